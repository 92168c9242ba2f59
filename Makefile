# Two commands a new user needs: `make train` and `make test`. Each creates .venv on first use.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
NPROC  ?= 2
ARGS   ?=

.PHONY: venv train test bench clean

venv:
	@PYTHON=$(PYTHON) bash scripts/setup_env.sh $(VENV)

# The embedded default: 2 ranks on the bundled real Criteo rows, lossy compression, dual policy.
train: venv
	@OMP_NUM_THREADS=1 $(VENV)/bin/torchrun --standalone --nproc_per_node $(NPROC) -m dlrm.train $(ARGS)

test: venv
	@$(PY) -m pytest -q $(ARGS)

bench: venv
	@$(PY) -m compression.bench $(ARGS)

clean:
	rm -rf outputs multirun runs .pytest_cache
