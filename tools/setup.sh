#!/usr/bin/env bash
# Installs what building and testing membar needs, skipping what is already there:
# Debian packages (apt-get) and a .venv with the pinned torch / transformers.
# Usage: tools/setup.sh [--no-venv]
set -euo pipefail
cd "$(dirname "$0")/.."

TORCH_VERSION=2.11.0
TRANSFORMERS_VERSION=5.17.0
# The Trainer integrations (membar.integrations) and their CI tests: accelerate (transformers'
# Trainer needs it) and TRL (SFTTrainer, GRPOTrainer; it brings datasets). About 20 s to install.
# pdoc renders the API reference (tools/api_docs.sh).
ACCELERATE_VERSION=1.15.0
TRL_VERSION=1.16.0
PDOC_VERSION=16.0.0
debs=(build-essential cmake ninja-build pkg-config libboost-dev libuv1-dev libspdlog-dev libfmt-dev
      libgtest-dev libgmock-dev clang libclang-rt-14-dev)

missing=()
for p in "${debs[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  echo "[setup] installing Debian packages: ${missing[*]}"
  sudo_cmd=""; [ "$(id -u)" -ne 0 ] && sudo_cmd="sudo"
  $sudo_cmd apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo_cmd apt-get install -y -qq "${missing[@]}" >/dev/null
fi

[ "${1:-}" = "--no-venv" ] && exit 0

py=${PYTHON_FOR_VENV:-python3}
if [ ! -x .venv/bin/python ]; then
  echo "[setup] creating .venv with $($py --version)"
  $py -m venv .venv
fi
want="torch==${TORCH_VERSION} transformers==${TRANSFORMERS_VERSION} accelerate==${ACCELERATE_VERSION} trl==${TRL_VERSION} pdoc==${PDOC_VERSION}"
have=$(.venv/bin/python - <<PY 2>/dev/null || true
import importlib.metadata as m
try:
    print(f"torch=={m.version('torch').split('+')[0]} transformers=={m.version('transformers')} "
          f"accelerate=={m.version('accelerate')} trl=={m.version('trl')} pdoc=={m.version('pdoc')}")
except Exception:
    print("")
PY
)
if [ "$have" != "$want" ] || ! .venv/bin/python -c 'import pytest, tqdm, numpy, matplotlib' 2>/dev/null; then
  echo "[setup] installing into .venv: $want pytest tqdm numpy matplotlib (a few minutes the first time)"
  .venv/bin/python -m pip install -q --upgrade pip
  .venv/bin/python -m pip install -q "torch==${TORCH_VERSION}" "transformers==${TRANSFORMERS_VERSION}" \
      "accelerate==${ACCELERATE_VERSION}" "trl==${TRL_VERSION}" "pdoc==${PDOC_VERSION}" pytest tqdm numpy matplotlib
fi
# The package is used in place (bindings/python, with the built membar/_C.so beside it): a .pth
# file puts it on the venv's path, and membar-train is a console entry point for its CLI (the
# developer's equivalent of `pip install .`, which builds a second copy; see pyproject.toml).
site=$(.venv/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
echo "$PWD/bindings/python" > "$site/membar-dev.pth"
cat > .venv/bin/membar-train <<SH
#!/usr/bin/env bash
exec "$PWD/.venv/bin/python" -m membar.train "\$@"
SH
chmod +x .venv/bin/membar-train
# The daemon and its admin CLI as commands of the venv too (what `pip install .` installs), from
# the build directory `make build` fills.
for command in membard membarctl; do
  cat > .venv/bin/$command <<SH
#!/usr/bin/env bash
binary="$PWD/\${MEMBAR_BUILD_DIR:-build}/bin/$command"
[ -x "\$binary" ] || { echo "$command: \$binary is not built yet: run 'make build'" >&2; exit 1; }
exec "\$binary" "\$@"
SH
  chmod +x .venv/bin/$command
done
echo "[setup] ok: $(.venv/bin/python -c 'import torch, transformers; print("torch", torch.__version__, "transformers", transformers.__version__)')"
