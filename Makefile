# Two commands on a fresh machine: `make demo` and `make test`. Each sets up .venv and builds
# fxfuse._C: `make demo` installs only what the demo needs (requirements-demo.txt: pinned torch and
# torchvision, tabulate, the build tools), `make test` adds the test dependencies (requirements-dev.txt).
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
DEMO_DEPS := $(VENV)/.demo-deps-installed
DEPS   := $(VENV)/.deps-installed
BUILT  := $(VENV)/.fxfuse-built
CSRC   := $(shell find fxfuse/csrc -name '*.cpp' -o -name '*.h' -o -name '*.cu')
# make test runs pytest-xdist with one worker per core (PYTEST_ARGS="-n 0" runs it in one process), each
# test module on one worker, the slowest modules first (tests/conftest.py's SLOWEST_FIRST).
PYTEST_XDIST ?= -n 2 --dist loadscope --no-loadscope-reorder
PYTEST_ARGS ?=
# make test prepares in parallel what does not depend on each other (the test dependencies' pip, the C++
# build, cuda-check's nvcc, lint): SETUP_JOBS=1 to run one at a time.
SETUP_JOBS ?= 2

.PHONY: all setup build test test-ready zoo zoo-coverage lint demo bench bench-compile install-check cuda-check cuda-build gpu-check clean

all: test

# The venv takes ~6 GB (torch's CUDA wheel) and nvcc writes its temporaries to TMPDIR: a full disk
# otherwise shows up later as a compiler's "No space left on device".
NEED_GB ?= 8
$(PY):
	@for d in . "$${TMPDIR:-/tmp}"; do \
	  free=$$(df -Pk "$$d" | awk 'NR==2 {print int($$4 / 1048576)}'); \
	  [ "$$free" -ge $(NEED_GB) ] || echo "warning: $$free GB free in $$d; set-up needs ~$(NEED_GB) GB"; \
	done
	$(PYTHON) -m venv $(VENV)

# What make prints stays within 100 columns: pip's version check off through its environment, and the
# editable build's warning about a package folder in the working directory (the checkout is that folder).
export PIP_DISABLE_PIP_VERSION_CHECK := 1
# pip -qq prints errors only: a pip config that lists extra package indexes gets a warning line (over
# 100 columns) for each package that an index lacks.
PIP := $(PY) -m pip install -qq
# pip compiles what it installs to bytecode one file after the other (torch's ~6,000 .py files: ~25
# CPU-seconds); compileall on every core instead. Like pip's, it leaves files that do not compile
# (a test file in Python 3.12 syntax) to import from source. .venv/lib holds only site-packages.
$(DEMO_DEPS): requirements-demo.txt | $(PY)
	$(PIP) --upgrade pip
	$(PIP) --no-compile -r requirements-demo.txt
	$(PY) -m compileall -qq -j 0 $(VENV)/lib || true
	touch $@

$(DEPS): requirements-dev.txt $(DEMO_DEPS)
	$(PIP) --no-compile -r requirements-dev.txt
	$(PY) -m compileall -qq -j 0 $(VENV)/lib || true
	touch $@

# FXFUSE_CUDA=0: the development build is CPU-only, so that make demo and make test stay fast on 2 cores
# (cuda-check compiles the CUDA kernels anyway). `make build FXFUSE_CUDA=` lets setup.py decide (CUDA
# torch + nvcc: on). ninja compiles the units in parallel (MAX_JOBS=N to change how many at once).
FXFUSE_CUDA ?= 0
$(BUILT): $(DEMO_DEPS) $(CSRC) setup.py pyproject.toml fxfuse/_cuda_build.py
	@echo "pip install -e . (FXFUSE_CUDA=$(FXFUSE_CUDA), no build isolation: compiles fxfuse._C)"
	@FXFUSE_CUDA=$(FXFUSE_CUDA) PYTHONWARNINGS=ignore $(PIP) --no-build-isolation --no-deps -e .
	touch $@

setup: $(DEPS)

build: $(BUILT)

test:
	$(MAKE) --no-print-directory -j$(SETUP_JOBS) --output-sync=target test-ready
	$(PY) -m pytest -q $(PYTEST_XDIST) $(PYTEST_ARGS)

test-ready: $(BUILT) $(DEPS) cuda-check lint

# Every file with tests marked `zoo`, whole: the model zoos (tests/support/timm_zoo.py, dense_zoo.py,
# wild_zoo.py), every accuracy draw (tests/test_accuracy.py), the budget sweeps, the op tests rerun under
# the CPU capabilities other than DEFAULT. `make test` runs only their representative part; -m "" lifts
# the default `-m 'not zoo'` from pyproject's addopts.
ZOO_FILES := $(shell grep -l 'pytest.mark.zoo' tests/test_*.py)
zoo: $(BUILT) $(DEPS)
	$(PY) -m pytest -q -m "" $(ZOO_FILES) $(PYTEST_ARGS)

# The timm zoo coverage table of docs/results.md.
zoo-coverage: $(BUILT) $(DEPS)
	$(PY) benchmarks/zoo_coverage.py

# ruff (configured in pyproject.toml): lint rules and the formatter's style; ruff format also checks
# the python code blocks of every Markdown file (README.md, CHANGELOG.md, docs/*.md). lint-imports
# (import-linter, contracts in pyproject.toml): the layers of docs/design.md, so that a back-edge fails.
lint: $(DEPS)
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .
	$(VENV)/bin/lint-imports

demo: $(BUILT)
	$(PY) examples/resnet_demo.py

bench: $(BUILT)
	$(PY) benchmarks/bench_resnet50.py

# torch.compile vs torch.compile(fxfuse.optimize(model)), ResNet-50 batch 8, channels_last (docs/results.md "torch.compile").
bench-compile: $(BUILT)
	$(PY) -m fxfuse bench torchvision:resnet50 --input-shape 8,3,224,224 --modes memory \
		--with compile,compile-fxfuse,compile-fxfuse-composed

# A user's install: fresh venv, torch first, `pip wheel --no-build-isolation .`, the wheel's
# fxfuse/_C*.so imported and the demo run outside the checkout (slow: one more C++ build).
install-check:
	tools/check_install.sh

# Compile-only check of the CUDA kernels (csrc/cuda/*.cu), run by `make test` so that they
# cannot rot: nvcc -c with torch's CUDAExtension flags for one architecture, into
# build/cuda-check (needs nvcc, no GPU; never touches fxfuse/_C*.so; skips what is up to date).
CUDA_CHECK_ARCH ?= 9.0
cuda-check: $(DEMO_DEPS)
	CUDA_CHECK_ARCH="$(CUDA_CHECK_ARCH)" $(PY) tools/compile_cuda.py

# The full FXFUSE_CUDA=1 extension (C++ and CUDA) into build/cuda-build*, then a check in a
# fresh process that it loads and registers its CUDA and AutocastCUDA kernels. Slow on 2 cores.
cuda-build: $(DEPS)
	TORCH_CUDA_ARCH_LIST="$(CUDA_CHECK_ARCH)" FXFUSE_CUDA=1 $(PY) setup.py build_ext --build-temp build/cuda-build --build-lib build/cuda-build-lib
	$(PY) tools/check_cuda_build.py

# Everything a GPU run needs (CUDA build, tests/test_cuda.py, float64 exactness on CUDA, autocast, kernel
# GB/s, ResNet-50/EfficientNet-B0 steps, speed, frontier, fit, bench with --fit-cap), logs and JSON into
# GPU_OUT; GPU_PHASES picks phases (e.g. "build tests speed:200"). Runs with the python that has CUDA torch
# (PYTHON=...); on a machine without a GPU it stops at once with one line.
GPU_OUT ?= gpu-check-out
GPU_PHASES ?=
gpu-check:
	PYTHON="$(if $(wildcard $(PY)),$(PY),$(PYTHON))" tools/gpu_check.sh $(GPU_OUT) $(GPU_PHASES)

clean:
	rm -rf build *.egg-info fxfuse/_C*.so $(BUILT)
