# grpoflow: `make run` runs the pipeline on the embedded default, `make test` runs the tests.
# Both create .venv and install what they need on first use.

PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# torch first and on its own: a bare `torch` requirement can resolve to a multi-GB CUDA build on a CPU
# machine. GPU users: `make install TORCH_SPEC="torch==<the version your vLLM wants>"` or install torch yourself.
TORCH_SPEC ?= torch==2.13.0
STAMP := $(VENV)/.grpoflow-installed
CONFIG ?= configs/tiny-cpu.yaml

.PHONY: install run test bench lint clean-state

$(STAMP): pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q "$(TORCH_SPEC)"
	$(PY) -m pip install -q -e ".[dev]"
	@touch $(STAMP)

install: $(STAMP)

run: $(STAMP)
	$(VENV)/bin/grpoflow run --config $(CONFIG) $(ARGS)

test: $(STAMP)
	$(PY) -m pytest -m "not bench" tests $(ARGS)

bench: $(STAMP)
	$(PY) -m pytest -m bench tests/benchmarks -s $(ARGS)

lint: $(STAMP)
	$(VENV)/bin/ruff check .

clean-state:
	rm -rf .state
