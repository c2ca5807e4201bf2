"""Shared test helpers."""
from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def load_example():
    """load_example("hf_trainer_oomb") -> the module examples/hf_trainer_oomb/train.py, under a name
    of its own: every example's script is train.py, and a cached `train` module of one example
    must not stand in for another's."""

    def load(directory: str):
        path = REPO / "examples" / directory / "train.py"
        spec = importlib.util.spec_from_file_location(f"membar_example_{directory}", path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module

    return load


@pytest.fixture
def one_thread():
    """torch on one thread for the test: the models in these tests are tiny, so threads only add
    overhead (and contention on a 2-core CI machine)."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def membard_binary() -> Path | None:
    """build/bin/membard (or $MEMBAR_BUILD_DIR/bin/membard) when it is built."""
    import os

    binary = Path(os.environ.get("MEMBAR_BUILD_DIR", REPO / "build")) / "bin" / "membard"
    return binary if binary.exists() else None


@pytest.fixture
def membard(tmp_path):
    """membard(*arguments, gpu_pool="16MiB", host_pool="64MiB") starts a membard on the host backend
    in the foreground at a socket of its own and returns the socket's path once it answers; every
    daemon started is stopped after the test. Skips the test when membard is not built."""
    import subprocess
    import time

    binary = membard_binary()
    if binary is None:
        pytest.skip("membard is not built (set MEMBAR_BUILD_DIR)")
    daemons = []

    def start(*arguments: str, gpu_pool: str = "16MiB", host_pool: str = "64MiB") -> str:
        socket = tmp_path / f"membard-{len(daemons)}.sock"
        daemons.append(subprocess.Popen([str(binary), "--backend", "host", "--socket", str(socket), "--gpu-pool",
                                         gpu_pool, "--host-pool", host_pool, "--foreground", "--log-level", "warn",
                                         *arguments]))
        for _ in range(500):
            if socket.exists():
                return str(socket)
            time.sleep(0.02)
        raise AssertionError("membard did not start")

    yield start
    for daemon in daemons:
        daemon.terminate()
        daemon.wait(timeout=10)
