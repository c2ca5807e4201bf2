#!/usr/bin/env python3
"""What data-parallel LoGRA sends per update against data-parallel dense training (issue "A whole
GPU node", item 3): bytes and all-reduce time per update, per model shape.

Data-parallel LoGRA averages each rank's sketches, one d x r fp32 block per targeted matrix, in one
all-reduce of the optimizer's flat sketch buffer (LoGRAOptimizer(process_group=...), whose
StepResult reports the bytes and seconds of each update); dense data-parallel training sums the
d x k gradients of the same matrices (bf16 here, their smallest form). Bytes come from the shapes
(the targeted projections of an HF Qwen2 model built on the meta device, as apply_logra finds them).
Seconds: `--world` ranks on this machine's backend (gloo on CPUs, NCCL with --cuda) all-reduce a
buffer of each size, median of --repeats after one warm-up, for every shape whose gradient buffer
is at most --max-gib (the sketch of every shape is timed).

    python bench/logra_dp_bench.py                          # CPU, gloo, 2 ranks, 0.5b/1.5b/7b/27b
    python bench/logra_dp_bench.py --cuda --world 8         # a node's GPUs, NCCL

Writes logra_dp_bench.json and logra_dp_bench.txt into $MEMBAR_RESULTS_DIR (default
bench/results/latest).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bindings" / "python"))
sys.path.insert(0, str(REPO / "bench"))

RANK = 64
SHAPES = {
    "0.5b": dict(hidden_size=896, num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
                 intermediate_size=4864, vocab_size=151936),
}


def shapes() -> dict:
    from logra_bench import SHAPES as LOGRA_SHAPES

    merged = dict(SHAPES)
    merged.update(LOGRA_SHAPES)
    return merged


def matrix_shapes(shape: dict) -> list[tuple[int, int]]:
    """(out_features, in_features) of every matrix apply_logra targets in a Qwen2 model of `shape`."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from membar.logra.linear import target_linears

    with torch.device("meta"):
        model = Qwen2ForCausalLM(Qwen2Config(**shape))
    return [(linear.out_features, linear.in_features) for *_, linear in target_linears(model)]


def worker(rank: int, world: int, port: int, cuda: bool, sizes: list[tuple[str, str, int]], repeats: int,
           out: str) -> None:
    dist.init_process_group("nccl" if cuda else "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    seconds = {}
    for name, kind, count in sizes:
        dtype = torch.float32 if kind == "sketch" else torch.bfloat16
        buffer = torch.ones(count, dtype=dtype, device=device)
        times = []
        for attempt in range(repeats + 1):
            dist.barrier()
            started = time.perf_counter()
            dist.all_reduce(buffer)
            if cuda:
                torch.cuda.synchronize(device)
            if attempt:   # the first is a warm-up
                times.append(time.perf_counter() - started)
        seconds[f"{name}/{kind}"] = statistics.median(times)
        del buffer
    if rank == 0:
        Path(out).write_text(json.dumps(seconds))
    dist.barrier()
    dist.destroy_process_group()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default="0.5b,1.5b,7b,27b")
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--cuda", action="store_true", help="NCCL over this node's GPUs (one rank per GPU)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--max-gib", type=float, default=1.5,
                        help="time the gradient all-reduce only where the buffer is at most this large")
    args = parser.parse_args()
    known = shapes()
    rows, sizes = [], []
    for name in [s for s in args.shapes.split(",") if s]:
        matrices = matrix_shapes(known[name])
        sketch = sum(out * RANK for out, _ in matrices)            # fp32 elements
        gradient = sum(out * inner for out, inner in matrices)     # bf16 elements
        row = {"shape": name, "rank": RANK, "matrices": len(matrices), "sketch_bytes": 4 * sketch,
               "gradient_bytes": 2 * gradient, "bytes_ratio": (2 * gradient) / (4 * sketch)}
        rows.append(row)
        sizes.append((name, "sketch", sketch))
        if 2 * gradient <= args.max_gib * 2**30:
            sizes.append((name, "gradient", gradient))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    results_dir = Path(os.environ.get("MEMBAR_RESULTS_DIR", REPO / "bench" / "results" / "latest"))
    results_dir.mkdir(parents=True, exist_ok=True)
    seconds_file = results_dir / "logra_dp_bench.seconds.json"
    mp.spawn(worker, args=(args.world, port, args.cuda, sizes, args.repeats, str(seconds_file)), nprocs=args.world)
    seconds = json.loads(seconds_file.read_text())
    seconds_file.unlink()
    for row in rows:
        row["sketch_seconds"] = seconds.get(f"{row['shape']}/sketch")
        row["gradient_seconds"] = seconds.get(f"{row['shape']}/gradient")
    backend = "nccl" if args.cuda else "gloo"
    where = torch.cuda.get_device_name() if args.cuda else f"{os.cpu_count()} CPU cores"
    result = {"benchmark": "data-parallel LoGRA sketches vs dense gradients per update", "backend": backend,
              "world": args.world, "machine": f"{where} ({platform.node()})",
              "commit": os.environ.get("MEMBAR_COMMIT", ""), "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
              "torch": torch.__version__, "rows": rows}
    lines = [f"data-parallel update traffic per rank, LoGRA r={RANK} sketches (fp32) vs dense gradients (bf16) of the "
             f"same matrices; all-reduce over {args.world} ranks, {backend}, {where}",
             f"{'shape':>6} {'matrices':>8} {'sketch':>10} {'gradients':>10} {'ratio':>6} {'sketch s':>9} {'gradient s':>10}"]
    for row in rows:
        grad_s = f"{row['gradient_seconds']:.3f}" if row["gradient_seconds"] is not None else "-"
        lines.append(f"{row['shape']:>6} {row['matrices']:>8} {row['sketch_bytes'] / 2**20:>7.0f} MiB"
                     f" {row['gradient_bytes'] / 2**30:>6.2f} GiB {row['bytes_ratio']:>5.0f}x"
                     f" {row['sketch_seconds']:>9.3f} {grad_s:>10}")
    text = "\n".join(lines) + "\n"
    print(text, end="")
    (results_dir / "logra_dp_bench.json").write_text(json.dumps(result, indent=2) + "\n")
    (results_dir / "logra_dp_bench.txt").write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
