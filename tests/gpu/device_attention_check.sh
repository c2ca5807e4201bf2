#!/usr/bin/env bash
# Builds the CUDA attention kernels and their ops on a bare GPU machine whose python3 has torch
# (and CUDA) but perhaps no GoogleTest, Boost or libuv, then runs their GPU tests: the C++ gpu
# tests of the attention kernels (test_attention_cuda) and `pytest -m gpu` over
# tests/python/test_attention_*.py.
#   MEMBAR_SWEEP=1       also builds the sweep module (kernels/sweep/, membar_attention_sweep) and
#                        runs tests/python/test_attention_wgmma_backward.py (the experimental
#                        layout) and bench/attention_sweep.py
#   MEMBAR_SKIP_TESTS=1  skips the gtest and pytest runs (with MEMBAR_SWEEP=1: the sweep only)
#   MEMBAR_BENCH=1       also runs bench/attention_bench.py (MEMBAR_BENCH_ARGS for its arguments)
#   MEMBAR_CUDA_ARCHS    architectures to build (default 90a)
# GoogleTest: the installed one, else GOOGLETEST_SOURCE_DIR, else the copy in .deps/bundle.tgz
# (tools/make_gpu_deps.sh).
# Usage: tests/gpu/device_attention_check.sh OUT_DIR [GOOGLETEST_SOURCE_DIR]
# Logs (build with ptxas registers and spills, gtest, pytest, sweep and bench results) land in OUT_DIR.
set -uo pipefail
out=${1:?usage: device_attention_check.sh OUT_DIR [GOOGLETEST_SOURCE_DIR]}
gtest_src=${2:-}
root=$(cd "$(dirname "$0")/../.." && pwd)
jobs=$(nproc)
archs=${MEMBAR_CUDA_ARCHS:-90a}
mkdir -p "$out"
log() { printf '[attention-check %s] %s\n' "$(date +%H:%M:%S)" "$*"; }

if [ -z "$gtest_src" ] && ! { [ -d /usr/include/gtest ] || [ -d /usr/local/include/gtest ]; } && [ -f "$root/.deps/bundle.tgz" ]; then
  mkdir -p /tmp/membar-gtest-src && tar xzf "$root/.deps/bundle.tgz" -C /tmp/membar-gtest-src
  gtest_src=/tmp/membar-gtest-src/src/googletest
fi
prefix_args=()
if [ -n "$gtest_src" ]; then
  cmake -S "$gtest_src" -B /tmp/membar-gtest-build -G Ninja -DCMAKE_BUILD_TYPE=Release -DBUILD_GMOCK=OFF \
    -DCMAKE_INSTALL_PREFIX=/tmp/membar-gtest >/dev/null && cmake --build /tmp/membar-gtest-build --target install -j "$jobs" >/dev/null
  prefix_args=(-DCMAKE_PREFIX_PATH=/tmp/membar-gtest)
fi
# The distribution's compiler where there is one (tools/gpu_check.sh says why).
if [ -z "${CXX:-}" ] && [ -x /usr/bin/g++ ]; then
  export CC=/usr/bin/gcc CXX=/usr/bin/g++ CUDAHOSTCXX=/usr/bin/g++
fi

log "configure + build (CUDA ${archs})"
"$root/tests/gpu/isolated_source.sh" /tmp/membar-src
cmake -S /tmp/membar-src -B /tmp/membar-build -G Ninja -DCMAKE_BUILD_TYPE=Release -DMEMBAR_WITH_CUDA=ON \
  -DMEMBAR_CUDA_ARCHS="$archs" -DMEMBAR_PYTHON=python3 "${prefix_args[@]}" >/tmp/membar-configure.log 2>&1 \
  || { tail -30 /tmp/membar-configure.log; exit 1; }
targets=(membar_C test_attention_cuda)
[ "${MEMBAR_SWEEP:-0}" = 1 ] && targets+=(membar_attention_sweep)
cmake --build /tmp/membar-build -j "$jobs" --target "${targets[@]}" >"$out/build.log" 2>&1 \
  || { grep -E "error" "$out/build.log" | head -30; exit 1; }
grep -E "Compiling entry|registers|spill" "$out/build.log" >"$out/ptxas.txt"
log "kernels with spills (none expected outside the sweep's contenders):"
grep -B2 "[1-9][0-9]* bytes spill stores" "$out/ptxas.txt" | grep -o "_Z[A-Za-z0-9_]*" | sort -u | c++filt | grep -v "sweep::" || echo "  none"

status=0
export PYTHONPATH=/tmp/membar-src/bindings/python MEMBAR_BUILD_DIR=/tmp/membar-build
if [ "${MEMBAR_SKIP_TESTS:-0}" != 1 ]; then
  log "C++ gpu tests (test_attention_cuda)"
  timeout 300 /tmp/membar-build/bin/test_attention_cuda >"$out/gtest.log" 2>&1 || status=1
  grep -E "^\[  (FAILED|PASSED) |Failure" "$out/gtest.log" | head -40
  log "pytest -m gpu tests/python/test_attention_*.py"
  (cd /tmp/membar-src && timeout 420 python3 -m pytest -v -m gpu -p faulthandler -p no:cacheprovider \
     tests/python/test_attention_*.py >"$out/pytest.log" 2>&1) || status=1
  grep -E "PASSED|FAILED|ERROR|SKIPPED|Fatal|passed|failed" "$out/pytest.log" | tail -60
fi
if [ "${MEMBAR_SWEEP:-0}" = 1 ]; then
  log "experimental layout against the reference (test_attention_wgmma_backward.py)"
  (cd /tmp/membar-src && timeout 300 python3 -m pytest -v -s -m gpu -p no:cacheprovider \
     tests/python/test_attention_wgmma_backward.py >"$out/wgmma_backward.log" 2>&1) || status=1
  grep -E "PASSED|FAILED|ERROR|SKIPPED|timing|passed|failed" "$out/wgmma_backward.log" | tail -12
  log "bench/attention_sweep.py"
  MEMBAR_RESULTS_DIR="$out" timeout 420 python3 /tmp/membar-src/bench/attention_sweep.py ${MEMBAR_SWEEP_ARGS:-} \
    2>&1 | tee "$out/sweep.log" | tail -60 || status=1
fi
if [ "${MEMBAR_BENCH:-0}" = 1 ]; then
  log "bench/attention_bench.py"
  MEMBAR_RESULTS_DIR="$out" timeout 300 python3 /tmp/membar-src/bench/attention_bench.py ${MEMBAR_BENCH_ARGS:-} 2>&1 \
    | tee "$out/bench.log" | tail -40
fi
log "done (status $status)"
exit $status
