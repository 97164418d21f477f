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

test: $(BUILT)
	$(PY) -m pytest -q $(PYTEST_ARGS)

demo: $(BUILT)
	$(PY) examples/resnet_demo.py

bench: $(BUILT)
	$(PY) benchmarks/bench_resnet50.py

# Compile-only check of the CUDA registration (nvcc must be on PATH).
cuda-check: $(DEPS)
	FXFUSE_CUDA=1 $(PY) setup.py build_ext --build-temp build/cuda-check --build-lib build/cuda-check-lib

clean:
	rm -rf build *.egg-info fxfuse/_C*.so $(BUILT)
