# The two commands a newcomer needs (README): `make demo` and `make test`.
# Each installs what is missing (tools/setup.sh), builds, then runs.
# On a GPU machine: `make gpu-check` (machine's own python3 + torch, no downloads).

PYTHON ?= $(CURDIR)/.venv/bin/python
BUILD ?= build
JOBS ?= 2
GENERATOR := $(shell command -v ninja >/dev/null 2>&1 && echo "-G Ninja")
CMAKE_FLAGS ?=

.PHONY: all setup build test test-cpp test-python demo gpu-check clean

all: build

setup:
	@tools/setup.sh

$(BUILD)/CMakeCache.txt:
	cmake -S . -B $(BUILD) $(GENERATOR) -DMEMBAR_PYTHON=$(PYTHON) $(CMAKE_FLAGS)

build: setup $(BUILD)/CMakeCache.txt
	cmake --build $(BUILD) -j $(JOBS)

test: build
	@tools/run_tests.sh $(BUILD) $(PYTHON)

demo: build
	PYTHONPATH=$(CURDIR)/bindings/python $(PYTHON) -m membar.train --demo

# GPU machine: build with CUDA into build-gpu, run the gpu-labelled tests and the benchmarks,
# write results under $${OUT:-bench/results/latest}.
gpu-check:
	@tools/gpu_check.sh

clean:
	rm -rf $(BUILD) build-gpu
