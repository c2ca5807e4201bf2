#!/usr/bin/env bash
# Makes .deps/: what the GPU machine (no network, no Debian dev packages) needs to build membar:
# the Boost.Interprocess/lockfree headers (extracted with bcp), spdlog + fmt headers (used
# header-only there), the sources of libuv and GoogleTest (built there by tools/gpu_check.sh), and
# an accelerate wheel (transformers' Trainer needs it; h200_session.sh's trainer step installs it).
# Run here (needs apt-get); then carry `.deps` (one compressed bundle.tgz) with the device call.
set -euo pipefail
cd "$(dirname "$0")/.."
need=(libboost-dev libboost1.74-tools-dev libspdlog-dev libfmt-dev libgtest-dev)
for p in "${need[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || \
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "$p" >/dev/null
done
stage=$(mktemp -d)
mkdir -p "$stage/include" "$stage/src"
mkdir -p "$stage/bcp"
bcp --boost=/usr/include interprocess lockfree atomic intrusive container "$stage/bcp" >/dev/null
test -d "$stage/bcp/boost" || { echo "bcp found no Boost headers in /usr/include" >&2; exit 1; }
mv "$stage/bcp/boost" "$stage/include/boost" && rm -rf "$stage/bcp"
cp -r /usr/include/spdlog /usr/include/fmt "$stage/include/"
cp -r /usr/src/googletest "$stage/src/googletest"
# libuv's source from Debian's source package (the same version as libuv1-dev here).
work=$(mktemp -d)
mkdir -p "$work/lists/partial" "$work/parts"
sed 's/^Types: deb$/Types: deb-src/' /etc/apt/sources.list.d/debian.sources > "$work/parts/src.sources"
opts=(-o Dir::Etc::SourceList=/dev/null -o "Dir::Etc::SourceParts=$work/parts" -o "Dir::State::Lists=$work/lists")
apt-get "${opts[@]}" update -qq 2>/dev/null
(cd "$work" && apt-get "${opts[@]}" source --download-only libuv1 >/dev/null 2>&1)
cp "$work"/libuv1_*.orig.tar.gz "$stage/src/"
rm -rf "$work" .deps && mkdir -p .deps
tar czf .deps/bundle.tgz -C "$stage" include src
rm -rf "$stage"
# transformers' Trainer needs accelerate (pure Python); the device has none and no network.
mkdir -p .deps/wheels
python3 -m pip download --no-deps -q -d .deps/wheels "accelerate==$(sed -n 's/^ACCELERATE_VERSION=//p' tools/setup.sh)"
ls -la .deps/bundle.tgz
