"""What a long access schedule costs the other clients of one membard (host backend, CPU only).

A 1M-token sparse OOMB step (7B shape: 28 layers, top-64 pages per chunk, 256 chunks) names about
2.7M page ranges in its schedule, ~30 MB on the wire. While one client installs a schedule of that
shape, another client acquires and releases a page in a loop; the bench reports the second
client's latency (p50, p99.9, worst) and the first one's set_schedule time.

    python bench/schedule_stall_bench.py [--membard build/bin/membard] [--seconds 16]

Writes schedule_stall_bench.{json,txt} to $MEMBAR_RESULTS_DIR (default bench/results/latest).
"""
from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bindings" / "python"))


def probe(socket: str, seconds: float) -> None:
    """The other client: acquire + release of one page in a loop; prints its latencies as JSON."""
    from membar.runtime import Runtime

    rt = Runtime.connect(socket=socket, embedded=False, name="probe")
    space = rt.space("x", page_bytes=64 << 10, pages=4)
    latencies = []
    end = time.time() + seconds
    while time.time() < end:
        start = time.perf_counter()
        space.acquire(0, 1, write=True, wait=True)
        space.release(0, 1, dirty=True)
        latencies.append(time.perf_counter() - start)
        time.sleep(0.0005)
    latencies.sort()
    print(json.dumps({"calls": len(latencies), "p50_ms": latencies[len(latencies) // 2] * 1e3,
                      "p999_ms": latencies[int(len(latencies) * 0.999)] * 1e3, "worst_ms": latencies[-1] * 1e3}))


def install(socket: str, chunks: int, layers: int, top_k: int, repeats: int, jumps: int) -> dict:
    """The long-context client: spaces of a sparse step's shape and its schedule, set `repeats` times."""
    from membar.runtime import Runtime

    rt = Runtime.connect(socket=socket, embedded=False, name="long-context")
    pages = 8192
    spaces = [rt.space(f"L{layer:02d}.{kind}", page_bytes=64 << 10, pages=pages)
              for layer in range(layers) for kind in ("k", "v", "dk", "dv")]
    rng = random.Random(0)
    steps = []
    for _ in range(chunks):
        for layer in range(layers):
            for access in range(3):   # forward, backward K/V, backward dK/dV: top-k single pages
                pair = spaces[4 * layer: 4 * layer + 2] if access < 2 else spaces[4 * layer + 2: 4 * layer + 4]
                selected = sorted(rng.sample(range(pages), top_k))
                steps.append([(space.id, page, 1) for space in pair for page in selected])
    seconds = []
    for _ in range(repeats):
        start = time.perf_counter()
        rt.set_schedule(steps)
        seconds.append(time.perf_counter() - start)
    start = time.perf_counter()
    for _ in range(jumps):
        rt.advance(len(steps) - 1)
        rt.advance(0)
    jump_seconds = (time.perf_counter() - start) / max(1, 2 * jumps)
    return {"steps": len(steps), "ranges": sum(len(step) for step in steps), "set_schedule_seconds": seconds,
            "jumps": jumps, "advance_seconds_per_jump": jump_seconds}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--membard", default=str(REPO / "build" / "bin" / "membard"))
    parser.add_argument("--seconds", type=float, default=16.0, help="how long the other client probes")
    parser.add_argument("--chunks", type=int, default=256)
    parser.add_argument("--layers", type=int, default=28)
    parser.add_argument("--top-k", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--jumps", type=int, default=20, help="advance() from the first step to the last and back")
    parser.add_argument("--probe", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.probe:
        probe(args.probe, args.seconds)
        return
    with tempfile.TemporaryDirectory() as folder:
        socket = os.path.join(folder, "membard.sock")
        daemon = subprocess.Popen([args.membard, "--backend", "host", "--socket", socket, "--gpu-pool", "2GiB",
                                   "--host-pool", "2GiB", "--foreground", "--log-level", "warn"])
        try:
            for _ in range(500):
                if os.path.exists(socket):
                    break
                time.sleep(0.02)
            other = subprocess.Popen([sys.executable, __file__, "--probe", socket, "--seconds", str(args.seconds)],
                                     stdout=subprocess.PIPE, text=True)
            time.sleep(0.5)
            result = install(socket, args.chunks, args.layers, args.top_k, args.repeats, args.jumps)
            result["other_client"] = json.loads(other.communicate()[0])
        finally:
            daemon.terminate()
            daemon.wait(timeout=10)
    text = (f"schedule of {result['steps']:,} steps, {result['ranges']:,} ranges, set "
            f"{len(result['set_schedule_seconds'])} times: "
            + ", ".join(f"{s:.2f} s" for s in result["set_schedule_seconds"])
            + f"; advance over the whole schedule {result['advance_seconds_per_jump'] * 1e3:.1f} ms"
            + f"; the other client's acquire+release meanwhile: {result['other_client']['calls']:,} calls, "
            f"p50 {result['other_client']['p50_ms']:.2f} ms, p99.9 {result['other_client']['p999_ms']:.2f} ms, "
            f"worst {result['other_client']['worst_ms']:.1f} ms")
    print(text)
    out = Path(os.environ.get("MEMBAR_RESULTS_DIR", REPO / "bench" / "results" / "latest"))
    out.mkdir(parents=True, exist_ok=True)
    (out / "schedule_stall_bench.json").write_text(json.dumps(result, indent=1) + "\n")
    (out / "schedule_stall_bench.txt").write_text(text + "\n")


if __name__ == "__main__":
    main()
