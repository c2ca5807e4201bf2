"""The trainer's attention calls: the store's pages as the kernels see them (HistoryView,
GradView) and, per call, the choice between cuDNN's fused attention (Note [cuDNN for dense
history]) and membar's paged kernels, which it reaches through membar.attention, the one wrapper
of the attention ops (page summaries and selections too: membar.attention.page_summary and
page_select).

Shapes (one sequence, one layer, one chunk):
  q        [chunk_tokens, num_q_heads, head_dim]
  k, v     [chunk_tokens, num_kv_heads, head_dim]
  pools    [pool_pages, page_tokens, num_kv_heads, head_dim]; page_index int32 [num_history_pages]
  lse      [num_q_heads, chunk_tokens], float32
  selected int32 [num_query_tiles, top_k] history page numbers, -1 = padding
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from .. import attention
from . import cudnn_attention


def cuda_softcap_kernels() -> bool:
    """Whether soft-capped layers (Gemma 2) run on the CUDA paged kernels (Note [Soft-capped scores]
    in membar/kernels/attention.h) rather than the PyTorch path (Note [Attention in PyTorch]).
    MEMBAR_CUDA_SOFTCAP=1 / 0 overrides the default. On the CPU the kernels always take the cap."""
    value = os.environ.get("MEMBAR_CUDA_SOFTCAP", "")
    return value == "1" if value in ("0", "1") else CUDA_SOFTCAP_DEFAULT


# On by default since their GPU tests passed on the H200 (session 18, 2f9f444: the capped C++ cases
# against the CPU reference, the capped ops against float32 autograd, Gemma 2's bf16 gradient error
# through the trainer); MEMBAR_CUDA_SOFTCAP=0 sends capped layers to the PyTorch path instead.
CUDA_SOFTCAP_DEFAULT = True


def cuda_window_kernels() -> bool:
    """Whether sliding-window layers (Mistral v0.1, Gemma 2/3 local layers, Qwen2) whose window hides
    keys run on the CUDA paged kernels (Note [Sliding window] in membar/kernels/attention.h) rather
    than the PyTorch path (Note [Attention in PyTorch]), where the call takes the layer's visible
    history in one call with the chunk. MEMBAR_CUDA_WINDOW=1 / 0 overrides the default. On the CPU
    the kernels always take the window."""
    value = os.environ.get("MEMBAR_CUDA_WINDOW", "")
    return value == "1" if value in ("0", "1") else CUDA_WINDOW_DEFAULT


# On by default since their GPU tests passed on the H200 (session 19, 7489cf1: the C++ Windowed suite
# against the CPU reference at every head size and dtype, the windowed ops against float32 autograd,
# Mistral's, Gemma 2's and Gemma 3's bf16 gradient errors through the trainer with their local layers
# on the kernels); MEMBAR_CUDA_WINDOW=0 sends windowed layers to the PyTorch path instead.
CUDA_WINDOW_DEFAULT = True


@dataclass
class HistoryView:
    """History K/V pages as the kernels see them: pools plus the page index of each history page."""

    k_pool: torch.Tensor        # [pool_pages, page_tokens, Hkv, D]
    v_pool: torch.Tensor        # [pool_pages, page_tokens, Hkv, D]
    page_index: torch.Tensor    # int32 [num_history_pages]; pool row of history page p
    history_tokens: int
    # Set when the view holds only the selected pages of a sparse access, renumbered 0..n-1 in
    # order (page_index then covers those n pages): int64 [pages of the access], the new number of
    # each of the access's pages (counted from block_first_page) or -1. Host or device.
    page_map: torch.Tensor | None = None
    v_page_index: torch.Tensor | None = None   # when V pages sit in other rows than K pages
    handles: list | None = None                # the store's bookkeeping (what to release)
    # Set when the view covers one block of the history, pages [block_first_page,
    # block_first_page + block_pages): selections (history page numbers) are then made local to it.
    block_first_page: int = 0
    block_pages: int | None = None
    # Set when history page p is pool row first_row + p for every p (K and V): the history is then
    # one strided tensor and dense calls may skip the page table (Note [cuDNN for dense history]).
    first_row: int | None = None

    @property
    def v_index(self) -> torch.Tensor:
        return self.page_index if self.v_page_index is None else self.v_page_index

    def remap_selection(self, selection: torch.Tensor | None) -> torch.Tensor | None:
        """A selection int32 [tiles, top_k] of history page numbers (host or device), as the call
        over this view must see it: pages outside the view's block dropped (-1), the rest numbered
        from the block's first page and, for a view of selected pages only, through page_map.
        Returned on the device of page_index (copied without blocking the host)."""
        if selection is None:
            return None
        if self.page_map is None and self.block_pages is None:
            return to_device(selection, self.page_index.device)
        local = selection.long() - self.block_first_page
        if self.block_pages is not None:
            local = torch.where((local >= 0) & (local < self.block_pages), local, -1)
        if self.page_map is not None:
            page_map = self.page_map.to(local.device)
            local = torch.where(local >= 0, page_map[local.clamp(min=0)], -1)
        return to_device(local.to(torch.int32), self.page_index.device)


@dataclass
class GradView:
    """History dK/dV pages, accumulated into in place by the backward kernel."""

    dk_pool: torch.Tensor       # [pool_pages, page_tokens, Hkv, D], grad page dtype
    dv_pool: torch.Tensor
    page_index: torch.Tensor    # int32 [num_history_pages]
    dv_page_index: torch.Tensor | None = None   # when dV pages sit in other rows than dK pages
    handles: list | None = None
    first_row: int | None = None                # as HistoryView.first_row, for dK and dV

    @property
    def dv_index(self) -> torch.Tensor:
        return self.page_index if self.dv_page_index is None else self.dv_page_index


def _history_rows(history: HistoryView):
    if history.history_tokens == 0:
        return None, None
    return (cudnn_attention.rows(history.k_pool, history.first_row, history.history_tokens),
            cudnn_attention.rows(history.v_pool, history.first_row, history.history_tokens))


def attention_forward(q, k, v, history: HistoryView, softmax_scale: float,
                      selected: torch.Tensor | None, query_tile_tokens: int, attend_chunk: bool = True,
                      kernel: str = "membar", deterministic: bool = False, logit_softcap: float = 0.0,
                      sliding_window: int = 0):
    """Returns (out [Tc, Hq, D], lse [Hq, Tc] float32). Does not block on the GPU.

    attend_chunk=False: attend only the history's pages (one block of a streamed history; rows
    that see no key get out 0, lse -inf); merge blocks with membar.attention.merge_attention_into.
    kernel="auto": dense calls on consecutive pages go through cuDNN where it applies
    (Note [cuDNN for dense history]); "membar": membar's paged kernels always. logit_softcap > 0:
    Gemma 2's soft-capped scores (Note [Soft-capped scores] in membar/kernels/attention.h; membar's
    kernels only, cuDNN takes no cap). sliding_window > 0: a local layer's window, positions counted
    from the view's first history token (Note [Sliding window]; membar's kernels only)."""
    if (not logit_softcap and not sliding_window and (attend_chunk or history.history_tokens > 0)
            and cudnn_attention.usable(q, history, selected, deterministic, kernel, k, "forward")):
        history_k, history_v = _history_rows(history)
        result = cudnn_attention.attempt("forward", q, k, lambda: cudnn_attention.forward(
            q, k, v, history_k, history_v, softmax_scale, attend_chunk))
        if result is not None:
            return result
    return attention.paged_attention_forward(
        q, k, v, history.k_pool, history.page_index, history.v_pool, history.v_index, history.history_tokens,
        softmax_scale=softmax_scale, selected_pages=history.remap_selection(selected),
        query_tile_tokens=query_tile_tokens, attend_chunk=attend_chunk, logit_softcap=logit_softcap,
        sliding_window=sliding_window)


def attention_backward(q, k, v, history: HistoryView, softmax_scale: float, out, dout, lse,
                       grads: GradView, selected: torch.Tensor | None, query_tile_tokens: int,
                       deterministic: bool, attend_chunk: bool = True, kernel: str = "membar",
                       logit_softcap: float = 0.0, sliding_window: int = 0):
    """Returns (dq, dk, dv) of the chunk and ADDS the history's dK/dV into grads' pools.

    attend_chunk=False: out/lse must be the rows' FINAL merged ones; dq is this block's part and
    dk/dv are zeros. kernel, logit_softcap, sliding_window: as in attention_forward."""
    if (not logit_softcap and not sliding_window and (attend_chunk or history.history_tokens > 0)
            and cudnn_attention.usable(q, history, selected, deterministic, kernel, k, "backward")
            and (history.history_tokens == 0 or (grads.first_row is not None and grads.dv_page_index is None))):
        history_k, history_v = _history_rows(history)
        dk_rows = dv_rows = None
        if history.history_tokens > 0:
            dk_rows = cudnn_attention.rows(grads.dk_pool, grads.first_row, history.history_tokens)
            dv_rows = cudnn_attention.rows(grads.dv_pool, grads.first_row, history.history_tokens)
        # A failed backward leaves the grad pages untouched (cudnn_attention.backward adds last).
        result = cudnn_attention.attempt("backward", q, k, lambda: cudnn_attention.backward(
            q, k, v, history_k, history_v, out, dout, lse, softmax_scale, dk_rows, dv_rows, attend_chunk))
        if result is not None:
            return result
    return attention.paged_attention_backward(
        q, k, v, history.k_pool, history.page_index, history.v_pool, history.v_index, out, dout, lse,
        grads.dk_pool, grads.page_index, grads.dv_pool, grads.dv_index, history.history_tokens,
        softmax_scale=softmax_scale, selected_pages=history.remap_selection(selected),
        query_tile_tokens=query_tile_tokens, deterministic=deterministic, attend_chunk=attend_chunk,
        logit_softcap=logit_softcap, sliding_window=sliding_window)


def to_device(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """tensor on device; a host tensor is copied through pinned memory without blocking the host
    (the copy is ordered on the current stream, like any kernel)."""
    if tensor.device == device:
        return tensor
    if device.type == "cuda" and tensor.device.type == "cpu":
        if not tensor.is_pinned():
            tensor = tensor.pin_memory()
        return tensor.to(device, non_blocking=True)
    return tensor.to(device)
