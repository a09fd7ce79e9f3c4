# Fresh machine: `make demo` (the main job) or `make test` (all tests); both run `make setup` first.
PY ?= python3.11
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.setup-done
# pip arguments for torch (e.g. "torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu"). On a GPU box
# with torch already in the image: make setup TORCH_SPEC= (the venv then sees the image's site-packages)
TORCH_SPEC ?= torch==2.13.0
PYTEST_ARGS ?=

.PHONY: setup test test-fast test-gpu demo clean

setup: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(if $(TORCH_SPEC),,--system-site-packages) $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	# torch first: installing megatron-core without torch pulls a multi-GB CUDA build
	if [ -n "$(TORCH_SPEC)" ]; then $(BIN)/python -m pip install -q $(TORCH_SPEC); fi
	$(BIN)/python -m pip install -q -e ".[test]"
	$(BIN)/python -c "import torch, megatron.core; print('torch', torch.__version__, '| megatron-core', megatron.core.__version__)"
	touch $(STAMP)

# Test processes run side by side (pytest-xdist); default: one per core, at most 4. Each test file
# runs in one process (--dist loadfile): a module's tests share its launches and fixtures.
TEST_WORKERS ?= $(shell n=$$(nproc 2>/dev/null || echo 2); [ $$n -gt 4 ] && n=4; echo $$n)
XDIST := -n $(TEST_WORKERS) --dist loadfile
# pytest exits 5 when a selection holds no test (e.g. PYTEST_ARGS="-k ..." that misses one phase)
OK5 := || [ $$? -eq 5 ]

# Every CPU test (CI's command); tests marked gpu skip without CUDA. The tests that compare wall
# times (marker serial) run alone first, then the rest side by side.
test: setup
	OMP_NUM_THREADS=1 $(BIN)/python -m pytest tests -m serial $(PYTEST_ARGS) $(OK5)
	OMP_NUM_THREADS=1 $(BIN)/python -m pytest tests $(XDIST) -m "not serial" $(PYTEST_ARGS) $(OK5)

# The quick subset (under 3 minutes on 2 cores): single-process library logic and the Megatron /
# trainer integration, without the tests marked slow; no Triton interpreter, no multi-rank runs.
test-fast: setup
	OMP_NUM_THREADS=1 $(BIN)/python -m pytest tests $(XDIST) -m "(unit or integration) and not slow" $(PYTEST_ARGS)

# On a CUDA machine: the GPU kernel checks and the NCCL ring checks (the latter need 2 or 4 GPUs).
test-gpu: setup
	$(BIN)/python -m pytest tests -m gpu $(XDIST) $(PYTEST_ARGS)

demo: setup
	PYTHON=$(BIN)/python bash examples/run_demo.sh

clean:
	rm -rf $(VENV) .pytest_cache
