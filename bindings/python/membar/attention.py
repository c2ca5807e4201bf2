"""Paged attention for chunk-recurrent training (OOMB), from Python: the one wrapper of the attention
ops (the trainer's calls in membar.oomb go through it too).

The ops live in ``torch.ops.membar`` (bindings/csrc/attention_ops.cpp; CPU kernels always, CUDA
kernels when built with CUDA). Shapes::

    q                 [chunk_tokens, q_heads, head_dim]
    k_chunk, v_chunk  [chunk_tokens, kv_heads, head_dim]
    k_pool, v_pool    [pool_pages, page_tokens, kv_heads, head_dim]   (page_tokens from the shape)
    *_page_index      int32 [num_history_pages]: history page p is pool row index[p]
    lse               [q_heads, chunk_tokens], float32 (float64 for float64 inputs)
    selected_pages    int32 [ceil(chunk_tokens / query_tile_tokens), k], -1 = padding

Every query sees every history token (or, with ``selected_pages``, the pages its query tile
selected) and the chunk's own keys up to its position (causal). With ``sliding_window`` W > 0 the
query at position q (history tokens are positions 0.., chunk token i is history_tokens + i) sees only
keys at positions p > q - W, as Hugging Face's sliding windows (Note [Sliding window] in
kernels/include/membar/kernels/attention.h; dense calls that attend the chunk only). The backward ADDS the history's
dK/dV into the grad pools in place (float32 or bfloat16 pools) and returns the chunk's dq, dk, dv.

Blocked history: with ``attend_chunk=False`` the queries attend only the given history pages, so
that a caller can stream a long history through the GPU in blocks of pages; ``merge_attention``
(or, one block at a time, ``merge_attention_into``) merges the blocks' (out, lse), and each
block's backward takes the merged (final) out and lse (Note [Blocked history] in
kernels/include/membar/kernels/attention.h).

CUDA kernel layouts: every call runs one compiled layout, chosen by the device, dtype, head size
and mode (Note [Layout choice] in kernels/include/membar/kernels/attention_cuda.h);
``torch.ops.membar.attention_cuda_layout(kind, dtype, head_dim, page_tokens)`` names it.

``ChunkAttention`` is the autograd view: its forward takes the chunk's q, k, v (differentiable)
and a ``PagedHistory`` (not differentiable); its backward returns the chunk's gradients and, as a
side effect, adds the history's dK/dV into the history's grad pools.
"""
from __future__ import annotations

import math
import struct
from dataclasses import dataclass
from typing import Optional, Tuple

import torch

from . import ops as _ops  # loads membar/_C.so

__all__ = [
    "PagedHistory",
    "ChunkAttention",
    "chunk_attention",
    "paged_attention_forward",
    "paged_attention_backward",
    "merge_attention",
    "merge_attention_into",
    "page_summary",
    "page_select",
    "page_select_scores",
    "reference_chunk_attention",
    "reference_chunk_attention_backward",
]


def _scale(head_dim: int, softmax_scale: Optional[float]) -> float:
    """softmax_scale, default 1/sqrt(head_dim), rounded to float32: the kernels take a float32
    scale, and the reference below uses the same value so that float64 results agree exactly."""
    scale = float(softmax_scale) if softmax_scale is not None else 1.0 / math.sqrt(head_dim)
    return struct.unpack("f", struct.pack("f", scale))[0]


def paged_attention_forward(
    q: torch.Tensor,
    k_chunk: torch.Tensor,
    v_chunk: torch.Tensor,
    k_pool: torch.Tensor,
    k_page_index: torch.Tensor,
    v_pool: torch.Tensor,
    v_page_index: torch.Tensor,
    history_tokens: int,
    softmax_scale: Optional[float] = None,
    selected_pages: Optional[torch.Tensor] = None,
    query_tile_tokens: int = 128,
    attend_chunk: bool = True,
    logit_softcap: float = 0.0,
    sliding_window: int = 0,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Returns (out [Tc, Hq, D], lse [Hq, Tc]). softmax_scale defaults to 1/sqrt(head_dim).
    logit_softcap > 0 (Gemma 2's attn_logit_softcapping) turns every scaled score s into
    cap * tanh(s / cap) before the softmax (Note [Soft-capped scores] in membar/kernels/attention.h).
    sliding_window W > 0 hides from each query the keys W or more positions before it (Note
    [Sliding window]); it needs attend_chunk and no selected_pages.

    attend_chunk=False: the queries attend only the given history pages (one block of a history
    streamed in blocks); a row that sees no key gets out 0 and lse -inf. Merge the blocks' results
    with ``merge_attention``."""
    return _ops.paged_attention_forward(
        q, k_chunk, v_chunk, k_pool, k_page_index, v_pool, v_page_index, int(history_tokens),
        _scale(q.shape[-1], softmax_scale), selected_pages, int(query_tile_tokens), bool(attend_chunk), "",
        float(logit_softcap), int(sliding_window))


def paged_attention_backward(
    q: torch.Tensor,
    k_chunk: torch.Tensor,
    v_chunk: torch.Tensor,
    k_pool: torch.Tensor,
    k_page_index: torch.Tensor,
    v_pool: torch.Tensor,
    v_page_index: torch.Tensor,
    out: torch.Tensor,
    dout: torch.Tensor,
    lse: torch.Tensor,
    dk_pool: torch.Tensor,
    dk_page_index: torch.Tensor,
    dv_pool: torch.Tensor,
    dv_page_index: torch.Tensor,
    history_tokens: int,
    softmax_scale: Optional[float] = None,
    selected_pages: Optional[torch.Tensor] = None,
    query_tile_tokens: int = 128,
    deterministic: bool = False,
    attend_chunk: bool = True,
    logit_softcap: float = 0.0,
    sliding_window: int = 0,
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Returns (dq, dk_chunk, dv_chunk) and ADDS the history's dK/dV into dk_pool/dv_pool.
    logit_softcap and sliding_window: the forward's.

    attend_chunk=False (one block of a streamed history): ``out`` and ``lse`` must be the FINAL
    merged ones of the rows; dq is this block's contribution and dk_chunk/dv_chunk are zeros."""
    return _ops.paged_attention_backward(
        q, k_chunk, v_chunk, k_pool, k_page_index, v_pool, v_page_index, out, dout, lse,
        dk_pool, dk_page_index, dv_pool, dv_page_index, int(history_tokens),
        _scale(q.shape[-1], softmax_scale), selected_pages, int(query_tile_tokens), bool(deterministic),
        bool(attend_chunk), "", float(logit_softcap), int(sliding_window))


def merge_attention_into(total: torch.Tensor, total_lse: torch.Tensor, out: torch.Tensor,
                         lse: torch.Tensor) -> torch.Tensor:
    """Adds a partial attention result over other keys into a running one, in place, and returns
    the merged lse: with m = logaddexp(total_lse, lse), total <- exp(total_lse - m) * total +
    exp(lse - m) * out. total [Tc, Hq, D] float32 (float64 for float64 inputs) is the running out,
    total_lse [Hq, Tc] its lse in the same dtype; out [Tc, Hq, D] (read in its own dtype), lse
    [Hq, Tc]. A side whose lse is -inf for a row (no key there) weighs 0; a row with -inf on both
    sides keeps out 0 and lse -inf."""
    merged = torch.logaddexp(total_lse, lse.to(total_lse.dtype))
    # Where both sides are -inf, -inf - -inf would be nan: weigh both 0 instead.
    pivot = torch.where(torch.isfinite(merged), merged, 0.0)
    total.mul_(torch.exp(total_lse - pivot).t().unsqueeze(-1))
    total.addcmul_(out, torch.exp(lse.to(total_lse.dtype) - pivot).t().unsqueeze(-1))
    return merged


def merge_attention(parts) -> Tuple[torch.Tensor, torch.Tensor]:
    """Merges partial attention results over disjoint key sets: ``parts`` is a sequence of
    (out [Tc, Hq, D], lse [Hq, Tc]); returns (out, lse) of the softmax over all their keys
    (merge_attention_into, part by part), computed in float32 (float64 for float64 inputs) and
    returned in the first part's dtypes. A row that sees no key in any part (out 0, lse -inf
    everywhere) gets out 0 and lse -inf."""
    parts = list(parts)
    if not parts:
        raise ValueError("merge_attention needs at least one (out, lse) part.")
    first_out, first_lse = parts[0]
    compute = torch.float64 if first_out.dtype == torch.float64 else torch.float32
    total = first_out.to(compute, copy=True)
    lse = first_lse.to(compute)
    for out, part_lse in parts[1:]:
        lse = merge_attention_into(total, lse, out, part_lse)
    return total.to(first_out.dtype), lse.to(first_lse.dtype)


def page_summary(
    k_pool: torch.Tensor, k_page_index: torch.Tensor, history_tokens: int, with_bounds: bool = False
) -> Tuple[torch.Tensor, Optional[torch.Tensor], Optional[torch.Tensor]]:
    """Per history page and kv head: mean of the page's valid key rows (float32
    [num_history_pages, Hkv, D]) and, with_bounds, the elementwise min and max (else None)."""
    return _ops.page_summary(k_pool, k_page_index, int(history_tokens), bool(with_bounds))


def page_select(
    q: torch.Tensor,
    mean: torch.Tensor,
    min: Optional[torch.Tensor] = None,
    max: Optional[torch.Tensor] = None,
    top_k: int = 64,
    query_tile_tokens: int = 128,
) -> torch.Tensor:
    """Top-k history pages per query tile (int32 [num_tiles, top_k], ascending, -1 padded).
    Scores use the mean keys, or the min/max upper bound when both are given."""
    return _ops.page_select(q, mean, min, max, int(top_k), int(query_tile_tokens))


def page_select_scores(q: torch.Tensor, mean: torch.Tensor, top_k: int = 64, query_tile_tokens: int = 128,
                       reduce_scores=None) -> torch.Tensor:
    """page_select with mean keys (no bounds) in PyTorch operations: the same int32 [num_tiles,
    top_k] (ascending, -1 padded; ties to the lower page, NaN scores last), with scores computed
    in float64 (the query heads sharing a key head summed first). What the trainer runs on CUDA
    (Note [Page selection in PyTorch]); reduce_scores(scores) may sum the float64 [tiles, pages]
    scores over other processes' heads first (tensor parallel)."""
    tokens, q_heads, dim = q.shape
    pages, kv_heads, _ = mean.shape
    tile = int(query_tile_tokens)
    tiles = -(-tokens // tile)
    full = tokens // tile
    parts = []
    if full:   # no padded copy of q: full tiles as a view, summed in float64
        parts.append(q[: full * tile].reshape(full, tile, q_heads, dim).sum(1, dtype=torch.float64) / tile)
    if full < tiles:
        rest = q[full * tile:]
        parts.append(rest.sum(0, keepdim=True, dtype=torch.float64) / rest.shape[0])
    tile_means = parts[0] if len(parts) == 1 else torch.cat(parts)
    grouped = tile_means.view(tiles, kv_heads, q_heads // kv_heads, dim).sum(2)
    scores = torch.einsum("thd,phd->tp", grouped, mean.to(torch.float64))
    if reduce_scores is not None:
        reduce_scores(scores)
    scores = torch.nan_to_num(scores, nan=float("-inf"))
    keep = min(int(top_k), pages)
    order = torch.sort(-scores, dim=1, stable=True).indices[:, :keep]   # ties: the lower page first
    selected = torch.sort(order, dim=1).values.to(torch.int32)
    if keep < top_k:
        selected = torch.cat([selected, selected.new_full((tiles, int(top_k) - keep), -1)], dim=1)
    return selected


# Note [Page selection in PyTorch]
#   Rationale: the CUDA page_select kernel runs one CTA per query tile; with one selection per
#   4096-token chunk (what offload wants) that is one CTA scoring every history page: the 1M sparse
#   step's stage-1 chunks went from 0.31 s to 0.53 s each as the history grew (H200, session 13),
#   while the rest of a stage-1 chunk does not grow with the history.
#   Approach: on CUDA the trainer selects with page_select_scores: a float64 reduction for the tile
#   means, one matrix product for the scores, a stable sort for top-k; each runs over the whole GPU.
#   MEMBAR_PAGE_SELECT=kernel keeps the kernel; MEMBAR_PAGE_SELECT=pytorch selects this way on the
#   CPU too (how the CPU tests run the trainer's CUDA path). CPU runs keep the reference kernel.
#   Limitations: not yet run on a GPU; float64 scores may order a near-tie differently from the
#   kernel's float32 sums (as the kernel's already do from the CPU reference's).


@dataclass
class PagedHistory:
    """The history a chunk attends to, and where its gradients go.

    The pools must hold the same contents when the backward runs as during the forward.
    ``dk_pool``/``dv_pool`` (float32 or bfloat16, same page shape as the K/V pools) receive the
    history's dK/dV, added in place; when they are None the history's gradients are computed
    into a scratch buffer and dropped.
    """

    k_pool: torch.Tensor
    k_page_index: torch.Tensor
    v_pool: torch.Tensor
    v_page_index: torch.Tensor
    history_tokens: int
    dk_pool: Optional[torch.Tensor] = None
    dk_page_index: Optional[torch.Tensor] = None
    dv_pool: Optional[torch.Tensor] = None
    dv_page_index: Optional[torch.Tensor] = None
    selected_pages: Optional[torch.Tensor] = None
    query_tile_tokens: int = 128

    @staticmethod
    def empty(page_tokens: int, kv_heads: int, head_dim: int, dtype: torch.dtype,
              device: torch.device | str = "cpu") -> "PagedHistory":
        """A history of zero tokens (the first chunk of a sequence)."""
        pool = torch.empty((0, page_tokens, kv_heads, head_dim), dtype=dtype, device=device)
        index = torch.empty((0,), dtype=torch.int32, device=device)
        return PagedHistory(pool, index, pool, index, 0)

    def grad_pools(self) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        if self.dk_pool is not None:
            if self.dv_pool is None or self.dk_page_index is None or self.dv_page_index is None:
                raise ValueError("PagedHistory: give dk_pool, dk_page_index, dv_pool and dv_page_index together.")
            return self.dk_pool, self.dk_page_index, self.dv_pool, self.dv_page_index
        # No grad pools: a scratch pool with one page per history page (float64 for float64
        # inputs, so that gradcheck sees exact values), both indices 0..n-1 over separate pools.
        num_pages = self.k_page_index.shape[0]
        shape = (num_pages,) + tuple(self.k_pool.shape[1:])
        grad_dtype = torch.float64 if self.k_pool.dtype == torch.float64 else torch.float32
        dk = torch.zeros(shape, dtype=grad_dtype, device=self.k_pool.device)
        dv = torch.zeros(shape, dtype=grad_dtype, device=self.k_pool.device)
        index = torch.arange(num_pages, dtype=torch.int32, device=self.k_pool.device)
        return dk, index, dv, index


class ChunkAttention(torch.autograd.Function):
    """out = attention(q, [history keys, k_chunk], [history values, v_chunk]) for one chunk.

    forward(q, k_chunk, v_chunk, history: PagedHistory, softmax_scale=None, deterministic=False,
    logit_softcap=0.0, sliding_window=0) returns out [Tc, Hq, D] (logit_softcap > 0: Gemma 2's
    soft-capped scores; sliding_window > 0: each query sees only the keys less than that many
    positions before it). backward returns dq, dk_chunk, dv_chunk and adds the history's dK/dV into
    history.dk_pool / history.dv_pool (in place, outside autograd).
    """

    @staticmethod
    def forward(ctx, q, k_chunk, v_chunk, history: PagedHistory, softmax_scale=None, deterministic=False,
                logit_softcap=0.0, sliding_window=0):
        scale = _scale(q.shape[-1], softmax_scale)
        out, lse = _ops.paged_attention_forward(
            q, k_chunk, v_chunk, history.k_pool, history.k_page_index, history.v_pool, history.v_page_index,
            int(history.history_tokens), scale, history.selected_pages, int(history.query_tile_tokens),
            logit_softcap=float(logit_softcap), sliding_window=int(sliding_window))
        ctx.save_for_backward(q, k_chunk, v_chunk, out, lse)
        ctx.history = history
        ctx.scale = scale
        ctx.deterministic = bool(deterministic)
        ctx.logit_softcap = float(logit_softcap)
        ctx.sliding_window = int(sliding_window)
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k_chunk, v_chunk, out, lse = ctx.saved_tensors
        history: PagedHistory = ctx.history
        dk_pool, dk_page_index, dv_pool, dv_page_index = history.grad_pools()
        dq, dk_chunk, dv_chunk = _ops.paged_attention_backward(
            q, k_chunk, v_chunk, history.k_pool, history.k_page_index, history.v_pool, history.v_page_index,
            out, dout.contiguous(), lse, dk_pool, dk_page_index, dv_pool, dv_page_index,
            int(history.history_tokens), ctx.scale, history.selected_pages, int(history.query_tile_tokens),
            ctx.deterministic, logit_softcap=ctx.logit_softcap, sliding_window=ctx.sliding_window)
        return dq, dk_chunk, dv_chunk, None, None, None, None, None


def chunk_attention(q: torch.Tensor, k_chunk: torch.Tensor, v_chunk: torch.Tensor, history: PagedHistory,
                    softmax_scale: Optional[float] = None, deterministic: bool = False,
                    logit_softcap: float = 0.0, sliding_window: int = 0) -> torch.Tensor:
    """Autograd-aware paged attention of one chunk (see ChunkAttention)."""
    return ChunkAttention.apply(q, k_chunk, v_chunk, history, softmax_scale, deterministic, logit_softcap,
                                sliding_window)


def _gather_history(pool: torch.Tensor, page_index: torch.Tensor, history_tokens: int) -> torch.Tensor:
    """[pool_pages, page_tokens, Hkv, D] + index -> [history_tokens, Hkv, D] (differentiable)."""
    pages = pool.index_select(0, page_index.long())
    return pages.reshape((-1,) + tuple(pool.shape[2:]))[:history_tokens]


def _reference_probabilities(q, k_chunk, v_chunk, k_pool, k_page_index, v_pool, v_page_index, history_tokens,
                             softmax_scale, selected_pages, query_tile_tokens, compute_dtype, logit_softcap=0.0,
                             sliding_window=0):
    """Materialised attention: (scores [Hq, Tc, L] with -inf where hidden, keys and values
    [L, Hq, D] expanded to the q heads, the soft-cap's slopes 1 - tanh^2 [Hq, Tc, L] or None),
    L = history_tokens + Tc, all in compute_dtype."""
    chunk_tokens, q_heads, head_dim = q.shape
    kv_heads = k_chunk.shape[1]
    group = q_heads // kv_heads
    page_tokens = k_pool.shape[1]
    scale = _scale(head_dim, softmax_scale)
    keys = torch.cat([_gather_history(k_pool, k_page_index, history_tokens), k_chunk]).to(compute_dtype)
    values = torch.cat([_gather_history(v_pool, v_page_index, history_tokens), v_chunk]).to(compute_dtype)
    keys = keys.repeat_interleave(group, dim=1)      # [L, Hq, D]
    values = values.repeat_interleave(group, dim=1)  # [L, Hq, D]
    scores = torch.einsum("thd,lhd->htl", q.to(compute_dtype), keys) * scale  # [Hq, Tc, L]
    slopes = None
    if logit_softcap:
        tanh = torch.tanh(scores / logit_softcap)
        scores, slopes = tanh * logit_softcap, 1 - tanh * tanh

    device = q.device
    query_positions = torch.arange(chunk_tokens, device=device)
    chunk_visible = torch.arange(chunk_tokens, device=device)[None, :] <= query_positions[:, None]  # [Tc, Tc]
    if selected_pages is None:
        history_visible = torch.ones((chunk_tokens, history_tokens), dtype=torch.bool, device=device)
    else:
        num_pages = (history_tokens + page_tokens - 1) // page_tokens
        num_tiles = selected_pages.shape[0]
        chosen = torch.zeros((num_tiles, num_pages + 1), dtype=torch.bool, device=device)
        slots = selected_pages.long().clone()
        slots[slots < 0] = num_pages  # padding lands in a column that is dropped
        chosen.scatter_(1, slots, True)
        tile_of_query = query_positions // query_tile_tokens
        page_of_token = torch.arange(history_tokens, device=device) // page_tokens
        history_visible = chosen[:, :num_pages][tile_of_query][:, page_of_token]
    visible = torch.cat([history_visible, chunk_visible], dim=1)  # [Tc, L]
    if sliding_window:
        # Hugging Face's kv_idx > q_idx - window, positions: history tokens 0.., chunk token i at
        # history_tokens + i.
        key_positions = torch.arange(history_tokens + chunk_tokens, device=device)
        visible = visible & (key_positions[None, :] > (history_tokens + query_positions)[:, None] - sliding_window)
    return scores.masked_fill(~visible[None], float("-inf")), keys, values, slopes


def reference_chunk_attention(
    q: torch.Tensor,
    k_chunk: torch.Tensor,
    v_chunk: torch.Tensor,
    k_pool: torch.Tensor,
    k_page_index: torch.Tensor,
    v_pool: torch.Tensor,
    v_page_index: torch.Tensor,
    history_tokens: int,
    softmax_scale: Optional[float] = None,
    selected_pages: Optional[torch.Tensor] = None,
    query_tile_tokens: int = 128,
    compute_dtype: Optional[torch.dtype] = None,
    logit_softcap: float = 0.0,
    sliding_window: int = 0,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Plain-torch paged attention with every score materialised (for tests only).

    Computes in compute_dtype (default: float64 for float64 inputs, else float32); returns
    (out in q's dtype [Tc, Hq, D], lse [Hq, Tc] in compute_dtype). Differentiable with respect
    to q, k_chunk, v_chunk and the pools.
    """
    if compute_dtype is None:
        compute_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    scores, _, values, _ = _reference_probabilities(q, k_chunk, v_chunk, k_pool, k_page_index, v_pool, v_page_index,
                                                    history_tokens, softmax_scale, selected_pages, query_tile_tokens,
                                                    compute_dtype, logit_softcap, sliding_window)
    lse = torch.logsumexp(scores, dim=-1)  # [Hq, Tc]
    probabilities = torch.exp(scores - lse[..., None])
    out = torch.einsum("htl,lhd->thd", probabilities, values)
    return out.to(q.dtype), lse


def reference_chunk_attention_backward(
    q: torch.Tensor,
    k_chunk: torch.Tensor,
    v_chunk: torch.Tensor,
    k_pool: torch.Tensor,
    k_page_index: torch.Tensor,
    v_pool: torch.Tensor,
    v_page_index: torch.Tensor,
    out: torch.Tensor,
    dout: torch.Tensor,
    history_tokens: int,
    softmax_scale: Optional[float] = None,
    selected_pages: Optional[torch.Tensor] = None,
    query_tile_tokens: int = 128,
    compute_dtype: Optional[torch.dtype] = None,
    logit_softcap: float = 0.0,
    sliding_window: int = 0,
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Plain-torch attention backward with materialised probabilities (for tests only), using
    the given (stored, possibly rounded) ``out`` for D_i = rowsum(dO_i * O_i) as a kernel does.
    Returns (dq, dk_chunk, dv_chunk) in q's dtype and the history's (dk, dv) rows
    [history_tokens, Hkv, D] in compute_dtype."""
    if compute_dtype is None:
        compute_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    chunk_tokens, q_heads, head_dim = q.shape
    kv_heads = k_chunk.shape[1]
    group = q_heads // kv_heads
    scale = _scale(head_dim, softmax_scale)
    scores, keys, values, slopes = _reference_probabilities(q, k_chunk, v_chunk, k_pool, k_page_index, v_pool,
                                                            v_page_index, history_tokens, softmax_scale, selected_pages,
                                                            query_tile_tokens, compute_dtype, logit_softcap,
                                                            sliding_window)
    probabilities = torch.softmax(scores, dim=-1)  # [Hq, Tc, L]
    dout_c = dout.to(compute_dtype)
    delta = (dout_c * out.to(compute_dtype)).sum(-1).transpose(0, 1)  # [Hq, Tc]
    dprobabilities = torch.einsum("thd,lhd->htl", dout_c, values)
    dscores = probabilities * (dprobabilities - delta[..., None]) * scale
    if slopes is not None:
        dscores = dscores * slopes
    dq = torch.einsum("htl,lhd->thd", dscores, keys)
    dkeys = torch.einsum("htl,thd->lhd", dscores, q.to(compute_dtype))       # [L, Hq, D]
    dvalues = torch.einsum("htl,thd->lhd", probabilities, dout_c)            # [L, Hq, D]
    length = dkeys.shape[0]
    dkeys = dkeys.reshape(length, kv_heads, group, head_dim).sum(2)
    dvalues = dvalues.reshape(length, kv_heads, group, head_dim).sum(2)
    return (dq.to(q.dtype), dkeys[history_tokens:].to(q.dtype), dvalues[history_tokens:].to(q.dtype),
            dkeys[:history_tokens], dvalues[:history_tokens])
