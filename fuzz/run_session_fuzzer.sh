#!/usr/bin/env bash
# Builds fuzz/session_fuzzer.cpp (sequences of ring requests against a real in-process engine on the
# host backend, the daemon's RingServer and SessionChannel) with clang++ (libFuzzer +
# AddressSanitizer + UBSan) and runs it for a bounded time from the seeds in fuzz/corpus/session.
# Usage: fuzz/run_session_fuzzer.sh OUT_DIR [SECONDS]
# Exit 77 (CTest: skipped) when clang++ or libFuzzer is not available; 1 on a finding.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
out=${1:-$root/build/fuzz}
seconds=${2:-30}
cxx=${CLANGXX:-$(command -v clang++ || command -v clang++-14 || true)}
if [ -z "$cxx" ]; then
  echo "clang++ not found: skipping the session fuzzer"
  exit 77
fi
mkdir -p "$out/session-corpus"
binary="$out/session_fuzzer"
sources=("$root/fuzz/session_fuzzer.cpp"
         "$root/common/protocol.cpp" "$root/common/wire_socket.cpp" "$root/common/status.cpp" "$root/common/human_bytes.cpp"
         "$root/engine/engine.cpp" "$root/engine/frames.cpp" "$root/engine/eviction.cpp" "$root/engine/batches.cpp" "$root/engine/page_copies.cpp"
         "$root/engine/channels.cpp" "$root/engine/backend.cpp" "$root/engine/host_share.cpp" "$root/engine/numa.cpp" "$root/engine/host/host_backend.cpp"
         "$root/runtimed/daemon/session.cpp" "$root/runtimed/daemon/shared_segment.cpp")
headers=$(ls "$root"/include/membar/*.h "$root"/include/membar/protocol/*.h "$root"/common/include/membar/common/*.h \
              "$root"/engine/*.h "$root"/engine/include/membar/engine/*.h "$root"/runtimed/daemon/*.h)
newest=$(ls -t "${sources[@]}" $headers | head -1)
if [ ! -x "$binary" ] || [ "$newest" -nt "$binary" ]; then
  echo "building $binary (a few minutes with one core)"
  if ! "$cxx" -std=c++20 -O1 -g -pthread -fsanitize=fuzzer,address,undefined -fno-sanitize-recover=undefined \
      -DFMT_HEADER_ONLY -I "$root/include" -I "$root/common/include" -I "$root/engine/include" -I "$root/engine" \
      -I "$root/runtimed/daemon" "${sources[@]}" -o "$binary" 2>"$out/session-build.log"; then
    if grep -q "libclang_rt.fuzzer\|cannot find.*fuzzer" "$out/session-build.log"; then
      echo "libFuzzer runtime missing (install libclang-rt-14-dev): skipping"
      exit 77
    fi
    cat "$out/session-build.log"
    exit 1
  fi
fi
cp -n "$root"/fuzz/corpus/session/* "$out/session-corpus/" 2>/dev/null || true
echo "running $binary for ${seconds}s"
# libFuzzer exits 77 on a finding by default, which CTest would read as "skipped": make it 1.
ASAN_OPTIONS=detect_leaks=1:allocator_may_return_null=1 \
"$binary" -max_total_time="$seconds" -artifact_prefix="$out/session-" -rss_limit_mb=4096 -max_len=2048 \
    -timeout=60 -print_final_stats=1 -error_exitcode=1 -timeout_exitcode=1 "$out/session-corpus" 2>&1 | tail -25
