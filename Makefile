# Two commands on a fresh machine: `make demo` and `make test`. Each sets up
# .venv (pinned torch/torchvision from requirements-dev.txt) and builds fxfuse._C.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
DEPS   := $(VENV)/.deps-installed
BUILT  := $(VENV)/.fxfuse-built
CSRC   := $(shell find fxfuse/csrc -name '*.cpp' -o -name '*.h' -o -name '*.cu')
PYTEST_ARGS ?=

.PHONY: all setup build test demo bench cuda-check clean

all: test

$(PY):
	$(PYTHON) -m venv $(VENV)

$(DEPS): requirements-dev.txt | $(PY)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -r requirements-dev.txt
	touch $@

$(BUILT): $(DEPS) $(CSRC) setup.py pyproject.toml
	$(PY) -m pip install --quiet --no-build-isolation --no-deps -e .
	touch $@

setup: $(DEPS)

build: $(BUILT)

test: $(BUILT) cuda-check
	$(PY) -m pytest -q $(PYTEST_ARGS)

demo: $(BUILT)
	$(PY) examples/resnet_demo.py

bench: $(BUILT)
	$(PY) benchmarks/bench_resnet50.py

# Compile-only check of the CUDA registration, run by `make test` so that it cannot rot
# (nvcc must be on PATH or in CUDA_HOME; no GPU needed): a full FXFUSE_CUDA=1 build into
# build/cuda-check*, never replacing fxfuse/_C*.so. One GPU architecture keeps it quick;
# ninja recompiles only what changed since the last check.
CUDA_CHECK_ARCH ?= 9.0
cuda-check: $(DEPS)
	TORCH_CUDA_ARCH_LIST="$(CUDA_CHECK_ARCH)" FXFUSE_CUDA=1 $(PY) setup.py build_ext --build-temp build/cuda-check --build-lib build/cuda-check-lib
	$(PY) tools/check_cuda_build.py

clean:
	rm -rf build *.egg-info fxfuse/_C*.so $(BUILT)
