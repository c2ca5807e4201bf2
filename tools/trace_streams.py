"""Where a profiled GPU step spent its time, per CUDA stream, from a torch.profiler Chrome trace:
each stream's busy time (the union of its kernels, copies and memsets), and, for the busiest
stream (the trainer's compute stream), its idle time inside the step and the longest gaps with the
kernel that ran before each. A step that is slower without slower kernels shows it here as idle
time on the compute stream (the bench's "+profile" writes this beside its operator table).

    python tools/trace_streams.py TRACE.json
"""
from __future__ import annotations

import json
import sys

GPU_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")


def _union(intervals: list[tuple[float, float]]) -> tuple[float, list[tuple[float, float]]]:
    """(covered microseconds, the gaps between covered runs) of [start, end) intervals."""
    covered, gaps, current = 0.0, [], None
    for start, end in sorted(intervals):
        if current is None:
            current = [start, end]
        elif start > current[1]:
            covered += current[1] - current[0]
            gaps.append((current[1], start))
            current = [start, end]
        else:
            current[1] = max(current[1], end)
    if current is not None:
        covered += current[1] - current[0]
    return covered, gaps


def summary(trace_path: str, top: int = 8) -> list[str]:
    with open(trace_path) as source:
        trace = json.load(source)
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    streams: dict[object, list[dict]] = {}
    for event in events:
        if event.get("ph") == "X" and event.get("cat") in GPU_CATEGORIES:
            stream = (event.get("args") or {}).get("stream", event.get("tid"))
            streams.setdefault(stream, []).append(event)
    if not streams:
        return ["no GPU events in the trace"]
    lines, busiest = [], None
    for stream, items in sorted(streams.items(), key=lambda item: -sum(e.get("dur", 0) for e in item[1])):
        intervals = [(e["ts"], e["ts"] + e.get("dur", 0)) for e in items]
        covered, gaps = _union(intervals)
        window = max(end for _, end in intervals) - min(start for start, _ in intervals)
        kinds = {category: sum(1 for e in items if e.get("cat") == category) for category in GPU_CATEGORIES}
        lines.append(f"stream {stream}: busy {covered * 1e-6:.2f} s of a {window * 1e-6:.2f} s window "
                     f"({kinds['kernel']} kernels, {kinds['gpu_memcpy']} copies, {kinds['gpu_memset']} memsets)")
        if busiest is None:
            busiest = (stream, sorted(items, key=lambda e: e["ts"]), gaps, window - covered)
    stream, items, gaps, idle = busiest
    ends = [(e["ts"] + e.get("dur", 0), e.get("name", "?")) for e in items]
    lines.append(f"stream {stream} (the busiest) idle {idle * 1e-6:.2f} s in {len(gaps)} gaps; "
                 f"gaps over 1 ms: {sum(b - a for a, b in gaps if b - a > 1000) * 1e-6:.2f} s in "
                 f"{sum(1 for a, b in gaps if b - a > 1000)}")
    for start, end in sorted(gaps, key=lambda gap: gap[0] - gap[1])[:top]:
        lines.append(f"  gap {(end - start) * 1e-3:8.2f} ms after {_ran_before(ends, start)[:90]}")
    return lines


def _ran_before(ends: list[tuple[float, str]], moment: float) -> str:
    """The name of the last event on the stream that ended at or before moment."""
    best, name = None, "?"
    for finish, label in ends:
        if finish <= moment + 1e-3 and (best is None or finish > best):
            best, name = finish, label
    return name


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    print("\n".join(summary(sys.argv[1])))
