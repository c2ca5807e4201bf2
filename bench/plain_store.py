"""The benchmarks' baseline page store: every page in plain PyTorch tensors on the compute device.

membar's trainer keeps its pages in the memory runtime (membar.oomb.runtime_store); this store is
what the runtime must match in speed: K/V and dK/dV pools allocated once by PyTorch's allocator,
views that are the pools themselves, grad pages zeroed once per sequence, nothing moved, nothing
waited for. It is a benchmark baseline, not a product path (no offload, no sharing, no daemon).
"""
from __future__ import annotations

import torch

from membar.oomb.kernels import GradView, HistoryView
from membar.oomb.kv_store import Access, KVStore, PageLayout, StoreStats


class PlainKVStore(KVStore):
    def __init__(self, device: torch.device | str, streamed: bool = False):
        self.device = torch.device(device)
        # streamed: the trainer reads history in blocks as it does from offloaded pages (the
        # benchmarks' "+streamed": what the blocks cost without any copy or wait).
        self.streamed = streamed
        self.stats = StoreStats()
        self.layout: PageLayout | None = None
        self._capacity: PageLayout | None = None
        self.pools: list[dict] = []
        self._zeroed: list[bool] = []
        self._page_numbers: torch.Tensor | None = None

    def open_sequence(self, layout: PageLayout) -> None:
        if not layout.fits_in(self._capacity):
            shape = (layout.num_pages, layout.page_tokens, layout.num_kv_heads, layout.head_dim)
            self.pools = []
            self.pools = [{kind: torch.empty(shape, dtype=dtype, device=self.device)
                           for kind, dtype in (("k", layout.dtype), ("v", layout.dtype),
                                               ("dk", layout.grad_dtype), ("dv", layout.grad_dtype))}
                          for _ in range(layout.num_layers)]
            self._page_numbers = torch.arange(layout.num_pages, dtype=torch.int32, device=self.device)
            self._capacity = layout
            # (the pools are PyTorch allocations: its peak counts them, device_pool_bytes stays 0)
        self.layout = layout
        self._zeroed = [False] * layout.num_layers
        self.stats.pages_allocated(layout.num_pages)

    def close_sequence(self) -> None:
        if self.layout is not None and self.stats.pages_live["current"] > 0:
            self.stats.pages_freed(self.stats.pages_live["current"])
        self.layout = None

    def _grad_pools(self, layer: int) -> dict:
        pools = self.pools[layer]
        if not self._zeroed[layer]:
            pools["dk"][: self.layout.num_pages].zero_()
            pools["dv"][: self.layout.num_pages].zero_()
            self._zeroed[layer] = True
        return pools

    def write_chunk(self, layer: int, first_page: int, k: torch.Tensor, v: torch.Tensor) -> None:
        layout = self.layout
        rows = slice(first_page * layout.page_tokens, first_page * layout.page_tokens + k.shape[0])
        self.pools[layer]["k"].view(-1, layout.num_kv_heads, layout.head_dim)[rows].copy_(k)
        self.pools[layer]["v"].view(-1, layout.num_kv_heads, layout.head_dim)[rows].copy_(v)

    def _rows(self, access: Access) -> torch.Tensor:
        return self._page_numbers[access.first_page: access.first_page + access.num_pages]

    def history(self, access: Access, history_tokens: int) -> HistoryView:
        pools = self.pools[access.layer]
        self.stats.pages_read += 2 * access.num_pages
        return HistoryView(pools["k"], pools["v"], self._rows(access), history_tokens, first_row=access.first_page)

    def grad_history(self, access: Access) -> GradView:
        pools = self._grad_pools(access.layer)
        return GradView(pools["dk"], pools["dv"], self._rows(access), first_row=access.first_page)

    def chunk_grads(self, access: Access, tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
        layout = self.layout
        pools = self._grad_pools(access.layer)
        rows = slice(access.first_page * layout.page_tokens, access.first_page * layout.page_tokens + tokens)
        return (pools["dk"].view(-1, layout.num_kv_heads, layout.head_dim)[rows],
                pools["dv"].view(-1, layout.num_kv_heads, layout.head_dim)[rows])

    def streams_history(self, layer: int) -> bool:
        return self.streamed

    def reads_selected_pages(self, layer: int) -> bool:
        return False

    def free_pages(self, first_page: int, num_pages: int) -> None:
        self.stats.pages_freed(num_pages)
