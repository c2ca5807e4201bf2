"""The Hugging Face side: an attention function registered as "membar_paged".

transformers calls attention functions as fn(module, query, key, value, attention_mask, scaling=...,
dropout=..., **kwargs) with post-RoPE query [batch, Hq, tokens, D] and key/value [batch, Hkv, tokens,
D], and expects (output [batch, tokens, Hq, D], weights or None). While an OOMB `ChunkContext` is
active the function runs the chunk's attention over the paged history; outside one it falls back
to SDPA (the model's own eager attention for soft-capped layers), so a model converted for OOMB
still evaluates and generates normally. While `models.probe_layers` runs, it records what each
layer passes (Note [One integration point] in models.py).
"""
from __future__ import annotations

import contextlib
import math
import os
import sys
from dataclasses import dataclass, field
from typing import Sequence

import torch

from .. import attention
from . import kernels, torch_attention
from .config import OOMBConfig
from .kv_store import Access, KVStore
from .models import AttentionProbe, LayerAttention

ATTENTION_NAME = "membar_paged"

# Passed as the attention mask of a chunk: a 4-D mask is taken as given by transformers' mask
# builder, which otherwise inspects position_ids for packed sequences on the host (a wait for the
# GPU per chunk). The paged attention reads no mask; the empty shape says so.
NO_MASK = torch.empty((1, 1, 0, 0), dtype=torch.bool)

# The chunk being run, process-wide rather than per thread: PyTorch's autograd engine runs the
# backward of CUDA tensors on its own device threads, and layer checkpointing recomputes the
# decoder layers (calling the attention function) there. One trainer step runs at a time.
class _CurrentChunk:
    context: "ChunkContext | None" = None


_state = _CurrentChunk()


@dataclass
class ChunkContext:
    """What the attention function needs to know about the chunk being run.

    config: the trainer's OOMBConfig (page size, mode, kernels, streaming); layers: what each layer
    hands the attention interface (models.probe_layers). stage: 1 (no-grad forward filling pages) or
    2 (recompute with grad, then backward). chunk: chunk number; first_token: its absolute position;
    sequence_tokens: the whole sequence's length (every chunk knows it: length-dependent RoPE reads
    it, Note [RoPE that depends on the sequence length] in models.py).
    """

    store: KVStore
    config: OOMBConfig
    layers: Sequence[LayerAttention]
    stage: int
    chunk: int
    first_token: int
    chunk_tokens: int
    sequence_tokens: int
    # Sparse mode, shared across chunks of one sequence:
    summaries: dict = field(default_factory=dict)    # layer -> float32 [num_pages, Hkv, D]
    # (layer, chunk) -> int32 [tiles, top_k] or None. On the host for layers whose store reads
    # selected pages (the union must be known there), else on the device.
    selections: dict = field(default_factory=dict)
    # (layer, chunk) -> (sorted tuple of the selection's pages, whether the store holds them in one
    # history block's room: Note [Streaming a layer's history]).
    selection_unions: dict = field(default_factory=dict)
    # Stage 2, this chunk only: layer -> (out, lse) of the first forward (see keep_attention_outputs).
    attention_outputs: dict = field(default_factory=dict)
    # config.reuse_stage1_attention in a training step, shared across chunks: chunk -> {layer: (out,
    # lse)} of stage 1, until stage 2's forward takes it (Note [Stage 1's attention in stage 2]);
    # None where stage 1's outputs are not kept.
    stage1_outputs: dict | None = None
    attended_layers: set = field(default_factory=set)
    # Head parallel: the group this rank's heads are split over (sparse selection sums its scores
    # over the group: Note [Page selection over split heads] in tensor_parallel.py), else None.
    split_group: object = None

    # -- the config, as the attention function reads it ------------------------------------------

    @property
    def page_tokens(self) -> int:
        return self.config.page_tokens

    @property
    def mode(self) -> str:
        return self.config.mode

    def sparse(self, layer: int) -> bool:
        """Whether the layer's chunks read a top-k selection of their history: in sparse mode, every
        layer without a sliding window. A local layer reads its whole window (Note [Local layers in
        sparse mode])."""
        return self.config.mode == "sparse" and self.layers[layer].sliding_window is None

    @property
    def top_k(self) -> int:
        return self.config.top_k

    @property
    def query_tile_tokens(self) -> int:
        return self.config.query_tile_tokens

    @property
    def deterministic(self) -> bool:
        return self.config.deterministic

    @property
    def dense_kernel(self) -> str:
        return self.config.dense_kernel

    @property
    def history_block_pages(self) -> int:
        """Offloaded layers stream their history in blocks of this many pages (0: one call)."""
        return self.config.history_block_tokens // self.config.page_tokens

    @property
    def keep_attention_outputs(self) -> bool:
        """Stage 2 keeps each layer's attention output until its backward, for the layer recompute
        of checkpointing."""
        return self.config.checkpoint_layers

    # -- where the chunk sits ----------------------------------------------------------------------

    @property
    def first_page(self) -> int:
        # Every earlier chunk is whole and starts on a page boundary.
        return self.first_token // self.config.page_tokens

    @property
    def history_pages(self) -> int:
        """Pages of all earlier chunks."""
        return self.first_page

    @property
    def later_chunks(self) -> bool:
        """Whether a later chunk exists (then its dK/dV pages hold gradient to inject)."""
        return self.first_token + self.chunk_tokens < self.sequence_tokens

    def history_first_page(self, layer: int) -> int:
        """The first history page the layer's queries can see: 0, or for a sliding-window layer the
        page holding the oldest key of the chunk's first query's window (pages before it are not
        read; Note [Attention in PyTorch] in torch_attention.py)."""
        window = self.layers[layer].sliding_window
        if window is None:
            return 0
        return min(max(0, self.first_token - window + 1) // self.page_tokens, self.history_pages)

    def window_hides(self, layer: int) -> bool:
        """Whether the layer's sliding window hides keys from some query of this chunk (the last one
        sees keys from first_token + chunk_tokens - window on)."""
        window = self.layers[layer].sliding_window
        return window is not None and self.first_token + self.chunk_tokens > window

    def torch_path(self, layer: int, device: torch.device | None = None) -> bool:
        """Whether this layer's attention in this chunk runs in PyTorch (Note [Attention in PyTorch]
        in torch_attention.py) rather than on the paged kernels. A soft-cap runs on the kernels (Note
        [Soft-capped scores]), on a CUDA `device` where kernels.cuda_softcap_kernels() says so. A
        window that hides keys runs on the kernels (Note [Sliding window] in
        membar/kernels/attention.h), on a CUDA `device` where kernels.cuda_window_kernels() says so,
        when the layer's visible history goes to one call with the chunk: not when it is streamed
        in blocks (a block alone does not know where the queries sit; Note [Streaming a layer's
        history]). In sparse mode a windowed layer reads its whole window (Note [Local layers in
        sparse mode])."""
        record = self.layers[layer]
        if (record.softcap is not None and device is not None and device.type == "cuda"
                and not kernels.cuda_softcap_kernels()):
            return True
        if not self.window_hides(layer):
            return False
        if device is not None and device.type == "cuda" and not kernels.cuda_window_kernels():
            return True
        return self.streams(layer)

    def softcap(self, layer: int) -> float:
        """The layer's attention-logit soft-cap for the paged kernels (0.0: none)."""
        return self.layers[layer].softcap or 0.0

    def sliding_window(self, layer: int) -> int:
        """The layer's window for the paged kernels: 0 where it hides no key of this chunk. The
        kernels count positions from the first page of the call's history (history_first_page),
        which keeps every distance, hence the mask, as Hugging Face's."""
        return self.layers[layer].sliding_window if self.window_hides(layer) else 0

    def streams(self, layer: int) -> bool:
        """Whether this layer's history goes through the GPU in several blocks: it is offloaded and
        longer than a block, and it is not a sparse selection whose pages the store holds in one
        block's room (Note [Streaming a layer's history])."""
        pages = self.history_pages - self.history_first_page(layer)
        if not (self.store.streams_history(layer) and 0 < self.history_block_pages < pages):
            return False
        union = self._selected(layer)
        return union is None or not union[1]

    def _union(self, layer: int) -> tuple[int, ...] | None:
        union = self._selected(layer)
        return None if union is None else union[0]

    def _selected(self, layer: int) -> tuple[tuple[int, ...], bool] | None:
        """The chunk's selection for the layer as (its pages, whether they fit one block's room), or
        None when the layer reads whole page ranges."""
        selection = self.selections.get((layer, self.chunk))
        if selection is None or not self.store.reads_selected_pages(layer):
            return None
        # Every access of the chunk needs it: computed once.
        union = self.selection_unions.get((layer, self.chunk))
        if union is None:
            pages = selected_pages(selection)
            block = self.history_block_pages
            union = (pages, block > 0 and self.store.holds_in_one_block(layer, pages, block))
            self.selection_unions[(layer, self.chunk)] = union
        return union

    def history_access(self, layer: int, phase: str, kind: str = "kv") -> Access:
        """The one access covering the layer's whole visible history (the unstreamed path)."""
        first = self.history_first_page(layer)
        return Access(kind, layer, self.chunk, phase, first, self.history_pages - first, self._union(layer))

    def history_accesses(self, layer: int, phase: str, kind: str = "kv") -> list[Access]:
        """The accesses one attention call (forward or backward) of this layer makes, in order:
        none without visible history, one over it, or one per block of a streamed history (in
        sparse mode, blocks holding no selected page are left out)."""
        start = self.history_first_page(layer)
        if start >= self.history_pages:
            return []
        if not self.streams(layer):
            return [self.history_access(layer, phase, kind)]
        union = self._union(layer)
        accesses = []
        for block, first in enumerate(range(start, self.history_pages, self.history_block_pages)):
            count = min(self.history_block_pages, self.history_pages - first)
            selected = None
            if union is not None:
                selected = tuple(page for page in union if first <= page < first + count)
                if not selected:
                    continue
            accesses.append(Access(kind, layer, self.chunk, phase, first, count, selected, block))
        return accesses

    def own_grad_access(self, layer: int) -> Access:
        pages = -(-self.chunk_tokens // self.page_tokens)
        return Access("chunk_grad", layer, self.chunk, "backward", self.first_page, pages)


def selected_pages(selection: torch.Tensor) -> tuple[int, ...]:
    """The sorted union of the pages a selection [tiles, top_k] names (padding -1 dropped)."""
    pages = selection.flatten()
    return tuple(sorted(set(pages[pages >= 0].tolist())))


def current_context() -> ChunkContext | None:
    return _state.context


@contextlib.contextmanager
def chunk_context(context: ChunkContext):
    previous = current_context()
    _state.context = context
    try:
        yield context
    finally:
        _state.context = previous


# Note [Streaming a layer's history]
#   Rationale: with offload, the pages of one layer's whole history on the GPU at once make GPU
#   memory grow with the sequence (K+V+dK+dV of one layer, ~6 KiB per token for a 7B model).
#   Approach: an offloaded layer whose history is longer than history_block_pages runs one
#   attention call per block of pages without the chunk's own keys (attend_chunk=False), plus one
#   call over the chunk alone (history_tokens 0), and merges them by log-sum-exp (the kernel
#   contract's Note [Blocked history]): lse = logaddexp of the parts, out = sum of
#   exp(lse_part - lse) * out_part, accumulated in float32 one block at a time. The backward calls
#   every block, and the chunk alone, with the final out and lse: each block adds its dK/dV into
#   its grad pages and returns its part of dq, which is summed in float32. Every block is an
#   access of the plan, so the store copies block i+1 in while block i computes, and writes dK/dV
#   back behind. The chunk's own keys get dK/dV from the chunk-only call alone.
#   A sparse selection is not streamed when the store holds its pages in one access's room
#   (KVStore.holds_in_one_block: the runtime store counts the 2 MiB frames they touch in the K/V
#   and dK/dV spaces against room_frames): then one call over the whole history reads them. Block
#   by block, a selection cost one call over all of the chunk's queries per block holding a
#   selected page, and per call an access, a merge and, in the backward, a float32 dq sum: with
#   64K-token blocks, 16 calls per layer and chunk at 1M tokens for 64 pages. A block's room alone
#   is too small for a scattered selection at the 7B shape (a 128 KiB page is 1/16 of a frame: a
#   64K-token block spans 33 frames, top-64 pages of a 256K-1M history touch 51-60), so the
#   default GPU budget also has room for as many scattered pages as a chunk's selection names
#   (OOMBConfig.selection_pages, where that is at most a block's pages; 2.48 GiB instead of 1.88
#   GiB at the 7B shape); a budget given too small for it streams selections as before. H200
#   (session 13): 256K sparse-offload 1.12x the throughput of block by block; the whole 1M sparse
#   step through membard 293 s (486 s to its last chunk block by block, session 12), its stage-2
#   chunks about 0.7 s each whatever their history (2.5 s down to 0.77 s before).
#   Limitations: the merged out is rounded to the model dtype once, like the single call's; dq
#   is rounded per block before the float32 sum (bf16 on the GPU: a few ulps more than one call).


def _attention_forward(context: ChunkContext, layer: int, q, k, v, history: kernels.HistoryView, scale: float,
                       selection, attend_chunk: bool = True):
    """One attention call of the layer: the paged kernels (soft-capped for Gemma 2, windowed for local
    layers), or PyTorch where they do not take the call (ChunkContext.torch_path; Note [Attention in
    PyTorch] in torch_attention.py)."""
    if context.torch_path(layer, q.device):
        return torch_attention.forward(q, k, v, history, scale, _positions(context, layer, history), attend_chunk)
    return kernels.attention_forward(q, k, v, history, scale, selection, context.query_tile_tokens,
                                     attend_chunk=attend_chunk, kernel=context.dense_kernel,
                                     deterministic=context.deterministic, logit_softcap=context.softcap(layer),
                                     sliding_window=context.sliding_window(layer))


def _attention_backward(context: ChunkContext, layer: int, q, k, v, history: kernels.HistoryView, scale: float,
                        out, dout, lse, grads: kernels.GradView, selection, attend_chunk: bool = True):
    """The backward of one attention call (see _attention_forward); ADDS the history's dK/dV into grads."""
    if context.torch_path(layer, q.device):
        return torch_attention.backward(q, k, v, history, scale, out, dout, lse, grads,
                                        _positions(context, layer, history), attend_chunk)
    return kernels.attention_backward(q, k, v, history, scale, out, dout, lse, grads, selection,
                                      context.query_tile_tokens, context.deterministic, attend_chunk=attend_chunk,
                                      kernel=context.dense_kernel, logit_softcap=context.softcap(layer),
                                      sliding_window=context.sliding_window(layer))


def _positions(context: ChunkContext, layer: int, history: kernels.HistoryView) -> torch_attention.Positions:
    record = context.layers[layer]
    return torch_attention.Positions(chunk_first=context.first_token,
                                     history_first=history.block_first_page * context.page_tokens,
                                     sliding_window=record.sliding_window, softcap=record.softcap)


def _forward(context: ChunkContext, layer: int, phase: str, q, k, v, scale: float, selection):
    """Attention of the chunk over its history and itself: (out [Tc, Hq, D], lse [Hq, Tc])."""
    store = context.store
    accesses = context.history_accesses(layer, phase)
    if not context.streams(layer):
        history = _history(context, accesses[0] if accesses else None)
        out, lse = _attention_forward(context, layer, q, k, v, history, scale, selection)
        if accesses:
            store.release(accesses[0], history)
        return out, lse
    # Note [Streaming a layer's history].
    out, lse = _attention_forward(context, layer, q, k, v, _history(context, None), scale, None)
    total = out.float()
    for access in accesses:
        history = _history(context, access)
        part, part_lse = _attention_forward(context, layer, q, k, v, history, scale, selection, attend_chunk=False)
        store.release(access, history)
        lse = attention.merge_attention_into(total, lse, part, part_lse)
    return total.to(q.dtype), lse


def _backward(context: ChunkContext, layer: int, q, k, v, out, dout, lse, scale: float, selection):
    """dq, dk, dv of the chunk; ADDS the history's dK/dV into the store's grad pages."""
    store = context.store
    accesses = context.history_accesses(layer, "backward")
    if not context.streams(layer):
        access = accesses[0] if accesses else None
        history = _history(context, access)
        grad_access = context.history_access(layer, "backward", kind="dkv") if access is not None else None
        grads = store.grad_history(grad_access) if access is not None else _empty_grads(store, k)
        dq, dk, dv = _attention_backward(context, layer, q, k, v, history, scale, out, dout, lse, grads, selection)
        if access is not None:
            store.release(access, history)
            store.release(grad_access, grads)
        return dq, dk, dv
    # Note [Streaming a layer's history]: the chunk alone, then each block, all given the final out/lse.
    dq, dk, dv = _attention_backward(context, layer, q, k, v, _history(context, None), scale, out, dout, lse,
                                     _empty_grads(store, k), None)
    dq_total = dq.float()
    grad_accesses = context.history_accesses(layer, "backward", kind="dkv")
    for access, grad_access in zip(accesses, grad_accesses):
        history = _history(context, access)
        grads = store.grad_history(grad_access)
        part, _, _ = _attention_backward(context, layer, q, k, v, history, scale, out, dout, lse, grads, selection,
                                         attend_chunk=False)
        store.release(access, history)
        store.release(grad_access, grads)
        dq_total.add_(part)   # float32 += model dtype, without a float32 copy of part
    return dq_total.to(dq.dtype), dk, dv


class _ChunkPagedAttention(torch.autograd.Function):
    """Attention of one chunk over its paged history, with grad (stage 2).

    forward(q [Tc, Hq, D], k [Tc, Hkv, D], v [Tc, Hkv, D]) -> out [Tc, Hq, D]. The history pages are
    fetched from the store again in backward (they may have been offloaded in between); backward
    returns dq, dk, dv of the chunk and ADDS the history's dK/dV into the store's grad pages.
    A second forward of the same layer in the same chunk is the recompute of layer checkpointing:
    it returns the first forward's output when that was kept (keep_attention_outputs).
    """

    @staticmethod
    def forward(ctx, q, k, v, context: ChunkContext, layer: int, scale: float):
        selection = context.selections.get((layer, context.chunk))
        first = layer not in context.attended_layers
        kept = None if first else context.attention_outputs.pop(layer, None)
        if kept is None and first:
            kept = _stage1_output(context, layer, q.device)   # Note [Stage 1's attention in stage 2]
        if kept is None:
            kept = _forward(context, layer, "forward", q, k, v, scale, selection)
        if first:
            if context.keep_attention_outputs:
                context.attention_outputs[layer] = kept
            context.attended_layers.add(layer)
        out, lse = kept
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.context, ctx.layer, ctx.scale = context, layer, scale
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        context, layer = ctx.context, ctx.layer
        context.attention_outputs.pop(layer, None)
        selection = context.selections.get((layer, context.chunk))
        dq, dk, dv = _backward(context, layer, q, k, v, out, dout.contiguous(), lse, ctx.scale, selection)
        return dq, dk, dv, None, None, None


def _history(context: ChunkContext, access: Access | None) -> kernels.HistoryView:
    """The store's view of access's pages, or a one-page placeholder when there is no access
    (chunk 0, or the chunk-only call of a streamed history: no page is read)."""
    layout = context.store.layout
    if access is None:
        empty = torch.zeros((1, layout.page_tokens, layout.num_kv_heads, layout.head_dim),
                            dtype=layout.dtype, device=layout.device)
        return kernels.HistoryView(empty, empty, torch.zeros(0, dtype=torch.int32, device=layout.device), 0)
    view = context.store.history(access, access.num_pages * layout.page_tokens)
    if access.first_page != 0 or access.num_pages != context.history_pages:
        view.block_first_page, view.block_pages = access.first_page, access.num_pages
    return view


def _empty_grads(store: KVStore, like: torch.Tensor) -> kernels.GradView:
    """Grad pools for a call without history pages: nothing will be written."""
    layout = store.layout
    empty = torch.zeros((1, layout.page_tokens, layout.num_kv_heads, layout.head_dim),
                        dtype=layout.grad_dtype, device=like.device)
    return kernels.GradView(empty, empty.clone(), torch.zeros(0, dtype=torch.int32, device=like.device))


class _InjectPageGrads(torch.autograd.Function):
    """Identity on a chunk's (k, v) whose backward adds the gradient that later chunks left in the
    chunk's own dK/dV pages (Note [Pages of a sequence] in kv_store.py)."""

    @staticmethod
    def forward(ctx, k, v, context: ChunkContext, layer: int):
        ctx.context, ctx.layer, ctx.tokens = context, layer, k.shape[0]
        return k.view_as(k), v.view_as(v)

    @staticmethod
    def backward(ctx, dk, dv):
        context = ctx.context
        access = context.own_grad_access(ctx.layer)
        page_dk, page_dv = context.store.chunk_grads(access, ctx.tokens)
        dk = (dk.float() + page_dk.float()).to(dk.dtype) if dk is not None else page_dk.to(page_dk.dtype)
        dv = (dv.float() + page_dv.float()).to(dv.dtype) if dv is not None else page_dv.to(page_dv.dtype)
        context.store.release(access, None)
        return dk, dv, None, None


def _stage1_attention(context: ChunkContext, layer: int, q, k, v, scale: float):
    """No-grad attention of a chunk; writes the chunk's K/V into its pages (and, in sparse mode,
    chooses the history pages each query tile sees and keeps the choice for stage 2)."""
    store = context.store
    selection = None
    if context.sparse(layer):
        selection = _select_pages(context, layer, q)
        if selection is not None and store.reads_selected_pages(layer):
            # The store copies only the selected pages, so their union must be known on the host:
            # this waits for the GPU (once per layer and chunk, sparse mode with offload only).
            selection = selection.cpu()
        context.selections[(layer, context.chunk)] = selection
    out, lse = _forward(context, layer, "stage1", q, k, v, scale, selection)
    if context.stage1_outputs is not None:
        _keep_stage1_output(context, layer, out, lse)
    store.write_chunk(layer, context.first_page, k, v)
    if context.sparse(layer) and context.later_chunks:
        _summarise_chunk(context, layer, k)
    if context.mode == "sparse":
        _predict_next_selection(context, layer)
    return out


# Note [Predicted selections]
#   Rationale: stage 1 of a sparse step chooses a chunk's history pages only once the chunk's
#   queries of that layer exist, so its plan cannot name them: with offload every frame they read
#   was copied when the attention asked for it, the stream waiting (73% prefetch hits over a 256K
#   step, all of stage 2's accesses hitting and none of stage 1's: H200, session 13). But
#   consecutive chunks' queries score the history's mean keys alike, and pages travel as whole
#   2 MiB frames (16 pages of the 7B shape), so the frames a layer read in the previous chunk are
#   a good guess for the frames it reads next.
#   Approach: once a layer's stage-1 attention is enqueued, the store is asked to predict
#   (KVStore.predict) the next layer's selection of this chunk (after the last layer, the first
#   layer's of the next chunk): the frames of that layer's selection in the chunk before, and of
#   that chunk's own pages (recent keys, not yet in the summaries it chose from). The copies
#   start behind the acquire of this layer's pages and run while this layer and the next one's
#   projections and selection compute. Where the selection lands in a copied frame, its access
#   finds the frame on the GPU; a frame guessed wrong is a copy for nothing (prefetch is a hint:
#   nothing is pinned, the access acquires what it really needs, gradients cannot change). Only
#   where the target chunk's history is longer than top_k (shorter ones read it whole, planned)
#   and the guess fits one access's room. MEMBAR_PREDICT_SELECTIONS=0 turns it off.
#   Measured (H200, session 22, 7B sparse-offload at 256K, one selection per chunk): prefetch hits
#   73% -> 84%, stage 1's stream waits 0.90 -> 0.35 s, the step 73.5 -> 72.3 s, 14% more bytes.
#   Limitations: a guess, not a plan: right about half the time at frame level there, and its
#   accuracy depends on the data (not on the method).


# Note [Local layers in sparse mode]
#   Rationale: models that train long contexts interleave local (sliding-window) layers with global
#   ones (Gemma 2 one in two, Gemma 3 five in six, Qwen2 with use_sliding_window), and sparse mode
#   exists to bound what a global layer reads of a long history. A local layer already reads at
#   most its window, a few pages; the kernels take no window and a selection together.
#   What: in sparse mode only the layers without a window select top-k pages (ChunkContext.sparse):
#   a local layer's chunks read every page of their window, exactly as in dense mode (summaries,
#   selections and guesses are made for the global layers only; the local layers' window accesses
#   are in the step's plan, stage 1 included). A model whose layers are all local trains as in dense
#   mode. Gradients equal full-sequence training's with the global layers' selections as masks
#   and the local layers' windows (test_local_layers_read_their_window_in_sparse_mode).


def _predict_next_selection(context: ChunkContext, layer: int) -> None:
    store = context.store
    if os.environ.get("MEMBAR_PREDICT_SELECTIONS", "1") == "0":
        return
    target, first_token = layer + 1, context.first_token
    if target == len(context.layers):
        if not context.later_chunks:
            return
        target, first_token = 0, first_token + context.chunk_tokens
    if not context.sparse(target) or not store.reads_selected_pages(target):
        return   # a local layer's window is in the plan
    page_tokens, chunk_tokens = context.page_tokens, context.config.chunk_tokens
    history = first_token // page_tokens
    if history <= context.top_k:
        return   # read whole, as the plan names it
    before = first_token // chunk_tokens - 1   # the chunk before the target (whole, page-aligned)
    previous_first = before * chunk_tokens // page_tokens
    selection = context.selections.get((target, before))
    if (target, before) not in context.selections:
        guess = set()
    elif selection is None:   # that chunk read its whole history
        guess = set(range(previous_first))
    else:
        union = context.selection_unions.get((target, before))   # stage 1 kept it (ChunkContext._selected)
        guess = set(union[0] if union is not None else selected_pages(selection))
    guess.update(range(previous_first, history))
    store.predict(target, sorted(page for page in guess if page < history))


# Note [Stage 1's attention in stage 2]
#   Rationale: stage 2 recomputes each chunk's forward with grad, and its attention over the
#   history is the same call on the same q, k, v and pages as stage 1's (the same selection in
#   sparse mode): one of a dense step's 4.5 attention passes (stage 1 forward, stage 2 forward,
#   a backward of ~2.5) computes what stage 1 already had, and with offload it reads the whole
#   history through the GPU once more.
#   Approach: with config.reuse_stage1_attention, stage 1 keeps each layer's (out, lse) per chunk
#   (the model dtype and float32, on the GPU, or with offload copied behind the stream into pinned
#   host memory, whatever the layer: GPU budgets are planned without them), and stage 2's forward
#   takes it instead of calling attention; its plan names no forward history access. The
#   trainer refuses, with a sentence before any work, a sequence whose outputs would not fit
#   (OOMBTrainer.stage1_output_bytes). The backward is unchanged (it reads the history and the
#   kept out and lse, as it would the recomputed ones), so gradients are those of the recompute
#   wherever the kernels are deterministic, and equal to them within rounding elsewhere. An entry
#   is dropped when stage 2 takes it or passes its chunk.
#   Limitations: the outputs of the whole sequence are held between the stages (~7 KiB per token
#   and layer at the 7B shape: 51 GiB at 256K); with offload their copies to and from the host run
#   on the compute stream (~0.6 ms each way per layer and chunk at the 7B shape, not overlapped);
#   not measured on a GPU yet, so off by default.


def _keep_stage1_output(context: ChunkContext, layer: int, out: torch.Tensor, lse: torch.Tensor) -> None:
    kept = (out, lse)
    if context.config.offload and out.is_cuda:   # host memory for every layer: the GPU budget stays as planned
        kept = tuple(torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True).copy_(tensor, non_blocking=True)
                     for tensor in kept)
    context.stage1_outputs.setdefault(context.chunk, {})[layer] = kept


def _stage1_output(context: ChunkContext, layer: int, device: torch.device):
    """Stage 1's (out, lse) of this layer and chunk on device, once, or None."""
    if context.stage1_outputs is None:
        return None
    kept = context.stage1_outputs.get(context.chunk, {}).pop(layer, None)
    if kept is None:
        return None
    return tuple(kernels.to_device(tensor, device) for tensor in kept)


def _select_pages(context: ChunkContext, layer: int, q) -> torch.Tensor | None:
    """Top-k history pages per query tile, or None when the whole history fits in top_k pages."""
    if context.history_pages <= context.top_k:
        return None
    mean = kernels.to_device(context.summaries[layer][: context.history_pages], q.device)
    if context.split_group is not None:
        from .tensor_parallel import split_page_select

        return split_page_select(q, mean, context.top_k, context.query_tile_tokens, context.split_group)
    choice = os.environ.get("MEMBAR_PAGE_SELECT")
    if (q.is_cuda and choice != "kernel") or choice == "pytorch":   # Note [Page selection in PyTorch]
        return attention.page_select_scores(q, mean, context.top_k, context.query_tile_tokens)
    return attention.page_select(q, mean, top_k=context.top_k, query_tile_tokens=context.query_tile_tokens)


_PAGE_NUMBERS: dict[torch.device, torch.Tensor] = {}


def _page_numbers(pages: int, device: torch.device) -> torch.Tensor:
    """int32 [pages], 0..pages-1: a view of one tensor per device, so that the CUDA ops read its
    values back once rather than every call (Note [Checked page indices] in
    bindings/csrc/cuda/attention_cuda.cpp)."""
    numbers = _PAGE_NUMBERS.get(device)
    if numbers is None or numbers.shape[0] < pages:
        numbers = torch.arange(max(pages, 256), dtype=torch.int32, device=device)
        _PAGE_NUMBERS[device] = numbers
    return numbers[:pages]


def _summarise_chunk(context: ChunkContext, layer: int, k) -> None:
    """Records the mean key of each of the chunk's pages in the layer's page summaries (host
    memory for offloaded layers, copied there behind the compute stream)."""
    tokens, heads, dim = k.shape
    page_tokens = context.page_tokens
    pages = -(-tokens // page_tokens)
    padded = k.new_zeros((pages * page_tokens, heads, dim))
    padded[:tokens] = k
    pool = padded.view(pages, page_tokens, heads, dim)
    mean, _, _ = attention.page_summary(pool, _page_numbers(pages, k.device), tokens)   # [pages, Hkv, D]
    summaries = context.summaries.get(layer)
    if summaries is None:
        shape = (context.store.layout.num_pages, heads, dim)
        if context.store.offloaded(layer):
            summaries = torch.zeros(shape, dtype=mean.dtype, pin_memory=k.device.type == "cuda")
        else:
            summaries = mean.new_zeros(shape)
        context.summaries[layer] = summaries
    summaries[context.first_page: context.first_page + pages].copy_(mean, non_blocking=True)


def membar_paged_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """The function registered with transformers' AttentionInterface as "membar_paged"."""
    context = current_context()
    if context is None:
        if attention_mask is NO_MASK:
            raise RuntimeError("membar_paged attention ran a trainer chunk outside its chunk context (a layer "
                               "recompute after the step?): the chunk's history is unknown here.")
        return _outside_the_trainer(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout,
                                    **kwargs)
    if isinstance(context, AttentionProbe):
        context.record(module, query, key, value, dict(kwargs, scaling=scaling, dropout=dropout))
        return query.new_zeros(query.shape[0], query.shape[2], query.shape[1], value.shape[-1]), None
    if attention_mask is not None and attention_mask is not NO_MASK:
        raise ValueError("chunk-recurrent training takes one unpadded sequence: pass no attention_mask.")
    if query.shape[0] != 1:
        raise ValueError(f"chunk-recurrent attention runs one sequence at a time, got batch {query.shape[0]}.")
    if dropout:
        raise ValueError("attention dropout must be 0 for chunk-recurrent training (stage 2 must "
                         "recompute stage 1 exactly).")
    layer = module.layer_idx
    scale = float(scaling if scaling is not None else query.shape[-1] ** -0.5)
    _check_call(context.layers[layer], scale, kwargs)
    # [1, H, Tc, D] -> [Tc, H, D]
    q = query[0].transpose(0, 1).contiguous()
    k = key[0].transpose(0, 1).contiguous()
    v = value[0].transpose(0, 1).contiguous()
    if q.shape[0] != context.chunk_tokens:
        raise ValueError(f"attention got {q.shape[0]} tokens for a chunk of {context.chunk_tokens}.")
    if context.stage == 1:
        out = _stage1_attention(context, layer, q, k, v, scale)
    else:
        if context.later_chunks:
            k, v = _InjectPageGrads.apply(k, v, context, layer)
        out = _ChunkPagedAttention.apply(q, k, v, context, layer, scale)
    return out.unsqueeze(0), None   # [1, Tc, Hq, D]


def _check_call(record: LayerAttention, scale: float, kwargs: dict) -> None:
    """A call must bring the options the probe recorded for its layer: the page accesses were
    planned from them (Note [One integration point] in models.py)."""
    window = kwargs.get("sliding_window")
    softcap = kwargs.get("softcap") or None
    if (window != record.sliding_window or softcap != record.softcap
            or not math.isclose(scale, record.scaling, rel_tol=1e-6)):
        raise ValueError(f"layer {record.layer} called attention with sliding_window={window}, softcap={softcap}, "
                         f"scaling={scale:g}, but its first call had {record.sliding_window}, {record.softcap}, "
                         f"{record.scaling:g}: chunk-recurrent training plans each layer's pages from the first.")


def _outside_the_trainer(module, query, key, value, attention_mask, **kwargs):
    """Attention outside a trainer step (evaluation, generation): SDPA, or the model's own eager
    attention when the layer soft-caps its scores (transformers' SDPA path ignores softcap)."""
    if kwargs.get("softcap"):
        eager = getattr(sys.modules.get(type(module).__module__), "eager_attention_forward", None)
        if eager is None:
            raise ValueError(f"{type(module).__name__} soft-caps its attention scores and its module has no "
                             f"eager_attention_forward to run outside the trainer.")
        mask = _additive_mask(query, key, attention_mask, kwargs.get("sliding_window"))
        return eager(module, query, key, value, mask, **kwargs)
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)


def _additive_mask(query, key, attention_mask, window: int | None) -> torch.Tensor:
    """The float mask eager attention adds to its scores. The mask function registered with
    "membar_paged" (SDPA's) returns None for a plain causal mask and a boolean one otherwise."""
    if attention_mask is None:
        queries, keys = query.shape[2], key.shape[2]
        query_positions = torch.arange(keys - queries, keys, device=query.device).unsqueeze(1)
        key_positions = torch.arange(keys, device=query.device).unsqueeze(0)
        attention_mask = key_positions <= query_positions
        if window is not None:
            attention_mask &= key_positions > query_positions - window
        attention_mask = attention_mask[None, None]    # [1, 1, queries, keys]
    if attention_mask.dtype != torch.bool:
        return attention_mask
    blocked = torch.zeros(attention_mask.shape, dtype=query.dtype, device=query.device)
    return blocked.masked_fill_(~attention_mask, torch.finfo(query.dtype).min)


def register() -> None:
    """Registers "membar_paged" with transformers (attention and mask functions). Idempotent."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(ATTENTION_NAME, membar_paged_attention)
    # SDPA's mask builder returns None for a plain causal mask, which is what the paged path wants,
    # and a real mask for the SDPA fallback when the user passes padding.
    AttentionMaskInterface.register(ATTENTION_NAME, sdpa_mask)
