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
