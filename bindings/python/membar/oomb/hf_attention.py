"""The Hugging Face side: an attention function registered as "membar_paged".

transformers calls attention functions as fn(module, query, key, value, attention_mask, scaling=...,
dropout=..., **kwargs) with post-RoPE query [batch, Hq, tokens, D] and key/value [batch, Hkv, tokens,
D], and expects (output [batch, tokens, Hq, D], weights or None). While an OOMB `ChunkContext` is
active the function runs the chunk's attention over the paged history; outside one it falls back
to SDPA, so a model converted for OOMB still evaluates and generates normally.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch

from .. import attention
from . import kernels
from .kv_store import Access, KVStore

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

    stage: 1 (no-grad forward filling pages) or 2 (recompute with grad, then backward).
    chunk: chunk number; first_token: its absolute position; first_page: its first page.
    history_pages / history_tokens: pages and tokens of all earlier chunks.
    later_chunks: whether any later chunk exists (then its dK/dV pages hold gradient to inject).
    history_block_pages: offloaded layers stream their history in blocks of this many pages
    (0: the whole history in one call). keep_attention_outputs: stage 2 keeps each layer's
    attention output until its backward, for the layer recompute of checkpointing.
    """

    store: KVStore
    stage: int
    chunk: int
    first_token: int
    first_page: int
    chunk_tokens: int
    history_pages: int
    later_chunks: bool
    page_tokens: int
    mode: str
    top_k: int
    query_tile_tokens: int
    deterministic: bool
    history_block_pages: int = 0
    keep_attention_outputs: bool = False
    dense_kernel: str = "membar"      # OOMBConfig.dense_kernel: "auto" or "membar"
    # Sparse mode, shared across chunks of one sequence:
    summaries: dict = field(default_factory=dict)    # layer -> float32 [num_pages, Hkv, D]
    # (layer, chunk) -> int32 [tiles, top_k] or None. On the host for layers whose store reads
    # selected pages (the union must be known there), else on the device.
    selections: dict = field(default_factory=dict)
    selection_unions: dict = field(default_factory=dict)  # (layer, chunk) -> sorted tuple of pages
    # Stage 2, this chunk only: layer -> (out, lse) of the first forward (see keep_attention_outputs).
    attention_outputs: dict = field(default_factory=dict)
    attended_layers: set = field(default_factory=set)

    @property
    def history_tokens(self) -> int:
        # Every earlier chunk is whole and starts on a page boundary.
        return self.first_token

    def streams(self, layer: int) -> bool:
        """Whether this layer's history goes through the GPU in several blocks."""
        return (self.store.offloaded(layer) and 0 < self.history_block_pages < self.history_pages)

    def _union(self, layer: int) -> tuple[int, ...] | None:
        selection = self.selections.get((layer, self.chunk))
        if selection is None or not self.store.reads_selected_pages(layer):
            return None
        # The union of a selection is needed by every access of the chunk: compute it once.
        union = self.selection_unions.get((layer, self.chunk))
        if union is None:
            union = selected_pages(selection)
            self.selection_unions[(layer, self.chunk)] = union
        return union

    def history_access(self, layer: int, phase: str, kind: str = "kv") -> Access:
        """The one access covering the whole history (the unstreamed path)."""
        return Access(kind, layer, self.chunk, phase, 0, self.history_pages, self._union(layer))

    def history_accesses(self, layer: int, phase: str, kind: str = "kv") -> list[Access]:
        """The accesses one attention call (forward or backward) of this layer makes, in order:
        none without history, one over the whole history, or one per block of a streamed history
        (in sparse mode, blocks holding no selected page are left out)."""
        if self.history_pages == 0:
            return []
        if not self.streams(layer):
            return [self.history_access(layer, phase, kind)]
        union = self._union(layer)
        accesses = []
        for block, first in enumerate(range(0, self.history_pages, self.history_block_pages)):
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
#   Limitations: the merged out is rounded to the model dtype once, like the single call's; dq
#   is rounded per block before the float32 sum (bf16 on the GPU: a few ulps more than one call).


def _forward(context: ChunkContext, layer: int, phase: str, q, k, v, scale: float, selection):
    """Attention of the chunk over its history and itself: (out [Tc, Hq, D], lse [Hq, Tc])."""
    store = context.store
    accesses = context.history_accesses(layer, phase)
    if not context.streams(layer):
        history = _history(context, accesses[0] if accesses else None)
        out, lse = kernels.attention_forward(q, k, v, history, scale, selection, context.query_tile_tokens,
                                             kernel=context.dense_kernel, deterministic=context.deterministic)
        if accesses:
            store.release(accesses[0], history)
        return out, lse
    # Note [Streaming a layer's history].
    out, lse = kernels.attention_forward(q, k, v, _history(context, None), scale, None, context.query_tile_tokens,
                                         kernel=context.dense_kernel, deterministic=context.deterministic)
    total = out.float()
    for access in accesses:
        history = _history(context, access)
        part, part_lse = kernels.attention_forward(q, k, v, history, scale, selection, context.query_tile_tokens,
                                                   attend_chunk=False, kernel=context.dense_kernel,
                                                   deterministic=context.deterministic)
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
        dq, dk, dv = kernels.attention_backward(q, k, v, history, scale, out, dout, lse, grads, selection,
                                                context.query_tile_tokens, context.deterministic,
                                                kernel=context.dense_kernel)
        if access is not None:
            store.release(access, history)
            store.release(grad_access, grads)
        return dq, dk, dv
    # Note [Streaming a layer's history]: the chunk alone, then each block, all given the final out/lse.
    dq, dk, dv = kernels.attention_backward(q, k, v, _history(context, None), scale, out, dout, lse,
                                            _empty_grads(store, k), None, context.query_tile_tokens,
                                            context.deterministic, kernel=context.dense_kernel)
    dq_total = dq.float()
    grad_accesses = context.history_accesses(layer, "backward", kind="dkv")
    for access, grad_access in zip(accesses, grad_accesses):
        history = _history(context, access)
        grads = store.grad_history(grad_access)
        part, _, _ = kernels.attention_backward(q, k, v, history, scale, out, dout, lse, grads, selection,
                                                context.query_tile_tokens, context.deterministic,
                                                attend_chunk=False, kernel=context.dense_kernel)
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
        kept = context.attention_outputs.pop(layer, None) if layer in context.attended_layers else None
        if kept is not None:
            out, lse = kept
        else:
            out, lse = _forward(context, layer, "forward", q, k, v, scale, selection)
            if context.keep_attention_outputs and layer not in context.attended_layers:
                context.attention_outputs[layer] = (out, lse)
            context.attended_layers.add(layer)
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
    if context.mode == "sparse":
        selection = _select_pages(context, layer, q)
        if selection is not None and store.reads_selected_pages(layer):
            # The store copies only the selected pages, so their union must be known on the host:
            # this waits for the GPU (once per layer and chunk, sparse mode with offload only).
            selection = selection.cpu()
        context.selections[(layer, context.chunk)] = selection
    out, _ = _forward(context, layer, "stage1", q, k, v, scale, selection)
    store.write_chunk(layer, context.first_page, k, v)
    if context.mode == "sparse" and context.later_chunks:
        _summarise_chunk(context, layer, k)
    return out


def _select_pages(context: ChunkContext, layer: int, q) -> torch.Tensor | None:
    """Top-k history pages per query tile, or None when the whole history fits in top_k pages."""
    if context.history_pages <= context.top_k:
        return None
    mean = kernels.to_device(context.summaries[layer][: context.history_pages], q.device)
    return attention.page_select(q, mean, top_k=context.top_k, query_tile_tokens=context.query_tile_tokens)


def _summarise_chunk(context: ChunkContext, layer: int, k) -> None:
    """Records the mean key of each of the chunk's pages in the layer's page summaries (host
    memory for offloaded layers, copied there behind the compute stream)."""
    tokens, heads, dim = k.shape
    page_tokens = context.page_tokens
    pages = -(-tokens // page_tokens)
    padded = k.new_zeros((pages * page_tokens, heads, dim))
    padded[:tokens] = k
    pool = padded.view(pages, page_tokens, heads, dim)
    index = torch.arange(pages, dtype=torch.int32, device=k.device)
    mean, _, _ = attention.page_summary(pool, index, tokens)   # [pages, Hkv, D]
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
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(module, query, key, value, attention_mask,
                                      scaling=scaling, dropout=dropout, **kwargs)
    if attention_mask is not None and attention_mask is not NO_MASK:
        raise ValueError("chunk-recurrent training takes one unpadded sequence: pass no attention_mask.")
    if kwargs.get("sliding_window"):
        raise ValueError("sliding-window attention layers are not supported by chunk-recurrent training.")
    if query.shape[0] != 1:
        raise ValueError(f"chunk-recurrent attention runs one sequence at a time, got batch {query.shape[0]}.")
    if dropout:
        raise ValueError("attention dropout must be 0 for chunk-recurrent training (stage 2 must "
                         "recompute stage 1 exactly).")
    layer = module.layer_idx
    scale = float(scaling if scaling is not None else query.shape[-1] ** -0.5)
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


def register() -> None:
    """Registers "membar_paged" with transformers (attention and mask functions). Idempotent."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(ATTENTION_NAME, membar_paged_attention)
    # SDPA's mask builder returns None for a plain causal mask, which is what the paged path wants,
    # and a real mask for the SDPA fallback when the user passes padding.
    AttentionMaskInterface.register(ATTENTION_NAME, sdpa_mask)
