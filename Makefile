# mpext: the two commands a fresh machine needs are `make test` and `make bench`.
#
#   make test                      build everything needed, run the whole test suite
#                                  (cuda-emu, then pytest: `make pytest` runs pytest alone)
#   make bench [BENCH_ARGS=--quick] build, run the benchmark against native PyTorch AMP
#   make gpu-check OUT=dir         on a GPU machine without network: build with CUDA, run the
#                                  CUDA tests and the GPU benchmark, results in dir (docs/gpu_check.md)
#
# By default a virtual environment .venv is created with $(TORCH_SPEC) and the test/bench
# dependencies. To use an environment that already has PyTorch (e.g. a CUDA machine):
#   make test PYTHON=/path/to/python
# Other knobs: TORCH_SPEC (pip requirement for torch), PYTEST_ARGS, TEST_WORKERS (the suite's
# pytest-xdist processes, default 2; 0 runs it in one), MPEXT_FORCE_CUDA=0|1,
# TORCH_CUDA_ARCH_LIST, NVCC, MPEXT_FAST_PATHS=0 (the C core without its fast paths:
# csrc/core/fast/README.md), MPEXT_OPT_LEVEL (-O level of every unit, default 3:
# build_tools/core.py).

SHELL := /bin/bash
VENV ?= .venv
TORCH_SPEC ?= torch==2.13.0
NVCC ?= nvcc
PYTEST_ARGS ?=
TEST_WORKERS ?= 2
BENCH_ARGS ?=
# lion-pytorch: the tests' Lion reference (tests/test_lion.py, the rules x formats table's Lion
# row), so it is a test dependency; bench_adam's native Lion too (BENCH_DEPS)
TEST_DEPS := pytest 'pytest-xdist>=3.5,<4' numpy hypothesis 'lightning>=2.6,<2.7' 'accelerate>=1.15,<1.16' 'transformers>=5,<6' lion-pytorch==0.2.5
BENCH_DEPS := matplotlib tqdm lion-pytorch==0.2.5
BUILD_DEPS := ninja setuptools wheel

ifdef PYTHON
PY := $(PYTHON)
ENV_TARGET := env-external
else
PY := $(VENV)/bin/python
ENV_TARGET := $(VENV)/.stamp venv-path
endif

# Run everything from the source tree: the extension is built in place (mpext/_C*.so).
export PYTHONPATH := $(CURDIR)$(if $(PYTHONPATH),:$(PYTHONPATH))

.PHONY: test pytest bench build env env-external venv-path build-force ctest ctest-valgrind \
	ctest-nofast cuda-check cuda-emu \
	gpu-check clean

test: build cuda-emu
	$(PYTEST)

# The pytest suite alone (make test without cuda-emu; .ci/run runs cuda-emu beside the build), in
# TEST_WORKERS processes (pytest-xdist: every test still runs, once; a test module's tests all
# run in one worker, so that a module-scoped fixture, such as test_distributed's multi-rank runs,
# is computed once; the test marked exclusive runs alone: tests/conftest.py; the modules that
# take longest start first, --no-loadscope-reorder keeping conftest.py's order), or in one
# process where the environment has no xdist.
PYTEST = $(PY) -m pytest tests $$($(PY) -c "import xdist" 2>/dev/null && echo "-n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder") \
	$(PYTEST_ARGS)
pytest: build
	$(PYTEST)

bench: build
	$(PY) -m benchmarks.run_all $(BENCH_ARGS)

env: $(ENV_TARGET)

# Remade when the Makefile changes, so that a dependency added here reaches an existing .venv.
# --no-compile: pip would byte-compile every module of torch and the test packages (26 s of CPU
# for torch alone, 10 s without); Python compiles what is imported, once, on first import.
$(VENV)/.stamp: Makefile
	python3 -m venv $(VENV)
	$(VENV)/bin/pip install -q --no-compile --upgrade $(BUILD_DEPS)
	$(VENV)/bin/pip install -q --no-compile "$(TORCH_SPEC)"
	$(VENV)/bin/pip install -q --no-compile $(TEST_DEPS) $(BENCH_DEPS)
	touch $@

# The checkout on the import path of the Makefile's own .venv (a .pth file in its site-packages):
# `.venv/bin/python` then imports mpext, built in place, from any directory, with no second
# compile and no PYTHONPATH. (An environment given with PYTHON= is left as it is.)
venv-path: $(VENV)/.stamp
	@$(VENV)/bin/python -c "import os, sys, sysconfig; \
	  open(os.path.join(sysconfig.get_path('purelib'), 'mpext-checkout.pth'), 'w').write(sys.argv[1] + '\n')" \
	  "$(CURDIR)"

# An environment given with PYTHON=: it must have torch; missing helpers are installed if the
# package index is reachable, and otherwise the tests that need them skip.
env-external:
	@$(PY) -c "import torch" 2>/dev/null || { echo "PYTHON=$(PY) has no torch: install PyTorch into it first" >&2; exit 1; }
	@$(PY) -c "import pytest" 2>/dev/null || $(PY) -m pip install -q pytest
	@for m in numpy hypothesis matplotlib tqdm lion_pytorch ninja lightning accelerate transformers \
	  xdist=pytest-xdist; do \
	  $(PY) -c "import $${m%%=*}" 2>/dev/null || $(PY) -m pip install -q $${m#*=} 2>/dev/null || \
	  echo "note: $${m#*=} is not installed and could not be; what needs it is skipped"; done

# Incremental (ninja) in-place build of mpext._C against the environment's torch. setup.py and
# the build_info print each start Python and import torch (seconds), so they run only when the
# stamp is out of date: a build source newer than it, a new environment, no mpext/_C*.so, or
# another BUILD_KEY (the interpreter and the environment knobs setup.py reads). A no-op build
# prints the build_info stored by the last real one.
BUILD_STAMP := build/.stamp-build
BUILD_INFO := build/build_info.txt
BUILD_SOURCES := setup.py $(wildcard build_tools/*.py) $(shell find csrc cuda -type f)
BUILD_KEY := $(PY) $(MPEXT_FORCE_CUDA) $(TORCH_CUDA_ARCH_LIST) $(CUDA_HOME) $(NVCC) $(CC) $(CXX) \
	$(if $(MPEXT_FAST_PATHS),fast=$(MPEXT_FAST_PATHS)) $(if $(MPEXT_OPT_LEVEL),opt=$(MPEXT_OPT_LEVEL))
BUILD_FORCE := $(if $(and $(wildcard mpext/_C*.so),$(wildcard $(BUILD_INFO))),,build-force)
ifneq ($(strip $(BUILD_KEY)),$(strip $(shell cat $(BUILD_STAMP) 2>/dev/null)))
BUILD_FORCE := build-force
endif

build: env $(BUILD_STAMP)
	@cat $(BUILD_INFO)

# The stamp takes the time the build began, so that a source edited during the build is newer.
$(BUILD_STAMP): $(BUILD_SOURCES) $(if $(PYTHON),,$(VENV)/.stamp) $(BUILD_FORCE)
	@mkdir -p build && touch $@.began
	$(PY) setup.py -q build_ext --inplace
	@$(PY) -c "import mpext, json; print('mpext build:', json.dumps(mpext.build_info()))" \
	  > $(BUILD_INFO)
	@echo '$(strip $(BUILD_KEY))' > $@ && touch -r $@.began $@ && rm $@.began

build-force:

# The C core's own tests under AddressSanitizer + UndefinedBehaviorSanitizer (no torch needed):
# every tests/c/test_*.c a binary of its own, run CPU-count at a time. Its sanitized core objects
# (build/core/asan-ubsan) are the ones cuda-emu links: compiled once.
ctest:
	python3 tests/c/run.py

ctest-valgrind:
	python3 tests/c/run.py --no-sanitize --valgrind

# The step's C tests (tests/c/test_step*.c, test_fast_paths.c) on a core built without its fast
# paths (csrc/core/fast/README.md): the step's pipeline alone must pass every one; the other
# tests never call the step, the only code that changes. Only step.c is compiled again (its
# objects beside the others', which are shared with ctest). CTEST_NOFAST_ARGS go to the test
# binaries (CI passes --isa best).
CTEST_NOFAST_ARGS ?=
ctest-nofast:
	python3 tests/c/run.py --no-fast-paths $(if $(strip $(CTEST_NOFAST_ARGS)),-- $(CTEST_NOFAST_ARGS))

# The CUDA kernels and launchers (cuda/*.cu) run on the CPU under ASan + UBSan and compared bit
# for bit with the C core (tests/cuda_emu/README.md); no GPU, CUDA runtime or torch needed.
cuda-emu:
	python3 tests/cuda_emu/run.py

# Every CUDA file compiled on its own by nvcc (no torch headers, no GPU needed), for sm_80 and
# sm_90, warnings as errors. Every phase still runs for both archs (the front end, cicc to PTX,
# ptxas to SASS, the host compile), in nvcc's fast-compile mode where it has one (-Ofc max, CUDA
# 12.8 on): the check asks whether the code compiles, not for fast SASS, and the device
# optimisers were nearly all of its time (cuda/step.cu for sm_80: 139 -> 8.7 s of CPU; the whole
# check ~290 -> 36 s). A planted error, an unused variable and an sm_90-only PTX instruction
# still fail it (docs/contributing.md, "CI").
cuda-check:
	@command -v $(NVCC) >/dev/null || { echo "cuda-check: $(NVCC) not found" >&2; exit 1; }
	@mkdir -p build/cuda-check
	@fast=$$($(NVCC) --help | grep -q -e '--Ofast-compile' && echo "-Ofc max"); \
	for f in cuda/*.cu; do \
	  echo "nvcc $$f (sm_80, sm_90) $$fast"; \
	  $(NVCC) -std=c++17 -O3 $$fast -Icsrc/include -Werror all-warnings -Xcompiler -Wall,-Wextra,-Wno-unknown-pragmas \
	    -gencode arch=compute_80,code=sm_80 -gencode arch=compute_90,code=sm_90 \
	    -c $$f -o build/cuda-check/$$(basename $$f .cu).o || exit 1; \
	done

# For a lent GPU machine (docs/gpu_check.md): no env step (it would call pip; there is no network
# there). The python is PYTHON, else .venv's if there is one, else python3.
GPU_PY := $(if $(PYTHON),$(PYTHON),$(if $(wildcard $(VENV)/bin/python),$(VENV)/bin/python,python3))
gpu-check:
	@test -n "$(OUT)" || { echo "usage: make gpu-check OUT=dir" >&2; exit 2; }
	$(GPU_PY) build_tools/gpu_check.py --out "$(OUT)" --python "$(GPU_PY)" $(GPU_CHECK_ARGS)

clean:
	rm -rf build mpext/_C*.so tests/c/build results
