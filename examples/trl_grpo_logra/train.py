"""TRL's GRPOTrainer with LoGRA on two-digit addition: sketches instead of gradients, LoGRAOptimizer
instead of AdamW, predicted-KL step control, every update published as (seed, U) for a follower.

  1. SFT (plain PyTorch, a few hundred steps): a tiny random-init Qwen2 learns the answer format
     of examples/logra_rl/task.py ("<bos> 4 7 + 0 8 =" -> "0 5 5 <eos>").
  2. GRPO with TRL: membar.integrations.logra.LoGRAGRPOTrainer wraps the projections, TRL samples
     groups of completions from the trained model itself (updated in place, nothing copied),
     scores them with a rule-based reward (digits right), and steps LoGRA.
  3. A follower model (a copy of the SFT weights) receives only the published (seed, U)
     messages through shared memory and ends with the trainer's weights, bit for bit.

Run from the repository root (CPU: about two minutes with the defaults):
  .venv/bin/python examples/trl_grpo_logra/train.py
  .venv/bin/python examples/trl_grpo_logra/train.py --task seven --sft-steps 0   # trivial task, no SFT
Needs trl (tools/setup.sh installs it).
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import sys
import time
import uuid
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "logra_rl"))
import task  # noqa: E402  (the addition task of the LoGRA RL example)

# Token strings for the task's ids (digits 0-9, then + = <bos> <eos> <pad> <unk>).
TOKENS = list("0123456789") + ["+", "=", "<bos>", "<eos>", "<pad>", "<unk>"]


def make_tokenizer():
    """A word-level tokenizer over the task's 16 tokens (no download): "<bos> 4 7 + 0 8 =" gives
    the task's ids, and adds no special token of its own."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    core = Tokenizer(models.WordLevel({token: index for index, token in enumerate(TOKENS)}, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    core.decoder = decoders.WordPiece(prefix="##", cleanup=False)   # joins tokens with spaces
    return PreTrainedTokenizerFast(tokenizer_object=core, bos_token="<bos>", eos_token="<eos>", pad_token="<pad>",
                                   unk_token="<unk>", padding_side="left")


def make_dataset(count: int, seed: int):
    """Prompts (strings) with their operands as extra columns, which TRL hands to the reward."""
    from datasets import Dataset

    a, b = task.sample_problems(count, torch.Generator().manual_seed(seed))
    prompts = [" ".join(TOKENS[t] for t in row) for row in task.encode_prompts(a, b).tolist()]
    return Dataset.from_dict({"prompt": prompts, "a": a.tolist(), "b": b.tolist()})


def addition_reward(completion_ids, a, b, **_):
    """The fraction of the three answer digits that are right; 0 when the format is broken."""
    answers = torch.full((len(completion_ids), task.ANSWER_TOKENS), task.PAD)
    for row, ids in enumerate(completion_ids):
        ids = list(ids)[:task.ANSWER_TOKENS]
        answers[row, :len(ids)] = torch.tensor(ids, dtype=torch.long)
    reward, _ = task.rewards(answers, torch.tensor(a), torch.tensor(b))
    return reward.tolist()


def seven_reward(completion_ids, **_):
    """A trivial verifiable task: the share of completion tokens that are the digit 7."""
    return [sum(1 for t in ids if t == 7) / max(len(ids), 1) for ids in completion_ids]


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--task", choices=["addition", "seven"], default="addition")
    parser.add_argument("--sft-steps", type=int, default=300, help="teacher-forced warm-up steps (0: none)")
    parser.add_argument("--steps", type=int, default=30, help="GRPO updates")
    parser.add_argument("--prompts", type=int, default=8, help="prompts per update")
    parser.add_argument("--group", type=int, default=8, help="completions per prompt (GRPO's num_generations)")
    parser.add_argument("--rank", type=int, default=32)
    parser.add_argument("--lr", type=float, default=1e-3, help="eta (the KL control scales each step by alpha <= 1)")
    parser.add_argument("--kl-delta", type=float, default=5e-3, help="target KL per update")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", default=os.path.join(os.environ.get("MEMBAR_RESULTS_DIR", "bench/results/latest"),
                                                      "trl_grpo_logra"))
    args = parser.parse_args(argv)
    for name in ("steps", "prompts", "rank"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be at least 1, got {getattr(args, name)}")
    if args.group < 2:
        parser.error(f"--group must be at least 2: group-relative advantages compare completions of one prompt "
                     f"(with {args.group} every advantage is 0)")
    return args


def supervised_warmup(model, steps: int, seed: int) -> None:
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    generator = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        a, b = task.sample_problems(128, generator)
        prompts, answers = task.encode_prompts(a, b), task.encode_answers(a, b)
        inputs = torch.cat([prompts, answers[:, :-1]], dim=1)
        logits = model(input_ids=inputs).logits[:, task.PROMPT_TOKENS - 1:, :]
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), answers.reshape(-1))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)


def main(argv=None) -> dict:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    from transformers import Qwen2ForCausalLM
    from trl import GRPOConfig

    from membar.integrations.logra import LoGRAGRPOTrainer, LoGRASettings
    from membar.logra import target_weights
    from membar.logra.sync import PolicySubscriber

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    model = Qwen2ForCausalLM(task.tiny_qwen2_config())
    if args.sft_steps:
        supervised_warmup(model, args.sft_steps, args.seed)
    follower = copy.deepcopy(model)   # will see only the published (seed, U) messages
    tokenizer = make_tokenizer()
    config = GRPOConfig(output_dir=str(out / "checkpoints"), learning_rate=args.lr, lr_scheduler_type="constant",
                        per_device_train_batch_size=args.prompts * args.group, num_generations=args.group,
                        max_completion_length=task.ANSWER_TOKENS, temperature=1.0, max_steps=args.steps,
                        logging_steps=1, save_strategy="no", report_to=[], use_cpu=True, seed=args.seed,
                        gradient_checkpointing=False, disable_tqdm=True, beta=0.0)
    channel = f"membar_trl_grpo_{uuid.uuid4().hex[:10]}"
    reward = addition_reward if args.task == "addition" else seven_reward
    trainer = LoGRAGRPOTrainer(model=model, reward_funcs=reward, args=config,
                               train_dataset=make_dataset(args.steps * args.prompts, args.seed + 1),
                               processing_class=tokenizer, sync_channel=channel,
                               logra=LoGRASettings(rank=args.rank, seed=args.seed + 1000, kl_delta=args.kl_delta))
    subscriber = PolicySubscriber(channel, target_weights(follower))
    started = time.time()
    try:
        trainer.train()
        subscriber.poll()
        same = all(torch.equal(mine, theirs) for mine, theirs in
                   zip(target_weights(follower).values(), target_weights(model).values()))
        updates = subscriber.applied
    finally:
        subscriber.close()
        trainer.policy_publisher.close()
    history = [entry for entry in trainer.state.log_history if "reward" in entry]
    rewards = [entry["reward"] for entry in history]
    publisher = trainer.policy_publisher
    dense_adam_bytes = sum(2 * w.numel() * 4 for w in target_weights(model).values())
    summary = {"task": args.task, "rewards": rewards, "alpha": [e.get("logra/alpha") for e in history],
               "seconds": time.time() - started, "follower_matches_trainer": same, "updates_followed": updates,
               "sync_payload_bytes": publisher.payload_bytes, "full_weight_bytes": publisher.full_weight_bytes,
               "optimizer_state_bytes": trainer.logra_optimizer.state_bytes(), "dense_adam_state_bytes": dense_adam_bytes}
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    first, last = rewards[:5], rewards[-5:]
    print(f"reward (mean of 5 updates) {sum(first) / len(first):.3f} -> {sum(last) / len(last):.3f} over "
          f"{len(rewards)} updates ({summary['seconds']:.0f} s)")
    print(f"optimizer state {summary['optimizer_state_bytes'] / 2**10:.0f} KiB (dense Adam on the same weights: "
          f"{dense_adam_bytes / 2**10:.0f} KiB); sync {publisher.payload_bytes / 2**10:.0f} KiB "
          f"per update (whole weights: {publisher.full_weight_bytes / 2**10:.0f} KiB)")
    print(f"follower applied {updates} (seed, U) updates: weights {'identical to' if same else 'DIFFER from'} "
          f"the trainer's")
    return summary


if __name__ == "__main__":
    main()
