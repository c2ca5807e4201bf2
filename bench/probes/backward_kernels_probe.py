"""Where a paged-attention backward's time goes, kernel by kernel: the default backward (dK/dV with dQ
by atomics), the deterministic one (dK/dV without dQ, then the dQ pass of Note [Warp-specialised dQ
pass]) and the deterministic one with the warpgroup dQ pass ($MEMBAR_CUDA_DQ_PASS=warpgroup), each
run a few times under torch.profiler on bench/attention_bench.py's inputs (Qwen2.5-7B heads, bf16,
chunk 4096, pages of 128 in shuffled order). Prints each kernel's mean time per backward and writes
them as JSON.

Usage: PYTHONPATH=bindings/python python3 bench/probes/backward_kernels_probe.py OUT.json HISTORY...
"""
import json
import os
import sys
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from attention_bench import make_inputs, membar_runner  # noqa: E402

RUNS = 3


def kernel_times(backward):
    """Mean milliseconds per backward of each CUDA kernel `backward` launches."""
    backward()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as trace:
        for _ in range(RUNS):
            backward()
        torch.cuda.synchronize()
    times = {}
    for event in trace.key_averages():
        total_us = getattr(event, "device_time_total", None)
        if total_us is None:
            total_us = event.cuda_time_total
        if total_us > 0:
            name = event.key.split("(")[0].split("<")[0].split("::")[-1]
            times[name] = times.get(name, 0.0) + total_us / 1000.0 / RUNS
    return dict(sorted(times.items(), key=lambda item: -item[1]))


def main() -> int:
    out_path = Path(sys.argv[1])
    results = {"device": torch.cuda.get_device_name(), "runs": RUNS, "histories": {}}
    for history in [int(value) for value in sys.argv[2:]]:
        p = make_inputs(history)
        forward, backward, _ = membar_runner(p)
        forward()
        _, deterministic, det_state = membar_runner(p, deterministic=True)
        det_state.update(_forward_state(p))
        row = {"default": kernel_times(backward), "deterministic": kernel_times(deterministic)}
        os.environ["MEMBAR_CUDA_DQ_PASS"] = "warpgroup"
        try:
            row["deterministic_warpgroup_dq"] = kernel_times(deterministic)
        finally:
            del os.environ["MEMBAR_CUDA_DQ_PASS"]
        results["histories"][str(history)] = row
        for mode, times in row.items():
            listed = ", ".join(f"{name} {ms:.2f}" for name, ms in times.items() if ms >= 0.05)
            print(f"{history:>7} {mode:<27} total {sum(times.values()):7.2f} ms: {listed}", flush=True)
        del p, forward, backward, deterministic, det_state
        torch.cuda.empty_cache()
    out_path.write_text(json.dumps(results, indent=1) + "\n")
    return 0


def _forward_state(p):
    """out and lse of the chosen forward on `p` (the backward's inputs)."""
    forward, _, state = membar_runner(p)
    forward()
    return state


if __name__ == "__main__":
    sys.exit(main())
