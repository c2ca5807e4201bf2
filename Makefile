# The two commands a newcomer needs (README): `make demo` and `make test`.
# Each installs what is missing (tools/setup.sh), builds, then runs.
# On a GPU machine: `make gpu-check` (machine's own python3 + torch, no downloads).

PYTHON ?= $(CURDIR)/.venv/bin/python
BUILD ?= build
JOBS ?= 2
GENERATOR := $(shell command -v ninja >/dev/null 2>&1 && echo "-G Ninja")
CMAKE_FLAGS ?=

.PHONY: all setup build cuda-compile-check test demo docs gpu-check clean

all: build

setup:
	@tools/setup.sh

$(BUILD)/CMakeCache.txt:
	cmake -S . -B $(BUILD) $(GENERATOR) -DMEMBAR_PYTHON=$(PYTHON) $(CMAKE_FLAGS)

build: setup $(BUILD)/CMakeCache.txt
	cmake --build $(BUILD) -j $(JOBS)

test: build cuda-compile-check
	@tools/run_tests.sh $(BUILD) $(PYTHON)

# Where nvcc exists but no GPU does (CI), the CUDA kernels, the CUDA VMM backend and the CUDA
# client compile for sm_90a, and their GPU-free unit tests (driver table error paths) run.
cuda-compile-check:
	@if command -v nvcc >/dev/null 2>&1 || [ -x /usr/local/cuda/bin/nvcc ]; then \
	  PATH=$$PATH:/usr/local/cuda/bin; \
	  cmake -S . -B $(BUILD)-cuda $(GENERATOR) -DMEMBAR_WITH_CUDA=ON -DMEMBAR_WITH_TORCH=OFF \
	      -DMEMBAR_CUDA_ARCHS=90a >/dev/null && \
	  cmake --build $(BUILD)-cuda -j $(JOBS) --target membar_kernels membar_client test_cuda_driver_api test_cuda_copy_plan && \
	  ctest --test-dir $(BUILD)-cuda -L unit -R 'CudaDriverApi|CopyPlan' --output-on-failure; \
	else echo "[cuda-compile-check] no nvcc: skipped"; fi

demo: build
	@PYTHON=$(PYTHON) CMAKE_FLAGS="$(CMAKE_FLAGS)" tools/demo.sh

# The Python API reference (pdoc), from the docstrings: docs/api/index.html.
docs: build
	@$(PYTHON) tools/api_docs.py --out docs/api

# GPU machine: build with CUDA into build-gpu, run the gpu-labelled tests and the benchmarks,
# write results under $${OUT:-bench/results/latest}.
gpu-check:
	@tools/gpu_check.sh

clean:
	rm -rf $(BUILD) $(BUILD)-cuda build-gpu build-demo-gpu
