"""The membar memory runtime from Python.

A :class:`Runtime` is one client of the runtime: a ``membard`` daemon when one answers, or the
same engine embedded in this process (the default on machines without a daemon or a GPU).
Pages live in named :class:`Space` objects, each one contiguous range of addresses: page p is
row p of the space's *pool* tensor, whatever the page size. A trainer acquires pages (they become
resident on the GPU, mapped in place and pinned), reads or writes those rows, and releases them::

    rt = Runtime.connect(embedded=True)
    keys = rt.space("L07.k", page_shape=(128, 4, 128), dtype=torch.bfloat16, pages=512)
    pool = keys.pool()                        # [512, 128, 4, 128]: page p is pool[p]
    keys.acquire(0, 8, write=True, zero=True).wait()
    pool[0:8] = new_keys                      # pages 0..7 of L07.k
    keys.release(0, 8, dirty=True)
    keys.offload(0, 8)                        # asynchronous write back to host memory

Only rows of acquired (not yet released) pages may be touched: the others may be unmapped
(reading them faults) or hold stale contents. Consecutive pages are consecutive rows, so a range
of a pool is one strided tensor any kernel can read. A pool tensor keeps its Runtime alive, so the
memory it views cannot go away under it.

The runtime is also reachable as ``torch.classes.membar.Runtime`` (what TorchScript code uses);
this module only adds names, defaults and Python types on top of it.
"""
from __future__ import annotations

import ctypes
import json
import math
from dataclasses import dataclass
from typing import Iterable, Optional, Sequence, Tuple, Union

import torch

from . import ops as _ops  # noqa: F401  (loads the compiled library, which registers the class)

__all__ = ["Runtime", "Space", "Acquired", "Channel", "PrivateDaemon"]

_KIB = 1 << 10
_MIB = 1 << 20


def _runtime_class():
    return torch.classes.membar.Runtime


@dataclass
class Acquired:
    """The answer of :meth:`Space.acquire`: the ticket to wait for; the pages are rows
    [first, first + count) of the space's pool."""

    runtime: "Runtime"
    ticket: int
    first: int
    count: int

    def wait(self) -> "Acquired":
        """Blocks until the pages' contents are in place (copies done, zero fills done)."""
        self.runtime.wait(self.ticket)
        return self

    def stream_wait(self, stream: Optional["torch.cuda.Stream"] = None) -> "Acquired":
        """Makes ``stream`` (default: the current CUDA stream) wait on the GPU, not the host."""
        self.runtime.stream_wait(self.ticket, stream)
        return self


class Channel:
    """A named shared-memory buffer made by the runtime (:meth:`Runtime.create_channel`): one
    process writes it, processes of the same user on the same daemon read it
    (:meth:`Runtime.open_channel`). ``buffer`` is a memoryview, writable for the creator and
    read-only for openers (the memory is mapped read-only, so a reader cannot corrupt it).

    A channel lives while its creator's Runtime is connected or until the creator calls
    :meth:`close`; readers keep what they mapped (they see the last contents) but new opens fail.
    With an embedded runtime only channels created in this process are found.
    """

    def __init__(self, runtime: "Runtime", name: str, answer: Sequence[int]):
        handle, fd, nbytes, writable, address = (int(v) for v in answer)
        self.runtime = runtime
        self.name = name
        self.handle = handle
        self.nbytes = nbytes
        self.writable = bool(writable)
        # The client library's own mapping (it lives until close): a published channel cannot be
        # mapped writable again (Note [Channels]).
        self._map = (ctypes.c_char * nbytes).from_address(address)
        view = memoryview(self._map).cast("B")
        self.buffer = view if self.writable else view.toreadonly()
        self._view = view

    def close(self) -> None:
        """Unmaps; the creator's close also drops the name. Views of ``buffer`` must be gone."""
        if self._map is None:
            return
        self.buffer.release()
        self._view.release()
        self._map = None
        self.runtime._native.close_channel(self.handle)

    def __enter__(self) -> "Channel":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        mode = "rw" if self.writable else "ro"
        return f"Channel({self.name!r}, {self.nbytes} bytes, {mode})"


class Space:
    """A named array of pages of one size, owned by a :class:`Runtime`.

    Ranges are (first, count); count defaults to "through the last page".
    """

    def __init__(self, runtime: "Runtime", space_id: int, name: str, page_bytes: int, page_count: int,
                 page_shape: Optional[Tuple[int, ...]] = None, dtype: Optional[torch.dtype] = None):
        self.runtime = runtime
        self.id = space_id
        self.name = name
        self.page_bytes = page_bytes
        self.page_count = page_count
        self.page_shape = page_shape
        self.dtype = dtype

    def __repr__(self) -> str:
        return (f"Space({self.name!r}, id={self.id}, pages={self.page_count}, "
                f"page_bytes={self.page_bytes}, page_shape={self.page_shape}, dtype={self.dtype})")

    def _range(self, first: int, count: Optional[int]) -> Tuple[int, int, int]:
        if count is None:
            count = self.page_count - first
        return self.id, int(first), int(count)

    def range(self, first: int = 0, count: Optional[int] = None) -> Tuple[int, int, int]:
        """(space id, first, count): one entry of a schedule step (see :meth:`Runtime.set_schedule`)."""
        return self._range(first, count)

    def acquire(self, first: int = 0, count: Optional[int] = None, *, write: bool = False,
                zero: bool = False, wait: bool = False) -> Acquired:
        """Makes pages GPU-resident and pinned. ``write``: they become dirty on release.
        ``zero``: pages without contents are zero-filled. Returns before the copies finish unless
        ``wait``."""
        space, first, count = self._range(first, count)
        ticket = self.runtime._native.acquire(space, first, count, bool(write), bool(zero))
        acquired = Acquired(self.runtime, int(ticket), first, count)
        return acquired.wait() if wait else acquired

    def release(self, first: int = 0, count: Optional[int] = None, *, dirty: bool = False) -> None:
        """Unpins; with ``dirty`` the GPU copy is the newest and is written back before eviction."""
        self.runtime._native.release(*self._range(first, count), bool(dirty))

    def stream_release(self, first: int = 0, count: Optional[int] = None, *, dirty: bool = False,
                       stream: Optional["torch.cuda.Stream"] = None) -> None:
        """Releases once the work enqueued so far on ``stream`` (default: the current CUDA stream)
        is done with the pages: the stream writes a marker when it gets there, and the runtime
        (embedded or membard) holds every copy out of or into these pages, and their frames, until
        it sees the marker. Nothing here waits for the GPU (Note [Stream-ordered release])."""
        stream = stream if stream is not None else torch.cuda.current_stream()
        self.runtime._native.stream_release(*self._range(first, count), bool(dirty), int(stream.cuda_stream))

    def prefetch(self, first: int = 0, count: Optional[int] = None) -> int:
        """Starts bringing host-resident pages to the GPU (not pinned); returns the ticket."""
        return int(self.runtime._native.prefetch(*self._range(first, count)))

    def offload(self, first: int = 0, count: Optional[int] = None) -> int:
        """Starts writing pages back to host memory and frees their GPU slots; returns the ticket."""
        return int(self.runtime._native.offload(*self._range(first, count)))

    def free(self, first: int = 0, count: Optional[int] = None) -> None:
        """Drops the pages' contents in both tiers (freeing a page twice is an error)."""
        self.runtime._native.free_pages(*self._range(first, count))

    def acquire_host(self, first: int = 0, count: Optional[int] = None) -> torch.Tensor:
        """A CPU uint8 tensor [count, page_bytes] over the pages' host copies (blocks until the
        data is there), contiguous. Valid until :meth:`release_host`."""
        return self.runtime._native.acquire_host(*self._range(first, count))

    def release_host(self, first: int = 0, count: Optional[int] = None, *, dirty: bool = False) -> None:
        """Ends host access; with ``dirty`` the host copy becomes the newest."""
        self.runtime._native.release_host(*self._range(first, count), bool(dirty))

    def pool(self, dtype: Optional[torch.dtype] = None, page_shape: Optional[Sequence[int]] = None) -> torch.Tensor:
        """The space's GPU-side addresses as [page_count, *page_shape] of ``dtype`` (defaults: the
        space's own, else a flat uint8 page): page p is row p."""
        dtype = dtype or self.dtype or torch.uint8
        if page_shape is None:
            page_shape = self.page_shape if self.page_shape is not None and dtype == self.dtype else None
        if page_shape is None:
            element = torch.empty((), dtype=dtype).element_size()
            if self.page_bytes % element:
                raise ValueError(f"Space.pool: a page of {self.page_bytes} bytes is not a whole number of {dtype}")
            page_shape = (self.page_bytes // element,)
        return self.runtime._native.pool(self.id, dtype, [int(x) for x in page_shape])

    @property
    def pointer(self) -> int:
        """The address of page 0 on the GPU side (page p lies at pointer + p * page_bytes)."""
        return int(self.runtime._native.space_pointer(self.id, "gpu"))

    def destroy(self) -> None:
        """Frees every page and forgets the space (no page may be acquired)."""
        self.runtime._native.destroy_space(self.id)


class Runtime:
    """One client of the membar runtime (see the module docstring)."""

    def __init__(self, native):
        self._native = native
        self._device_index = int(native.device())

    @classmethod
    def connect(cls, socket: Optional[str] = None, embedded: Optional[bool] = None, *, backend: str = "auto",
                gpu_pool_bytes: int = 256 * _MIB, host_pool_bytes: int = 1024 * _MIB, device: Optional[int] = None,
                name: str = "", gpu_quota_bytes: int = 0, host_quota_bytes: int = 0) -> "Runtime":
        """Connects to a runtime.

        ``embedded=True``: always an in-process runtime (``backend`` "auto", "host" or "cuda";
        pools of ``gpu_pool_bytes`` / ``host_pool_bytes`` made now). ``embedded=False``: a daemon
        only (``socket``, else ``$MEMBAR_SOCKET``, else the default socket) or an error.
        ``embedded=None`` (default): the daemon when one answers, else embedded.
        Quotas of 0 take the daemon's default share (embedded: the whole pool).
        ``device``: the CUDA device to work on. A daemon may serve several (``membard --devices
        0,1``); ``None`` takes its first device (embedded: device 0), and a device it does not
        serve is an error naming the ones it does. ``Runtime.device`` says which one it is.
        """
        if device is not None and int(device) < 0:
            raise ValueError(f"Runtime.connect: device must not be negative, got {device}")
        if embedded and socket:
            raise ValueError("Runtime.connect: give a socket or embedded=True, not both")
        target = "embedded" if embedded else (socket or "")
        native = _runtime_class().connect(target, embedded is not False, backend, int(gpu_pool_bytes),
                                          int(host_pool_bytes), -1 if device is None else int(device), name,
                                          int(gpu_quota_bytes), int(host_quota_bytes))
        return cls(native)

    def describe(self) -> str:
        """"embedded:host", "embedded:cuda" or "daemon:<socket>"."""
        return self._native.describe()

    @property
    def stream_waits_preferred(self) -> bool:
        """Whether a CUDA stream should wait for tickets on the GPU (stream_wait) rather than the host
        (wait): through membard, or embedded with copies ordered on the device (Note [Device-ordered
        copies] in engine/batches.cpp; MEMBAR_DEVICE_ORDER=0 turns that off)."""
        return bool(self._native.stream_waits_preferred())

    @property
    def backend(self) -> str:
        """"cuda" or "host"."""
        return self._native.backend()

    @property
    def device(self) -> torch.device:
        """Where pool tensors live."""
        return torch.device("cuda", self._device_index) if self.backend == "cuda" else torch.device("cpu")

    @property
    def device_index(self) -> int:
        """The device this runtime serves: the one the daemon answered for (its first device when
        ``connect`` named none), or the embedded runtime's. A label on the host backend."""
        return self._device_index

    def space(self, name: str, page_bytes: Optional[int] = None, pages: int = 1, *,
              page_shape: Optional[Sequence[int]] = None, dtype: Optional[torch.dtype] = None) -> Space:
        """Creates a space of ``pages`` pages of any size. Give ``page_bytes`` or ``page_shape``
        and ``dtype`` (whose size it then is)."""
        shape = tuple(int(x) for x in page_shape) if page_shape is not None else None
        if shape is not None:
            if dtype is None:
                raise ValueError("Runtime.space: page_shape needs a dtype")
            shaped = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
            if page_bytes is not None and page_bytes != shaped:
                raise ValueError(f"Runtime.space: page_shape {shape} of {dtype} is {shaped} bytes, "
                                 f"not page_bytes={page_bytes}")
            page_bytes = shaped
        if page_bytes is None:
            raise ValueError("Runtime.space: give page_bytes or page_shape and dtype")
        space_id = self._native.create_space(name, int(page_bytes), int(pages))
        return Space(self, int(space_id), name, int(page_bytes), int(pages), shape, dtype)

    def set_schedule(self, steps: Iterable[Iterable[Union[Tuple[int, int, int], Tuple[Space, int, int]]]]) -> None:
        """The access schedule: ``steps[i]`` lists the (space, first, count) ranges step i touches
        (a :class:`Space` or its id; ``Space.range(first, count)`` builds one). Eviction follows it
        (farthest next use first) and :meth:`advance` prefetches ahead along it."""
        flat = []
        for step in steps:
            numbers = []
            for space, first, count in step:
                numbers += [space.id if isinstance(space, Space) else int(space), int(first), int(count)]
            flat.append(numbers)
        self._native.set_schedule(flat)

    def add_stall_ns(self, ns: int) -> None:
        """Adds ``ns`` nanoseconds the caller measured waiting for pages where the runtime cannot see
        it (a CUDA stream's wait after :meth:`stream_wait`, timed with events) to this client's
        stall time, which ``membarctl stats`` / ``top`` show; host waits are counted already.
        Through ``membard`` it travels with the next request."""
        self._native.add_stall_ns(int(ns))

    def advance(self, step: int) -> None:
        """Step ``step`` of the schedule is about to run: prefetch ahead within the GPU quota."""
        self._native.advance(int(step))

    def wait(self, ticket: int) -> None:
        """Blocks until ``ticket`` (and every earlier one) has completed."""
        self._native.wait(int(ticket))

    @property
    def completed_ticket(self) -> int:
        return int(self._native.completed_ticket())

    def stream_wait(self, ticket: int, stream: Optional["torch.cuda.Stream"] = None) -> None:
        """Makes ``stream`` (default: the current CUDA stream) wait on the GPU for ``ticket``."""
        stream = stream if stream is not None else torch.cuda.current_stream()
        self._native.stream_wait(int(ticket), int(stream.cuda_stream))

    def stats(self) -> dict:
        """Frames per tier, this client's bytes by residency, bytes moved each way, prefetch
        hits / misses, evictions, stall time, and its spaces (each with the same counts)."""
        return json.loads(self._native.stats())

    def wait_ready(self, timeout_s: float = 600.0, log=None) -> float:
        """Blocks until no frame of the pools is being prepared (host slabs pinned and registered,
        renewed GPU frames cleared); returns the seconds waited. Preparing memory can stall on a
        busy GPU, so a trainer waits here, before its first step, not inside it. TimeoutError
        after timeout_s."""
        import time

        started = time.monotonic()
        said = False
        while True:
            preparing = sum(int(tier["frames_preparing"]) for tier in self.stats()["tiers"])
            waited = time.monotonic() - started
            if preparing == 0:
                return waited
            if waited > timeout_s:
                raise TimeoutError(f"the runtime was still preparing {preparing * 2} MiB of its pools after "
                                   f"{timeout_s:.0f} s")
            if waited > 1.0 and not said and log is not None:
                log(f"membar: waiting for the runtime to pin {preparing * 2 / 1024:.1f} GiB of its pools")
                said = True
            time.sleep(0.05)

    def pool_bytes_left(self) -> tuple[int, int]:
        """(GPU, host) bytes of the runtime's pools that no client holds: free frames and frames
        still being prepared (a daemon pins its host pool in the background after it starts), and
        on a daemon serving several devices from one node host pool, the host frames this device
        would get from it on request."""
        left = {tier["tier"]: (int(tier["frames_free"]) + int(tier["frames_preparing"])
                               + int(tier.get("frames_on_request", 0))) * (2 << 20)
                for tier in self.stats()["tiers"]}
        return left.get("gpu", 0), left.get("host", 0)

    def gpu_bytes(self, peak: bool = True) -> int:
        """GPU memory this client's pages occupy (2 MiB frames), at its peak or now: memory outside
        PyTorch's allocator, to add to torch.cuda.max_memory_allocated()."""
        frames = self.stats()["clients"][0]["gpu_frames"]
        return int(frames["peak" if peak else "current"]) * (2 << 20)

    def create_channel(self, name: str, nbytes: int) -> Channel:
        """A zero-filled channel of ``nbytes`` that this process writes (see :class:`Channel`)."""
        return Channel(self, name, self._native.create_channel(str(name), int(nbytes)))

    def open_channel(self, name: str) -> Channel:
        """Maps an existing channel read-only; RuntimeError (NOT_FOUND) when there is none."""
        return Channel(self, name, self._native.open_channel(str(name)))

    def __repr__(self) -> str:
        return f"Runtime({self.describe()})"


def membard_binary() -> str:
    """The membard to start for a private daemon: $MEMBAR_MEMBARD, else the one built beside this
    _C.so (named in _C.build.json: the same CUDA choice), else `membard` on the PATH (a pip
    install puts it there). ValueError with a sentence when there is none."""
    import os
    import shutil
    from pathlib import Path

    explicit = os.environ.get("MEMBAR_MEMBARD")
    if explicit:
        if not os.access(explicit, os.X_OK):
            raise ValueError(f"$MEMBAR_MEMBARD names {explicit}, which is not an executable membard.")
        return explicit
    info = Path(__file__).with_name("_C.build.json")
    try:
        built = json.loads(info.read_text()).get("membard")
    except (OSError, ValueError):
        built = None
    if built and os.access(built, os.X_OK):
        return built
    found = shutil.which("membard")
    if found:
        return found
    raise ValueError("no membard to start: build it (`make build`), install membar with pip (it installs membard), "
                     "or set $MEMBAR_MEMBARD to its path.")


def _die_with_parent() -> None:   # runs in the child before exec: SIGTERM when the trainer dies
    import signal

    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(1, signal.SIGTERM)   # PR_SET_PDEATHSIG


class PrivateDaemon:
    """A membard of this process's own (``--socket private`` in membar-train): started in the
    foreground on a socket in a private temporary folder, with pools of the given sizes on one
    device, and stopped by close(), at this process's exit, or by the kernel when this process
    dies. It gives one trainer the daemon's copy path (its copies run in another process, so the
    trainer's stream waits on the GPU and the host never does: Note [Runtime pages] in
    membar/oomb/runtime_store.py) without an administrator's daemon. The kernel's signal follows
    the thread that started it: start it from a thread that lives as long as the training (the
    main thread)."""

    def __init__(self, backend: str, gpu_pool_bytes: int, host_pool_bytes: int, device: int | None = None,
                 timeout_s: float = 60.0):
        import atexit
        import subprocess
        import tempfile
        import time
        from pathlib import Path

        self.directory = tempfile.mkdtemp(prefix="membard-")
        self.socket = str(Path(self.directory) / "membard.sock")
        self.log_path = str(Path(self.directory) / "membard.log")
        command = [membard_binary(), "--backend", backend, "--socket", self.socket, "--foreground",
                   "--gpu-pool", f"{math.ceil(gpu_pool_bytes / _MIB)}MiB",
                   "--host-pool", f"{math.ceil(host_pool_bytes / _MIB)}MiB", "--log-level", "warn"]
        if device is not None and backend == "cuda":
            command += ["--devices", str(int(device))]
        with open(self.log_path, "wb") as log:
            self.process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                            preexec_fn=_die_with_parent)
        atexit.register(self.close)
        deadline = time.monotonic() + timeout_s
        while not Path(self.socket).exists():
            if self.process.poll() is not None or time.monotonic() > deadline:
                said = Path(self.log_path).read_text(errors="replace").strip().splitlines()[-3:]
                self.close()
                raise RuntimeError(f"the private membard did not start ({' / '.join(said) or 'no output'}).")
            time.sleep(0.02)

    def close(self) -> None:
        import shutil

        process = getattr(self, "process", None)
        if process is not None and process.poll() is None:
            process.terminate()
            try:
                process.wait(timeout=20)
            except Exception:   # noqa: BLE001 - a daemon that does not stop is killed
                process.kill()
                process.wait()
        self.process = None
        shutil.rmtree(getattr(self, "directory", ""), ignore_errors=True)
