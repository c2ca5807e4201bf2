"""Which torch SDPA backend is fastest at the Qwen2.5-7B attention shape, and which one does
the full-sequence HF baseline actually run?  (28 q heads, 4 KV heads, D=128, bf16.)

Prints one JSON line per measurement. FLOPs: 4*Sq*Sk*D*Hq (forward, halved when causal),
backward 2.5x forward, as in bench/attention_bench.py.
"""
import contextlib
import json
import sys
import time

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

HQ, HKV, D = 28, 4, 128
dev = "cuda"


def timed(fn, reps):
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / reps / 1e3


def case(name, sq, sk, causal, backend, gqa, reps=3):
    q = torch.randn(1, HQ, sq, D, device=dev, dtype=torch.bfloat16, requires_grad=True)
    kv_heads = HKV if gqa else HQ
    k = torch.randn(1, kv_heads, sk, D, device=dev, dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn(1, kv_heads, sk, D, device=dev, dtype=torch.bfloat16, requires_grad=True)
    flops = 4.0 * sq * sk * D * HQ * (0.5 if causal else 1.0)
    out = {"case": name, "sq": sq, "sk": sk, "causal": causal, "backend": str(backend), "gqa": gqa}
    try:
        ctx = sdpa_kernel([backend]) if backend is not None else contextlib.nullcontext()
        with ctx:
            def fwd():
                with torch.no_grad():
                    return F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=gqa)
            t_f = timed(fwd, reps)
            o = F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=gqa)
            g = torch.randn_like(o)

            def fb():
                o = F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=gqa)
                torch.autograd.grad(o, (q, k, v), g)
            t_fb = timed(fb, reps)
        out.update(fwd_tflops=flops / t_f / 1e12, bwd_tflops=2.5 * flops / max(t_fb - t_f, 1e-9) / 1e12,
                   fwd_ms=t_f * 1e3, fwd_bwd_ms=t_fb * 1e3)
    except Exception as e:  # noqa: BLE001 - a backend that cannot run is a result here
        out["error"] = str(e).splitlines()[0][:200]
    print(json.dumps(out), flush=True)


def kernels_of(fn):
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    names = sorted({e.key for e in prof.key_averages() if any(s in e.key.lower() for s in ("attn", "fmha", "flash", "cudnn", "sdpa", "attention"))})
    return names


def hf_baseline_kernels():
    from transformers import Qwen2Config, Qwen2ForCausalLM
    cfg = Qwen2Config(hidden_size=3584, num_hidden_layers=1, num_attention_heads=28, num_key_value_heads=4,
                      intermediate_size=1024, vocab_size=1024, max_position_embeddings=32768)
    cfg._attn_implementation = "sdpa"
    with torch.device(dev):
        m = Qwen2ForCausalLM(cfg).to(torch.bfloat16)
    m.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    m.train()
    ids = torch.randint(0, 1024, (1, 8192), device=dev)

    def step():
        m(input_ids=ids).logits.float().sum().backward()
    step()
    return kernels_of(step)


if __name__ == "__main__":
    print(json.dumps({"torch": torch.__version__, "cudnn": torch.backends.cudnn.version(),
                      "gpu": torch.cuda.get_device_name()}), flush=True)
    try:
        print(json.dumps({"hf_sdpa_kernels": hf_baseline_kernels()}), flush=True)
    except Exception as e:  # noqa: BLE001
        print(json.dumps({"hf_sdpa_kernels_error": str(e)[:300]}), flush=True)
    B = SDPBackend
    for sq, sk, causal in ((32768, 32768, True), (4096, 32768, False), (4096, 4096, True)):
        for backend, gqa in ((None, True), (B.FLASH_ATTENTION, False), (B.FLASH_ATTENTION, True),
                             (B.CUDNN_ATTENTION, False), (B.CUDNN_ATTENTION, True), (B.EFFICIENT_ATTENTION, True)):
            case(f"{sq}x{sk}", sq, sk, causal, backend, gqa)
    # lse-carrying ops the chunk trainer would call (forward of a history block, backward with the
    # merged out/lse of the whole row).
    q = torch.randn(1, HQ, 4096, D, device=dev, dtype=torch.bfloat16)
    k = torch.randn(1, HQ, 32768, D, device=dev, dtype=torch.bfloat16)
    v = torch.randn_like(k)
    try:
        r = torch.ops.aten._scaled_dot_product_cudnn_attention(q, k, v, None, True, 0.0, False, False)
        print(json.dumps({"cudnn_op_outputs": [tuple(x.shape) if isinstance(x, torch.Tensor) else str(x) for x in r]}), flush=True)
        ref = F.scaled_dot_product_attention(q.float(), k.float(), v.float())
        print(json.dumps({"cudnn_op_max_err": (r[0].float() - ref).abs().max().item(),
                          "lse_dtype": str(r[1].dtype), "lse_stride": r[1].stride()}), flush=True)
    except Exception as e:  # noqa: BLE001
        print(json.dumps({"cudnn_op_error": str(e)[:300]}), flush=True)
