"""A KVStore whose pages live in the membar memory runtime (membar.runtime).

Each layer has four spaces, "L{layer}.k", ".v", ".dk", ".dv", of one page per page_tokens tokens
(page_shape [page_tokens, Hkv, D]). The runtime is embedded in this process by default, or a
running membard daemon (socket=...). The trainer's whole access plan becomes the runtime's
schedule (Runtime.set_schedule), and each access advances it, so the runtime prefetches the pages
of the next layers and evicts by farthest next use; with offload=True every access's pages are
also written back to host memory as soon as the access ends (KV behind stage 1, dK/dV behind each
layer's backward), keeping GPU use to the few layers in flight.

Note [Runtime pages and the compute stream]
  Acquired pages are handed to the kernels as rows of the space's pool tensor (the client's
  mapped window). The runtime's release takes no stream, so before releasing pages that kernels
  enqueued on a CUDA stream still use, this store waits for that stream. That is correct and
  simple; a stream-ordered release in the runtime would remove the wait.

Limitations: a page must be a power of two between 64 KiB and 2 MiB (the runtime's page sizes),
e.g. 128 tokens x 4 KV heads x 128 dims in bf16 (128 KiB) or fp32 (256 KiB).
"""
from __future__ import annotations

import torch

from .kernels import GradView, HistoryView
from .kv_store import Access, KVStore, PageLayout, StoreStats, _runs

_MIB = 1 << 20


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


class RuntimeKVStore(KVStore):
    """Pages in membar's runtime. runtime: an already connected membar.runtime.Runtime (optional);
    socket: reach a membard daemon there instead of embedding one; offload: write pages back to
    host memory behind each access. Same threading contract as KVStore."""

    def __init__(self, device: torch.device | str, socket: str | None = None, offload: bool = False,
                 runtime=None, gpu_pool_bytes: int | None = None, host_pool_bytes: int | None = None):
        self.device = torch.device(device)
        self.socket = socket
        self.offload = offload
        self.runtime = runtime
        self._gpu_pool_bytes, self._host_pool_bytes = gpu_pool_bytes, host_pool_bytes
        self.layout: PageLayout | None = None
        self._capacity: PageLayout | None = None
        self.spaces: list[dict] = []     # per layer: {"k", "v", "dk", "dv"} -> Space
        self._live: dict = {}            # space name -> bool [num_pages]: pages holding contents
        self._kv_pool = self._grad_pool = None
        self._step_of: dict = {}
        self._base_stats = None
        self._own = StoreStats()

    # -- connection and spaces --------------------------------------------------------------------

    def _connect(self, layout: PageLayout) -> None:
        from membar.runtime import Runtime

        layer_bytes = 2 * layout.num_pages * (layout.page_bytes(layout.dtype) + layout.page_bytes(layout.grad_dtype))
        total = layout.num_layers * layer_bytes
        gpu = self._gpu_pool_bytes or (min(total, 3 * layer_bytes) if self.offload else total)
        host = self._host_pool_bytes or (total if self.offload else 4 * _MIB)
        gpu, host = _round_up(gpu + 4 * _MIB, 2 * _MIB), _round_up(host + 4 * _MIB, 2 * _MIB)
        backend = "cuda" if self.device.type == "cuda" else "host"
        if self.socket:
            self.runtime = Runtime.connect(socket=self.socket, embedded=False, device=self.device.index or 0)
        else:
            self.runtime = Runtime.connect(embedded=True, backend=backend, gpu_pool_bytes=gpu, host_pool_bytes=host,
                                           device=self.device.index or 0)
        if self.runtime.device.type != self.device.type:
            raise ValueError(f"the runtime keeps pages on {self.runtime.device}, the model runs on {self.device}.")

    def open_sequence(self, layout: PageLayout) -> None:
        for dtype in (layout.dtype, layout.grad_dtype):
            size = layout.page_bytes(dtype)
            if size & (size - 1) or not (64 * 1024 <= size <= 2 * _MIB):
                raise ValueError(
                    f"a page of {layout.page_tokens} tokens x {layout.num_kv_heads} KV heads x {layout.head_dim} "
                    f"dims in {dtype} is {size} bytes; the runtime's pages are powers of two from 64 KiB to 2 MiB "
                    "(change page_tokens, or use the plain TensorKVStore).")
        if layout.device != self.device:
            raise ValueError(f"this store serves {self.device}, the model runs on {layout.device}.")
        if not layout.fits_in(self._capacity):
            for layer_spaces in self.spaces:
                for space in layer_spaces.values():
                    self._free_live(space)
                    space.destroy()
            self.spaces = []
            if self.runtime is None or (not self.socket and self._capacity is not None):
                self._connect(layout)
            page_shape = (layout.page_tokens, layout.num_kv_heads, layout.head_dim)
            for layer in range(layout.num_layers):
                spaces = {}
                for kind, dtype in (("k", layout.dtype), ("v", layout.dtype),
                                    ("dk", layout.grad_dtype), ("dv", layout.grad_dtype)):
                    spaces[kind] = self.runtime.space(f"L{layer:03d}.{kind}", page_shape=page_shape, dtype=dtype,
                                                      pages=layout.num_pages)
                    self._live[spaces[kind].name] = torch.zeros(layout.num_pages, dtype=torch.bool)
                self.spaces.append(spaces)
            self._kv_pool = self.spaces[0]["k"].pool()
            self._grad_pool = self.spaces[0]["dk"].pool()
            self._capacity = layout
        self.layout = layout
        self._step_of = {}
        self._own.pages_allocated(layout.num_pages)

    def close_sequence(self) -> None:
        if self.layout is None:
            return
        self._sync()
        for layer_spaces in self.spaces:
            for space in layer_spaces.values():
                self._free_live(space)
        if self._own.pages_live["current"] > 0:
            self._own.pages_freed(self._own.pages_live["current"])
        self.layout = None

    def _free_live(self, space) -> None:
        live = self._live.get(space.name)
        if live is None:
            return
        for first, count in _runs(torch.nonzero(live).flatten().tolist()):
            space.free(first, count)
        live.zero_()

    # -- helpers ------------------------------------------------------------------------------------

    def _sync(self) -> None:
        # Note [Runtime pages and the compute stream].
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()

    def _acquire(self, space, pages: list[int], write: bool, zero: bool | None = None):
        """Acquires pages (runs of consecutive pages); returns their pool rows in page order.
        zero (default: write): pages without contents read as zeros."""
        indices, handles = [], []
        for first, count in _runs(pages):
            acquired = space.acquire(first, count, write=write, zero=write if zero is None else zero)
            if self.device.type == "cuda":
                self.runtime.stream_wait(acquired.ticket)
            else:
                acquired.wait()
            indices.append(acquired.indices)
            handles.append((space, first, count, write))
            if write:
                self._live[space.name][first: first + count] = True
        return torch.cat(indices).to(self.device), handles

    def _release(self, handles) -> None:
        self._sync()
        for space, first, count, dirty in handles:
            space.release(first, count, dirty=dirty)
            if self.offload:
                space.offload(first, count)

    @staticmethod
    def _pages_of(access: Access) -> list[int]:
        if access.selected is not None:
            return list(access.selected)
        return list(range(access.first_page, access.first_page + access.num_pages))

    def _advance(self, access: Access) -> None:
        step = self._step_of.get(access.key)
        if step is not None:
            self.runtime.advance(step)

    # -- KVStore ------------------------------------------------------------------------------------

    def offloaded(self, layer: int) -> bool:
        return self.offload

    def write_chunk(self, layer: int, first_page: int, k: torch.Tensor, v: torch.Tensor) -> None:
        # k, v: [tokens, Hkv, D]
        layout = self.layout
        tokens = k.shape[0]
        pages = -(-tokens // layout.page_tokens)
        handles = []
        for kind, data in (("k", k), ("v", v)):
            rows, acquired = self._acquire(self.spaces[layer][kind], list(range(first_page, first_page + pages)), True)
            padded = data.new_zeros((pages * layout.page_tokens,) + tuple(data.shape[1:]))
            padded[:tokens] = data
            self._kv_pool.index_copy_(0, rows.long(), padded.view(pages, layout.page_tokens, *data.shape[1:]))
            handles += acquired
        self._release(handles)

    def history(self, access: Access, history_tokens: int) -> HistoryView:
        self._advance(access)
        pages = self._pages_of(access)
        k_rows, k_handles = self._acquire(self.spaces[access.layer]["k"], pages, False)
        v_rows, v_handles = self._acquire(self.spaces[access.layer]["v"], pages, False)
        view = HistoryView(self._kv_pool, self._kv_pool, k_rows, history_tokens, v_page_index=v_rows,
                           handles=k_handles + v_handles)
        if access.selected is not None:
            # Only the selected pages are acquired: renumber them 0..n-1 (kernels.HistoryView.page_map).
            page_map = torch.full((access.num_pages,), -1, dtype=torch.int64)
            page_map[torch.tensor(pages, dtype=torch.int64) - access.first_page] = torch.arange(len(pages))
            view.page_map = page_map   # host: HistoryView.remap_selection applies it
            view.history_tokens = len(pages) * self.layout.page_tokens
        return view

    def grad_history(self, access: Access) -> GradView:
        self._advance(access)
        pages = self._pages_of(access)
        dk_rows, dk_handles = self._acquire(self.spaces[access.layer]["dk"], pages, True)
        dv_rows, dv_handles = self._acquire(self.spaces[access.layer]["dv"], pages, True)
        return GradView(self._grad_pool, self._grad_pool, dk_rows, dv_page_index=dv_rows,
                        handles=dk_handles + dv_handles)

    def chunk_grads(self, access: Access, tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
        self._advance(access)
        layout = self.layout
        pages = self._pages_of(access)
        out = []
        for kind in ("dk", "dv"):
            # In sparse mode no later chunk may have selected a page: it then holds no gradient.
            rows, handles = self._acquire(self.spaces[access.layer][kind], pages, False, zero=True)
            values = self._grad_pool.index_select(0, rows.long())   # a copy: safe after release
            self._release(handles)
            out.append(values.view(len(pages) * layout.page_tokens, layout.num_kv_heads, layout.head_dim)[:tokens])
        return out[0], out[1]

    def release(self, access: Access, view) -> None:
        if view is not None and getattr(view, "handles", None):
            self._release(view.handles)
            view.handles = None

    def free_pages(self, first_page: int, num_pages: int) -> None:
        for layer_spaces in self.spaces:
            for space in layer_spaces.values():
                live = self._live[space.name]
                for first, count in _runs([p for p in range(first_page, first_page + num_pages) if live[p]]):
                    space.free(first, count)
                live[first_page: first_page + num_pages] = False
        self._own.pages_freed(num_pages)

    def plan(self, accesses: list[Access]) -> None:
        steps, self._step_of = [], {}
        kinds = {"kv": ("k", "v"), "dkv": ("dk", "dv"), "chunk_grad": ("dk", "dv")}
        for access in accesses:
            ranges = []
            for kind in kinds[access.kind]:
                space = self.spaces[access.layer][kind]
                ranges += [(space, first, count) for first, count in _runs(self._pages_of(access))]
            self._step_of[access.key] = len(steps)
            steps.append(ranges)
        self.runtime.set_schedule(steps)

    @property
    def stats(self) -> StoreStats:
        """Page traffic as the runtime counts it (this client), plus the store's page bookkeeping."""
        stats = StoreStats(pages_live=self._own.pages_live)
        if self.runtime is None or self.layout is None and self._capacity is None:
            return stats
        client = self.runtime.stats()["clients"][0]
        layout = self._capacity
        page = layout.page_bytes(layout.dtype)
        stats.bytes_to_device = int(client.get("bytes_host_to_gpu", 0))
        stats.bytes_to_host = int(client.get("bytes_gpu_to_host", 0))
        stats.pages_to_device = stats.bytes_to_device // page
        stats.pages_to_host = stats.bytes_to_host // page
        stats.prefetch_hits = int(client.get("prefetch_hits", 0))
        stats.prefetch_misses = int(client.get("prefetch_misses", 0))
        stats.host_pool_bytes = self._host_pool_bytes or 0
        stats.device_pool_bytes = self.runtime.window_bytes
        return stats
