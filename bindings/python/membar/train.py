"""membar-train: chunk-recurrent (OOMB) long-context training from the command line.

    python -m membar.train --model qwen2.5-0.5b --seq-len 131072 --chunk 4096 --steps 10
    python -m membar.train --model /path/to/hf_checkpoint --task passkey --seq-len 32768 --offload
    python -m membar.train --model /path/to/hf_checkpoint --data tokens.npy --seq-len 131072 --save out/
    python -m membar.train --model qwen2.5-7b --seq-len 1M --offload --gpu-resident-layers auto --steps 1
    python -m membar.train --demo          # small model recalls a key >= 16K tokens back, ~3 minutes
    torchrun --nproc_per_node 4 -m membar.train --model ... --batch 1   # data parallel, 4 sequences a step
    torchrun --nproc_per_node 4 -m membar.train --model ... --tensor-parallel 4   # heads split over 4 ranks

Each step prints loss, tokens/s, peak GPU memory, host memory and pages moved; --json prints a
JSON summary as the last line of stdout.

Under torchrun (several ranks) each rank trains --batch sequences of the global batch (the ranks'
batches in rank order: 2 ranks with --batch 1 train the sequences one process with --batch 2 would,
and compute the same update; membar.oomb.distributed, Note [Data parallel steps]); rank 0 prints.
--tensor-parallel T splits each model over T consecutive ranks, which train the same sequences
(membar.oomb.tensor_parallel, Note [Head parallel layers]).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

import torch


# The demo's training steps: about 3 minutes on one core of an unloaded 2-core CPU (~2.7 s a step).
DEMO_STEPS = 64


def _tokens(text):
    from membar.oomb.config import parse_tokens

    try:
        return parse_tokens(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def _size(text):
    """A byte size: 8GiB, 512MiB, 1.5G, or a plain number of bytes."""
    from membar.units import parse_size

    try:
        return parse_size(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def _parse(argv):
    parser = argparse.ArgumentParser(prog="membar-train", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="tiny-qwen2",
                        help="HF checkpoint directory, a config.json, or a preset "
                             "(tiny-qwen2, tiny-llama, demo, qwen2.5-0.5b, qwen2.5-1.5b, qwen2.5-7b)")
    parser.add_argument("--task", choices=["passkey", "recall", "random"], default="random",
                        help="passkey: retrieve a key placed --distance tokens back; recall: the key opens the "
                             "sequence, questions after --distance filler tokens end it; random: uniform tokens")
    parser.add_argument("--data", default=None,
                        help="train on token ids from a file (.pt, .npy, .bin, or .txt tokenized with the model's "
                             "tokenizer), cut into windows of --seq-len tokens")
    parser.add_argument("--data-dtype", default="uint16", help=".bin data: uint16 (default), uint32, int32 or int64")
    parser.add_argument("--save", default=None, help="save the trained model (save_pretrained) into this directory")
    parser.add_argument("--seq-len", type=_tokens, default=8192, help="tokens per sequence (e.g. 131072, 128K, 1M)")
    parser.add_argument("--distance", type=int, default=None, help="passkey/recall: minimum key-to-question distance")
    parser.add_argument("--num-keys", type=int, default=16, help="passkey/recall: number of distinct keys")
    parser.add_argument("--key-repeats", type=int, default=1, help="passkey: (KEY marker, key) pairs stating the key")
    parser.add_argument("--key-tokens", type=int, default=1, help="recall: copies of the key opening the sequence")
    parser.add_argument("--queries", type=int, default=1, help="recall: questions at the end (each trained)")
    parser.add_argument("--key-marker", action="store_true", help="recall: state the key as (KEY marker, key) pairs")
    parser.add_argument("--window", type=int, default=None,
                        help="passkey/recall: also score the trained model on only the last WINDOW tokens "
                             "(the question without the key)")
    parser.add_argument("--batch", type=int, default=1, help="sequences per step")
    parser.add_argument("--chunk", type=int, default=4096, help="tokens per chunk")
    parser.add_argument("--page-tokens", type=int, default=128, help="tokens per KV page")
    parser.add_argument("--mode", choices=["dense", "sparse"], default="dense")
    parser.add_argument("--top-k", type=int, default=64, help="sparse: history pages per query tile")
    parser.add_argument("--query-tile", type=int, default=128, help="sparse: queries sharing a selection")
    parser.add_argument("--offload", action="store_true",
                        help="keep KV/dKV pages in host memory; they stream through a GPU budget of a few history "
                             "blocks (see --gpu-budget, --gpu-resident-layers)")
    parser.add_argument("--gpu-budget", type=_size, default=None,
                        help="with --offload: GPU memory the runtime may keep pages in (e.g. 8GiB); default: a "
                             "few history blocks plus --gpu-resident-layers whole layers")
    parser.add_argument("--gpu-resident-layers", default="0",
                        help="with --offload: GPU budget for N more whole layers' pages (the runtime keeps what is "
                             "needed soonest); 'auto': as many as fit beside --gpu-reserve-gib (what a sequence too "
                             "long for GPU or host memory alone needs)")
    parser.add_argument("--gpu-reserve-gib", type=float, default=30.0,
                        help="--gpu-resident-layers auto: GPU memory left for activations and attention blocks "
                             "(beside gradients and AdamW's moments, which are counted)")
    parser.add_argument("--history-block", type=_tokens, default=65536,
                        help="with --offload: a layer's history goes through the GPU in blocks of this many tokens "
                             "(0: all at once)")
    parser.add_argument("--socket", default=None,
                        help="keep pages in the membard daemon at this socket (default: $MEMBAR_SOCKET; without "
                             "either, the runtime is embedded in this process; 'embedded' forces that; 'private' "
                             "starts a membard of this run's own, sized for it, and stops it at the end: with "
                             "--offload on a GPU the fastest path when no daemon runs)")
    parser.add_argument("--grad-dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default=None,
                        help="model dtype (default: bfloat16 on GPU, float32 on CPU)")
    parser.add_argument("--deterministic", action="store_true")
    parser.add_argument("--dense-kernel", choices=["auto", "membar"], default="auto",
                        help="dense attention: auto = cuDNN's fused kernels on Hopper GPUs where they apply, "
                             "membar = membar's paged kernels everywhere")
    parser.add_argument("--checkpoint-layers", action="store_true", help="recompute decoder layers in backward")
    parser.add_argument("--reuse-stage1-attention", action="store_true",
                        help="stage 2 takes stage 1's attention outputs instead of recomputing them: one attention "
                             "forward less per layer and chunk, for ~hidden x 2 bytes per token and layer held "
                             "between the stages (GPU, or host memory with --offload)")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--optimizer", choices=["adamw", "logra"], default="adamw",
                        help="adamw: dense AdamW on every parameter; logra: LoGRA (low-rank gradient sketches of "
                             "the attention and MLP projections accumulated over the chunks, Adam on the "
                             "sketches, merged full-rank update; other parameters frozen), its states in the "
                             "same runtime as the pages")
    parser.add_argument("--logra-rank", type=int, default=64, help="--optimizer logra: sketch rank")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--tensor-parallel", type=int, default=1, metavar="T",
                        help="under torchrun: split each layer's attention heads and MLP over T ranks (ranks "
                             "k*T .. k*T+T-1 train one sequence together; the groups are data parallel)")
    parser.add_argument("--dist-timeout", type=float, default=600.0,
                        help="under torchrun: seconds a collective may wait for the other ranks before failing")
    parser.add_argument("--device", default=None, help="cuda or cpu (default: cuda when available)")
    parser.add_argument("--eval-every", type=int, default=0, help="passkey: accuracy every N steps (0: at the end)")
    parser.add_argument("--eval-sequences", type=int, default=None,
                        help="held-out sequences the accuracy is measured on (default 16; 32 with --demo)")
    parser.add_argument("--json", action="store_true", help="print a JSON summary as the last line")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.add_argument("--demo", action="store_true",
                        help="train a small model to recall a key >= 16K tokens back and print its accuracy")
    parser.add_argument("--demo-steps", type=int, default=DEMO_STEPS,
                        help="demo: training steps (fewer when --demo-minutes run out first)")
    parser.add_argument("--demo-minutes", type=float, default=4.0, help="demo: most minutes of training")
    return parser.parse_args(argv)


def _gib(value: float) -> str:
    return f"{value / 2**30:.2f} GiB"


def _resident_layers(args, model, device) -> int:
    """--gpu-resident-layers as a number: given, or planned from free GPU and host memory ('auto')."""
    from membar.oomb.config import (_GRAD_PAGE_DTYPES, OOMBConfig, host_available_bytes, plan_gpu_resident_layers,
                                    selection_pages)
    from membar.oomb.runtime_store import streamed_bytes

    value = str(args.gpu_resident_layers).strip().lower()
    if value in ("0", ""):
        return 0
    if not args.offload:
        raise ValueError("--gpu-resident-layers sizes the GPU budget of offloaded pages: it needs --offload.")
    if value != "auto":
        try:
            layers = int(value)
        except ValueError:
            raise ValueError(f"--gpu-resident-layers takes a number or 'auto', got {args.gpu_resident_layers!r}.") from None
        if layers < 0:
            raise ValueError(f"--gpu-resident-layers must be >= 0, got {layers}.")
        return layers
    # The ranks of this node share its host memory; a split model's ranks each hold their heads' pages.
    local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", "1")) if getattr(args, "world_size", 1) > 1 else 1
    socket = _socket(args)
    if socket not in (None, "private"):   # a private daemon is sized to the plan, like an embedded runtime
        return _resident_layers_in_daemon(args, model, device, socket)
    free = 0
    if device.type == "cuda":
        # What the step and the optimizer allocate later on the GPU: the parameters' gradients and
        # AdamW's two moments, each the size of the trained parameters.
        later = 3 * sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
        free = max(0, torch.cuda.mem_get_info(device)[0] - later)
    # The reserve is for activations; the streamed history blocks take GPU room beside the layers too.
    streamed = streamed_bytes(args.seq_len, model.config, args.page_tokens, model.dtype,
                              _GRAD_PAGE_DTYPES[args.grad_dtype], args.history_block, OOMBConfig.prefetch_depth,
                              getattr(args, "tensor_parallel", 1),
                              selection_pages(args.mode, args.top_k, args.chunk, args.query_tile or args.page_tokens))
    plan = plan_gpu_resident_layers(args.seq_len, model.config, args.page_tokens, model.dtype,
                                    _GRAD_PAGE_DTYPES[args.grad_dtype], free,
                                    int(args.gpu_reserve_gib * 2**30) + streamed,
                                    host_available_bytes() // max(local_ranks, 1),
                                    tensor_parallel=getattr(args, "tensor_parallel", 1))
    layers = model.config.num_hidden_layers
    print(f"pages: {plan.gpu_resident_layers} of {layers} layers on the GPU, {layers - plan.gpu_resident_layers} in "
          f"host memory ({plan.host_bytes / 2**30:.1f} GiB; {plan.layer_bytes / 2**30:.2f} GiB per layer)", flush=True)
    return plan.gpu_resident_layers


def _resident_layers_in_daemon(args, model, device, socket: str) -> int:
    """--gpu-resident-layers auto through membard: the pages' GPU and host memory are the daemon's
    pools (already allocated, so free GPU memory and MemAvailable here do not count them), so the
    plan asks the daemon what its pools have left for this device, keeping room in its GPU pool
    for the streamed history blocks."""
    from membar.oomb.config import _GRAD_PAGE_DTYPES, OOMBConfig, selection_pages
    from membar.oomb.runtime_store import plan_in_daemon

    plan, gpu_left, host_left = plan_in_daemon(socket, device, args.seq_len, model.config, args.page_tokens,
                                               model.dtype, _GRAD_PAGE_DTYPES[args.grad_dtype], args.history_block,
                                               OOMBConfig.prefetch_depth, getattr(args, "tensor_parallel", 1),
                                               selection_pages(args.mode, args.top_k, args.chunk,
                                                               args.query_tile or args.page_tokens))
    layers = model.config.num_hidden_layers
    print(f"pages: {plan.gpu_resident_layers} of {layers} layers on the GPU, {layers - plan.gpu_resident_layers} in "
          f"host memory ({plan.host_bytes / 2**30:.1f} GiB; {plan.layer_bytes / 2**30:.2f} GiB per layer), planned "
          f"against membard's pools ({gpu_left / 2**30:.1f} GiB GPU, {host_left / 2**30:.1f} GiB host left)",
          flush=True)
    return plan.gpu_resident_layers


def _make_trainer(args, model, group=None, split_group=None):
    from membar.oomb import OOMBConfig, OOMBTrainer
    from membar.oomb.runtime_store import RuntimeKVStore

    device = next(model.parameters()).device
    if split_group is not None:   # split first: what is left on the GPU is what the plan may use
        from membar.oomb.tensor_parallel import shard_model

        shard_model(model, split_group)
    resident = _resident_layers(args, model, device)
    config = OOMBConfig(chunk_tokens=args.chunk, page_tokens=args.page_tokens, mode=args.mode, top_k=args.top_k,
                        query_tile_tokens=args.query_tile, offload=args.offload, grad_page_dtype=args.grad_dtype,
                        deterministic=args.deterministic, checkpoint_layers=args.checkpoint_layers,
                        history_block_tokens=args.history_block, dense_kernel=args.dense_kernel,
                        gpu_resident_layers=resident, gpu_budget_bytes=args.gpu_budget,
                        reuse_stage1_attention=args.reuse_stage1_attention)
    socket = _socket(args)
    extra = (0, 0)
    if args.optimizer == "logra":   # LoGRA's states share the pages' runtime
        from membar.logra import state_pool_bytes

        extra = (state_pool_bytes(model, args.logra_rank),) * 2
    store = RuntimeKVStore(device, offload=args.offload, socket=socket, gpu_budget_bytes=config.gpu_budget_bytes,
                           gpu_resident_layers=resident, block_tokens=args.history_block,
                           prefetch_depth=config.prefetch_depth, name=_client_name(args), extra_bytes=extra)
    args.store = "runtime"
    return OOMBTrainer(model, config, store=store, process_group=group, tensor_parallel_group=split_group)


def _socket(args) -> str | None:
    """The daemon to keep pages in: --socket, else $MEMBAR_SOCKET ("embedded" or unset: none). A
    socket named that no daemon answers at is one sentence, not a traceback."""
    import os

    socket = args.socket if args.socket is not None else os.environ.get("MEMBAR_SOCKET") or None
    if socket in (None, "", "embedded"):
        return None
    if socket == "private":   # a membard of this run's own (membar.runtime.PrivateDaemon)
        return socket
    import stat

    origin = "--socket" if args.socket is not None else "$MEMBAR_SOCKET"
    try:
        if not stat.S_ISSOCK(os.stat(socket).st_mode):
            raise ValueError(f"{origin} {socket} is not a socket (is membard running? it creates the socket).")
    except FileNotFoundError:
        raise ValueError(f"{origin} names {socket}, where no membard listens (start one with "
                         f"`membard --socket {socket}`, or leave {origin} out to embed the runtime).") from None
    return socket


def _client_name(args) -> str:
    """How membarctl shows this trainer: the model and the sequence length."""
    model = str(args.model).rstrip("/").split("/")[-1] or "model"
    rank = f" rank {args.rank}" if getattr(args, "world_size", 1) > 1 else ""
    return f"membar-train {model} {args.seq_len // 1024}K{rank}"[:63]


def _device(requested: str | None) -> torch.device:
    """--device, or the GPU when there is one and membar was built with its CUDA kernels."""
    import membar

    if requested is not None:
        device = torch.device(requested)
        if device.type == "cuda" and not membar.has_cuda_kernels():
            raise ValueError("--device cuda: this membar library was built without CUDA kernels; build them with "
                             "`make gpu-check` (or cmake -DMEMBAR_WITH_CUDA=ON).")
        return device
    if torch.cuda.is_available():
        if membar.has_cuda_kernels():
            return torch.device("cuda")
        print("membar-train: a GPU is present but this membar library has no CUDA kernels (a CPU build, "
              "as `make build` makes); running on the CPU. `make demo` (tools/demo.sh) or `make gpu-check` "
              "builds them.", flush=True)
    return torch.device("cpu")


def _gpu_demo(args, device: torch.device) -> dict:
    """The demo on a GPU: the recall experiment of bench/oomb_bench.py --learning (dense, chunks of
    4096, bf16 with float32 master weights; on the H200 it reached 100% held-out accuracy after 61 s)
    within --demo-minutes, then the short-window control for the same steps."""
    from membar.oomb.learning import recall_experiment

    print(f"membar-train --demo on {device}: recall one of 8 keys stated 2048 times at the start of an "
          f"18K-token sequence, 16384 random tokens before the questions; a small model trained from scratch "
          f"with chunk-recurrent training (dense, chunks of 4096), then the same model shown only the last "
          f"4096 tokens (chance 12%)", flush=True)
    outcome = recall_experiment(args.demo_minutes * 60, device=device, log=lambda line: print(line, flush=True))
    full, short = outcome["oomb_full_context"], outcome["short_window"]
    print("held-out accuracy, 64 fresh sequences:", flush=True)
    print(f"  whole sequence (key 16384+ tokens before the question): {full['accuracy']:.0%} after "
          f"{full['steps']} steps ({full['train_seconds']:.0f} s)", flush=True)
    print(f"  same model, only the last 4096 tokens (key out of reach): {short['accuracy']:.0%}", flush=True)
    print(f"  chance (1 of 8 keys): {outcome['chance']:.0%}", flush=True)
    summary = {"model": "demo", "device": str(device), "steps_run": full["steps"], "accuracy": full["accuracy"],
               "window_accuracy": short["accuracy"], "chance": outcome["chance"], "experiment": outcome}
    if args.json:
        print(json.dumps(summary), flush=True)
    return summary


def _demo_defaults(args):
    """The demo: recall a key stated at the start of the sequence, 16K tokens after it.

    The task is the easiest long-range one (RecallTask): the key opens the sequence (2048 copies),
    16384 random filler tokens follow, then 8 questions whose answers are never in the input. The
    model ties its input and output embeddings, so "copy what the context held" is one skill shared
    by all keys, and a large vocabulary makes the filler average out. Each step trains 4 sequences
    with 4 different keys: with one key per step the model chases the last key it saw and stayed
    near chance (12-19% held-out accuracy after 30 dense steps at lr 1e-2 or 100 sparse at 3e-3).
    """
    args.model = "demo"
    args.task = "recall"
    args.distance = 16384
    args.num_keys = 8
    args.key_tokens = 2048
    args.queries = 8
    args.key_marker = False
    args.chunk = 2048
    args.page_tokens = 64
    # Sparse attention (each tile of 128 queries sees its top 16 history pages of 64 tokens, plus its
    # own chunk) makes a step ~4x cheaper than dense on a CPU, which buys the batches of 4 that learn.
    args.mode = "sparse"
    args.top_k = 16
    args.query_tile = 128
    args.lr = 1e-2
    args.batch = 4
    if args.eval_sequences is None:   # an explicit --eval-sequences (the CI's quick demos) is kept
        args.eval_sequences = 32
    args.window = 4096
    args.steps = args.demo_steps
    return args


def run(argv=None) -> dict:
    args = _parse(argv)
    if args.demo:
        args = _demo_defaults(args)
    if args.eval_sequences is None:
        args.eval_sequences = 16
    _check_arguments(args)
    torch.manual_seed(args.seed)
    device = _device(args.device)
    from membar.oomb import distributed as _distributed

    args.rank, args.world_size, group, split_group = 0, 1, None, None
    if _distributed.launched_by_torchrun():
        if args.demo:
            raise ValueError("--demo runs in one process; start it without torchrun.")
        device = _distributed.init_from_env(device, args.dist_timeout)
        world_group = torch.distributed.group.WORLD
        args.rank, args.world_size = _distributed.world(world_group)
        if args.rank != 0:   # rank 0 prints; errors still reach every rank's stderr
            sys.stdout = open(os.devnull, "w")
        if args.tensor_parallel > 1:
            from membar.oomb.tensor_parallel import make_groups

            group, split_group = make_groups(args.tensor_parallel)
        else:
            group = world_group
    elif args.tensor_parallel > 1:
        raise ValueError(f"--tensor-parallel {args.tensor_parallel} splits the model over {args.tensor_parallel} "
                         f"ranks: start under torchrun --nproc_per_node {args.tensor_parallel} (or a multiple).")
    # Data-parallel place of this rank: its model replica and how many replicas train.
    args.replica, args.replicas = args.rank // args.tensor_parallel, args.world_size // args.tensor_parallel
    if args.demo and device.type == "cuda":
        return _gpu_demo(args, device)
    dtype = _model_dtype(args, device)
    if device.type == "cpu" and args.demo:
        torch.set_num_threads(1)   # the demo model is tiny: threads would only add overhead

    from membar.oomb.presets import build_model

    distance = _recall_length(args)
    _check_memory(args, device, dtype)
    model = build_model(args.model, dtype=dtype, device=device, max_positions=args.seq_len, seed=args.seed)
    model.train()
    if args.world_size > 1:   # one clear sentence on every rank, before any work
        _distributed.check_same(model, _rank_settings(args), torch.distributed.group.WORLD)
    trainer = _make_trainer(args, model, group, split_group)
    trainer.reserve(args.seq_len)   # page pools allocated once, not inside the first step
    tasks = _make_tasks(args, trainer.vocab_size, distance)
    next_batch = _batch_source(args, tasks, trainer.vocab_size)
    optimizer, schedule = _make_optimizer(args, model, trainer)
    summary = _start(args, model, device, dtype, trainer, tasks)
    _train(args, trainer, model, optimizer, schedule, next_batch, tasks, summary)
    if tasks.task is not None:
        _final_accuracy(args, trainer, tasks, summary)
    if args.save:
        _save(args, model, summary)
    if args.json:
        print(json.dumps(summary), flush=True)
    if args.world_size > 1:
        torch.distributed.destroy_process_group()
    return summary


def _rank_settings(args) -> dict:
    """The arguments every rank must share (not where it prints, saves or finds its daemon)."""
    local = {"socket", "device", "json", "no_progress", "save", "rank", "replica", "dist_timeout"}
    return {key: value for key, value in vars(args).items() if key not in local}


def _check_arguments(args) -> None:
    """One sentence for each argument a run cannot start with (before anything is built)."""
    at_least_one = {"--batch": (args.batch, "sequences per step"), "--steps": (args.steps, "training steps"),
                    "--chunk": (args.chunk, "tokens per chunk"), "--page-tokens": (args.page_tokens, "tokens per page"),
                    "--eval-sequences": (args.eval_sequences, "held-out sequences")}
    for flag, (value, meaning) in at_least_one.items():
        if value < 1:
            raise ValueError(f"{flag} must be at least 1 ({meaning}), got {value}.")
    if args.seq_len < 2:
        raise ValueError(f"--seq-len must be at least 2 (a token and its target), got {args.seq_len}.")
    if not args.lr > 0:
        raise ValueError(f"--lr must be positive, got {args.lr}.")
    if args.eval_every < 0:
        raise ValueError(f"--eval-every must be 0 (only at the end) or positive, got {args.eval_every}.")
    if args.demo and not args.demo_minutes > 0:
        raise ValueError(f"--demo-minutes must be positive, got {args.demo_minutes}.")
    if args.save is not None:
        _check_save_target(args.save)
    if args.tensor_parallel < 1:
        raise ValueError(f"--tensor-parallel must be at least 1 (ranks per model), got {args.tensor_parallel}.")


def _check_save_target(path: str) -> None:
    """--save names a directory that save_pretrained can write (checked before training, so a
    long run does not end in a model that was never written)."""
    if os.path.exists(path) and not os.path.isdir(path):
        raise ValueError(f"--save {path} is an existing file; the model is saved as a directory (config.json, "
                         f"weights, tokenizer): give a directory path.")
    parent = os.path.abspath(path)
    while not os.path.exists(parent):
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent) or not os.access(parent, os.W_OK):
        raise ValueError(f"--save {path}: {parent} is not a writable directory.")


def _model_dtype(args, device: torch.device) -> torch.dtype:
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, None: None}[args.dtype]
    if dtype is None:
        dtype = torch.bfloat16 if device.type == "cuda" and not args.demo else torch.float32
    return dtype


def _recall_length(args) -> int | None:
    """The recall task's key-to-question distance; its sequence length follows from it (the key,
    the filler and the questions) and replaces --seq-len."""
    if args.task != "recall":
        return None
    distance = args.distance if args.distance is not None else args.seq_len - args.key_tokens - args.queries - 1
    args.seq_len = args.key_tokens + distance + args.queries + 1
    return distance


def _model_config(name: str):
    from transformers import AutoConfig

    from membar.oomb.presets import preset_config

    if os.path.isdir(name) or os.path.isfile(name):
        return AutoConfig.from_pretrained(name)
    return preset_config(name)


def training_memory(config, dtype: torch.dtype, seq_len: int, page_tokens: int, grad_page_dtype: torch.dtype) -> dict:
    """Bytes a run needs at least, before activations: the weights, their gradients and AdamW's two
    moments (each the size of the weights), and the K, V, dK, dV pages of every layer."""
    from transformers import AutoModelForCausalLM

    from membar.oomb.config import pool_bytes_per_layer

    with torch.device("meta"):
        shell = AutoModelForCausalLM.from_config(config)
    parameters = sum(p.numel() for p in shell.parameters())
    weights = parameters * torch.empty((), dtype=dtype).element_size()
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    heads = text.num_attention_heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
    kv_heads = getattr(text, "num_key_value_heads", None) or heads
    pages = text.num_hidden_layers * pool_bytes_per_layer(seq_len, page_tokens, kv_heads, head_dim, dtype,
                                                          grad_page_dtype)
    return {"parameters": parameters, "weight_bytes": weights, "model_state_bytes": 4 * weights, "page_bytes": pages}


def _check_memory(args, device: torch.device, dtype: torch.dtype) -> None:
    """Refuses, with a sentence, a run whose weights, gradients, optimizer moments (and pages, where
    they share the memory) cannot fit: the kernel would otherwise kill it midway."""
    from membar.oomb.config import _GRAD_PAGE_DTYPES, host_available_bytes

    need = training_memory(_model_config(args.model), dtype, args.seq_len, args.page_tokens,
                           _GRAD_PAGE_DTYPES[args.grad_dtype])
    need["page_bytes"] //= args.tensor_parallel   # a split model's ranks each hold their heads' pages
    # LoGRA: the weights (frozen but for its merged updates) and states of a few percent of them.
    state = need["model_state_bytes"] if args.optimizer == "adamw" else need["weight_bytes"]
    if args.tensor_parallel > 1:
        # Each rank loads the whole model, then keeps its share of the split layers (most of the
        # weights) with their gradients and moments.
        state = max(need["weight_bytes"], state // args.tensor_parallel)
    if device.type == "cpu":
        # Through membard the pages live in the daemon's pools (allocated already; it refuses a
        # quota they cannot hold), not in this process's share of MemAvailable.
        pages_here = 0 if _socket(args) not in (None, "private") else need["page_bytes"]
        where, available, needed = "host memory", host_available_bytes(), state + pages_here
    elif device.type == "cuda":
        where, available = f"GPU memory of {device}", torch.cuda.mem_get_info(device)[1]
        needed = state + (0 if args.offload else need["page_bytes"])
    else:
        return
    if available and needed > available:
        if state > available:
            advice = "choose a smaller model" + (" or a GPU" if device.type == "cpu" else "")
        else:
            advice = "choose a shorter --seq-len" + (" or --offload" if device.type == "cuda" else "")
        raise ValueError(
            f"{args.model} ({need['parameters'] / 1e9:.2f}B parameters, {dtype}) needs at least {_gib(needed)} of "
            f"{where} for its weights{', gradients and AdamW moments' if args.optimizer == 'adamw' else ''}"
            f"{' and its KV pages' if needed > state else ''} (activations not counted), but "
            f"{_gib(available)} is available: {advice}.")


class _Tasks:
    """The training task (None: --data or random tokens), its held-out twin, and the held-out
    sequences every accuracy is measured on."""

    def __init__(self, task=None, eval_task=None, held_out=(), distance=None, windows=None):
        self.task, self.eval_task, self.held_out, self.distance, self.windows = (task, eval_task, list(held_out),
                                                                                 distance, windows)


def _make_tasks(args, vocab: int, distance: int | None) -> _Tasks:
    from membar.oomb.tasks import PasskeyTask, RecallTask

    if args.data is not None:
        if args.task != "random" or args.demo:
            raise ValueError("--data trains on the file's tokens: leave out --task and --demo.")
        from membar.oomb.data import TokenWindows, load_tokens

        tokens = load_tokens(args.data, args.data_dtype, tokenizer_path=args.model)
        windows = TokenWindows(tokens, args.seq_len, vocab, seed=args.seed + 3)
        print(f"data: {args.data}: {tokens.numel():,} tokens, {windows.count:,} sequences of {args.seq_len}",
              flush=True)
        return _Tasks(windows=windows)
    if args.task == "passkey":
        distance = args.distance if args.distance is not None else int(args.seq_len * 0.9)
        make = lambda seed: PasskeyTask(vocab, args.seq_len, distance, num_keys=args.num_keys, seed=seed,  # noqa: E731
                                        key_repeats=args.key_repeats)
    elif args.task == "recall":
        make = lambda seed: RecallTask(vocab, distance, num_keys=args.num_keys, key_tokens=args.key_tokens,  # noqa: E731
                                       queries=args.queries, seed=seed, key_marker=args.key_marker)
    else:
        return _Tasks()
    task, eval_task = make(args.seed + 1), make(args.seed + 1000)
    return _Tasks(task, eval_task, [eval_task.batch(1) for _ in range(args.eval_sequences)], distance)


def _batch_source(args, tasks: _Tasks, vocab: int):
    """A function giving the next (input_ids, labels or None) of --batch sequences: this rank's rows
    of the global batch (every rank draws the whole global batch from the same generators; the ranks
    of one tensor-parallel group take the same rows)."""
    generator = torch.Generator().manual_seed(args.seed + 2)
    replica, replicas = getattr(args, "replica", 0), getattr(args, "replicas", 1)
    rows = slice(replica * args.batch, (replica + 1) * args.batch)
    total = args.batch * replicas

    def next_batch():
        if tasks.task is not None:
            batch = tasks.task.batch(total)
            return batch.input_ids[rows], batch.labels[rows]
        if tasks.windows is not None:
            return tasks.windows.batch(total)[rows], None
        return torch.randint(0, vocab, (total, args.seq_len), generator=generator)[rows], None

    return next_batch


class _LoGRAStep:
    """LoGRA as the training loop's optimizer: step() consumes the sketches the chunks' backwards
    accumulated (there are no dense gradients to clip or zero)."""

    def __init__(self, optimizer):
        self.optimizer = optimizer
        self.param_groups = [{"lr": optimizer.lr}]

    def step(self):
        self.optimizer.lr = self.param_groups[0]["lr"]
        return self.optimizer.step()

    def zero_grad(self, set_to_none: bool = True):
        pass


def _make_optimizer(args, model, trainer):
    if args.optimizer == "logra":
        from membar import logra

        # The trainer has probed the model's attention; LoGRA now wraps its projections, its states
        # in the runtime that holds the pages (sized for both by _make_trainer).
        handle = logra.apply_logra(model, rank=args.logra_rank, seed=args.seed, runtime=trainer.store.runtime)
        optimizer = _LoGRAStep(logra.LoGRAOptimizer(handle, lr=args.lr, offload_moments=args.offload))
        # Data parallel: the ranks sum their sketches (d x r per matrix), not dense gradients.
        trainer.reduce_also(lambda: handle.states.flat("sketch") if handle.states.allocated("sketch") else None)
        print(f"optimizer: LoGRA rank {args.logra_rank} on {len(handle.layers)} projections "
              f"({sum(layer.out_features * layer.in_features for layer in handle.layers) / 1e6:.1f}M weights "
              f"updated, {sum(layer.out_features * layer.rank for layer in handle.layers) / 1e6:.1f}M trainable "
              f"sketch entries), states in {handle.states.storage.describe()}", flush=True)
        return optimizer, None
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    schedule = None
    if args.demo:
        # Cosine decay to a tenth of the rate over the demo's steps: at a constant 1e-2 a model that
        # has learned to recall can lose it again late in the run.
        schedule = torch.optim.lr_scheduler.LambdaLR(
            optimizer, lambda done: 0.1 + 0.45 * (1 + math.cos(math.pi * min(done / max(args.steps, 1), 1.0))))
    return optimizer, schedule


def offload_hint(offload: bool, device, runtime: str, host_waits: bool = True) -> str:
    """A line for --offload on a GPU through an embedded runtime whose trainer waits for pages on
    the host (copies ordered on the host: MEMBAR_DEVICE_ORDER=0): membard is faster there (its
    copies run in another process, so the trainer's stream waits on the GPU and the host never
    does; Note [Runtime pages]). Empty otherwise."""
    if (not offload or torch.device(device).type != "cuda" or not runtime.startswith("embedded")
            or not host_waits):
        return ""
    return ("hint: this run waits for each page's copies on the host (MEMBAR_DEVICE_ORDER=0 or MEMBAR_STREAM_WAIT=0 "
            "is set, or the GPU lacks 64-bit stream memory operations); offload runs faster without that, or "
            "through membard: --socket private (this run starts its own) or --socket PATH of a running one "
            "(docs/service.md).")


def sparse_offload_hint(args) -> str:
    """A line for --mode sparse --offload with query tiles smaller than a chunk: the pages moved
    are the union of every tile's selection (most of a long history), where one selection per
    chunk moves only its top-k pages (docs/oomb.md). Empty otherwise."""
    if args.mode != "sparse" or not args.offload or args.query_tile >= args.chunk:
        return ""
    tiles = -(-args.chunk // args.query_tile)
    return (f"hint: with --offload each chunk moves the union of its {tiles} query tiles' top-{args.top_k} pages "
            f"(up to {tiles * args.top_k} pages per layer); --query-tile {args.chunk} selects once per chunk and "
            f"moves only top-{args.top_k} pages (docs/oomb.md).")


def _start(args, model, device, dtype, trainer, tasks: _Tasks) -> dict:
    """Prints what runs and the accuracy before training; returns the summary to fill."""
    from membar.oomb.tasks import passkey_accuracy

    parameters = sum(p.numel() for p in model.parameters())
    print(f"membar-train: {args.model} ({parameters / 1e6:.1f}M parameters, {dtype}) on {device}; "
          f"{args.seq_len} tokens/sequence, chunk {args.chunk}, pages of {args.page_tokens}, {args.mode}"
          f"{f' top-{args.top_k}' if args.mode == 'sparse' else ''}, offload {'on' if args.offload else 'off'}, "
          f"pages in the runtime ({trainer.store.runtime.describe() if trainer.store.runtime else 'not connected'})",
          flush=True)
    store = trainer.store
    hint = offload_hint(args.offload, device, store.runtime.describe() if store.runtime else "",
                        host_waits=not getattr(store, "_gpu_waits", False))
    if hint:
        print(hint, flush=True)
    hint = sparse_offload_hint(args)
    if hint:
        print(hint, flush=True)
    if args.world_size > 1:
        from membar.oomb import tensor_parallel

        layout = tensor_parallel.info(model)
        split = (f"{args.replicas} group(s) of {args.tensor_parallel} rank(s), each splitting the model's heads, "
                 f"MLPs{' and vocabulary' if layout is not None and layout.vocab_split else ''}"
                 if args.tensor_parallel > 1 else f"{args.replicas} data-parallel rank(s)")
        print(f"ranks: {args.world_size} ({split}); global batch {args.batch * args.replicas} sequence(s) per step; "
              f"this rank holds {parameters / 1e6:.1f}M parameters", flush=True)
    summary = {"model": args.model, "device": str(device), "dtype": str(dtype), "seq_len": args.seq_len,
               "chunk": args.chunk, "page_tokens": args.page_tokens, "mode": args.mode, "offload": args.offload,
               "reuse_stage1_attention": args.reuse_stage1_attention,
               "store": args.store, "data": args.data, "optimizer": args.optimizer,
               "parameters": parameters, "world_size": args.world_size, "tensor_parallel": args.tensor_parallel,
               "global_batch": args.batch * args.replicas, "steps": []}
    if args.demo:
        print(f"task: recall one of {args.num_keys} keys, stated {args.key_tokens} times at the start, after "
              f"{tasks.distance} random filler tokens; {args.queries} questions at the end, answers never in the "
              f"input; trained on the answers only (chance {1 / args.num_keys:.1%}, loss ln {args.num_keys} = "
              f"{math.log(args.num_keys):.2f})", flush=True)
    elif tasks.task is not None:
        before = passkey_accuracy(trainer, tasks.eval_task, args.eval_sequences, batches=tasks.held_out)
        print(f"passkey accuracy before training: {before:.0%} "
              f"(chance {1 / args.num_keys:.0%}; key >= {tasks.task.distance} tokens before the question)", flush=True)
        summary["accuracy_before"] = before
    return summary


class _Progress:
    """A tqdm bar when stderr is a terminal; otherwise (a log file, a pipe) plain lines only, since
    a bar's carriage-return redraws become fragments there. The bar shows the mean loss of the
    last RECENT steps, labelled as such; each step's own loss is in its line."""

    RECENT = 10

    def __init__(self, total: int | None, enabled: bool):
        self.bar = None
        self.recent: list[float] = []
        if enabled and sys.stderr.isatty():
            try:
                from tqdm import tqdm
            except ImportError:   # tqdm is in the pinned environment; run without a bar elsewhere.
                return
            self.bar = tqdm(total=total, unit="step", dynamic_ncols=True, file=sys.stderr)

    def line(self, text: str) -> None:
        if self.bar is not None:
            self.bar.write(text)
        else:
            print(text, flush=True)

    def step(self, loss: float, tokens_per_second: float, text: str) -> None:
        self.recent = (self.recent + [loss])[-self.RECENT:]
        if self.bar is not None:
            self.bar.set_postfix({f"mean loss (last {len(self.recent)})": f"{sum(self.recent) / len(self.recent):.3f}",
                                  "tok/s": f"{tokens_per_second:,.0f}"})
            self.bar.update(1)
        self.line(text)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def _train(args, trainer, model, optimizer, schedule, next_batch, tasks: _Tasks, summary: dict) -> None:
    """The training steps (until --steps, or --demo-minutes for the demo); fills summary."""
    from membar.oomb import tensor_parallel
    from membar.oomb.tasks import passkey_accuracy
    from membar.oomb.trainer import host_memory

    progress = _Progress(args.steps if args.steps < 10**6 else None, not args.no_progress)
    deadline = time.monotonic() + args.demo_minutes * 60 if args.demo else math.inf
    started = time.monotonic()
    step = 0
    try:
        while step < args.steps and time.monotonic() < deadline:
            input_ids, labels = next_batch()
            loss = trainer.step(input_ids, labels)
            if args.optimizer == "adamw":
                # Split models: the whole model's norm, each shard and replicated parameter once.
                tensor_parallel.clip_grad_norm_(model, 1.0)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            if schedule is not None:
                schedule.step()
            step += 1
            stats = dict(trainer.stats)
            # Under torchrun: the job's tokens per second (all ranks), and the global mean loss.
            stats["tokens_per_second"] = stats.get("global_tokens_per_second", stats["tokens_per_second"])
            record = {"step": step, "loss": loss, "tokens_per_second": stats["tokens_per_second"],
                      "seconds": stats["seconds"],
                      # PyTorch's peak plus the runtime's GPU frames (pages, and LoGRA's states)
                      "peak_gpu_bytes": stats.get("peak_gpu_bytes_total", stats.get("peak_gpu_bytes", 0)),
                      "host_rss_bytes": stats["rss_bytes"], "pages_moved": stats["pages_moved"]}
            summary["steps"].append(record)
            if step == 1:
                cudnn = stats.get("cudnn_attention_calls")
                summary["attention_kernels"] = "cudnn+membar" if cudnn else "membar"
                progress.line(f"attention: {'cuDNN fused kernels for dense history, membar kernels elsewhere' if cudnn else 'membar kernels'}")
            if args.demo:
                line = (f"step {step}: answer loss {loss:.3f}  ({time.monotonic() - started:.0f} s, "
                        f"{stats['tokens_per_second']:,.0f} tok/s, host {_gib(record['host_rss_bytes'])})")
            else:
                line = (f"step {step}: loss {loss:.4f}  {stats['tokens_per_second']:,.0f} tok/s  "
                        f"peak GPU {_gib(record['peak_gpu_bytes'])}  host {_gib(record['host_rss_bytes'])}  "
                        f"pages moved {record['pages_moved']:,}")
            progress.step(loss, stats["tokens_per_second"], line)
            if tasks.task is not None and args.eval_every and step % args.eval_every == 0:
                accuracy = passkey_accuracy(trainer, tasks.eval_task, args.eval_sequences, batches=tasks.held_out)
                progress.line(f"step {step}: passkey accuracy {accuracy:.0%}")
    finally:
        progress.close()
    summary["train_seconds"] = time.monotonic() - started
    summary["steps_run"] = step
    if step:
        summary["mean_tokens_per_second"] = sum(r["tokens_per_second"] for r in summary["steps"]) / step
        summary["peak_gpu_bytes"] = max(r["peak_gpu_bytes"] for r in summary["steps"])
        summary["final_loss"] = summary["steps"][-1]["loss"]
    summary["host_memory"] = host_memory()
    summary["runtime"] = _runtime_report(trainer)
    if summary["runtime"]:
        print(summary["runtime"]["line"], flush=True)


def _runtime_report(trainer) -> dict:
    """What the memory runtime did for this run (its client's counters), with a one-line summary."""
    from membar.units import human_bytes

    runtime = getattr(trainer.store, "runtime", None)
    if runtime is None:
        return {}
    # Timed stream waits (MEMBAR_TIME_STREAM_WAITS=1) reach the runtime's stall time when the store's
    # stats collect them (first, so the runtime's counters below hold them); the host's are the rest.
    stream_ns = trainer.store.stats.stream_wait_ns if hasattr(trainer.store, "stats") else -1
    stats = runtime.stats()
    client = stats["clients"][0]
    page_bytes = trainer.store.layout_page_bytes() if hasattr(trainer.store, "layout_page_bytes") else 0
    hits, misses = int(client.get("prefetch_hits", 0)), int(client.get("prefetch_misses", 0))
    report = {"runtime": runtime.describe(), "spaces": int(client["spaces"]),
              "bytes_host_to_gpu": int(client["bytes_host_to_gpu"]), "bytes_gpu_to_host": int(client["bytes_gpu_to_host"]),
              "prefetch_hits": hits, "prefetch_misses": misses,
              "stall_seconds": max(0, int(client.get("stall_ns", 0)) - max(stream_ns, 0)) * 1e-9,
              **({"stream_wait_seconds": stream_ns * 1e-9} if stream_ns >= 0 else {}),
              "gpu_frames_peak": int(client["gpu_frames"]["peak"]), "host_frames_peak": int(client["host_frames"]["peak"])}
    moved = report["bytes_host_to_gpu"] + report["bytes_gpu_to_host"]
    report["line"] = (
        f"runtime ({report['runtime']}): {report['spaces']} spaces; moved {human_bytes(report['bytes_host_to_gpu'])} "
        f"to the GPU tier and {human_bytes(report['bytes_gpu_to_host'])} to host memory"
        + (f" ({moved // page_bytes:,} pages)" if page_bytes else "")
        + (f"; prefetch hit rate {hits / (hits + misses):.1%}" if hits + misses else "")
        + f"; the host waited {report['stall_seconds']:.2f} s for pages"
        + ("" if not getattr(trainer.store, "_gpu_waits", False)
           else f" and the stream {report['stream_wait_seconds']:.2f} s (timed on the GPU)" if stream_ns >= 0
           else " (the stream waits for them on the GPU, untimed)")
        + "; GPU tier peak "
        f"{human_bytes(report['gpu_frames_peak'] * (2 << 20))}")
    return report


def _final_accuracy(args, trainer, tasks: _Tasks, summary: dict) -> None:
    """Held-out accuracy after training (and on the last --window tokens only); prints it."""
    from membar.oomb.tasks import passkey_accuracy

    step, elapsed = summary["steps_run"], summary["train_seconds"]
    accuracy = passkey_accuracy(trainer, tasks.eval_task, args.eval_sequences, batches=tasks.held_out)
    summary["accuracy"] = accuracy
    summary["chance"] = 1 / args.num_keys
    if args.demo:
        losses = [record["loss"] for record in summary["steps"]]
        first, last = losses[:5], losses[-5:]
        print(f"trained {step} steps in {elapsed:.0f} s; answer loss (mean of 5 steps) "
              f"{sum(first) / max(len(first), 1):.2f} at the start -> {sum(last) / max(len(last), 1):.2f} "
              f"at the end", flush=True)
        print(f"held-out accuracy, {len(tasks.held_out)} fresh sequences:", flush=True)
        print(f"  whole sequence (key {tasks.distance}+ tokens before the question): {accuracy:.0%}", flush=True)
    else:
        print(f"passkey accuracy after {step} steps ({elapsed:.0f} s): {accuracy:.0%} "
              f"(before: {summary['accuracy_before']:.0%}, chance {1 / args.num_keys:.0%})", flush=True)
    if args.window:
        windowed = passkey_accuracy(trainer, tasks.eval_task, args.eval_sequences, window=args.window,
                                    batches=tasks.held_out)
        summary["window_accuracy"] = windowed
        print(f"  {'same model, ' if args.demo else 'window: '}only the last {args.window} tokens "
              f"(key out of reach): {windowed:.0%}", flush=True)
    if args.demo:
        print(f"  chance (1 of {args.num_keys} keys): {1 / args.num_keys:.0%}", flush=True)


def _save(args, model, summary: dict) -> None:
    """save_pretrained into --save (rank 0), with the checkpoint's tokenizer when --model has one;
    verifies that the files are there (save_pretrained only logs when it cannot write). A split
    model's shards are gathered first (every rank takes part)."""
    from membar.oomb import tensor_parallel

    state = tensor_parallel.full_state_dict(model) if tensor_parallel.info(model) is not None else None
    if args.rank != 0:
        return
    os.makedirs(args.save, exist_ok=True)
    model.save_pretrained(args.save, state_dict=state)
    names = set(os.listdir(args.save))
    weights = {"model.safetensors", "model.safetensors.index.json", "pytorch_model.bin"}
    if "config.json" not in names or not names & weights:
        raise ValueError(f"--save {args.save}: save_pretrained wrote no model there (found {sorted(names) or 'nothing'}).")
    tokenizer_note = "no tokenizer (a random-init preset has none)"
    summary["tokenizer_saved"] = False
    if os.path.isdir(args.model):
        from transformers import AutoTokenizer

        try:
            tokenizer = AutoTokenizer.from_pretrained(args.model)
        except (OSError, ValueError):
            tokenizer_note = f"no tokenizer ({args.model} has none)"
        else:
            tokenizer.save_pretrained(args.save)
            summary["tokenizer_saved"] = True
            tokenizer_note = "its tokenizer"
    summary["saved"] = args.save
    print(f"saved the model and {tokenizer_note} to {args.save}", flush=True)


def main(argv=None) -> int:
    try:
        run(argv)
    except (ValueError, TypeError, OSError) as error:
        print(f"membar-train: {_rank_prefix()}{error}", file=sys.stderr)
        return _leave_job(2)
    except torch.OutOfMemoryError as error:
        # A long sequence that does not fit is the commonest failure: one sentence naming what
        # frees GPU memory, instead of PyTorch's traceback.
        said = str(error).strip().splitlines()[0] if str(error).strip() else "out of memory"
        print(f"membar-train: {_rank_prefix()}the GPU ran out of memory ({said[:240]}). Keep pages off it with "
              f"--offload (--gpu-resident-layers auto keeps what fits), store gradient pages in bfloat16 "
              f"(--grad-dtype bfloat16), train with --optimizer logra (no AdamW moments), shorten --chunk or "
              f"--seq-len, or train through a membard whose pools fit (--socket).", file=sys.stderr)
        return _leave_job(4)
    except RuntimeError as error:
        if not _distributed_job():
            raise
        # A collective failed: another rank died, left or hung past --dist-timeout.
        first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        print(f"membar-train: {_rank_prefix()}the job's ranks lost each other (another rank died, left, or waited "
              f"past --dist-timeout): {first}", file=sys.stderr)
        return _leave_job(3)
    return 0


def _leave_job(code: int) -> int:
    """A rank that failed ends its process at once: tearing the process group down at interpreter
    exit can abort (its threads still joinable) or wait for peers that are gone."""
    if not _distributed_job():
        return code
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _distributed_job() -> bool:
    return torch.distributed.is_available() and torch.distributed.is_initialized()


def _rank_prefix() -> str:
    if not _distributed_job():
        return ""
    return f"rank {torch.distributed.get_rank()} of {torch.distributed.get_world_size()}: "


if __name__ == "__main__":
    sys.exit(main())
