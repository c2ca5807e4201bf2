"""The Hopper (wgmma) forward layouts (Note [Warpgroup forward] in
kernels/cuda/attention_forward_wgmma.cuh) against the mma.sync forward and the float32 reference,
at every head size (64, 96, 128, 256) and in bf16 and fp16.

Each layout runs in a subprocess (asked for by name through the op's `layout` argument), so that
an illegal memory access or a hang fails one test cleanly instead of poisoning the CUDA context of
every later test. The child runs every case on fresh random inputs (several seeds) through the
mma.sync layout another GPU would run (baseline_layout) and the wgmma one and prints one JSON line
per case with both errors against membar.attention.reference_chunk_attention in float32 (a
history-only reference for attend_chunk=False); the parent asserts. A wgmma layout's error may be
at most twice the baseline's, plus a small absolute slack for rounding-order noise. `-s` also
prints a timing line (TFLOP/s of the baseline, the wgmma one and SDPA flash at a 32K history,
chunk 4096).

Run (about a minute on an H200):
    python3 -m pytest -s -m gpu tests/python/test_attention_wgmma.py
"""
import json
import math
import os
import subprocess
import sys

import pytest
import torch


def baseline_layout(case, head_dim=128):
    """The mma.sync layout a GPU without wgmma runs for this case (choose_forward_layout): 128-key
    blocks for pages of 128, 64-key ones for pages of 64, 64-row CTAs at head_dim 256. Where a wgmma
    layout does not fit (sparse tiles of 64 rows), both fall back to the same chosen layout."""
    page_tokens = case[2]
    if head_dim == 256:
        return "w4r16_k64_s2_shift_pad"
    return "w8r16_k128_s3_qreg_shift" if page_tokens % 128 == 0 else "w8r16_k64_s3_qreg_shift"


# (layout, dtype, head_dim) checked: each warpgroup layout at the head sizes and dtypes it is
# compiled for (128-key blocks and three stages do not fit beside a Q tile of head_dim 256).
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16}
VARIANTS = {
    "wgmma_w8r64_k128_s2": [("bfloat16", 128), ("float16", 128), ("float16", 96)],
    "wgmma_w8r64_k64_s3": [("bfloat16", 128), ("float16", 96)],
    "wgmma_w8r64_k64_s3_2cta": [("float16", 64), ("bfloat16", 64)],
    "wgmma_w8r64_k64_s2": [("bfloat16", 256), ("float16", 256)],
    # Note [Warp-specialised forward]: chosen on Hopper at head sizes 64, 96 and 128 (pages of 128).
    "wgmma_ws_w12r64_k128_s2": [("bfloat16", 128), ("float16", 128), ("bfloat16", 96), ("float16", 96),
                                ("bfloat16", 64), ("float16", 64)],
}


# (chunk_tokens, history_tokens, page_tokens, q_heads, kv_heads, attend_chunk, sparse tile or 0, top_k)
CASES = [
    (4096, 0, 128, 28, 4, True, 0, 0),
    (4096, 100, 128, 28, 4, True, 0, 0),          # one partial page
    (4096, 32 * 128, 128, 28, 4, True, 0, 0),     # 32 pages
    (300, 0, 128, 8, 8, True, 0, 0),              # a chunk that is not a tile multiple
    (300, 100, 64, 8, 8, True, 0, 0),
    (300, 32 * 64 - 17, 64, 28, 4, True, 0, 0),   # 32 pages of 64, the last partial
    (300, 1000, 128, 8, 8, False, 0, 0),          # a history block without the chunk
    (4096, 32 * 64, 64, 28, 4, False, 0, 0),
    (300, 0, 64, 8, 8, False, 0, 0),              # no key at all: out 0, lse -inf
    (512, 2000, 128, 8, 8, True, 128, 4),         # sparse, tiles of whole CTAs
    (300, 1100, 128, 28, 4, True, 128, 3),        # sparse, the last tile (and CTA) partial
    (4096, 3000, 128, 28, 4, True, 4096, 8),      # sparse, one selection per chunk (oomb_bench --query-tile)
    (300, 1100, 128, 8, 8, True, 64, 3),          # sparse tiles of 64: the default kernel runs
    (300, 2 * 128 + 30, 128, 8, 8, True, 128, 4),  # sparse, all 3 pages selected: the last page's 30 tokens
                                                   # leave a 64-key block without a row (64-key layouts)
]
# Two fixed seeds and a fresh one per run.
SEEDS = (1, 2, int.from_bytes(os.urandom(4), "little"))


# ---------------------------------------------------------------------------------------------
# Child: runs in its own process (python3 tests/python/test_attention_wgmma.py <mode> <layout>).

def make_problem(case, seed, device, dtype=torch.bfloat16, head_dim=128):
    chunk_tokens, history_tokens, page_tokens, q_heads, kv_heads, attend_chunk, tile, top_k = case
    generator = torch.Generator().manual_seed(seed)
    num_pages = (history_tokens + page_tokens - 1) // page_tokens
    pool_pages = num_pages + 3
    d = head_dim

    def randn(*shape):
        return torch.randn(*shape, generator=generator).to(dtype).to(device)

    problem = {
        "q": randn(chunk_tokens, q_heads, d), "k": randn(chunk_tokens, kv_heads, d),
        "v": randn(chunk_tokens, kv_heads, d),
        "k_pool": randn(pool_pages, page_tokens, kv_heads, d), "v_pool": randn(pool_pages, page_tokens, kv_heads, d),
        "k_index": torch.randperm(pool_pages, generator=generator)[:num_pages].to(torch.int32).to(device),
        "v_index": torch.randperm(pool_pages, generator=generator)[:num_pages].to(torch.int32).to(device),
        "selection": None, "tile": tile or 128,
    }
    if tile:
        tiles = (chunk_tokens + tile - 1) // tile
        selection = torch.full((tiles, top_k), -1, dtype=torch.int32)
        for t in range(tiles):
            chosen = torch.randperm(num_pages, generator=generator)[:top_k - 1].to(torch.int32)
            selection[t, :chosen.numel()] = chosen
        problem["selection"] = selection.to(device)
    return problem


def reference(problem, case):
    """(out, lse) in float32: the chunk reference of membar.attention, or history only."""
    import membar.attention as attention

    chunk_tokens, history_tokens, page_tokens, q_heads, kv_heads, attend_chunk, tile, top_k = case
    p = {name: value.float() if isinstance(value, torch.Tensor) and value.is_floating_point() else value
         for name, value in problem.items()}
    if attend_chunk:
        return attention.reference_chunk_attention(p["q"], p["k"], p["v"], p["k_pool"], p["k_index"], p["v_pool"],
                                                   p["v_index"], history_tokens, None, p["selection"], p["tile"])
    assert p["selection"] is None, "the history-only reference is dense"
    if history_tokens == 0:
        return (torch.zeros_like(p["q"]), torch.full((q_heads, chunk_tokens), float("-inf"), device=p["q"].device))
    group = q_heads // kv_heads
    head_dim = p["q"].shape[-1]
    keys = p["k_pool"][p["k_index"].long()].reshape(-1, kv_heads, head_dim)[:history_tokens]
    values = p["v_pool"][p["v_index"].long()].reshape(-1, kv_heads, head_dim)[:history_tokens]
    keys = keys.repeat_interleave(group, dim=1)      # [history, Hq, D]
    values = values.repeat_interleave(group, dim=1)  # [history, Hq, D]
    scale = attention._scale(head_dim, None)
    scores = torch.einsum("thd,lhd->htl", p["q"], keys) * scale  # [Hq, Tc, history]
    lse = torch.logsumexp(scores, dim=-1)
    out = torch.einsum("htl,lhd->thd", torch.exp(scores - lse[..., None]), values)
    return out, lse


def forward(problem, case, layout):
    import membar.attention as attention

    history_tokens, attend_chunk = case[1], case[5]
    return torch.ops.membar.paged_attention_forward(
        problem["q"], problem["k"], problem["v"], problem["k_pool"], problem["k_index"], problem["v_pool"],
        problem["v_index"], history_tokens, attention._scale(problem["q"].shape[-1], None), problem["selection"],
        problem["tile"],
        attend_chunk, layout)


def error(got, want):
    """Largest absolute difference where `want` is finite; None when the -inf pattern differs."""
    got, want = got.float(), want.float()
    finite = torch.isfinite(want)
    if not torch.equal(torch.isfinite(got), finite):
        return None
    return (got[finite] - want[finite]).abs().max().item() if finite.any() else 0.0


def child_check(layout, dtype, head_dim):
    import membar  # noqa: F401  (loads the ops library)

    for case in CASES:
        for seed in SEEDS:
            problem = make_problem(case, seed, "cuda", DTYPES[dtype], head_dim)
            default_out, default_lse = forward(problem, case, baseline_layout(case, head_dim))
            out, lse = forward(problem, case, layout)
            torch.cuda.synchronize()
            want_out, want_lse = reference(problem, case)
            no_key = ~torch.isfinite(want_lse)  # [Hq, Tc]
            zero_rows = bool((out.float().transpose(0, 1)[no_key] == 0).all().item()) if no_key.any() else True
            print(json.dumps({
                "case": list(case), "seed": seed,
                "out": error(out, want_out), "lse": error(lse, want_lse),
                "default_out": error(default_out, want_out), "default_lse": error(default_lse, want_lse),
                "lse_scale": want_lse[torch.isfinite(want_lse)].abs().max().item() if (~no_key).any() else 0.0,
                "no_key_rows_zero": zero_rows,
            }), flush=True)


def child_timing(layout, dtype, head_dim):
    import membar  # noqa: F401
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.attention.bias import causal_lower_right

    chunk, history, page, q_heads, kv_heads = 4096, 32768, 128, 28, 4
    problem = make_problem((chunk, history, page, q_heads, kv_heads, True, 0, 0), 7, "cuda", DTYPES[dtype], head_dim)
    case = (chunk, history, page, q_heads, kv_heads, True, 0, 0)
    flops = 4.0 * chunk * q_heads * head_dim * (history + chunk / 2)

    # The median of CUDA-event timings, as bench/attention_bench.py measures (one warm-up call).
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "bench"))
    from attention_bench import time_ms as bench_time_ms

    def time_ms(function):
        return bench_time_ms(function, warmup=1)

    default_ms = time_ms(lambda: forward(problem, case, baseline_layout(case, head_dim)))
    layout_ms = time_ms(lambda: forward(problem, case, layout))
    group = q_heads // kv_heads
    keys = torch.cat([problem["k_pool"][problem["k_index"].long()].reshape(-1, kv_heads, head_dim), problem["k"]])
    values = torch.cat([problem["v_pool"][problem["v_index"].long()].reshape(-1, kv_heads, head_dim), problem["v"]])
    sq = problem["q"].transpose(0, 1).unsqueeze(0)
    sk = keys.repeat_interleave(group, dim=1).transpose(0, 1).unsqueeze(0)
    sv = values.repeat_interleave(group, dim=1).transpose(0, 1).unsqueeze(0)
    mask = causal_lower_right(sq.shape[2], sk.shape[2])

    def sdpa():
        with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
            torch.nn.functional.scaled_dot_product_attention(sq, sk, sv, attn_mask=mask)

    sdpa_ms = time_ms(sdpa)
    print(json.dumps({"default_tflops": flops / default_ms / 1e9, "layout_tflops": flops / layout_ms / 1e9,
                      "sdpa_tflops": flops / sdpa_ms / 1e9}), flush=True)


if __name__ == "__main__":
    mode, name = sys.argv[1], sys.argv[2]
    (child_check if mode == "check" else child_timing)(name, sys.argv[3], int(sys.argv[4]))
    sys.exit(0)


# ---------------------------------------------------------------------------------------------
# Parent: the pytest tests.

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)
if torch.cuda.get_device_capability() != (9, 0):
    pytest.skip("the wgmma layouts need a Hopper (sm_90) GPU", allow_module_level=True)

import membar  # noqa: E402,F401  (loads the ops library)

if not hasattr(torch.ops.membar, "attention_cuda_layouts"):
    pytest.skip("the ops library was built without CUDA", allow_module_level=True)

WGMMA_LAYOUTS = [name for name in torch.ops.membar.attention_cuda_layouts("forward") if name.startswith("wgmma")]


def run_child(mode, layout, timeout, *arguments):
    environment = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    finished = subprocess.run([sys.executable, os.path.abspath(__file__), mode, layout, *map(str, arguments)],
                              capture_output=True, text=True, timeout=timeout, env=environment)
    assert finished.returncode == 0, (layout, finished.returncode, finished.stdout[-3000:], finished.stderr[-3000:])
    return [json.loads(line) for line in finished.stdout.splitlines() if line.startswith("{")]


def test_wgmma_layouts_are_compiled_and_chosen():
    assert sorted(WGMMA_LAYOUTS) == sorted(VARIANTS), WGMMA_LAYOUTS
    # On Hopper the choice runs them for every dtype and head size (pages of 128 and 64).
    for dtype in (torch.bfloat16, torch.float16):
        for head_dim in (64, 96, 128):
            assert torch.ops.membar.attention_cuda_layout("forward", dtype, head_dim, 128) == "wgmma_ws_w12r64_k128_s2"
        for head_dim in (96, 128):
            assert torch.ops.membar.attention_cuda_layout("forward", dtype, head_dim, 64) == "wgmma_w8r64_k64_s3"
        assert torch.ops.membar.attention_cuda_layout("forward", dtype, 64, 64) == "wgmma_w8r64_k64_s3_2cta"
        for page_tokens in (64, 128):
            assert torch.ops.membar.attention_cuda_layout("forward", dtype, 256, page_tokens) == "wgmma_w8r64_k64_s2"


@pytest.mark.parametrize("layout,dtype,head_dim",
                         [(layout, dtype, head_dim) for layout, variants in VARIANTS.items()
                          for dtype, head_dim in variants])
def test_wgmma_forward_matches_reference(layout, dtype, head_dim):
    records = run_child("check", layout, 150, dtype, head_dim)
    assert len(records) == len(CASES) * len(SEEDS), records
    for record in records:
        label = (layout, dtype, head_dim, record["case"], record["seed"])
        assert record["out"] is not None and record["lse"] is not None, ("-inf pattern differs", label, record)
        assert record["default_out"] is not None and record["default_lse"] is not None, ("default", label, record)
        assert record["no_key_rows_zero"], ("a row without keys must get out 0", label)
        assert record["out"] <= 2 * record["default_out"] + 1e-3, ("out", label, record)
        lse_slack = 1e-5 * max(1.0, record["lse_scale"])
        assert record["lse"] <= 2 * record["default_lse"] + lse_slack, ("lse", label, record)


@pytest.mark.parametrize("layout", WGMMA_LAYOUTS)
def test_wgmma_forward_timing(layout):
    dtype, head_dim = VARIANTS[layout][0]
    (record,) = run_child("timing", layout, 150, dtype, head_dim)
    print(f"\n[wgmma timing] {layout}: {record['layout_tflops']:.0f} TFLOP/s; "
          f"{baseline_layout((0, 0, 128), head_dim)} {record['default_tflops']:.0f}; SDPA flash "
          f"{record['sdpa_tflops']:.0f} (history 32768, chunk 4096, 28/4 heads, {dtype}, D {head_dim})")
    assert math.isfinite(record["layout_tflops"])
