"""The Hopper (wgmma) backward layouts: wgmma_ws_w12_k128 (Note [Warp-specialised backward] in
kernels/cuda/attention_backward_wgmma_ws.cuh), which the library runs on Hopper for head size 128 in
pages of 128 since session 32, wgmma_w8_k128 (Note [Warpgroup backward] in
kernels/cuda/attention_backward_wgmma.cuh) for head sizes 64 and 96, and wgmma_w8_k64_d2 (Note [Warpgroup backward at head size 256] in
attention_backward_wgmma_d2.cuh) for head size 256, against the mma.sync layouts they replaced
there (which other GPUs run) and the float32 reference. Both run through the library's op, asked for
by name (its `layout` argument).

Each check runs in a subprocess, so that an illegal memory access or a hang fails one test cleanly
instead of poisoning the CUDA context of every later test. The child runs every case on fresh
random inputs (several seeds; grad pages with random initial contents, so that the kernel must ADD
into them; bf16 and fp16 inputs; head sizes 128, 64, 96 and 256) through both layouts, in three
modes (fp32 grad pages, bf16 grad pages, fp32 pages deterministic), and prints one JSON line per
(case, seed, dtype, mode) with both errors against the float32 reference
(membar.attention.reference_chunk_attention_backward; a history-only reference for
attend_chunk=False); the parent asserts. The layout's error may be at most twice the baseline's,
plus a small slack for rounding-order noise. Soft-capped and windowed calls are checked against
their references by test_attention_cuda.py (the chosen layout) and by the C++ gpu tests (every
compiled layout that fits). The deterministic mode's dQ (a pass of its own) must be within twice
the default mode's dQ error. `-s` also prints a timing line (backward TFLOP/s of both layouts and
SDPA flash at a 32K history, chunk 4096, 28/4 heads, head size 128).

Run on an H200 (about a minute for the whole file):
    python3 -m pytest -s -m gpu tests/python/test_attention_wgmma_backward.py
"""
import json
import math
import os
import subprocess
import sys

import pytest
import torch

LAYOUT = "wgmma_ws_w12_k128"
WARPGROUP = "wgmma_w8_k128"
SPLIT = "w8_k128_split_s2_pad"
DTYPES = ("bfloat16", "float16")
HEAD_DIMS = (128, 64, 96, 256)
# The layout under test and the mma.sync one it replaced, per head size (the split layout needs whole
# 64-column groups: at 96 the one-warp-per-16-keys layout; at 256 the two-pass one).
LAYOUTS = {128: LAYOUT, 64: WARPGROUP, 96: WARPGROUP, 256: "wgmma_w8_k64_d2"}
BASELINE = {128: SPLIT, 64: SPLIT, 96: "w8_k128_dq64", 256: "w4_k64_dq32_pad_s2_d2"}
BENCH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "bench")

# (chunk_tokens, history_tokens, page_tokens, q_heads, kv_heads, attend_chunk, sparse tile or 0, top_k)
CASES = [
    (1024, 0, 128, 28, 4, True, 0, 0),            # chunk keys only (causal blocks)
    (1024, 1000, 128, 28, 4, True, 0, 0),         # GQA 28/4, a partial last page
    (300, 32 * 128 - 17, 128, 8, 8, True, 0, 0),  # a chunk that is not a block multiple, 32 pages
    (300, 1000, 128, 8, 8, False, 0, 0),          # a history block without the chunk
    (1024, 2000, 128, 28, 4, False, 0, 0),
    (512, 2000, 128, 8, 8, True, 128, 4),         # sparse, tiles of 128
    (300, 1100, 128, 28, 4, True, 128, 3),        # sparse, the last tile partial
    (300, 1100, 128, 8, 8, True, 64, 3),          # sparse tiles of 64
]
# Head size 256 runs pages of 64 too (64 keys a CTA).
CASES_256 = CASES + [
    (300, 1000, 64, 8, 8, True, 0, 0),            # pages of 64, a partial last page
    (512, 2000, 64, 8, 8, True, 128, 4),          # sparse over pages of 64
]
SEEDS = (1, 2)
# (grad page dtype, deterministic)
MODES = (("float32", False), ("bfloat16", False), ("float32", True))
OUTPUTS = ("dq", "dk", "dv", "dk_pool", "dv_pool")


# ---------------------------------------------------------------------------------------------
# Child: runs in its own process (python3 tests/python/test_attention_wgmma_backward.py <mode>).

def make_problem(case, seed, device, dtype="bfloat16", head_dim=128):
    chunk_tokens, history_tokens, page_tokens, q_heads, kv_heads, attend_chunk, tile, top_k = case
    element = getattr(torch, dtype)
    generator = torch.Generator().manual_seed(seed)
    num_pages = (history_tokens + page_tokens - 1) // page_tokens
    pool_pages = num_pages + 3

    def randn(*shape, scale=1.0):
        return (torch.randn(*shape, generator=generator) * scale).to(element).to(device)

    problem = {
        "q": randn(chunk_tokens, q_heads, head_dim, scale=1.5), "k": randn(chunk_tokens, kv_heads, head_dim),
        "v": randn(chunk_tokens, kv_heads, head_dim), "dout": randn(chunk_tokens, q_heads, head_dim),
        "k_pool": randn(pool_pages, page_tokens, kv_heads, head_dim),
        "v_pool": randn(pool_pages, page_tokens, kv_heads, head_dim),
        "selection": None, "tile": tile or 128,
        # Initial contents of the grad pages (the kernels ADD into them).
        "dk_pool0": (torch.randn(pool_pages, page_tokens, kv_heads, head_dim, generator=generator) * 0.1).to(device),
        "dv_pool0": (torch.randn(pool_pages, page_tokens, kv_heads, head_dim, generator=generator) * 0.1).to(device),
    }
    for name in ("k_index", "v_index", "dk_index", "dv_index"):
        problem[name] = torch.randperm(pool_pages, generator=generator)[:num_pages].to(torch.int32).to(device)
    if tile:
        tiles = (chunk_tokens + tile - 1) // tile
        selection = torch.full((tiles, top_k), -1, dtype=torch.int32)
        for t in range(tiles):
            chosen = torch.randperm(num_pages, generator=generator)[:top_k - 1].to(torch.int32)
            selection[t, :chosen.numel()] = chosen
        problem["selection"] = selection.to(device)
    return problem


def history_only_reference(p, case):
    """(out, lse, dq, dk rows, dv rows) in float32 for attend_chunk=False (dense history only)."""
    import membar.attention as attention

    chunk_tokens, history_tokens, page_tokens, q_heads, kv_heads, attend_chunk, tile, top_k = case
    assert p["selection"] is None, "the history-only reference is dense"
    group = q_heads // kv_heads
    head_dim = p["q"].shape[-1]
    scale = attention._scale(head_dim, None)
    q, dout = p["q"].float(), p["dout"].float()
    keys = p["k_pool"].float()[p["k_index"].long()].reshape(-1, kv_heads, head_dim)[:history_tokens]
    values = p["v_pool"].float()[p["v_index"].long()].reshape(-1, kv_heads, head_dim)[:history_tokens]
    wide_keys = keys.repeat_interleave(group, dim=1)      # [history, Hq, D]
    wide_values = values.repeat_interleave(group, dim=1)  # [history, Hq, D]
    scores = torch.einsum("thd,lhd->htl", q, wide_keys) * scale  # [Hq, Tc, history]
    lse = torch.logsumexp(scores, dim=-1)
    probabilities = torch.exp(scores - lse[..., None])
    out = torch.einsum("htl,lhd->thd", probabilities, wide_values).to(p["q"].dtype)
    delta = (dout * out.float()).sum(-1).transpose(0, 1)  # [Hq, Tc]
    dprobabilities = torch.einsum("thd,lhd->htl", dout, wide_values)
    dscores = probabilities * (dprobabilities - delta[..., None]) * scale
    dq = torch.einsum("htl,lhd->thd", dscores, wide_keys)
    dk = torch.einsum("htl,thd->lhd", dscores, q).reshape(history_tokens, kv_heads, group, head_dim).sum(2)
    dv = torch.einsum("htl,thd->lhd", probabilities, dout).reshape(history_tokens, kv_heads, group, head_dim).sum(2)
    return out, lse, dq, dk, dv


def reference(p, case):
    """The float32 truth: (out in the inputs' dtype, lse, and the expected dq, dk, dv, dk_pool, dv_pool)."""
    import membar.attention as attention

    chunk_tokens, history_tokens, page_tokens, q_heads, kv_heads, attend_chunk, tile, top_k = case
    if attend_chunk:
        f = {name: value.float() if isinstance(value, torch.Tensor) and value.is_floating_point() else value
             for name, value in p.items()}
        out, lse = attention.reference_chunk_attention(f["q"], f["k"], f["v"], f["k_pool"], f["k_index"], f["v_pool"],
                                                       f["v_index"], history_tokens, None, f["selection"], f["tile"])
        out = out.to(p["q"].dtype)
        dq, dk, dv, dk_history, dv_history = attention.reference_chunk_attention_backward(
            f["q"], f["k"], f["v"], f["k_pool"], f["k_index"], f["v_pool"], f["v_index"], out.float(), f["dout"],
            history_tokens, None, f["selection"], f["tile"])
    else:
        out, lse, dq, dk_history, dv_history = history_only_reference(p, case)
        dk = torch.zeros_like(p["k"], dtype=torch.float32)
        dv = torch.zeros_like(p["v"], dtype=torch.float32)
    # The grad pages: their initial contents plus the history rows' gradients, page by page.
    dk_pool, dv_pool = p["dk_pool0"].clone(), p["dv_pool0"].clone()
    for page in range((history_tokens + page_tokens - 1) // page_tokens):
        rows = slice(page * page_tokens, min((page + 1) * page_tokens, history_tokens))
        count = rows.stop - rows.start
        dk_pool[int(p["dk_index"][page]), :count] += dk_history[rows].float()
        dv_pool[int(p["dv_index"][page]), :count] += dv_history[rows].float()
    truth = {"dq": dq.float(), "dk": dk.float(), "dv": dv.float(), "dk_pool": dk_pool, "dv_pool": dv_pool}
    return out, lse.float(), truth


def backward(p, case, out, lse, grad_dtype, deterministic, layout):
    """The backward through the library's op with the CUDA layout named `layout`."""
    import membar.attention as attention

    history_tokens, attend_chunk = case[1], case[5]
    dtype = getattr(torch, grad_dtype)
    dk_pool, dv_pool = p["dk_pool0"].to(dtype).clone(), p["dv_pool0"].to(dtype).clone()
    dq, dk, dv = torch.ops.membar.paged_attention_backward(
        p["q"], p["k"], p["v"], p["k_pool"], p["k_index"], p["v_pool"], p["v_index"], out, p["dout"], lse,
        dk_pool, p["dk_index"], dv_pool, p["dv_index"], history_tokens, attention._scale(p["q"].shape[-1], None),
        p["selection"], p["tile"], deterministic, attend_chunk, layout=layout)
    return {"dq": dq, "dk": dk, "dv": dv, "dk_pool": dk_pool, "dv_pool": dv_pool}


def error(got, want):
    """Largest absolute difference; None where got is not finite (want always is)."""
    got = got.float()
    if not torch.isfinite(got).all():
        return None
    return (got - want).abs().max().item() if want.numel() else 0.0


def child_check():
    import membar  # noqa: F401  (loads the ops library)

    for head_dim in HEAD_DIMS:
        for case in cases_of(head_dim):
            for seed in SEEDS:
                for dtype in DTYPES:
                    check_one(case, seed, dtype, head_dim)


def cases_of(head_dim):
    return CASES_256 if head_dim == 256 else CASES


def check_one(case, seed, dtype, head_dim):
    problem = make_problem(case, seed, "cuda", dtype, head_dim)
    out, lse, truth = reference(problem, case)
    for grad_dtype, deterministic in MODES:
        split = backward(problem, case, out, lse, grad_dtype, deterministic, BASELINE[head_dim])
        got = backward(problem, case, out, lse, grad_dtype, deterministic, LAYOUTS[head_dim])
        torch.cuda.synchronize()
        record = {"case": list(case), "seed": seed, "dtype": dtype, "head_dim": head_dim, "grad_dtype": grad_dtype,
                  "deterministic": deterministic}
        for name in OUTPUTS:
            record[name] = error(got[name], truth[name])
            record["split_" + name] = error(split[name], truth[name])
            record["scale_" + name] = truth[name].abs().max().item() if truth[name].numel() else 0.0
        print(json.dumps(record), flush=True)


def child_timing():
    import membar  # noqa: F401

    sys.path.insert(0, BENCH)
    # The bench's inputs, runners and median of CUDA-event timings (bench/attention_bench.py).
    from attention_bench import CHUNK, forward_flops, make_inputs, membar_runner, sdpa_runner, time_ms

    history = 32768
    p = make_inputs(history)
    backward_flops = 2.5 * forward_flops(CHUNK, history)
    forward, _, state = membar_runner(p)
    forward()
    out, lse = state["out"], state["lse"]
    dk_pool = torch.zeros(p["k_pool"].shape, device="cuda", dtype=torch.float32)
    dv_pool = torch.zeros_like(dk_pool)

    def runner(layout):
        return lambda: torch.ops.membar.paged_attention_backward(
            p["q"], p["k"], p["v"], p["k_pool"], p["k_index"], p["v_pool"], p["v_index"], out, p["dout"], lse,
            dk_pool, p["k_index"], dv_pool, p["v_index"], history, p["scale"], None, 128, False, True, layout=layout)

    layout_ms = time_ms(runner(LAYOUT))
    split_ms = time_ms(runner(SPLIT))
    sdpa_forward, sdpa_forward_backward, _ = sdpa_runner(p)
    sdpa_ms = time_ms(sdpa_forward_backward) - time_ms(sdpa_forward)
    print(json.dumps({"split_tflops": backward_flops / split_ms / 1e9,
                      "layout_tflops": backward_flops / layout_ms / 1e9,
                      "sdpa_tflops": backward_flops / sdpa_ms / 1e9}), flush=True)


if __name__ == "__main__":
    child_check() if sys.argv[1] == "check" else child_timing()
    sys.exit(0)


# ---------------------------------------------------------------------------------------------
# Parent: the pytest tests.

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)
if torch.cuda.get_device_capability() != (9, 0):
    pytest.skip("the wgmma backward needs a Hopper (sm_90) GPU", allow_module_level=True)

import membar  # noqa: E402,F401  (loads the ops library)

if not hasattr(torch.ops.membar, "attention_cuda_layouts"):
    pytest.skip("the ops library was built without CUDA", allow_module_level=True)

def run_child(mode, timeout):
    environment = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    finished = subprocess.run([sys.executable, os.path.abspath(__file__), mode], capture_output=True, text=True,
                              timeout=timeout, env=environment)
    assert finished.returncode == 0, (finished.returncode, finished.stdout[-3000:], finished.stderr[-3000:])
    return [json.loads(line) for line in finished.stdout.splitlines() if line.startswith("{")]


def test_wgmma_backward_is_shipped():
    names = torch.ops.membar.attention_cuda_layouts("backward")
    assert all(name in names for name in [*LAYOUTS.values(), *BASELINE.values()]), names


def test_wgmma_backward_matches_reference():
    records = run_child("check", timeout=500)
    cases = sum(len(cases_of(head_dim)) for head_dim in HEAD_DIMS)
    assert len(records) == cases * len(SEEDS) * len(DTYPES) * len(MODES), records
    for record in records:
        label = (record["case"], record["head_dim"], record["seed"], record["dtype"], record["grad_dtype"],
                 record["deterministic"])
        for name in OUTPUTS:
            assert record["split_" + name] is not None, ("split layout not finite", name, label, record)
            assert record[name] is not None, ("not finite", name, label, record)
            slack = 2e-3 * max(1.0, record["scale_" + name])
            assert record[name] <= 2 * record["split_" + name] + slack, (name, label, record)
    # The deterministic dQ pass (on Hopper the warpgroup one, Note [Warpgroup dQ pass], for both
    # layouts alike) against the default backward's atomically added dQ: within 2x its error.
    default = {(str(r["case"]), r["head_dim"], r["seed"], r["dtype"]): r for r in records
               if r["grad_dtype"] == "float32" and not r["deterministic"]}
    for record in records:
        if not record["deterministic"]:
            continue
        other = default[(str(record["case"]), record["head_dim"], record["seed"], record["dtype"])]
        slack = 2e-3 * max(1.0, record["scale_dq"])
        assert record["dq"] <= 2 * other["dq"] + slack, (record, other)


def test_wgmma_backward_timing():
    (record,) = run_child("timing", timeout=300)
    print(f"\n[wgmma backward timing] {LAYOUT}: {record['layout_tflops']:.0f} TFLOP/s; {SPLIT} "
          f"{record['split_tflops']:.0f}; SDPA flash {record['sdpa_tflops']:.0f} "
          f"(history 32768, chunk 4096, 28/4 heads, D 128)")
    assert math.isfinite(record["layout_tflops"]) and record["layout_tflops"] > 0
