#!/usr/bin/env bash
# Copies the source tree into DEST without the components the attention kernels do not need
# (runtime daemon/client, examples, other test tiers), so that the CUDA attention targets can be
# configured and built on a machine that lacks their dependencies (Boost, libuv, spdlog) or while
# another component is mid-edit. Usage: tests/gpu/isolated_source.sh DEST
set -euo pipefail
dest=${1:?usage: isolated_source.sh DEST}
src=$(cd "$(dirname "$0")/../.." && pwd)
mkdir -p "$dest"
tar -C "$src" --exclude=./.git --exclude='./build*' --exclude=./.venv --exclude=./.deps -cf - . | tar -C "$dest" -xf -
for dir in libclient runtimed examples bench; do rm -f "$dest/$dir/CMakeLists.txt"; done
for dir in "$dest"/tests/*/; do
  [ "$(basename "$dir")" = gpu ] || rm -f "$dir/CMakeLists.txt"
done
# Only the attention bindings: other areas' ops may need libraries this build leaves out.
find "$dest/bindings/csrc" -name '*.cpp' ! -name 'attention*' ! -name '*module*' -delete 2>/dev/null || true
