#!/usr/bin/env python3
"""OOMB benchmark: chunk-recurrent training beside full-sequence training, on one GPU.

    python bench/oomb_bench.py                 # Qwen2.5-7B shape, 32K .. 2M tokens
    python bench/oomb_bench.py --quick         # Qwen2.5-0.5B shape, 16K .. 64K tokens (minutes)
    python bench/oomb_bench.py --learning      # passkey >= 16K tokens back: OOMB vs short windows

Every (variant, context) runs in its own subprocess under a time limit, so an out-of-memory or a
hang ends that configuration only; a series (one variant) stops at its first failure, since longer
contexts would fail too. Variants:
  full            HF full-sequence training: SDPA, gradient checkpointing, loss in 4K pieces
  dense           OOMB, exact gradients, all pages on the GPU
  dense-offload   OOMB, pages of every layer in pinned host memory, prefetched per layer
  dense-hybrid    OOMB, as many layers' pages on the GPU as fit, the rest in host memory
  sparse          OOMB, top-k pages per query tile (selection from stage 1 reused in stage 2)
  sparse-offload  the same with offload
Each step is forward + backward of one sequence (no optimizer step, like the baseline in
/work/shared/docs/measured.md), after a short warm-up sequence. Results: oomb_bench.json and
oomb_bench.txt in $MEMBAR_RESULTS_DIR (default bench/results/latest).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "bindings" / "python"))

VARIANTS = ["full", "dense", "dense-offload", "dense-hybrid", "sparse", "sparse-offload"]


def parse_tokens(text: str) -> int:
    text = text.strip().upper()
    scale = {"K": 1024, "M": 1024 * 1024}.get(text[-1], 1)
    return int(float(text[:-1] if text[-1] in "KM" else text) * scale)


def human_tokens(tokens: int) -> str:
    if tokens % (1024 * 1024) == 0:
        return f"{tokens // (1024 * 1024)}M"
    return f"{tokens // 1024}K" if tokens % 1024 == 0 else str(tokens)


def host_available_bytes() -> int:
    with open("/proc/meminfo") as info:
        for line in info:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return 0


# -- one configuration (child process) ------------------------------------------------------------

def run_one(spec: dict) -> dict:
    import torch

    from membar.oomb import OOMBConfig, OOMBTrainer, pool_bytes_per_layer
    from membar.oomb.baseline import full_sequence_step
    from membar.oomb.presets import build_model
    from membar.oomb.trainer import host_memory

    tokens, variant = spec["tokens"], spec["variant"]
    device = torch.device("cuda")
    model = build_model(spec["model"], dtype=torch.bfloat16, device=device, max_positions=tokens, seed=0)
    model.train()
    weights_bytes = torch.cuda.memory_allocated()
    vocab = model.config.vocab_size
    generator = torch.Generator().manual_seed(0)
    sequence = torch.randint(0, vocab, (1, tokens), generator=generator).to(device)
    warmup = sequence[:, : min(tokens, 2 * spec["chunk"])]
    result = {"variant": variant, "tokens": tokens, "model": spec["model"], "weights_gib": weights_bytes / 2**30,
              "checkpoint_layers": variant != "full" and spec.get("checkpoint_layers", True)}

    if variant == "full":
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})

        def step(ids):
            full_sequence_step(model, ids, loss_piece_tokens=4096, attn_implementation="sdpa")
    else:
        mode = "sparse" if variant.startswith("sparse") else "dense"
        offload = variant.endswith("offload") or variant.endswith("hybrid")
        resident = 0
        if variant.endswith("hybrid"):
            text = model.config
            head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
            per_layer = pool_bytes_per_layer(tokens, spec["page_tokens"], text.num_key_value_heads, head_dim,
                                             torch.bfloat16, torch.float32)
            free = torch.cuda.mem_get_info()[1] - weights_bytes - int(spec["gpu_reserve_gib"] * 2**30)
            resident = max(0, min(text.num_hidden_layers, free // per_layer))
            host_needed = (text.num_hidden_layers - resident) * per_layer
            result.update(gpu_resident_layers=int(resident), host_pool_needed_gib=host_needed / 2**30)
            if host_needed > 0.92 * host_available_bytes():
                result.update(error=f"pages need {host_needed / 2**30:.0f} GiB of host memory beside "
                                    f"{resident} GPU-resident layers; {host_available_bytes() / 2**30:.0f} GiB available")
                return result
        config = OOMBConfig(chunk_tokens=spec["chunk"], page_tokens=spec["page_tokens"], mode=mode,
                            top_k=spec["top_k"], query_tile_tokens=spec["page_tokens"], offload=offload,
                            gpu_resident_layers=int(resident), loss_piece_tokens=4096,
                            checkpoint_layers=spec.get("checkpoint_layers", True))
        trainer = OOMBTrainer(model, config)

        def step(ids):
            trainer.step(ids)

    step(warmup)
    model.zero_grad(set_to_none=False)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    started = time.perf_counter()
    step(sequence)
    torch.cuda.synchronize()
    seconds = time.perf_counter() - started
    result.update(
        step_seconds=seconds, tokens_per_second=tokens / seconds,
        peak_gpu_gib=torch.cuda.max_memory_allocated() / 2**30,
        peak_gpu_reserved_gib=torch.cuda.max_memory_reserved() / 2**30,
        host_peak_rss_gib=host_memory()["peak_rss_bytes"] / 2**30)
    if variant != "full":
        stats = trainer.stats
        result.update(pages_moved=stats["pages_moved"], bytes_moved_gib=stats["bytes_moved"] / 2**30,
                      host_pool_gib=stats["host_pool_bytes"] / 2**30,
                      device_pool_gib=stats["device_pool_bytes"] / 2**30,
                      stage1_seconds=stats["stage1_seconds"], stage2_seconds=stats["stage2_seconds"])
    return result


# -- the series (parent process) ------------------------------------------------------------------

def run_series(args) -> list[dict]:
    results = []
    for variant in args.variants:
        for tokens in args.contexts:
            spec = dict(variant=variant, tokens=tokens, model=args.model, chunk=args.chunk,
                        page_tokens=args.page_tokens, top_k=args.top_k, gpu_reserve_gib=args.gpu_reserve_gib,
                        checkpoint_layers=not args.no_checkpoint_layers)
            started = time.monotonic()
            try:
                child = subprocess.run([sys.executable, __file__, "--one", json.dumps(spec)], capture_output=True,
                                       text=True, timeout=args.time_limit, cwd=REPO)
                lines = [line for line in child.stdout.splitlines() if line.startswith("{")]
                if lines:
                    result = json.loads(lines[-1])
                else:
                    tail = (child.stderr or "").strip().splitlines()[-3:]
                    oom = "OutOfMemoryError" in child.stderr or "out of memory" in child.stderr
                    result = dict(spec, oom=oom, error=" | ".join(tail) or f"exit {child.returncode}")
            except subprocess.TimeoutExpired:
                result = dict(spec, timeout=True, error=f"over the {args.time_limit} s limit")
            result["wall_seconds"] = time.monotonic() - started
            results.append(result)
            print(format_row(result), flush=True)
            if result.get("error") or result.get("oom"):
                break   # longer contexts of this variant would fail as well
    return results


def format_row(r: dict) -> str:
    head = f"{r['variant']:<15} {human_tokens(r['tokens']):>5}"
    if r.get("oom"):
        return f"{head}  OOM"
    if r.get("error"):
        return f"{head}  -- {r['error']}"
    return (f"{head}  {r['step_seconds']:9.1f} s  {r['tokens_per_second']:9,.0f} tok/s  "
            f"GPU {r['peak_gpu_gib']:6.1f} GiB  host {r['host_peak_rss_gib']:6.1f} GiB"
            + (f"  moved {r['bytes_moved_gib']:8.1f} GiB" if "bytes_moved_gib" in r else ""))


def summarise(results: list[dict]) -> dict:
    """The issue's goals, where the measured points allow checking them."""
    ok = {(r["variant"], r["tokens"]): r for r in results if "step_seconds" in r}
    goals = {}
    offload = sorted((t, r["peak_gpu_gib"]) for (v, t), r in ok.items() if v == "dense-offload")
    if len(offload) >= 2:
        (t0, g0), (t1, g1) = offload[0], offload[-1]
        goals["gpu_mib_per_10k_tokens_offload"] = (g1 - g0) * 1024 / ((t1 - t0) / 1e4)
    longest = max([t for (v, t) in ok if v.startswith("dense")], default=0)
    goals["longest_dense_tokens"] = longest
    k128 = 128 * 1024
    if ("dense", k128) in ok and ("full", k128) in ok:
        goals["dense_vs_full_step_time_128k"] = ok[("dense", k128)]["step_seconds"] / ok[("full", k128)]["step_seconds"]
    both = [t for (v, t) in ok if v == "dense" and ("dense-offload", t) in ok]
    if both:
        t = max(both)
        goals["offload_overhead"] = ok[("dense-offload", t)]["step_seconds"] / ok[("dense", t)]["step_seconds"] - 1
        goals["offload_overhead_tokens"] = t
    for t in sorted({t for (v, t) in ok}, reverse=True):
        if ("dense", t) in ok and ("sparse", t) in ok:
            goals["sparse_speedup"] = ok[("dense", t)]["step_seconds"] / ok[("sparse", t)]["step_seconds"]
            goals["sparse_speedup_tokens"] = t
            break
    return goals


# -- learning experiment --------------------------------------------------------------------------

def run_learning(args) -> dict:
    """Passkey >= 16K tokens back: OOMB on whole sequences vs training on short windows only."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from membar.oomb import OOMBConfig, OOMBTrainer
    from membar.oomb.tasks import PasskeyTask, passkey_accuracy

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    tokens, distance = args.learning_tokens, args.learning_distance
    outcome = {"tokens": tokens, "distance": distance, "steps": args.learning_steps, "device": str(device),
               "key_repeats": args.learning_key_repeats, "chance": 1 / 16}
    for name, window in (("oomb_full_context", None), ("short_window", args.short_window)):
        torch.manual_seed(0)
        config = Qwen2Config(hidden_size=256, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                             head_dim=64, intermediate_size=512, vocab_size=64, max_position_embeddings=tokens,
                             rope_theta=1e6, tie_word_embeddings=False, attn_implementation="sdpa")
        model = Qwen2ForCausalLM(config).to(device)
        trainer = OOMBTrainer(model, OOMBConfig(chunk_tokens=2048, page_tokens=64))
        optimizer = torch.optim.AdamW(model.parameters(), lr=args.learning_lr, weight_decay=0.0)
        task = PasskeyTask(64, tokens, distance, num_keys=16, seed=1, key_repeats=args.learning_key_repeats)
        evaluation = PasskeyTask(64, tokens, distance, num_keys=16, seed=2, key_repeats=args.learning_key_repeats)
        started = time.monotonic()
        for step in range(args.learning_steps):
            batch = task.batch(1)
            ids, labels = batch.input_ids, batch.labels
            if window is not None:
                ids, labels = ids[:, -window:], labels[:, -window:]   # the question, but not the key
            trainer.step(ids, labels)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        accuracy = passkey_accuracy(trainer, evaluation, args.eval_sequences)
        outcome[name] = {"accuracy": accuracy, "train_seconds": time.monotonic() - started, "window": window}
        print(f"{name}: passkey accuracy {accuracy:.0%} after {args.learning_steps} steps "
              f"({outcome[name]['train_seconds']:.0f} s)", flush=True)
    return outcome


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--one", help=argparse.SUPPRESS)
    parser.add_argument("--quick", action="store_true", help="0.5B shape at 16K..64K")
    parser.add_argument("--model", default=None)
    parser.add_argument("--contexts", default=None, help="comma list, e.g. 32K,64K,1M")
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--chunk", type=int, default=4096)
    parser.add_argument("--page-tokens", type=int, default=128)
    parser.add_argument("--top-k", type=int, default=64)
    parser.add_argument("--gpu-reserve-gib", type=float, default=30.0,
                        help="dense-hybrid: GPU memory kept free for activations beside the pages")
    parser.add_argument("--time-limit", type=int, default=1200, help="seconds per configuration")
    parser.add_argument("--no-checkpoint-layers", action="store_true",
                        help="OOMB variants keep each chunk's layer activations (default: recompute them in "
                             "backward, like the full-sequence baseline's gradient checkpointing)")
    parser.add_argument("--learning", action="store_true", help="run the passkey learning experiment")
    parser.add_argument("--learning-tokens", type=int, default=16384 + 1024)
    parser.add_argument("--learning-distance", type=int, default=16384)
    parser.add_argument("--learning-steps", type=int, default=400)
    parser.add_argument("--learning-lr", type=float, default=1e-3)
    parser.add_argument("--learning-key-repeats", type=int, default=1, help="(KEY, key) pairs in the statement")
    parser.add_argument("--short-window", type=int, default=4096)
    parser.add_argument("--eval-sequences", type=int, default=100)
    args = parser.parse_args()

    if args.one:
        try:
            print(json.dumps(run_one(json.loads(args.one))), flush=True)
        except Exception as error:   # report the failure as data; the parent decides what it means
            import torch

            oom = isinstance(error, torch.OutOfMemoryError) or "out of memory" in str(error).lower()
            print(json.dumps(dict(json.loads(args.one), oom=oom, error=f"{type(error).__name__}: {error}"[:300])))
        return 0

    out = Path(os.environ.get("MEMBAR_RESULTS_DIR", REPO / "bench" / "results" / "latest"))
    out.mkdir(parents=True, exist_ok=True)
    if args.learning:
        outcome = run_learning(args)
        (out / "oomb_learning.json").write_text(json.dumps(outcome, indent=1))
        return 0

    args.model = args.model or ("qwen2.5-0.5b" if args.quick else "qwen2.5-7b")
    contexts = args.contexts or ("16K,32K,64K" if args.quick else "32K,64K,128K,256K,512K,1M,2M")
    args.contexts = [parse_tokens(c) for c in contexts.split(",")]
    args.variants = [v for v in args.variants.split(",") if v]
    unknown = set(args.variants) - set(VARIANTS)
    if unknown:
        parser.error(f"unknown variants {sorted(unknown)}; known: {VARIANTS}")
    if args.quick and args.time_limit == 1200:
        args.time_limit = 300
    results = run_series(args)
    goals = summarise(results)
    report = {"model": args.model, "chunk": args.chunk, "page_tokens": args.page_tokens, "top_k": args.top_k,
              "results": results, "goals": goals}
    (out / "oomb_bench.json").write_text(json.dumps(report, indent=1))
    table = [f"OOMB benchmark, {args.model} shape (random init, bf16), chunk {args.chunk}, pages of "
             f"{args.page_tokens}, sparse top-{args.top_k}",
             f"{'variant':<15} {'ctx':>5}  {'step':>11}  {'tokens/s':>15}  {'peak GPU':>14}  {'peak host RSS':>15}"]
    table += [format_row(r) for r in results]
    table += ["", "goals: " + json.dumps(goals)]
    (out / "oomb_bench.txt").write_text("\n".join(table) + "\n")
    print("\n".join(table[-1:]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
