"""Summarises the membar-train logs of `tools/h200_session.sh cli` (and `share`, `tp`): tokens/s of
steps 2-3, peak GPU memory and the losses of each run (the last --json line of each log), and
membard / embedded per mode.

    python tools/cli_summary.py FOLDER
"""
from __future__ import annotations

import json
import pathlib
import sys


def main(folder: str) -> int:
    rates = {}
    for log in sorted(pathlib.Path(folder).glob("*.log")):
        lines = [line for line in log.read_text().splitlines() if line.startswith("{")]
        if not lines:
            print(f"{log.stem}: no summary (see {log.name})")
            continue
        steps = json.loads(lines[-1])["steps"][1:]
        if not steps:
            print(f"{log.stem}: fewer than 2 steps")
            continue
        rates[log.stem] = sum(step["tokens_per_second"] for step in steps) / len(steps)
        peak = max(step["peak_gpu_bytes"] for step in steps) / 2**30
        losses = " ".join(f"{step['loss']:.4f}" for step in json.loads(lines[-1])["steps"])
        print(f"{log.stem}: {rates[log.stem]:,.0f} tok/s (steps 2-{len(steps) + 1}), peak GPU {peak:.1f} GiB, "
              f"losses {losses}")
    for mode in ("dense", "offload", "sparse", "sparse-offload"):
        if f"membard-{mode}" in rates and f"embedded-{mode}" in rates:
            print(f"{mode}: membard / embedded = {rates[f'membard-{mode}'] / rates[f'embedded-{mode}']:.3f}")
    if "embedded-offload-streamwait" in rates and "embedded-offload" in rates:
        print(f"offload: embedded GPU-side waits / host waits = "
              f"{rates['embedded-offload-streamwait'] / rates['embedded-offload']:.3f}")
    if "private-offload" in rates and "embedded-offload" in rates:
        print(f"offload: private membard / embedded = {rates['private-offload'] / rates['embedded-offload']:.3f}")
    if "embedded-dense-splitbwd" in rates and "embedded-dense" in rates:
        print(f"dense: warpgroup backward / split mma.sync backward = "
              f"{rates['embedded-dense'] / rates['embedded-dense-splitbwd']:.3f}")
    for store in ("embedded", "membard"):
        if f"{store}-offload" in rates and f"{store}-dense" in rates:
            print(f"{store}: offload / dense = {rates[f'{store}-offload'] / rates[f'{store}-dense']:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
