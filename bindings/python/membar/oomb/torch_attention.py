"""Attention of a chunk over its history pages in plain PyTorch, for the sliding-window calls
membar's paged kernels do not take (with Gemma 2's attention-logit soft-cap where a local layer has
one).

Note [Attention in PyTorch]
  Rationale: a local layer (Mistral v0.1, Gemma 2/3, Qwen2 with use_sliding_window, Phi-3 with a
  sliding_window) lets a query at position p see keys p - W + 1 .. p only, and Gemma 2 passes every
  score s through softcap * tanh(s / softcap) before the softmax. The paged kernels take the
  soft-cap (Note [Soft-capped scores] in membar/kernels/attention.h) and a window over the whole
  visible history in one call with the chunk (Note [Sliding window]; on CUDA where
  kernels.cuda_window_kernels() says so), but not a window over one block of a streamed history,
  which this path serves (ChunkContext.torch_path decides), and correctness comes before speed.
  Approach: the same contract as the paged kernels (kernels.attention_forward / _backward), so the
  chunk-recurrent machinery around it (stages, streaming blocks merged by log-sum-exp, the access
  plan, offload) is unchanged. The trainer asks the store only for the pages a chunk's window
  reaches (ChunkContext.history_first_page); they are gathered from the view's pools by page
  index, and keys are taken in blocks (history rows, then the chunk's own keys) with an explicit
  mask from absolute positions: causal, and key > query - W. Scores, soft-cap, softmax and all
  sums are float32 (float64 for float64 inputs). The forward returns (out, lse) merged over the
  blocks, lse -inf for a row that saw no key (out 0 there). The backward is given the rows' final
  out and lse (P = exp(s - lse), D = rowsum(dO * O): the identity streamed history and cuDNN use),
  so it needs nothing from the forward; the soft-cap's derivative is 1 - tanh^2. It returns dq and
  the chunk's own dk/dv, and ADDS the history's dK/dV into the grad pages (index_add_ on the pool
  rows named by the grad view's page index), like the paged backward.
  On CUDA with bf16 or fp16 inputs the products run on the tensor cores, as the paged kernels
  compute them: 16-bit operands (P and dS rounded to the input dtype, like the kernels' P and dS)
  with float32 accumulation and results (torch.bmm(..., out_dtype=float32)); the softmax and all
  sums stay float32. Elsewhere (the CPU, float32 and float64 inputs) every product is float32
  (float64).
  Limitations: the slower path: every key block is a dense product over the whole window or
  history (masked entries are computed, then dropped), about (window + chunk) / window more work
  than a banded kernel would do for a local layer, and the masks, soft-cap and softmax are
  separate elementwise passes over float32 score blocks. Score blocks are bounded
  (SCORE_ELEMENTS). Sparse selections are not taken (check_layers refuses sparse mode with such
  layers).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .kernels import GradView, HistoryView

# Score entries per key block: each float32 temporary is ~64 MiB on the CPU, ~512 MiB on a GPU
# (where fewer, larger blocks keep kernel launches from dominating: 2048 keys per block for a
# 4096-token chunk of 16 query heads).
SCORE_ELEMENTS = {"cpu": 1 << 24, "cuda": 1 << 27}


@dataclass(frozen=True)
class Positions:
    """Absolute positions: the chunk's first token, and the first token of the history view."""

    chunk_first: int
    history_first: int
    sliding_window: int | None = None
    softcap: float | None = None


def _accumulate_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _operand_dtype(q: torch.Tensor) -> torch.dtype | None:
    """The 16-bit operand dtype of the products (CUDA with bf16 or fp16 inputs: the tensor cores),
    or None: float32 (float64) operands."""
    return q.dtype if q.device.type == "cuda" and q.dtype in (torch.bfloat16, torch.float16) else None


def _half_product(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Batched a @ b of 16-bit operands, float32 accumulation and result (CUDA)."""
    return torch.bmm(a, b, out_dtype=torch.float32)


def _product(a: torch.Tensor, b: torch.Tensor, operands: torch.dtype | None, dtype: torch.dtype) -> torch.Tensor:
    """Batched a @ b in `dtype` (float32 or float64): with 16-bit `operands`, a and b rounded to them
    first (Note [Attention in PyTorch])."""
    if operands is None:
        return torch.matmul(a.to(dtype), b.to(dtype))
    return _half_product(a.to(operands), b.to(operands))


def _history_rows(pool: torch.Tensor, page_index: torch.Tensor, tokens: int) -> torch.Tensor:
    """The view's pages [n, page_tokens, Hkv, D] gathered in order, as rows [tokens, Hkv, D]."""
    pages = pool.index_select(0, page_index.long())
    return pages.reshape((-1,) + tuple(pool.shape[2:]))[:tokens]


def _key_blocks(q, k, v, history: HistoryView, positions: Positions, attend_chunk: bool):
    """(k rows [n, Hkv, D], v rows, positions int64 [n], source, offset) per block of keys;
    source is "history" or "chunk", offset the block's first row within its source."""
    if history.page_map is not None:
        raise ValueError("the PyTorch attention path takes whole pages, not a sparse selection.")
    budget = SCORE_ELEMENTS.get(q.device.type, SCORE_ELEMENTS["cpu"])
    block = max(1, budget // max(1, q.shape[0] * q.shape[1]))
    sources = []
    if history.history_tokens > 0:
        history_k = _history_rows(history.k_pool, history.page_index, history.history_tokens)
        history_v = _history_rows(history.v_pool, history.v_index, history.history_tokens)
        sources.append(("history", history_k, history_v, positions.history_first))
    if attend_chunk:
        sources.append(("chunk", k, v, positions.chunk_first))
    for source, keys, values, first in sources:
        for offset in range(0, keys.shape[0], block):
            end = min(offset + block, keys.shape[0])
            key_positions = torch.arange(first + offset, first + end, device=q.device)
            yield keys[offset:end], values[offset:end], key_positions, source, offset


def _scores(q_groups, keys, query_positions, key_positions, scale: float, positions: Positions, operands, dtype):
    """Masked scores [Hkv, G * Tc, n] in `dtype` (-inf where masked) and tanh of the soft-capped
    scores (or None), for q_groups [Hkv, G * Tc, D] and keys [n, Hkv, D]."""
    raw = _product(q_groups, keys.permute(1, 2, 0), operands, dtype).mul_(scale)
    tanh = None
    if positions.softcap is not None:
        tanh = torch.tanh(raw / positions.softcap)
        raw = tanh * positions.softcap
    visible = key_positions.unsqueeze(0) <= query_positions.unsqueeze(1)          # [Tc, n]
    if positions.sliding_window is not None:
        visible &= key_positions.unsqueeze(0) > query_positions.unsqueeze(1) - positions.sliding_window
    groups = q_groups.shape[1] // query_positions.shape[0]
    visible = visible.repeat(groups, 1).unsqueeze(0)                             # [1, G * Tc, n]
    return raw.masked_fill(~visible, float("-inf")), tanh, visible


def _grouped(q, num_kv_heads: int, dtype) -> torch.Tensor:
    """q [Tc, Hq, D] -> [Hkv, G * Tc, D], query head h = kv * G + g (transformers' repeat_kv order)."""
    tokens, heads, dim = q.shape
    groups = heads // num_kv_heads
    grouped = q.to(dtype).view(tokens, num_kv_heads, groups, dim).permute(1, 2, 0, 3)
    return grouped.reshape(num_kv_heads, groups * tokens, dim)


def _ungrouped(x, tokens: int) -> torch.Tensor:
    """[Hkv, G * Tc, D] -> [Tc, Hq, D]."""
    kv_heads, rows, dim = x.shape
    groups = rows // tokens
    return x.view(kv_heads, groups, tokens, dim).permute(2, 0, 1, 3).reshape(tokens, kv_heads * groups, dim)


def forward(q, k, v, history: HistoryView, scale: float, positions: Positions, attend_chunk: bool = True):
    """(out [Tc, Hq, D] in q's dtype, lse [Hq, Tc] float32, float64 for float64 q) of the chunk's
    queries over the history view's rows and, when attend_chunk, the chunk's own keys."""
    dtype, operands = _accumulate_dtype(q.dtype), _operand_dtype(q)
    tokens, kv_heads = q.shape[0], k.shape[1]
    q_groups = _grouped(q, kv_heads, operands or dtype)
    query_positions = torch.arange(positions.chunk_first, positions.chunk_first + tokens, device=q.device)
    out = torch.zeros(q_groups.shape, dtype=dtype, device=q.device)
    lse = torch.full(q_groups.shape[:2], float("-inf"), dtype=dtype, device=q.device)
    for keys, values, key_positions, _, _ in _key_blocks(q, k, v, history, positions, attend_chunk):
        scores, _, _ = _scores(q_groups, keys, query_positions, key_positions, scale, positions, operands, dtype)
        block_lse = torch.logsumexp(scores, dim=-1)                              # [Hkv, G * Tc]
        merged = torch.logaddexp(lse, block_lse)
        finite = torch.isfinite(merged)
        safe = torch.where(finite, merged, torch.zeros_like(merged))
        probabilities = torch.exp(scores - safe.unsqueeze(-1))                   # 0 where masked
        out.mul_(torch.where(finite, torch.exp(lse - safe), torch.zeros_like(lse)).unsqueeze(-1))
        out.add_(_product(probabilities, values.transpose(0, 1), operands, dtype))
        lse = merged
    return _ungrouped(out, tokens).to(q.dtype), _ungrouped(lse.unsqueeze(-1), tokens)[..., 0].t().contiguous()


def backward(q, k, v, history: HistoryView, scale: float, out, dout, lse, grads: GradView | None,
             positions: Positions, attend_chunk: bool = True):
    """(dq [Tc, Hq, D], dk, dv [Tc, Hkv, D]) of the chunk (dk/dv zeros when not attend_chunk);
    ADDS the history's dK/dV into grads' pools. out and lse must be the rows' final ones."""
    dtype, operands = _accumulate_dtype(q.dtype), _operand_dtype(q)
    tokens, kv_heads = q.shape[0], k.shape[1]
    q_groups = _grouped(q, kv_heads, operands or dtype)
    dout_groups = _grouped(dout, kv_heads, operands or dtype)
    # D = rowsum(dO * O) and lse per row, in the grouped order [Hkv, G * Tc].
    row_dot = _grouped((dout.to(dtype) * out.to(dtype)).sum(-1, keepdim=True), kv_heads, dtype)[..., 0]
    row_lse = _grouped(lse.t().unsqueeze(-1), kv_heads, dtype)[..., 0]
    row_lse = torch.where(torch.isfinite(row_lse), row_lse, torch.full_like(row_lse, float("inf")))
    query_positions = torch.arange(positions.chunk_first, positions.chunk_first + tokens, device=q.device)
    dq = torch.zeros(q_groups.shape, dtype=dtype, device=q.device)
    dk = torch.zeros(k.shape, dtype=dtype, device=k.device)
    dv = torch.zeros(v.shape, dtype=dtype, device=v.device)
    history_dk = history_dv = None
    if history.history_tokens > 0:
        history_dk = torch.zeros((history.history_tokens,) + tuple(k.shape[1:]), dtype=dtype, device=k.device)
        history_dv = torch.zeros_like(history_dk)
    for keys, values, key_positions, source, offset in _key_blocks(q, k, v, history, positions, attend_chunk):
        scores, tanh, visible = _scores(q_groups, keys, query_positions, key_positions, scale, positions, operands,
                                        dtype)
        probabilities = torch.exp(scores - row_lse.unsqueeze(-1))                # [Hkv, G * Tc, n]
        block_dv = _product(probabilities.transpose(1, 2), dout_groups, operands, dtype)   # [Hkv, n, D]
        dp = _product(dout_groups, values.permute(1, 2, 0), operands, dtype)              # [Hkv, G * Tc, n]
        ds = probabilities.mul_(dp.sub_(row_dot.unsqueeze(-1)))
        if tanh is not None:
            ds.mul_(1 - tanh * tanh)
        ds.masked_fill_(~visible, 0.0)
        dq.add_(_product(ds, keys.transpose(0, 1), operands, dtype), alpha=scale)
        block_dk = _product(ds.transpose(1, 2), q_groups, operands, dtype).mul_(scale)   # [Hkv, n, D]
        rows = slice(offset, offset + keys.shape[0])
        target_k, target_v = (history_dk, history_dv) if source == "history" else (dk, dv)
        target_k[rows] += block_dk.transpose(0, 1)
        target_v[rows] += block_dv.transpose(0, 1)
    if history_dk is not None:
        _add_into_pages(grads.dk_pool, grads.page_index, history_dk)
        _add_into_pages(grads.dv_pool, grads.dv_index, history_dv)
    return _ungrouped(dq, tokens).to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


def _add_into_pages(pool: torch.Tensor, page_index: torch.Tensor, rows: torch.Tensor) -> None:
    """pool[page_index[i]] += page i of rows [tokens, Hkv, D] (the last page zero-padded)."""
    page_tokens = pool.shape[1]
    pages = page_index.shape[0]
    padded = rows.new_zeros((pages * page_tokens,) + tuple(rows.shape[1:]))
    padded[: rows.shape[0]] = rows
    pool.index_add_(0, page_index.long(), padded.view((pages, page_tokens) + tuple(rows.shape[1:])).to(pool.dtype))
