"""The Hugging Face side: an attention function registered as "membar_paged".

transformers calls attention functions as fn(module, query, key, value, attention_mask, scaling=...,
dropout=..., **kwargs) with post-RoPE query [batch, Hq, tokens, D] and key/value [batch, Hkv, tokens,
D], and expects (output [batch, tokens, Hq, D], weights or None). While an OOMB `ChunkContext` is
active the function runs the chunk's attention over the paged history; outside one it falls back
to SDPA, so a model converted for OOMB still evaluates and generates normally.
"""
from __future__ import annotations

import contextlib
import threading
from dataclasses import dataclass, field

import torch

from . import kernels
from .kv_store import Access, KVStore

ATTENTION_NAME = "membar_paged"

_state = threading.local()


@dataclass
class ChunkContext:
    """What the attention function needs to know about the chunk being run.

    stage: 1 (no-grad forward filling pages) or 2 (recompute with grad, then backward).
    chunk: chunk number; first_token: its absolute position; first_page: its first page.
    history_pages / history_tokens: pages and tokens of all earlier chunks.
    later_chunks: whether any later chunk exists (then its dK/dV pages hold gradient to inject).
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
    # Sparse mode, shared across chunks of one sequence:
    summaries: dict = field(default_factory=dict)    # layer -> float32 [num_pages, Hkv, D]
    selections: dict = field(default_factory=dict)   # (layer, chunk) -> int32 [tiles, top_k] or None
    selection_unions: dict = field(default_factory=dict)  # (layer, chunk) -> sorted tuple of pages

    @property
    def history_tokens(self) -> int:
        # Every earlier chunk is whole and starts on a page boundary.
        return self.first_token

    def history_access(self, layer: int, phase: str, kind: str = "kv") -> Access:
        selected = None
        selection = self.selections.get((layer, self.chunk))
        if selection is not None:
            # The union of a selection is needed by every access of the chunk: compute it once
            # (it reads the selection back from the GPU).
            selected = self.selection_unions.get((layer, self.chunk))
            if selected is None:
                selected = selected_pages(selection)
                self.selection_unions[(layer, self.chunk)] = selected
        return Access(kind, layer, self.chunk, phase, 0, self.history_pages, selected)

    def own_grad_access(self, layer: int) -> Access:
        pages = -(-self.chunk_tokens // self.page_tokens)
        return Access("chunk_grad", layer, self.chunk, "backward", self.first_page, pages)


def selected_pages(selection: torch.Tensor) -> tuple[int, ...]:
    """The sorted union of the pages a selection [tiles, top_k] names (padding -1 dropped)."""
    pages = selection.flatten()
    return tuple(sorted(set(pages[pages >= 0].tolist())))


def current_context() -> ChunkContext | None:
    return getattr(_state, "context", None)


@contextlib.contextmanager
def chunk_context(context: ChunkContext):
    previous = current_context()
    _state.context = context
    try:
        yield context
    finally:
        _state.context = previous


class _ChunkPagedAttention(torch.autograd.Function):
    """Attention of one chunk over its paged history, with grad (stage 2).

    forward(q [Tc, Hq, D], k [Tc, Hkv, D], v [Tc, Hkv, D]) -> out [Tc, Hq, D]. The history pages are
    fetched from the store again in backward (they may have been offloaded in between); backward
    returns dq, dk, dv of the chunk and ADDS the history's dK/dV into the store's grad pages.
    """

    @staticmethod
    def forward(ctx, q, k, v, context: ChunkContext, layer: int, scale: float):
        store = context.store
        access = context.history_access(layer, "forward")
        history = _history(context, access)
        selection = context.selections.get((layer, context.chunk))
        out, lse = kernels.attention_forward(q, k, v, history, scale, selection, context.query_tile_tokens)
        if context.history_pages > 0:
            store.release(access, history)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.context, ctx.layer, ctx.scale = context, layer, scale
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        context, layer = ctx.context, ctx.layer
        store = context.store
        access = context.history_access(layer, "backward")
        history = _history(context, access)
        grad_access = context.history_access(layer, "backward", kind="dkv")
        grads = store.grad_history(grad_access) if context.history_pages > 0 else _empty_grads(store, k)
        selection = context.selections.get((layer, context.chunk))
        dq, dk, dv = kernels.attention_backward(
            q, k, v, history, ctx.scale, out, dout.contiguous(), lse, grads, selection,
            context.query_tile_tokens, context.deterministic)
        if context.history_pages > 0:
            store.release(access, history)
            store.release(grad_access, grads)
        return dq, dk, dv, None, None, None


def _history(context: ChunkContext, access: Access) -> kernels.HistoryView:
    """The store's history view, or a one-page placeholder for chunk 0 (no page is read)."""
    if context.history_pages > 0:
        return context.store.history(access, context.history_tokens)
    layout = context.store.layout
    empty = torch.zeros((1, layout.page_tokens, layout.num_kv_heads, layout.head_dim),
                        dtype=layout.dtype, device=layout.device)
    return kernels.HistoryView(empty, empty, torch.zeros(0, dtype=torch.int32, device=layout.device), 0)


def _empty_grads(store: KVStore, like: torch.Tensor) -> kernels.GradView:
    """Grad pools for a chunk without history (chunk 0): nothing will be written."""
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
        context.selections[(layer, context.chunk)] = selection
    access = context.history_access(layer, "stage1")
    history = _history(context, access)
    out, _ = kernels.attention_forward(q, k, v, history, scale, selection, context.query_tile_tokens)
    if context.history_pages > 0:
        store.release(access, history)
    store.write_chunk(layer, context.first_page, k, v)
    if context.mode == "sparse" and context.later_chunks:
        _summarise_chunk(context, layer, k)
    return out


def _select_pages(context: ChunkContext, layer: int, q) -> torch.Tensor | None:
    """Top-k history pages per query tile, or None when the whole history fits in top_k pages."""
    if context.history_pages <= context.top_k:
        return None
    mean = context.summaries[layer][: context.history_pages]
    return kernels.page_select(q, mean, context.top_k, context.query_tile_tokens)


def _summarise_chunk(context: ChunkContext, layer: int, k) -> None:
    """Appends the mean key of each of the chunk's pages to the layer's page summaries."""
    tokens, heads, dim = k.shape
    page_tokens = context.page_tokens
    pages = -(-tokens // page_tokens)
    padded = k.new_zeros((pages * page_tokens, heads, dim))
    padded[:tokens] = k
    pool = padded.view(pages, page_tokens, heads, dim)
    index = torch.arange(pages, dtype=torch.int32, device=k.device)
    mean = kernels.page_summary(pool, index, tokens)   # [pages, Hkv, D]
    summaries = context.summaries.get(layer)
    if summaries is None:
        summaries = mean.new_zeros((context.store.layout.num_pages, heads, dim))
        context.summaries[layer] = summaries
    summaries[context.first_page: context.first_page + pages] = mean


def membar_paged_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """The function registered with transformers' AttentionInterface as "membar_paged"."""
    context = current_context()
    if context is None:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(module, query, key, value, attention_mask,
                                      scaling=scaling, dropout=dropout, **kwargs)
    if attention_mask is not None:
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
