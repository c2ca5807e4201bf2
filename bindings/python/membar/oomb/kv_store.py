"""Where the K/V and dK/dV pages of a sequence live during chunk-recurrent training.

The trainer talks to a small interface, `KVStore`; its implementation is membar's memory runtime
(membar.oomb.runtime_store.RuntimeKVStore, Note [Runtime pages]), embedded in the trainer or the
membard daemon of the node.

Note [Pages of a sequence]
  A sequence of S tokens is cut into chunks of chunk_tokens (a multiple of page_tokens), so chunk c
  owns the pages [c * pages_per_chunk, (c + 1) * pages_per_chunk) and the last page of the sequence
  may be partial. Page numbers are per sequence and the same in every layer. Each layer has four
  pools: K and V (model dtype), dK and dV (grad page dtype), each [num_pages, page_tokens, Hkv, D].
  Stage 1 writes chunk c's K/V into its pages; attention of chunk c reads the pages of all earlier
  chunks (its history). Stage 2 (reverse) adds the history's dK/dV into their grad pages and reads
  chunk c's own grad pages once every later chunk has run.

Note [Access plan and prefetch]
  Every page access the trainer will make is known ahead (in sparse mode, once stage 1 has chosen
  the pages): `plan()` hands the store the ordered list, which becomes the runtime's schedule. An
  access advances the schedule, so the runtime copies the next accesses' pages in on its own copy
  streams while the current layer computes, evicts by farthest next use, and writes dK/dV pages
  back behind the backward pass. An access that is not in the plan (or arrives out of order, e.g.
  under layer checkpointing) is served on demand: the plan is a performance hint, never needed
  for correctness.

Threading: methods are called by one thread at a time: the trainer's, or (on CUDA, during a
backward the trainer waits for) the autograd engine's device thread. None blocks on the GPU unless
it says so. GPU work is enqueued on the current stream or on the store's copy streams, ordered by
events.
"""
from __future__ import annotations

import abc
from dataclasses import dataclass, field

import torch

from .kernels import GradView, HistoryView, to_device


@dataclass(frozen=True)
class PageLayout:
    """Shape of the page pools for one sequence."""

    num_layers: int
    num_pages: int               # pages of the whole sequence
    page_tokens: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype           # K/V pages (the model's dtype)
    grad_dtype: torch.dtype      # dK/dV pages
    device: torch.device         # where the attention kernels run

    def page_bytes(self, dtype: torch.dtype) -> int:
        element = torch.empty((), dtype=dtype).element_size()
        return self.page_tokens * self.num_kv_heads * self.head_dim * element

    def fits_in(self, other: "PageLayout | None") -> bool:
        return (other is not None and self.num_pages <= other.num_pages
                and (self.num_layers, self.page_tokens, self.num_kv_heads, self.head_dim, self.dtype,
                     self.grad_dtype, self.device) ==
                (other.num_layers, other.page_tokens, other.num_kv_heads, other.head_dim, other.dtype,
                 other.grad_dtype, other.device))


@dataclass(frozen=True)
class Access:
    """One use of pages by one layer of one chunk.

    kind: "kv" (history K/V, read), "dkv" (history dK/dV, accumulated into), "chunk_grad" (the
    chunk's own dK/dV rows, read once all later chunks are done).
    phase: "stage1", "forward" (stage 2 recompute) or "backward".
    first_page, num_pages: the page range. selected: in sparse mode, the page numbers within the
    range that are actually read (sorted); None means all of them. block: which block of the
    layer's history this is when the history is streamed in blocks (0 otherwise).
    """

    kind: str
    layer: int
    chunk: int
    phase: str
    first_page: int
    num_pages: int
    selected: tuple[int, ...] | None = None
    block: int = 0

    @property
    def key(self):
        return (self.kind, self.layer, self.chunk, self.phase, self.block)


_CALL_PARTS = ("lock_wait", "locked", "enqueue", "deliver")


@dataclass
class StoreStats:
    pages_to_device: int = 0
    pages_to_host: int = 0
    bytes_to_device: int = 0
    bytes_to_host: int = 0
    prefetch_hits: int = 0
    prefetch_misses: int = 0
    host_pool_bytes: int = 0
    device_pool_bytes: int = 0
    stall_ns: int = 0
    stream_wait_ns: int = -1     # time a CUDA stream waited on the GPU for pages; -1: not timed
    # ... by access kind and phase when timed: label -> [ns, waits, longest wait ns]
    stream_wait_by_kind: dict = field(default_factory=dict)
    pages_read: int = 0          # history pages the attention acquired (K and V each counted)
    predicted_frames: int = 0    # frames copied ahead on a guess (KVStore.predict), K and V each counted
    host_ns: int = 0             # the trainer's host time inside the store's runtime calls
    gpu_maps: int = 0            # GPU frames mapped at a new position (Note [Remapping a position])
    fence_waits: int = 0         # runtime calls that waited on the host for the trainer's stream to pass
    fence_wait_ns: int = 0       # a release marker before remapping a position (part of host_ns)
    # The runtime's own account of its calls' time (ClientStats call_*_ns): waiting for the engine's
    # lock, holding it, handing copies to the backend, delivering events (map calls).
    call_ns: dict = field(default_factory=lambda: dict.fromkeys(_CALL_PARTS, 0))
    # This process's mapping of frames (Note [Maps off the caller's thread] in libclient/memory.cpp):
    # time applying the runtime's map events (on a mapping thread with MEMBAR_ASYNC_MAPS=1), the
    # calls' waits for them (part of host_ns), runs of maps, and whether a mapping thread did it.
    map_apply_ns: int = 0
    map_wait_ns: int = 0
    map_runs: int = 0
    async_maps: bool = False
    pages_live: dict = field(default_factory=lambda: {"current": 0, "peak": 0, "allocated": 0, "freed": 0})

    def pages_allocated(self, count: int) -> None:
        live = self.pages_live
        live["current"] += count
        live["allocated"] += count
        live["peak"] = max(live["peak"], live["current"])

    def pages_freed(self, count: int) -> None:
        self.pages_live["current"] -= count
        self.pages_live["freed"] += count

    def as_dict(self) -> dict:
        return {
            "pages_to_device": self.pages_to_device, "pages_to_host": self.pages_to_host,
            "pages_moved": self.pages_to_device + self.pages_to_host,
            "bytes_to_device": self.bytes_to_device, "bytes_to_host": self.bytes_to_host,
            "prefetch_hits": self.prefetch_hits, "prefetch_misses": self.prefetch_misses,
            "host_pool_bytes": self.host_pool_bytes, "device_pool_bytes": self.device_pool_bytes,
            "stall_ns": self.stall_ns, "stream_wait_ns": self.stream_wait_ns, "pages_read": self.pages_read,
            "predicted_frames": self.predicted_frames,
            "host_ns": self.host_ns, "gpu_maps": self.gpu_maps,
            "fence_waits": self.fence_waits, "fence_wait_ns": self.fence_wait_ns, "call_ns": dict(self.call_ns),
            "map_apply_ns": self.map_apply_ns, "map_wait_ns": self.map_wait_ns, "map_runs": self.map_runs,
            "async_maps": self.async_maps,
            "stream_wait_by_kind": {label: list(entry) for label, entry in self.stream_wait_by_kind.items()},
            "pages_live": dict(self.pages_live),
        }


class KVStore(abc.ABC):
    """The trainer's view of page memory. See Note [Pages of a sequence] and Note [Access plan]."""

    stats: StoreStats

    @abc.abstractmethod
    def open_sequence(self, layout: PageLayout) -> None:
        """Makes room for one sequence's pages (K/V now, dK/dV zeroed by their first use)."""

    def use_config(self, config) -> None:
        """The trainer's OOMBConfig (chunk and history block sizes, prefetch depth), handed over
        before the first sequence; a store fills in what it was not told. Optional."""

    def reserve(self, layout: PageLayout) -> None:
        """Allocates everything a sequence of this layout needs, so that the steps that follow
        allocate nothing (pinned host memory takes ~40 ms per GiB to allocate). Optional."""
        self.open_sequence(layout)
        self.close_sequence()

    def offloaded(self, layer: int) -> bool:
        """Whether the layer's pages travel to the GPU per access. The trainer then streams the
        layer's history through the GPU in blocks (config.history_block_tokens)."""
        return False

    def streams_history(self, layer: int) -> bool:
        """Whether the trainer reads the layer's history in blocks (config.history_block_tokens,
        Note [Streaming a layer's history] in hf_attention.py): where its pages are offloaded."""
        return self.offloaded(layer)

    def reads_selected_pages(self, layer: int) -> bool:
        """Whether accesses of this layer must name their selected pages (Access.selected) in
        sparse mode. Naming them needs the selection on the host (one wait for the GPU per layer
        and chunk in stage 1), so a store that serves every page anyway says False."""
        return True

    def holds_in_one_block(self, layer: int, pages: tuple[int, ...], block_pages: int) -> bool:
        """Whether an access to these pages (a sparse selection's, sorted) of an offloaded layer
        holds no more GPU memory than one access to a history block of block_pages pages: the
        trainer then reads them in one attention call instead of block by block (Note [Streaming a
        layer's history] in hf_attention.py)."""
        return len(pages) <= block_pages

    @abc.abstractmethod
    def close_sequence(self) -> None:
        """Ends the sequence; its pages are dead (pools may be kept for the next sequence)."""

    @abc.abstractmethod
    def write_chunk(self, layer: int, first_page: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Stores a chunk's post-RoPE keys and values, k/v [tokens, Hkv, D], from first_page on."""

    @abc.abstractmethod
    def history(self, access: Access, history_tokens: int) -> HistoryView:
        """K/V pools + page index covering access's pages, ready for kernels on the current stream."""

    @abc.abstractmethod
    def grad_history(self, access: Access) -> GradView:
        """dK/dV pools + page index covering access's pages, to be accumulated into."""

    @abc.abstractmethod
    def chunk_grads(self, access: Access, tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The accumulated dK, dV rows of a chunk's own pages: [tokens, Hkv, D] each."""

    def release(self, access: Access, view) -> None:
        """The kernels enqueued so far are done with `view`; a grad view is written back."""

    @abc.abstractmethod
    def free_pages(self, first_page: int, num_pages: int) -> None:
        """No later access reads these pages (in any layer)."""

    def plan(self, accesses: list[Access]) -> None:
        """The accesses to come, in order (a prefetch hint)."""

    def predict(self, layer: int, pages: list[int]) -> None:
        """A guess at the K/V pages of an access the plan could not name (a sparse selection of
        stage 1, Note [Predicted selections] in hf_attention.py): a store whose pages travel may
        start copying them now. A hint: nothing is pinned, a wrong guess costs only copies."""


def _runs(pages: list[int]) -> list[tuple[int, int]]:
    """Sorted page numbers as (first, count) runs of consecutive pages."""
    runs: list[tuple[int, int]] = []
    for page in pages:
        if runs and runs[-1][0] + runs[-1][1] == page:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1)
        else:
            runs.append((page, 1))
    return runs
