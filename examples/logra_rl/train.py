"""GRPO-style RL on two-digit addition with LoGRA, a separate rollout process fed by policy sync,
and dense Adam beside it.

  1. SFT: a tiny random-init Qwen2 (~1M parameters) learns the answer format (and some of the
     arithmetic) by teacher forcing, briefly.
  2. RL, twice from the same SFT weights:
     - LoGRA: attention and MLP projections trained through sketches (rank r), Adam on the
       sketches, predicted-KL step control; a rollout PROCESS keeps its own model copy and
       receives every update as (seed, step, alpha * eta * U) through the shared-memory ring:
       channels of a membard daemon with --socket (sketches and moments then live in the
       daemon's pages too, where its backend matches the device), POSIX shared memory without.
     - Dense: torch.optim.Adam on the same projections, rollouts in-process.
     Both use group-relative advantages: G samples per prompt, A = (R - mean_group) / std_group.
  3. Writes rewards.json and reward_curve.png to --out.

Run from the repository root (CPU: a few minutes; GPU used when present):
  PYTHONPATH=bindings/python .venv/bin/python examples/logra_rl/train.py
  membard --backend host --socket /tmp/membard.sock --foreground &   # optional: sync via the daemon
  PYTHONPATH=bindings/python .venv/bin/python examples/logra_rl/train.py --socket /tmp/membard.sock
"""
from __future__ import annotations

import argparse
import copy
import json
import multiprocessing
import os
import sys
import time
import uuid
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import task  # noqa: E402  (the example's own module, next to this file)

from membar import logra  # noqa: E402
from membar.logra.sync import PolicyPublisher, PolicySubscriber  # noqa: E402


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sft-steps", type=int, default=300)
    parser.add_argument("--rl-steps", type=int, default=60)
    parser.add_argument("--prompts", type=int, default=32, help="prompts per RL update")
    parser.add_argument("--group", type=int, default=8, help="samples per prompt")
    parser.add_argument("--rank", type=int, default=32)
    parser.add_argument("--lr-logra", type=float, default=1e-3,
                        help="eta; the KL control scales each step by alpha <= 1")
    parser.add_argument("--lr-dense", type=float, default=3e-4)
    parser.add_argument("--kl-delta", type=float, default=5e-3, help="target KL per update (LoGRA)")
    parser.add_argument("--threads", type=int, default=1,
                        help="CPU threads per process (the trainer and the rollout process alternate; more "
                             "threads than cores make PyTorch's spinning workers fight)")
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default="auto")
    parser.add_argument("--socket", default=os.environ.get("MEMBAR_SOCKET") or None,
                        help="membard socket: policy sync through the daemon's channels (default $MEMBAR_SOCKET; "
                             "without one, POSIX shared memory)")
    parser.add_argument("--out", default=os.path.join(os.environ.get("MEMBAR_RESULTS_DIR", "bench/results/latest"), "logra_rl"))
    args = parser.parse_args(argv)
    _check_arguments(parser, args)
    return args


def _check_arguments(parser, args) -> None:
    """One sentence (and exit status 2) for each argument the run cannot use."""
    for flag, value, least in (("--rl-steps", args.rl_steps, 1), ("--prompts", args.prompts, 1),
                               ("--rank", args.rank, 1), ("--threads", args.threads, 1),
                               ("--sft-steps", args.sft_steps, 0)):
        if value < least:
            parser.error(f"{flag} must be at least {least}, got {value}")
    if args.group < 2:
        parser.error(f"--group must be at least 2: advantages compare the samples of one prompt, and with "
                     f"{args.group} every advantage (and every update) is zero")
    for flag, value in (("--lr-logra", args.lr_logra), ("--lr-dense", args.lr_dense), ("--kl-delta", args.kl_delta),
                        ("--temperature", args.temperature)):
        if not value > 0:
            parser.error(f"{flag} must be positive, got {value}")


def answer_log_probs(model, prompts: torch.Tensor, answers: torch.Tensor) -> torch.Tensor:
    """log pi(answer token) [count, 4] under teacher forcing."""
    inputs = torch.cat([prompts, answers[:, :-1]], dim=1)  # [count, 10]
    logits = model(input_ids=inputs).logits[:, task.PROMPT_TOKENS - 1:, :].float()  # [count, 4, vocab]
    return torch.log_softmax(logits, dim=-1).gather(-1, answers.unsqueeze(-1)).squeeze(-1)


def supervised_warmup(model, steps: int, device, generator) -> float:
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    loss = torch.tensor(0.0)
    for _ in range(steps):
        a, b = task.sample_problems(128, generator)
        prompts, answers = task.encode_prompts(a, b).to(device), task.encode_answers(a, b).to(device)
        loss = -answer_log_probs(model, prompts, answers).mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return loss.item()


@torch.no_grad()
def greedy_accuracy(model, device, count=256) -> float:
    generator = torch.Generator().manual_seed(12345)  # fixed held-out problems
    a, b = task.sample_problems(count, generator)
    answers = task.generate(model, task.encode_prompts(a, b).to(device), temperature=0.0, generator=None)
    return task.rewards(answers.cpu(), a, b)[1].float().mean().item()


def group_advantages(reward: torch.Tensor, group: int) -> torch.Tensor:
    grouped = reward.view(-1, group)
    centred = grouped - grouped.mean(dim=1, keepdim=True)
    return (centred / (grouped.std(dim=1, keepdim=True) + 1e-4)).reshape(-1)


def sample_batch(model, prompts_per_update, group, temperature, generator, device):
    a, b = task.sample_problems(prompts_per_update, generator)
    a, b = a.repeat_interleave(group), b.repeat_interleave(group)
    prompts = task.encode_prompts(a, b).to(device)
    answers = task.generate(model, prompts, temperature, generator)
    return a, b, prompts.cpu(), answers.cpu()


def connect_daemon(socket, name):
    """The membard client for --socket, or None (POSIX shared memory, plain tensors)."""
    if not socket:
        return None
    from membar.runtime import Runtime

    return Runtime.connect(socket=socket, embedded=False, name=name)


def rollout_worker(channel: str, model_path: str, device: str, args_dict: dict, requests, results):
    """The rollout process: its own model copy, updated only through the policy channel."""
    torch.set_num_threads(args_dict["threads"])
    from transformers import Qwen2ForCausalLM

    model = Qwen2ForCausalLM(task.tiny_qwen2_config())
    model.load_state_dict(torch.load(model_path, map_location="cpu"))
    model.to(device).eval()
    runtime = connect_daemon(args_dict.get("socket"), "logra-rollout")
    subscriber = PolicySubscriber(channel, logra.target_weights(model), runtime=runtime)
    try:
        while True:
            request = requests.get()
            if request is None:
                return
            version, sample_seed = request
            if not subscriber.wait_for(version, timeout_s=300):
                results.put(RuntimeError(f"rollout: update {version} never arrived"))
                return
            generator = torch.Generator().manual_seed(sample_seed)
            batch = sample_batch(model, args_dict["prompts"], args_dict["group"], args_dict["temperature"],
                                 generator, device)
            # numpy, not torch: torch would share the tensors through file descriptors.
            results.put((version, subscriber.applied, tuple(t.numpy() for t in batch)))
    finally:
        subscriber.close()


def rl_update_loss(model, prompts, answers, advantages):
    log_probs = answer_log_probs(model, prompts, answers)  # [count, 4]
    return -(advantages.unsqueeze(1) * log_probs).mean()


def train_logra(sft_model, args, device, out_dir: Path) -> dict:
    model = copy.deepcopy(sft_model)
    runtime = connect_daemon(args.socket, "logra-trainer")
    states_runtime = runtime if runtime is not None and runtime.device.type == torch.device(device).type else None
    handle = logra.apply_logra(model, rank=args.rank, seed=args.seed + 1000, runtime=states_runtime)
    channel = f"membar_logra_rl_{uuid.uuid4().hex[:10]}"
    publisher = PolicyPublisher(channel, handle, slots=32, snapshot_every=8, runtime=runtime)
    optimizer = logra.LoGRAOptimizer(handle, lr=args.lr_logra, algorithm="adam", publisher=publisher,
                                      kl_control=logra.KLControl(delta=args.kl_delta, alpha_max=1.0))
    model_path = str(out_dir / "sft_model.pt")
    torch.save(sft_model.state_dict(), model_path)
    context = multiprocessing.get_context("spawn")
    requests, results = context.Queue(), context.Queue()
    worker = context.Process(target=rollout_worker, args=(channel, model_path, str(device), vars(args), requests, results))
    worker.start()
    history = {"reward": [], "accuracy": [], "alpha": [], "predicted_kl": [], "seconds": []}
    started = time.time()
    try:
        for update in range(args.rl_steps):
            requests.put((update, args.seed * 100003 + update))
            answer = results.get(timeout=600)
            if isinstance(answer, Exception):
                raise answer
            version, applied, arrays = answer
            a, b, prompts, answers = (torch.from_numpy(array) for array in arrays)
            assert version == update and applied == update, "the rollout must be on-policy"
            reward, _ = task.rewards(answers, a, b)
            advantages = group_advantages(reward, args.group).to(device)
            prompts, answers = prompts.to(device), answers.to(device)
            model.train()
            rl_update_loss(model, prompts, answers, advantages).backward()
            probe_inputs = torch.cat([prompts, answers[:, :-1]], dim=1)[:64]

            def probe():
                return model(input_ids=probe_inputs).logits[:, task.PROMPT_TOKENS - 1:, :]

            result = optimizer.step(kl_probe=probe)
            history["reward"].append(reward.mean().item())
            history["alpha"].append(result.alpha)
            history["predicted_kl"].append(result.predicted_kl)
            history["seconds"].append(time.time() - started)
            if update % 10 == 9 or update == args.rl_steps - 1:
                history["accuracy"].append((update + 1, greedy_accuracy(model, device)))
                print(f"[logra] update {update + 1:3d} reward {history['reward'][-1]:.3f} "
                      f"greedy exact {history['accuracy'][-1][1]:.3f} alpha {result.alpha:.3f}", flush=True)
        requests.put(None)
        worker.join(timeout=60)
    finally:
        if worker.is_alive():
            worker.kill()
        publisher.close()
    history["sync_payload_bytes"] = publisher.payload_bytes
    history["full_weight_bytes"] = publisher.full_weight_bytes
    history["sync_bytes_per_update"] = publisher.payload_bytes
    history["optimizer_state_bytes"] = optimizer.state_bytes()
    history["sync_transport"] = publisher.ring.transport
    history["states"] = handle.states.storage.describe()
    return history


def train_dense(sft_model, args, device) -> dict:
    model = copy.deepcopy(sft_model)
    for parameter in model.parameters():
        parameter.requires_grad_(False)
    weights = list(logra.target_weights(model).values())
    for weight in weights:
        weight.requires_grad_(True)
    optimizer = torch.optim.Adam(weights, lr=args.lr_dense)
    generator = torch.Generator().manual_seed(args.seed + 7)
    history = {"reward": [], "accuracy": [], "seconds": []}
    started = time.time()
    for update in range(args.rl_steps):
        a, b, prompts, answers = sample_batch(model, args.prompts, args.group, args.temperature, generator, device)
        reward, _ = task.rewards(answers, a, b)
        advantages = group_advantages(reward, args.group).to(device)
        model.train()
        rl_update_loss(model, prompts.to(device), answers.to(device), advantages).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        history["reward"].append(reward.mean().item())
        history["seconds"].append(time.time() - started)
        if update % 10 == 9 or update == args.rl_steps - 1:
            history["accuracy"].append((update + 1, greedy_accuracy(model, device)))
            print(f"[dense] update {update + 1:3d} reward {history['reward'][-1]:.3f} "
                  f"greedy exact {history['accuracy'][-1][1]:.3f}", flush=True)
    history["optimizer_state_bytes"] = sum(2 * w.numel() * 4 for w in weights)
    # A rollout process elsewhere would need the updated weights themselves after every update.
    history["sync_bytes_per_update"] = sum(w.numel() * w.element_size() for w in weights)
    return history


def smooth(values, window=5):
    out = []
    for index in range(len(values)):
        chunk = values[max(0, index - window + 1):index + 1]
        out.append(sum(chunk) / len(chunk))
    return out


def plot(histories: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (left, right, costs) = plt.subplots(1, 3, figsize=(16, 4))
    for name, history in histories.items():
        steps = list(range(1, len(history["reward"]) + 1))
        left.plot(steps, history["reward"], alpha=0.25)
        left.plot(steps, smooth(history["reward"]), label=name, color=left.lines[-1].get_color())
        if history["accuracy"]:
            xs, ys = zip(*history["accuracy"])
            right.plot(xs, ys, marker="o", label=name)
    left.set(xlabel="RL update", ylabel="mean sampled reward (digits right)", title="Reward")
    right.set(xlabel="RL update", ylabel="greedy exact match (held-out)", title="Accuracy")
    left.legend()
    right.legend()
    # What LoGRA is for: the optimizer state it keeps and the bytes a policy update sends to a
    # rollout process, beside dense Adam's (two moments; a weight copy per update).
    names = list(histories)
    state = [histories[name]["optimizer_state_bytes"] / 2**10 for name in names]
    sync = [histories[name]["sync_bytes_per_update"] / 2**10 for name in names]
    positions = range(len(names))
    costs.bar([x - 0.2 for x in positions], state, width=0.4, label="optimizer state")
    costs.bar([x + 0.2 for x in positions], sync, width=0.4, label="sync per update (dense: weight copy)")
    costs.set_xticks(list(positions), [name.split(" (")[0] for name in names])
    costs.set(ylabel="KiB", title="Memory and sync bytes")
    costs.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=120)


def main(argv=None):
    args = parse_args(argv)
    device = torch.device("cuda" if args.device == "auto" and torch.cuda.is_available() else
                          ("cpu" if args.device == "auto" else args.device))
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    if device.type == "cpu":
        torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    from transformers import Qwen2ForCausalLM

    model = Qwen2ForCausalLM(task.tiny_qwen2_config()).to(device)
    parameters = sum(p.numel() for p in model.parameters())
    generator = torch.Generator().manual_seed(args.seed)
    started = time.time()
    sft_loss = supervised_warmup(model, args.sft_steps, device, generator)
    sft_accuracy = greedy_accuracy(model, device)
    print(f"[sft] {parameters / 1e6:.2f}M parameters, {args.sft_steps} steps, loss {sft_loss:.3f}, "
          f"greedy exact {sft_accuracy:.3f} ({time.time() - started:.0f} s)", flush=True)
    histories = {
        f"LoGRA r={args.rank} (+KL control, rollout process)": train_logra(model, args, device, out_dir),
        "dense Adam": train_dense(model, args, device),
    }
    summary = {"device": str(device), "parameters": parameters, "sft_steps": args.sft_steps,
               "sft_greedy_exact": sft_accuracy, "args": vars(args), "runs": histories}
    (out_dir / "rewards.json").write_text(json.dumps(summary, indent=1))
    plot(histories, out_dir / "reward_curve.png")
    for name, history in histories.items():
        first, last = history["reward"][:5], history["reward"][-5:]
        print(f"{name}: reward {sum(first) / len(first):.3f} -> {sum(last) / len(last):.3f}, "
              f"greedy exact {sft_accuracy:.3f} -> {history['accuracy'][-1][1]:.3f}, "
              f"{history['seconds'][-1]:.0f} s")
    print("what each run keeps and would send to a rollout process per update (dense: a copy of the weights):")
    for name, history in histories.items():
        print(f"  {name.split(' (')[0]:<12} optimizer state {history['optimizer_state_bytes'] / 2**10:8.0f} KiB, "
              f"sync per update {history['sync_bytes_per_update'] / 2**10:8.0f} KiB")
    print(f"wrote {out_dir / 'reward_curve.png'} and {out_dir / 'rewards.json'}")
    return summary


if __name__ == "__main__":
    main()
