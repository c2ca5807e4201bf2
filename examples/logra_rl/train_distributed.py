"""GRPO-style RL with LoGRA over a torch.distributed job: trainer ranks whose frozen weights are
sharded by FSDP2, rollout ranks that follow the policy through broadcast updates (seed, U).

The task, model and loss are train.py's (two-digit addition, a ~1M-parameter Qwen2). Of the job's
ranks, the first --trainers train and the rest sample:
  - rollout rank j samples --prompts / (rollout ranks) prompts x --group answers with its own model
    copy and broadcasts them to every rank;
  - each trainer takes a share of the groups, computes the policy-gradient loss through LoGRA's
    sketches, and LoGRAOptimizer(process_group=trainers) averages the sketches and predicted KLs,
    so every trainer applies the same update to its rows of the sharded weights
    (logra.shard_weights; Note [Sharded frozen weights]);
  - trainer 0 broadcasts the update as (seed, step, alpha * eta * U) to the rollout ranks
    (BroadcastPublisher / BroadcastReceiver; Note [Policy sync by broadcast]), which apply it with
    the trainer's kernel and sample the next batch on-policy.
At the end every rank writes its LoGRA weights to --out (the trainers' gathered from their shards),
and rank 0 writes rewards.json.

  torchrun --nproc_per_node 3 examples/logra_rl/train_distributed.py --trainers 2     # CPU: gloo
  torchrun --nproc_per_node 8 examples/logra_rl/train_distributed.py --trainers 4 --device cuda
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
import task  # noqa: E402
from train import greedy_accuracy, group_advantages, rl_update_loss, supervised_warmup  # noqa: E402

from membar import logra  # noqa: E402
from membar.logra.broadcast import BroadcastPublisher, BroadcastReceiver  # noqa: E402


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trainers", type=int, default=None, help="trainer ranks (default: all but one)")
    parser.add_argument("--sft-steps", type=int, default=300)
    parser.add_argument("--rl-steps", type=int, default=60)
    parser.add_argument("--prompts", type=int, default=32, help="prompts per update, over all rollout ranks")
    parser.add_argument("--group", type=int, default=8, help="samples per prompt")
    parser.add_argument("--rank", type=int, default=32, help="LoGRA sketch rank")
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--kl-delta", type=float, default=5e-3)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--threads", type=int, default=1, help="CPU threads per rank")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds a collective may wait")
    parser.add_argument("--out", default=os.path.join(os.environ.get("MEMBAR_RESULTS_DIR", "bench/results/latest"),
                                                      "logra_rl_distributed"))
    return parser.parse_args(argv)


def _check(args, world: int) -> tuple[int, int]:
    trainers = args.trainers if args.trainers is not None else world - 1
    rollouts = world - trainers
    if trainers < 1 or rollouts < 1:
        raise SystemExit(f"train_distributed: {world} ranks cannot hold {trainers} trainer(s) and at least one rollout "
                         f"rank: start more ranks (torchrun --nproc_per_node) or give --trainers.")
    if args.prompts % rollouts:
        raise SystemExit(f"train_distributed: --prompts {args.prompts} must divide over {rollouts} rollout rank(s).")
    if args.prompts % trainers:
        raise SystemExit(f"train_distributed: --prompts {args.prompts} (groups) must divide over {trainers} trainer(s).")
    if args.group < 2:
        raise SystemExit("train_distributed: --group must be at least 2 (advantages are relative to the group).")
    return trainers, rollouts


def exchange_samples(args, rank: int, trainers: int, rollouts: int, mine, device) -> tuple[torch.Tensor, ...]:
    """Every rollout rank broadcasts its (a, b, answers) to every rank; returns them concatenated
    (rollout rank order): a, b [n], answers [n, 4]."""
    count = args.prompts // rollouts * args.group
    parts = []
    for source in range(trainers, trainers + rollouts):
        packed = torch.empty((count, 2 + task.ANSWER_TOKENS), dtype=torch.int64, device=device)
        if rank == source:
            a, b, answers = mine
            packed.copy_(torch.cat([a.unsqueeze(1), b.unsqueeze(1), answers], dim=1))
        dist.broadcast(packed, source)
        parts.append(packed.cpu())
    packed = torch.cat(parts)
    return packed[:, 0], packed[:, 1], packed[:, 2:]


def train(args, model, rank: int, trainers: int, rollouts: int, trainer_group, sync_group, device) -> dict:
    handle = logra.apply_logra(model, rank=args.rank, seed=args.seed + 1000, runtime=None)
    logra.shard_weights(handle, trainer_group)
    publisher = BroadcastPublisher(handle, group=sync_group, src=0) if rank == 0 else None
    optimizer = logra.LoGRAOptimizer(handle, lr=args.lr, algorithm="adam", publisher=publisher,
                                      kl_control=logra.KLControl(delta=args.kl_delta, alpha_max=1.0),
                                      process_group=trainer_group)
    history = {"reward": [], "alpha": [], "predicted_kl": [], "seconds": []}
    started = time.time()
    groups_each = args.prompts // trainers
    for update in range(args.rl_steps):
        a, b, answers = exchange_samples(args, rank, trainers, rollouts, None, device)
        reward, _ = task.rewards(answers, a, b)
        advantages = group_advantages(reward, args.group)
        rows = slice(rank * groups_each * args.group, (rank + 1) * groups_each * args.group)   # whole groups
        prompts = task.encode_prompts(a[rows], b[rows]).to(device)
        mine = answers[rows].to(device)
        model.train()
        rl_update_loss(model, prompts, mine, advantages[rows].to(device)).backward()
        probe_inputs = torch.cat([prompts, mine[:, :-1]], dim=1)[:64]

        def probe():
            return model(input_ids=probe_inputs).logits[:, task.PROMPT_TOKENS - 1:, :]

        result = optimizer.step(kl_probe=probe)
        history["reward"].append(reward.float().mean().item())
        history["alpha"].append(result.alpha)
        history["predicted_kl"].append(result.predicted_kl)
        history["seconds"].append(time.time() - started)
        if rank == 0 and (update % 10 == 9 or update == args.rl_steps - 1):
            print(f"[trainers] update {update + 1:3d} reward {history['reward'][-1]:.3f} alpha {result.alpha:.3f}",
                  flush=True)
    if publisher is not None:
        publisher.close()
        history["sync_bytes_per_update"] = publisher.payload_bytes
    local = sum(layer.weight.to_local().numel() * layer.weight.element_size() for layer in handle.layers)
    history["frozen_weight_bytes_on_this_rank"] = local
    history["frozen_weight_bytes"] = sum(layer.weight.numel() * layer.weight.element_size() for layer in handle.layers)
    history["weights"] = [w.detach().cpu() for w in logra.full_weights(handle)]
    return history


def roll_out(args, model, rank: int, trainers: int, rollouts: int, sync_group, device) -> dict:
    weights = logra.target_weights(model)
    receiver = BroadcastReceiver(weights, rank=args.rank, group=sync_group, src=0)
    index = rank - trainers
    for update in range(args.rl_steps):
        generator = torch.Generator().manual_seed(args.seed * 100003 + update * 1009 + index)
        a, b = task.sample_problems(args.prompts // rollouts, generator)
        a, b = a.repeat_interleave(args.group), b.repeat_interleave(args.group)
        answers = task.generate(model, task.encode_prompts(a, b).to(device), args.temperature, generator)
        exchange_samples(args, rank, trainers, rollouts, (a.to(device), b.to(device), answers.to(device)), device)
        if receiver.receive() is None:
            raise RuntimeError(f"rollout rank {rank}: the trainers stopped before update {update}")
    if receiver.receive() is not None:
        raise RuntimeError(f"rollout rank {rank}: more updates than --rl-steps")
    return {"applied": receiver.applied, "greedy_exact": greedy_accuracy(model, device),
            "weights": [weights[i].detach().cpu() for i in sorted(weights)]}


def main(argv=None) -> dict:
    args = parse_args(argv)
    backend = "nccl" if args.device == "cuda" else "gloo"
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = torch.device("cuda", local_rank) if args.device == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    else:
        torch.set_num_threads(args.threads)
    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=args.timeout))
    rank, world = dist.get_rank(), dist.get_world_size()
    trainers, rollouts = _check(args, world)
    # Every rank makes every group, in the same order.
    trainer_group = dist.new_group(list(range(trainers)))
    sync_group = dist.new_group([0] + list(range(trainers, world)))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    from transformers import Qwen2ForCausalLM

    torch.manual_seed(args.seed)
    model = Qwen2ForCausalLM(task.tiny_qwen2_config()).to(device)
    started = time.time()
    if rank == 0:   # one SFT, then every rank starts from its weights
        loss = supervised_warmup(model, args.sft_steps, device, torch.Generator().manual_seed(args.seed))
        print(f"[sft] {args.sft_steps} steps, loss {loss:.3f} ({time.time() - started:.0f} s); {trainers} trainer(s) "
              f"with sharded frozen weights, {rollouts} rollout rank(s)", flush=True)
    with torch.no_grad():
        for parameter in model.parameters():
            dist.broadcast(parameter.data, 0)
    if rank < trainers:
        result = train(args, model, rank, trainers, rollouts, trainer_group, sync_group, device)
    else:
        result = roll_out(args, model, rank, trainers, rollouts, sync_group, device)
    torch.save(result.pop("weights"), out / f"weights_rank{rank}.pt")
    if rank == trainers:
        print(f"[rollout] applied {result['applied']} updates by broadcast; greedy exact {result['greedy_exact']:.3f}",
              flush=True)
    summaries = [None] * world
    dist.all_gather_object(summaries, result)
    if rank == 0:
        history = summaries[0]
        summary = {"trainers": trainers, "rollouts": rollouts, "args": vars(args), "trainer": history,
                   "rollout": summaries[trainers], "seconds": time.time() - started}
        (out / "rewards.json").write_text(json.dumps(summary, indent=1))
        first, last = history["reward"][:5], history["reward"][-5:]
        print(f"reward {sum(first) / len(first):.3f} -> {sum(last) / len(last):.3f}; frozen weights per trainer "
              f"{history['frozen_weight_bytes_on_this_rank'] / 2**10:.0f} of {history['frozen_weight_bytes'] / 2**10:.0f} "
              f"KiB; sync per update {history['sync_bytes_per_update'] / 2**10:.0f} KiB; wrote {out / 'rewards.json'}",
              flush=True)
    # No rank tears its connections down while another still uses them (the subgroups too).
    dist.barrier()
    dist.destroy_process_group()
    return summaries[0]


if __name__ == "__main__":
    main()
    # Everything is written and the process group is torn down; leave without the interpreter's
    # finalisation, where a collective library's leftover thread objects have aborted a rank once
    # in CI ("terminate called without an active exception") after a successful run.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
