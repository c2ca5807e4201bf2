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

Threading: every method is called from the trainer's thread; none blocks on the GPU unless it says
so. GPU work is enqueued on the current stream or on the store's side stream, ordered by events.
"""
from __future__ import annotations

import abc
from dataclasses import dataclass, field

import torch

from .kernels import GradView, HistoryView


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
    range that are actually read (sorted); None means all of them.
    """

    kind: str
    layer: int
    chunk: int
    phase: str
    first_page: int
    num_pages: int
    selected: tuple[int, ...] | None = None

    @property
    def key(self):
        return (self.kind, self.layer, self.chunk, self.phase)


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


class TensorKVStore(KVStore):
    """Pages in preallocated tensor pools.

    offload=False: all four pools of every layer live on the compute device; views are the pools
    themselves (no copy).
    offload=True: the pools of every layer from gpu_resident_layers on live in host memory (pinned
    when CUDA is available); the first gpu_resident_layers layers stay on the device, which lets a
    sequence use GPU and host memory together (KV + dK/dV of 1M tokens of a 7B model fit neither alone). Each access copies
    the pages it needs into fresh device tensors on a side stream, ahead of use when planned, and
    dK/dV pages go back to host memory once a layer's backward is done. On a machine without CUDA
    the same copies run synchronously (used by the CPU tests to check that offload changes no bit).
    Pools are kept between sequences and grown when a longer one comes.
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
        self._grad_pages_zeroed: list[int] = []   # per layer: grad pages [0, n) have been zeroed
        self._cuda = self.device.type == "cuda"
        self._side_stream = torch.cuda.Stream(self.device) if (offload and self._cuda) else None
        self._plan_position: dict = {}
        self._plan: list[Access] = []
        self._prefetched: dict = {}
        self._page_numbers: torch.Tensor | None = None

    # -- allocation ---------------------------------------------------------------------------

    def _offloaded(self, layer: int) -> bool:
        return self.offload and layer >= self.gpu_resident_layers

    def _new_pool(self, layout: PageLayout, dtype: torch.dtype, layer: int) -> torch.Tensor:
        shape = (layout.num_pages, layout.page_tokens, layout.num_kv_heads, layout.head_dim)
        if self._offloaded(layer):
            return torch.empty(shape, dtype=dtype, pin_memory=self._cuda)
        return torch.empty(shape, dtype=dtype, device=self.device)

    def open_sequence(self, layout: PageLayout) -> None:
        if layout.device != self.device:
            raise ValueError(f"this store serves {self.device}, the model runs on {layout.device}.")
        if not layout.fits_in(self._capacity):
            self.k_pools = self.v_pools = []
            self.dk_pools = self.dv_pools = []
            self.k_pools = [self._new_pool(layout, layout.dtype, layer) for layer in range(layout.num_layers)]
            self.v_pools = [self._new_pool(layout, layout.dtype, layer) for layer in range(layout.num_layers)]
            self.dk_pools = [None] * layout.num_layers
            self.dv_pools = [None] * layout.num_layers
            self._capacity = layout
            layer_bytes = 2 * layout.num_pages * (layout.page_bytes(layout.dtype) + layout.page_bytes(layout.grad_dtype))
            offloaded = sum(self._offloaded(layer) for layer in range(layout.num_layers))
            self.stats.host_pool_bytes = offloaded * layer_bytes
            self.stats.device_pool_bytes = (layout.num_layers - offloaded) * layer_bytes
            self._page_numbers = torch.arange(layout.num_pages, dtype=torch.int32, device=self.device)
        self.layout = layout
        self._grad_pages_zeroed = [0] * layout.num_layers
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
        if self._side_stream is not None:
            torch.cuda.current_stream(self.device).wait_stream(self._side_stream)
        self.layout = None

    def _grad_pools(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer's dK/dV pools with every page of this sequence zeroed (once per sequence)."""
        layout = self.layout
        if self.dk_pools[layer] is None:
            self.dk_pools[layer] = self._new_pool(self._capacity, layout.grad_dtype, layer)
            self.dv_pools[layer] = self._new_pool(self._capacity, layout.grad_dtype, layer)
        if self._grad_pages_zeroed[layer] < layout.num_pages:
            if self._side_stream is not None and self._offloaded(layer):
                # Host pools are written by the side stream only, so it does the zeroing too.
                with torch.cuda.stream(self._side_stream):
                    self.dk_pools[layer][: layout.num_pages].zero_()
                    self.dv_pools[layer][: layout.num_pages].zero_()
                self._side_stream.synchronize()
            else:
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
        if not self._offloaded(layer):
            k_rows.copy_(k)
            v_rows.copy_(v)
            return
        if self._side_stream is not None:
            self._side_stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(self._side_stream):
                k_rows.copy_(k, non_blocking=True)
                v_rows.copy_(v, non_blocking=True)
            k.record_stream(self._side_stream)
            v.record_stream(self._side_stream)
        else:
            k_rows.copy_(k)
            v_rows.copy_(v)
        self.stats.pages_to_host += 2 * pages
        self.stats.bytes_to_host += 2 * pages * layout.page_bytes(layout.dtype)
        self._drop_stale(layer, "kv", range(first_page, first_page + pages))

    # -- views ----------------------------------------------------------------------------------

    def history(self, access: Access, history_tokens: int) -> HistoryView:
        if not self._offloaded(access.layer):
            return HistoryView(self.k_pools[access.layer], self.v_pools[access.layer],
                               self._page_numbers[: access.num_pages], history_tokens)
        k_pool, v_pool, page_index = self._serve(access)
        if access.selected is None:
            return HistoryView(k_pool, v_pool, page_index, history_tokens)
        if history_tokens != access.num_pages * self.layout.page_tokens:
            raise ValueError("a sparse history must consist of whole pages.")
        page_map = torch.full((access.num_pages,), -1, dtype=torch.int64)
        page_map[torch.tensor(access.selected, dtype=torch.int64) - access.first_page] = torch.arange(len(access.selected))
        return HistoryView(k_pool, v_pool, page_index, len(access.selected) * self.layout.page_tokens,
                           page_map.to(self.device))

    def grad_history(self, access: Access) -> GradView:
        dk_pool, dv_pool = self._grad_pools(access.layer)
        if not self._offloaded(access.layer):
            return GradView(dk_pool, dv_pool, self._page_numbers[: access.num_pages])
        dk_dev, dv_dev, page_index = self._serve(access)
        return GradView(dk_dev, dv_dev, page_index)

    def chunk_grads(self, access: Access, tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
        layout = self.layout
        row_shape = (access.num_pages * layout.page_tokens, layout.num_kv_heads, layout.head_dim)
        if not self._offloaded(access.layer):
            dk_pool, dv_pool = self._grad_pools(access.layer)
            pages = slice(access.first_page, access.first_page + access.num_pages)
            return dk_pool[pages].view(row_shape)[:tokens], dv_pool[pages].view(row_shape)[:tokens]
        self._grad_pools(access.layer)
        dk_dev, dv_dev, _ = self._serve(access)
        return dk_dev.view(row_shape)[:tokens], dv_dev.view(row_shape)[:tokens]

    def release(self, access: Access, view) -> None:
        if not self._offloaded(access.layer) or not isinstance(view, GradView):
            return
        # Write the accumulated dK/dV pages back to the host pools, behind the compute stream.
        layout = self.layout
        pages = self._pages_of(access)
        dk_host, dv_host = self.dk_pools[access.layer], self.dv_pools[access.layer]
        if self._side_stream is not None:
            self._side_stream.wait_stream(torch.cuda.current_stream(self.device))
            context = torch.cuda.stream(self._side_stream)
        else:
            context = _NullContext()
        with context:
            row = 0
            for first, count in _runs(pages):
                dk_host[first: first + count].copy_(view.dk_pool[row: row + count], non_blocking=True)
                dv_host[first: first + count].copy_(view.dv_pool[row: row + count], non_blocking=True)
                row += count
        if self._side_stream is not None:
            view.dk_pool.record_stream(self._side_stream)
            view.dv_pool.record_stream(self._side_stream)
        self.stats.pages_to_host += 2 * len(pages)
        self.stats.bytes_to_host += 2 * len(pages) * layout.page_bytes(layout.grad_dtype)
        self._drop_stale(access.layer, "grad", pages)

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
        """Enqueues the host-to-device copy of access's pages; returns (tensors, ready event)."""
        layout = self.layout
        if access.kind == "kv":
            source_k, source_v = self.k_pools[access.layer], self.v_pools[access.layer]
            dtype = layout.dtype
        else:
            source_k, source_v = self._grad_pools(access.layer)
            dtype = layout.grad_dtype
        pages = self._pages_of(access)
        shape = (len(pages), layout.page_tokens, layout.num_kv_heads, layout.head_dim)
        # The copy holds the pages in order, so page p of the copy is pool row p. A sparse access
        # copies only its selected pages: the view renumbers them (HistoryView.page_map).
        index = torch.arange(len(pages), dtype=torch.int32)
        if self._side_stream is not None:
            with torch.cuda.stream(self._side_stream):
                k_dev = torch.empty(shape, dtype=dtype, device=self.device)
                v_dev = torch.empty(shape, dtype=dtype, device=self.device)
                row = 0
                for first, count in _runs(pages):
                    k_dev[row: row + count].copy_(source_k[first: first + count], non_blocking=True)
                    v_dev[row: row + count].copy_(source_v[first: first + count], non_blocking=True)
                    row += count
                index_dev = index.pin_memory().to(self.device, non_blocking=True)
                ready = torch.cuda.Event()
                ready.record(self._side_stream)
        else:
            k_dev = torch.empty(shape, dtype=dtype, device=self.device)
            v_dev = torch.empty(shape, dtype=dtype, device=self.device)
            row = 0
            for first, count in _runs(pages):
                k_dev[row: row + count].copy_(source_k[first: first + count])
                v_dev[row: row + count].copy_(source_v[first: first + count])
                row += count
            index_dev, ready = index.to(self.device), None
        self.stats.pages_to_device += 2 * len(pages)
        self.stats.bytes_to_device += 2 * len(pages) * layout.page_bytes(dtype)
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
            if upcoming.key not in self._prefetched and self._offloaded(upcoming.layer):
                self._prefetched[upcoming.key] = (upcoming, self._load(upcoming))


class _NullContext:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False
