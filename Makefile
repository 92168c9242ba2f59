# Two commands a new user needs: `make train` and `make test`. Each creates .venv on first use.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
NPROC  ?= 2
ARGS   ?=

NETARGS ?=

.PHONY: venv train test bench bench-network clean

venv:
	@PYTHON=$(PYTHON) bash scripts/setup_env.sh $(VENV)

# The embedded default: 2 ranks on the bundled real Criteo rows, lossy compression, dual policy.
train: venv
	@OMP_NUM_THREADS=1 $(VENV)/bin/torchrun --standalone --nproc_per_node $(NPROC) -m dlrm.train $(ARGS)

test: venv
	@$(PY) -m pytest -q $(ARGS)

# Codec benchmark, then (as root, which the network namespace needs) the emulated-link benchmark.
bench: venv
	@$(PY) -m compression.bench $(ARGS)
	@if [ "$$(id -u)" = 0 ]; then bash scripts/bench_network.sh $(NETARGS); \
	 else echo "network benchmark skipped: needs root (sudo make bench-network)"; fi

bench-network: venv
	@bash scripts/bench_network.sh $(NETARGS)

clean:
	rm -rf outputs multirun runs .pytest_cache
