"""The attention ops the trainer calls, in one place.

The ops themselves are ``torch.ops.membar.paged_attention_forward`` / ``paged_attention_backward`` /
``page_summary`` / ``page_select`` (kernels/include/membar/kernels/attention.h holds the contract,
bindings/csrc/attention_ops.cpp the schemas). This module only names the arguments, so that the
rest of the trainer reads as keyword calls and a schema change touches one file.

Shapes (one sequence, one layer, one chunk):
  q        [chunk_tokens, num_q_heads, head_dim]
  k, v     [chunk_tokens, num_kv_heads, head_dim]
  pools    [pool_pages, page_tokens, num_kv_heads, head_dim]; page_index int32 [num_history_pages]
  lse      [num_q_heads, chunk_tokens], float32
  selected int32 [num_query_tiles, top_k] history page numbers, -1 = padding
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


def _ops():
    # Importing membar loads the compiled library into torch.ops.membar.
    import membar  # noqa: F401

    return torch.ops.membar


@dataclass
class HistoryView:
    """History K/V pages as the kernels see them: pools plus the page index of each history page."""

    k_pool: torch.Tensor        # [pool_pages, page_tokens, Hkv, D]
    v_pool: torch.Tensor        # [pool_pages, page_tokens, Hkv, D]
    page_index: torch.Tensor    # int32 [num_history_pages]; pool row of history page p
    history_tokens: int
    # Set when the view holds only the selected pages of a sparse access, renumbered 0..n-1 in
    # order (page_index then covers those n pages): int64 [original history pages], the new number
    # of each original page or -1. Selections must go through remap_selection.
    page_map: torch.Tensor | None = None
    v_page_index: torch.Tensor | None = None   # when V pages sit in other rows than K pages
    handles: list | None = None                # the store's bookkeeping (what to release)

    @property
    def v_index(self) -> torch.Tensor:
        return self.page_index if self.v_page_index is None else self.v_page_index

    def remap_selection(self, selection: torch.Tensor | None) -> torch.Tensor | None:
        if selection is None or self.page_map is None:
            return selection
        mapped = self.page_map[selection.clamp(min=0).long()]
        return torch.where(selection >= 0, mapped, -1).to(torch.int32)


@dataclass
class GradView:
    """History dK/dV pages, accumulated into in place by the backward kernel."""

    dk_pool: torch.Tensor       # [pool_pages, page_tokens, Hkv, D], grad page dtype
    dv_pool: torch.Tensor
    page_index: torch.Tensor    # int32 [num_history_pages]
    dv_page_index: torch.Tensor | None = None   # when dV pages sit in other rows than dK pages
    handles: list | None = None

    @property
    def dv_index(self) -> torch.Tensor:
        return self.page_index if self.dv_page_index is None else self.dv_page_index


def attention_forward(q, k, v, history: HistoryView, softmax_scale: float,
                      selected: torch.Tensor | None, query_tile_tokens: int):
    """Returns (out [Tc, Hq, D], lse [Hq, Tc] float32). Does not block on the GPU."""
    return _ops().paged_attention_forward(
        q, k, v, history.k_pool, history.page_index, history.v_pool, history.v_index,
        history.history_tokens, softmax_scale, history.remap_selection(selected), query_tile_tokens)


def attention_backward(q, k, v, history: HistoryView, softmax_scale: float, out, dout, lse,
                       grads: GradView, selected: torch.Tensor | None, query_tile_tokens: int,
                       deterministic: bool):
    """Returns (dq, dk, dv) of the chunk and ADDS the history's dK/dV into grads' pools."""
    return _ops().paged_attention_backward(
        q, k, v, history.k_pool, history.page_index, history.v_pool, history.v_index,
        out, dout, lse, grads.dk_pool, grads.page_index, grads.dv_pool, grads.dv_index,
        history.history_tokens, softmax_scale, history.remap_selection(selected), query_tile_tokens, deterministic)


def page_summary(k_pool, page_index, history_tokens: int) -> torch.Tensor:
    """Mean key of each page per kv head: float32 [num_pages, Hkv, D]."""
    mean, _, _ = _ops().page_summary(k_pool, page_index, history_tokens, False)
    return mean


def page_select(q, mean, top_k: int, query_tile_tokens: int) -> torch.Tensor:
    """Top-k history pages per query tile: int32 [num_query_tiles, top_k], ascending, -1 padded."""
    return _ops().page_select(q, mean, None, None, top_k, query_tile_tokens)
