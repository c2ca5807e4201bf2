"""bench/logra_dp_bench.py on the CPU (gloo, 2 ranks): the bytes it reports per update are the sizes
LoGRAOptimizer actually all-reduces (the sketches of what apply_logra wraps) and the dense gradients of
the same matrices, and both all-reduces are timed."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from transformers import Qwen2Config, Qwen2ForCausalLM

from membar import logra

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "bench"))


def test_bytes_are_the_optimizers_and_both_all_reduces_are_timed(tmp_path):
    from logra_bench import SHAPES

    env = dict(os.environ, MEMBAR_RESULTS_DIR=str(tmp_path), PYTHONPATH=str(REPO / "bindings" / "python"))
    subprocess.run([sys.executable, str(REPO / "bench" / "logra_dp_bench.py"), "--shapes", "tiny", "--repeats", "1"],
                   check=True, env=env, timeout=300)
    row = json.loads((tmp_path / "logra_dp_bench.json").read_text())["rows"][0]
    model = Qwen2ForCausalLM(Qwen2Config(**SHAPES["tiny"]))
    handle = logra.apply_logra(model, rank=row["rank"], seed=1, runtime=None)
    assert row["sketch_bytes"] == 4 * sum(layer.out_features * layer.rank for layer in handle.layers)
    assert row["gradient_bytes"] == 2 * sum(layer.weight.numel() for layer in handle.layers)
    assert row["bytes_ratio"] == row["gradient_bytes"] / row["sketch_bytes"]
    assert row["sketch_seconds"] > 0 and row["gradient_seconds"] > 0
    assert "tiny" in (tmp_path / "logra_dp_bench.txt").read_text()
