#!/usr/bin/env python3
"""Model coverage on one GPU: chunk-recurrent training of the families people train, beside
full-sequence training, in bf16 (random init, the published shapes in membar/oomb/presets.py).

    python bench/model_coverage_bench.py --quick                      # all four shapes, < 5 min
    python bench/model_coverage_bench.py --models qwen3-8b            # one shape, whole table row
    python bench/model_coverage_bench.py --models gemma-2-9b --contexts 32K

Two parts per model (each configuration in its own try block: an out-of-memory error is a result):
  errors   the model's shape cut to its first --error-layers layers (every other setting kept),
           one sequence of --error-tokens: the gradients of full-sequence bf16 training and of
           chunk-recurrent bf16 training, each against full-sequence float32 training of the same
           weights. Error measure as the tests: max over parameters of max |g - g32| / max |g32|,
           and the relative L2 error of all gradients together. Goal: chunk-recurrent <= 2x full.
  timing   the whole model (or --timing-layers of it) at each of --contexts: one step (forward +
           backward, no optimizer) of full-sequence training (gradient checkpointing, loss in 4K
           pieces) and of chunk-recurrent training (chunks of --chunk, layer checkpointing), after a
           warm-up sequence; seconds and peak GPU memory (torch allocator). Chunk-recurrent pages
           stay on the GPU when they fit beside --gpu-reserve-gib, else the first layers that fit
           stay there and the rest go to pinned host memory (bf16 grad pages when even that does
           not fit). At contexts >= --partial-from the chunk-recurrent step is a partial step
           (Note [Partial steps] in membar/oomb/trainer.py: all of stage 1, the --stage2-chunks
           longest-history chunks of stage 2) and its seconds are the estimate of a whole step.
Full-sequence attention: SDPA; Gemma 2 soft-caps its scores, which transformers' SDPA path ignores,
so its full-sequence reference is eager attention (errors part) and --gemma-full (timing: flex
attention by default, or "skip"). Gemma 2's chunk-recurrent attention runs the PyTorch path
(Note [Attention in PyTorch] in membar/oomb/torch_attention.py): exact, and slower.
--quick: the four shapes with --timing-layers 4 at 32K only, errors with 2 layers at 4K tokens, no
Gemma 2 full-sequence timing (flex attention compiles for a minute or more).
Rows are merged by (model, part, variant, tokens) into model_coverage.json, and the table
model_coverage.md is rewritten after every configuration, in $MEMBAR_RESULTS_DIR (default
bench/results/latest); run one model per call and the table fills up. --time-budget skips what
starts after the budget is spent. --tiny shrinks every shape (CPU smoke test).
"""
from __future__ import annotations

import argparse
import copy
import gc
import json
import os
import sys
import time
import traceback
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "bindings" / "python"))

MODELS = ["qwen3-8b", "llama-3.1-8b", "gemma-2-9b", "mistral-7b"]
K = 1024


def parse_tokens(text: str) -> int:
    text = text.strip().upper()
    scale = {"K": K, "M": K * K}.get(text[-1], 1)
    return int(float(text[:-1] if text[-1] in "KM" else text) * scale)


def human_tokens(tokens: int) -> str:
    return f"{tokens // K}K" if tokens % K == 0 else str(tokens)


# -- models --------------------------------------------------------------------------------------

def shape_config(name: str, layers: int | None, tiny: bool, max_positions: int):
    """The preset's config, cut to `layers` layers; --tiny shrinks widths (CPU smoke test)."""
    from membar.oomb.presets import preset_config

    config = preset_config(name, max_positions)
    if tiny:
        for field, value in dict(hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
                                 head_dim=16, vocab_size=1001, query_pre_attn_scalar=16).items():
            if hasattr(config, field):
                setattr(config, field, value)
        if getattr(config, "sliding_window", None):
            config.sliding_window = 100
    if layers is not None and layers < config.num_hidden_layers:
        config.num_hidden_layers = layers
        if getattr(config, "layer_types", None):
            config.layer_types = config.layer_types[:layers]
    return config


def build(config, dtype, device, seed: int = 0):
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa", dtype=dtype)
    model.train()
    return model


def full_attention(model, gemma_full: str) -> str | None:
    """Full-sequence attention for the timing part (None: not run, see --gemma-full)."""
    from membar.oomb.models import attention_softcaps

    if not attention_softcaps(model):
        return "sdpa"
    return {"flex": "flex_attention", "eager": "eager", "skip": None}[gemma_full]


def attention_path(model) -> str:
    """Where the model's attention runs in the chunk-recurrent step on CUDA (Note [Soft-capped scores],
    Note [Sliding window]; MEMBAR_CUDA_SOFTCAP / MEMBAR_CUDA_WINDOW send them to the PyTorch path)."""
    from membar.oomb.kernels import cuda_softcap_kernels, cuda_window_kernels
    from membar.oomb.models import attention_softcaps

    text = model.config
    parts = []
    if attention_softcaps(model):
        parts.append("soft-cap on " + ("membar kernels" if cuda_softcap_kernels() else "PyTorch"))
    if getattr(text, "sliding_window", None):
        parts.append("windows on " + ("membar kernels" if cuda_window_kernels() else "PyTorch"))
    return "; ".join(parts) if parts else "cuDNN / membar kernels"


def release(device) -> None:
    import torch

    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        if hasattr(torch._C, "_host_emptyCache"):
            torch._C._host_emptyCache()


def synchronize(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def reset_peak(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)


def peak_gib(device) -> float:
    import torch

    return torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else 0.0


# -- the errors part ---------------------------------------------------------------------------------

def _grads(model) -> dict:
    return {name: p.grad.detach().float().cpu() for name, p in model.named_parameters() if p.grad is not None}


def gradient_errors(grads: dict, reference: dict) -> dict:
    import torch

    worst = max(float((grads[name] - ref).abs().max() / ref.abs().max()) for name, ref in reference.items())
    difference = torch.sqrt(sum(((grads[name] - ref).double() ** 2).sum() for name, ref in reference.items()))
    norm = torch.sqrt(sum((ref.double() ** 2).sum() for ref in reference.values()))
    return {"max_relative": worst, "relative_l2": float(difference / norm)}


def measure_errors(name: str, args, device) -> dict:
    import torch

    from membar.oomb import OOMBConfig, OOMBTrainer
    from membar.oomb.baseline import full_sequence_step, reference_attention

    tokens = args.error_tokens
    config = shape_config(name, args.error_layers, args.tiny, tokens)
    model32 = build(config, torch.float32, device)
    model16 = copy.deepcopy(model32).to(torch.bfloat16)
    ids = torch.randint(0, config.vocab_size, (1, tokens), generator=torch.Generator().manual_seed(1))
    attention = reference_attention(model32)
    row = {"model": name, "part": "errors", "variant": "errors", "tokens": tokens, "layers": config.num_hidden_layers,
           "full_attention": attention, "chunk": args.error_chunk}
    for model in (model32, model16):
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    loss32 = full_sequence_step(model32, ids.to(device), loss_piece_tokens=4096, attn_implementation=attention)
    reference = _grads(model32)
    del model32
    release(device)
    loss16 = full_sequence_step(model16, ids.to(device), loss_piece_tokens=4096, attn_implementation=attention)
    full16 = _grads(model16)
    model16.zero_grad(set_to_none=True)
    model16.gradient_checkpointing_disable()
    trainer = OOMBTrainer(model16, OOMBConfig(chunk_tokens=args.error_chunk, page_tokens=args.page_tokens,
                                              checkpoint_layers=True))
    loss_oomb = trainer.step(ids)
    oomb16 = _grads(model16)
    full_error, oomb_error = gradient_errors(full16, reference), gradient_errors(oomb16, reference)
    row.update(loss_float32=loss32, loss_full_bf16=loss16, loss_chunk_recurrent_bf16=loss_oomb,
               full_bf16=full_error, chunk_recurrent_bf16=oomb_error,
               ratio=oomb_error["max_relative"] / full_error["max_relative"],
               torch_path_layers=[record.layer for record in trainer.layers if record.needs_torch_path],
               cudnn_attention_calls=trainer.stats.get("cudnn_attention_calls", 0))
    row["within_goal"] = row["ratio"] <= 2.0
    return row


# -- the timing part ---------------------------------------------------------------------------------

def oomb_config(model, tokens: int, args, device):
    """OOMBConfig for a timed step: pages on the GPU when they fit, else a GPU/host split."""
    import torch

    from membar.oomb import OOMBConfig, plan_gpu_resident_layers, pool_bytes_per_layer
    from membar.oomb.config import host_available_bytes
    from membar.oomb.models import text_config
    from membar.oomb.runtime_store import streamed_bytes

    text = text_config(model.config)
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    dtype = next(model.parameters()).dtype
    options = dict(chunk_tokens=args.chunk, page_tokens=args.page_tokens, checkpoint_layers=True,
                   loss_piece_tokens=4096)
    if device.type != "cuda":
        return OOMBConfig(**options), "gpu"
    # Free memory less the parameters' gradients (allocated by the first backward) and a reserve
    # for activations.
    parameter_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    free = torch.cuda.mem_get_info(device)[0] - parameter_bytes
    reserve = int(args.gpu_reserve_gib * 2**30)
    for grad_dtype in (torch.float32, torch.bfloat16):
        layer_bytes = pool_bytes_per_layer(tokens, args.page_tokens, text.num_key_value_heads, head_dim, dtype,
                                           grad_dtype)
        if layer_bytes * text.num_hidden_layers + reserve <= free:
            return OOMBConfig(**options, grad_page_dtype=grad_dtype), f"gpu ({str(grad_dtype)[6:]} grad pages)"
        # The streamed history blocks take GPU room beside the resident layers (OOMBConfig's defaults).
        streamed = streamed_bytes(tokens, model.config, args.page_tokens, dtype, grad_dtype,
                                  OOMBConfig(**options).history_block_tokens, OOMBConfig.prefetch_depth)
        try:
            plan = plan_gpu_resident_layers(tokens, model.config, args.page_tokens, dtype, grad_dtype, free,
                                            reserve + streamed, host_available_bytes())
        except ValueError:
            continue
        return (OOMBConfig(**options, grad_page_dtype=grad_dtype, offload=True,
                           gpu_resident_layers=plan.gpu_resident_layers),
                f"{plan.gpu_resident_layers} layers on the GPU, the rest in host memory ({str(grad_dtype)[6:]} "
                f"grad pages)")
    raise RuntimeError(f"the pages of {human_tokens(tokens)} tokens fit neither the GPU nor the host.")


def measure_step(model, name: str, variant: str, tokens: int, args, device) -> dict:
    import torch

    from membar.oomb import OOMBTrainer
    from membar.oomb.baseline import full_sequence_step

    text = model.config
    row = {"model": name, "part": "timing", "variant": variant, "tokens": tokens, "layers": text.num_hidden_layers}
    ids = torch.randint(0, text.vocab_size, (1, tokens), generator=torch.Generator().manual_seed(2))
    warmup = ids[:, : 2 * args.chunk]
    partial = None
    if variant == "full":
        attention = full_attention(model, args.gemma_full)
        row["attention"] = attention
        if attention is None:
            row["skipped"] = "--gemma-full skip (SDPA ignores the soft-cap; eager needs O(tokens^2) memory)"
            return row
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        if attention == "flex_attention":
            # flex attention compiles for each new sequence length: a short warm-up left the timed
            # step compiling (gemma-2-9b at 32K "took" 56.7 s, session 22). Warm up at the length timed.
            warmup = ids
        ids, warmup = ids.to(device), warmup.to(device)

        def step(sequence):
            full_sequence_step(model, sequence, loss_piece_tokens=4096, attn_implementation=attention)
    else:
        config, placement = oomb_config(model, tokens, args, device)
        row.update(attention=attention_path(model), pages=placement, chunk=config.chunk_tokens)
        trainer = OOMBTrainer(model, config)
        trainer.reserve(tokens)
        if tokens >= args.partial_from and args.stage2_chunks:
            partial = args.stage2_chunks

        def step(sequence, stage2_chunks=None):
            trainer.step(sequence, stage2_chunks=stage2_chunks)
    step(warmup)
    model.zero_grad(set_to_none=False)
    reset_peak(device)
    started = time.perf_counter()
    if partial:
        step(ids, partial)
    else:
        step(ids)
    synchronize(device)
    row.update(step_seconds=time.perf_counter() - started, peak_gpu_gib=peak_gib(device))
    if variant != "full":
        stats = trainer.stats
        # The pages live in the runtime's own GPU frames, which PyTorch's peak does not count
        # (session 24: rows before then gave PyTorch's peak alone for chunk-recurrent training).
        row.update(peak_gpu_torch_gib=row["peak_gpu_gib"],
                   runtime_gpu_gib=stats.get("device_pool_bytes", 0) / 2**30,
                   peak_gpu_gib=stats.get("peak_gpu_bytes_total", 0) / 2**30 or row["peak_gpu_gib"])
        row.update(stage1_seconds=stats["stage1_seconds"], pages_moved=stats["pages_moved"],
                   cudnn_attention_calls=stats["cudnn_attention_calls"])
        if partial:
            row.update(partial_step=True, stage2_chunks_run=stats["stage2_chunks_run"],
                       stage2_chunks_total=stats["stage2_chunks_total"],
                       estimated_step_seconds=stats["estimated_step_seconds"],
                       step_seconds_upper_bound=stats["step_seconds_upper_bound"])
    return row


# -- results -------------------------------------------------------------------------------------------

def row_key(row: dict) -> tuple:
    return (row["model"], row["part"], row["variant"], row["tokens"])


def merge(rows: list[dict], new: dict) -> list[dict]:
    """rows with `new` in place of its configuration's row; a configuration skipped for time keeps
    the row an earlier run measured."""
    if new.get("skipped") == "time budget spent" and any(row_key(row) == row_key(new) and not row.get("skipped")
                                                         for row in rows):
        return rows
    return [row for row in rows if row_key(row) != row_key(new)] + [new]


def _cell(row: dict | None) -> str:
    if row is None:
        return ""
    if row.get("skipped"):
        return "skipped"
    if row.get("oom"):
        return "OOM"
    if row.get("error"):
        return "error"
    seconds = row.get("estimated_step_seconds", row["step_seconds"])
    mark = "~" if row.get("partial_step") else ""
    # A chunk-recurrent row from before session 24 gave PyTorch's peak alone, without the pages.
    torch_only = "*" if row["variant"] == "chunk-recurrent" and "runtime_gpu_gib" not in row else ""
    return f"{mark}{seconds:.1f} s, {row['peak_gpu_gib']:.1f} GiB{torch_only}"


def markdown(rows: list[dict], commit: str) -> str:
    models = [name for name in MODELS if any(row["model"] == name for row in rows)]
    models += sorted({row["model"] for row in rows} - set(models))
    contexts = sorted({row["tokens"] for row in rows if row["part"] == "timing"})
    header = ["model", "layers (errors / timing)", "bf16 grad error vs fp32: full sequence", "chunk-recurrent",
              "ratio (goal <= 2)"]
    for tokens in contexts:
        header += [f"{human_tokens(tokens)} full sequence", f"{human_tokens(tokens)} chunk-recurrent"]
    lines = [f"Model coverage (bench/model_coverage_bench.py, commit {commit}): bf16, random init.",
             "Errors: max over parameters of max |g - g_fp32| / max |g_fp32| (relative L2 in brackets). "
             "Timing: one forward + backward step, peak GPU memory (chunk-recurrent: PyTorch's peak plus the "
             "runtime's GPU frames); ~ marks a partial step's estimate; * marks a peak without the runtime's "
             "frames (PyTorch's alone: rows measured before session 24).", "",
             "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for name in models:
        errors = next((row for row in rows if row["model"] == name and row["part"] == "errors"), None)
        timing = [row for row in rows if row["model"] == name and row["part"] == "timing"]
        layers = f"{errors.get('layers', '-') if errors else '-'} / {timing[0].get('layers', '-') if timing else '-'}"
        if errors and "full_bf16" in errors:
            full, oomb = errors["full_bf16"], errors["chunk_recurrent_bf16"]
            cells = [f"{full['max_relative']:.3g} ({full['relative_l2']:.2g})",
                     f"{oomb['max_relative']:.3g} ({oomb['relative_l2']:.2g})", f"{errors['ratio']:.2f}"]
        else:
            cells = ["error" if errors else "", "", ""]
        for tokens in contexts:
            for variant in ("full", "chunk-recurrent"):
                cells.append(_cell(next((row for row in timing if row["variant"] == variant
                                         and row["tokens"] == tokens), None)))
        lines.append("| " + " | ".join([name, layers] + cells) + " |")
    return "\n".join(lines) + "\n"


def write(rows: list[dict], out: Path, commit: str) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "model_coverage.json").write_text(json.dumps({"commit": commit, "rows": rows}, indent=1))
    (out / "model_coverage.md").write_text(markdown(rows, commit))


def commit_of() -> str:
    """$MEMBAR_COMMIT when set (a copied tree's git metadata may be older than its files), else git's."""
    import subprocess

    if os.environ.get("MEMBAR_COMMIT"):
        return os.environ["MEMBAR_COMMIT"]
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return os.environ.get("MEMBAR_COMMIT", "unknown")


# -- main ------------------------------------------------------------------------------------------------

def run_configuration(function, *arguments) -> dict:
    import torch

    try:
        return function(*arguments)
    except Exception as error:   # an OOM or a failure ends this configuration, not the run
        traceback.print_exc()
        oom = isinstance(error, torch.OutOfMemoryError) or "out of memory" in str(error).lower()
        return {"oom": oom, "error": f"{type(error).__name__}: {error}"[:400]}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--contexts", default="32K,128K")
    parser.add_argument("--parts", default="errors,timing")
    parser.add_argument("--variants", default="full,chunk-recurrent", help="timing variants to run")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--tiny", action="store_true", help="shrink every shape (CPU smoke test)")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--error-layers", type=int, default=4)
    parser.add_argument("--error-tokens", type=parse_tokens, default=8 * K)
    parser.add_argument("--error-chunk", type=parse_tokens, default=2 * K)
    parser.add_argument("--timing-layers", type=int, default=None, help="default: every layer of the shape")
    parser.add_argument("--chunk", type=parse_tokens, default=4 * K)
    parser.add_argument("--page-tokens", type=int, default=128)
    parser.add_argument("--gpu-reserve-gib", type=float, default=24.0)
    parser.add_argument("--partial-from", type=parse_tokens, default=128 * K)
    parser.add_argument("--stage2-chunks", type=int, default=4)
    parser.add_argument("--gemma-full", choices=("flex", "eager", "skip"), default=None,
                        help="Gemma 2's full-sequence timing: flex attention (default; skip with --quick)")
    parser.add_argument("--time-budget", type=float, default=540.0, help="seconds; later configurations are skipped")
    parser.add_argument("--fresh", action="store_true", help="start a new results file instead of merging")
    args = parser.parse_args(argv)
    if args.gemma_full is None:
        args.gemma_full = "skip" if args.quick else "flex"
    if args.quick:
        args.contexts, args.timing_layers = "32K", args.timing_layers or 4
        args.error_layers, args.error_tokens, args.error_chunk = 2, 4 * K, K
    contexts = [parse_tokens(text) for text in args.contexts.split(",") if text]
    if args.tiny:
        contexts = [min(tokens, 2 * K) for tokens in contexts]
        args.chunk, args.page_tokens = 256, 64
        args.error_tokens, args.error_chunk = min(args.error_tokens, 1024), 256
    import torch

    device = torch.device(args.device)
    out = Path(os.environ.get("MEMBAR_RESULTS_DIR", REPO / "bench" / "results" / "latest"))
    commit = commit_of()
    rows: list[dict] = []
    existing = out / "model_coverage.json"
    if existing.exists() and not args.fresh:
        rows = json.loads(existing.read_text()).get("rows", [])
    started = time.time()
    deadline = started + args.time_budget
    if os.environ.get("MEMBAR_STACKS_EVERY"):
        # Every thread's stack every N seconds: a step that runs far longer than expected shows
        # whether it moves (different stacks) or waits (the same one).
        import faulthandler

        faulthandler.dump_traceback_later(float(os.environ["MEMBAR_STACKS_EVERY"]), repeat=True)
    parts = args.parts.split(",")

    def record(row: dict) -> None:
        nonlocal rows
        rows = merge(rows, row)
        write(rows, out, commit)
        print(json.dumps(row), flush=True)
        print(f"[{time.time() - started:.0f} s since start]", file=sys.stderr, flush=True)

    for name in args.models.split(","):
        if "errors" in parts:
            if time.time() > deadline:
                record({"model": name, "part": "errors", "variant": "errors", "tokens": args.error_tokens,
                        "skipped": "time budget spent"})
            else:
                result = run_configuration(measure_errors, name, args, device)
                record(dict({"model": name, "part": "errors", "variant": "errors", "tokens": args.error_tokens},
                            **result))
            release(device)
        if "timing" not in parts:
            continue
        model = None
        for tokens in contexts:
            for variant in [v for v in ("full", "chunk-recurrent") if v in args.variants.split(",")]:
                key = {"model": name, "part": "timing", "variant": variant, "tokens": tokens}
                if time.time() > deadline:
                    record(dict(key, skipped="time budget spent"))
                    continue
                if model is None:
                    config = shape_config(name, args.timing_layers, args.tiny, max(contexts))
                    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
                    model = build(config, dtype, device)
                key["layers"] = model.config.num_hidden_layers
                result = run_configuration(measure_step, model, name, variant, tokens, args, device)
                record(dict(key, **result))
                model.zero_grad(set_to_none=True)
                model.gradient_checkpointing_disable()
                release(device)
        del model
        release(device)
    print(markdown(rows, commit))
    return 0


if __name__ == "__main__":
    sys.exit(main())
