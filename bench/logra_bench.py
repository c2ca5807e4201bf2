"""LoGRA memory and time per update against dense AdamW, bf16 AdamW, LoRA and the plain sketch.

One training update = forward + backward + optimizer step of an HF Qwen2ForCausalLM (random
init, from config) on batch x seqlen tokens with gradient checkpointing. Variants:
  logra64, logra256     membar.logra: bf16 W frozen, sketches accumulated in backward (x projected
                        in backward under checkpointing), Adam on the flat sketch buffer, fused
                        tensor-core merged update (bf16 stochastic rounding); loss through
                        membar.logra.loss (chunked, gradient computed in the forward, no
                        full-vocabulary logits kept)
  logra64_kl            logra64 plus predicted-KL step control: one forward-mode pass over a
                        512-token probe (the first sequence's first 512 tokens) per update
  adamw_fp32master      AdamW on fp32 params with bf16 autocast (HF loss, full logits)
  adamw_bf16            AdamW on bf16 params (HF loss)
  lora64                PEFT LoRA r=64 on the 7 projections (HF loss); skipped without peft
  sketch64, sketch256   plain PyTorch sketch: W frozen, fixed random-sign A buffer, zero-init
                        B trained (B.grad = G A^T), AdamW on B (HF loss): the usual way
                        to train a sketch in plain PyTorch
  sketch64_chunked      the plain sketch with the same chunked loss as LoGRA (separates the
                        loss's share of the saving from LoGRA's own)
  logra64_rt            logra64 with sketches and Adam moments as pages of an embedded
                        membar.runtime.Runtime (CUDA backend); peak adds the runtime's GPU frames
  logra64_offload       logra64_rt with the moments offloaded to host memory between updates
  logra64_fwdproj       logra64 projecting x A^T in the forward (saved P) instead of the backward
  logra64_exact         logra64 with the CUDA-core update kernel (bit-identical to the CPU) instead
                        of the tensor-core one
Per config: peak and mean allocated GPU memory (mean sampled every 2 ms during the measured
updates), seconds per update (best and mean of the measured updates), trainable / state bytes,
and for LoGRA the policy-sync payload per update against the full targeted weights.

Every config runs in a fresh subprocess (an OOM cannot poison the next). Configs that run out
of memory are recorded as OOM with the memory they would need (weights, gradients, optimizer
states; activations not counted). Results: logra_bench.json and logra_bench.txt in
$MEMBAR_RESULTS_DIR (default bench/results/latest); with --profile also
logra_profile_<shape>_<variant>.txt (top CUDA kernels of one update, and the split of the update
into forward + backward and optimizer step).

  python bench/logra_bench.py --shapes 7b,27b,1.5b        # H200: the full sweep (7 minutes)
  python bench/logra_bench.py --shapes 7b --variants logra64,sketch64 --profile
  python bench/logra_bench.py --quick                     # tiny shapes on the CPU (CI smoke run)
"""
from __future__ import annotations

import argparse
import json
import math
import os
import resource
import subprocess
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bindings" / "python"))

SHAPES = {
    "1.5b": dict(hidden_size=1536, num_hidden_layers=28, num_attention_heads=12, num_key_value_heads=2,
                 intermediate_size=8960, vocab_size=151936),
    "7b": dict(hidden_size=3584, num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4,
               intermediate_size=18944, vocab_size=152064),
    # Qwen2.5-32B's layer shape with 52 layers: ~27B parameters.
    "27b": dict(hidden_size=5120, num_hidden_layers=52, num_attention_heads=40, num_key_value_heads=8,
                intermediate_size=27648, vocab_size=152064),
    "tiny": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                 intermediate_size=160, vocab_size=1000),
}
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# Most telling first: results are written after every config, so a run cut short still reports.
DEFAULT_VARIANTS = ("logra64,sketch64,logra256,sketch256,logra64_kl,adamw_bf16,lora64,adamw_fp32master,"
                    "sketch64_chunked,logra64_rt,logra64_offload")
# At ~27B only LoGRA is expected to fit one H200; the dense variants are run to record their OOM.
VARIANTS_BY_SHAPE = {"27b": "logra64,adamw_fp32master,adamw_bf16"}
LOSS_CHUNK_TOKENS = 1024


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", "--models", dest="models", default="7b,1.5b",
                        help="comma-separated model shapes: 1.5b, 7b, 27b, tiny")
    parser.add_argument("--variants", default=None,
                        help=f"comma-separated variants (default: {DEFAULT_VARIANTS}; at 27b: {VARIANTS_BY_SHAPE['27b']})")
    parser.add_argument("--profile", action="store_true",
                        help="profile one update per config with torch.profiler: top CUDA kernels, and the "
                             "update split into forward + backward and optimizer step")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seqlen", type=int, default=2048)
    parser.add_argument("--updates", type=int, default=4, help="updates per config (the first is warm-up)")
    parser.add_argument("--timeout", type=int, default=900, help="seconds per config")
    parser.add_argument("--quick", action="store_true", help="tiny shapes on the CPU, a smoke run")
    parser.add_argument("--append", action="store_true",
                        help="merge into an existing logra_bench.json (same model and variant: replaced), "
                             "for running the configs in several pieces")
    parser.add_argument("--child", nargs=2, metavar=("MODEL", "VARIANT"), help=argparse.SUPPRESS)
    parser.add_argument("--device", default=None, help=argparse.SUPPRESS)
    return parser.parse_args()


# ----------------------------------------------------------------------------------------------
# Child: one config.

def chunked_causal_lm_loss(model, input_ids):
    """Mean next-token cross-entropy without full-vocabulary logits: membar.logra.loss, chunks of
    LOSS_CHUNK_TOKENS tokens, the hidden-state gradient computed in the forward (no logit is
    computed twice; Note [Chunked linear cross-entropy])."""
    from membar.logra.loss import causal_lm_loss

    return causal_lm_loss(model, input_ids, chunk_tokens=LOSS_CHUNK_TOKENS)


def parameter_count(model_name):
    """Parameters of the HF Qwen2 shape, from its config (q/k/v biases, untied lm_head)."""
    shape = SHAPES[model_name]
    hidden, layers, intermediate, vocab = (shape["hidden_size"], shape["num_hidden_layers"],
                                           shape["intermediate_size"], shape["vocab_size"])
    kv = hidden // shape["num_attention_heads"] * shape["num_key_value_heads"]
    attention = hidden * hidden + hidden + 2 * (hidden * kv + kv) + hidden * hidden
    per_layer = attention + 3 * hidden * intermediate + 2 * hidden
    return 2 * vocab * hidden + layers * per_layer + hidden


def dense_need_bytes(model_name, variant):
    """Bytes a dense variant needs before activations: weights + gradients + AdamW's two moments
    (fp32 master: 4 + 4 + 8 bytes per parameter; bf16 params: 2 + 2 + 4)."""
    count = parameter_count(model_name)
    if variant == "adamw_fp32master":
        return 16 * count
    if variant == "adamw_bf16":
        return 8 * count
    return None


def build(model_name, variant, device):
    import torch
    import torch.nn as nn
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(**SHAPES[model_name], max_position_embeddings=32768, tie_word_embeddings=False)
    config._attn_implementation = "sdpa"
    dtype = torch.float32 if variant == "adamw_fp32master" else torch.bfloat16
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # build directly in the target dtype (no fp32 copy of a 27B model)
    try:
        with torch.device(device):
            model = Qwen2ForCausalLM(config)
    finally:
        torch.set_default_dtype(previous)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    info = {}
    if variant.startswith("logra"):
        from membar import logra
        from membar.logra.sync import update_message_bytes

        rank = int(variant[len("logra"):].split("_")[0])
        kl = variant.endswith("_kl")
        runtime = None
        if variant.endswith("_rt") or variant.endswith("_offload"):
            from membar.runtime import Runtime

            # The embedded runtime's GPU pool holds sketches and both moments; its host pool
            # the offloaded moments. 2 MiB of slack per kind for page rounding.
            state_bytes = sum(4 * child.out_features * rank for _, _, _, child in logra.target_linears(model, TARGETS))
            window = (3 * (state_bytes + (4 << 20)) + (2 << 20) - 1) // (2 << 20) * (2 << 20)
            runtime = Runtime.connect(embedded=True, backend="cuda" if device == "cuda" else "host",
                                      gpu_pool_bytes=window, host_pool_bytes=window)
        handle = logra.apply_logra(model, rank=rank, targets=TARGETS, seed=1, runtime=runtime,
                                   projection="forward" if variant.endswith("_fwdproj") else "auto")
        optimizer = logra.LoGRAOptimizer(handle, lr=1e-5, algorithm="adam",
                                          kl_control=logra.KLControl(delta=2e-4, alpha_max=1.0) if kl else None,
                                          offload_moments=variant.endswith("_offload"),
                                          exact_update=variant.endswith("_exact"))
        info["runtime"] = runtime  # kept alive with the model
        info["sync_payload_bytes"] = update_message_bytes([(l.out_features, l.rank) for l in handle.layers])
        info["full_weight_bytes"] = sum(l.weight.numel() * l.weight.element_size() for l in handle.layers)
        info["trainable"] = sum(l.out_features * l.rank for l in handle.layers)

        def backward(input_ids):
            chunked_causal_lm_loss(model, input_ids).backward()

        def step(input_ids):
            probe_ids = input_ids[:1, :512]
            optimizer.step(kl_probe=(lambda: model(input_ids=probe_ids).logits) if kl else None)

        def update(input_ids):
            backward(input_ids)
            step(input_ids)

        info["phases"] = (backward, step)

        info["state_bytes"] = lambda: optimizer.state_bytes()
        return model, update, info

    if variant == "lora64":
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=64, lora_alpha=128, target_modules=list(TARGETS)))
    elif variant.startswith("sketch"):
        rank = int(variant[len("sketch"):].split("_")[0])

        class PlainSketch(nn.Module):
            def __init__(self, base, rank):
                super().__init__()
                self.base = base
                base.weight.requires_grad_(False)
                signs = torch.randint(0, 2, (rank, base.in_features), device=base.weight.device) * 2 - 1
                self.register_buffer("A", signs.to(base.weight.dtype) / math.sqrt(rank))
                self.B = nn.Parameter(torch.zeros(base.out_features, rank, device=base.weight.device,
                                                  dtype=base.weight.dtype))

            def forward(self, x):
                return self.base(x) + (x @ self.A.t()) @ self.B.t()

        for parameter in model.parameters():
            parameter.requires_grad_(False)
        for module in list(model.modules()):
            for name, child in list(module.named_children()):
                if name in TARGETS and isinstance(child, nn.Linear):
                    setattr(module, name, PlainSketch(child, rank))
    parameters = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(parameters, lr=1e-5, fused=(device == "cuda"))
    info["trainable"] = sum(p.numel() for p in parameters)
    chunked = variant.endswith("_chunked")
    autocast = variant == "adamw_fp32master"

    def backward(input_ids):
        with torch.autocast(device_type=device, dtype=torch.bfloat16, enabled=autocast):
            if chunked:
                loss = chunked_causal_lm_loss(model, input_ids)
            else:
                loss = model(input_ids=input_ids, labels=input_ids).loss
        loss.backward()

    def step(input_ids):
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    def update(input_ids):
        backward(input_ids)
        step(input_ids)

    info["phases"] = (backward, step)

    def state_bytes():
        total = 0
        for state in optimizer.state.values():
            for value in state.values():
                if torch.is_tensor(value):
                    total += value.numel() * value.element_size()
        return total

    info["state_bytes"] = state_bytes
    return model, update, info


class MemorySampler:
    """Samples torch.cuda.memory_allocated() every 2 ms on a helper thread."""

    def __init__(self):
        import torch

        self.torch = torch
        self.samples = []
        self.running = False

    def __enter__(self):
        self.running = True
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()
        return self

    def _run(self):
        while self.running:
            self.samples.append(self.torch.cuda.memory_allocated())
            time.sleep(0.002)

    def __exit__(self, *exc):
        self.running = False
        self.thread.join()

    def mean(self):
        return sum(self.samples) / max(1, len(self.samples))


def is_out_of_memory(error):
    import torch

    if isinstance(error, torch.OutOfMemoryError):
        return True
    message = str(error)
    return "out of memory" in message or "CUBLAS_STATUS_ALLOC_FAILED" in message or "RESOURCE_EXHAUSTED" in message


def profile_update(update, phases, input_ids, out_path, title):
    """One update under torch.profiler: the top CUDA kernels by their own GPU time, and the split
    of the update into forward + backward and optimizer step (each synchronised). Written to
    out_path; returns a short summary for the JSON."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    backward, step = phases
    torch.cuda.synchronize()
    started = time.time()
    backward(input_ids)
    torch.cuda.synchronize()
    middle = time.time()
    step(input_ids)
    torch.cuda.synchronize()
    ended = time.time()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as profiler:
        update(input_ids)
        torch.cuda.synchronize()
    averages = profiler.key_averages()
    kernels = [e for e in averages if getattr(e, "self_device_time_total", 0) > 0 and e.device_type.name == "CUDA"]
    kernels.sort(key=lambda e: e.self_device_time_total, reverse=True)
    total_us = sum(e.self_device_time_total for e in kernels)
    lines = [f"# {title}: one update, forward+backward {middle - started:.4f} s, optimizer step {ended - middle:.4f} s "
             f"(synchronised between phases); GPU kernel time {total_us / 1e6:.4f} s",
             f"{'GPU ms':>9} {'share':>6} {'calls':>6}  kernel"]
    top = []
    for event in kernels[:30]:
        lines.append(f"{event.self_device_time_total / 1e3:9.2f} {event.self_device_time_total / max(1, total_us):6.1%} "
                     f"{event.count:6d}  {event.key[:150]}")
        top.append([event.key[:120], round(event.self_device_time_total / 1e3, 3), event.count])
    lines.append("")
    lines.append("# top operators by GPU time (including their kernels)")
    operators = [e for e in averages if e.device_type.name == "CPU" and getattr(e, "device_time_total", 0) > 0]
    operators.sort(key=lambda e: e.device_time_total, reverse=True)
    for event in operators[:25]:
        lines.append(f"{event.device_time_total / 1e3:9.2f} ms {event.count:6d}  {event.key[:150]}")
    Path(out_path).write_text("\n".join(lines) + "\n")
    return dict(forward_backward_s=middle - started, optimizer_s=ended - middle, kernel_s=total_us / 1e6,
                top_kernels=top[:12])


def run_child(model_name, variant, args):
    import torch

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    cuda = device == "cuda"
    if not cuda:
        torch.set_num_threads(1)  # a smoke run on a shared CI machine: no spinning thread pools
    result = dict(model=model_name, variant=variant, batch=args.batch, seqlen=args.seqlen, device=device,
                  parameters=parameter_count(model_name))
    need = dense_need_bytes(model_name, variant)
    if need is not None:
        result["need_gib_before_activations"] = need / 2**30
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        result["device_gib"] = torch.cuda.get_device_properties(0).total_memory / 2**30
    phase = "build"
    try:
        model, update, info = build(model_name, variant, device)
        vocab = SHAPES[model_name]["vocab_size"]
        input_ids = torch.randint(0, vocab, (args.batch, args.seqlen), device=device)
        times = []
        sampler = MemorySampler() if cuda else None
        for index in range(args.updates):
            phase = f"update {index}"
            if cuda:
                torch.cuda.synchronize()
            if index == 1 and sampler is not None:
                sampler.__enter__()
            started = time.time()
            update(input_ids)
            if cuda:
                torch.cuda.synchronize()
            times.append(time.time() - started)
        if sampler is not None:
            sampler.__exit__(None, None, None)
        measured = times[1:] or times
        result.update(step_s=min(measured), mean_step_s=sum(measured) / len(measured), trainable=info["trainable"],
                      state_bytes=info["state_bytes"]())
        if info.get("runtime") is not None:
            result["runtime_gpu_bytes"] = info["runtime"].gpu_bytes(peak=True)
        for key in ("sync_payload_bytes", "full_weight_bytes"):
            if key in info:
                result[key] = info[key]
        if cuda:
            # Runtime pages live in the runtime's own VMM frames, outside PyTorch's allocator.
            extra = result.get("runtime_gpu_bytes", 0)
            result["peak_gib"] = (torch.cuda.max_memory_allocated() + extra) / 2**30
            result["mean_gib"] = (sampler.mean() + extra) / 2**30
            if args.profile:
                phase = "profile"
                out_dir = Path(os.environ.get("MEMBAR_RESULTS_DIR", REPO / "bench" / "results" / "latest"))
                result["profile"] = profile_update(update, info["phases"], input_ids,
                                                   out_dir / f"logra_profile_{model_name}_{variant}.txt",
                                                   f"{model_name} {variant}")
        else:
            result["peak_host_rss_gib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    except ImportError as error:
        result["skipped"] = f"missing dependency: {error.name}"
    except (RuntimeError, MemoryError) as error:  # torch.OutOfMemoryError is a RuntimeError
        if not is_out_of_memory(error):
            raise
        result["oom"] = True
        result["oom_at"] = phase
        if cuda:
            result["peak_gib_before_oom"] = torch.cuda.max_memory_allocated() / 2**30
    print("RESULT " + json.dumps(result), flush=True)


# ----------------------------------------------------------------------------------------------
# Parent: one subprocess per config, then the table.

def human_bytes(count):
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if count >= size:
            return f"{count / size:.1f} {unit}"
    return f"{count} B"


def sketch_baseline(results, r):
    """The plain sketch of the same shape and rank as LoGRA row r (None if not measured)."""
    rank = r["variant"][len("logra"):].split("_")[0]
    for other in results:
        if other["model"] == r["model"] and other["variant"] == f"sketch{rank}" and "step_s" in other:
            return other
    return None


def format_table(results):
    header = ["model", "variant", "trainable", "peak GiB", "mean GiB", "s/update", "vs plain sketch (time, peak)",
              "sync payload / full"]
    rows = [header]
    for r in results:
        if r.get("oom"):
            need = r.get("need_gib_before_activations")
            note = f"needs {need:.0f} GiB + activations" if need else ""
            if "device_gib" in r:
                note += f" ({r['device_gib']:.0f} GiB device)"
            rows.append([r["model"], r["variant"], "", "OOM at " + r.get("oom_at", "?"), "", "", "", note])
            continue
        if "skipped" in r or "error" in r:
            rows.append([r["model"], r["variant"], "", r.get("skipped", r.get("error", ""))[:40], "", "", "", ""])
            continue
        peak = r.get("peak_gib", r.get("peak_host_rss_gib"))
        payload = ""
        if "sync_payload_bytes" in r:
            payload = (f"{human_bytes(r['sync_payload_bytes'])} / {human_bytes(r['full_weight_bytes'])} "
                       f"({r['sync_payload_bytes'] / r['full_weight_bytes']:.4f})")
        versus = ""
        baseline = sketch_baseline(results, r) if r["variant"].startswith("logra") else None
        if baseline is not None:
            versus = f"{r['step_s'] / baseline['step_s']:.3f}x"
            if "peak_gib" in r and "peak_gib" in baseline:
                versus += f", {r['peak_gib'] / baseline['peak_gib']:.3f}x"
        rows.append([r["model"], r["variant"], f"{r['trainable'] / 1e6:.1f}M",
                     f"{peak:.2f}" + ("" if "peak_gib" in r else " (host RSS)"),
                     f"{r['mean_gib']:.2f}" if "mean_gib" in r else "", f"{r['step_s']:.3f}", versus, payload])
    widths = [max(len(str(row[i])) for row in rows) for i in range(len(header))]
    return "\n".join(" | ".join(str(cell).ljust(width) for cell, width in zip(row, widths)) for row in rows)


def main():
    args = parse_args()
    if args.child:
        run_child(args.child[0], args.child[1], args)
        return
    if args.quick:
        models, batch, seqlen, updates, device = ["tiny"], 2, 64, 2, "cpu"
        variants_for = lambda model: args.variants or "logra16,logra16_kl,adamw_bf16,sketch16_chunked,logra16_rt"
    else:
        models, batch, seqlen, updates, device = args.models.split(","), args.batch, args.seqlen, args.updates, None
        variants_for = lambda model: args.variants or VARIANTS_BY_SHAPE.get(model, DEFAULT_VARIANTS)
    for model in models:
        if model not in SHAPES:
            sys.exit(f"unknown shape {model!r}; known: {', '.join(SHAPES)}")
    out_dir = Path(os.environ.get("MEMBAR_RESULTS_DIR", REPO / "bench" / "results" / "latest"))
    out_dir.mkdir(parents=True, exist_ok=True)
    json_path = out_dir / "logra_bench.json"
    earlier = json.loads(json_path.read_text()) if args.append and json_path.exists() else []
    results = []

    def write():
        merged = [r for r in earlier if (r["model"], r["variant"]) not in {(n["model"], n["variant"]) for n in results}]
        merged += results
        json_path.write_text(json.dumps(merged, indent=1))
        (out_dir / "logra_bench.txt").write_text(format_table(merged) + "\n")
        return merged

    for model_name in models:
        for variant in variants_for(model_name).split(","):
            command = [sys.executable, __file__, "--child", model_name, variant, "--batch", str(batch),
                       "--seqlen", str(seqlen), "--updates", str(updates)]
            if device:
                command += ["--device", device]
            if args.profile:
                command += ["--profile"]
            started = time.time()
            try:
                completed = subprocess.run(command, capture_output=True, text=True, timeout=args.timeout)
                lines = [l for l in completed.stdout.splitlines() if l.startswith("RESULT ")]
                if lines:
                    result = json.loads(lines[-1][len("RESULT "):])
                else:
                    result = dict(model=model_name, variant=variant, error=f"exit {completed.returncode}: "
                                  + (completed.stderr.strip().splitlines() or ["no output"])[-1])
            except subprocess.TimeoutExpired:
                result = dict(model=model_name, variant=variant, error=f"timed out after {args.timeout} s")
            result["wall_s"] = time.time() - started
            results.append(result)
            print(json.dumps({key: value for key, value in result.items() if key != "profile"}), flush=True)
            profile_path = out_dir / f"logra_profile_{model_name}_{variant}.txt"
            if "profile" in result and profile_path.exists():
                print(profile_path.read_text(), flush=True)
            merged = write()
    print(format_table(merged))
    failed = [r for r in results if "error" in r]
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
