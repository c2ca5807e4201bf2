"""`pip wheel .` builds a wheel against the environment's torch (no torch download, pip's default
isolated build), and the wheel installed into a fresh virtual environment that shares that torch
gives `import membar` with working ops, and the membard, membarctl and membar-train commands.

The build is CPU-only (MEMBAR_WITH_CUDA=OFF: nvcc may be on a CI machine, and a CUDA build takes
far longer) and runs two compile jobs: pytest runs one test at a time, so on the 2-core CI machine
a single job left one core idle (224 s for this test with one job)."""
from __future__ import annotations

import os
import subprocess
import sys
import sysconfig
import venv
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def _clean_environment(**extra) -> dict:
    """This process's environment without what points Python at the source tree."""
    environment = {name: value for name, value in os.environ.items()
                   if name not in ("PYTHONPATH", "MEMBAR_LIBRARY", "MEMBAR_BUILD_DIR", "VIRTUAL_ENV")}
    environment.update(extra)
    return environment


@pytest.fixture(scope="module")
def shared_torch_venv(tmp_path_factory) -> Path:
    """A fresh venv whose site-packages reaches this environment's (torch, transformers) through a
    .pth line. Paths added that way are not site directories, so this environment's own .pth files
    (the developer install's membar-dev.pth) are not processed: only the wheel provides membar."""
    root = tmp_path_factory.mktemp("venv")
    venv.EnvBuilder(with_pip=True).create(root)
    python = root / "bin" / "python"
    site = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          capture_output=True, text=True, check=True).stdout.strip()
    Path(site, "shared-torch.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    return root


@pytest.mark.slow
def test_wheel_builds_against_the_shared_torch_and_installs_the_commands(shared_torch_venv, tmp_path):
    python = shared_torch_venv / "bin" / "python"
    wheelhouse = tmp_path / "wheels"
    build = subprocess.run(
        [str(python), "-m", "pip", "wheel", "-v", "--no-deps", "-w", str(wheelhouse), f"-Cbuild-dir={tmp_path / 'build'}",
         str(REPO)],
        capture_output=True, text=True, timeout=1200, cwd=tmp_path,
        env=_clean_environment(MEMBAR_WITH_CUDA="OFF", CMAKE_BUILD_PARALLEL_LEVEL="2", PIP_NO_INPUT="1"))
    assert build.returncode == 0, (build.stdout + build.stderr)[-4000:]
    # The isolated build linked the torch of the target environment (Note [Which torch a pip build
    # links]), not one of its own.
    import torch

    torch_lib = os.path.join(os.path.dirname(torch.__file__), "lib")
    log = build.stdout + build.stderr
    assert f"LibTorch {torch.__version__} from {torch_lib}" in log, log[-4000:]
    wheels = list(wheelhouse.glob("membar-*.whl"))
    assert len(wheels) == 1, build.stdout[-2000:]

    install = subprocess.run([str(python), "-m", "pip", "install", "--no-deps", str(wheels[0])],
                             capture_output=True, text=True, timeout=300, env=_clean_environment())
    assert install.returncode == 0, install.stderr[-2000:]

    probe = (
        "import torch, membar\n"
        "from membar import logra\n"
        "import membar.oomb, membar.runtime\n"
        "key = logra.ProjectionKey(1, 2, 3)\n"
        "x = torch.randn(5, 64)\n"
        "a = logra.generate(key, 8, 64)\n"
        "assert torch.allclose(logra.project(x, key, 8), x @ a.t(), atol=1e-5)\n"
        "print(membar.__file__)\n")
    imported = subprocess.run([str(python), "-c", probe], capture_output=True, text=True, timeout=300,
                              cwd=tmp_path, env=_clean_environment())
    assert imported.returncode == 0, imported.stderr[-3000:]
    assert str(shared_torch_venv) in imported.stdout, imported.stdout   # the wheel's copy, not the source tree

    for command in ("membard", "membarctl", "membar-train"):
        executable = shared_torch_venv / "bin" / command
        assert executable.exists(), f"{command} is not a command of the environment"
        finished = subprocess.run([str(executable), "--help"], capture_output=True, text=True, timeout=120,
                                  cwd=tmp_path, env=_clean_environment())
        assert finished.returncode == 0, f"{command} --help: {finished.stderr[-1000:]}"
        assert "usage" in (finished.stdout + finished.stderr).lower()
