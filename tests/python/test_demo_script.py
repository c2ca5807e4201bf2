"""tools/demo.sh (`make demo`): the GPU is used only when it can be, and otherwise the demo runs
on the CPU and says why. On this GPU-less machine nvidia-smi is faked by a script on PATH."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def run_demo(tmp_path, compute_capability: str):
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "nvidia-smi").write_text(f"#!/bin/sh\necho {compute_capability}\n")
    (fake / "nvidia-smi").chmod(0o755)
    environment = dict(os.environ, PATH=f"{fake}{os.pathsep}{os.environ['PATH']}", PYTHON=sys.executable,
                       OMP_NUM_THREADS="1")
    environment.pop("MEMBAR_LIBRARY", None)
    return subprocess.run([str(REPO / "tools" / "demo.sh"), "--demo-minutes", "0.01", "--eval-sequences", "2",
                           "--no-progress"], capture_output=True, text=True, timeout=300, env=environment)


@pytest.mark.parametrize("compute_capability, reason", [
    ("7.5", "GPU compute capability 7.5 (membar's kernels need 8.0+)"),
    ("9.0", "does not see the GPU"),   # the CPU wheel of torch: no GPU for it, whatever nvidia-smi says
])
def test_demo_falls_back_to_the_cpu_and_says_why(tmp_path, compute_capability, reason):
    import torch

    if torch.cuda.is_available():
        pytest.skip("a real GPU is here: the fallback is not what would run")
    finished = run_demo(tmp_path, compute_capability)
    assert finished.returncode == 0, finished.stderr[-2000:]
    assert reason in finished.stdout and "the demo runs on the CPU" in finished.stdout, finished.stdout[:1000]
    assert "on cpu" in finished.stdout and "held-out accuracy" in finished.stdout
    assert "building membar's CUDA kernels" not in finished.stdout


def test_demo_with_its_own_daemon_shows_the_trainer_and_stops_it(tmp_path):
    """DEMO_DAEMON=1: membard starts on a private socket, the demo trains through it, membarctl
    shows the trainer by name while it trains, and the daemon is gone afterwards."""
    import torch

    if torch.cuda.is_available():
        pytest.skip("with a GPU the demo builds the CUDA daemon first (minutes)")
    environment = dict(os.environ, PYTHON=sys.executable, OMP_NUM_THREADS="1", DEMO_DAEMON="1")
    environment.pop("MEMBAR_LIBRARY", None)
    environment.pop("MEMBAR_SOCKET", None)
    finished = subprocess.run([str(REPO / "tools" / "demo.sh"), "--demo-minutes", "0.05", "--demo-steps", "1",
                               "--eval-sequences", "2", "--no-progress"],
                              capture_output=True, text=True, timeout=300, env=environment)
    assert finished.returncode == 0, (finished.stdout[-2000:], finished.stderr[-2000:])
    out = finished.stdout
    assert "membarctl stats while the demo trains" in out
    assert "name: membar-train demo 18K" in out and "name: L000.k" in out
    assert "runtime (daemon:" in out and "[demo] stopping membard" in out
    socket = next(line.split("--socket ")[1].split(" ")[0] for line in out.splitlines() if "starting" in line)
    assert not Path(socket).exists() and not Path(socket).parent.exists()
