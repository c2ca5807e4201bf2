"""Session 37's experiment: the warp-specialised backward with each item's dQ issued during the next
item after an mbarrier wait for both consumers' dS^T halves ($MEMBAR_WS_DEFER_DQ=1), against the
shipped form (a named barrier of the two consumers every item), so that the consumers need not run
in step. Times the default backward (the dK/dV kernel by torch.profiler, the whole backward by CUDA
events) and the deterministic one on bench/attention_bench.py's inputs (Qwen2.5-7B heads, bf16,
chunk 4096, pages of 128 shuffled), and compares each variant's dQ, dK and dV with the deterministic
backward's.

Usage: PYTHONPATH=bindings/python python3 bench/probes/ws_defer_dq_probe.py OUT.json HISTORY...
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

VARIANTS = {"shipped": {}, "defer": {"MEMBAR_WS_DEFER_DQ": "1"}, "shipped_again": {}}


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
        reference = [t.float().clone() for t in deterministic()][:3]
        row = {"deterministic": {"ms": time_ms(deterministic), "kernels": kernel_times(deterministic)}}
        row["deterministic"]["tflops"] = flops(history) / row["deterministic"]["ms"] / 1e9
        for name, env in VARIANTS.items():
            os.environ.update(env)
            try:
                _, backward, bstate = membar_runner(p)
                bstate.update(state)
                grads = backward()
                errors = [(g.float() - r).abs().max().item() for g, r in zip(grads[:3], reference)]
                scales = [r.abs().max().item() for r in reference]
                ms = time_ms(backward)
                kernels = kernel_times(backward)
            finally:
                for key in env:
                    del os.environ[key]
            row[name] = {"ms": ms, "tflops": flops(history) / ms / 1e9, "max_error_dq_dk_dv": errors,
                         "max_dq_dk_dv": scales, "kernels": kernels}
            top = ", ".join(f"{k} {v:.2f}" for k, v in kernels.items() if v >= 0.05)
            print(f"{history:>7} {name:<14} {ms:8.2f} ms {row[name]['tflops']:6.1f} TF/s err dq/dk/dv "
                  f"{errors[0]:.2g}/{errors[1]:.2g}/{errors[2]:.2g} (max {scales[0]:.2g}/{scales[1]:.2g}/"
                  f"{scales[2]:.2g}): {top}", flush=True)
        det = row["deterministic"]
        print(f"{history:>7} deterministic  {det['ms']:8.2f} ms {det['tflops']:6.1f} TF/s "
              f"({row['shipped']['ms'] / det['ms']:.3f}x the shipped default, "
              f"{row['defer']['ms'] / det['ms']:.3f}x the deferred)", flush=True)
        results["histories"][str(history)] = row
        del p
        torch.cuda.empty_cache()
    out_path.write_text(json.dumps(results, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
