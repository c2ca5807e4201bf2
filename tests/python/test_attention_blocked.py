"""A history streamed in blocks of pages (attend_chunk=False, Note [Blocked history] in
kernels/include/membar/kernels/attention.h) gives the same attention as one call over all of it:
the blocks' forwards plus a chunk-only call, merged by lse, equal the single call's out and lse;
the blocks' backwards, each given the final out and lse, add the same dK/dV into the grad pages
and sum to the same dq. CPU tests run in CI; the CUDA ones are marked gpu."""
import math

import pytest
import torch

import membar  # noqa: F401  (loads the ops library)
from membar.attention import merge_attention

ops = torch.ops.membar


def make_problem(chunk_tokens, history_tokens, page_tokens, q_heads, kv_heads, head_dim, dtype, device, seed):
    """Random chunk and history (pages scattered over shuffled pool rows), dout, and grad pools
    that start from random values."""
    generator = torch.Generator().manual_seed(seed)
    num_pages = (history_tokens + page_tokens - 1) // page_tokens
    pool_pages = num_pages + 2

    def randn(*shape, scale=1.0):
        return (torch.randn(*shape, generator=generator, dtype=torch.float64) * scale).to(dtype).to(device)

    def index():
        return torch.randperm(pool_pages, generator=generator)[:num_pages].to(torch.int32).to(device)

    grad_dtype = torch.float64 if dtype == torch.float64 else torch.float32
    return {
        "q": randn(chunk_tokens, q_heads, head_dim, scale=1.5),
        "k": randn(chunk_tokens, kv_heads, head_dim),
        "v": randn(chunk_tokens, kv_heads, head_dim),
        "dout": randn(chunk_tokens, q_heads, head_dim),
        "k_pool": randn(pool_pages, page_tokens, kv_heads, head_dim),
        "v_pool": randn(pool_pages, page_tokens, kv_heads, head_dim),
        "k_index": index(), "v_index": index(), "dk_index": index(), "dv_index": index(),
        "dk_pool0": randn(pool_pages, page_tokens, kv_heads, head_dim, scale=0.1).to(grad_dtype),
        "dv_pool0": randn(pool_pages, page_tokens, kv_heads, head_dim, scale=0.1).to(grad_dtype),
        "history_tokens": history_tokens,
        "page_tokens": page_tokens,
        "scale": 1.0 / math.sqrt(head_dim),
    }


def single_call(p, selection=None, tile=128):
    """One forward and backward over the whole history and the chunk."""
    out, lse = ops.paged_attention_forward(p["q"], p["k"], p["v"], p["k_pool"], p["k_index"], p["v_pool"],
                                           p["v_index"], p["history_tokens"], p["scale"], selection, tile)
    dk_pool, dv_pool = p["dk_pool0"].clone(), p["dv_pool0"].clone()
    dq, dk, dv = ops.paged_attention_backward(p["q"], p["k"], p["v"], p["k_pool"], p["k_index"], p["v_pool"],
                                              p["v_index"], out, p["dout"], lse, dk_pool, p["dk_index"], dv_pool,
                                              p["dv_index"], p["history_tokens"], p["scale"], selection, tile)
    return {"out": out, "lse": lse, "dq": dq, "dk": dk, "dv": dv, "dk_pool": dk_pool, "dv_pool": dv_pool}


def page_blocks(p, pages_per_block):
    """(first page, end page, history tokens of the block) for each block of the history."""
    num_pages = p["k_index"].shape[0]
    blocks = []
    for first in range(0, num_pages, pages_per_block):
        end = min(num_pages, first + pages_per_block)
        tokens = min(p["history_tokens"], end * p["page_tokens"]) - first * p["page_tokens"]
        blocks.append((first, end, tokens))
    return blocks


def blocked_calls(p, pages_per_block, selection=None, tile=128):
    """The history in blocks of pages_per_block pages (attend_chunk=False) plus a chunk-only call,
    merged; then each block's backward given the merged out and lse. With a selection, the
    history is one block (a selection numbers the pages of the whole history)."""
    blocks = page_blocks(p, pages_per_block) if selection is None else [(0, p["k_index"].shape[0], p["history_tokens"])]
    empty_index = p["k_index"][:0]
    parts = []
    for first, end, tokens in blocks:
        parts.append(ops.paged_attention_forward(p["q"], p["k"], p["v"], p["k_pool"], p["k_index"][first:end],
                                                 p["v_pool"], p["v_index"][first:end], tokens, p["scale"], selection,
                                                 tile, False))
    parts.append(ops.paged_attention_forward(p["q"], p["k"], p["v"], p["k_pool"], empty_index, p["v_pool"],
                                             empty_index, 0, p["scale"], None, tile, True))
    out, lse = merge_attention(parts)

    dk_pool, dv_pool = p["dk_pool0"].clone(), p["dv_pool0"].clone()
    dq = torch.zeros(p["q"].shape, dtype=torch.float64, device=p["q"].device)
    for first, end, tokens in blocks:
        block_dq, block_dk, block_dv = ops.paged_attention_backward(
            p["q"], p["k"], p["v"], p["k_pool"], p["k_index"][first:end], p["v_pool"], p["v_index"][first:end], out,
            p["dout"], lse, dk_pool, p["dk_index"][first:end], dv_pool, p["dv_index"][first:end], tokens, p["scale"],
            selection, tile, False, False)
        assert not block_dk.any() and not block_dv.any()  # the chunk's keys get nothing from a history block
        dq += block_dq.double()
    chunk_dq, dk, dv = ops.paged_attention_backward(
        p["q"], p["k"], p["v"], p["k_pool"], empty_index, p["v_pool"], empty_index, out, p["dout"], lse, dk_pool,
        empty_index, dv_pool, empty_index, 0, p["scale"], None, tile, False, True)
    dq += chunk_dq.double()
    return {"out": out, "lse": lse, "dq": dq, "dk": dk, "dv": dv, "dk_pool": dk_pool, "dv_pool": dv_pool,
            "parts": parts}


def max_error(a, b):
    return (a.double() - b.double()).abs().max().item() if a.numel() else 0.0


@pytest.mark.parametrize("pages_per_block", [3, 7])
@pytest.mark.parametrize("page_tokens", [16, 37])
def test_blocked_history_equals_one_call_cpu(pages_per_block, page_tokens):
    # 300 history tokens: 19 or 9 pages, the last one partial; 3 or 7 pages per block gives 2-7 blocks.
    p = make_problem(45, 300, page_tokens, 8, 2, 32, torch.float64, "cpu", seed=page_tokens * 10 + pages_per_block)
    whole = single_call(p)
    blocked = blocked_calls(p, pages_per_block)
    for name in ("out", "lse", "dq", "dk", "dv", "dk_pool", "dv_pool"):
        torch.testing.assert_close(blocked[name].double(), whole[name].double(), rtol=1e-10, atol=1e-10, msg=name)


def test_blocked_sparse_history_equals_one_call_cpu():
    p = make_problem(40, 200, 16, 4, 1, 32, torch.float64, "cpu", seed=11)
    # Query tiles of 8 rows; tile 2 lists only padding, so without the chunk its rows see nothing.
    selection = torch.tensor([[3, -1, 0], [12, 5, 7], [-1, -1, -1], [1, 2, -1], [-1, 9, 4]], dtype=torch.int32)
    whole = single_call(p, selection, tile=8)
    blocked = blocked_calls(p, 0, selection, tile=8)
    out, lse = blocked["parts"][0]
    assert torch.equal(out[16:24], torch.zeros_like(out[16:24]))
    assert torch.isneginf(lse[:, 16:24]).all() and torch.isfinite(lse[:, :16]).all()
    for name in ("out", "lse", "dq", "dk", "dv", "dk_pool", "dv_pool"):
        torch.testing.assert_close(blocked[name].double(), whole[name].double(), rtol=1e-10, atol=1e-10, msg=name)


def test_rows_without_keys_get_zero_out_and_minus_infinity_lse_cpu():
    p = make_problem(20, 0, 16, 4, 2, 16, torch.float32, "cpu", seed=12)
    empty = p["k_index"][:0]
    out, lse = ops.paged_attention_forward(p["q"], p["k"], p["v"], p["k_pool"], empty, p["v_pool"], empty, 0,
                                           p["scale"], None, 128, False)
    assert torch.equal(out, torch.zeros_like(out)) and torch.isneginf(lse).all()
    dk_pool = p["dk_pool0"].clone()
    dq, dk, dv = ops.paged_attention_backward(p["q"], p["k"], p["v"], p["k_pool"], empty, p["v_pool"], empty,
                                              out, p["dout"], lse, dk_pool, empty, dk_pool.clone(), empty, 0,
                                              p["scale"], None, 128, False, False)
    assert not dq.any() and not dk.any() and not dv.any()
    assert torch.equal(dk_pool, p["dk_pool0"])


def test_backward_with_minus_infinity_lse_adds_nothing_cpu():
    """An lse of -inf given to the backward means the row sees no key: it contributes nothing,
    even with attend_chunk (no inf or NaN from exp(S - lse))."""
    p = make_problem(24, 64, 16, 4, 2, 16, torch.float32, "cpu", seed=13)
    whole = single_call(p)
    lse = whole["lse"].clone()
    lse[:, 5] = float("-inf")
    dk_pool, dv_pool = p["dk_pool0"].clone(), p["dv_pool0"].clone()
    dq, dk, dv = ops.paged_attention_backward(p["q"], p["k"], p["v"], p["k_pool"], p["k_index"], p["v_pool"],
                                              p["v_index"], whole["out"], p["dout"], lse, dk_pool, p["dk_index"],
                                              dv_pool, p["dv_index"], p["history_tokens"], p["scale"])
    assert torch.isfinite(dq).all() and torch.isfinite(dk).all() and torch.isfinite(dk_pool).all()
    assert not dq[5].any()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("page_tokens", [64, 128])
def test_blocked_history_equals_one_call_cuda(page_tokens):
    # 1000 history tokens: 16 or 8 pages, the last one partial.
    p = make_problem(300, 1000, page_tokens, 8, 2, 128, torch.bfloat16, "cuda", seed=page_tokens)
    whole = single_call(p)
    blocked = blocked_calls(p, 3)
    # The same problem on the CPU in float64 is the truth; the blocked result may be at most
    # twice as far from it as the single call, plus the rounding of the blocks' bf16 outputs.
    truth = single_call({k: (v.cpu().double() if isinstance(v, torch.Tensor) and v.is_floating_point()
                             else v.cpu() if isinstance(v, torch.Tensor) else v) for k, v in p.items()})
    for name in ("out", "lse", "dq", "dk", "dv", "dk_pool", "dv_pool"):
        single_error = max_error(whole[name].cpu(), truth[name])
        blocked_error = max_error(blocked[name].cpu(), truth[name])
        slack = 1e-2 * max(1.0, truth[name].abs().max().item())
        assert blocked_error <= 2 * single_error + slack, (name, blocked_error, single_error)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_blocked_sparse_and_empty_rows_cuda():
    p = make_problem(256, 1300, 128, 4, 1, 128, torch.bfloat16, "cuda", seed=21)
    # Query tiles of 64 rows; tile 1 lists only padding, so without the chunk its rows see nothing.
    selection = torch.tensor([[3, -1, 0], [-1, -1, -1], [10, 2, -1], [-1, 9, 4]], dtype=torch.int32, device="cuda")
    whole = single_call(p, selection, tile=64)
    blocked = blocked_calls(p, 0, selection, tile=64)
    out, lse = blocked["parts"][0]
    assert torch.equal(out[64:128], torch.zeros_like(out[64:128]))
    assert torch.isneginf(lse[:, 64:128]).all() and torch.isfinite(lse[:, :64]).all()
    for name in ("out", "lse", "dq", "dk", "dv", "dk_pool", "dv_pool"):
        error = max_error(blocked[name], whole[name])
        assert error <= 2e-2 * max(1.0, whole[name].abs().max().item()), (name, error)
    # No history and no chunk: zeros and -inf, and a backward that adds nothing.
    empty = p["k_index"][:0]
    out, lse = ops.paged_attention_forward(p["q"], p["k"], p["v"], p["k_pool"], empty, p["v_pool"], empty, 0,
                                           p["scale"], None, 128, False)
    assert torch.equal(out, torch.zeros_like(out)) and torch.isneginf(lse).all()
    for deterministic in (False, True):
        dk_pool = p["dk_pool0"].clone()
        dq, _, _ = ops.paged_attention_backward(p["q"], p["k"], p["v"], p["k_pool"], empty, p["v_pool"], empty, out,
                                                p["dout"], lse, dk_pool, empty, dk_pool.clone(), empty, 0, p["scale"],
                                                None, 128, deterministic, False)
        assert not dq.any() and torch.equal(dk_pool, p["dk_pool0"])
