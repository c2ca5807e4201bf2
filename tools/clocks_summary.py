"""Summarises an `nvidia-smi --query-gpu=timestamp,clocks.sm,power.draw,temperature.gpu --format=csv
-lms 200` log (tools/h200_session.sh's clocks_start): the SM clock, power and temperature while the GPU
was busy (power above a third of the log's highest), so that a benchmark's long runs can be told apart
from its short ones when the clock falls under a power limit.

Usage: python3 tools/clocks_summary.py CLOCKS.csv
"""
import csv
import statistics
import sys


def number(text: str) -> float:
    return float(text.strip().split()[0])


def main() -> int:
    with open(sys.argv[1], newline="") as log:
        rows = [row for row in csv.reader(log) if row and not row[0].startswith("timestamp")]
    samples = []
    for row in rows:
        try:
            samples.append((number(row[1]), number(row[2]), number(row[3])))
        except (IndexError, ValueError):
            continue
    if not samples:
        print(f"clocks: no samples in {sys.argv[1]}")
        return 1
    highest_power = max(power for _, power, _ in samples)
    busy = [sample for sample in samples if sample[1] > highest_power / 3]
    clocks = [clock for clock, _, _ in busy]
    print(f"clocks while busy ({len(busy)} of {len(samples)} samples, 200 ms apart): SM clock median "
          f"{statistics.median(clocks):.0f} MHz (min {min(clocks):.0f}, max {max(clocks):.0f}); power median "
          f"{statistics.median(p for _, p, _ in busy):.0f} W (max {highest_power:.0f}); temperature max "
          f"{max(t for _, _, t in busy):.0f} C")
    return 0


if __name__ == "__main__":
    sys.exit(main())
