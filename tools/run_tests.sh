#!/usr/bin/env bash
# Runs every test that needs no GPU: C++ (CTest, labels unit + integration + fuzz) and Python
# (pytest). Usage: tools/run_tests.sh BUILD_DIR PYTHON
set -uo pipefail
build=${1:-build}; py=${2:-.venv/bin/python}
cd "$(dirname "$0")/.."
status=0
echo "== C++ tests (ctest, no gpu label) =="
ctest --test-dir "$build" -LE gpu --output-on-failure --timeout 600 -j 2 || status=1
echo "== Python tests (pytest) =="
PYTHONPATH=$PWD/bindings/python MEMBAR_BUILD_DIR=$PWD/$build "$py" -m pytest -q tests/python -m "not gpu"
rc=$?
# pytest exit 5 means no test was collected: that is a failure of this script, not a pass.
[ $rc -ne 0 ] && status=1
exit $status
