#!/usr/bin/env bash
# `make demo`: membar-train --demo, on the GPU where there is one.
#
# `make build` builds membar for the CPU (what CI and `make test` use). Where this machine has an
# NVIDIA GPU of compute capability 8.0 or newer, torch sees it and nvcc exists, the ops library is
# also built with the CUDA kernels into build-demo-gpu/ (its own _C.so, loaded through
# MEMBAR_LIBRARY, so the CPU build and `make test` are untouched) and the demo trains there. When
# any of that is missing or the CUDA build fails, the demo runs on the CPU and says why.
#
# DEMO_DAEMON=1 (`make demo DEMO_DAEMON=1`): the demo starts its own membard on a private socket,
# trains through it ($MEMBAR_SOCKET), shows `membarctl stats` once training runs, and stops it.
set -uo pipefail
cd "$(dirname "$0")/.."
root=$PWD
py=${PYTHON:-$root/.venv/bin/python}
export PYTHONPATH=$root/bindings/python
say() { printf '[demo] %s\n' "$*"; }

# The CUDA architecture for CMake (90a on Hopper: the warpgroup kernels), or a reason on stderr.
gpu_arch() {
  command -v nvidia-smi >/dev/null 2>&1 || { echo "no nvidia-smi" >&2; return 1; }
  local cap
  cap=$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader 2>/dev/null | head -1 | tr -d ' ')
  [[ "$cap" =~ ^([0-9]+)\.([0-9]+)$ ]] || { echo "no GPU listed by nvidia-smi" >&2; return 1; }
  local major=${BASH_REMATCH[1]} minor=${BASH_REMATCH[2]}
  if (( major < 8 )); then echo "GPU compute capability $cap (membar's kernels need 8.0+)" >&2; return 1; fi
  "$py" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null \
    || { echo "torch in $py does not see the GPU" >&2; return 1; }
  if ! command -v nvcc >/dev/null 2>&1 && [ ! -x /usr/local/cuda/bin/nvcc ]; then
    echo "no nvcc (install the CUDA toolkit to build membar's GPU kernels)" >&2; return 1
  fi
  if [ "$major$minor" = "90" ]; then echo 90a; else echo "$major$minor"; fi
}

if arch=$(gpu_arch 2> /tmp/membar-demo-gpu.$$); then
  export PATH=$PATH:/usr/local/cuda/bin
  log=$root/build-demo-gpu/build.log
  mkdir -p build-demo-gpu
  say "building membar's CUDA kernels for sm_$arch into build-demo-gpu/ (log: $log; a few minutes the first time)"
  generator=$(command -v ninja >/dev/null 2>&1 && echo "-G Ninja")
  # The distribution's compiler where there is one (see tools/gpu_check.sh: a g++ without a shared
  # libstdc++ makes a _C.so that crashes inside torch's process).
  if [ -z "${CXX:-}" ] && [ -x /usr/bin/g++ ]; then export CC=/usr/bin/gcc CXX=/usr/bin/g++ CUDAHOSTCXX=/usr/bin/g++; fi
  # shellcheck disable=SC2086  # CMAKE_FLAGS (from make) holds several words
  if cmake -S . -B build-demo-gpu $generator -DCMAKE_BUILD_TYPE=Release -DMEMBAR_WITH_CUDA=ON \
        -DMEMBAR_CUDA_ARCHS="$arch" -DMEMBAR_PYTHON="$py" \
        -DMEMBAR_PYTHON_LIBRARY_DIR="$root/build-demo-gpu/python" ${CMAKE_FLAGS:-} > "$log" 2>&1 \
     && cmake --build build-demo-gpu -j "${JOBS_GPU:-$(nproc)}" --target membar_C membard membarctl >> "$log" 2>&1; then
    export MEMBAR_LIBRARY=$root/build-demo-gpu/python/_C.so
    bin=$root/build-demo-gpu/bin
  else
    say "the CUDA build failed (see $log): the demo runs on the CPU"
  fi
else
  say "no usable GPU ($(cat /tmp/membar-demo-gpu.$$)): the demo runs on the CPU"
fi
rm -f /tmp/membar-demo-gpu.$$
if [ "${DEMO_DAEMON:-0}" = 0 ]; then
  exec "$py" -m membar.train --demo "$@"
fi

# The daemon's own demo: membard (CUDA backend beside the CUDA build, else the host backend of
# the CPU build), the trainer as its client, membarctl's view of it while it trains.
bin=${bin:-$root/build/bin}
backend=host
[ "$bin" = "$root/build-demo-gpu/bin" ] && backend=cuda
work=$(mktemp -d /tmp/membar-demo.XXXXXX)
socket=$work/membard.sock
say "starting $bin/membard --backend $backend --socket $socket (log: $work/membard.log)"
"$bin/membard" --backend "$backend" --socket "$socket" --gpu-pool 1GiB --host-pool 1GiB > "$work/membard.log" 2>&1 &
daemon=$!
stop_daemon() { kill "$daemon" 2>/dev/null; wait "$daemon" 2>/dev/null; rm -rf "$work"; }
trap stop_daemon EXIT
for _ in $(seq 100); do [ -S "$socket" ] && break; sleep 0.1; done
[ -S "$socket" ] || { say "membard did not start:"; cat "$work/membard.log"; exit 1; }
export MEMBAR_SOCKET=$socket
"$py" -m membar.train --demo "$@" 2>&1 | tee "$work/train.log" &
trainer=$!
# Once the first step is done, the operator's view of the node: the trainer by name, its spaces.
while kill -0 "$trainer" 2>/dev/null; do
  if grep -q "^step 1:" "$work/train.log" 2>/dev/null; then
    say "membarctl stats while the demo trains:"
    # (the first of the trainer's spaces: K, V, dK and dV pages per layer)
    "$bin/membarctl" --socket "$socket" stats | awk '/^# Space/ && ++n == 2 {exit} {print "    " $0}'
    break
  fi
  # Often enough to catch a short run (CI's demo: one step, then two held-out sequences) while
  # it still holds its spaces.
  sleep 0.2
done
wait "$trainer"
rc=$?
say "stopping membard"
exit $rc
