"""bench/model_coverage_bench.py on the CPU with every shape shrunk (--tiny): both parts run, rows
merge by (model, part, variant, tokens) across calls, and the table names what ran. The H200 run
is the lead's (the command is in docs/models.md)."""
from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]


def load_bench():
    spec = importlib.util.spec_from_file_location("model_coverage_bench", REPO / "bench" / "model_coverage_bench.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
def test_tiny_shapes_on_the_cpu(tmp_path, monkeypatch):
    bench = load_bench()
    monkeypatch.setenv("MEMBAR_RESULTS_DIR", str(tmp_path))
    monkeypatch.setenv("MEMBAR_COMMIT", "0123abc")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        common = ["--tiny", "--device", "cpu", "--quick", "--contexts", "1K", "--gemma-full", "eager"]
        assert bench.main(common + ["--models", "gemma-2-9b", "--fresh"]) == 0
        # One timing variant per call (a row's missing step alone), merged into the same table.
        assert bench.main(common + ["--models", "qwen3-8b", "--parts", "timing", "--variants", "chunk-recurrent"]) == 0
        partial = {row["variant"] for row in json.loads((tmp_path / "model_coverage.json").read_text())["rows"]
                   if row["model"] == "qwen3-8b"}
        assert partial == {"chunk-recurrent"}, partial
        assert bench.main(common + ["--models", "qwen3-8b", "--parts", "timing", "--variants", "full"]) == 0
    finally:
        torch.set_num_threads(threads)
    results = json.loads((tmp_path / "model_coverage.json").read_text())
    assert results["commit"] == "0123abc"
    rows = results["rows"]
    keys = {(row["model"], row["part"], row["variant"]) for row in rows}
    assert keys == {("gemma-2-9b", "errors", "errors"), ("gemma-2-9b", "timing", "full"),
                    ("gemma-2-9b", "timing", "chunk-recurrent"), ("qwen3-8b", "timing", "full"),
                    ("qwen3-8b", "timing", "chunk-recurrent")}
    errors = next(row for row in rows if row["part"] == "errors")
    # Layer 0 is local (its window runs in PyTorch), layer 1 global: soft-capped on the paged kernels.
    assert errors["full_attention"] == "eager" and errors["torch_path_layers"] == [0]
    assert 0 < errors["chunk_recurrent_bf16"]["max_relative"] and errors["within_goal"], errors
    assert all("step_seconds" in row for row in rows if row["part"] == "timing"), rows
    table = (tmp_path / "model_coverage.md").read_text()
    assert "| gemma-2-9b | 2 / 4 |" in table and "| qwen3-8b | - / 4 |" in table


def test_gemma_full_sequence_reference_is_never_sdpa():
    bench = load_bench()
    from membar.oomb.baseline import reference_attention

    config = bench.shape_config("gemma-2-9b", 2, True, 1024)
    model = bench.build(config, torch.float32, torch.device("cpu"))
    assert reference_attention(model) == "eager"
    assert bench.full_attention(model, "flex") == "flex_attention" and bench.full_attention(model, "skip") is None
    assert bench.full_attention(bench.build(bench.shape_config("qwen3-8b", 2, True, 1024), torch.float32,
                                            torch.device("cpu")), "flex") == "sdpa"


def test_a_row_skipped_for_time_keeps_the_measured_one_and_old_peaks_are_marked():
    bench = load_bench()
    key = {"model": "qwen3-8b", "part": "timing", "variant": "chunk-recurrent", "tokens": 32768}
    measured = dict(key, step_seconds=8.3, peak_gpu_gib=41.1)
    rows = bench.merge([], measured)
    assert bench.merge(rows, dict(key, skipped="time budget spent")) == [measured]
    # A failure or a new measurement replaces it.
    assert bench.merge(rows, dict(key, oom=True, error="OOM")) == [dict(key, oom=True, error="OOM")]
    # A chunk-recurrent peak without the runtime's GPU frames (rows before session 24) is marked.
    assert bench._cell(measured) == "8.3 s, 41.1 GiB*"
    assert bench._cell(dict(measured, peak_gpu_gib=53.2, runtime_gpu_gib=12.1)) == "8.3 s, 53.2 GiB"
    assert bench._cell(dict(measured, variant="full")) == "8.3 s, 41.1 GiB"
