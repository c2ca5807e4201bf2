"""membar.integrations.oomb: a transformers Trainer whose micro-batches run as chunk-recurrent
steps computes the same gradients, updates, logged losses and checkpoints as the plain Trainer
on the full sequences (same optimizer, scheduler, clipping, data collator, accumulation)."""
from __future__ import annotations

import copy

import pytest
import torch

pytest.importorskip("accelerate", reason="transformers' Trainer needs accelerate (tools/setup.sh installs it)")

from transformers import Qwen2Config, Qwen2ForCausalLM, TrainerCallback, TrainingArguments  # noqa: E402
from transformers import Trainer  # noqa: E402

from membar.integrations.oomb import OOMBHFTrainer, oomb_batch  # noqa: E402
from membar.oomb import OOMBConfig  # noqa: E402

VOCAB = 97
PAD = 0


@pytest.fixture(autouse=True)
def _one_thread(one_thread):
    yield


def tiny_model(seed=0):
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(Qwen2Config(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                         num_key_value_heads=2, intermediate_size=96, vocab_size=VOCAB,
                                         max_position_embeddings=4096, rope_theta=10000.0,
                                         attn_implementation="sdpa"))
    with torch.no_grad():
        for parameter in model.parameters():
            if parameter.dim() == 1:
                parameter.add_(0.1 * torch.randn_like(parameter))
    return model.float()


def dataset(count=8, seed=0):
    """Rows of 40-130 tokens whose first 6 tokens (a 'prompt') are not trained."""
    generator = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(count):
        length = int(torch.randint(40, 131, (1,), generator=generator))
        ids = torch.randint(1, VOCAB, (length,), generator=generator)
        labels = ids.clone()
        labels[:6] = -100
        rows.append({"input_ids": ids, "labels": labels})
    return rows


def right_padding_collator(rows):
    """The user's collator: right padding with PAD, labels -100 and attention_mask 0 there."""
    width = max(len(row["input_ids"]) for row in rows)
    input_ids = torch.full((len(rows), width), PAD)
    labels = torch.full((len(rows), width), -100)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for index, row in enumerate(rows):
        length = len(row["input_ids"])
        input_ids[index, :length] = torch.as_tensor(row["input_ids"])
        labels[index, :length] = torch.as_tensor(row["labels"])
        mask[index, :length] = 1
    return {"input_ids": input_ids, "labels": labels, "attention_mask": mask}


class GradientRecorder(TrainerCallback):
    """Copies every parameter's gradient just before each optimizer step (after clipping)."""

    def __init__(self):
        self.steps = []

    def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
        self.steps.append({name: p.grad.detach().clone() for name, p in model.named_parameters()
                           if p.grad is not None})


def train(trainer_class, tmp_path, name, accumulation, **extra):
    model = tiny_model()
    recorder = GradientRecorder()
    args = TrainingArguments(output_dir=str(tmp_path / name), per_device_train_batch_size=2,
                             gradient_accumulation_steps=accumulation, max_steps=3, learning_rate=0.1, optim="sgd",
                             lr_scheduler_type="linear", warmup_steps=1, max_grad_norm=1.0, logging_steps=1,
                             save_strategy="steps", save_steps=3, report_to=[], use_cpu=True, seed=0,
                             dataloader_num_workers=0, disable_tqdm=True)
    trainer = trainer_class(model=model, args=args, train_dataset=dataset(), data_collator=right_padding_collator,
                            callbacks=[recorder], **extra)
    trainer.train()
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    return model, recorder.steps, losses, trainer


@pytest.mark.parametrize("accumulation", [1, 2])
def test_trainer_steps_equal_the_plain_trainers(tmp_path, accumulation):
    reference_model, reference_grads, reference_losses, _ = train(Trainer, tmp_path, "plain", accumulation)
    model, grads, losses, trainer = train(OOMBHFTrainer, tmp_path, "oomb", accumulation,
                                          oomb_config=OOMBConfig(chunk_tokens=32, page_tokens=16))
    assert trainer.oomb.stats["chunks"] >= 3, "the sequences must span several chunks"
    assert len(grads) == len(reference_grads) == 3
    for step, (got, want) in enumerate(zip(grads, reference_grads)):
        assert got.keys() == want.keys()
        for name, reference in want.items():
            error = float((got[name] - reference).abs().max() / reference.abs().max())
            assert error <= 1e-4, f"step {step}: {name}: relative gradient error {error:.3g}"
    for got, want in zip(losses, reference_losses):
        assert abs(got - want) <= 1e-5 * abs(want), (losses, reference_losses)
    # SGD (the update is the gradient, so a tolerance on it means something; Adam's normalisation
    # would blow up differences in gradients that are zero up to rounding).
    for (name, parameter), reference in zip(model.named_parameters(), reference_model.parameters()):
        assert torch.allclose(parameter, reference, atol=1e-6, rtol=1e-5), name
    # The checkpoint the Trainer saved holds the trained weights under the model's own names.
    from safetensors.torch import load_file

    saved = load_file(str(tmp_path / "oomb" / "checkpoint-3" / "model.safetensors"))
    state = model.state_dict()
    assert saved and all(torch.equal(saved[name], state[name]) for name in saved)


def test_batches_that_would_move_positions_are_refused():
    ids = torch.arange(1, 9).reshape(2, 4)
    left = {"input_ids": ids, "attention_mask": torch.tensor([[0, 1, 1, 1], [1, 1, 1, 1]])}
    with pytest.raises(ValueError, match="left-padded"):
        oomb_batch(left)
    packed = {"input_ids": ids, "position_ids": torch.tensor([[0, 1, 0, 1], [0, 1, 2, 3]])}
    with pytest.raises(ValueError, match="packed"):
        oomb_batch(packed)
    input_ids, labels = oomb_batch({"input_ids": ids, "attention_mask": torch.tensor([[1, 1, 0, 0], [1, 1, 1, 1]])})
    assert labels[0].tolist() == [1, 2, -100, -100] and labels[1].tolist() == [5, 6, 7, 8]


def test_mixed_precision_is_refused_with_a_sentence(tmp_path):
    args = TrainingArguments(output_dir=str(tmp_path), use_cpu=True, bf16=True, report_to=[])
    with pytest.raises(ValueError, match="load the model in bfloat16"):
        OOMBHFTrainer(model=tiny_model(), args=args, train_dataset=dataset(2), data_collator=right_padding_collator)


def test_sft_trainer_steps_equal_trls(tmp_path, load_example):
    trl = pytest.importorskip("trl", reason="TRL is not installed (tools/setup.sh installs trl; CI has it)")
    from datasets import Dataset

    from membar.integrations.oomb import oomb_sft_trainer

    word_level_tokenizer = load_example("hf_trainer_oomb").word_level_tokenizer

    rows = [{"input_ids": row["input_ids"].tolist(), "labels": row["labels"].tolist()} for row in dataset(4)]

    def run(name, make):
        model = tiny_model()
        recorder = GradientRecorder()
        config = trl.SFTConfig(output_dir=str(tmp_path / name), per_device_train_batch_size=2,
                               gradient_accumulation_steps=2, max_steps=1, learning_rate=0.1, optim="sgd",
                               logging_steps=1, save_strategy="no", report_to=[], use_cpu=True, seed=0, bf16=False,
                               max_length=None, packing=False, disable_tqdm=True)
        trainer = make(model=model, args=config, train_dataset=Dataset.from_list(rows),
                       data_collator=right_padding_collator, processing_class=word_level_tokenizer(VOCAB),
                       callbacks=[recorder])
        trainer.train()
        return recorder.steps[0], [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]

    reference, reference_losses = run("trl", trl.SFTTrainer)
    grads, losses = run("oomb", lambda **kwargs: oomb_sft_trainer(
        **kwargs, oomb_config=OOMBConfig(chunk_tokens=32, page_tokens=16)))
    assert abs(losses[0] - reference_losses[0]) <= 1e-5 * abs(reference_losses[0])
    for name, want in reference.items():
        error = float((grads[name] - want).abs().max() / want.abs().max())
        assert error <= 1e-4, f"{name}: relative gradient error {error:.3g}"


def test_example_runs_with_both_trainers(tmp_path, load_example):
    train = load_example("hf_trainer_oomb")

    for trainer in ("hf", "sft") if _has_trl() else ("hf",):
        summary = train.main(["--trainer", trainer, "--seq-len", "256", "--chunk", "64", "--page-tokens", "32",
                              "--steps", "2", "--out", str(tmp_path / trainer)])
        assert len(summary["losses"]) == 2 and summary["checkpoints"] == ["checkpoint-2"]


def _has_trl() -> bool:
    try:
        import trl  # noqa: F401
    except ImportError:
        return False
    return True
