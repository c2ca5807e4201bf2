#!/usr/bin/env python3
"""Where a step's stream waited for pages: each "+timewaits" row of an oomb_bench.json, its waits
per access kind and phase (stream_wait_by_kind), longest total first, and the host's time inside the
store's runtime calls (store_host_seconds), GPU maps and the host's waits for the trainer's stream
before a remap (fence waits) where the row has them. Rows without timed waits get their host line only.

    tools/waits_summary.py bench/results/.../oomb_bench.json
"""
from __future__ import annotations

import json
import sys


def summary(path: str) -> list[str]:
    lines = []
    for row in json.load(open(path))["results"]:
        waits = row.get("stream_wait_by_kind")
        step = row.get("step_seconds") or 0.0
        host = (f"; the host spent {row['store_host_seconds']:.2f} s in the store's runtime calls"
                if "store_host_seconds" in row else "")
        host += f", {row['gpu_maps']} GPU frames mapped" if "gpu_maps" in row else ""
        if "fence_waits" in row:
            host += (f", {row['fence_waits']} fence waits ({row.get('store_fence_wait_seconds', 0.0):.2f} s)")
        if "bytes_moved_gib" in row:
            host += f", {row['bytes_moved_gib']:.1f} GiB moved"
        if row.get("prefetch_hits") is not None:
            looked = row["prefetch_hits"] + row.get("prefetch_misses", 0)
            host += (f", prefetch hits {row['prefetch_hits'] / looked:.1%} of {looked} frame acquires" if looked else "")
            host += f" ({row['predicted_frames']} frames predicted)" if row.get("predicted_frames") else ""
        calls = row.get("store_call_seconds")
        if calls and any(calls.values()):
            host += (f"; runtime calls: lock wait {calls['lock_wait']:.2f} s, locked {calls['locked']:.2f} s "
                     f"(enqueue {calls['enqueue']:.2f} s), deliver {calls['deliver']:.2f} s")
        if "store_map_apply_seconds" in row:
            where = "a mapping thread" if row.get("async_maps") else "the trainer's thread"
            host += (f"; maps applied on {where} in {row['store_map_apply_seconds']:.2f} s "
                     f"({row.get('map_runs', 0)} runs), calls waited {row.get('store_map_wait_seconds', 0.0):.2f} s for them")
        if not waits:
            if "store_host_seconds" in row and row.get("gpu_maps") is not None and row.get("bytes_moved_gib"):
                lines.append(f"{row['variant']} at {row['tokens']} tokens: {step:.1f} s{host}")
            continue
        lines.append(f"{row['variant']} at {row['tokens']} tokens: {step:.1f} s, the stream waited "
                     f"{row.get('stream_wait_seconds', 0.0):.2f} s{host}")
        for kind, entry in sorted(waits.items(), key=lambda item: -item[1]["seconds"]):
            lines.append(f"  {kind:<16} {entry['seconds']:8.2f} s in {entry['waits']:>7} waits, "
                         f"longest {entry['longest_ms']:.1f} ms")
    return lines


if __name__ == "__main__":
    print("\n".join(summary(sys.argv[1])) if len(sys.argv) > 1 else __doc__)
