#!/usr/bin/env bash
# Builds fuzz/protocol_fuzzer.cpp with clang++ (libFuzzer + AddressSanitizer + UBSan) and runs
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
# Seeds: one well-formed input per decoder, so the fuzzer starts inside the formats.
python3 - "$out/corpus" <<'PY'
import struct, sys, os
d = sys.argv[1]
magic, version = 0x3152424D, 1
hello = struct.pack("<IIQQ", 0, 0, 1 << 30, 0) + b"trainer".ljust(64, b"\0")
seeds = {
  "hello": bytes([0]) + struct.pack("<IHHII", magic, version, 1, len(hello), 0) + hello,
  "stream": bytes([1]) + struct.pack("<IHHII", magic, version, 9, 8, 0) + struct.pack("<Q", 7) * 2,
  "request": bytes([2]) + struct.pack("<QHHIIIIIQQ", 1, 4, 0, 1, 1, 0, 4, 0, 0, 0) + bytes(16) + struct.pack("<I", 4096),
  "schedule": bytes([3]) + struct.pack("<II", 2, 1) + struct.pack("<III", 1, 0, 4) + struct.pack("<I", 0),
  "locations": bytes([4]) + struct.pack("<II", 2, 2) + struct.pack("<IIII", 0, 1, 3, 0),
  # Before the per-space residency records, and with them (one record: client, six counts).
  "stats-old": bytes([5]) + struct.pack("<I", 4) + b"host" + struct.pack("<I", 1) + struct.pack("<BQQQ", 0, 16, 1, 15)
           + struct.pack("<I", 0) + struct.pack("<I", 1) + struct.pack("<I", 1) + struct.pack("<I", 5) + b"L07.k"
           + struct.pack("<QI", 65536, 8),
}
seeds["stats"] = seeds["stats-old"] + struct.pack("<II", 1, 3) + struct.pack("<6Q", 2, 1, 0, 5, 1, 0)
for name, data in seeds.items():
  with open(os.path.join(d, "seed-" + name), "wb") as f:
    f.write(data)
PY
echo "running $binary for ${seconds}s"
# libFuzzer exits 77 on a finding by default, which CTest would read as "skipped": make it 1.
"$binary" -max_total_time="$seconds" -artifact_prefix="$out/" -rss_limit_mb=2048 -max_len=4096 -print_final_stats=1 \
    -error_exitcode=1 -timeout_exitcode=1 "$out/corpus" 2>&1 | tail -25
