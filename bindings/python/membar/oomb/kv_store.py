"""Where the K/V and dK/dV pages of a sequence live during chunk-recurrent training.

The trainer talks to a small interface, `KVStore`; this module has the plain-tensor
implementation (`TensorKVStore`). membar.oomb.runtime_store adds one backed by the memory
runtime (membar.runtime) when that is available.

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
  the pages): `plan()` hands the store the ordered list. An offloading store serving access i
  starts copying accesses i+1 .. i+prefetch_depth in on a side stream, so that each layer's pages
  arrive while the previous layer computes, and writes dK/dV pages back behind the backward pass.
  An access that is not in the plan (or arrives out of order, e.g. under layer checkpointing) is
  served synchronously: the plan is a performance hint, never needed for correctness.

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
            "pages_live": dict(self.pages_live),
        }


class KVStore(abc.ABC):
    """The trainer's view of page memory. See Note [Pages of a sequence] and Note [Access plan]."""

    stats: StoreStats

    @abc.abstractmethod
    def open_sequence(self, layout: PageLayout) -> None:
        """Makes room for one sequence's pages (K/V now, dK/dV zeroed by their first use)."""

    def reserve(self, layout: PageLayout) -> None:
        """Allocates everything a sequence of this layout needs, so that the steps that follow
        allocate nothing (pinned host memory takes ~40 ms per GiB to allocate). Optional."""
        self.open_sequence(layout)
        self.close_sequence()

    def offloaded(self, layer: int) -> bool:
        """Whether the layer's pages travel to the GPU per access. The trainer then streams the
        layer's history through the GPU in blocks (config.history_block_tokens)."""
        return False

    def reads_selected_pages(self, layer: int) -> bool:
        """Whether accesses of this layer must name their selected pages (Access.selected) in
        sparse mode. Naming them needs the selection on the host (one wait for the GPU per layer
        and chunk in stage 1), so a store that serves every page anyway says False."""
        return True

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


def _runs(pages: list[int]) -> list[tuple[int, int]]:
    """Sorted page numbers as (first, count) runs of consecutive pages."""
    runs: list[tuple[int, int]] = []
    for page in pages:
        if runs and runs[-1][0] + runs[-1][1] == page:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1)
        else:
            runs.append((page, 1))
    return runs


def _copy_to_host(destination: torch.Tensor, source: torch.Tensor) -> None:
    """Copies device rows into a host pool without blocking. A meta device (tests that count the
    memory a step keeps on the device, tests/python/test_oomb_memory.py) has no bits to copy."""
    if source.device.type != "meta":
        destination.copy_(source, non_blocking=True)


def _content_runs(pages: list[int], written: torch.Tensor | None) -> list[tuple[int, int, bool]]:
    """Runs of consecutive pages as (first, count, has_content); written: bool [num_pages] on the
    host, or None when every page has content."""
    if written is None:
        return [(first, count, True) for first, count in _runs(pages)]
    flags = written[torch.tensor(pages, dtype=torch.int64)].tolist() if pages else []
    runs: list[tuple[int, int, bool]] = []
    for page, flag in zip(pages, flags):
        if runs and runs[-1][0] + runs[-1][1] == page and runs[-1][2] == flag:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1, flag)
        else:
            runs.append((page, 1, flag))
    return runs


class TensorKVStore(KVStore):
    """Pages in preallocated tensor pools.

    offload=False: all four pools of every layer live on the compute device; views are the pools
    themselves (no copy).
    offload=True: the pools of every layer from gpu_resident_layers on live in host memory (pinned
    when CUDA is available); the first gpu_resident_layers layers stay on the device, which lets a
    sequence use GPU and host memory together (KV + dK/dV of 1M tokens of a 7B model fit neither
    alone). Each access copies the pages it needs into fresh device tensors, ahead of use when
    planned, and dK/dV pages go back to host memory once a layer's backward is done (Note [Copy
    streams]). On a machine without CUDA the same copies run synchronously (used by the CPU tests
    to check that offload changes no bit). Pools are kept between sequences and grown when a
    longer one comes (or ahead of time by reserve()).

    Note [Copy streams]
      Rationale: host-to-device loads and device-to-host write-backs use different copy engines and
      must not wait for each other: a write-back waits for the kernels that produced its pages,
      and a load queued behind it on the same stream would wait for them too, arriving late.
      Approach: loads run on a load stream, write-backs on a store stream. A load of pages that
      a write-back is still copying out waits for that write-back's event (kept per layer and
      kind); a write-back waits for the compute stream. Grad pages that were never written back
      in this sequence are not read from host memory at all: their device copy is zeroed, so the
      host pools need no zeroing. No method waits for the GPU on the host.
      Limitations: a prefetched copy holds device memory from its load until its use; prefetch
      depth times the largest access bounds it.
    """

    def __init__(self, device: torch.device | str, offload: bool = False, prefetch_depth: int = 2,
                 gpu_resident_layers: int = 0):
        if gpu_resident_layers < 0:
            raise ValueError(f"gpu_resident_layers must be >= 0, got {gpu_resident_layers}.")
        self.device = torch.device(device)
        self.offload = offload
        self.gpu_resident_layers = gpu_resident_layers if offload else 0
        self.prefetch_depth = prefetch_depth
        self.stats = StoreStats()
        self.layout: PageLayout | None = None
        self._capacity: PageLayout | None = None
        self.k_pools: list[torch.Tensor] = []
        self.v_pools: list[torch.Tensor] = []
        self.dk_pools: list[torch.Tensor | None] = []
        self.dv_pools: list[torch.Tensor | None] = []
        self._grad_pages_zeroed: list[int] = []    # device-resident layers: grad pages [0, n) zeroed
        self._grad_written: list[torch.Tensor] = []   # offloaded layers: bool [num_pages] on the host
        self._cuda = self.device.type == "cuda"
        self._load_stream = torch.cuda.Stream(self.device) if (offload and self._cuda) else None
        self._store_stream = torch.cuda.Stream(self.device) if (offload and self._cuda) else None
        self._written_events: dict = {}   # (layer, "kv" | "grad") -> event after the last write-back
        self._plan_position: dict = {}
        self._plan: list[Access] = []
        self._prefetched: dict = {}
        self._page_numbers: torch.Tensor | None = None

    # -- allocation ---------------------------------------------------------------------------

    def offloaded(self, layer: int) -> bool:
        return self.offload and layer >= self.gpu_resident_layers

    def reads_selected_pages(self, layer: int) -> bool:
        return self.offloaded(layer)

    def _new_pool(self, layout: PageLayout, dtype: torch.dtype, layer: int) -> torch.Tensor:
        shape = (layout.num_pages, layout.page_tokens, layout.num_kv_heads, layout.head_dim)
        if self.offloaded(layer):
            return torch.empty(shape, dtype=dtype, pin_memory=self._cuda)
        return torch.empty(shape, dtype=dtype, device=self.device)

    def _ensure_capacity(self, layout: PageLayout) -> None:
        if layout.device != self.device:
            raise ValueError(f"this store serves {self.device}, the model runs on {layout.device}.")
        if layout.fits_in(self._capacity):
            return
        self._wait_for_copies()
        self.k_pools = self.v_pools = []
        self.dk_pools = self.dv_pools = []
        self.k_pools = [self._new_pool(layout, layout.dtype, layer) for layer in range(layout.num_layers)]
        self.v_pools = [self._new_pool(layout, layout.dtype, layer) for layer in range(layout.num_layers)]
        self.dk_pools = [None] * layout.num_layers
        self.dv_pools = [None] * layout.num_layers
        self._capacity = layout
        layer_bytes = 2 * layout.num_pages * (layout.page_bytes(layout.dtype) + layout.page_bytes(layout.grad_dtype))
        offloaded = sum(self.offloaded(layer) for layer in range(layout.num_layers))
        self.stats.host_pool_bytes = offloaded * layer_bytes
        self.stats.device_pool_bytes = (layout.num_layers - offloaded) * layer_bytes
        # Page numbers for views of device-resident pools (all layers offloaded: none, so nothing
        # on the device grows with the sequence).
        resident = offloaded < layout.num_layers
        self._page_numbers = (torch.arange(layout.num_pages, dtype=torch.int32, device=self.device)
                              if resident else None)

    def reserve(self, layout: PageLayout) -> None:
        self._ensure_capacity(layout)
        for layer in range(layout.num_layers):
            self._allocate_grad_pools(layer)

    def open_sequence(self, layout: PageLayout) -> None:
        self._ensure_capacity(layout)
        self.layout = layout
        self._grad_pages_zeroed = [0] * layout.num_layers
        self._grad_written = [torch.zeros(layout.num_pages, dtype=torch.bool) if self.offloaded(layer) else None
                              for layer in range(layout.num_layers)]
        self._prefetched.clear()
        self._plan, self._plan_position = [], {}
        self.stats.pages_allocated(layout.num_pages)

    def close_sequence(self) -> None:
        if self.layout is None:
            return
        self._prefetched.clear()
        self._plan, self._plan_position = [], {}
        if self.stats.pages_live["current"] > 0:
            self.stats.pages_freed(self.stats.pages_live["current"])
        # The next sequence overwrites the host pools: the compute stream (and whoever waits
        # for it) must not run ahead of this sequence's write-backs.
        if self._store_stream is not None:
            torch.cuda.current_stream(self.device).wait_stream(self._store_stream)
            torch.cuda.current_stream(self.device).wait_stream(self._load_stream)
        self._written_events.clear()
        self.layout = None

    def _wait_for_copies(self) -> None:
        """Blocks until every copy in flight is done (only before pools are replaced)."""
        if self._store_stream is not None:
            self._store_stream.synchronize()
            self._load_stream.synchronize()

    def _allocate_grad_pools(self, layer: int) -> None:
        if self.dk_pools[layer] is None:
            self.dk_pools[layer] = self._new_pool(self._capacity, self._capacity.grad_dtype, layer)
            self.dv_pools[layer] = self._new_pool(self._capacity, self._capacity.grad_dtype, layer)

    def _grad_pools(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer's dK/dV pools. On the device, every page of this sequence is zeroed (once per
        sequence, on the compute stream); host pools are never zeroed (Note [Copy streams])."""
        layout = self.layout
        self._allocate_grad_pools(layer)
        if not self.offloaded(layer) and self._grad_pages_zeroed[layer] < layout.num_pages:
            self.dk_pools[layer][: layout.num_pages].zero_()
            self.dv_pools[layer][: layout.num_pages].zero_()
            self._grad_pages_zeroed[layer] = layout.num_pages
        return self.dk_pools[layer], self.dv_pools[layer]

    # -- stage 1 ------------------------------------------------------------------------------

    def write_chunk(self, layer: int, first_page: int, k: torch.Tensor, v: torch.Tensor) -> None:
        # k, v: [tokens, Hkv, D]
        layout = self.layout
        tokens = k.shape[0]
        pages = -(-tokens // layout.page_tokens)
        if first_page + pages > layout.num_pages:
            raise ValueError(f"chunk pages [{first_page}, {first_page + pages}) lie past the sequence's "
                             f"{layout.num_pages} pages.")
        row_shape = (pages * layout.page_tokens, layout.num_kv_heads, layout.head_dim)
        k_rows = self.k_pools[layer][first_page: first_page + pages].view(row_shape)[:tokens]
        v_rows = self.v_pools[layer][first_page: first_page + pages].view(row_shape)[:tokens]
        if not self.offloaded(layer):
            k_rows.copy_(k)
            v_rows.copy_(v)
            return
        with self._writing(layer, "kv", (k, v)):
            _copy_to_host(k_rows, k)
            _copy_to_host(v_rows, v)
        self.stats.pages_to_host += 2 * pages
        self.stats.bytes_to_host += 2 * pages * layout.page_bytes(layout.dtype)
        self._drop_stale(layer, "kv", range(first_page, first_page + pages))

    # -- views ----------------------------------------------------------------------------------

    def history(self, access: Access, history_tokens: int) -> HistoryView:
        if not self.offloaded(access.layer):
            return HistoryView(self.k_pools[access.layer], self.v_pools[access.layer],
                               self._page_numbers[access.first_page: access.first_page + access.num_pages],
                               history_tokens, first_row=access.first_page)
        k_pool, v_pool, page_index = self._serve(access)
        if access.selected is None:
            return HistoryView(k_pool, v_pool, page_index, history_tokens, first_row=0)
        if history_tokens != access.num_pages * self.layout.page_tokens:
            raise ValueError("a sparse history must consist of whole pages.")
        # Host-side renumbering of the copied pages (HistoryView.remap_selection applies it).
        page_map = torch.full((access.num_pages,), -1, dtype=torch.int64)
        page_map[torch.tensor(access.selected, dtype=torch.int64) - access.first_page] = torch.arange(len(access.selected))
        return HistoryView(k_pool, v_pool, page_index, len(access.selected) * self.layout.page_tokens, page_map)

    def grad_history(self, access: Access) -> GradView:
        dk_pool, dv_pool = self._grad_pools(access.layer)
        if not self.offloaded(access.layer):
            return GradView(dk_pool, dv_pool,
                            self._page_numbers[access.first_page: access.first_page + access.num_pages],
                            first_row=access.first_page)
        dk_dev, dv_dev, page_index = self._serve(access)
        return GradView(dk_dev, dv_dev, page_index, first_row=0 if access.selected is None else None)

    def chunk_grads(self, access: Access, tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
        layout = self.layout
        row_shape = (access.num_pages * layout.page_tokens, layout.num_kv_heads, layout.head_dim)
        if not self.offloaded(access.layer):
            dk_pool, dv_pool = self._grad_pools(access.layer)
            pages = slice(access.first_page, access.first_page + access.num_pages)
            return dk_pool[pages].view(row_shape)[:tokens], dv_pool[pages].view(row_shape)[:tokens]
        dk_dev, dv_dev, _ = self._serve(access)
        return dk_dev.view(row_shape)[:tokens], dv_dev.view(row_shape)[:tokens]

    def release(self, access: Access, view) -> None:
        if not self.offloaded(access.layer) or not isinstance(view, GradView):
            return
        # Write the accumulated dK/dV pages back to the host pools, behind the compute stream.
        layout = self.layout
        pages = self._pages_of(access)
        dk_host, dv_host = self.dk_pools[access.layer], self.dv_pools[access.layer]
        with self._writing(access.layer, "grad", (view.dk_pool, view.dv_pool)):
            row = 0
            for first, count in _runs(pages):
                _copy_to_host(dk_host[first: first + count], view.dk_pool[row: row + count])
                _copy_to_host(dv_host[first: first + count], view.dv_pool[row: row + count])
                row += count
        self._grad_written[access.layer][torch.tensor(pages, dtype=torch.int64)] = True
        self.stats.pages_to_host += 2 * len(pages)
        self.stats.bytes_to_host += 2 * len(pages) * layout.page_bytes(layout.grad_dtype)
        self._drop_stale(access.layer, "grad", pages)

    def _writing(self, layer: int, kind: str, sources):
        """Context for a write-back of device tensors `sources` into host pools: on the store stream
        after the compute stream's work so far, recording the event later loads wait for."""
        return _WriteBack(self, layer, kind, sources)

    def _drop_stale(self, layer: int, written_kind: str, pages) -> None:
        """A prefetched copy of pages that were just written is stale: drop it (it is loaded again
        when served). written_kind: "kv" (K/V pages) or "grad" (dK/dV pages)."""
        written = set(pages)
        for key in [key for key, (prefetched, _) in self._prefetched.items()
                    if prefetched.layer == layer and (prefetched.kind == "kv") == (written_kind == "kv")
                    and written.intersection(self._pages_of(prefetched))]:
            del self._prefetched[key]

    def free_pages(self, first_page: int, num_pages: int) -> None:
        # Pools are preallocated and reused by the next sequence: freeing is bookkeeping here.
        self.stats.pages_freed(num_pages)

    # -- offload: copies and prefetch -----------------------------------------------------------

    def plan(self, accesses: list[Access]) -> None:
        self._plan = list(accesses)
        self._plan_position = {access.key: index for index, access in enumerate(self._plan)}

    @staticmethod
    def _pages_of(access: Access) -> list[int]:
        if access.selected is not None:
            return list(access.selected)
        return list(range(access.first_page, access.first_page + access.num_pages))

    def _load(self, access: Access):
        """Enqueues the host-to-device copy of access's pages; returns (tensors, ready event).
        Grad pages never written back in this sequence are zeroed on the device instead."""
        layout = self.layout
        if access.kind == "kv":
            source_k, source_v = self.k_pools[access.layer], self.v_pools[access.layer]
            dtype, written, event_kind = layout.dtype, None, "kv"
        else:
            self._allocate_grad_pools(access.layer)
            source_k, source_v = self.dk_pools[access.layer], self.dv_pools[access.layer]
            dtype, written, event_kind = layout.grad_dtype, self._grad_written[access.layer], "grad"
        pages = self._pages_of(access)
        shape = (len(pages), layout.page_tokens, layout.num_kv_heads, layout.head_dim)
        # The copy holds the pages in order, so page p of the copy is pool row p. A sparse access
        # copies only its selected pages: the view renumbers them (HistoryView.page_map).
        index = torch.arange(len(pages), dtype=torch.int32)
        stream = self._load_stream
        context = torch.cuda.stream(stream) if stream is not None else _NullContext()
        copied = 0
        with context:
            if stream is not None:
                event = self._written_events.get((access.layer, event_kind))
                if event is not None:
                    stream.wait_event(event)
            k_dev = torch.empty(shape, dtype=dtype, device=self.device)
            v_dev = torch.empty(shape, dtype=dtype, device=self.device)
            row = 0
            for first, count, has_content in _content_runs(pages, written):
                if has_content:
                    k_dev[row: row + count].copy_(source_k[first: first + count], non_blocking=True)
                    v_dev[row: row + count].copy_(source_v[first: first + count], non_blocking=True)
                    copied += count
                else:
                    k_dev[row: row + count].zero_()
                    v_dev[row: row + count].zero_()
                row += count
            index_dev = to_device(index, self.device)
            ready = None
            if stream is not None:
                ready = torch.cuda.Event()
                ready.record(stream)
        self.stats.pages_to_device += 2 * copied
        self.stats.bytes_to_device += 2 * copied * layout.page_bytes(dtype)
        return (k_dev, v_dev, index_dev), ready

    def _serve(self, access: Access):
        entry = self._prefetched.pop(access.key, None)
        if entry is not None and entry[0] == access:
            tensors, ready = entry[1]
            self.stats.prefetch_hits += 1
        else:
            tensors, ready = self._load(access)
            self.stats.prefetch_misses += 1
        if ready is not None:
            stream = torch.cuda.current_stream(self.device)
            stream.wait_event(ready)
            for tensor in tensors:
                tensor.record_stream(stream)
        self._prefetch_after(access)
        return tensors

    def _prefetch_after(self, access: Access) -> None:
        position = self._plan_position.get(access.key)
        if position is None or self.prefetch_depth == 0:
            return
        for upcoming in self._plan[position + 1: position + 1 + self.prefetch_depth]:
            if upcoming.key not in self._prefetched and self.offloaded(upcoming.layer):
                self._prefetched[upcoming.key] = (upcoming, self._load(upcoming))


class _WriteBack:
    """See TensorKVStore._writing."""

    def __init__(self, store: TensorKVStore, layer: int, kind: str, sources):
        self.store, self.layer, self.kind, self.sources = store, layer, kind, sources
        self.stream = store._store_stream
        self.context = torch.cuda.stream(self.stream) if self.stream is not None else _NullContext()

    def __enter__(self):
        if self.stream is not None:
            self.stream.wait_stream(torch.cuda.current_stream(self.store.device))
        self.context.__enter__()
        return self

    def __exit__(self, *exc):
        self.context.__exit__(*exc)
        if self.stream is not None and exc[0] is None:
            for tensor in self.sources:
                tensor.record_stream(self.stream)
            event = torch.cuda.Event()
            event.record(self.stream)
            self.store._written_events[(self.layer, self.kind)] = event
        return False


class _NullContext:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False
