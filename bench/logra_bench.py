"""LoGRA memory and time per update against dense AdamW, bf16 AdamW, LoRA and the plain sketch.

One training update = forward + backward + optimizer step of an HF Qwen2ForCausalLM (random
init, from config) on batch x seqlen tokens with gradient checkpointing. Variants:
  logra64, logra256     membar.logra: bf16 W frozen, x A^T saved instead of x, sketches + Adam
                        on sketches, fused merged update (bf16 stochastic rounding); loss computed
                        in checkpointed chunks (no full-vocabulary logits kept)
  logra64_kl            logra64 plus predicted-KL step control: one forward-mode pass over a
                        512-token probe (the first sequence's first 512 tokens) per update
  adamw_fp32master      AdamW on fp32 params with bf16 autocast (HF loss, full logits)
  adamw_bf16            AdamW on bf16 params (HF loss)
  lora64                PEFT LoRA r=64 on the 7 projections (HF loss); skipped without peft
  sketch64, sketch256   plain PyTorch sketch: W frozen, fixed random-sign A buffer, zero-init
                        B trained (B.grad = G A^T), AdamW on B (HF loss), as in
                        ../shared/probes/optim_baseline.py
  sketch64_chunked      the plain sketch with the same chunked loss as LoGRA (separates the
                        loss's share of the saving from LoGRA's own)
Per config: peak and mean allocated GPU memory (mean sampled every 2 ms during the measured
updates), seconds per update (best and mean of the measured updates), trainable / state bytes,
and for LoGRA the policy-sync payload per update against the full targeted weights.

Every config runs in a fresh subprocess. Results: logra_bench.json and logra_bench.txt in
$MEMBAR_RESULTS_DIR (default bench/results/latest).

  python bench/logra_bench.py                       # H200: 1.5b and 7b, all variants
  python bench/logra_bench.py --models 27b --variants logra64,adamw_bf16
  python bench/logra_bench.py --quick               # tiny shapes on the CPU (CI smoke run)
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
DEFAULT_VARIANTS = "logra64,sketch64,logra256,sketch256,logra64_kl,adamw_bf16,lora64,adamw_fp32master,sketch64_chunked"
LOSS_CHUNK_TOKENS = 1024


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="7b,1.5b")
    parser.add_argument("--variants", default=DEFAULT_VARIANTS)
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
    """Mean next-token cross-entropy without keeping full-vocabulary logits: the final hidden
    states [B, T, H] go through lm_head + CE in checkpointed pieces of LOSS_CHUNK_TOKENS tokens,
    so only one piece's fp32 logits exist at a time (also in the backward)."""
    import torch
    import torch.nn.functional as F
    from torch.utils.checkpoint import checkpoint

    hidden = model.model(input_ids=input_ids).last_hidden_state[:, :-1, :]  # [B, T-1, H]
    labels = input_ids[:, 1:]
    hidden = hidden.reshape(-1, hidden.shape[-1])
    labels = labels.reshape(-1)
    head = model.lm_head

    def piece_loss(piece_hidden, piece_labels):
        logits = head(piece_hidden).float()
        return F.cross_entropy(logits, piece_labels, reduction="sum")

    total = hidden.new_zeros((), dtype=torch.float32)
    for start in range(0, hidden.shape[0], LOSS_CHUNK_TOKENS):
        end = min(start + LOSS_CHUNK_TOKENS, hidden.shape[0])
        total = total + checkpoint(piece_loss, hidden[start:end], labels[start:end], use_reentrant=False)
    return total / hidden.shape[0]


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
        handle = logra.apply_logra(model, rank=rank, targets=TARGETS, seed=1)
        optimizer = logra.LoGRAOptimizer(handle, lr=1e-5, algorithm="adam",
                                          kl_control=logra.KLControl(delta=2e-4, alpha_max=1.0) if kl else None)
        info["sync_payload_bytes"] = update_message_bytes([(l.out_features, l.rank) for l in handle.layers])
        info["full_weight_bytes"] = sum(l.weight.numel() * l.weight.element_size() for l in handle.layers)
        info["trainable"] = sum(l.out_features * l.rank for l in handle.layers)

        def update(input_ids):
            chunked_causal_lm_loss(model, input_ids).backward()
            probe_ids = input_ids[:1, :512]
            optimizer.step(kl_probe=(lambda: model(input_ids=probe_ids).logits) if kl else None)

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

    def update(input_ids):
        with torch.autocast(device_type=device, dtype=torch.bfloat16, enabled=autocast):
            if chunked:
                loss = chunked_causal_lm_loss(model, input_ids)
            else:
                loss = model(input_ids=input_ids, labels=input_ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

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


def run_child(model_name, variant, args):
    import torch

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    cuda = device == "cuda"
    if not cuda:
        torch.set_num_threads(1)  # a smoke run on a shared CI machine: no spinning thread pools
    result = dict(model=model_name, variant=variant, batch=args.batch, seqlen=args.seqlen, device=device)
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    try:
        model, update, info = build(model_name, variant, device)
        vocab = SHAPES[model_name]["vocab_size"]
        input_ids = torch.randint(0, vocab, (args.batch, args.seqlen), device=device)
        times = []
        sampler = MemorySampler() if cuda else None
        for index in range(args.updates):
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
        for key in ("sync_payload_bytes", "full_weight_bytes"):
            if key in info:
                result[key] = info[key]
        if cuda:
            result["peak_gib"] = torch.cuda.max_memory_allocated() / 2**30
            result["mean_gib"] = sampler.mean() / 2**30
        else:
            result["peak_host_rss_gib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    except torch.OutOfMemoryError:
        result["oom"] = True
    except ImportError as error:
        result["skipped"] = f"missing dependency: {error.name}"
    print("RESULT " + json.dumps(result), flush=True)


# ----------------------------------------------------------------------------------------------
# Parent: one subprocess per config, then the table.

def human_bytes(count):
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if count >= size:
            return f"{count / size:.1f} {unit}"
    return f"{count} B"


def format_table(results):
    header = ["model", "variant", "trainable", "peak GiB", "mean GiB", "s/update", "sync payload / full"]
    rows = [header]
    for r in results:
        if r.get("oom"):
            rows.append([r["model"], r["variant"], "", "OOM", "", "", ""])
            continue
        if "skipped" in r or "error" in r:
            rows.append([r["model"], r["variant"], "", r.get("skipped", r.get("error", ""))[:40], "", "", ""])
            continue
        peak = r.get("peak_gib", r.get("peak_host_rss_gib"))
        payload = ""
        if "sync_payload_bytes" in r:
            payload = (f"{human_bytes(r['sync_payload_bytes'])} / {human_bytes(r['full_weight_bytes'])} "
                       f"({r['sync_payload_bytes'] / r['full_weight_bytes']:.4f})")
        rows.append([r["model"], r["variant"], f"{r['trainable'] / 1e6:.1f}M",
                     f"{peak:.2f}" + ("" if "peak_gib" in r else " (host RSS)"),
                     f"{r['mean_gib']:.2f}" if "mean_gib" in r else "", f"{r['step_s']:.3f}", payload])
    widths = [max(len(str(row[i])) for row in rows) for i in range(len(header))]
    return "\n".join(" | ".join(str(cell).ljust(width) for cell, width in zip(row, widths)) for row in rows)


def main():
    args = parse_args()
    if args.child:
        run_child(args.child[0], args.child[1], args)
        return
    if args.quick:
        models, batch, seqlen, updates, device = ["tiny"], 2, 64, 2, "cpu"
        variants = "logra16,logra16_kl,adamw_bf16,sketch16_chunked"
    else:
        models, batch, seqlen, updates, device = args.models.split(","), args.batch, args.seqlen, args.updates, None
        variants = args.variants
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
        for variant in variants.split(","):
            command = [sys.executable, __file__, "--child", model_name, variant, "--batch", str(batch),
                       "--seqlen", str(seqlen), "--updates", str(updates)]
            if device:
                command += ["--device", device]
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
            print(json.dumps(result), flush=True)
            merged = write()
    print(format_table(merged))
    failed = [r for r in results if "error" in r]
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
