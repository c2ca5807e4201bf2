"""The long-range learning experiment: recall a key >= 16K tokens back.

A small model is trained from scratch with OOMB on whole RecallTask sequences (membar.oomb.tasks),
and the same model, for the same number of steps, on the last `short_window` tokens only (the
questions, but never the key): the control that cannot learn. `bench/oomb_bench.py --learning`
runs it on the H200 (the issue's >= 90% goal) and `membar-train --demo` runs it on a GPU.
"""
from __future__ import annotations

import math
import time

import torch

from .config import OOMBConfig
from .tasks import RecallTask, passkey_accuracy
from .trainer import OOMBTrainer


def recall_experiment(seconds: float, *, device: torch.device | str | None = None, distance: int = 16384,
                      batch: int = 4, lr: float = 1e-2, chunk: int = 4096, mode: str = "dense",
                      eval_sequences: int = 64, eval_seconds: float = 20.0, target: float = 0.97,
                      short_window: int = 4096, log=print) -> dict:
    """Trains for about `seconds` (72% of it the whole-sequence model, then the control for the
    same steps); returns the outcome (accuracies, steps, curve). The whole-sequence run ends early
    once held-out accuracy reaches `target`. On CUDA the model is bf16 with float32 master weights
    (AdamW steps the masters, the model gets a rounded copy, so late small updates are not lost);
    on the CPU it is float32."""
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    from transformers import Qwen2Config, Qwen2ForCausalLM

    num_keys, vocab = 8, 1024
    task = RecallTask(vocab, distance, num_keys=num_keys, key_tokens=2048, queries=8, seed=1)
    held_out_task = RecallTask(vocab, distance, num_keys=num_keys, key_tokens=2048, queries=8, seed=1000)
    held_out = [held_out_task.batch(1) for _ in range(eval_sequences)]
    outcome = {"task": "recall", "tokens": task.tokens, "distance": distance, "num_keys": num_keys,
               "chance": 1 / num_keys, "device": str(device), "dtype": str(dtype), "batch": batch,
               "lr": lr, "budget_seconds": seconds, "chunk": chunk, "mode": mode}
    steps_done = None
    for name, window, share in (("oomb_full_context", None, 0.72), ("short_window", short_window, 0.22)):
        torch.manual_seed(0)
        # The `demo` preset's shape (one layer, one head, tied embeddings, vocabulary 1024), with
        # head_dim 64 for the GPU kernels.
        config = Qwen2Config(hidden_size=64, num_hidden_layers=1, num_attention_heads=1, num_key_value_heads=1,
                             head_dim=64, intermediate_size=128, vocab_size=vocab, tie_word_embeddings=True,
                             max_position_embeddings=task.tokens + 1024, rope_theta=1e6, attn_implementation="sdpa")
        model = Qwen2ForCausalLM(config).to(device=device, dtype=dtype)
        trainer = OOMBTrainer(model, OOMBConfig(chunk_tokens=chunk, page_tokens=64, mode=mode, top_k=16,
                                                query_tile_tokens=128))
        parameters = list(model.parameters())
        masters = [parameter.detach().float().clone().requires_grad_(True) for parameter in parameters]
        optimizer = torch.optim.AdamW(masters, lr=lr, weight_decay=0.0)
        budget = seconds * share
        if window is None:
            # Untrained, the model already leans towards the key (its 2048 copies fill part of what
            # attention averages and the embeddings are tied): the baseline to learn from.
            outcome["accuracy_before_training"] = passkey_accuracy(trainer, held_out_task, len(held_out),
                                                                   batches=held_out)
            log(f"{name}: held-out accuracy before training {outcome['accuracy_before_training']:.0%}")
        started = time.monotonic()
        curve, step, losses = [], 0, []
        last_eval = started
        while True:
            elapsed = time.monotonic() - started
            if steps_done is not None:
                if step >= steps_done:
                    break
                progress = step / max(steps_done, 1)
            else:
                if elapsed >= budget:
                    break
                progress = elapsed / budget
            for group in optimizer.param_groups:   # cosine decay to a tenth over the run
                group["lr"] = lr * (0.1 + 0.45 * (1 + math.cos(math.pi * min(progress, 1.0))))
            sample = task.batch(batch)
            ids, labels = sample.input_ids, sample.labels
            if window is not None:
                ids, labels = ids[:, -window:], labels[:, -window:]   # the questions, but not the key
            losses.append(trainer.step(ids, labels))
            for master, parameter in zip(masters, parameters):
                master.grad = parameter.grad.float() if parameter.grad is not None else None
                parameter.grad = None
            torch.nn.utils.clip_grad_norm_(masters, 1.0)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            with torch.no_grad():
                for master, parameter in zip(masters, parameters):
                    parameter.copy_(master)
            step += 1
            if window is None and time.monotonic() - last_eval >= eval_seconds:
                accuracy = passkey_accuracy(trainer, held_out_task, len(held_out), batches=held_out[:32])
                curve.append({"step": step, "seconds": time.monotonic() - started, "accuracy": accuracy,
                              "loss": sum(losses[-10:]) / len(losses[-10:])})
                log(f"{name}: step {step}, {curve[-1]['seconds']:.0f} s, answer loss {curve[-1]['loss']:.3f}, "
                    f"held-out accuracy {accuracy:.0%}")
                last_eval = time.monotonic()
                if accuracy >= target:
                    break
        train_seconds = time.monotonic() - started
        accuracy = passkey_accuracy(trainer, held_out_task, len(held_out), batches=held_out)
        outcome[name] = {"accuracy": accuracy, "steps": step, "train_seconds": train_seconds, "window": window,
                         "final_loss": sum(losses[-10:]) / max(len(losses[-10:]), 1), "curve": curve,
                         "tokens_per_second": trainer.stats.get("tokens_per_second")}
        log(f"{name}: held-out accuracy {accuracy:.0%} ({len(held_out)} sequences) after {step} steps "
            f"({train_seconds:.0f} s; chance {1 / num_keys:.0%})")
        steps_done = step
    outcome["goal_met"] = outcome["oomb_full_context"]["accuracy"] >= 0.9
    return outcome
