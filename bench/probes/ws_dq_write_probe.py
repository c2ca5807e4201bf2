"""How the warp-specialised backward should add its dQ (session 36's experiment): fp32 atomics per
element (today) or one bulk reduction (cp.reduce.async.bulk) per staged row, each with the CTAs
starting their item lists at the same item or at different ones ($MEMBAR_WS_DQ_WRITE=bulk,
$MEMBAR_WS_ROTATE=1). Times the default backward (the dK/dV kernel by torch.profiler, the whole
backward by CUDA events) on bench/attention_bench.py's inputs (Qwen2.5-7B heads, bf16, chunk 4096,
pages of 128 shuffled) and compares each variant's dQ, dK and dV with the deterministic backward's.

Usage: PYTHONPATH=bindings/python python3 bench/probes/ws_dq_write_probe.py OUT.json HISTORY...
"""
import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from attention_bench import make_inputs, membar_runner, time_ms  # noqa: E402
from backward_kernels_probe import kernel_times  # noqa: E402

VARIANTS = {"atomics": {}, "atomics_rotate": {"MEMBAR_WS_ROTATE": "1"}, "bulk": {"MEMBAR_WS_DQ_WRITE": "bulk"},
            "bulk_rotate": {"MEMBAR_WS_DQ_WRITE": "bulk", "MEMBAR_WS_ROTATE": "1"},
            "overlap": {"MEMBAR_WS_DQ_WRITE": "overlap"},
            "overlap_rotate": {"MEMBAR_WS_DQ_WRITE": "overlap", "MEMBAR_WS_ROTATE": "1"}}



def flops(history, chunk=4096, heads=28, head_dim=128):
    # The backward's five products over the keys each query sees (history + causal chunk).
    pairs = chunk * history + chunk * (chunk + 1) / 2
    return 5 * 2 * pairs * head_dim * heads


def main() -> int:
    out_path = Path(sys.argv[1])
    results = {"device": torch.cuda.get_device_name(), "histories": {}}
    for history in [int(value) for value in sys.argv[2:]]:
        p = make_inputs(history)
        forward, _, state = membar_runner(p)
        forward()
        _, deterministic, det_state = membar_runner(p, deterministic=True)
        det_state.update(state)
        reference = [t.clone() for t in deterministic()][:1]
        row = {}
        for name, env in VARIANTS.items():
            os.environ.update(env)
            try:
                _, backward, bstate = membar_runner(p)
                bstate.update(state)
                grads = backward()
                dq_error = (grads[0].float() - reference[0].float()).abs().max().item()
                scale = reference[0].float().abs().max().item()
                ms = time_ms(backward)
                kernels = kernel_times(backward)
            finally:
                for key in env:
                    del os.environ[key]
            row[name] = {"ms": ms, "tflops": flops(history) / ms / 1e9, "dq_max_error": dq_error,
                         "dq_max": scale, "kernels": kernels}
            top = ", ".join(f"{k} {v:.2f}" for k, v in kernels.items() if v >= 0.05)
            print(f"{history:>7} {name:<15} {ms:8.2f} ms {row[name]['tflops']:6.1f} TF/s dq err {dq_error:.3g} "
                  f"(max {scale:.3g}): {top}", flush=True)
        results["histories"][str(history)] = row
        del p
        torch.cuda.empty_cache()
    out_path.write_text(json.dumps(results, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
