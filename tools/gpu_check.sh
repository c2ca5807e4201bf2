#!/usr/bin/env bash
# `make gpu-check`: on a GPU machine, build with CUDA (machine's own python3 + torch, no
# downloads), run the gpu-labelled tests and the benchmarks, and write results for bench/results/.
#
# Results go to $MEMBAR_RESULTS_DIR (default: $OUT when set, else bench/results/latest).
# Stages (GPU_CHECK_STAGES, space-separated; default all): build tests bench
# (GPU_CHECK_TARGETS, space-separated: build only these targets, e.g. "membard pipeline_bench")
# Benchmarks (GPU_CHECK_BENCH; default all but sweep): runtime pipeline attention logra oomb, and sweep
# (builds the attention kernels' sweep module and runs bench/attention_sweep.py); extra arguments for
# each Python benchmark in ATTENTION_BENCH_ARGS, LOGRA_BENCH_ARGS, OOMB_BENCH_ARGS (defaults: the
# full sweeps, which take far longer than one 10-minute device call).
# Where libuv/spdlog/boost/gtest are missing, they come from .deps/bundle.tgz
# (tools/make_gpu_deps.sh), built into /tmp/membar-deps.
set -uo pipefail
cd "$(dirname "$0")/.."
root=$PWD
py=${PYTHON:-python3}
# On the lent device machine only 8 files come back from $OUT: results are written elsewhere and
# packed into $OUT/gpu_check_results.tgz at the end.
results=${MEMBAR_RESULTS_DIR:-$([ -n "${OUT:-}" ] && echo /tmp/membar-results || echo "$root/bench/results/latest")}
stages=${GPU_CHECK_STAGES:-"build tests bench"}
benches=${GPU_CHECK_BENCH:-"runtime pipeline attention logra oomb"}
jobs=${JOBS:-$(nproc)}
mkdir -p "$results"
export MEMBAR_RESULTS_DIR=$results
log() { printf '[gpu-check %s] %s\n' "$(date +%H:%M:%S)" "$*"; }
has_stage() { [[ " $stages " == *" $1 "* ]]; }
has_bench() { [[ " $benches " == *" $1 "* ]]; }

{
  echo "date: $(date -u +%Y-%m-%dT%H:%M:%SZ)"
  echo "commit: ${MEMBAR_COMMIT:-$(git rev-parse HEAD 2>/dev/null || echo unknown)}"
  echo "host: $(hostname)"
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv,noheader 2>/dev/null | sed 's/^/gpu: /'
  echo "nvcc: $(nvcc --version 2>/dev/null | tail -1)"
  echo "torch: $($py -c 'import torch; print(torch.__version__)' 2>&1)"
  echo "cpus: $(nproc)  mem: $(free -g | awk '/Mem:/{print $2}') GiB"
} > "$results/machine.txt"
cat "$results/machine.txt"

deps_flags=()
if ! { [ -f /usr/include/uv.h ] && [ -d /usr/include/boost/interprocess ] && [ -d /usr/include/spdlog ] \
       && { [ -d /usr/include/gtest ] || [ -d /usr/local/include/gtest ]; }; }; then
  prefix=/tmp/membar-deps
  if [ ! -f "$prefix/.ok" ]; then
    log "building bundled dependencies into $prefix"
    [ -f .deps/bundle.tgz ] || { echo "missing .deps/bundle.tgz: run tools/make_gpu_deps.sh here and carry .deps"; exit 2; }
    rm -rf "$prefix" && mkdir -p "$prefix/src"
    tar xzf .deps/bundle.tgz -C "$prefix"
    (cd "$prefix/src" && tar xzf libuv1_*.orig.tar.gz && cd libuv1-* \
      && cmake -S . -B b -G Ninja -DCMAKE_BUILD_TYPE=Release -DCMAKE_INSTALL_PREFIX="$prefix" -DCMAKE_POLICY_VERSION_MINIMUM=3.5 \
           -DLIBUV_BUILD_TESTS=OFF -DCMAKE_POSITION_INDEPENDENT_CODE=ON >/dev/null \
      && cmake --build b -j "$jobs" >/dev/null && cmake --install b >/dev/null) || { echo "libuv build failed"; exit 2; }
    (cd "$prefix/src/googletest" && cmake -S . -B b -G Ninja -DCMAKE_BUILD_TYPE=Release \
           -DCMAKE_INSTALL_PREFIX="$prefix" -DCMAKE_POSITION_INDEPENDENT_CODE=ON >/dev/null \
      && cmake --build b -j "$jobs" >/dev/null && cmake --install b >/dev/null) || { echo "googletest build failed"; exit 2; }
    touch "$prefix/.ok"
  fi
  deps_flags=(-DMEMBAR_DEPS_PREFIX="$prefix" -DCMAKE_PREFIX_PATH="$prefix")
  export LD_LIBRARY_PATH="$prefix/lib:${LD_LIBRARY_PATH:-}"
fi

# Use the distribution's compiler where there is one: the H200 image's default g++ (/opt/gcc)
# ships no libstdc++.so, so it links libstdc++ statically into membar/_C.so, and that private
# copy's iostreams crash inside a process whose libstdc++ is the system one (seen 2026-11-30:
# SIGSEGV in std::codecvt under std::ostream::_M_insert from a TORCH_CHECK message).
if [ -z "${CXX:-}" ] && [ -x /usr/bin/g++ ]; then
  export CC=/usr/bin/gcc CXX=/usr/bin/g++ CUDAHOSTCXX=/usr/bin/g++
fi

status=0
if has_stage build; then
  log "configure + build (CUDA, sm_90a)"
  cmake -S . -B build-gpu -G Ninja -DCMAKE_BUILD_TYPE=Release -DMEMBAR_WITH_CUDA=ON \
      -DMEMBAR_CUDA_ARCHS=90a -DMEMBAR_PYTHON="$py" "${deps_flags[@]}" > "$results/build.log" 2>&1 \
    && cmake --build build-gpu -j "$jobs" ${GPU_CHECK_TARGETS:+--target $GPU_CHECK_TARGETS} -- -k 0 >> "$results/build.log" 2>&1
  rc=$?
  grep -E "registers|spill|error" "$results/build.log" | grep -v "^--" > "$results/ptxas.txt" || true
  if [ $rc -ne 0 ]; then
    log "build FAILED (rc $rc); errors:"; grep -E "error|Error" "$results/build.log" | head -40
    status=1
  fi
fi

if has_stage tests; then
  log "gpu-labelled C++ tests"
  ctest --test-dir build-gpu -L gpu --output-on-failure --timeout 300 > "$results/gpu_ctest.log" 2>&1 || status=1
  tail -15 "$results/gpu_ctest.log"
  log "gpu-marked Python tests"
  PYTHONPATH=$root/bindings/python timeout 600 $py -m pytest -q -m gpu tests/python \
      -p no:cacheprovider > "$results/gpu_pytest.log" 2>&1
  rc=$?; [ $rc -ne 0 ] && [ $rc -ne 5 ] && status=1
  tail -15 "$results/gpu_pytest.log"
fi

if has_stage bench; then
  export PYTHONPATH=$root/bindings/python
  if has_bench runtime && [ -x build-gpu/bin/runtime_bench ]; then
    log "bench: runtime"; timeout 300 build-gpu/bin/runtime_bench 2>&1 | tail -30 || status=1
  fi
  if has_bench runtime && [ -x build-gpu/bin/ring_latency ]; then
    log "bench: ring latency (cuda backend)"; timeout 120 build-gpu/bin/ring_latency --backend cuda 2>&1 | tail -12 || status=1
  fi
  if has_bench pipeline && [ -x build-gpu/bin/pipeline_bench ]; then
    log "bench: client pipeline (embedded)"; timeout 120 build-gpu/bin/pipeline_bench 2>&1 | tail -12 || status=1
    if [ -x build-gpu/bin/membard ]; then
      sock=/tmp/membar-pipeline-$$.sock
      build-gpu/bin/membard --backend cuda --socket "$sock" --gpu-pool 1GiB --host-pool 2GiB --foreground \
          --log-level warn > "$results/pipeline_membard.log" 2>&1 &
      daemon=$!
      for _ in $(seq 100); do [ -S "$sock" ] && break; sleep 0.1; done
      log "bench: client pipeline (membard --backend cuda)"
      timeout 120 build-gpu/bin/pipeline_bench --socket "$sock" 2>&1 | tail -12 || status=1
      kill "$daemon" 2>/dev/null; wait "$daemon" 2>/dev/null
    fi
  fi
  if has_bench attention && [ -f bench/attention_bench.py ]; then
    log "bench: attention"; timeout 400 $py bench/attention_bench.py ${ATTENTION_BENCH_ARGS:-} 2>&1 | tail -30 || status=1
  fi
  if has_bench sweep && [ -f bench/attention_sweep.py ]; then
    log "bench: attention layouts sweep"
    { cmake --build build-gpu -j "$jobs" --target membar_attention_sweep >> "$results/build.log" 2>&1 \
      && MEMBAR_BUILD_DIR=$root/build-gpu timeout 600 $py bench/attention_sweep.py 2>&1 | tail -60; } || status=1
  fi
  if has_bench logra && [ -f bench/logra_bench.py ]; then
    log "bench: logra"; timeout ${LOGRA_BENCH_TIMEOUT:-600} $py bench/logra_bench.py ${LOGRA_BENCH_ARGS:-} 2>&1 | tail -30 || status=1
  fi
  if has_bench oomb && [ -f bench/oomb_bench.py ]; then
    log "bench: oomb"; timeout ${OOMB_BENCH_TIMEOUT:-900} $py bench/oomb_bench.py ${OOMB_BENCH_ARGS:-} 2>&1 | tail -30 || status=1
  fi
fi
if [ -n "${OUT:-}" ] && [ "$results" != "$OUT" ]; then
  tar czf "$OUT/gpu_check_results.tgz" -C "$results" . && cp "$results/machine.txt" "$OUT/" 2>/dev/null
fi
log "done (status $status); results in $results"
exit $status
