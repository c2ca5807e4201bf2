"""Where the K/V and dK/dV pages of a sequence live: membar's memory runtime (membar.runtime).

Each layer has four spaces, "L{layer}.k", ".v", ".dk", ".dv", of one page per page_tokens tokens
(page_shape [page_tokens, Hkv, D]; any size). The runtime is embedded in this process by
default, or the membard daemon named by ``socket`` / ``$MEMBAR_SOCKET``.

Note [Runtime pages]
  Rationale: the runtime must be the store at the speed of plain tensor pools: cuDNN's fused
  attention (the fastest dense kernels on Hopper) reads only contiguous K/V, and nothing may wait
  for the GPU on the host in the step loop.
  Approach: a space is contiguous (Note [Space layout] in engine/engine.cpp), so a layer's pages
  [a, b) are rows [a, b) of its pool tensor and a history view is one strided tensor with
  first_row = a: the dense path runs cuDNN on it directly, membar's kernels get the identity page
  table, and sparse reads index it by page number. Each access is one runtime call:
  acquire_ranges over the K and V (or dK and dV) ranges with the schedule step to advance to, so
  the runtime prefetches the next accesses and evicts by farthest next use (the whole access plan
  is its schedule); the current stream then waits for the ticket on the GPU (cuStreamWaitValue64),
  and releases are stream-ordered (the stream writes a marker; the runtime holds copies and
  unmaps until it sees it). With offload, the runtime's GPU budget is what it may keep on the GPU
  (gpu_budget_bytes, or a working set of a few history blocks, plus gpu_resident_layers whole
  layers when asked); every layer's history streams in blocks, and whatever the budget holds
  stays resident by the runtime's choice.
  Limitations: with offload in sparse mode, each access names its selected pages, so the union of
  a selection must be known on the host (one wait for the GPU per layer and chunk in stage 1).
  The stream waits on the GPU wherever that needs no host thread of this process
  (Runtime.stream_waits_preferred): through membard (its threads enqueue the copies), and embedded
  on CUDA, whose engine orders copies on the device (Note [Device-ordered copies] in
  engine/batches.cpp: a ticket's copies are enqueued, behind the stream's release markers, the
  moment it is issued). An embedded engine that orders copies on the host (MEMBAR_DEVICE_ORDER=0)
  waits on the host instead: its copies are enqueued by threads of this process only once the
  stream passes a marker, and CUDA's lazy module loading can wait for the device to go idle while
  holding a driver lock those threads need, so a stream waiting on the GPU for them deadlocked
  (seen on the H200: autograd thread in cuKernelGetFunction, the dispatcher in cuMemcpyAsync), and
  waiting on the host for them cost offload 4-17% on the H200 (stall 19-33%).
  MEMBAR_STREAM_WAIT=1 / 0 (or stream_waits=) forces stream / host waits. Host waits (and a stream
  wait's wait until the copies are enqueued) are counted as stall time; the stream's own wait on
  the GPU is not, unless MEMBAR_TIME_STREAM_WAITS=1 puts a pair of CUDA events around each one
  (StoreStats.stream_wait_ns, and per access kind and phase stream_wait_by_kind; the trainer's
  stream_wait_seconds and stream_wait_by_kind, the bench's "+timewaits"). Timed
  stream waits are reported to the runtime (Runtime.add_stall_ns) as they finish, read at each
  `stats`, so the runtime's stall time (membarctl) holds both; StoreStats.stall_ns stays the host's.
  Grad pages are counted as contents once a backward acquired them (zero-filled on first use).
  With offload and MEMBAR_STAGED_HISTORY=1 (or kv), history blocks are staged (Note [Staged history]).
  On the meta device (shapes without bits: how tests measure what a step keeps on the device at
  any length) the runtime runs on its host backend for the bookkeeping and the pools are meta
  tensors of the same shape; reserve() before a measured step keeps their creation out of it.

Note [Chunk grads with the last block]
  Rationale: a chunk's own dK/dV pages (its chunk_grad access, read once every later chunk has
  added to them) come right after its layer's history blocks in the plan, and with offload they
  have usually left the GPU since the chunk after it wrote them. The runtime's lookahead brings a
  step's frames in only once MIN would evict for them (Note [Eviction order]), and MIN's victim
  there is the last block's own frames, in use until the step before: traced on the host backend
  (4 layers, 16 chunks, blocks of 4 chunks), 70 of 74 chunk_grad frames were placed by the advance
  to their own step, so their copy started when the stream already needed them (on the H200 the
  stream's longest waits with offload: 0.3 s at 128K, 0.6-0.9 s at 256K).
  Approach: the schedule step of the layer's last dK/dV access of the chunk names the chunk's own
  dK/dV pages as well (plan()), so the lookahead places them with that block, a step earlier; the
  access itself still acquires only the block, and its chunk_grad step follows. Same trace: every
  chunk_grad frame placed a step ahead, none at its own step. MEMBAR_CHUNK_GRADS_EARLY=0 turns it
  off. Limitations: where the block itself is placed late (at its own advance) the chunk's copies
  ride in the block's batch, and the block's kernels wait for them too.

Note [Staged history]
  Rationale: a layer's history is read once per later chunk, block by block. Acquired as pages of
  its own spaces, each block's frames are placed on the GPU and mapped at the block's position:
  at 128K tokens of a 7B model ~220K placements a step, ~16 s of the trainer's thread in cuMemMap
  and cuMemUnmap (H200, session 19), which is what kept offload below plain tensors.
  Approach: with offload, the store keeps four staging spaces (K, V, dK, dV), each of
  `slots` blocks of rows (prefetch_depth + 2, fewer when the GPU budget is small), acquired once
  per sequence layout and held: mapped once, never evicted. A dense history access (kind "kv" or
  "dkv", no selection) takes a free slot of its kind (a K/V access shares the slot that already
  holds its pages: a layer's recompute and backward read one block one after the other; K/V pages
  are written once a step) and asks the runtime to copy the block's pages into the slot's rows (copy_pages,
  Note [Copied pages] in engine/page_copies.cpp: the pages stay in host memory, or are read on
  the GPU where still resident); the view's rows are the slot's, one strided tensor as before
  (first_row). Releasing a dK/dV view copies the slot's rows back into the layer's dK/dV pages;
  releasing a K/V view only frees the slot. A release writes a marker on the trainer's stream
  (stream_mark) and a slot's next copies wait on the device for that marker, so a slot is refilled
  only after the kernels that read it, and no later: a marker written when the copy is issued
  would also cover the accesses enqueued since (the host runs ahead of the GPU), and the copy
  could no longer hide behind them (session 20's first runs did that). Copies out of and into one
  slot are ordered by the runtime's frame dependencies. Ahead of use, the store issues the copies
  of the next planned accesses while a slot of their kind is free, unless an earlier unreleased
  dK/dV access overlaps their pages (its write-back must land first) or a K/V block is not written
  yet: those wait for their turn.
  A sparse access copies only its selected pages, page by page, into the slot's first rows (the
  view's page_map numbers the access's pages into them; dK/dV go back the same way), where
  acquiring moves whole 2 MiB frames for 128 KiB pages. Blocks larger than a slot, selections of
  more than 1024 runs and accesses out of the plan when no slot is free keep the acquire path, as
  do the chunk's own pages (write, chunk_grad), which the runtime's schedule still covers
  (MEMBAR_STAGED_HISTORY=kv stages the K/V history only, whole blocks, and acquires dK/dV and
  selections in place, where nearby uses stay on the GPU); a staged dK/dV access after an acquired
  one of its layer waits for that one's release before its copies go ahead. Opt-in
  (MEMBAR_STAGED_HISTORY=1): measured on the H200 (7B shape, 128K, blocks of 64K tokens, session
  20) it cuts frame maps from ~217K to ~10K and the trainer's host time in runtime calls from 29 to
  22 s, but the step took 53.5 s against 47.4 s acquiring the history's own pages (46.5 s plain
  tensors): it moved 747 against 636 GiB, since
  every access copies its block while pages acquired in place stay on the GPU between nearby uses,
  and handing its copies over cost 15.9 s against 3.7 s. With the slot markers above (session 21):
  staged 52.9 s, K/V staged with dK/dV acquired (=kv) 49.9 s, acquired 46.6 s, plain 46.1 s; sparse
  offload at 256K staged 83.9 s and 905 GiB against 80.2 s and 756 GiB acquired (session 13).
  Limitations: a slot pool per kind means the history of a backward (K/V and dK/dV of one block)
  holds two slots; the staging rows take prefetch_depth + 2 history blocks of K, V, dK and dV out
  of the GPU budget, which store_sizes sizes as prefetch_depth + 3 of them. Every dK/dV access
  copies its block in and out, where pages acquired in place may stay on the GPU between uses.
"""
from __future__ import annotations

import math
import os
import time

import torch

from ..units import human_bytes
from .kernels import GradView, HistoryView
from .kv_store import _CALL_PARTS, Access, KVStore, PageLayout, StoreStats, _runs

_MIB = 1 << 20
_FRAME = 2 * _MIB
_MAX_COPY_PAIRS = 2048   # copy_pages' limit per call (engine/page_copies.cpp)
_SLACK = 4 * _MIB   # on top of each tier's budget: ranges straddling frames


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def _space_bytes(pages: int, page_bytes: int) -> int:
    return _round_up(pages * page_bytes, _FRAME)


def _frames_spanned(pages: int, page_bytes: int, space_pages: int) -> int:
    """The most 2 MiB frames `pages` consecutive pages of a space of `space_pages` can touch: a
    page starts at a multiple of gcd(page_bytes, frame) within its frame, so a range can start
    that close to a frame's end."""
    spanned = -(-(pages * page_bytes + _FRAME - math.gcd(page_bytes, _FRAME)) // _FRAME)
    return min(spanned, _space_bytes(space_pages, page_bytes) // _FRAME)


def _frames_of(pages, page_bytes: int) -> set[int]:
    """The 2 MiB frames of a space holding these pages (a page may straddle two)."""
    return {frame for page in pages
            for frame in range(page * page_bytes // _FRAME, ((page + 1) * page_bytes - 1) // _FRAME + 1)}


def schedule_steps(accesses, ranges_of, chunk_grads_early: bool = True) -> tuple[list[list[int]], dict]:
    """The runtime schedule of a plan: one step per access, its flat (space, first, count) ranges
    (ranges_of(access)), and each access's step by key. With chunk_grads_early, the step of a
    layer's last dK/dV access of a chunk also names that chunk's own dK/dV pages (its chunk_grad
    access's ranges: Note [Chunk grads with the last block])."""
    steps, step_of, last_dkv = [], {}, {}
    for access in accesses:
        step_of[access.key] = len(steps)
        ranges = ranges_of(access)
        if access.kind == "dkv":
            last_dkv[(access.layer, access.chunk)] = len(steps)
        elif access.kind == "chunk_grad" and chunk_grads_early:
            before = last_dkv.get((access.layer, access.chunk))
            if before is not None:
                steps[before] = steps[before] + ranges
        steps.append(ranges)
    return steps, step_of


def room_frames(block_pages: int, selection_pages: int, page_bytes: int, space_pages: int) -> int:
    """The frames of one space that one access of an offloaded layer may touch: those a history
    block of block_pages consecutive pages can span, or, for a sparse selection of at most
    selection_pages pages where that is no more than a block's pages, those as many scattered pages
    can touch (each may lie in frames of its own), whichever is more (Note [Streaming a layer's
    history] in hf_attention.py)."""
    block = _frames_spanned(block_pages, page_bytes, space_pages)
    if not 0 < selection_pages <= block_pages:
        return block
    scattered = selection_pages * _frames_spanned(1, page_bytes, space_pages)
    return max(block, min(scattered, _space_bytes(space_pages, page_bytes) // _FRAME))


def access_bytes(block_pages: int, selection_pages: int, kv_page_bytes: int, grad_page_bytes: int,
                 space_pages: int) -> int:
    """GPU bytes one access of an offloaded layer holds: its K, V, dK and dV room (room_frames)."""
    return _FRAME * (2 * room_frames(block_pages, selection_pages, kv_page_bytes, space_pages)
                     + 2 * room_frames(block_pages, selection_pages, grad_page_bytes, space_pages))


def store_sizes(layout: PageLayout, offload: bool, block_pages: int, prefetch_depth: int,
                gpu_budget_bytes: int | None = None, gpu_resident_layers: int = 0,
                chunk_pages: int = 0, selection_pages: int = 0) -> tuple[int, int]:
    """(GPU bytes, host bytes) the runtime needs for a sequence of this layout: without offload
    every page on the GPU; with offload a host tier for the pages that leave the GPU and a GPU budget of
    gpu_budget_bytes, or else a working set (prefetch_depth + 3 accesses of a history block's K, V,
    dK and dV, or of a sparse selection's where that is more: access_bytes) plus
    gpu_resident_layers whole layers. A budget below what one step acquires at once is a
    ValueError.

    The host tier takes a frame only for what leaves the GPU, so with gpu_resident_layers (and no
    explicit budget) it is sized for the other layers' pages plus the streamed working set, not for
    every page: the 7B 1M sparse step through membard (session 13, 14 of 28 layers on the GPU, bf16
    grad pages) used 54.5 GiB of host frames for 14 x 4 GiB of pages. Sized for every page, the
    Gemma-2-9B 128K step (42 layers x 3 GiB, some of them planned on the GPU) asked for a 126 GiB
    host pool on a 128 GiB machine and was killed while pinning it (session 23)."""
    kv, grad = layout.page_bytes(layout.dtype), layout.page_bytes(layout.grad_dtype)
    layer = 2 * _space_bytes(layout.num_pages, kv) + 2 * _space_bytes(layout.num_pages, grad)
    total = layout.num_layers * layer
    if not offload:
        return total, 0
    pages = layout.num_pages
    block = min(block_pages or pages, pages)
    access = access_bytes(block, selection_pages, kv, grad, pages)
    host = total
    if gpu_budget_bytes is None:
        # A block's bytes, and what a sparse selection's room adds to a block's frames.
        extra = access - access_bytes(block, 0, kv, grad, pages)
        streamed = 2 * _space_bytes(block, kv) + 2 * _space_bytes(block, grad) + extra
        gpu_budget_bytes = (prefetch_depth + 3) * streamed + gpu_resident_layers * layer
        host = min(total, total - min(gpu_resident_layers, layout.num_layers) * layer
                   + (prefetch_depth + 3) * streamed)
    budget = min(total, _round_up(gpu_budget_bytes, _FRAME))
    # What a backward holds at once: one access's K, V, dK and dV and the chunk's dK and dV.
    chunk = min(chunk_pages or pages, pages)
    least = min(total, access + _FRAME * 2 * _frames_spanned(chunk, grad, pages))
    if budget + _SLACK < least:
        raise ValueError(f"a GPU budget of {human_bytes(gpu_budget_bytes)} cannot hold what one step acquires at "
                         f"once ({human_bytes(least)}: a history block's K, V, dK and dV and a chunk's dK and dV); "
                         f"raise gpu_budget_bytes or lower history_block_tokens.")
    return budget, host


def _check_host_room(pinned: int, gpu_bytes: int, host_bytes: int, cuda: bool, margin: float = 0.92) -> None:
    """A sentence, before anything is pinned, when the pools this store would pin on this machine
    exceed `margin` of its available memory: pinning them would have the kernel's OOM killer stop
    the process instead (Gemma-2-9B at 128K, session 23, before store_sizes left resident layers
    out of the host tier)."""
    from membar.oomb.config import host_available_bytes

    available = host_available_bytes()
    if not available or pinned <= margin * available:
        return
    what = (f"a host tier of {human_bytes(host_bytes)} for the pages that leave the GPU" if cuda
            else f"{human_bytes(gpu_bytes)} of pages and a host tier of {human_bytes(host_bytes)}")
    raise ValueError(
        f"the runtime would pin {human_bytes(pinned)} of host memory ({what}), more than {margin:.0%} of the "
        f"{human_bytes(available)} this machine has available: keep more layers on the GPU "
        f"(gpu_resident_layers, membar-train --gpu-resident-layers auto), use bfloat16 gradient pages, shorten "
        f"the sequence, or train through a membard whose --host-pool fits (--socket).")


def streamed_bytes(tokens: int, model_config, page_tokens: int, dtype, grad_page_dtype, block_tokens: int,
                   prefetch_depth: int = 2, tensor_parallel: int = 1, selection_pages: int = 0) -> int:
    """GPU bytes an offloading store holds beside its GPU-resident layers for the streamed history:
    prefetch_depth + 3 accesses of a block's K, V, dK and dV (or of a sparse selection of
    selection_pages pages where that is more), as store_sizes adds them to the GPU budget. A plan
    of resident layers must leave this room too (Gemma-2-9B at 128K, session 24: planned beside 24
    GiB for activations alone, its 26 resident layers and 7.5 GiB of streamed blocks ran the GPU
    out of memory)."""
    from membar.oomb.config import pool_bytes_per_layer

    text = getattr(model_config, "text_config", None) or model_config
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    block = min(block_tokens or tokens, tokens)
    kv_heads = text.num_key_value_heads // tensor_parallel
    row = page_tokens * kv_heads * head_dim
    kv, grad = row * dtype.itemsize, row * grad_page_dtype.itemsize
    pages, block_pages = -(-tokens // page_tokens), -(-block // page_tokens)
    extra = (access_bytes(block_pages, selection_pages, kv, grad, pages)
             - access_bytes(block_pages, 0, kv, grad, pages))
    return (prefetch_depth + 3) * (pool_bytes_per_layer(block, page_tokens, kv_heads, head_dim, dtype, grad_page_dtype)
                                   + extra)


def plan_in_daemon(socket: str, device, tokens: int, model_config, page_tokens: int, dtype, grad_page_dtype,
                   block_tokens: int, prefetch_depth: int = 2, tensor_parallel: int = 1, selection_pages: int = 0):
    """plan_gpu_resident_layers against what membard's pools at `socket` have left for `device`
    (they are allocated already, so this process's free memory does not count them), keeping room
    in its GPU pool for the streamed history blocks (prefetch_depth + 3 accesses of a block, or of
    a sparse selection of selection_pages pages where that is more, as store_sizes). Returns (plan,
    GPU bytes left, host bytes left); the plan's ValueError names the daemon's pools."""
    from membar.oomb.config import plan_gpu_resident_layers
    from membar.runtime import Runtime

    device = torch.device(device)
    runtime = Runtime.connect(socket=socket, embedded=False, name="membar plan",
                              device=(device.index or 0) if device.type == "cuda" else None)
    gpu_left, host_left = runtime.pool_bytes_left()
    del runtime
    streamed = streamed_bytes(tokens, model_config, page_tokens, dtype, grad_page_dtype, block_tokens, prefetch_depth,
                              tensor_parallel, selection_pages)
    try:
        plan = plan_gpu_resident_layers(tokens, model_config, page_tokens, dtype, grad_page_dtype, gpu_left, streamed,
                                        host_left, tensor_parallel=tensor_parallel,
                                        reserve_for="the streamed history blocks")
    except ValueError as error:
        raise ValueError(f"{error} (planned against membard at {socket}: its pools have {gpu_left / 2**30:.1f} GiB "
                         f"of GPU and {host_left / 2**30:.1f} GiB of host memory left; start it with a larger "
                         f"--host-pool.)") from None
    return plan, gpu_left, host_left


class _Staging:
    """The staging rows of Note [Staged history] and what they hold. Kinds: "kv" (K and V rows),
    "dkv" (dK and dV rows); a slot is rows [slot * block_pages, (slot + 1) * block_pages). A K/V
    slot remembers which pages it holds: an access to the same pages (a layer's recompute and
    backward of one block, one after the other) shares it without a copy (K/V pages are written
    once a step, in stage 1)."""

    def __init__(self, spaces: dict, pools: dict, slots: int, block_pages: int, device: torch.device):
        self.spaces = spaces            # "k", "v", "dk", "dv" -> Space
        self.pools = pools              # the same keys -> pool tensor
        self.slots = slots
        self.block_pages = block_pages
        self.rows = torch.arange(slots * block_pages, dtype=torch.int32, device=device)
        self.hits = 0                   # accesses whose copies were issued ahead (or shared)
        self.misses = 0                 # ... issued when the access came
        self.shared = 0                 # accesses served by a slot already holding their pages
        self.selections = 0             # accesses of a sparse selection (its pages only copied)
        self.refs = {kind: [0] * slots for kind in ("kv", "dkv")}
        self.free = {kind: list(range(slots)) for kind in ("kv", "dkv")}   # least recently freed first
        self.content: list = [None] * slots     # K/V slot -> (layer, first, count) it holds
        self.where: dict = {}                   # (layer, first, count) -> K/V slot holding it
        self.filled: list = [0] * slots         # K/V slot -> ticket of the copy that filled it
        # kind -> slot -> the stream marker its last reader left at release (0: none yet).
        self.marker = {kind: [0] * slots for kind in ("kv", "dkv")}
        self.issued: dict = {}          # key -> (slot, ticket): copies issued, view not taken yet
        self.held: dict = {}            # key -> (kind, slot): views out
        self.dkv_pending: dict = {}     # key -> (layer, first, end): dK/dV not yet written back
        self.plan([])

    def plan(self, accesses: list, barriers: dict | None = None) -> None:
        """A new plan: copies issued for the old one are given up (their slots' next copies wait
        for them in the runtime); views still out keep their slots. barriers: staged dK/dV access
        key -> the key of the last dK/dV access of its layer before it that is not staged (a sparse
        selection): its copies are issued ahead only once that one is released."""
        self.order = accesses           # the planned staged accesses, in order
        self.next = 0                   # first planned position not looked at by stage_ahead
        self.barriers = barriers or {}
        self.released_unstaged: set = set()
        for key, (slot, _) in list(self.issued.items()):
            kind = key[0]
            self.give(kind, slot)
            self.dkv_pending.pop(key, None)
        self.issued = {}

    def forget(self) -> None:
        """A new sequence: no K/V slot holds its pages yet."""
        self.content = [None] * self.slots
        self.where = {}

    def take(self, access) -> tuple[int, int] | None:
        """A slot for the access: (slot, ticket of the copy filling it, or -1 when the caller must
        copy), or None when every slot of its kind is in use."""
        kind = access.kind
        if kind == "kv":
            pages = (access.layer, access.first_page, access.num_pages, access.selected)
            slot = self.where.get(pages)
            if slot is not None:
                if self.refs[kind][slot] == 0:
                    self.free[kind].remove(slot)
                self.refs[kind][slot] += 1
                self.shared += 1
                return slot, self.filled[slot]
        if not self.free[kind]:
            return None
        slot = self.free[kind].pop(0)
        self.refs[kind][slot] = 1
        if kind == "kv":
            old = self.content[slot]
            if old is not None:
                self.where.pop(old, None)
            self.content[slot] = None
        return slot, -1

    def filled_with(self, access, slot: int, ticket: int) -> None:
        if access.kind == "kv":
            pages = (access.layer, access.first_page, access.num_pages, access.selected)
            self.content[slot] = pages
            self.where[pages] = slot
            self.filled[slot] = ticket

    def give(self, kind: str, slot: int) -> None:
        self.refs[kind][slot] -= 1
        if self.refs[kind][slot] == 0:
            self.free[kind].append(slot)

    def written(self, layer: int, first: int, end: int) -> None:
        """K/V pages [first, end) of `layer` were written: no slot holds their new contents."""
        for pages, slot in list(self.where.items()):
            if pages[0] == layer and pages[1] < end and first < pages[1] + pages[2]:
                del self.where[pages]
                self.content[slot] = None

    def slot_rows(self, slot: int, pages: int) -> torch.Tensor:
        start = slot * self.block_pages
        return self.rows[start: start + pages]


class RuntimeKVStore(KVStore):
    """Pages in membar's runtime (Note [Runtime pages]).

    runtime: an already connected membar.runtime.Runtime (optional); socket: reach the membard
    daemon there instead of embedding a runtime (default: $MEMBAR_SOCKET when set, else embedded),
    or "private": start a membard of the store's own, sized as an embedded runtime would be
    (membar.runtime.PrivateDaemon: the daemon's copy path without an administrator's daemon);
    offload: pages live in host memory and stream through a GPU budget (gpu_budget_bytes, default
    a few history blocks plus gpu_resident_layers whole layers); name: how membarctl shows this
    trainer; extra_bytes: (GPU, host) bytes the runtime this store connects holds beyond the pages,
    for other spaces sharing it (LoGRA's states in membar-train). Same threading contract as KVStore."""

    def __init__(self, device: torch.device | str, *, offload: bool = False, socket: str | None = None,
                 runtime=None, gpu_budget_bytes: int | None = None, gpu_resident_layers: int = 0,
                 block_tokens: int | None = None, chunk_tokens: int | None = None, prefetch_depth: int | None = None,
                 name: str = "membar-trainer", extra_bytes: tuple[int, int] = (0, 0),
                 stream_waits: bool | None = None):
        self.device = torch.device(device)
        self.offload = offload
        env_socket = os.environ.get("MEMBAR_SOCKET") or None
        self.socket = socket if socket is not None else (env_socket if env_socket != "embedded" else None)
        self.runtime = runtime
        self._own_runtime = runtime is None
        self._private = None   # the PrivateDaemon of socket="private"
        self.gpu_budget_bytes = gpu_budget_bytes
        self.gpu_resident_layers = gpu_resident_layers
        self.block_tokens = block_tokens
        self.chunk_tokens = chunk_tokens
        self.prefetch_depth = prefetch_depth
        self.selection_pages = 0   # the most pages a sparse selection names (OOMBConfig.selection_pages)
        self._selection_room = 0   # ... as the GPU budget was sized for (0: a block's room only)
        self.name = name
        self.extra_bytes = extra_bytes   # (GPU, host) room for other spaces in a runtime this store connects
        # GPU-side waits for tickets (None: through membard, or with MEMBAR_STREAM_WAIT=1): Note [Runtime pages]
        self.stream_waits = stream_waits
        # MEMBAR_TIME_STREAM_WAITS=1: time each GPU-side wait with a pair of CUDA events around it
        # (the stream's own stall; opt-in: two event records per access).
        self._time_waits = os.environ.get("MEMBAR_TIME_STREAM_WAITS") == "1"
        # Note [Chunk grads with the last block] (MEMBAR_CHUNK_GRADS_EARLY=0 turns it off).
        self._chunk_grads_early = os.environ.get("MEMBAR_CHUNK_GRADS_EARLY", "1") != "0"
        self._wait_events: list = []
        self._stream_wait_ns = 0
        self._stream_wait_by_kind: dict = {}   # access kind:phase -> [ns, waits, longest ns]
        self.layout: PageLayout | None = None
        self._capacity: PageLayout | None = None
        self._sizes = (0, 0)
        self.spaces: list[dict] = []     # per layer: {"k", "v", "dk", "dv"} -> Space
        self.pools: list[dict] = []      # per layer: the same keys -> pool tensor [pages, page_tokens, Hkv, D]
        self._live: dict = {}            # space id -> bool [num_pages]: pages holding contents
        self._page_numbers: torch.Tensor | None = None
        self._step_of: dict = {}
        self._cuda = self.device.type == "cuda"
        self._gpu_waits = True
        self._meta = self.device.type == "meta"
        self._own = StoreStats()
        self._baseline: dict | None = None
        # Note [Staged history]: with offload, history blocks are copied through staging rows.
        staged = os.environ.get("MEMBAR_STAGED_HISTORY", "0")
        if staged not in ("0", "1", "kv"):
            raise ValueError(f"MEMBAR_STAGED_HISTORY={staged!r}: use 1 (K/V and dK/dV history staged), kv (K/V "
                             f"only, dK/dV acquired in place) or 0 (none).")
        self.staged = offload and staged != "0" and not self._meta
        self._staged_kinds = ("kv",) if staged == "kv" else ("kv", "dkv")
        self._staging: _Staging | None = None

    # -- connection and spaces --------------------------------------------------------------------

    def _connect(self, gpu_bytes: int, host_bytes: int) -> None:
        from membar.runtime import Runtime

        gpu = _round_up(max(gpu_bytes, _FRAME) + _SLACK + self.extra_bytes[0], _FRAME)
        host = _round_up(max(host_bytes, _FRAME) + _SLACK + self.extra_bytes[1], _FRAME)
        backend = "cuda" if self._cuda else "host"
        if self.socket in (None, "private"):   # pools of this store's own: pinned now, on this machine
            _check_host_room(host + (0 if self._cuda else gpu), gpu_bytes, host_bytes, self._cuda)
        # A CUDA model asks the daemon for its GPU; a CPU one takes the daemon's first device.
        device = (self.device.index or 0) if self._cuda else None
        if self.socket == "private":   # a membard of this store's own, sized like an embedded runtime
            from membar.runtime import PrivateDaemon

            if self._private is not None:
                self._private.close()
            self._private = PrivateDaemon(backend, gpu, host, device=device)
            self.runtime = Runtime.connect(socket=self._private.socket, embedded=False, device=device,
                                           name=self.name, gpu_quota_bytes=gpu, host_quota_bytes=host)
        elif self.socket:
            self.runtime = Runtime.connect(socket=self.socket, embedded=False, device=device, name=self.name,
                                           gpu_quota_bytes=gpu, host_quota_bytes=host)
        else:
            self.runtime = Runtime.connect(embedded=True, backend=backend, gpu_pool_bytes=gpu, host_pool_bytes=host,
                                           device=device, name=self.name)
        if self.runtime.device.type != ("cpu" if self._meta else self.device.type):
            raise ValueError(f"the runtime keeps pages on {self.runtime.device}, the model runs on {self.device}.")
        wait_env = os.environ.get("MEMBAR_STREAM_WAIT")
        self._gpu_waits = (self.stream_waits if self.stream_waits is not None
                           else wait_env == "1" if wait_env in ("0", "1")
                           else self.runtime.stream_waits_preferred)

    def use_config(self, config) -> None:
        self.selection_pages = config.selection_pages
        if self.block_tokens is None:
            self.block_tokens = config.history_block_tokens
        if self.chunk_tokens is None:
            self.chunk_tokens = config.chunk_tokens
        if self.prefetch_depth is None:
            self.prefetch_depth = config.prefetch_depth

    def _block_pages(self, layout: PageLayout) -> int:
        return -(-self.block_tokens // layout.page_tokens) if self.block_tokens else 0

    def open_sequence(self, layout: PageLayout) -> None:
        if layout.device != self.device:
            raise ValueError(f"this store serves {self.device}, the model runs on {layout.device}.")
        if not layout.fits_in(self._capacity):
            if self.block_tokens is None:
                self.block_tokens = 65536
            if self.prefetch_depth is None:
                self.prefetch_depth = 2
            chunk_pages = -(-self.chunk_tokens // layout.page_tokens) if self.chunk_tokens else 0
            selection = self.selection_pages
            try:
                sizes = store_sizes(layout, self.offload, self._block_pages(layout), self.prefetch_depth,
                                    self.gpu_budget_bytes, self.gpu_resident_layers, chunk_pages, selection)
            except ValueError:
                if not selection:
                    raise
                # A budget given too small for a selection's room still streams selections block by block.
                selection = 0
                sizes = store_sizes(layout, self.offload, self._block_pages(layout), self.prefetch_depth,
                                    self.gpu_budget_bytes, self.gpu_resident_layers, chunk_pages, selection)
            self._selection_room = selection
            self._close_staging()
            for layer_spaces in self.spaces:
                for space in layer_spaces.values():
                    self._free_live(space)
                    space.destroy()
            self.spaces, self.pools, self._live = [], [], {}
            if self.runtime is None or (self._own_runtime and self.socket in (None, "private")
                                        and (sizes[0] > self._sizes[0] or sizes[1] > self._sizes[1])):
                self.runtime = None
                self._connect(*sizes)
                self._sizes = sizes
            page_shape = (layout.page_tokens, layout.num_kv_heads, layout.head_dim)
            for layer in range(layout.num_layers):
                spaces, pools = {}, {}
                for kind, dtype in (("k", layout.dtype), ("v", layout.dtype),
                                    ("dk", layout.grad_dtype), ("dv", layout.grad_dtype)):
                    space = self.runtime.space(f"L{layer:03d}.{kind}", page_shape=page_shape, dtype=dtype,
                                               pages=layout.num_pages)
                    spaces[kind] = space
                    pools[kind] = (torch.empty((layout.num_pages, *page_shape), dtype=dtype, device="meta")
                                   if self._meta else space.pool())
                    self._live[space.id] = torch.zeros(layout.num_pages, dtype=torch.bool)
                self.spaces.append(spaces)
                self.pools.append(pools)
            self._page_numbers = torch.arange(layout.num_pages, dtype=torch.int32, device=self.device)
            self._open_staging(layout, sizes[0])
            self._capacity = layout
        if self._staging is not None:
            self._staging.plan([])   # a sequence without a plan stages on demand
            self._staging.forget()
        self.layout = layout
        self._step_of = {}
        self._own.pages_allocated(layout.num_pages)

    # -- staging rows (Note [Staged history]) -----------------------------------------------------

    def _open_staging(self, layout: PageLayout, gpu_budget: int) -> None:
        block = min(self._block_pages(layout) or layout.num_pages, layout.num_pages)
        if not self.staged or block >= layout.num_pages:
            return   # one block is the whole history: the history's own pages serve as well
        kv, grad = layout.page_bytes(layout.dtype), layout.page_bytes(layout.grad_dtype)
        chunk = min(-(-self.chunk_tokens // layout.page_tokens) if self.chunk_tokens else block, layout.num_pages)
        # What the acquire path still holds at once: a chunk's K and V (write) or dK and dV
        # (chunk_grad); in sparse mode a selection's K, V, dK and dV beside the chunk's dK and dV.
        working = 2 * _FRAME * max(_frames_spanned(chunk, kv, layout.num_pages),
                                   _frames_spanned(chunk, grad, layout.num_pages))
        if self.selection_pages:
            working = (access_bytes(block, self._selection_room, kv, grad, layout.num_pages)
                       + 2 * _FRAME * _frames_spanned(chunk, grad, layout.num_pages))
        slots = (self.prefetch_depth or 2) + 2
        while slots >= 2 and (2 * _space_bytes(slots * block, kv) + 2 * _space_bytes(slots * block, grad)
                              + working > gpu_budget):
            slots -= 1
        if slots < 2:
            return   # a GPU budget this small streams through the history's own pages
        page_shape = (layout.page_tokens, layout.num_kv_heads, layout.head_dim)
        spaces, pools, flat = {}, {}, []
        for kind, dtype in (("k", layout.dtype), ("v", layout.dtype), ("dk", layout.grad_dtype),
                            ("dv", layout.grad_dtype)):
            space = self.runtime.space(f"stage.{kind}", page_shape=page_shape, dtype=dtype, pages=slots * block)
            spaces[kind] = space
            pools[kind] = space.pool()
            flat += [space.id, 0, slots * block]
        # Held for the layout's life: mapped once, never evicted (released in _close_staging).
        ticket = self.runtime._native.acquire_ranges(flat, True, True, -1)
        self.runtime._native.wait(ticket)
        self._staging = _Staging(spaces, pools, slots, block, self.device)
        self._staging_ranges = flat

    def _close_staging(self) -> None:
        staging, self._staging = self._staging, None
        if staging is None:
            return
        native = self.runtime._native
        if self._cuda:
            native.stream_release_ranges(self._staging_ranges, False, torch.cuda.current_stream(self.device).cuda_stream)
        else:
            native.release_ranges(self._staging_ranges, False)
        for space in staging.spaces.values():
            space.destroy()

    def _stageable(self, access: Access) -> bool:
        staging = self._staging
        if staging is None or access.kind not in self._staged_kinds or access.num_pages > staging.block_pages:
            return False
        # A selection's runs, K and V (or dK and dV) each, in one copy_pages call (2048 pairs at most);
        # a backward's K/V and dK/dV views number a selection's pages alike: both staged, or neither.
        if access.selected is None:
            return True
        return "dkv" in self._staged_kinds and len(_runs(list(access.selected))) <= _MAX_COPY_PAIRS // 2

    def _stage_pairs(self, access: Access, slot: int, into_rows: bool) -> list[int]:
        """copy_pages pairs between the access's pages and the slot's rows (into the rows, or back):
        its runs (_page_runs) take the slot's rows in order."""
        staging = self._staging
        flat = []
        for kind in self._stage_kinds(access):
            row = slot * staging.block_pages
            for first, count in self._page_runs(access):
                pages = [self.spaces[access.layer][kind].id, first, count]
                rows = [staging.spaces[kind].id, row, count]
                flat += pages + rows if into_rows else rows + pages
                row += count
        return flat

    def _stage_kinds(self, access: Access) -> tuple[str, str]:
        return ("k", "v") if access.kind == "kv" else ("dk", "dv")

    def _issue_stage(self, access: Access, slot: int) -> int:
        """Copies the access's pages into the slot's rows; returns the ticket."""
        staging = self._staging
        flat = self._stage_pairs(access, slot, into_rows=True)
        started = time.perf_counter_ns()
        # Behind the marker the slot's last reader left at its release, not behind everything the
        # stream holds now (the host runs ahead of the GPU: that would wait for the accesses just
        # before this one and leave the copy no time to hide behind them).
        ticket = self.runtime._native.copy_pages(flat, staging.marker[access.kind][slot])
        self._own.host_ns += time.perf_counter_ns() - started
        if access.kind == "dkv":
            staging.dkv_pending[access.key] = (access.layer, access.first_page, access.first_page + access.num_pages)
        return ticket

    def _ready_to_stage(self, access: Access) -> bool:
        """Whether the access's copies may be issued now: its K/V pages are written, or no earlier
        dK/dV access that is not written back yet overlaps its pages."""
        end = access.first_page + access.num_pages
        if access.kind == "kv":
            return all(bool(self._live[self.spaces[access.layer][kind].id][access.first_page: end].all())
                       for kind in ("k", "v"))
        staging = self._staging
        barrier = staging.barriers.get(access.key)
        if barrier is not None and barrier not in staging.released_unstaged:
            return False
        return not any(layer == access.layer and first < end and access.first_page < last
                       for layer, first, last in staging.dkv_pending.values())

    def _stage_ahead(self) -> None:
        """Issues the copies of the next planned staged accesses while slots of their kind are free."""
        staging = self._staging
        while staging.next < len(staging.order):
            access = staging.order[staging.next]
            if access.key in staging.issued or access.key in staging.held:
                staging.next += 1
                continue
            if not self._ready_to_stage(access):
                return
            taken = staging.take(access)
            if taken is None:
                return
            slot, ticket = taken
            if ticket < 0:
                ticket = self._issue_stage(access, slot)
                staging.filled_with(access, slot, ticket)
            staging.issued[access.key] = (slot, ticket)
            staging.next += 1

    def _staged_view(self, access: Access, history_tokens: int | None):
        """The view of a staged access (its copies issued ahead or now), or None when no slot is free."""
        staging = self._staging
        entry = staging.issued.pop(access.key, None)
        if entry is None:
            taken = staging.take(access)
            if taken is None:
                return None
            slot, ticket = taken
            if ticket < 0:
                ticket = self._issue_stage(access, slot)
                staging.filled_with(access, slot, ticket)
                staging.misses += 1
            else:
                staging.hits += 1
        else:
            slot, ticket = entry
            staging.hits += 1
        staging.held[access.key] = (access.kind, slot)
        count = access.num_pages if access.selected is None else len(access.selected)
        staging.selections += access.selected is not None
        self._own.pages_read += 2 * count   # K and V (or dK and dV) pages
        self._wait_ticket(ticket, f"{access.kind}:{access.phase}")
        rows = staging.slot_rows(slot, count)
        # Whole blocks are one strided tensor (first_row); a selection's pages sit in the slot's
        # first rows in order, and page_map numbers the access's pages into them.
        start = slot * staging.block_pages if access.selected is None else None
        pools = staging.pools
        handles = ("staged", access)
        if access.kind == "kv":
            if access.selected is not None:   # the view holds the selected (whole) pages only
                history_tokens = count * self.layout.page_tokens
            view = HistoryView(pools["k"], pools["v"], rows, history_tokens, handles=handles, first_row=start)
            if access.selected is not None:
                page_map = torch.full((access.num_pages,), -1, dtype=torch.int64)
                page_map[torch.tensor(access.selected, dtype=torch.int64) - access.first_page] = torch.arange(count)
                view.page_map = page_map
            return view
        return GradView(pools["dk"], pools["dv"], rows, handles=handles, first_row=start)

    def _release_staged(self, access: Access) -> None:
        staging = self._staging
        _, slot = staging.held.pop(access.key)
        started = time.perf_counter_ns()
        # The stream's marker after this access's kernels: the slot's next copies wait for it.
        marker = self.runtime._native.stream_mark(torch.cuda.current_stream(self.device).cuda_stream) if self._cuda else 0
        staging.marker[access.kind][slot] = max(staging.marker[access.kind][slot], marker)
        if access.kind == "dkv":
            # The slot's rows back into the layer's dK/dV pages, behind the kernels that wrote them.
            flat = self._stage_pairs(access, slot, into_rows=False)
            for kind in ("dk", "dv"):
                live = self._live[self.spaces[access.layer][kind].id]
                for first, count in self._page_runs(access):
                    live[first: first + count] = True
            ticket = self.runtime._native.copy_pages(flat, marker)
            if not self._cuda:
                self.runtime._native.wait(ticket)
            staging.dkv_pending.pop(access.key, None)
        self._own.host_ns += time.perf_counter_ns() - started
        staging.give(access.kind, slot)
        self._stage_ahead()

    def close_sequence(self) -> None:
        if self.layout is None:
            return
        if self._cuda:
            # The next sequence's writes must not overtake this one's reads in the runtime's copies:
            # its stream-ordered releases already order them; the host waits for nothing here.
            pass
        for layer_spaces in self.spaces:
            for space in layer_spaces.values():
                self._free_live(space)
        if self._own.pages_live["current"] > 0:
            self._own.pages_freed(self._own.pages_live["current"])
        self.layout = None

    def _free_live(self, space) -> None:
        live = self._live.get(space.id)
        if live is None or not bool(live.any()):
            return
        for first, count in _runs(torch.nonzero(live).flatten().tolist()):
            space.free(first, count)
        live.zero_()

    # -- one access = one runtime call ------------------------------------------------------------

    def _ranges(self, layer: int, kinds: tuple[str, str], pages: list[tuple[int, int]]) -> list[int]:
        flat = []
        for kind in kinds:
            space_id = self.spaces[layer][kind].id
            for first, count in pages:
                flat += [space_id, first, count]
        return flat

    def _acquire(self, flat: list[int], *, write: bool, zero: bool, step: int | None, label: str = "") -> None:
        started = time.perf_counter_ns()
        try:
            self._acquire_timed(flat, write=write, zero=zero, step=step, label=label)
        finally:
            self._own.host_ns += time.perf_counter_ns() - started

    def _acquire_timed(self, flat: list[int], *, write: bool, zero: bool, step: int | None, label: str) -> None:
        native = self.runtime._native
        ticket = native.acquire_ranges(flat, write, zero, -1 if step is None else step)
        if write or zero:
            for i in range(0, len(flat), 3):
                self._live[flat[i]][flat[i + 1]: flat[i + 1] + flat[i + 2]] = True
        self._wait_ticket_timed(ticket, label)

    def _wait_ticket(self, ticket: int, label: str) -> None:
        started = time.perf_counter_ns()
        try:
            self._wait_ticket_timed(ticket, label)
        finally:
            self._own.host_ns += time.perf_counter_ns() - started

    def _wait_ticket_timed(self, ticket: int, label: str) -> None:
        native = self.runtime._native
        if self._cuda:
            if native.completed_ticket() < ticket:
                if self._gpu_waits:
                    stream = torch.cuda.current_stream(self.device)
                    if self._time_waits:
                        before, after = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                        before.record(stream)
                    native.stream_wait(ticket, stream.cuda_stream)
                    if self._time_waits:
                        after.record(stream)
                        self._wait_events.append((before, after, label))
                else:   # Note [Runtime pages], Limitations (the runtime counts the wait as stall time)
                    native.wait(ticket)
        else:
            native.wait(ticket)

    def _release(self, flat: list[int], dirty: bool) -> None:
        native = self.runtime._native
        started = time.perf_counter_ns()
        if self._cuda:
            native.stream_release_ranges(flat, dirty, torch.cuda.current_stream(self.device).cuda_stream)
        else:
            native.release_ranges(flat, dirty)
        self._own.host_ns += time.perf_counter_ns() - started

    @staticmethod
    def _page_runs(access: Access) -> list[tuple[int, int]]:
        if access.selected is not None:
            return _runs(list(access.selected))
        return [(access.first_page, access.num_pages)]

    # -- KVStore ------------------------------------------------------------------------------------

    def offloaded(self, layer: int) -> bool:
        return self.offload

    def reads_selected_pages(self, layer: int) -> bool:
        return self.offload

    def holds_in_one_block(self, layer: int, pages: tuple[int, ...], block_pages: int) -> bool:
        # What the GPU budget counts is frames (store_sizes): the pages' frames in the K/V and
        # dK/dV spaces against one access's room (room_frames: a block's frames, or as many
        # scattered pages as a selection names where the budget was sized for them).
        layout = self.layout
        for dtype in (layout.dtype, layout.grad_dtype):
            size = layout.page_bytes(dtype)
            if len(_frames_of(pages, size)) > room_frames(block_pages, self._selection_room, size, layout.num_pages):
                return False
        return True

    def write_chunk(self, layer: int, first_page: int, k: torch.Tensor, v: torch.Tensor) -> None:
        # k, v: [tokens, Hkv, D]
        layout = self.layout
        tokens = k.shape[0]
        pages = -(-tokens // layout.page_tokens)
        if first_page + pages > layout.num_pages:
            raise ValueError(f"chunk pages [{first_page}, {first_page + pages}) lie past the sequence's "
                             f"{layout.num_pages} pages.")
        flat = self._ranges(layer, ("k", "v"), [(first_page, pages)])
        self._acquire(flat, write=True, zero=False, step=None, label="write")
        first_row = first_page * layout.page_tokens
        pools = self.pools[layer]
        if k.device.type != "meta":
            pools["k"].view(-1, layout.num_kv_heads, layout.head_dim)[first_row: first_row + tokens].copy_(k)
            pools["v"].view(-1, layout.num_kv_heads, layout.head_dim)[first_row: first_row + tokens].copy_(v)
        self._release(flat, dirty=True)
        if self._staging is not None:
            self._staging.written(layer, first_page, first_page + pages)

    def _view_rows(self, access: Access) -> torch.Tensor:
        return self._page_numbers[access.first_page: access.first_page + access.num_pages]

    def _count_read(self, flat: list[int]) -> None:
        self._own.pages_read += sum(flat[2::3])

    def history(self, access: Access, history_tokens: int) -> HistoryView:
        if self._stageable(access):
            view = self._staged_view(access, history_tokens)
            if view is not None:
                return view
        flat = self._ranges(access.layer, ("k", "v"), self._page_runs(access))
        self._count_read(flat)
        self._acquire(flat, write=False, zero=False, step=self._step_of.get(access.key),
                      label=f"{access.kind}:{access.phase}")
        pools = self.pools[access.layer]
        return HistoryView(pools["k"], pools["v"], self._view_rows(access), history_tokens,
                           handles=(flat, False), first_row=access.first_page)

    def grad_history(self, access: Access) -> GradView:
        if self._stageable(access):
            view = self._staged_view(access, None)
            if view is not None:
                return view
        flat = self._ranges(access.layer, ("dk", "dv"), self._page_runs(access))
        self._count_read(flat)
        self._acquire(flat, write=True, zero=True, step=self._step_of.get(access.key),
                      label=f"{access.kind}:{access.phase}")
        pools = self.pools[access.layer]
        return GradView(pools["dk"], pools["dv"], self._view_rows(access), handles=(flat, True),
                        first_row=access.first_page)

    def chunk_grads(self, access: Access, tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
        layout = self.layout
        flat = self._ranges(access.layer, ("dk", "dv"), [(access.first_page, access.num_pages)])
        # In sparse mode no later chunk may have selected a page: it then reads as zeros.
        self._acquire(flat, write=False, zero=True, step=self._step_of.get(access.key), label="chunk_grad")
        self._chunk_grad_ranges = flat
        first_row = access.first_page * layout.page_tokens
        pools = self.pools[access.layer]
        rows = slice(first_row, first_row + tokens)
        return (pools["dk"].view(-1, layout.num_kv_heads, layout.head_dim)[rows],
                pools["dv"].view(-1, layout.num_kv_heads, layout.head_dim)[rows])

    def release(self, access: Access, view) -> None:
        if view is None:
            # The chunk's own grad pages (chunk_grads): the kernels reading them are enqueued.
            flat = getattr(self, "_chunk_grad_ranges", None)
            if flat is not None:
                self._chunk_grad_ranges = None
                self._release(flat, dirty=False)
            return
        handles = getattr(view, "handles", None)
        if handles:
            view.handles = None
            if handles[0] == "staged":
                self._release_staged(handles[1])
                return
            flat, dirty = handles
            self._release(flat, dirty)
            if self._staging is not None and access.kind == "dkv":
                self._staging.released_unstaged.add(access.key)
                self._stage_ahead()

    def free_pages(self, first_page: int, num_pages: int) -> None:
        for layer_spaces in self.spaces:
            for space in layer_spaces.values():
                live = self._live[space.id]
                segment = live[first_page: first_page + num_pages]
                if not bool(segment.any()):
                    continue
                for first, count in _runs((torch.nonzero(segment).flatten() + first_page).tolist()):
                    space.free(first, count)
                segment.zero_()
        self._own.pages_freed(num_pages)

    def plan(self, accesses: list[Access]) -> None:
        kinds = {"kv": ("k", "v"), "dkv": ("dk", "dv"), "chunk_grad": ("dk", "dv")}
        if self._staging is not None:   # staged accesses are the store's to prefetch, not the schedule's
            staged, unstaged, barriers, last_unstaged = [], [], {}, {}
            for access in accesses:
                if self._stageable(access):
                    staged.append(access)
                    if access.kind == "dkv" and access.layer in last_unstaged:
                        barriers[access.key] = last_unstaged[access.layer]
                else:
                    unstaged.append(access)
                    if access.kind == "dkv":
                        last_unstaged[access.layer] = access.key
            self._staging.plan(staged, barriers)
            accesses = unstaged
        # Flat (space id, first, count) triples straight to the native call: a 1M-token sparse
        # step's schedule has ~2.7M ranges, and Runtime.set_schedule's tuples cost seconds.
        steps, self._step_of = schedule_steps(
            accesses, lambda access: self._ranges(access.layer, kinds[access.kind], self._page_runs(access)),
            self._chunk_grads_early)
        started = time.perf_counter_ns()
        self.runtime._native.set_schedule(steps)
        self._own.host_ns += time.perf_counter_ns() - started
        if self._staging is not None:
            self._stage_ahead()

    def predict(self, layer: int, pages: list[int]) -> None:
        # Whole frames are what travels: the guess's frames, as page ranges over the K and V spaces
        # (a few runs where the selection is dense in its frames), all in one prefetch_ranges call.
        # A guess with more frames than one access's room is dropped: it would evict what it has
        # to keep.
        if not self.offload or self.runtime is None or self._meta or not pages:
            return
        layout = self.layout
        size = layout.page_bytes(layout.dtype)
        frames = sorted(_frames_of(pages, size))
        block = min(self._block_pages(layout) or layout.num_pages, layout.num_pages)
        if len(frames) > room_frames(block, self._selection_room, size, layout.num_pages):
            return
        started = time.perf_counter_ns()
        pages = []
        for first, count in _runs(frames):
            first_page = first * _FRAME // size
            pages.append((first_page, min(layout.num_pages, -(-(first + count) * _FRAME // size)) - first_page))
        # One call for the K and V ranges (through membard: one round trip).
        self.runtime._native.prefetch_ranges(self._ranges(layer, ("k", "v"), pages))
        self._own.predicted_frames += 2 * len(frames)
        self._own.host_ns += time.perf_counter_ns() - started

    def reserve(self, layout: PageLayout) -> None:
        self.open_sequence(layout)
        self.close_sequence()
        if not self._meta:   # pools pinned before the first step, not during it
            self.runtime.wait_ready(log=lambda line: print(line, flush=True))

    def _collect_stream_waits(self) -> None:
        """Sums the timed GPU-side waits (MEMBAR_TIME_STREAM_WAITS=1) whose events have completed and
        reports them to the runtime as stall time (Runtime.add_stall_ns), so that `membarctl stats`
        and `top` show the stream's waits beside the host's; unfinished ones wait for a later call.
        Each wait is also counted under its access's kind and phase ("kv:backward", "dkv:backward",
        "chunk_grad", "write", ...: StoreStats.stream_wait_by_kind), to show which accesses wait."""
        pending, finished = [], 0
        for before, after, label in self._wait_events:
            if after.query():
                waited = int(before.elapsed_time(after) * 1e6)
                finished += waited
                entry = self._stream_wait_by_kind.setdefault(label, [0, 0, 0])
                entry[0] += waited
                entry[1] += 1
                entry[2] = max(entry[2], waited)
            else:
                pending.append((before, after, label))
        self._wait_events = pending
        if finished:
            self._stream_wait_ns += finished
            self.runtime.add_stall_ns(finished)

    def layout_page_bytes(self) -> int:
        """Bytes of one K/V page of the current (or last) sequence's layout; 0 before any."""
        layout = self._capacity
        return layout.page_bytes(layout.dtype) if layout is not None else 0

    @property
    def stats(self) -> StoreStats:
        """Page traffic as the runtime counts it (this client), plus the store's page bookkeeping."""
        stats = StoreStats(pages_live=self._own.pages_live, pages_read=self._own.pages_read, host_ns=self._own.host_ns,
                           predicted_frames=self._own.predicted_frames)
        if self.runtime is None or self._capacity is None:
            return stats
        self._collect_stream_waits()   # first: they reach the runtime's stall counter with this stats call
        client = self.runtime.stats()["clients"][0]
        layout = self._capacity
        page = layout.page_bytes(layout.dtype)
        stats.bytes_to_device = int(client.get("bytes_host_to_gpu", 0))
        stats.bytes_to_host = int(client.get("bytes_gpu_to_host", 0))
        stats.pages_to_device = stats.bytes_to_device // page
        stats.pages_to_host = stats.bytes_to_host // page
        stats.prefetch_hits = int(client.get("prefetch_hits", 0))
        stats.prefetch_misses = int(client.get("prefetch_misses", 0))
        if self._staging is not None:   # staged accesses: copies issued ahead, or when the access came
            stats.prefetch_hits += self._staging.hits
            stats.prefetch_misses += self._staging.misses
        stats.gpu_maps = int(client.get("gpu_maps", 0))
        stats.fence_waits = int(client.get("fence_waits", 0))
        stats.fence_wait_ns = int(client.get("fence_wait_ns", 0))
        stats.call_ns = {part: int(client.get(f"call_{part}_ns", 0)) for part in _CALL_PARTS}
        _, _, stats.map_runs, stats.map_wait_ns, stats.map_apply_ns, asynchronous = self.runtime._native.map_counters()
        stats.async_maps = bool(asynchronous)
        stats.host_pool_bytes = int(client["host_frames"]["peak"]) * _FRAME
        stats.device_pool_bytes = int(client["gpu_frames"]["peak"]) * _FRAME
        # The runtime's stall time holds the host's waits and the stream waits reported to it.
        stats.stall_ns = max(0, int(client.get("stall_ns", 0)) - self._stream_wait_ns)
        stats.stream_wait_ns = self._stream_wait_ns if self._time_waits else -1
        stats.stream_wait_by_kind = {label: list(entry) for label, entry in self._stream_wait_by_kind.items()}
        return stats
