#!/usr/bin/env python3
"""OOMB benchmark: chunk-recurrent training beside full-sequence training, on one GPU.

    python bench/oomb_bench.py --time-budget 330          # Qwen2.5-7B shape, 32K .. 2M, what fits in 330 s
    python bench/oomb_bench.py --quick                    # Qwen2.5-0.5B shape, 16K .. 64K tokens (minutes)
    python bench/oomb_bench.py --learning                 # recall >= 16K tokens back: OOMB vs short windows
    python bench/oomb_bench.py --parts sweep,learning --time-budget 330 --learning-seconds 240

Configurations (variant, context) run in priority order: context by context (shortest first), and
within a context in the order of --variants. A child process builds the model once and runs the
configurations one after another, printing one JSON line each; the parent enforces a per-config
time limit and the overall budget (killing the child and starting a fresh one for what is left),
and rewrites the results after every line, so whatever finished is kept. Before each
configuration the child estimates its time from the H200 numbers measured so far (this run's,
else bench/results' 7B numbers, scaled by context^1.6 for dense, ^1.1 for sparse) and skips it
when the budget left cannot hold it. A variant that fails (OOM, timeout) skips its longer contexts.
Variants (pages live in membar's runtime: embedded, or the membard named by $MEMBAR_SOCKET):
  full            HF full-sequence training: SDPA, gradient checkpointing, loss in 4K pieces
  dense           OOMB, exact gradients, all pages on the GPU
  dense-offload   OOMB, pages in host memory, streamed per layer in blocks through a GPU budget
                  (--gpu-budget, default a few history blocks)
  dense-hybrid    OOMB, as many layers' pages on the GPU as fit, the rest in host memory
  sparse          OOMB, top-k pages per query tile (selection from stage 1 reused in stage 2)
  sparse-offload  the same with offload
  sparse-hybrid   sparse, as many layers' pages on the GPU as fit, the rest in host memory
Suffixes: "+logra" / "+adamw" add a LoGRA (rank 64, states in the pages' runtime) / dense
AdamW update to the timed step; "+membar" runs dense attention on membar's kernels instead of cuDNN's; "+plain" keeps
the pages in plain PyTorch tensors instead of the runtime (bench/plain_store.py: the baseline
the runtime must match); "+dp" runs the trainer data-parallel in a torch.distributed group of
world size 1 (NCCL on GPUs, gloo on CPUs), against the same variant without it (issue "A whole GPU
node": <= 1% cost); "+streamwait" lets the stream wait on the GPU for enqueued copies instead of
the host waiting (Note [Runtime pages]); "+hostorder" has the embedded engine order its copies on the
host (MEMBAR_DEVICE_ORDER=0: the host waits, as before Note [Device-ordered copies]); "+timewaits" times
the stream's GPU-side waits for pages with CUDA events (MEMBAR_TIME_STREAM_WAITS=1: the "gpu wait"
column); "+depth4" copies pages in 4 accesses ahead (default 2)
and grows the default GPU budget with it; "+piece4096" computes the loss 4096 tokens at a time
(default 512); "+blockwise" streams sparse selections block by block even where their pages fit
one block's room (as before session 12); "+reuse" has stage 2 take stage 1's attention outputs (Note [Stage 1's attention in stage 2]);
"+defersubmit" has the embedded engine hand its device-ordered copies to CUDA on its dispatcher
thread instead of the calling one (MEMBAR_DEFER_SUBMIT=1, Note [Hand-over on the dispatcher] in
engine/batches.cpp); "+nochunkearly" has the runtime's schedule name a chunk's own dK/dV pages only at their own
access (MEMBAR_CHUNK_GRADS_EARLY=0; by default the layer's last dK/dV block names them too, Note
[Chunk grads with the last block] in runtime_store.py); "+nopredict" copies no guessed stage-1 selection ahead (MEMBAR_PREDICT_SELECTIONS=0, Note [Predicted
selections] in hf_attention.py); "+splitbwd" runs membar's attention backward on the split mma.sync
layout (MEMBAR_CUDA_BACKWARD_LAYOUT) instead of the chosen one (the warpgroup one on Hopper);
"+displace8" lets a frame already mapped at a page's position serve it when its
occupant is among the first 8 of MIN's eviction candidates ("+displaceall": any occupant a prefetch may
evict; MEMBAR_DISPLACE_RANK, Note [Eviction order]: fewer GPU map calls for some extra copies); "+streamed" after "+plain" reads the plain tensors'
history in blocks as offloaded pages are read (what the blocks cost without a copy or a wait);
"+asyncmaps" maps frames on a thread of the client library's own (MEMBAR_ASYNC_MAPS=1; "+syncmaps":
=0, the default) instead of the thread that receives the runtime's events (Note [Maps off the
caller's thread] in libclient/memory.cpp); "+copyeach" hands each copy to the driver in a call of its
own (MEMBAR_BATCH_COPIES=0) instead of a batch's copies in one cudaMemcpyBatchAsync call (Note [Copies
handed over in one call] in engine/cuda/cuda_backend.cpp); "+mapruns" maps frames at the next call that
hands pages out, adjacent positions in one run (MEMBAR_DEFER_MAPS=1, Note [Maps in runs] in
libclient/memory.cpp), instead of each as its event arrives; "+copyevents" has the CUDA backend wait for
each batch's CUDA event instead of reading the copy stream's completion word (MEMBAR_COPY_EVENTS=1,
Note [Completion words] in engine/cuda/cuda_backend.cpp);
"+profile" records the timed step with torch.profiler and
writes its busiest operations (self device time, calls) to profile-VARIANT-TOKENS.txt beside the
results (the profiler slows the step: its time is not comparable); "@8K" sets the variant's history block.
Each step is forward + backward of one sequence (no optimizer step, like the full-sequence
baseline), after a short warm-up sequence; OOMB variants recompute layer activations in backward
(like the baseline's gradient checkpointing) unless --no-checkpoint-layers.
Columns: step time, tokens/s, peak GPU memory (PyTorch's allocator plus the runtime's frames), GPU
growth per 10K tokens (against the same variant's previous context), peak host RSS during the
configuration, host page pools, bytes moved, offload overhead (X-offload step time / X step time
- 1 at the same context), the time the stream waited for pages (share of the step), and
throughput against the "+plain" run of the same kernels at the same context.
Results: oomb_bench.json and oomb_bench.txt (sweep), oomb_learning.json (learning) in
$MEMBAR_RESULTS_DIR (default bench/results/latest).
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import selectors
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "bindings" / "python"))

VARIANTS = ["full", "dense", "dense-offload", "sparse", "sparse-offload", "dense-hybrid", "sparse-hybrid"]
K = 1024

# Step seconds measured on the H200 at the Qwen2.5-7B shape (bench/results/2026-11-30-h200*).
KNOWN_7B_SECONDS = {   # measured on the H200 (bench/results/2026-11-30-h200-session3)
    ("full", 32 * K): 5.1, ("full", 64 * K): 13.6, ("full", 128 * K): 41.6,
    ("dense", 32 * K): 6.2, ("dense", 64 * K): 15.9, ("dense", 128 * K): 45.5,
    ("dense-offload", 32 * K): 6.3, ("dense-offload", 64 * K): 16.3, ("dense-offload", 256 * K): 160.1,
    ("sparse", 32 * K): 6.3, ("sparse", 64 * K): 13.2, ("sparse", 256 * K): 56.1, ("sparse", 512 * K): 120.1,
    ("sparse-offload", 256 * K): 118.0,
}
# Seconds each configuration costs beside its timed step and warm-up: trainer, page pools.
CONFIG_OVERHEAD_SECONDS = 6.0
WARMUP_SECONDS = 4.0
MODEL_BUILD_SECONDS = {"qwen2.5-7b": 35.0}


# Variant flags that set an environment variable the runtime reads when it starts (flag, variable, value):
# "+hostorder" orders the embedded engine's copies on the host, as before Note [Device-ordered copies]
# (the trainer waits on the host); "+timewaits" puts CUDA events around each GPU-side wait for pages;
# "+copyeach" hands a batch's copies to the driver one call each (Note [Copies handed over in one
# call]); "+copyevents" sees batches complete through CUDA events (Note [Completion words]); "+mapruns"
# keeps frame events until a call settles and maps adjacent positions as one run (Note [Maps in runs]).
_RUNTIME_SWITCHES = [
    ("+hostorder", "MEMBAR_DEVICE_ORDER", "0"),
    ("+timewaits", "MEMBAR_TIME_STREAM_WAITS", "1"),
    ("+copyeach", "MEMBAR_BATCH_COPIES", "0"),
    ("+copyevents", "MEMBAR_COPY_EVENTS", "1"),
    ("+mapruns", "MEMBAR_DEFER_MAPS", "1"),
    ("+staged", "MEMBAR_STAGED_HISTORY", "1"),   # history blocks copied through staging rows
    ("+kvstaged", "MEMBAR_STAGED_HISTORY", "kv"),   # ... K/V only (dK/dV acquired in place)
    ("+nopredict", "MEMBAR_PREDICT_SELECTIONS", "0"),   # no stage-1 selection guessed ahead (Note [Predicted selections])
    # the embedded engine's batches handed to CUDA by its dispatcher thread (Note [Hand-over on the dispatcher])
    ("+defersubmit", "MEMBAR_DEFER_SUBMIT", "1"),   # (the default since session 28)
    ("+nodefersubmit", "MEMBAR_DEFER_SUBMIT", "0"),   # ... the trainer's thread hands them over
    # a chunk's own dK/dV pages prefetched as their own step only (Note [Chunk grads with the last block] off)
    ("+nochunkearly", "MEMBAR_CHUNK_GRADS_EARLY", "0"),
    # membar's attention backward on the split mma.sync layout instead of the one the kernels choose
    # (on Hopper the warpgroup one, Note [Warpgroup backward]); read at every call
    ("+splitbwd", "MEMBAR_CUDA_BACKWARD_LAYOUT", "w8_k128_split_s2_pad"),
]


def parse_tokens(text: str) -> int:
    text = text.strip().upper()
    scale = {"K": K, "M": K * K}.get(text[-1], 1)
    return int(float(text[:-1] if text[-1] in "KM" else text) * scale)


def _size(text: str) -> int:
    from membar.units import parse_size

    try:
        return parse_size(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def human_tokens(tokens: int) -> str:
    if tokens % (K * K) == 0:
        return f"{tokens // (K * K)}M"
    return f"{tokens // K}K" if tokens % K == 0 else str(tokens)


def base_variant(variant: str) -> str:
    """The variant without its history block and kernel suffixes ("dense-offload@8K" ->
    "dense-offload", "dense+membar" -> "dense")."""
    return variant.split("@")[0].split("+")[0]


def resident_name(variant: str) -> str:
    """The variant that keeps every page on the GPU, with the same kernels ("sparse-offload+membar"
    -> "sparse+membar")."""
    base = base_variant(variant)
    base = base[: -len("-offload")] if base.endswith("-offload") else base
    return base + ("+membar" if "+membar" in variant else "")


def prefetch_depth_of(variant: str) -> int:
    """"+depth4": the store copies pages in 4 accesses ahead, and its default GPU budget grows with
    it (store_sizes); 2 (OOMBConfig's default) otherwise."""
    match = re.search(r"\+depth(\d+)", variant)
    return int(match.group(1)) if match else 2


def loss_piece_tokens_of(variant: str) -> int:
    """"+piece4096": the loss (full-vocabulary logits) is computed 4096 tokens at a time; OOMBConfig's
    default (1024) otherwise."""
    from membar.oomb import OOMBConfig

    match = re.search(r"\+piece(\d+)", variant)
    return int(match.group(1)) if match else OOMBConfig.loss_piece_tokens


LOGRA_RANK = 64


def data_parallel_group(cuda: bool):
    """A torch.distributed group of this process alone ("+dp"), made once per configuration child."""
    import socket

    import torch
    import torch.distributed as dist

    if not dist.is_initialized():
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        kwargs = {"device_id": torch.device("cuda", torch.cuda.current_device())} if cuda else {}
        dist.init_process_group("nccl" if cuda else "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0,
                                world_size=1, **kwargs)
    return dist.group.WORLD


def optimizer_of(variant: str) -> str | None:
    """"+logra" includes a LoGRA (rank 64) update in the timed step, "+adamw" a dense AdamW one;
    otherwise the step is forward + backward only."""
    return "logra" if "+logra" in variant else "adamw" if "+adamw" in variant else None


def dense_kernel_of(variant: str) -> str:
    """"+membar" after a variant runs it with membar's own dense kernels instead of cuDNN's."""
    return "membar" if "+membar" in variant else "auto"


def estimate_seconds(variant: str, tokens: int, model: str, measured: dict) -> float:
    """Expected seconds of one configuration (timed step, warm-up, set-up), from the closest
    shorter measurement of the same variant (this run's first, then the known 7B numbers)."""
    exponent = 1.1 if variant.startswith("sparse") else 1.6
    known = dict(KNOWN_7B_SECONDS) if model == "qwen2.5-7b" else {}
    known.update(measured)
    base = base_variant(variant).replace("-hybrid", "-offload")
    points = [(t, s) for (v, t), s in known.items() if v in (variant, base) and t <= tokens]
    if not points:
        points = [(t, s) for (v, t), s in known.items() if v == base.split("-")[0] and t <= tokens]
    if not points:
        return 0.0   # nothing to go by (other shapes): run it, the per-config limit still applies
    t0, s0 = max(points)
    step = s0 * (tokens / t0) ** exponent
    # The warm-up is a sequence of two chunks: a few seconds at any context.
    return step + min(step, WARMUP_SECONDS) + CONFIG_OVERHEAD_SECONDS


def reset_peak_rss() -> None:
    """Starts a new peak of this process's resident set (Linux: VmHWM is reset by clear_refs 5)."""
    try:
        with open("/proc/self/clear_refs", "w") as refs:
            refs.write("5")
    except OSError:
        pass


# -- configurations (child process) ----------------------------------------------------------------

@contextlib.contextmanager
def profiled(variant: str, tokens: int, cuda: bool):
    """"+profile": torch.profiler around the timed step; its busiest operations by self device
    time (CPU time on a CPU run), with call counts, go to profile-VARIANT-TOKENS.txt."""
    if "+profile" not in variant:
        yield
        return
    from torch.profiler import ProfilerActivity, profile

    # On a GPU the device's own activity only: a long step's CPU operators make a trace too large
    # to export (the table then names kernels and copies).
    activities = [ProfilerActivity.CUDA] if cuda else [ProfilerActivity.CPU]
    with profile(activities=activities) as profiler:
        yield
    key = "self_cuda_time_total" if cuda else "self_cpu_time_total"
    table = profiler.key_averages().table(sort_by=key, row_limit=40, max_name_column_width=60)
    name = f"profile-{variant.replace('+', '_').replace('@', '_')}-{human_tokens(tokens)}.txt"
    out_dir = Path(os.environ.get("MEMBAR_RESULTS_DIR", REPO / "bench" / "results" / "latest"))
    out_dir.mkdir(parents=True, exist_ok=True)
    with open(out_dir / name, "w") as out:
        out.write(f"{variant} at {tokens} tokens, sorted by {key} (the profiler's own overhead included)\n")
        out.write(table)
        if cuda:   # each stream's busy time and the compute stream's idle gaps (tools/trace_streams.py)
            sys.path.insert(0, str(REPO / "tools"))
            import trace_streams

            with tempfile.TemporaryDirectory() as folder:
                trace = os.path.join(folder, "trace.json")
                profiler.export_chrome_trace(trace)
                out.write("\n" + "\n".join(trace_streams.summary(trace)) + "\n")


def run_one(model, spec: dict) -> dict:
    import torch

    from membar.oomb import OOMBConfig, OOMBTrainer, plan_gpu_resident_layers
    from membar.oomb.config import host_available_bytes, selection_pages
    from membar.oomb.baseline import full_sequence_step
    from membar.oomb.runtime_store import plan_in_daemon, streamed_bytes
    from membar.oomb.trainer import host_memory

    tokens, variant = spec["tokens"], spec["variant"]
    device = next(model.parameters()).device
    cuda = device.type == "cuda"
    weights_bytes = torch.cuda.memory_allocated() if cuda else 0
    vocab = model.config.vocab_size
    generator = torch.Generator().manual_seed(0)
    sequence = torch.randint(0, vocab, (1, tokens), generator=generator)   # on the host: OOMB keeps it there
    warmup = sequence[:, : min(tokens, 2 * spec["chunk"])]
    result = {"variant": variant, "tokens": tokens, "model": spec["model"],
              "checkpoint_layers": variant != "full" and spec.get("checkpoint_layers", True)}
    variant = base_variant(variant)
    trainer = None
    if variant == "full":
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        sequence, warmup = sequence.to(device), warmup.to(device)

        def step(ids):
            full_sequence_step(model, ids, loss_piece_tokens=4096, attn_implementation="sdpa")
    else:
        mode = "sparse" if variant.startswith("sparse") else "dense"
        offload = variant.endswith("offload") or variant.endswith("hybrid")
        resident = 0
        if variant.endswith("hybrid"):
            # GPU memory is the whole device less the weights (the step's own allocations come later);
            # through membard it is what the daemon's pools have left (they are allocated already).
            socket = os.environ.get("MEMBAR_SOCKET")
            try:
                if socket and socket != "embedded":
                    selection = selection_pages("sparse" if variant.startswith("sparse") else "dense", spec["top_k"],
                                                spec["chunk"], spec.get("query_tile_tokens") or spec["page_tokens"])
                    plan = plan_in_daemon(socket, device, tokens, model.config, spec["page_tokens"], torch.bfloat16,
                                          torch.float32, spec["history_block_tokens"], selection_pages=selection)[0]
                    result.update(planned_against="membard")
                else:
                    device_bytes = (torch.cuda.mem_get_info()[1] if cuda else host_available_bytes()) - weights_bytes
                    selection = selection_pages("sparse" if variant.startswith("sparse") else "dense", spec["top_k"],
                                                spec["chunk"], spec.get("query_tile_tokens") or spec["page_tokens"])
                    # The reserve is for activations; the streamed history blocks take room beside it.
                    streamed = streamed_bytes(tokens, model.config, spec["page_tokens"], torch.bfloat16, torch.float32,
                                              spec["history_block_tokens"], prefetch_depth_of(result["variant"]),
                                              selection_pages=selection)
                    plan = plan_gpu_resident_layers(tokens, model.config, spec["page_tokens"], torch.bfloat16,
                                                    torch.float32, device_bytes,
                                                    int(spec["gpu_reserve_gib"] * 2**30) + streamed,
                                                    host_available_bytes())
            except ValueError as error:
                result.update(error=str(error))
                return result
            resident = plan.gpu_resident_layers
            result.update(gpu_resident_layers=resident, host_pool_needed_gib=plan.host_bytes / 2**30)
        config = OOMBConfig(chunk_tokens=spec["chunk"], page_tokens=spec["page_tokens"], mode=mode,
                            top_k=spec["top_k"], query_tile_tokens=spec.get("query_tile_tokens") or spec["page_tokens"],
                            offload=offload,
                            gpu_resident_layers=int(resident), loss_piece_tokens=loss_piece_tokens_of(result["variant"]),
                            gpu_budget_bytes=spec.get("gpu_budget_bytes") or None,
                            prefetch_depth=prefetch_depth_of(result["variant"]),
                            checkpoint_layers=spec.get("checkpoint_layers", True),
                            history_block_tokens=spec["history_block_tokens"],
                            reuse_stage1_attention="+reuse" in result["variant"],
                            dense_kernel=dense_kernel_of(result["variant"]))
        result.update(loss_piece_tokens=config.loss_piece_tokens)
        if offload:
            result.update(prefetch_depth=config.prefetch_depth)
        store = None
        if "+plain" in result["variant"]:   # the baseline: pages in plain PyTorch tensors (bench/plain_store.py)
            if offload:
                result.update(error="the plain tensor store keeps every page on the GPU: no offload variant")
                return result
            from plain_store import PlainKVStore

            store = PlainKVStore(device, streamed="+streamed" in result["variant"])
        group = data_parallel_group(cuda) if "+dp" in result["variant"] else None
        # Runtime switches read when the runtime starts: the variant's flag sets the variable, else it goes.
        for _, variable, _ in _RUNTIME_SWITCHES:   # (two switches may set one variable)
            os.environ.pop(variable, None)
        for flag, variable, value in _RUNTIME_SWITCHES:
            if flag in result["variant"]:
                os.environ[variable] = value
        # "+displace8": the engine's displace_rank (Note [Eviction order]): a frame already mapped at a
        # page's position serves it when its occupant is among MIN's first 8 candidates.
        displace = re.search(r"\+displace(\d+|all)", result["variant"])
        if displace:
            os.environ["MEMBAR_DISPLACE_RANK"] = displace.group(1)
        else:
            os.environ.pop("MEMBAR_DISPLACE_RANK", None)
        # "+asyncmaps" / "+syncmaps": frame maps on the client's mapping thread or on the thread that
        # receives the runtime's events (Note [Maps off the caller's thread]; MEMBAR_ASYNC_MAPS, read when
        # the runtime starts).
        if "+asyncmaps" in result["variant"]:
            os.environ["MEMBAR_ASYNC_MAPS"] = "1"
        elif "+syncmaps" in result["variant"]:
            os.environ["MEMBAR_ASYNC_MAPS"] = "0"
        else:
            os.environ.pop("MEMBAR_ASYNC_MAPS", None)
        trainer = OOMBTrainer(model, config, store=store, process_group=group)
        if "+streamwait" in result["variant"]:
            trainer.store.stream_waits = True
        # How many sparse selections were read in one call and how many block by block (Note
        # [Streaming a layer's history] in hf_attention.py), counted where the store answers.
        fits = {True: 0, False: 0}
        holds = trainer.store.holds_in_one_block
        if "+blockwise" in result["variant"]:
            # Sparse selections streamed block by block even where their pages fit one block's room,
            # as before session 12.
            holds = lambda layer, pages, block_pages: False   # noqa: E731

        def counted_holds(layer, pages, block_pages):
            answer = holds(layer, pages, block_pages)
            fits[bool(answer)] += 1
            return answer

        trainer.store.holds_in_one_block = counted_holds
        optimizer_name = optimizer_of(result["variant"])
        if optimizer_name == "logra":   # LoGRA's states share the pages' runtime
            from membar import logra

            trainer.store.extra_bytes = (logra.state_pool_bytes(model, LOGRA_RANK),) * 2
        trainer.reserve(tokens)   # page pools are allocated once, before the timed step
        optimizer = None
        if optimizer_name == "logra":
            handle = logra.apply_logra(model, rank=LOGRA_RANK, seed=1, runtime=trainer.store.runtime)
            optimizer = logra.LoGRAOptimizer(handle, lr=1e-5, offload_moments=offload)
            result.update(trainable_parameters=sum(layer.out_features * layer.rank for layer in handle.layers))
        elif optimizer_name == "adamw":   # dense AdamW on the bf16 parameters (moments in bf16: its smallest form)
            optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=cuda)
            result.update(trainable_parameters=sum(p.numel() for p in model.parameters()))

        def step(ids, partial=None):
            trainer.step(ids, stage2_chunks=partial)
            if optimizer is not None and not partial:
                optimizer.step()
                if optimizer_name == "adamw":
                    optimizer.zero_grad(set_to_none=False)

    step(warmup)
    model.zero_grad(set_to_none=False)
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    reset_peak_rss()
    started = time.perf_counter()
    partial = spec.get("stage2_chunks") if trainer is not None else None
    with profiled(result["variant"], tokens, cuda):
        if partial:
            step(sequence, partial)   # Note [Partial steps] in membar/oomb/trainer.py
        else:
            step(sequence)
        if cuda:
            torch.cuda.synchronize()
    seconds = time.perf_counter() - started
    memory = host_memory()
    result.update(
        step_seconds=seconds, tokens_per_second=tokens / seconds,
        peak_gpu_gib=torch.cuda.max_memory_allocated() / 2**30 if cuda else 0.0,
        peak_gpu_reserved_gib=torch.cuda.max_memory_reserved() / 2**30 if cuda else 0.0,
        host_peak_rss_gib=memory["peak_rss_bytes"] / 2**30, host_rss_gib=memory["rss_bytes"] / 2**30)
    if trainer is not None:
        stats = trainer.stats
        if cuda:   # PyTorch's peak plus the runtime's GPU frames (not in PyTorch's allocator)
            result.update(peak_gpu_total_gib=stats["peak_gpu_bytes_total"] / 2**30)
        result.update(stall_seconds=stats["stall_seconds"], store_host_seconds=stats["store_host_seconds"],
                      gpu_maps=stats["gpu_maps"], fence_waits=stats["fence_waits"],
                      store_fence_wait_seconds=stats["store_fence_wait_seconds"],
                      store_call_seconds=stats["store_call_seconds"],
                      store_map_apply_seconds=stats.get("store_map_apply_seconds", 0.0),
                      store_map_wait_seconds=stats.get("store_map_wait_seconds", 0.0),
                      map_runs=stats.get("map_runs", 0), async_maps=stats.get("async_maps", False))
        if "stream_wait_seconds" in stats:   # "+timewaits": the stream's GPU-side waits, timed
            result.update(stream_wait_seconds=stats["stream_wait_seconds"],
                          stream_wait_by_kind=stats.get("stream_wait_by_kind", {}))
        result.update(pages_moved=stats["pages_moved"], bytes_moved_gib=stats["bytes_moved"] / 2**30,
                      host_pool_gib=stats["host_pool_bytes"] / 2**30,
                      device_pool_gib=stats["device_pool_bytes"] / 2**30,
                      prefetch_hits=stats["prefetch_hits"], prefetch_misses=stats["prefetch_misses"],
                      predicted_frames=stats.get("predicted_frames", 0),
                      stage1_seconds=stats["stage1_seconds"], stage2_seconds=stats["stage2_seconds"],
                      **{key: stats[key] for key in ("partial_step", "stage2_chunks_run", "stage2_chunks_total",
                                                     "stage2_to_stage1_ratio", "estimated_step_seconds",
                                                     "step_seconds_upper_bound") if key in stats},
                      selections_in_one_call=fits[True], selections_streamed=fits[False],
                      history_block_tokens=spec["history_block_tokens"], dense_kernel=config.dense_kernel,
                      query_tile_tokens=config.query_tile_tokens)
    return result


def child_main(job: dict) -> None:
    """Runs job["specs"] in order with one model, printing one JSON line per configuration."""
    import gc

    import torch

    from membar.oomb.presets import build_model

    deadline = job["deadline"]
    longest = max(spec["tokens"] for spec in job["specs"])
    device = torch.device(job.get("device", "cuda"))
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model = build_model(job["model"], dtype=dtype, device=device, max_positions=longest, seed=0)
    model.train()
    measured = {tuple(key): value for key, value in job.get("measured", [])}
    failed = set(job.get("failed", []))
    for spec in job["specs"]:
        variant, tokens = spec["variant"], spec["tokens"]
        if variant in failed:
            result = dict(spec, skipped=f"{variant} already failed at a shorter context")
        else:
            expected = estimate_seconds(variant, tokens, job["model"], measured)
            if spec.get("stage2_chunks") and variant != "full":
                # Stage 1 is about a quarter of a step; the longest-history stage-2 chunks cost about
                # twice a stage-2 chunk's mean (Note [Partial steps]).
                chunks = -(-tokens // spec["chunk"])
                expected *= min(1.0, 0.25 + 1.5 * spec["stage2_chunks"] / chunks)
            left = deadline - time.time()
            if expected > left:
                result = dict(spec, skipped=f"estimated {expected:.0f} s, {max(left, 0):.0f} s of the budget left")
            else:
                try:
                    result = run_one(model, spec)
                    if optimizer_of(variant) == "logra":   # LoGRA replaced the model's projections
                        del model
                        gc.collect()
                        model = build_model(job["model"], dtype=dtype, device=device, max_positions=longest, seed=0)
                        model.train()
                    if "step_seconds" in result:
                        measured[(variant, tokens)] = result["step_seconds"]
                except Exception as error:   # an OOM ends this configuration, not the run
                    import traceback

                    traceback.print_exc()
                    oom = isinstance(error, torch.OutOfMemoryError) or "out of memory" in str(error).lower()
                    result = dict(spec, oom=oom, error=f"{type(error).__name__}: {error}"[:300])
                if result.get("error") or result.get("oom"):
                    failed.add(variant)
                model.zero_grad(set_to_none=True)
                model.gradient_checkpointing_disable()
                gc.collect()
                if device.type == "cuda":
                    torch.cuda.empty_cache()
                if device.type == "cuda" and hasattr(torch._C, "_host_emptyCache"):
                    torch._C._host_emptyCache()   # give the page pools' pinned memory back
        print(json.dumps({"result": result}), flush=True)
    print(json.dumps({"done": True}), flush=True)


# -- the sweep (parent process) ---------------------------------------------------------------------

def run_sweep(args, write) -> list[dict]:
    specs = [dict(variant=variant, tokens=tokens, model=args.model, chunk=args.chunk, page_tokens=args.page_tokens,
                  top_k=args.top_k, gpu_reserve_gib=args.gpu_reserve_gib, gpu_budget_bytes=args.gpu_budget,
                  query_tile_tokens=args.query_tile or args.page_tokens, stage2_chunks=args.stage2_chunks,
                  checkpoint_layers=not args.no_checkpoint_layers,
                  history_block_tokens=(parse_tokens(variant.split("@")[1]) if "@" in variant
                                        else args.history_block_tokens))
             for tokens in args.contexts for variant in args.variants
             if tokens in args.variant_contexts.get(variant, [tokens])]
    started = time.time()
    deadline = started + args.time_budget if args.time_budget else started + 10**9
    results: list[dict] = []
    pending = list(specs)
    while pending:
        measured = [[[r["variant"], r["tokens"]], r["step_seconds"]] for r in results if "step_seconds" in r]
        failed = sorted({r["variant"] for r in results if r.get("error") or r.get("oom") or r.get("timeout")})
        startup = MODEL_BUILD_SECONDS.get(args.model, 15.0)
        if time.time() + startup > deadline:
            for spec in pending:
                results.append(dict(spec, skipped="no budget left to start a process"))
                print(format_row(results[-1]), flush=True)
            break
        job = {"specs": pending, "deadline": deadline, "model": args.model, "measured": measured, "failed": failed,
               "device": args.device}
        child = subprocess.Popen([sys.executable, __file__, "--child", json.dumps(job)], stdout=subprocess.PIPE,
                                 stderr=subprocess.PIPE, cwd=REPO)
        stderr_tail: list[str] = []
        selector = selectors.DefaultSelector()
        selector.register(child.stdout, selectors.EVENT_READ, "out")
        selector.register(child.stderr, selectors.EVENT_READ, "err")
        partial = {"out": b"", "err": b""}
        last_progress = time.time()
        first_line = True
        killed = None
        done = False
        while not done and selector.get_map():
            limit = args.time_limit + (startup if first_line else 0)
            now = time.time()
            if now - last_progress > limit:
                killed = f"over the {args.time_limit} s limit per configuration"
            elif now > deadline + 30:
                killed = "over the time budget"
            if killed:
                child.kill()
                break
            for key, _ in selector.select(timeout=1.0):
                # Raw reads split into lines here: a buffered readline could hold a finished line
                # back while select() waits for more bytes.
                data = os.read(key.fileobj.fileno(), 1 << 16)
                if not data:
                    selector.unregister(key.fileobj)
                    continue
                *lines, partial[key.data] = (partial[key.data] + data).split(b"\n")
                for raw in lines:
                    line = raw.decode(errors="replace")
                    if key.data == "err":
                        stderr_tail = (stderr_tail + [line.rstrip()])[-5:]
                        if line.startswith("[oomb] "):   # MEMBAR_PROGRESS_SECONDS: how far a long step got
                            print(line.rstrip(), file=sys.stderr, flush=True)
                        continue
                    if not line.startswith("{"):
                        continue
                    message = json.loads(line)
                    if message.get("done"):
                        done = True
                        continue
                    result = message["result"]
                    result["wall_seconds"] = time.time() - last_progress
                    last_progress = time.time()
                    first_line = False
                    pending.pop(0)
                    results.append(result)
                    write(results)
                    print(format_row(annotate(results)[-1]), flush=True)
        child.wait()
        if pending and not done:
            # The configuration in flight ended the process (timeout, budget, crash): record it.
            spec = pending.pop(0)
            if killed:
                progress = [line for line in stderr_tail if line.startswith("[oomb] ")]
                result = dict(spec, timeout=True, error=killed + (f" ({progress[-1][7:]})" if progress else ""))
            else:
                text = " | ".join(stderr_tail)
                result = dict(spec, oom="out of memory" in text.lower(), error=text[-300:] or f"exit {child.returncode}")
            results.append(result)
            write(results)
            print(format_row(annotate(results)[-1]), flush=True)
    return results


def annotate(results: list[dict]) -> list[dict]:
    """Adds growth per 10K tokens (against the variant's previous context) and offload overhead."""
    ok = {(r["variant"], r["tokens"]): r for r in results if "step_seconds" in r and not r.get("partial_step")}
    for r in results:
        if "step_seconds" not in r or r.get("partial_step"):
            continue
        earlier = [t for (v, t) in ok if v == r["variant"] and t < r["tokens"]]
        if earlier:
            previous = ok[(r["variant"], max(earlier))]
            peak, previous_peak = (r.get("peak_gpu_total_gib", r["peak_gpu_gib"]),
                                   previous.get("peak_gpu_total_gib", previous["peak_gpu_gib"]))
            r["gpu_growth_mib_per_10k"] = (peak - previous_peak) * 1024 / ((r["tokens"] - previous["tokens"]) / 1e4)
        if base_variant(r["variant"]).endswith("-offload"):
            resident = ok.get((resident_name(r["variant"]), r["tokens"]))
            if resident:
                r["offload_overhead"] = r["step_seconds"] / resident["step_seconds"] - 1
        # Throughput against the plain-tensor baseline of the same kernels, pages on the GPU.
        plain = ok.get((resident_name(r["variant"]) + "+plain", r["tokens"]))
        if plain and ("+plain" not in r["variant"] or "+streamed" in r["variant"] or "+reuse" in r["variant"]):
            r["vs_plain"] = plain["step_seconds"] / r["step_seconds"]
        single = ok.get((r["variant"].replace("+dp", ""), r["tokens"]))
        if "+dp" in r["variant"] and single:   # data parallel at world size 1 against one process
            r["vs_single_process"] = single["step_seconds"] / r["step_seconds"]
    return results


def format_row(r: dict) -> str:
    head = f"{r['variant']:<18} {human_tokens(r['tokens']):>5}"
    if r.get("skipped"):
        return f"{head}  skipped: {r['skipped']}"
    if r.get("oom"):
        return f"{head}  OOM  ({r.get('error', '')[:120]})"
    if r.get("error"):
        return f"{head}  -- {r['error']}"
    growth = r.get("gpu_growth_mib_per_10k")
    overhead = r.get("offload_overhead")
    if r.get("partial_step"):
        return (f"{head}  partial: stage 1 {r['stage1_seconds']:.1f} s + {r['stage2_chunks_run']} of "
                f"{r['stage2_chunks_total']} stage-2 chunks {r['stage2_seconds']:.1f} s; whole step ~"
                f"{r['estimated_step_seconds']:.0f} s (<= {r['step_seconds_upper_bound']:.0f} s)  "
                f"GPU {r['peak_gpu_gib']:6.1f} GiB  host {r['host_peak_rss_gib']:6.1f} GiB"
                + (f"  pools {r['host_pool_gib']:6.1f} GiB" if "host_pool_gib" in r else ""))
    gpu = r.get("peak_gpu_total_gib", r["peak_gpu_gib"])
    return (f"{head}  {r['step_seconds']:8.1f} s  {r['tokens_per_second']:8,.0f} tok/s  "
            f"GPU {gpu:6.1f} GiB  "
            + (f"{growth:+8.1f}" if growth is not None else f"{'':>8}") + " MiB/10K  "
            f"host {r['host_peak_rss_gib']:6.1f} GiB"
            + (f"  pools {r['host_pool_gib']:6.1f} GiB  moved {r['bytes_moved_gib']:7.1f} GiB"
               if "bytes_moved_gib" in r else "")
            + (f"  overhead {overhead:+.1%}" if overhead is not None else "")
            + (f"  stall {r['stall_seconds'] / r['step_seconds']:.2%}" if "stall_seconds" in r else "")
            + (f"  gpu wait {r['stream_wait_seconds'] / r['step_seconds']:.2%}" if "stream_wait_seconds" in r else "")
            + (f"  {r['vs_plain']:.3f}x plain" if "vs_plain" in r else "")
            + (f"  {r['vs_single_process']:.3f}x one process" if "vs_single_process" in r else ""))


def summarise(results: list[dict]) -> dict:
    """The issue's goals, where the measured points allow checking them."""
    ok = {(r["variant"], r["tokens"]): r for r in results if "step_seconds" in r and not r.get("partial_step")}
    goals = {}
    partial = [r for r in results if r.get("partial_step") and base_variant(r["variant"]).startswith("dense")]
    if partial:
        longest = max(partial, key=lambda r: r["tokens"])
        goals["longest_dense_tokens_partial_step"] = longest["tokens"]
        goals["longest_dense_partial_step"] = {key: longest.get(key) for key in (
            "variant", "peak_gpu_gib", "host_peak_rss_gib", "stage1_seconds", "stage2_chunks_run",
            "stage2_chunks_total", "estimated_step_seconds", "step_seconds_upper_bound")}
    for variant in sorted({v for (v, _) in ok if base_variant(v).endswith("-offload")}):
        points = sorted((t, r.get("peak_gpu_total_gib", r["peak_gpu_gib"])) for (v, t), r in ok.items() if v == variant)
        if len(points) >= 2:
            # Below history_block_tokens a layer's history still arrives whole, so the goal is read
            # between the two longest contexts (the first-to-last figure is kept beside it).
            name = variant.replace("-", "_").replace("@", "_block_")
            (t0, g0), (t1, g1) = points[-2], points[-1]
            goals[f"gpu_mib_per_10k_tokens_{name}"] = (g1 - g0) * 1024 / ((t1 - t0) / 1e4)
            goals[f"gpu_growth_tokens_{name}"] = [t0, t1]
            (t0, g0) = points[0]
            goals[f"gpu_mib_per_10k_tokens_{name}_from_{human_tokens(t0)}"] = (g1 - g0) * 1024 / ((t1 - t0) / 1e4)
    longest = max([t for (v, t) in ok if v.startswith("dense")], default=0)
    goals["longest_dense_tokens"] = longest
    goals["longest_tokens_by_variant"] = {v: max(t for (w, t) in ok if w == v) for v in sorted({v for (v, _) in ok})}
    k128 = 128 * K
    for dense in ("dense", "dense+membar"):
        if (dense, k128) in ok and ("full", k128) in ok:
            name = "dense_vs_full_step_time_128k" + ("_membar_kernels" if "+membar" in dense else "")
            goals[name] = ok[(dense, k128)]["step_seconds"] / ok[("full", k128)]["step_seconds"]
    for variant in sorted({v for (v, _) in ok if base_variant(v) == "dense-offload"}):
        resident = "dense" + ("+membar" if "+membar" in variant else "")
        both = sorted(t for (v, t) in ok if v == resident and (variant, t) in ok)
        if both:
            goals[f"offload_overhead{variant[len('dense-offload'):]}"] = {
                human_tokens(t): ok[(variant, t)]["step_seconds"] / ok[(resident, t)]["step_seconds"] - 1
                for t in both}
    ratios = {f"{v}@{human_tokens(t)}": r["vs_plain"] for (v, t), r in sorted(ok.items()) if "vs_plain" in r}
    if ratios:   # throughput through the runtime / through plain tensors (issue 11: >= 0.98)
        goals["runtime_vs_plain_tensors"] = ratios
    single = {f"{v}@{human_tokens(t)}": r["vs_single_process"] for (v, t), r in sorted(ok.items())
              if "vs_single_process" in r}
    if single:   # data parallel with world size 1 / one process (issue "A whole GPU node": >= 0.99)
        goals["data_parallel_world1_vs_single_process"] = single
    stalls = {f"{v}@{human_tokens(t)}": r["stall_seconds"] / r["step_seconds"] for (v, t), r in sorted(ok.items())
              if "stall_seconds" in r and "+plain" not in v}
    if stalls:
        goals["stall_fraction"] = stalls
    waits = {f"{v}@{human_tokens(t)}": r["stream_wait_seconds"] / r["step_seconds"] for (v, t), r in sorted(ok.items())
             if "stream_wait_seconds" in r}
    if waits:
        goals["stream_wait_fraction"] = waits
    for t in sorted({t for (v, t) in ok}, reverse=True):
        dense = [v for (v, u) in ok if u == t and base_variant(v) in ("dense", "dense-offload")]
        sparse = [v for (v, u) in ok if u == t and base_variant(v) in ("sparse", "sparse-offload")]
        if dense and sparse:
            fastest_dense = min(dense, key=lambda v: ok[(v, t)]["step_seconds"])
            fastest_sparse = min(sparse, key=lambda v: ok[(v, t)]["step_seconds"])
            goals["sparse_speedup"] = ok[(fastest_dense, t)]["step_seconds"] / ok[(fastest_sparse, t)]["step_seconds"]
            goals["sparse_speedup_tokens"] = t
            goals["sparse_speedup_variants"] = [fastest_sparse, fastest_dense]
            break
    return goals


# -- learning experiment ----------------------------------------------------------------------------

def run_learning(args) -> dict:
    """Recall a key >= 16K tokens back (membar.oomb.learning.recall_experiment, what `membar-train
    --demo` runs on a GPU): a small model trained from scratch with OOMB on whole sequences, against
    the same model trained on the last --short-window tokens only. Both get the same steps; the OOMB
    run ends early once held-out accuracy reaches --learning-target."""
    from membar.oomb.learning import recall_experiment

    return recall_experiment(args.learning_seconds, distance=args.learning_distance, batch=args.learning_batch,
                             lr=args.learning_lr, chunk=args.learning_chunk, mode=args.learning_mode,
                             eval_sequences=args.eval_sequences, eval_seconds=args.learning_eval_seconds,
                             target=args.learning_target, short_window=args.short_window,
                             log=lambda line: print(line, flush=True))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--parts", default="sweep", help="comma list of: sweep, learning")
    parser.add_argument("--quick", action="store_true", help="0.5B shape at 16K..64K")
    parser.add_argument("--model", default=None)
    parser.add_argument("--contexts", default=None, help="comma list, e.g. 32K,64K,1M")
    parser.add_argument("--variants", default="full,dense,dense-offload,sparse,sparse-offload",
                        help=f"comma list in priority order within a context, of {','.join(VARIANTS)}; "
                             "VARIANT@TOKENS sets that variant's history block (e.g. dense-offload@8K); "
                             "VARIANT:CTX/CTX runs it at those contexts only (e.g. sparse-offload:128K/256K)")
    parser.add_argument("--device", default="cuda", help="cuda (the benchmark) or cpu (a smoke test of the harness)")
    parser.add_argument("--chunk", type=int, default=4096)
    parser.add_argument("--page-tokens", type=int, default=128)
    parser.add_argument("--top-k", type=int, default=64)
    parser.add_argument("--stage2-chunks", type=int, default=0,
                        help="measure partial steps: all of stage 1, then only this many stage-2 chunks (the "
                             "longest histories); reports the whole step's estimate and upper bound")
    parser.add_argument("--query-tile", type=int, default=0,
                        help="sparse: queries that share one selection (default: a page's worth; the chunk "
                             "size gives one selection per chunk, so offload moves only top-k pages)")
    parser.add_argument("--history-block-tokens", type=int, default=65536,
                        help="offloaded layers stream their history through the GPU in blocks of this many tokens")
    parser.add_argument("--gpu-budget", type=_size, default=0,
                        help="offload variants: the runtime's GPU budget for pages (e.g. 2GiB; default: a few "
                             "history blocks, plus the planned layers for dense-hybrid)")
    parser.add_argument("--gpu-reserve-gib", type=float, default=30.0,
                        help="dense-hybrid: GPU memory kept free for activations beside the pages")
    parser.add_argument("--time-budget", type=float, default=0.0,
                        help="seconds for the whole sweep (0: no budget); configurations that would not fit are skipped")
    parser.add_argument("--time-limit", type=int, default=900, help="seconds per configuration")
    parser.add_argument("--no-checkpoint-layers", action="store_true",
                        help="OOMB variants keep each chunk's layer activations (default: recompute them in "
                             "backward, like the full-sequence baseline's gradient checkpointing)")
    parser.add_argument("--total-seconds", type=float, default=0.0,
                        help="the whole invocation's limit: the learning part trains only for what is left of it")
    parser.add_argument("--learning", action="store_true", help="run only the learning experiment (--parts learning)")
    parser.add_argument("--learning-seconds", type=float, default=225.0,
                        help="training seconds of the learning experiment (OOMB run 72%%, control 22%%)")
    parser.add_argument("--learning-distance", type=int, default=16384)
    parser.add_argument("--learning-chunk", type=int, default=4096,
                        help="chunk tokens of the learning run (fewer chunks: more steps per second)")
    parser.add_argument("--learning-batch", type=int, default=4)
    parser.add_argument("--learning-lr", type=float, default=1e-2)
    parser.add_argument("--learning-mode", choices=["dense", "sparse"], default="dense")
    parser.add_argument("--learning-target", type=float, default=0.97,
                        help="the OOMB run stops once held-out accuracy (32 sequences) reaches this")
    parser.add_argument("--learning-eval-seconds", type=float, default=20.0)
    parser.add_argument("--short-window", type=int, default=4096)
    parser.add_argument("--eval-sequences", type=int, default=64)
    args = parser.parse_args()
    invocation_started = time.time()

    if args.child:
        child_main(json.loads(args.child))
        return 0

    out = Path(os.environ.get("MEMBAR_RESULTS_DIR", REPO / "bench" / "results" / "latest"))
    out.mkdir(parents=True, exist_ok=True)
    parts = {"learning"} if args.learning else {p.strip() for p in args.parts.split(",") if p.strip()}
    unknown_parts = parts - {"sweep", "learning"}
    if unknown_parts:
        parser.error(f"unknown parts {sorted(unknown_parts)}; known: sweep, learning")

    if "sweep" in parts:
        args.model = args.model or ("qwen2.5-0.5b" if args.quick else "qwen2.5-7b")
        contexts = args.contexts or ("16K,32K,64K" if args.quick else "32K,64K,128K,256K,512K,1M,2M")
        args.contexts = [parse_tokens(c) for c in contexts.split(",")]
        # VARIANT:CTX/CTX limits a variant to those contexts (added to the sweep's contexts).
        args.variant_contexts = {}
        variants = []
        for entry in (v for v in args.variants.split(",") if v):
            name, _, only = entry.partition(":")
            variants.append(name)
            if only:
                args.variant_contexts[name] = [parse_tokens(c) for c in only.split("/")]
                args.contexts = sorted(set(args.contexts) | set(args.variant_contexts[name]))
        args.variants = variants
        unknown = {base_variant(v) for v in args.variants} - set(VARIANTS)
        if unknown:
            parser.error(f"unknown variants {sorted(unknown)}; known: {VARIANTS}")
        if args.quick and args.time_limit == 900:
            args.time_limit = 300
        header = [f"OOMB benchmark, {args.model} shape (random init, {'bf16' if args.device == 'cuda' else 'fp32'} on {args.device}), chunk {args.chunk}, pages of "
                  f"{args.page_tokens}, sparse top-{args.top_k}, offloaded history in blocks of "
                  f"{args.history_block_tokens} tokens, layer recompute "
                  f"{'off' if args.no_checkpoint_layers else 'on'}"
                  + (f", time budget {args.time_budget:.0f} s" if args.time_budget else "")]

        def write(results):
            annotate(results)
            report = {"model": args.model, "chunk": args.chunk, "page_tokens": args.page_tokens, "top_k": args.top_k,
                      "query_tile_tokens": args.query_tile or args.page_tokens,
                      "history_block_tokens": args.history_block_tokens, "time_budget": args.time_budget,
                      "results": results, "goals": summarise(results)}
            (out / "oomb_bench.json").write_text(json.dumps(report, indent=1))
            table = header + [format_row(r) for r in results] + ["", "goals: " + json.dumps(report["goals"])]
            (out / "oomb_bench.txt").write_text("\n".join(table) + "\n")

        print(header[0], flush=True)
        results = run_sweep(args, write)
        write(results)
        print("goals: " + json.dumps(summarise(results)), flush=True)
    if "learning" in parts:
        if args.total_seconds:
            # Training gets what the invocation has left, less ~30 s for set-up, evaluation and the
            # control; too little left and the experiment is not started at all.
            left = args.total_seconds - (time.time() - invocation_started) - 30.0
            if left < 20.0:
                print(f"learning: skipped, {max(left, 0):.0f} s of --total-seconds left for training", flush=True)
                (out / "oomb_learning.json").write_text(json.dumps({"skipped": "no time left"}, indent=1))
                return 0
            args.learning_seconds = min(args.learning_seconds, left)
        outcome = run_learning(args)
        (out / "oomb_learning.json").write_text(json.dumps(outcome, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
