"""Where LoGRA keeps its per-matrix states (sketches, Adam moments, fp32 masters).

Note [LoGRA state storage]
Rationale: the optimizer touches every layer's sketch and moments once per update. One small
tensor per layer and state makes that hundreds of tiny kernels per kind (at 7B: 196 layers x ~12
elementwise ops, several milliseconds of launch overhead that the GPU waits on), and it scatters
the states over the caching allocator where the runtime cannot page them.
Approach: :class:`LoGRAStates` keeps one flat fp32 buffer per kind (``sketch``,
``first_moment``, ``second_moment``), every layer's [d, r] a view at a fixed offset, so the
optimizer runs each elementwise step once over all layers. The buffers come from a storage:
 - :class:`TensorStorage` (default): plain tensors on the weights' device; offloading copies a
   kind to pinned host memory and frees the device copy.
 - :class:`RuntimeStorage` (what apply_logra uses by default): one space of
   membar.runtime.Runtime per kind, acquired as a whole; a space is contiguous (Note [Space
   layout] in engine/engine.cpp), so the flat buffer is its pool tensor, flattened. Offloading
   hands the pages to the runtime (``Space.offload``: written back to host memory, GPU frames
   freed for others); restoring acquires them again at the same addresses.
With ``LoGRAOptimizer(offload_moments=True)`` the moments leave after every update and start
coming back (prefetch) when the next backward first touches a sketch, so the copy overlaps the
backward instead of stalling the optimizer step.
An offload does not wait for its copy: the runtime orders it after the update's kernels (a
stream-ordered release), and its ticket is checked when the kind is restored, long done by then.
Limitations: until session 10 the offload waited on the CPU for the copy to host at the end of
every update (measured on the H200: +16 ms on a 0.76 s 7B update, 2%; +37 ms on a 0.23 s 1.5B
update); without that wait it has not been measured on a GPU yet. An embedded runtime's GPU pool stays allocated
while moments are offloaded; the memory only serves others through a daemon. Masters ([d, k] fp32,
optional) stay plain tensors from :func:`allocate_state`.
"""
from __future__ import annotations

import math
from typing import Sequence

import torch

# What a state is for; the runtime uses it to name spaces.
STATE_KINDS = ("sketch", "first_moment", "second_moment", "master", "update")
FLAT_KINDS = ("sketch", "first_moment", "second_moment")


def allocate_state(
    shape: Sequence[int],
    device: torch.device | str,
    kind: str,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Returns a zero-filled, contiguous state tensor. Blocks; any thread may call it."""
    if kind not in STATE_KINDS:
        raise ValueError(f"unknown LoGRA state kind {kind!r}; expected one of {STATE_KINDS}")
    return torch.zeros(tuple(shape), device=device, dtype=dtype)


class TensorStorage:
    """Flat fp32 buffers as plain tensors. ``offload`` moves a kind to pinned host memory."""

    def __init__(self, device: torch.device | str):
        self.device = torch.device(device)
        self._host: dict[str, torch.Tensor] = {}
        self._prefetched: dict[str, torch.Tensor] = {}
        self._stream = None

    def describe(self) -> str:
        return f"tensors on {self.device}"

    def allocate(self, kind: str, numel: int) -> torch.Tensor:
        return torch.zeros(numel, dtype=torch.float32, device=self.device)

    def offload(self, kind: str, flat: torch.Tensor) -> None:
        if self.device.type == "cpu":
            self._host[kind] = flat
            return
        host = self._host.get(kind)
        if host is None:
            host = torch.empty(flat.numel(), dtype=flat.dtype, pin_memory=True)
            self._host[kind] = host
        host.copy_(flat, non_blocking=True)
        # The device buffer is dropped by the caller; the caching allocator keeps the copy's
        # source alive until the copy on the current stream is done.

    def prefetch(self, kind: str, numel: int) -> None:
        """Starts the copy back on a side stream (CUDA), so it overlaps the backward."""
        if self.device.type == "cpu" or kind in self._prefetched:
            return
        if self._stream is None:
            self._stream = torch.cuda.Stream(device=self.device)
        # The side stream must not read the host buffer before the offload's copy into it is done.
        self._stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self._stream):
            self._prefetched[kind] = self._host[kind].to(self.device, non_blocking=True)

    def restore(self, kind: str, numel: int) -> torch.Tensor:
        host = self._host[kind]
        if self.device.type == "cpu":
            return host
        prefetched = self._prefetched.pop(kind, None)
        if prefetched is None:
            return host.to(self.device, non_blocking=True)
        current = torch.cuda.current_stream(self.device)
        current.wait_stream(self._stream)
        prefetched.record_stream(current)
        return prefetched

    def close(self) -> None:
        self._host.clear()
        self._prefetched.clear()


class RuntimeStorage:
    """Flat fp32 buffers as pages of a membar.runtime.Runtime (Note [LoGRA state storage])."""

    PAGE_BYTES = 2 << 20

    def __init__(self, runtime, name: str = "logra"):
        self.runtime = runtime
        self.name = name
        self.spaces = {}
        self._flat = {}
        self._offloads = {}   # kind -> the ticket of its offload, checked on restore

    def describe(self) -> str:
        return f"runtime pages ({self.runtime.describe()})"

    @property
    def device(self) -> torch.device:
        return self.runtime.device

    def _acquire(self, kind: str) -> torch.Tensor:
        space = self.spaces[kind]
        space.acquire(0, space.page_count, write=True, zero=True, wait=True)
        return self._flat[kind]

    def allocate(self, kind: str, numel: int) -> torch.Tensor:
        pages = max(1, math.ceil(numel * 4 / self.PAGE_BYTES))
        space = self.runtime.space(f"{self.name}.{kind}", page_bytes=self.PAGE_BYTES, pages=pages)
        self.spaces[kind] = space
        self._flat[kind] = space.pool(torch.float32, (self.PAGE_BYTES // 4,)).view(-1)[:numel]
        return self._acquire(kind)

    def offload(self, kind: str, flat: torch.Tensor) -> None:
        space = self.spaces[kind]
        if flat.is_cuda:
            space.stream_release(0, space.page_count, dirty=True)
        else:
            space.release(0, space.page_count, dirty=True)
        self._offloads[kind] = space.offload(0, space.page_count)

    def prefetch(self, kind: str, numel: int) -> None:
        """Asks the runtime to bring the pages back now (asynchronously; the acquire in
        :meth:`restore` then finds them resident)."""
        space = self.spaces[kind]
        space.prefetch(0, space.page_count)

    def restore(self, kind: str, numel: int) -> torch.Tensor:
        self._check_offload(kind)
        return self._acquire(kind)

    def _check_offload(self, kind: str) -> None:
        """Raises the offload's error, if its copy failed (it finished long ago in a training loop)."""
        ticket = self._offloads.pop(kind, None)
        if ticket is not None:
            self.runtime.wait(ticket)

    def close(self) -> None:
        for kind in list(self._offloads):
            self._check_offload(kind)
        for space in self.spaces.values():
            try:
                space.release(0, space.page_count)
            except RuntimeError:
                pass  # already released (offloaded)
            space.destroy()
        self.spaces.clear()
        self._flat.clear()


class LoGRAStates:
    """One flat fp32 buffer per kind of state, every layer's [d, r] a view (Note [LoGRA state
    storage]). Buffers are made zero-filled on first use. Not thread-safe: the training thread
    owns it."""

    def __init__(self, shapes: Sequence[tuple[int, int]], device: torch.device | str, runtime=None,
                 name: str = "logra"):
        self.shapes = [(int(rows), int(rank)) for rows, rank in shapes]
        self.offsets = []
        total = 0
        for rows, rank in self.shapes:
            self.offsets.append(total)
            total += rows * rank
        self.numel = total
        self.storage = RuntimeStorage(runtime, name) if runtime is not None else TensorStorage(device)
        self._flat: dict[str, torch.Tensor] = {}
        self._views: dict[str, list[torch.Tensor]] = {}
        self._offloaded: set[str] = set()
        self._prefetch_on_sketch_use: list[str] = []

    def _check(self, kind: str) -> None:
        if kind not in FLAT_KINDS:
            raise ValueError(f"unknown flat LoGRA state kind {kind!r}; expected one of {FLAT_KINDS}")

    def allocated(self, kind: str) -> bool:
        return kind in self._flat or kind in self._offloaded

    def flat(self, kind: str) -> torch.Tensor:
        """The kind's flat buffer [total] fp32 (made zero-filled on first use; brought back first
        when offloaded)."""
        self._check(kind)
        if kind in self._offloaded:
            self._set(kind, self.storage.restore(kind, self.numel))
            self._offloaded.discard(kind)
        elif kind not in self._flat:
            self._set(kind, self.storage.allocate(kind, self.numel))
        return self._flat[kind]

    def _set(self, kind: str, flat: torch.Tensor) -> None:
        self._flat[kind] = flat
        self._views[kind] = [flat[offset:offset + rows * rank].view(rows, rank)
                             for offset, (rows, rank) in zip(self.offsets, self.shapes)]

    def view(self, kind: str, index: int) -> torch.Tensor:
        """Layer ``index``'s [d, r] view of the kind (valid until the kind is offloaded). The
        first sketch view asked for after :meth:`offload` (..., prefetch_on_sketch_use=True)
        starts bringing those kinds back, so the copy overlaps the rest of the backward."""
        if kind == "sketch" and self._prefetch_on_sketch_use:
            self.prefetch(self._prefetch_on_sketch_use)
            self._prefetch_on_sketch_use = []
        self.flat(kind)
        return self._views[kind][index]

    def prefetch(self, kinds: Sequence[str]) -> None:
        """Starts bringing offloaded kinds back without waiting."""
        for kind in kinds:
            if kind in self._offloaded:
                self.storage.prefetch(kind, self.numel)

    def views(self, kind: str) -> list[torch.Tensor]:
        self.flat(kind)
        return self._views[kind]

    def peek(self, kind: str, index: int) -> torch.Tensor | None:
        """The view if the kind is resident, else None (never allocates or restores)."""
        views = self._views.get(kind)
        return views[index] if views is not None and kind in self._flat else None

    def offload(self, kinds: Sequence[str], prefetch_on_sketch_use: bool = False) -> None:
        """Hands the kinds' buffers to host memory until their next use; with
        ``prefetch_on_sketch_use`` they start coming back when the next backward touches a sketch."""
        if prefetch_on_sketch_use:
            self._prefetch_on_sketch_use = list(kinds)
        for kind in kinds:
            self._check(kind)
            if kind not in self._flat:
                continue
            self.storage.offload(kind, self._flat.pop(kind))
            self._views.pop(kind, None)
            self._offloaded.add(kind)

    def resident_bytes(self) -> int:
        """Bytes of the kinds resident on the device now."""
        return 4 * self.numel * len(self._flat)

    def nbytes(self) -> int:
        """Bytes of every allocated kind, resident or offloaded."""
        return 4 * self.numel * (len(self._flat) + len(self._offloaded))

    def close(self) -> None:
        self._flat.clear()
        self._views.clear()
        self._offloaded.clear()
        self.storage.close()
