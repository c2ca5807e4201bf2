"""The paged attention kernels at one history, for a profiler (Nsight Compute) to read the counters
of: the chosen forward, then the chosen backward, each run a few times on bench/attention_bench.py's
inputs (Qwen2.5-7B heads, bf16, chunk 4096, pages of 128 in shuffled order). It only runs them; the
counters come from the profiler around it, e.g. (tools/h200_session.sh step `ncu`)

    ncu --clock-control none --kernel-name regex:paged_attention_forward --launch-skip 2 --launch-count 1 \
        --section SpeedOfLight --section MemoryWorkloadAnalysis python3 bench/probes/attention_ncu_probe.py 262144

Usage: PYTHONPATH=bindings/python python3 bench/probes/attention_ncu_probe.py HISTORY [FORWARD_LAYOUT]
"""
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from attention_bench import make_inputs, membar_runner  # noqa: E402


def main() -> int:
    history = int(sys.argv[1]) if len(sys.argv) > 1 else 32768
    layout = sys.argv[2] if len(sys.argv) > 2 else ""
    p = make_inputs(history)
    forward, backward, _ = membar_runner(p, forward_layout=layout)
    for _ in range(3):
        forward()
    for _ in range(3):
        backward()
    torch.cuda.synchronize()
    print(f"ran the forward and the backward 3 times each at history {history} (forward layout {layout or 'chosen'})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
