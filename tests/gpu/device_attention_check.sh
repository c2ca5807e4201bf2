#!/usr/bin/env bash
# Builds and runs the CUDA attention kernels' GPU tests, Python GPU tests and benchmark on a bare
# GPU machine whose python3 has torch (and CUDA) but perhaps no GoogleTest, Boost or libuv.
# Usage: tests/gpu/device_attention_check.sh OUT_DIR [GOOGLETEST_SOURCE_DIR]
# Logs (build with ptxas register/spill report, SASS instruction counts, gtest, pytest, bench
# JSON + text) land in OUT_DIR.
set -uo pipefail
out=${1:?usage: device_attention_check.sh OUT_DIR [GOOGLETEST_SOURCE_DIR]}
gtest_src=${2:-}
root=$(cd "$(dirname "$0")/../.." && pwd)
jobs=$(nproc)
mkdir -p "$out"
prefix_args=()
if [ -n "$gtest_src" ]; then
  cmake -S "$gtest_src" -B /tmp/membar-gtest-build -G Ninja -DCMAKE_BUILD_TYPE=Release -DBUILD_GMOCK=OFF \
    -DCMAKE_INSTALL_PREFIX=/tmp/membar-gtest >/dev/null && cmake --build /tmp/membar-gtest-build --target install -j "$jobs" >/dev/null
  prefix_args=(-DCMAKE_PREFIX_PATH=/tmp/membar-gtest)
fi
"$root/tests/gpu/isolated_source.sh" /tmp/membar-src
cmake -S /tmp/membar-src -B /tmp/membar-build -G Ninja -DCMAKE_BUILD_TYPE=Release -DMEMBAR_WITH_CUDA=ON \
  -DMEMBAR_CUDA_ARCHS=90a -DMEMBAR_PYTHON=python3 "${prefix_args[@]}" >/tmp/membar-configure.log 2>&1 || { tail -30 /tmp/membar-configure.log; exit 1; }
cmake --build /tmp/membar-build -j "$jobs" --target membar_C test_attention_cuda >"$out/build.log" 2>&1 || { grep -E "error" "$out/build.log" | head -30; exit 1; }
grep -E "Compiling entry|registers|spill" "$out/build.log" | grep -B1 -A1 "attention\|registers" | sed -E 's/_ZN6membar[A-Za-z0-9_]*(paged_attention_[a-z_]*kernel|page_[a-z]*_kernel)/\1/' >"$out/ptxas.txt"
{
  echo "SASS instruction counts in the attention objects:"
  for object in /tmp/membar-build/kernels/CMakeFiles/membar_kernels.dir/cuda/attention_*.cu.o; do
    echo "$(basename "$object"): HMMA $(cuobjdump --dump-sass "$object" | grep -c HMMA), HGMMA $(cuobjdump --dump-sass "$object" | grep -c HGMMA), LDSM $(cuobjdump --dump-sass "$object" | grep -c LDSM), LDL $(cuobjdump --dump-sass "$object" | grep -c 'LDL')"
  done
} >>"$out/ptxas.txt" 2>&1
grep -A8 "SASS instruction" "$out/ptxas.txt"
status=0
timeout 240 /tmp/membar-build/bin/test_attention_cuda 2>&1 | tee "$out/gtest.log" | grep -E "^\[  (FAILED|PASSED) |Failure" | head -40 || status=1
grep -q "\[  PASSED  \]" "$out/gtest.log" && ! grep -q "\[  FAILED  \]" "$out/gtest.log" || status=1
cd /tmp/membar-src && PYTHONPATH=/tmp/membar-src/bindings/python timeout 240 python3 -m pytest -v -p faulthandler tests/python/test_attention_cuda.py >"$out/pytest.log" 2>&1 || status=1
grep -E "PASSED|FAILED|ERROR|Fatal|line [0-9]+ in test_|passed|failed" "$out/pytest.log" | tail -40
[ "${MEMBAR_SKIP_BENCH:-0}" = 1 ] || MEMBAR_RESULTS_DIR="$out" PYTHONPATH=/tmp/membar-src/bindings/python timeout 300 python3 /tmp/membar-src/bench/attention_bench.py ${MEMBAR_BENCH_ARGS:-} 2>&1 | tee "$out/bench.log" | tail -40
exit $status
