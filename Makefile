# Two commands a new user needs: `make train` and `make test`. Each creates .venv on first use.
# `make lint` runs the checks CI runs before the tests (ruff lint + format check, mypy).
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
NPROC  ?= 2
ARGS   ?=

NETARGS ?=

.PHONY: venv check-env lock train test test-scale test-gpu lint bench bench-gpu bench-network clean

# The environment is built from requirements/<flavour>.lock (every package pinned; see scripts/setup_env.sh).
venv:
	@PYTHON=$(PYTHON) bash scripts/setup_env.sh $(VENV)

# Fails, naming each package, unless .venv holds exactly its lock file's packages (CI runs it).
check-env: venv
	@$(PY) scripts/env_lock.py check requirements/$$(cut -d' ' -f1 $(VENV)/.dlrm-compress-stack).lock

# Re-resolve both lock files (a deliberate upgrade: commit them and run the whole suite on them).
lock: venv
	@$(PY) scripts/env_lock.py refresh

# The embedded default: 2 ranks on the bundled real Criteo rows, lossy compression, dual policy.
train: venv
	@OMP_NUM_THREADS=1 $(VENV)/bin/torchrun --standalone --nproc_per_node $(NPROC) -m dlrm.train $(ARGS)

test: venv
	@$(PY) -m pytest -q $(ARGS)

# The scale suite (marker scale; `make test` leaves it out): the trainer and the all-to-alls at 3 and
# 4 ranks (none against stock TorchRec for every sharding, bounds, dense_comm, auto, hot rows, the
# row cache, resume), two emulated nodes, and the slowest multi-rank variants. CI runs both.
test-scale: venv
	@$(PY) -m pytest -q -m scale $(ARGS)

# The GPU suite (tests/gpu, marker gpu; `make test` leaves it out): codecs and kernels on CUDA against
# the CPU, host syncs under CUDA's sync debug mode, codec GB/s beside the CPU's, the trainer on NCCL.
# Without CUDA every test skips, saying so. -rA prints the figures the tests measure.
test-gpu: venv
	@$(PY) -m pytest -m gpu tests/gpu -rA $(ARGS)

# ruff (lint, then format check) and mypy, configured in pyproject.toml; all three run, any failure fails.
lint: venv
	@rc=0; \
	 $(VENV)/bin/ruff check . || rc=1; \
	 $(VENV)/bin/ruff format --check . || rc=1; \
	 $(VENV)/bin/mypy || rc=1; \
	 exit $$rc

# Codec benchmark, then (as root, which the network namespace needs) the emulated-link benchmark.
bench: venv
	@$(PY) -m dlrm.bench.codec $(ARGS)
	@if [ "$$(id -u)" = 0 ]; then bash scripts/bench_network.sh $(NETARGS); \
	 else echo "network benchmark skipped: needs root (sudo make bench-network)"; fi

# One compressed collective's codec work on a GPU against the raw bytes' wire time (launches and host
# syncs counted on CPU; on a machine without CUDA those counts alone): docs/gpu.md.
bench-gpu: venv
	@$(PY) -m dlrm.bench.gpu_collective $(ARGS)

bench-network: venv
	@bash scripts/bench_network.sh $(NETARGS)

clean:
	rm -rf outputs multirun runs .pytest_cache .mypy_cache .ruff_cache
