"""bench/schedule_stall_bench.py runs against a real membard (host backend) at a small size."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import membard_binary

REPO = Path(__file__).resolve().parents[2]


def test_bench_measures_the_other_clients_calls_while_a_schedule_installs(tmp_path):
    binary = membard_binary()
    if binary is None:
        pytest.skip("membard is not built")
    run = subprocess.run([sys.executable, str(REPO / "bench" / "schedule_stall_bench.py"), "--membard", str(binary),
                          "--seconds", "2", "--chunks", "4", "--layers", "2", "--top-k", "8"],
                         env={**os.environ, "MEMBAR_RESULTS_DIR": str(tmp_path)},
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    result = json.loads((tmp_path / "schedule_stall_bench.json").read_text())
    assert result["steps"] == 4 * 2 * 3 and result["ranges"] == 4 * 2 * 3 * 2 * 8
    assert len(result["set_schedule_seconds"]) == 2
    assert result["other_client"]["calls"] > 0 and result["other_client"]["worst_ms"] > 0
    assert "the other client's acquire+release meanwhile" in (tmp_path / "schedule_stall_bench.txt").read_text()
