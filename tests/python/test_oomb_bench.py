"""bench/oomb_bench.py's harness on the CPU: configurations run in a child process in priority
order, results are annotated (growth per 10K tokens, offload overhead) and written after every
configuration, and the time budget skips what would not fit; on a GPU, the same at the 0.5B shape."""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]


def load_bench():
    spec = importlib.util.spec_from_file_location("oomb_bench", REPO / "bench" / "oomb_bench.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_estimates_scale_from_the_closest_shorter_measurement():
    bench = load_bench()
    K = 1024
    # Known 7B numbers: dense 128K ~45 s, so 256K is ~3x that (context^1.6) plus a warm-up.
    assert 130 < bench.estimate_seconds("dense", 256 * K, "qwen2.5-7b", {}) < 250
    # This run's own measurement wins over the table.
    assert bench.estimate_seconds("dense", 64 * K, "qwen2.5-7b", {("dense", 64 * K): 1.0}) < 10
    # Sparse grows about linearly; hybrid follows offload.
    sparse = bench.estimate_seconds("sparse-offload", 128 * K, "qwen2.5-7b", {("sparse-offload", 64 * K): 10.0})
    assert 20 < sparse < 40
    assert bench.estimate_seconds("dense-hybrid", 64 * K, "qwen2.5-7b", {}) > 16
    assert bench.estimate_seconds("dense", 64 * K, "tiny-qwen2", {}) == 0.0


def test_annotate_and_summarise():
    bench = load_bench()
    K = 1024
    rows = [dict(variant="dense", tokens=32 * K, step_seconds=10.0, peak_gpu_gib=40.0),
            dict(variant="dense-offload", tokens=32 * K, step_seconds=10.2, peak_gpu_gib=30.0),
            dict(variant="dense-offload", tokens=64 * K, step_seconds=30.0, peak_gpu_gib=30.01),
            dict(variant="dense", tokens=64 * K, oom=True, error="OutOfMemoryError")]
    bench.annotate(rows)
    assert abs(rows[1]["offload_overhead"] - 0.02) < 1e-9
    assert abs(rows[2]["gpu_growth_mib_per_10k"] - 0.01 * 1024 / 3.2768) < 1e-9
    goals = bench.summarise(rows)
    assert goals["longest_dense_tokens"] == 64 * K
    assert set(goals["offload_overhead"]) == {"32K"}


def test_kernel_suffix_and_sparse_speedup():
    bench = load_bench()
    K = 1024
    assert bench.base_variant("dense-offload+membar@16K") == "dense-offload"
    assert bench.dense_kernel_of("dense+membar") == "membar" and bench.dense_kernel_of("dense@8K") == "auto"
    rows = [dict(variant="full", tokens=128 * K, step_seconds=40.0, peak_gpu_gib=90.0),
            dict(variant="dense", tokens=128 * K, step_seconds=44.0, peak_gpu_gib=58.0),
            dict(variant="dense+membar", tokens=128 * K, step_seconds=68.0, peak_gpu_gib=58.0),
            dict(variant="dense-offload+membar", tokens=128 * K, step_seconds=70.0, peak_gpu_gib=37.0),
            dict(variant="dense-offload@16K", tokens=256 * K, step_seconds=160.0, peak_gpu_gib=37.0),
            dict(variant="sparse-offload", tokens=256 * K, step_seconds=80.0, peak_gpu_gib=37.0),
            dict(variant="sparse", tokens=256 * K, step_seconds=50.0, peak_gpu_gib=79.0)]
    bench.annotate(rows)
    # An offloaded variant is compared with the resident one of the same kernels.
    assert abs(rows[3]["offload_overhead"] - (70.0 / 68.0 - 1)) < 1e-9
    goals = bench.summarise(rows)
    assert abs(goals["dense_vs_full_step_time_128k"] - 1.1) < 1e-9
    assert abs(goals["dense_vs_full_step_time_128k_membar_kernels"] - 1.7) < 1e-9
    assert goals["sparse_speedup_tokens"] == 256 * K and goals["sparse_speedup"] == 160.0 / 50.0
    assert goals["sparse_speedup_variants"] == ["sparse", "dense-offload@16K"]


def test_sweep_runs_on_the_cpu_and_writes_results(tmp_path):
    environment = dict(os.environ, MEMBAR_RESULTS_DIR=str(tmp_path),
                       PYTHONPATH=str(REPO / "bindings" / "python"), OMP_NUM_THREADS="1")
    command = [sys.executable, str(REPO / "bench" / "oomb_bench.py"), "--device", "cpu", "--model", "tiny-qwen2",
               "--contexts", "256,512", "--variants", "dense,dense+plain,dense+dp,dense-offload,dense-offload+depth4+piece32,dense-hybrid,sparse-hybrid", "--chunk", "64", "--page-tokens", "16",
               "--history-block-tokens", "128", "--gpu-budget", "20MiB", "--time-budget", "120", "--time-limit", "100"]
    finished = subprocess.run(command, capture_output=True, text=True, timeout=200, env=environment)
    assert finished.returncode == 0, finished.stderr[-2000:]
    report = json.loads((tmp_path / "oomb_bench.json").read_text())
    rows = {(r["variant"], r["tokens"]): r for r in report["results"]}
    assert set(rows) == {(v, t) for v in ("dense", "dense+plain", "dense+dp", "dense-offload", "dense-offload+depth4+piece32",
                                          "dense-hybrid", "sparse-hybrid") for t in (256, 512)}
    assert rows[("dense-offload", 512)]["prefetch_depth"] == 2
    assert rows[("dense-offload+depth4+piece32", 512)]["prefetch_depth"] == 4
    assert rows[("dense-offload+depth4+piece32", 512)]["loss_piece_tokens"] == 32
    assert rows[("dense-offload", 512)]["loss_piece_tokens"] == 512   # OOMBConfig's default
    assert rows[("dense", 512)]["vs_plain"] > 0 and rows[("dense-offload", 512)]["vs_plain"] > 0
    assert rows[("dense+dp", 512)]["vs_single_process"] > 0   # data parallel, world size 1, gloo
    assert "data_parallel_world1_vs_single_process" in report["goals"]
    assert "runtime_vs_plain_tensors" in report["goals"]
    assert all("step_seconds" in r for r in rows.values()), report["results"]
    # On the CPU the "GPU" is host memory less the 30 GiB reserve: no layer is planned to stay.
    # (This shape's pages fit in a few 2 MiB frames, under any budget: test_oomb_runtime.py moves pages.)
    assert rows[("dense-hybrid", 512)]["gpu_resident_layers"] == 0
    assert rows[("sparse-hybrid", 512)]["gpu_resident_layers"] == 0 and rows[("sparse-hybrid", 512)]["bytes_moved_gib"] >= 0
    offloaded = rows[("dense-offload", 512)]
    assert offloaded["bytes_moved_gib"] >= 0 and offloaded["device_pool_gib"] <= 20 / 1024
    assert "offload_overhead" in offloaded and "gpu_growth_mib_per_10k" in offloaded
    assert "dense-offload" in (tmp_path / "oomb_bench.txt").read_text()


def test_long_steps_report_how_far_they_got(tmp_path):
    """MEMBAR_PROGRESS_SECONDS: the trainer says how far a step got at most every N seconds and at the
    end of each stage; the bench passes the lines on (a step stopped by its time limit says where)."""
    environment = dict(os.environ, MEMBAR_RESULTS_DIR=str(tmp_path), MEMBAR_PROGRESS_SECONDS="3600",
                       PYTHONPATH=str(REPO / "bindings" / "python"), OMP_NUM_THREADS="1")
    command = [sys.executable, str(REPO / "bench" / "oomb_bench.py"), "--device", "cpu", "--model", "tiny-qwen2",
               "--contexts", "512", "--variants", "dense", "--chunk", "64", "--page-tokens", "16"]
    finished = subprocess.run(command, capture_output=True, text=True, timeout=200, env=environment)
    assert finished.returncode == 0, finished.stderr[-2000:]
    lines = [line for line in finished.stderr.splitlines() if line.startswith("[oomb] ")]
    # Every stage's last chunk is reported whatever the interval (warm-up and measured step).
    assert any(line.startswith("[oomb] stage 1: 8 of 8 chunks after ") for line in lines), lines
    assert any(line.startswith("[oomb] stage 2: 8 of 8 chunks after ") for line in lines), lines
    assert not any(" 4 of 8 " in line for line in lines), "at most one line per interval"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_sweep_at_the_half_billion_shape(tmp_path):
    """The benchmark's own path on CUDA (child process, page pools reserved, layer recompute,
    streamed offload, sparse offload), small enough for the gpu test stage (~40 s)."""
    environment = dict(os.environ, MEMBAR_RESULTS_DIR=str(tmp_path), PYTHONPATH=str(REPO / "bindings" / "python"))
    command = [sys.executable, str(REPO / "bench" / "oomb_bench.py"), "--model", "qwen2.5-0.5b",
               "--contexts", "8K,16K", "--variants", "dense,dense-offload@4K,sparse-offload:16K", "--chunk", "2048",
               "--top-k", "16", "--time-budget", "150", "--time-limit", "120"]
    finished = subprocess.run(command, capture_output=True, text=True, timeout=240, env=environment)
    print(finished.stdout[-3000:])
    assert finished.returncode == 0, finished.stderr[-3000:]
    report = json.loads((tmp_path / "oomb_bench.json").read_text())
    failures = [r for r in report["results"] if "step_seconds" not in r]
    assert not failures, failures
    growth = report["goals"]["gpu_mib_per_10k_tokens_dense_offload_block_4K"]
    print(f"0.5B, 8K -> 16K, history blocks of 4K: GPU growth {growth:.1f} MiB per 10K tokens")


def test_partial_steps_are_not_whole_steps():
    bench = load_bench()
    K = 1024
    rows = [dict(variant="dense-hybrid", tokens=1024 * K, step_seconds=400.0, peak_gpu_gib=120.0, partial_step=True,
                 host_peak_rss_gib=90.0, stage1_seconds=380.0, stage2_seconds=20.0, stage2_chunks_run=2,
                 stage2_chunks_total=256, estimated_step_seconds=1700.0, step_seconds_upper_bound=2900.0),
            dict(variant="dense", tokens=128 * K, step_seconds=45.0, peak_gpu_gib=58.0)]
    bench.annotate(rows)
    assert "gpu_growth_mib_per_10k" not in rows[0]
    goals = bench.summarise(rows)
    assert goals["longest_dense_tokens"] == 128 * K
    assert goals["longest_dense_tokens_partial_step"] == 1024 * K
    assert goals["longest_dense_partial_step"]["estimated_step_seconds"] == 1700.0
    assert "whole step ~1700 s (<= 2900 s)" in bench.format_row(rows[0])


def test_the_plain_baseline_gives_the_runtime_s_gradient_bits():
    """The benchmarks' baseline store (plain tensors) and the runtime compute the same step."""
    sys.path.insert(0, str(REPO / "bench"))
    from plain_store import PlainKVStore
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from membar.oomb import OOMBConfig, OOMBTrainer
    from membar.oomb.runtime_store import RuntimeKVStore

    torch.manual_seed(0)
    model = Qwen2ForCausalLM(Qwen2Config(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                         num_key_value_heads=2, intermediate_size=96, vocab_size=97))
    input_ids = torch.randint(0, 97, (1, 300), generator=torch.Generator().manual_seed(1))
    grads = []
    for store in (PlainKVStore("cpu"), RuntimeKVStore("cpu")):
        model.zero_grad()
        OOMBTrainer(model, OOMBConfig(chunk_tokens=64, page_tokens=16, deterministic=True), store=store).step(input_ids)
        grads.append([parameter.grad.clone() for parameter in model.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(*grads))


def test_the_streamed_plain_baseline_reads_blocks_and_trains_as_one_call():
    """"+streamed": the plain store has the trainer read its history in blocks as offloaded pages
    are read (no access longer than a block), and the gradients stay those of one call."""
    sys.path.insert(0, str(REPO / "bench"))
    from plain_store import PlainKVStore
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from membar.oomb import OOMBConfig, OOMBTrainer

    torch.manual_seed(0)
    model = Qwen2ForCausalLM(Qwen2Config(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                         num_key_value_heads=2, intermediate_size=96, vocab_size=97))
    input_ids = torch.randint(0, 97, (1, 300), generator=torch.Generator().manual_seed(1))
    grads, longest = [], []
    for streamed in (False, True):
        store = PlainKVStore("cpu", streamed=streamed)
        read = store.history
        pages = []
        store.history = lambda access, tokens: (pages.append(access.num_pages), read(access, tokens))[1]
        model.zero_grad()
        config = OOMBConfig(chunk_tokens=64, page_tokens=16, history_block_tokens=64, deterministic=True)
        OOMBTrainer(model, config, store=store).step(input_ids)
        grads.append([parameter.grad.clone() for parameter in model.parameters()])
        longest.append(max(pages))
    assert longest == [16, 4]   # 256 tokens of history at the last chunk in one access, then blocks of 4 pages
    for one_call, blocks in zip(*grads):
        torch.testing.assert_close(blocks, one_call, rtol=1e-4, atol=1e-6)


def test_hybrid_through_membard_plans_against_the_daemons_pools(tmp_path, membard):
    """With $MEMBAR_SOCKET the hybrid variants plan their GPU-resident layers from what membard's
    pools have left (host backend: its "GPU" tier holds both of the tiny model's layers)."""
    environment = dict(os.environ, MEMBAR_RESULTS_DIR=str(tmp_path), MEMBAR_SOCKET=membard(gpu_pool="64MiB"),
                       PYTHONPATH=str(REPO / "bindings" / "python"), OMP_NUM_THREADS="1")
    command = [sys.executable, str(REPO / "bench" / "oomb_bench.py"), "--device", "cpu", "--model", "tiny-qwen2",
               "--contexts", "512", "--variants", "sparse-hybrid", "--chunk", "64", "--page-tokens", "16",
               "--history-block-tokens", "128", "--time-limit", "100"]
    finished = subprocess.run(command, capture_output=True, text=True, timeout=200, env=environment)
    assert finished.returncode == 0, finished.stderr[-2000:]
    (row,) = json.loads((tmp_path / "oomb_bench.json").read_text())["results"]
    assert row.get("error") is None, row
    assert row["planned_against"] == "membard" and row["gpu_resident_layers"] == 2


def test_waits_summary_lists_each_timed_row_by_kind_longest_first(tmp_path):
    """tools/waits_summary.py (the waits256 session step): a "+timewaits" row's waits per access kind
    and phase, the longest total first; a row without timed waits gets its host line only where pages
    moved (the runtime's host time, maps and fence waits), and plain-tensor rows are left out."""
    spec = importlib.util.spec_from_file_location("waits_summary", REPO / "tools" / "waits_summary.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    path = tmp_path / "oomb_bench.json"
    path.write_text(json.dumps({"results": [
        {"variant": "dense+plain", "tokens": 262144, "step_seconds": 151.2, "store_host_seconds": 0.0,
         "gpu_maps": 0, "bytes_moved_gib": 0.0},
        {"variant": "dense-offload+displace8", "tokens": 262144, "step_seconds": 155.0, "store_host_seconds": 20.0,
         "gpu_maps": 1000, "fence_waits": 12, "store_fence_wait_seconds": 0.5, "bytes_moved_gib": 2900.0,
         "store_call_seconds": {"lock_wait": 1.0, "locked": 6.0, "enqueue": 2.5, "deliver": 4.0},
         "store_map_apply_seconds": 3.0, "map_runs": 700, "store_map_wait_seconds": 0.25, "async_maps": True},
        {"variant": "dense-offload+timewaits", "tokens": 262144, "step_seconds": 160.0, "stream_wait_seconds": 9.0,
         "stream_wait_by_kind": {"kv:forward": {"seconds": 1.5, "waits": 10, "longest_ms": 3.0},
                                 "dkv:backward": {"seconds": 7.5, "waits": 20, "longest_ms": 40.0}}}]}))
    lines = module.summary(str(path))
    assert len(lines) == 4, lines
    assert lines[0] == ("dense-offload+displace8 at 262144 tokens: 155.0 s; the host spent 20.00 s in the store's "
                        "runtime calls, 1000 GPU frames mapped, 12 fence waits (0.50 s), 2900.0 GiB moved; runtime calls: "
                        "lock wait 1.00 s, locked 6.00 s (enqueue 2.50 s), deliver 4.00 s; maps applied on a mapping "
                        "thread in 3.00 s (700 runs), calls waited 0.25 s for them")
    assert lines[1].startswith("dense-offload+timewaits at 262144 tokens: 160.0 s")
    assert "dkv:backward" in lines[2] and "7.50 s in      20 waits, longest 40.0 ms" in lines[2]
    assert "kv:forward" in lines[3]


def test_trace_streams_finds_the_compute_stream_s_idle_gaps(tmp_path):
    """tools/trace_streams.py ("+profile" on the GPU): busy time per stream as the union of its
    events, and the busiest stream's idle gaps, longest first, named by what ran before them."""
    spec = importlib.util.spec_from_file_location("trace_streams", REPO / "tools" / "trace_streams.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    ms = 1000   # trace times are microseconds
    events = [
        {"ph": "X", "cat": "kernel", "name": "attention", "ts": 0, "dur": 4000 * ms, "args": {"stream": 7}},
        {"ph": "X", "cat": "kernel", "name": "overlapping", "ts": 3000 * ms, "dur": 2000 * ms, "args": {"stream": 7}},
        {"ph": "X", "cat": "kernel", "name": "mlp", "ts": 8000 * ms, "dur": 1000 * ms, "args": {"stream": 7}},
        {"ph": "X", "cat": "kernel", "name": "merge", "ts": 9500 * ms, "dur": 500 * ms, "args": {"stream": 7}},
        {"ph": "X", "cat": "gpu_memcpy", "name": "Memcpy HtoD", "ts": 100, "dur": 3000 * ms, "args": {"stream": 20}},
        {"ph": "X", "cat": "cpu_op", "name": "aten::add", "ts": 0, "dur": 99999 * ms},
    ]
    path = tmp_path / "trace.json"
    path.write_text(json.dumps({"traceEvents": events}))
    lines = module.summary(str(path))
    assert lines[0] == "stream 7: busy 6.50 s of a 10.00 s window (4 kernels, 0 copies, 0 memsets)"
    assert lines[1] == "stream 20: busy 3.00 s of a 3.00 s window (0 kernels, 1 copies, 0 memsets)"
    assert lines[2] == "stream 7 (the busiest) idle 3.50 s in 2 gaps; gaps over 1 ms: 3.50 s in 2"
    assert lines[3] == "  gap  3000.00 ms after overlapping"
    assert lines[4] == "  gap   500.00 ms after mlp"
