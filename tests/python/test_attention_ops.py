"""Paged-attention ops (bindings/csrc/attention_ops.cpp, CPU kernels) against the plain torch
reference (membar.attention.reference_chunk_attention), ChunkAttention's autograd, in-place
accumulation into the grad pools, sparse selection and the bindings' input checks."""
import pytest
import torch

from membar import attention
from membar.attention import ChunkAttention, PagedHistory, reference_chunk_attention


def make_history(history_tokens, page_tokens, kv_heads, head_dim, dtype, generator, spare_pages=2):
    """K/V pools with the history scattered over shuffled pool rows; unused rows hold NaN so
    that reading them would show."""
    num_pages = (history_tokens + page_tokens - 1) // page_tokens
    pool_pages = num_pages + spare_pages
    pools, indices = [], []
    for _ in range(2):
        pool = torch.full((pool_pages, page_tokens, kv_heads, head_dim), float("nan"), dtype=dtype)
        index = torch.randperm(pool_pages, generator=generator)[:num_pages].to(torch.int32)
        flat = torch.randn(num_pages * page_tokens, kv_heads, head_dim, generator=generator, dtype=torch.float64)
        for page in range(num_pages):
            rows = min(page_tokens, history_tokens - page * page_tokens)
            pool[index[page], :rows] = flat[page * page_tokens: page * page_tokens + rows].to(dtype)
        pools.append(pool)
        indices.append(index)
    return pools[0], indices[0], pools[1], indices[1]


def make_chunk(chunk_tokens, q_heads, kv_heads, head_dim, dtype, generator):
    q = torch.randn(chunk_tokens, q_heads, head_dim, generator=generator, dtype=torch.float64).to(dtype)
    k = torch.randn(chunk_tokens, kv_heads, head_dim, generator=generator, dtype=torch.float64).to(dtype)
    v = torch.randn(chunk_tokens, kv_heads, head_dim, generator=generator, dtype=torch.float64).to(dtype)
    return q, k, v


def random_selection(chunk_tokens, tile, num_pages, per_tile, generator):
    tiles = (chunk_tokens + tile - 1) // tile
    selection = torch.full((tiles, per_tile), -1, dtype=torch.int32)
    for t in range(tiles):
        count = int(torch.randint(0, min(per_tile, num_pages) + 1, (1,), generator=generator))
        selection[t, :count] = torch.randperm(num_pages, generator=generator)[:count].to(torch.int32)
        selection[t] = selection[t][torch.randperm(per_tile, generator=generator)]
    return selection


def gathered_rows(pool, index, history_tokens):
    """The history rows of a pool as [history_tokens, Hkv, D] (float64)."""
    return pool.index_select(0, index.long()).reshape(-1, *pool.shape[2:])[:history_tokens].double()


SHAPES = [
    # (chunk_tokens, history_tokens, page_tokens, q_heads, kv_heads, head_dim, sparse)
    (37, 0, 64, 4, 4, 64, False),
    (50, 100, 64, 8, 2, 64, False),
    (20, 77, 16, 7, 1, 128, False),
    (33, 150, 37, 8, 1, 64, True),
    (1, 20, 8, 4, 1, 32, False),
]


def _assert_within_twice_plain(results):
    """Each (name, got, plain, want): got is at most twice as far from want (float64) as the plain
    reference computed in the same precision, plus a floor of 1e-5 relative."""
    for name, got, plain, want in results:
        if want.numel() == 0:
            continue
        got_error = (got.double() - want).abs().max().item()
        plain_error = (plain.double() - want).abs().max().item()
        floor = 1e-5 * max(1.0, want.abs().max().item())
        assert got_error <= 2 * plain_error + floor, (name, got_error, plain_error)


@pytest.mark.parametrize("softcap", [0.0, 1.5], ids=["plain", "softcap"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", SHAPES)
def test_forward_and_backward_match_reference(dtype, shape, softcap):
    """softcap: Gemma 2's attention-logit soft-cap (1.5 bends most of these N(0, 1) scores); the
    float64 reference differentiates torch.tanh by autograd."""
    chunk_tokens, history_tokens, page_tokens, q_heads, kv_heads, head_dim, sparse = shape
    generator = torch.Generator().manual_seed(hash(shape) % 1000 + 17)
    q, k, v = make_chunk(chunk_tokens, q_heads, kv_heads, head_dim, dtype, generator)
    k_pool, k_index, v_pool, v_index = make_history(history_tokens, page_tokens, kv_heads, head_dim, dtype, generator)
    num_pages = k_index.shape[0]
    tile = 8
    selection = random_selection(chunk_tokens, tile, num_pages, 3, generator) if sparse else None
    dout = torch.randn(q.shape, generator=generator, dtype=torch.float64).to(dtype)

    out, lse = attention.paged_attention_forward(q, k, v, k_pool, k_index, v_pool, v_index, history_tokens,
                                                 selected_pages=selection, query_tile_tokens=tile,
                                                 logit_softcap=softcap)
    assert out.dtype == dtype and out.shape == q.shape
    assert lse.shape == (q_heads, chunk_tokens)

    grad_dtype = torch.float64 if dtype == torch.float64 else torch.float32
    dk_pool = 0.1 * torch.randn((num_pages + 1,) + k_pool.shape[1:], generator=generator, dtype=torch.float64)
    dk_pool = dk_pool.to(grad_dtype)
    dv_pool = dk_pool.clone()
    dk_index = torch.randperm(num_pages + 1, generator=generator)[:num_pages].to(torch.int32)
    dv_index = torch.randperm(num_pages + 1, generator=generator)[:num_pages].to(torch.int32)
    dk_before, dv_before = dk_pool.clone(), dv_pool.clone()
    dq, dk, dv = attention.paged_attention_backward(
        q, k, v, k_pool, k_index, v_pool, v_index, out, dout, lse, dk_pool, dk_index, dv_pool, dv_index,
        history_tokens, selected_pages=selection, query_tile_tokens=tile, logit_softcap=softcap)

    # The exact answer: the reference in float64 on the same (rounded) inputs, with autograd
    # through the gathered history.
    leaves = [t.detach().double().requires_grad_() for t in (q, k, v, k_pool.nan_to_num(), v_pool.nan_to_num())]
    ref_out, ref_lse = reference_chunk_attention(*leaves[:3], leaves[3], k_index, leaves[4], v_index,
                                                 history_tokens, selected_pages=selection, query_tile_tokens=tile,
                                                 logit_softcap=softcap)
    ref_out.backward(dout.double())
    ref_dk_rows = gathered_rows(leaves[3].grad, k_index, history_tokens)
    ref_dv_rows = gathered_rows(leaves[4].grad, v_index, history_tokens)
    got_dk_rows = gathered_rows(dk_pool - dk_before, dk_index, history_tokens)
    got_dv_rows = gathered_rows(dv_pool - dv_before, dv_index, history_tokens)

    if dtype == torch.float64:
        tolerance = dict(rtol=1e-10, atol=1e-10)
        pairs = [(out, ref_out), (lse, ref_lse), (dq, leaves[0].grad), (dk, leaves[1].grad), (dv, leaves[2].grad),
                 (got_dk_rows, ref_dk_rows), (got_dv_rows, ref_dv_rows)]
        for got, want in pairs:
            torch.testing.assert_close(got.double(), want.double(), **tolerance)
    else:
        # At most twice the error of a plain implementation in the same precision: computed in
        # float32 from the same rounded inputs, its outputs rounded to the element type, and its
        # backward fed its own rounded output (as a kernel's is).
        plain_out, plain_lse = reference_chunk_attention(q, k, v, k_pool, k_index, v_pool, v_index, history_tokens,
                                                         selected_pages=selection, query_tile_tokens=tile,
                                                         logit_softcap=softcap)
        plain_dq, plain_dk, plain_dv, plain_dk_rows, plain_dv_rows = attention.reference_chunk_attention_backward(
            q, k, v, k_pool, k_index, v_pool, v_index, plain_out, dout, history_tokens, selected_pages=selection,
            query_tile_tokens=tile, logit_softcap=softcap)
        triples = [
            ("out", out, plain_out, ref_out),
            ("lse", lse, plain_lse, ref_lse),
            ("dq", dq, plain_dq, leaves[0].grad),
            ("dk_chunk", dk, plain_dk, leaves[1].grad),
            ("dv_chunk", dv, plain_dv, leaves[2].grad),
            ("dk_pages", got_dk_rows, plain_dk_rows, ref_dk_rows),
            ("dv_pages", got_dv_rows, plain_dv_rows, ref_dv_rows),
        ]
        _assert_within_twice_plain(triples)

    # Grad pool rows that hold no history row stay as they were.
    for pool, before, index in ((dk_pool, dk_before, dk_index), (dv_pool, dv_before, dv_index)):
        untouched = torch.ones(pool.shape[:2], dtype=torch.bool)
        for page in range(num_pages):
            rows = min(page_tokens, history_tokens - page * page_tokens)
            untouched[index[page], :rows] = False
        assert torch.equal(pool[untouched], before[untouched])


WINDOW_SHAPES = [
    # (chunk_tokens, history_tokens, page_tokens, q_heads, kv_heads, head_dim, sliding_window): windows
    # below a page, off the page grid, past the whole history (no effect), of one position, chunk only.
    (50, 100, 64, 8, 2, 64, 30),
    (20, 77, 16, 7, 1, 128, 41),
    (33, 150, 37, 8, 1, 64, 400),
    (45, 130, 32, 4, 2, 48, 1),
    (37, 0, 64, 4, 4, 64, 10),
    (1, 20, 8, 4, 1, 32, 5),
]


def hf_windowed_attention(q, k, v, history_k, history_v, window, softcap, scale):
    """Float64 attention over [history rows; chunk] with Hugging Face's sliding-window mask written
    out independently of membar.attention: key position kv_idx is visible to query position q_idx
    iff kv_idx <= q_idx and kv_idx > q_idx - window (history rows at 0.., chunk token i at
    history_tokens + i). Differentiable; returns out [Tc, Hq, D]."""
    history_tokens, chunk_tokens = history_k.shape[0], q.shape[0]
    group = q.shape[1] // k.shape[1]
    keys = torch.cat([history_k, k]).repeat_interleave(group, dim=1)
    values = torch.cat([history_v, v]).repeat_interleave(group, dim=1)
    scores = torch.einsum("thd,lhd->htl", q, keys) * scale
    if softcap:
        scores = softcap * torch.tanh(scores / softcap)
    q_idx = history_tokens + torch.arange(chunk_tokens)[:, None]
    kv_idx = torch.arange(history_tokens + chunk_tokens)[None, :]
    visible = (kv_idx <= q_idx) & (kv_idx > q_idx - window)
    probabilities = torch.softmax(scores.masked_fill(~visible, float("-inf")), dim=-1)
    return torch.einsum("htl,lhd->thd", probabilities, values)


@pytest.mark.parametrize("softcap", [0.0, 1.5], ids=["plain", "softcap"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", WINDOW_SHAPES)
def test_sliding_window_matches_hugging_face_mask(dtype, shape, softcap):
    """Note [Sliding window] in membar/kernels/attention.h: the windowed ops against float64
    autograd through an attention masked as Hugging Face masks (float64 inputs: to 1e-10; bf16 and
    float32: within twice the error of the plain windowed reference in the same precision). The
    window must change the answer wherever it hides a key."""
    chunk_tokens, history_tokens, page_tokens, q_heads, kv_heads, head_dim, window = shape
    generator = torch.Generator().manual_seed(hash(shape) % 1000 + 29)
    q, k, v = make_chunk(chunk_tokens, q_heads, kv_heads, head_dim, dtype, generator)
    k_pool, k_index, v_pool, v_index = make_history(history_tokens, page_tokens, kv_heads, head_dim, dtype, generator)
    num_pages = k_index.shape[0]
    dout = torch.randn(q.shape, generator=generator, dtype=torch.float64).to(dtype)
    out, lse = attention.paged_attention_forward(q, k, v, k_pool, k_index, v_pool, v_index, history_tokens,
                                                 logit_softcap=softcap, sliding_window=window)
    grad_dtype = torch.float64 if dtype == torch.float64 else torch.float32
    dk_pool = torch.zeros((num_pages + 1,) + k_pool.shape[1:], dtype=grad_dtype)
    dv_pool = torch.zeros_like(dk_pool)
    dk_index = torch.randperm(num_pages + 1, generator=generator)[:num_pages].to(torch.int32)
    dq, dk, dv = attention.paged_attention_backward(
        q, k, v, k_pool, k_index, v_pool, v_index, out, dout, lse, dk_pool, dk_index, dv_pool, dk_index,
        history_tokens, logit_softcap=softcap, sliding_window=window)
    got_dk_rows = gathered_rows(dk_pool, dk_index, history_tokens)
    got_dv_rows = gathered_rows(dv_pool, dk_index, history_tokens)

    leaves = [t.detach().double().requires_grad_() for t in
              (q, k, v, gathered_rows(k_pool, k_index, history_tokens), gathered_rows(v_pool, v_index, history_tokens))]
    scale = attention._scale(head_dim, None)
    want_out = hf_windowed_attention(*leaves, window, softcap, scale)
    want_out.backward(dout.double())
    wants = [want_out, leaves[0].grad, leaves[1].grad, leaves[2].grad, leaves[3].grad, leaves[4].grad]
    gots = [out, dq, dk, dv, got_dk_rows, got_dv_rows]
    names = ["out", "dq", "dk_chunk", "dv_chunk", "dk_pages", "dv_pages"]
    # The window changes the answer where it hides a key (the last query sees window keys).
    without = hf_windowed_attention(*[leaf.detach() for leaf in leaves], history_tokens + chunk_tokens + 1, softcap,
                                    scale)
    hides = history_tokens + chunk_tokens > window
    assert hides == bool((without - want_out.detach()).abs().max() > 1e-6), (hides, window)
    if dtype == torch.float64:
        for name, got, want in zip(names, gots, wants):
            torch.testing.assert_close(got.double(), want.double(), rtol=1e-10, atol=1e-10, msg=name)
        return
    plain_out, _ = reference_chunk_attention(q, k, v, k_pool, k_index, v_pool, v_index, history_tokens,
                                             logit_softcap=softcap, sliding_window=window)
    plain = [plain_out, *attention.reference_chunk_attention_backward(
        q, k, v, k_pool, k_index, v_pool, v_index, plain_out, dout, history_tokens, logit_softcap=softcap,
        sliding_window=window)]
    _assert_within_twice_plain(zip(names, gots, plain, wants))


def test_reference_takes_the_window_as_hugging_face_does():
    generator = torch.Generator().manual_seed(12)
    q, k, v = make_chunk(30, 4, 2, 16, torch.float64, generator)
    k_pool, k_index, v_pool, v_index = make_history(45, 8, 2, 16, torch.float64, generator)
    got, _ = reference_chunk_attention(q, k, v, k_pool.nan_to_num(), k_index, v_pool.nan_to_num(), v_index, 45,
                                       sliding_window=20, logit_softcap=2.0)
    want = hf_windowed_attention(q, k, v, gathered_rows(k_pool, k_index, 45), gathered_rows(v_pool, v_index, 45), 20,
                                 2.0, attention._scale(16, None))
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("softcap", [0.0, 0.6])
def test_chunk_attention_gradcheck(softcap):
    generator = torch.Generator().manual_seed(3)
    q, k, v = make_chunk(5, 4, 2, 3, torch.float64, generator)
    k_pool, k_index, v_pool, v_index = make_history(7, 3, 2, 3, torch.float64, generator)
    history = PagedHistory(k_pool, k_index, v_pool, v_index, 7)
    inputs = tuple(t.clone().requires_grad_() for t in (q, k, v))
    assert torch.autograd.gradcheck(lambda a, b, c: ChunkAttention.apply(a, b, c, history, None, False, softcap),
                                    inputs)
    # Sparse, with its selection reused by the backward.
    history.selected_pages = torch.tensor([[2, -1], [0, 1], [-1, -1]], dtype=torch.int32)
    history.query_tile_tokens = 2
    assert torch.autograd.gradcheck(lambda a, b, c: ChunkAttention.apply(a, b, c, history, None, False, softcap),
                                    inputs)


@pytest.mark.parametrize("softcap", [0.0, 0.625])   # a cap float32 holds exactly, as the kernels take it
@pytest.mark.parametrize("window", [1, 3, 8])
def test_chunk_attention_gradcheck_with_a_window(window, softcap):
    """Windows of one position, shorter than the chunk and reaching into the history (7 tokens in
    pages of 3), through chunk_attention, deterministic and not; the history's gradients too."""
    generator = torch.Generator().manual_seed(13)
    q, k, v = make_chunk(5, 4, 2, 3, torch.float64, generator)
    k_pool, k_index, v_pool, v_index = make_history(7, 3, 2, 3, torch.float64, generator)
    k_pool, v_pool = k_pool.nan_to_num(), v_pool.nan_to_num()
    inputs = tuple(t.clone().requires_grad_() for t in (q, k, v))
    pages = PagedHistory(k_pool, k_index, v_pool, v_index, 7)
    for deterministic in (False, True):
        assert torch.autograd.gradcheck(
            lambda a, b, c: attention.chunk_attention(a, b, c, pages, None, deterministic, softcap, window), inputs)
    # The history's dK/dV (added into grad pools) against float64 autograd of the reference.
    dk_pool, dv_pool = torch.zeros(k_pool.shape, dtype=torch.float64), torch.zeros(v_pool.shape, dtype=torch.float64)
    history = PagedHistory(k_pool, k_index, v_pool, v_index, 7, dk_pool, k_index, dv_pool, v_index)
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    attention.chunk_attention(*leaves, history, logit_softcap=softcap, sliding_window=window).sum().backward()
    ref_leaves = [t.detach().clone().requires_grad_() for t in (q, k, v, k_pool, v_pool)]
    reference, _ = reference_chunk_attention(*ref_leaves[:3], ref_leaves[3], k_index, ref_leaves[4], v_index, 7,
                                             logit_softcap=softcap, sliding_window=window)
    reference.sum().backward()
    torch.testing.assert_close(dk_pool, ref_leaves[3].grad, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(dv_pool, ref_leaves[4].grad, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(leaves[0].grad, ref_leaves[0].grad, rtol=1e-10, atol=1e-10)


def test_chunk_attention_history_grads_match_reference_and_accumulate():
    generator = torch.Generator().manual_seed(4)
    q, k, v = make_chunk(9, 4, 1, 8, torch.float64, generator)
    k_pool, k_index, v_pool, v_index = make_history(13, 4, 1, 8, torch.float64, generator)
    num_pages = k_index.shape[0]
    dk_pool = torch.zeros((num_pages, 4, 1, 8), dtype=torch.float64)
    dv_pool = torch.zeros_like(dk_pool)
    grad_index = torch.arange(num_pages, dtype=torch.int32)
    history = PagedHistory(k_pool, k_index, v_pool, v_index, 13, dk_pool, grad_index, dv_pool, grad_index)
    weights = torch.randn(q.shape, generator=generator, dtype=torch.float64)

    inputs = [t.clone().requires_grad_() for t in (q, k, v)]
    (attention.chunk_attention(*inputs, history) * weights).sum().backward()
    leaves = [t.clone().requires_grad_() for t in (q, k, v, k_pool.nan_to_num(), v_pool.nan_to_num())]
    out, _ = reference_chunk_attention(*leaves[:3], leaves[3], k_index, leaves[4], v_index, 13)
    (out * weights).sum().backward()
    for got, want in zip(inputs, leaves[:3]):
        torch.testing.assert_close(got.grad, want.grad, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(gathered_rows(dk_pool, grad_index, 13), gathered_rows(leaves[3].grad, k_index, 13),
                               rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(gathered_rows(dv_pool, grad_index, 13), gathered_rows(leaves[4].grad, v_index, 13),
                               rtol=1e-10, atol=1e-10)

    # A second backward adds the same contribution again: doubling is exact.
    first_dk, first_dv = dk_pool.clone(), dv_pool.clone()
    inputs = [t.clone().requires_grad_() for t in (q, k, v)]
    (attention.chunk_attention(*inputs, history) * weights).sum().backward()
    assert torch.equal(dk_pool, 2 * first_dk)
    assert torch.equal(dv_pool, 2 * first_dv)


def test_bfloat16_grad_pools_round_to_nearest_even():
    generator = torch.Generator().manual_seed(5)
    q, k, v = make_chunk(16, 4, 2, 64, torch.bfloat16, generator)
    k_pool, k_index, v_pool, v_index = make_history(40, 16, 2, 64, torch.bfloat16, generator, spare_pages=0)
    start = (0.1 * torch.randn(k_pool.shape, generator=generator)).to(torch.bfloat16)
    dk_pool, dv_pool = start.clone(), start.clone()
    out, lse = attention.paged_attention_forward(q, k, v, k_pool, k_index, v_pool, v_index, 40)
    dout = torch.randn(q.shape, generator=generator).to(torch.bfloat16)
    attention.paged_attention_backward(q, k, v, k_pool, k_index, v_pool, v_index, out, dout, lse,
                                       dk_pool, k_index, dv_pool, v_index, 40)
    # The same backward into float32 pools gives the float32 sums; rounding them once (torch
    # rounds to nearest even) must give the bfloat16 pools bit for bit.
    dk32, dv32 = start.float(), start.float()
    attention.paged_attention_backward(q, k, v, k_pool, k_index, v_pool, v_index, out, dout, lse,
                                       dk32, k_index, dv32, v_index, 40)
    assert torch.equal(dk_pool, dk32.to(torch.bfloat16))
    assert torch.equal(dv_pool, dv32.to(torch.bfloat16))
    assert not torch.equal(dk_pool, start)


def test_page_summary_and_select_match_torch():
    generator = torch.Generator().manual_seed(6)
    k_pool, k_index, _, _ = make_history(75, 16, 2, 8, torch.float32, generator)
    mean, low, high = attention.page_summary(k_pool, k_index, 75, with_bounds=True)
    rows = gathered_rows(k_pool, k_index, 75)
    for page in range(5):
        block = rows[page * 16: min(75, (page + 1) * 16)]
        torch.testing.assert_close(mean[page].double(), block.mean(0), rtol=1e-6, atol=1e-6)
        assert torch.equal(low[page].double(), block.amin(0))
        assert torch.equal(high[page].double(), block.amax(0))
    mean_only, no_min, no_max = attention.page_summary(k_pool, k_index, 75)
    assert no_min is None and no_max is None
    assert torch.equal(mean_only, mean)

    q = torch.randn(45, 8, 8, generator=generator)
    for top_k in (1, 3, 5, 9):
        for bounds in (False, True):
            selected = attention.page_select(q, mean, low if bounds else None, high if bounds else None,
                                             top_k=top_k, query_tile_tokens=20)
            assert selected.shape == (3, top_k) and selected.dtype == torch.int32
            for tile in range(3):
                qbar = q[tile * 20:(tile + 1) * 20].double().mean(0)  # [Hq, D]
                per_head_kv = torch.arange(8) // 4
                if bounds:
                    terms = torch.maximum(qbar[None] * low.double()[:, per_head_kv], qbar[None] * high.double()[:, per_head_kv])
                else:
                    terms = qbar[None] * mean.double()[:, per_head_kv]
                scores = terms.sum(dim=(1, 2))  # [pages]
                keep = min(top_k, 5)
                expected = torch.sort(torch.topk(scores, keep).indices).values.tolist() + [-1] * (top_k - keep)
                assert selected[tile].tolist() == expected


@pytest.mark.parametrize("tokens,pages,q_heads,kv_heads,top_k,tile", [
    (45, 5, 8, 2, 3, 20), (4096, 300, 28, 4, 64, 4096), (300, 40, 8, 8, 7, 128), (130, 9, 6, 1, 12, 64)])
def test_page_select_in_pytorch_is_the_kernels_selection(tokens, pages, q_heads, kv_heads, top_k, tile):
    """Note [Page selection in PyTorch]: page_select_scores (what the trainer runs on CUDA) picks the
    reference kernel's pages per tile, in its format (ascending, -1 padded), partial last tiles,
    GQA groups and top_k beyond the pages included; ties go to the lower page, NaN scores last."""
    generator = torch.Generator().manual_seed(tokens + pages + top_k)
    q = torch.randn(tokens, q_heads, 16, generator=generator)
    mean = torch.randn(pages, kv_heads, 16, generator=generator)
    for dtype in (torch.float32, torch.bfloat16):
        want = attention.page_select(q.to(dtype), mean, top_k=top_k, query_tile_tokens=tile)
        got = attention.page_select_scores(q.to(dtype), mean, top_k=top_k, query_tile_tokens=tile)
        assert got.dtype == torch.int32 and got.shape == want.shape
        assert torch.equal(got, want), (dtype, got, want)
    # Equal scores (pages 1 and 3 identical) keep the lower page; a NaN page ranks last.
    tied = mean.clone()
    tied[min(3, pages - 1)] = tied[1]
    tied[0] = float("nan")
    want = attention.page_select(q, tied, top_k=top_k, query_tile_tokens=tile)
    assert torch.equal(attention.page_select_scores(q, tied, top_k=top_k, query_tile_tokens=tile), want)


def test_sparse_selection_skips_unselected_pages():
    generator = torch.Generator().manual_seed(7)
    q, k, v = make_chunk(12, 2, 1, 16, torch.float32, generator)
    k_pool, k_index, v_pool, v_index = make_history(48, 16, 1, 16, torch.float32, generator)
    selection = torch.tensor([[1, -1], [-1, -1]], dtype=torch.int32)  # tile 0 sees page 1 only
    out, _ = attention.paged_attention_forward(q, k, v, k_pool, k_index, v_pool, v_index, 48,
                                               selected_pages=selection, query_tile_tokens=6)
    # Garbage in the unselected pages must not change anything.
    k_pool2, v_pool2 = k_pool.clone(), v_pool.clone()
    for page in (0, 2):
        k_pool2[k_index[page]] = 1e4
        v_pool2[v_index[page]] = -1e4
    out2, _ = attention.paged_attention_forward(q, k, v, k_pool2, k_index, v_pool2, v_index, 48,
                                                selected_pages=selection, query_tile_tokens=6)
    assert torch.equal(out, out2)
    # Tile 1 sees only its own chunk: the same as attention with no history at all.
    empty = PagedHistory.empty(16, 1, 16, torch.float32)
    out_no_history, _ = attention.paged_attention_forward(q, k, v, empty.k_pool, empty.k_page_index, empty.v_pool,
                                                          empty.v_page_index, 0)
    torch.testing.assert_close(out[6:], out_no_history[6:])
    dk_pool = torch.zeros(k_pool.shape)
    dv_pool = torch.zeros(k_pool.shape)
    dq, _, _ = attention.paged_attention_backward(
        q, k, v, k_pool, k_index, v_pool, v_index, out, torch.randn(q.shape, generator=generator), _lse(q, k, v, k_pool,
        k_index, v_pool, v_index, selection), dk_pool, k_index, dv_pool, v_index, 48, selected_pages=selection,
        query_tile_tokens=6)
    for page in (0, 2):
        assert torch.count_nonzero(dk_pool[k_index[page]]) == 0
        assert torch.count_nonzero(dv_pool[v_index[page]]) == 0
    assert torch.count_nonzero(dk_pool[k_index[1]]) > 0


def _lse(q, k, v, k_pool, k_index, v_pool, v_index, selection):
    return attention.paged_attention_forward(q, k, v, k_pool, k_index, v_pool, v_index, 48, selected_pages=selection,
                                             query_tile_tokens=6)[1]


def test_meta_shapes():
    q = torch.empty(10, 8, 64, device="meta", dtype=torch.bfloat16)
    k = torch.empty(10, 2, 64, device="meta", dtype=torch.bfloat16)
    pool = torch.empty(4, 16, 2, 64, device="meta", dtype=torch.bfloat16)
    index = torch.empty(3, device="meta", dtype=torch.int32)
    out, lse = torch.ops.membar.paged_attention_forward(q, k, k, pool, index, pool, index, 40, 0.125)
    assert out.shape == q.shape and out.dtype == torch.bfloat16 and lse.shape == (8, 10) and lse.dtype == torch.float32
    grad_pool = torch.empty(4, 16, 2, 64, device="meta", dtype=torch.float32)
    dq, dk, dv = torch.ops.membar.paged_attention_backward(q, k, k, pool, index, pool, index, q, q, lse, grad_pool,
                                                           index, grad_pool, index, 40, 0.125)
    assert dq.shape == q.shape and dk.shape == k.shape and dv.shape == k.shape
    mean, low, high = torch.ops.membar.page_summary(pool, index, 40, True)
    assert mean.shape == (3, 2, 64) and low.shape == (3, 2, 64) and mean.dtype == torch.float32
    selected = torch.ops.membar.page_select(q, mean, None, None, 5, 4)
    assert selected.shape == (3, 5) and selected.dtype == torch.int32


def _good_call_arguments():
    generator = torch.Generator().manual_seed(8)
    q, k, v = make_chunk(10, 4, 2, 16, torch.float32, generator)
    k_pool, k_index, v_pool, v_index = make_history(20, 8, 2, 16, torch.float32, generator)
    return dict(q=q, k_chunk=k, v_chunk=v, k_pool=k_pool, k_page_index=k_index, v_pool=v_pool,
                v_page_index=v_index, history_tokens=20)


@pytest.mark.parametrize("change, message", [
    (lambda a: a.update(q=a["q"].double()), "share one dtype"),
    (lambda a: a.update(q=a["q"].to(torch.int32)), "must be float32, float64, bfloat16 or float16"),
    (lambda a: a.update(q=a["q"][:, :3]), "multiple of num_kv_heads"),
    (lambda a: a.update(k_chunk=a["k_chunk"][:5], v_chunk=a["v_chunk"][:5]), "chunk_tokens"),
    (lambda a: a.update(k_pool=a["k_pool"].transpose(0, 1)), "must be contiguous"),
    (lambda a: a.update(v_pool=a["v_pool"][:, :, :, :8].contiguous()), "has shape"),
    (lambda a: a.update(k_page_index=a["k_page_index"].long()), "must be int32"),
    (lambda a: a.update(k_page_index=a["k_page_index"][:2]), "num_history_pages"),
    (lambda a: a.update(k_page_index=torch.tensor([0, 1, 99], dtype=torch.int32)), "is not a page of its pool"),
    (lambda a: a.update(v_page_index=torch.tensor([0, -1, 2], dtype=torch.int32)), "is not a page of its pool"),
    (lambda a: a.update(history_tokens=-1), "must not be negative"),
    (lambda a: a.update(history_tokens=50), "num_history_pages"),
    (lambda a: a.update(q=a["q"][:0], k_chunk=a["k_chunk"][:0], v_chunk=a["v_chunk"][:0]), "chunk_tokens must be at least 1"),
    (lambda a: a.update(softmax_scale=-1.0), "softmax_scale"),
    (lambda a: a.update(logit_softcap=-2.0), "logit_softcap must be 0"),
    (lambda a: a.update(logit_softcap=float("nan")), "logit_softcap must be 0"),
    (lambda a: a.update(sliding_window=-1), "sliding_window must be 0"),
    (lambda a: a.update(sliding_window=4, attend_chunk=False), "sliding window needs attend_chunk"),
    (lambda a: a.update(sliding_window=4, selected_pages=torch.tensor([[1, 0]], dtype=torch.int32),
                        query_tile_tokens=16), "sliding window cannot be combined with a sparse"),
    (lambda a: a.update(selected_pages=torch.tensor([[0, 5]], dtype=torch.int32), query_tile_tokens=16), "past the end"),
    (lambda a: a.update(selected_pages=torch.tensor([[1, 1]], dtype=torch.int32), query_tile_tokens=16), "twice"),
    (lambda a: a.update(selected_pages=torch.tensor([[1, 0]], dtype=torch.int32), query_tile_tokens=4), "shape"),
])
def test_forward_rejects_bad_inputs(change, message):
    arguments = _good_call_arguments()
    change(arguments)
    with pytest.raises(RuntimeError, match=message):
        attention.paged_attention_forward(**arguments)


def test_backward_rejects_bad_grad_pools():
    a = _good_call_arguments()
    out, lse = attention.paged_attention_forward(**a)
    base = (a["q"], a["k_chunk"], a["v_chunk"], a["k_pool"], a["k_page_index"], a["v_pool"], a["v_page_index"])
    grad = torch.zeros(a["k_pool"].shape)
    index = torch.tensor([0, 1, 2], dtype=torch.int32)
    other = torch.tensor([3, 4, 0], dtype=torch.int32)

    def call(dk_pool=grad, dk_index=index, dv_pool=None, dv_index=index, dout=out, lse_=lse):
        dv_pool = torch.zeros(a["k_pool"].shape) if dv_pool is None else dv_pool
        return attention.paged_attention_backward(*base, out, dout, lse_, dk_pool, dk_index, dv_pool, dv_index, 20)

    call()  # the good call works
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        call(dk_pool=grad.half(), dv_pool=grad.half())
    with pytest.raises(RuntimeError, match="share one dtype"):
        call(dv_pool=grad.bfloat16())
    with pytest.raises(RuntimeError, match="lists pool page 1 twice"):
        call(dk_index=torch.tensor([0, 1, 1], dtype=torch.int32))
    with pytest.raises(RuntimeError, match="already used"):
        call(dv_pool=grad, dv_index=other)  # one pool for both: page 0 is taken by dk
    with pytest.raises(RuntimeError, match="contiguous"):
        call(dk_pool=torch.zeros(a["k_pool"].shape[::-1]).permute(3, 2, 1, 0))
    with pytest.raises(RuntimeError, match="lse must have shape"):
        call(lse_=lse[:, :3])
    with pytest.raises(RuntimeError, match="dout must have q's shape"):
        call(dout=out[:3])
    with pytest.raises(RuntimeError, match="lse must be"):
        call(lse_=lse.double())
    # Disjoint pages of one shared pool are fine.
    shared = torch.zeros((6,) + tuple(a["k_pool"].shape[1:]))
    call(dk_pool=shared, dv_pool=shared, dv_index=torch.tensor([3, 4, 5], dtype=torch.int32))
    assert torch.count_nonzero(shared) > 0


def test_page_select_rejects_bad_inputs():
    q = torch.randn(10, 4, 8)
    mean = torch.randn(3, 2, 8)
    with pytest.raises(RuntimeError, match="top_k must be at least 1"):
        attention.page_select(q, mean, top_k=0)
    with pytest.raises(RuntimeError, match="both min and max"):
        attention.page_select(q, mean, min=mean, top_k=2)
    with pytest.raises(RuntimeError, match="mean must be float32"):
        attention.page_select(q, mean.double(), top_k=2)
    with pytest.raises(RuntimeError, match="head_dim"):
        attention.page_select(q, mean[:, :, :4], top_k=2)


def test_chunk_attention_without_grad_pools_and_without_history():
    generator = torch.Generator().manual_seed(9)
    q, k, v = make_chunk(6, 2, 1, 4, torch.float64, generator)
    history = PagedHistory.empty(4, 1, 4, torch.float64)
    inputs = tuple(t.clone().requires_grad_() for t in (q, k, v))
    assert torch.autograd.gradcheck(lambda a, b, c: ChunkAttention.apply(a, b, c, history), inputs)
    out = attention.chunk_attention(*inputs, history)
    reference, _ = reference_chunk_attention(q, k, v, history.k_pool, history.k_page_index, history.v_pool,
                                             history.v_page_index, 0)
    torch.testing.assert_close(out.detach(), reference, rtol=1e-12, atol=1e-12)


def test_opcheck_schemas_and_fake_tensors():
    """torch.library.opcheck: mutation annotations match what the CPU kernels write, the meta
    functions agree with the real outputs, and the ops trace under AOT dispatch."""
    from torch.library import opcheck

    generator = torch.Generator().manual_seed(10)
    q, k, v = make_chunk(10, 4, 2, 16, torch.float32, generator)
    k_pool, k_index, v_pool, v_index = make_history(12, 8, 2, 16, torch.float32, generator, spare_pages=1)
    selection = torch.tensor([[1, -1], [0, 1]], dtype=torch.int32)
    utils = ("test_schema", "test_faketensor", "test_aot_dispatch_dynamic")
    ops = torch.ops.membar
    k_pool, v_pool = k_pool.nan_to_num(), v_pool.nan_to_num()
    opcheck(ops.paged_attention_forward.default, (q, k, v, k_pool, k_index, v_pool, v_index, 12, 0.25), test_utils=utils)
    opcheck(ops.paged_attention_forward.default, (q, k, v, k_pool, k_index, v_pool, v_index, 12, 0.25, selection, 5),
            test_utils=utils)
    out, lse = ops.paged_attention_forward(q, k, v, k_pool, k_index, v_pool, v_index, 12, 0.25)
    dk_pool, dv_pool = torch.zeros(k_pool.shape), torch.zeros(v_pool.shape)
    opcheck(ops.paged_attention_backward.default,
            (q, k, v, k_pool, k_index, v_pool, v_index, out, torch.randn(out.shape, generator=generator), lse,
             dk_pool, k_index, dv_pool, v_index, 12, 0.25), test_utils=utils)
    # With a soft-cap and a sliding window (the schemas' trailing arguments).
    opcheck(ops.paged_attention_forward.default, (q, k, v, k_pool, k_index, v_pool, v_index, 12, 0.25),
            dict(logit_softcap=1.5, sliding_window=7), test_utils=utils)
    opcheck(ops.paged_attention_backward.default,
            (q, k, v, k_pool, k_index, v_pool, v_index, out, torch.randn(out.shape, generator=generator), lse,
             dk_pool, k_index, dv_pool, v_index, 12, 0.25), dict(sliding_window=7), test_utils=utils)
    opcheck(ops.page_summary.default, (k_pool, k_index, 12, True), test_utils=utils)
    mean = ops.page_summary(k_pool, k_index, 12, False)[0]
    opcheck(ops.page_select.default, (q, mean, None, None, 1, 4), test_utils=utils)


def test_deterministic_backward_repeats_bit_for_bit():
    generator = torch.Generator().manual_seed(11)
    q, k, v = make_chunk(96, 8, 2, 64, torch.bfloat16, generator)
    k_pool, k_index, v_pool, v_index = make_history(200, 64, 2, 64, torch.bfloat16, generator)
    out, lse = attention.paged_attention_forward(q, k, v, k_pool, k_index, v_pool, v_index, 200)
    dout = torch.randn(q.shape, generator=generator).to(torch.bfloat16)
    results = []
    for deterministic in (True, True, False):
        dk_pool, dv_pool = torch.zeros(k_pool.shape), torch.zeros(v_pool.shape)
        grads = attention.paged_attention_backward(q, k, v, k_pool, k_index, v_pool, v_index, out, dout, lse, dk_pool,
                                                   k_index, dv_pool, v_index, 200, deterministic=deterministic)
        results.append(grads + (dk_pool, dv_pool))
    for first, second in zip(results[0], results[1]):
        assert torch.equal(first, second)
    # The faster dq strategy agrees to rounding; dK/dV are computed the same way in both.
    torch.testing.assert_close(results[2][0].float(), results[0][0].float(), rtol=2e-2, atol=2e-2)
    for first, fast in zip(results[0][1:], results[2][1:]):
        assert torch.equal(first, fast)
