"""The PyTorch attention path (Note [Attention in PyTorch] in torch_attention.py) against plain
autograd attention over the same keys in float64, on fresh random inputs: sliding windows (inside
the first history page and inside the chunk), soft-caps, grouped queries, key blocks, and history
blocks without the chunk merged by log-sum-exp as the streamed path does."""
from __future__ import annotations

import pytest
import torch

from membar.oomb import torch_attention
from membar.attention import merge_attention_into
from membar.oomb.kernels import GradView, HistoryView


def reference(q, k_all, v_all, key_positions, query_positions, scale, window, softcap):
    """out [Tc, Hq, D], lse [Hq, Tc] by autograd-able float64 attention."""
    groups = q.shape[1] // k_all.shape[1]
    k_rep, v_rep = k_all.repeat_interleave(groups, 1), v_all.repeat_interleave(groups, 1)
    scores = torch.einsum("qhd,khd->hqk", q, k_rep) * scale
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    visible = key_positions[None] <= query_positions[:, None]
    if window is not None:
        visible &= key_positions[None] > query_positions[:, None] - window
    scores = scores.masked_fill(~visible, float("-inf"))
    lse = torch.logsumexp(scores, -1)
    return torch.einsum("hqk,khd->qhd", torch.softmax(scores, -1), v_rep), lse


def case(seed, tokens=40, q_heads=6, kv_heads=2, dim=8, page=8, history_pages=5, history_first_page=3,
         pool_pages=12):
    generator = torch.Generator().manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=generator, dtype=torch.float64)

    q, k, v = randn(tokens, q_heads, dim), randn(tokens, kv_heads, dim), randn(tokens, kv_heads, dim)
    k_pool, v_pool = randn(pool_pages, page, kv_heads, dim), randn(pool_pages, page, kv_heads, dim)
    # The history's pages sit in scattered pool rows (as an offloaded store's copies might not).
    rows = torch.randperm(pool_pages, generator=generator)[:history_pages].to(torch.int32)
    history = HistoryView(k_pool, v_pool, rows, history_pages * page)
    history_first = history_first_page * page
    chunk_first = history_first + history_pages * page
    return q, k, v, history, history_first, chunk_first


@pytest.mark.parametrize("window,softcap,block", [(None, None, None), (21, None, None), (13, 2.0, None),
                                                   (None, 1.5, 37), (50, None, 37)])
def test_forward_and_backward_match_autograd(monkeypatch, window, softcap, block):
    if block is not None:   # several key blocks per source: SCORE_ELEMENTS / (Tc * Hq) keys each
        monkeypatch.setitem(torch_attention.SCORE_ELEMENTS, "cpu", block * 40 * 6)
    q, k, v, history, history_first, chunk_first = case(1)
    scale = 0.3
    positions = torch_attention.Positions(chunk_first, history_first, window, softcap)
    out, lse = torch_attention.forward(q, k, v, history, scale, positions)

    history_k = history.k_pool[history.page_index.long()].flatten(0, 1).clone().requires_grad_()
    history_v = history.v_pool[history.page_index.long()].flatten(0, 1).clone().requires_grad_()
    q_ref, k_ref, v_ref = (t.clone().requires_grad_() for t in (q, k, v))
    key_positions = torch.cat([torch.arange(history_first, history_first + history_k.shape[0]),
                               torch.arange(chunk_first, chunk_first + k.shape[0])])
    query_positions = torch.arange(chunk_first, chunk_first + q.shape[0])
    ref_out, ref_lse = reference(q_ref, torch.cat([history_k, k_ref]), torch.cat([history_v, v_ref]), key_positions,
                                 query_positions, scale, window, softcap)
    assert torch.allclose(out, ref_out, atol=1e-12) and torch.allclose(lse, ref_lse, atol=1e-12)

    dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    ref_out.backward(dout)
    dk_pool, dv_pool = torch.randn_like(history.k_pool), torch.randn_like(history.v_pool)
    dk_before, dv_before = dk_pool.clone(), dv_pool.clone()
    grads = GradView(dk_pool, dv_pool, history.page_index)
    dq, dk, dv = torch_attention.backward(q, k, v, history, scale, out, dout, lse, grads, positions)
    for got, want in ((dq, q_ref.grad), (dk, k_ref.grad), (dv, v_ref.grad)):
        assert torch.allclose(got, want, atol=1e-10)
    rows = history.page_index.long()
    added_k = (dk_pool - dk_before)[rows].flatten(0, 1)
    added_v = (dv_pool - dv_before)[rows].flatten(0, 1)
    assert torch.allclose(added_k, history_k.grad, atol=1e-10) and torch.allclose(added_v, history_v.grad, atol=1e-10)
    untouched = torch.ones(dk_pool.shape[0], dtype=torch.bool)
    untouched[rows] = False
    assert torch.equal(dk_pool[untouched], dk_before[untouched])
    if window is not None and window < 40:
        # Keys older than every query's window got no gradient, and some did: the window bit.
        assert added_k[: history_k.shape[0] - window - 1].abs().max() == 0 and added_k.abs().max() > 0


def test_history_blocks_without_the_chunk_merge_to_one_call():
    """The streamed path: a chunk-only call, then history blocks with attend_chunk=False merged by
    log-sum-exp, then each backward given the final out/lse; a block the window hides entirely
    gives lse -inf and no gradient."""
    q, k, v, history, history_first, chunk_first = case(3, history_pages=6)
    window, softcap, scale = 30, 3.0, 0.25
    positions = torch_attention.Positions(chunk_first, history_first, window, softcap)
    one_out, one_lse = torch_attention.forward(q, k, v, history, scale, positions)

    empty = HistoryView(history.k_pool, history.v_pool, torch.zeros(0, dtype=torch.int32), 0)
    out, lse = torch_attention.forward(q, k, v, empty, scale, torch_attention.Positions(chunk_first, 0, window,
                                                                                         softcap))
    total = out.clone()
    blocks = []
    for first in (0, 2, 4):    # pages [0, 2), [2, 4), [4, 6) of the history
        view = HistoryView(history.k_pool, history.v_pool, history.page_index[first: first + 2], 16)
        block_positions = torch_attention.Positions(chunk_first, history_first + first * 8, window, softcap)
        part, part_lse = torch_attention.forward(q, k, v, view, scale, block_positions, attend_chunk=False)
        if first == 0:
            assert torch.isinf(part_lse).all() and part.abs().max() == 0   # older than every window
        lse = merge_attention_into(total, lse, part, part_lse)
        blocks.append((view, block_positions))
    assert torch.allclose(total, one_out, atol=1e-12) and torch.allclose(lse, one_lse, atol=1e-12)

    dout = torch.randn(q.shape, generator=torch.Generator().manual_seed(4), dtype=torch.float64)
    pools = [torch.zeros_like(history.k_pool) for _ in range(4)]
    one = torch_attention.backward(q, k, v, history, scale, one_out, dout, one_lse,
                                   GradView(pools[0], pools[1], history.page_index), positions)
    dq, dk, dv = torch_attention.backward(q, k, v, empty, scale, one_out, dout, one_lse, None,
                                          torch_attention.Positions(chunk_first, 0, window, softcap))
    for view, block_positions in blocks:
        part, part_dk, _ = torch_attention.backward(q, k, v, view, scale, one_out, dout, one_lse,
                                                    GradView(pools[2], pools[3], view.page_index), block_positions,
                                                    attend_chunk=False)
        assert part_dk.abs().max() == 0
        dq = dq + part
    assert torch.allclose(dq, one[0], atol=1e-10) and torch.allclose(dk, one[1], atol=1e-10)
    assert torch.allclose(pools[2], pools[0], atol=1e-10) and torch.allclose(pools[3], pools[1], atol=1e-10)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_sixteen_bit_products_stay_within_the_inputs_rounding(monkeypatch, dtype):
    """The CUDA path for 16-bit inputs (products of 16-bit operands with float32 results, P and dS
    rounded to the input dtype) run on the CPU: torch.bmm's out_dtype exists only on CUDA, so a
    float32 product of the same rounded operands stands in for it. Its results stay as close to the
    float64 reference as the float32 path's, within the 16-bit rounding of P and dS."""
    products = []

    def stand_in(a, b):
        assert a.dtype == b.dtype == dtype, (a.dtype, b.dtype)
        products.append(a.shape)
        return torch.matmul(a.float(), b.float())

    q, k, v, history, history_first, chunk_first = case(5)
    positions = torch_attention.Positions(chunk_first, history_first, 21, 2.0)
    scale = 0.3
    dout = torch.randn(q.shape, generator=torch.Generator().manual_seed(6), dtype=torch.float64)
    low = [t.to(dtype) for t in (q, k, v, history.k_pool, history.v_pool, dout)]
    low_history = HistoryView(low[3], low[4], history.page_index, history.history_tokens)
    exact = [t.to(torch.float64) for t in low]   # the same rounded inputs, in float64
    exact_history = HistoryView(exact[3], exact[4], history.page_index, history.history_tokens)

    def run(inputs, view, out_dtype):
        out, lse = torch_attention.forward(*inputs[:3], view, scale, positions)
        pools = (torch.zeros(view.k_pool.shape, dtype=out_dtype), torch.zeros(view.v_pool.shape, dtype=out_dtype))
        grads = torch_attention.backward(*inputs[:3], view, scale, out, inputs[5], lse,
                                         GradView(pools[0], pools[1], view.page_index), positions)
        return [out, lse, *grads, *pools]

    want = run(exact, exact_history, torch.float64)
    float32 = run(low, low_history, torch.float32)
    monkeypatch.setattr(torch_attention, "_operand_dtype", lambda t: t.dtype)
    monkeypatch.setattr(torch_attention, "_half_product", stand_in)
    got = run(low, low_history, torch.float32)
    assert len(products) == 2 * (2 + 5), products   # two key blocks (history, chunk): 2 forward, 5 backward products each
    for name, fast, slow, reference in zip(("out", "lse", "dq", "dk", "dv", "dk pages", "dv pages"), got, float32, want):
        fast_error = (fast.double() - reference).abs().max().item()
        slow_error = (slow.double() - reference).abs().max().item()
        bound = 4 * torch.finfo(dtype).eps * max(1.0, reference.abs().max().item())
        assert fast_error <= max(2 * slow_error, bound), (name, fast_error, slow_error, bound)
