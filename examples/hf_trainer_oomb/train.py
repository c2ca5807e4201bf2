"""Long-context fine-tuning from a standard Hugging Face Trainer (or TRL's SFTTrainer), each
micro-batch run as a chunk-recurrent (OOMB) step: exact full-sequence gradients with activation
memory of one chunk. The optimizer, scheduler, logging, checkpoints and data collator are the
Trainer's own.

CPU (tiny random-init model, 2K-token passkey sequences in chunks of 512, about a minute):
  .venv/bin/python examples/hf_trainer_oomb/train.py
  .venv/bin/python examples/hf_trainer_oomb/train.py --trainer sft         # TRL's SFTTrainer
GPU, 64K tokens, a local checkpoint (a Qwen2 or Llama directory with its tokenizer):
  python examples/hf_trainer_oomb/train.py --model /path/to/Qwen2.5-0.5B --seq-len 65536 --chunk 4096 \
      --dtype bfloat16 --steps 4 --offload

The data are passkey sequences (membar.oomb.tasks): a key is stated near the start and asked for
at the end; only the answer is trained (labels -100 elsewhere).
"""
from __future__ import annotations

import argparse
import json
import os
import time

import torch


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="tiny-qwen2", help="a local checkpoint directory or a membar preset name")
    parser.add_argument("--trainer", choices=["hf", "sft"], default="hf", help="transformers.Trainer or TRL's SFTTrainer")
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--chunk", type=int, default=512, help="tokens per chunk")
    parser.add_argument("--page-tokens", type=int, default=128)
    parser.add_argument("--offload", action="store_true", help="keep KV pages in host memory")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument("--steps", type=int, default=6, help="optimizer steps")
    parser.add_argument("--batch", type=int, default=1, help="sequences per micro-batch")
    parser.add_argument("--accumulation", type=int, default=2, help="micro-batches per optimizer step")
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=os.path.join(os.environ.get("MEMBAR_RESULTS_DIR", "bench/results/latest"),
                                                      "hf_trainer_oomb"))
    args = parser.parse_args(argv)
    for name in ("seq_len", "chunk", "steps", "batch", "accumulation"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    if args.chunk % args.page_tokens:
        parser.error(f"--chunk ({args.chunk}) must be a multiple of --page-tokens ({args.page_tokens})")
    return args


def passkey_rows(vocab_size: int, tokens: int, count: int, seed: int) -> list[dict]:
    from membar.oomb.tasks import PasskeyTask

    task = PasskeyTask(vocab_size, tokens, distance=int(tokens * 0.9), num_keys=16, seed=seed)
    rows = []
    for _ in range(count):
        batch = task.batch(1)
        rows.append({"input_ids": batch.input_ids[0].tolist(), "labels": batch.labels[0].tolist()})
    return rows


def collate(rows):
    """The data collator: right padding with token 0, labels -100 and attention_mask 0 there."""
    width = max(len(row["input_ids"]) for row in rows)
    input_ids = torch.zeros((len(rows), width), dtype=torch.long)
    labels = torch.full((len(rows), width), -100, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for index, row in enumerate(rows):
        length = len(row["input_ids"])
        input_ids[index, :length] = torch.tensor(row["input_ids"])
        labels[index, :length] = torch.tensor(row["labels"])
        mask[index, :length] = 1
    return {"input_ids": input_ids, "labels": labels, "attention_mask": mask}


def word_level_tokenizer(vocab_size: int):
    """A stand-in tokenizer for a random-init preset (TRL's SFTTrainer wants one for padding)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    core = Tokenizer(models.WordLevel({f"t{index}": index for index in range(vocab_size)}, unk_token="t1"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=core, pad_token="t0", eos_token="t1", unk_token="t1")


def main(argv=None) -> dict:
    args = parse_args(argv)
    from membar.integrations.oomb import OOMBHFTrainer, oomb_sft_trainer
    from membar.oomb import OOMBConfig
    from membar.oomb.presets import build_model

    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu":
        torch.set_num_threads(1)   # tiny model: threads only add overhead
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[args.dtype]
    model = build_model(args.model, dtype=dtype, device=device, max_positions=args.seq_len, seed=args.seed)
    vocab = model.config.vocab_size
    rows = passkey_rows(vocab, args.seq_len, args.steps * args.batch * args.accumulation, args.seed + 1)
    oomb = OOMBConfig(chunk_tokens=args.chunk, page_tokens=args.page_tokens, offload=args.offload)
    common = dict(output_dir=os.path.join(args.out, "checkpoints"), per_device_train_batch_size=args.batch,
                  gradient_accumulation_steps=args.accumulation, max_steps=args.steps, learning_rate=args.lr,
                  lr_scheduler_type="cosine", warmup_steps=1, logging_steps=1, save_strategy="steps",
                  save_steps=args.steps, save_total_limit=1, report_to=[], use_cpu=device == "cpu",
                  seed=args.seed, disable_tqdm=True)
    if args.trainer == "hf":
        from transformers import TrainingArguments

        trainer = OOMBHFTrainer(model=model, args=TrainingArguments(**common), train_dataset=rows,
                                data_collator=collate, oomb_config=oomb)
    else:
        from datasets import Dataset
        from trl import SFTConfig

        tokenizer = (word_level_tokenizer(vocab) if not os.path.isdir(args.model)
                     else __import__("transformers").AutoTokenizer.from_pretrained(args.model))
        trainer = oomb_sft_trainer(model=model, args=SFTConfig(**common, max_length=None, packing=False, bf16=False),
                                   train_dataset=Dataset.from_list(rows), data_collator=collate,
                                   processing_class=tokenizer, oomb_config=oomb)
    started = time.time()
    trainer.train()
    seconds = time.time() - started
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    stats = trainer.oomb.stats
    summary = {"trainer": args.trainer, "model": args.model, "seq_len": args.seq_len, "chunk": args.chunk,
               "losses": losses, "seconds": seconds, "tokens_per_second": stats.get("tokens_per_second"),
               "peak_gpu_bytes": stats.get("peak_gpu_bytes", 0), "checkpoints": sorted(
                   name for name in os.listdir(common["output_dir"]) if name.startswith("checkpoint"))}
    print(f"{args.trainer}: {len(losses)} optimizer steps of {args.batch * args.accumulation} x {args.seq_len} tokens "
          f"in {seconds:.0f} s; loss {losses[0]:.3f} -> {losses[-1]:.3f}; last micro-batch "
          f"{stats['tokens_per_second']:,.0f} tokens/s in {stats['chunks']} chunks"
          + (f", peak GPU {stats['peak_gpu_bytes'] / 2**30:.1f} GiB" if stats.get("peak_gpu_bytes") else ""))
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "summary.json"), "w") as file:
        json.dump(summary, file, indent=1)
    return summary


if __name__ == "__main__":
    main()
