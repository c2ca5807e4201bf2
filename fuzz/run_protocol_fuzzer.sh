#!/usr/bin/env bash
# Builds fuzz/protocol_fuzzer.cpp (protocol v2 parsers and ring descriptors) with clang++ (libFuzzer + AddressSanitizer + UBSan) and runs
# it for a bounded time. Usage: fuzz/run_protocol_fuzzer.sh OUT_DIR [SECONDS]
# Exit 77 (CTest: skipped) when clang++ or libFuzzer is not available.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
out=${1:-$root/build/fuzz}
seconds=${2:-30}
cxx=${CLANGXX:-$(command -v clang++ || command -v clang++-14 || true)}
if [ -z "$cxx" ]; then
  echo "clang++ not found: skipping the protocol fuzzer"
  exit 77
fi
mkdir -p "$out/corpus"
binary="$out/protocol_fuzzer"
sources=("$root/fuzz/protocol_fuzzer.cpp" "$root/common/protocol.cpp" "$root/common/wire_socket.cpp"
         "$root/common/status.cpp")
newest=$(ls -t "${sources[@]}" "$root/include/membar/protocol/v2.h" "$root/common/include/membar/common/wire_socket.h" | head -1)
if [ ! -x "$binary" ] || [ "$newest" -nt "$binary" ]; then
  if ! "$cxx" -std=c++20 -O1 -g -fsanitize=fuzzer,address,undefined -fno-sanitize-recover=undefined \
      -I "$root/include" -I "$root/common/include" "${sources[@]}" -o "$binary" 2>"$out/build.log"; then
    if grep -q "libclang_rt.fuzzer\|cannot find.*fuzzer" "$out/build.log"; then
      echo "libFuzzer runtime missing (install libclang-rt-14-dev): skipping"
      exit 77
    fi
    cat "$out/build.log"
    exit 1
  fi
fi
# Seeds: one well-formed input per decoder (fuzz/corpus/protocol), so the fuzzer starts inside the
# formats; what it finds is kept in OUT_DIR/corpus for the next run.
cp -n "$root"/fuzz/corpus/protocol/* "$out/corpus/" 2>/dev/null || true
echo "running $binary for ${seconds}s"
# libFuzzer exits 77 on a finding by default, which CTest would read as "skipped": make it 1.
"$binary" -max_total_time="$seconds" -artifact_prefix="$out/" -rss_limit_mb=2048 -max_len=4096 -print_final_stats=1 \
    -error_exitcode=1 -timeout_exitcode=1 "$out/corpus" 2>&1 | tail -25
