#!/usr/bin/env bash
# Prepares what a device call carries (`carry: [".deps"]`): the dependency bundle
# (tools/make_gpu_deps.sh, once per checkout: a new checkout has none, and a call without it builds
# nothing) and .deps/tree.tgz, the committed tree of HEAD, so that the device builds exactly a
# commit, never a helper's unfinished edits in the working tree (session 19). Prints the command
# line to give the device: it unpacks the tree in /tmp/t and runs tools/h200_session.sh there.
#
#   tools/device_tree.sh [STEP...]      (steps default to "build tests")
set -euo pipefail
cd "$(dirname "$0")/.."
[ -f .deps/bundle.tgz ] || tools/make_gpu_deps.sh
commit=$(git rev-parse --short HEAD)
git archive --format=tar.gz -o .deps/tree.tgz HEAD -- . ':(exclude)bench/results'
if [ -n "$(git status --porcelain --untracked-files=no)" ]; then
  echo "note: the working tree has uncommitted changes; the device gets HEAD ($commit) without them" >&2
fi
steps=${*:-build tests}
echo "mkdir -p /tmp/t && tar xzf .deps/tree.tgz -C /tmp/t && cp -r .deps /tmp/t/ && cd /tmp/t && MEMBAR_COMMIT=$commit timeout 535 tools/h200_session.sh $steps"
