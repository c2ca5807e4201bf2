"""Chunk-recurrent (OOMB) training steps inside Hugging Face ``Trainer`` and TRL's ``SFTTrainer``.

    from membar.integrations.oomb import OOMBHFTrainer
    trainer = OOMBHFTrainer(model=model, args=TrainingArguments(...), train_dataset=dataset,
                            data_collator=collator, oomb_config=OOMBConfig(chunk_tokens=4096))
    trainer.train()

    from membar.integrations.oomb import oomb_sft_trainer      # TRL
    trainer = oomb_sft_trainer(model=model, args=SFTConfig(...), train_dataset=dataset,
                               processing_class=tokenizer, oomb_config=OOMBConfig(chunk_tokens=4096))

Note [Trainer steps through OOMB]
  Rationale: people fine-tune with a Trainer they already configured (optimizer, scheduler,
  logging, checkpoints, data collator); chunk-recurrent training should change only what one
  micro-batch's forward and backward cost, nothing around it.
  Approach: :class:`OOMBTrainerMixin` overrides ``training_step`` only. It turns the collated
  batch into (input_ids, labels) with -100 on padding, and runs :meth:`OOMBTrainer.step`, which
  leaves in ``.grad`` the gradient of the full-sequence loss. The step is weighed as the parent
  Trainer would weigh the micro-batch's loss: its summed token loss over ``num_items_in_batch``
  when the Trainer counts tokens across gradient accumulation (the default for causal LMs, and
  what TRL's SFTTrainer does), else its mean loss over the accumulation steps. The Trainer
  then clips, steps the optimizer and the scheduler, logs the returned loss and saves
  checkpoints as usual (the model's weights are the model's: membar adds no parameter).
  Evaluation and generation run the model's ordinary forward (membar's attention falls back to
  SDPA outside a chunk-recurrent step).
  Limitations: one process (no DDP/FSDP/DeepSpeed: chunk-recurrent steps call backward once per
  chunk, which their gradient hooks do not expect); mixed precision through the Trainer's
  autocast (bf16=True / fp16=True) is refused: load the model in bfloat16 instead; right padding
  only (left padding shifts positions); no packed sequences (position_ids that restart); no
  custom ``compute_loss_func`` or label smoothing, and a subclass's own ``compute_loss`` (TRL's
  entropy and token-accuracy metrics) is not called for training micro-batches.
"""
from __future__ import annotations

import torch
from transformers import Trainer

from membar.oomb.config import OOMBConfig
from membar.oomb.trainer import IGNORE_INDEX, OOMBTrainer


class OOMBTrainerMixin:
    """Put before a ``transformers.Trainer`` subclass: ``class T(OOMBTrainerMixin, SFTTrainer)``.

    Keyword arguments taken here (everything else goes to the Trainer): ``oomb_config`` (an
    :class:`~membar.oomb.config.OOMBConfig`; default chunks of 4096 tokens, dense attention) and
    ``oomb_store`` (where KV pages live, as :class:`~membar.oomb.trainer.OOMBTrainer` takes it).
    See Note [Trainer steps through OOMB]."""

    def __init__(self, *args, oomb_config: OOMBConfig | None = None, oomb_store=None, **kwargs):
        super().__init__(*args, **kwargs)
        config = oomb_config if oomb_config is not None else OOMBConfig()
        training = self.args
        if training.gradient_checkpointing and not config.checkpoint_layers:
            # Chunk-recurrent steps recompute layers through OOMBTrainer's own checkpointing.
            from dataclasses import replace

            config = replace(config, checkpoint_layers=True)
        _refuse_unsupported(self)
        self.oomb_config = config
        self._oomb_store = oomb_store
        self._oomb: OOMBTrainer | None = None

    @property
    def oomb(self) -> OOMBTrainer:
        """The chunk-recurrent stepper, made at the first training step (once the Trainer has put
        the model on its device)."""
        if self._oomb is None:
            model = self.accelerator.unwrap_model(self.model)
            self._oomb = OOMBTrainer(model, self.oomb_config, store=self._oomb_store)
        return self._oomb

    def training_step(self, model, inputs, num_items_in_batch=None) -> torch.Tensor:
        """One micro-batch: a chunk-recurrent forward and backward (gradients accumulate into
        ``.grad``); returns the micro-batch's weighted loss, as ``Trainer.training_step`` does."""
        model.train()
        if hasattr(self.optimizer, "train") and callable(self.optimizer.train):
            self.optimizer.train()
        input_ids, labels = oomb_batch(inputs)
        predicted = int((labels[:, 1:] != IGNORE_INDEX).sum())
        scale = self._micro_batch_weight(predicted, num_items_in_batch)
        if predicted == 0:
            return torch.zeros((), device=self.args.device)
        loss = self.oomb.step(input_ids, labels, loss_scale=scale)
        return torch.tensor(loss, device=self.args.device)

    def _micro_batch_weight(self, predicted: int, num_items_in_batch) -> float:
        """What the parent Trainer multiplies this micro-batch's mean token loss by."""
        counts_items = self.model_accepts_loss_kwargs or self.compute_loss_func is not None
        if num_items_in_batch is not None and counts_items:
            # The loss is summed over the micro-batch's tokens and divided by the tokens of every
            # micro-batch of the accumulated step (one process: no cross-device factor).
            return predicted / float(num_items_in_batch)
        if self.compute_loss_func is None:
            return 1.0 / self.current_gradient_accumulation_steps
        return 1.0


def _refuse_unsupported(trainer) -> None:
    """One sentence for each Trainer configuration a chunk-recurrent step cannot reproduce."""
    args = trainer.args
    if args.world_size > 1 or args.n_gpu > 1:
        raise ValueError("chunk-recurrent Trainer steps run in one process on one device (no DDP, FSDP, DeepSpeed "
                         "or DataParallel): launch one process and make one device visible.")
    if args.bf16 or args.fp16:
        raise ValueError("chunk-recurrent Trainer steps do not run under the Trainer's autocast (bf16=True / "
                         "fp16=True): load the model in bfloat16 (dtype=torch.bfloat16) and leave both off.")
    if callable(trainer.compute_loss_func):
        raise ValueError("a custom compute_loss_func cannot be used with chunk-recurrent steps: they compute the "
                         "next-token cross-entropy chunk by chunk.")
    if args.label_smoothing_factor:
        raise ValueError("label smoothing cannot be used with chunk-recurrent steps: they compute the plain "
                         "next-token cross-entropy.")
    loss_type = getattr(args, "loss_type", None)
    if loss_type not in (None, "nll"):
        raise ValueError(f"loss_type {loss_type!r} cannot be used with chunk-recurrent steps: they compute the "
                         "plain next-token cross-entropy ('nll').")
    if getattr(args, "padding_free", False) or getattr(args, "packing", False):
        raise ValueError("packed or padding-free batches restart positions inside a row, which chunk-recurrent "
                         "steps do not support: set packing=False and padding_free=False.")


def oomb_batch(inputs: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """(input_ids, labels) [batch, tokens] from a collated Trainer batch: labels default to
    input_ids, and are -100 wherever attention_mask is 0. Refuses what would change the
    positions of real tokens (left padding, packed rows)."""
    if "input_ids" not in inputs:
        raise ValueError(f"chunk-recurrent steps need input_ids in the batch, got {sorted(inputs)}.")
    input_ids = inputs["input_ids"]
    labels = inputs.get("labels")
    labels = input_ids.clone() if labels is None else labels.clone()
    if "shift_labels" in inputs:
        raise ValueError("the batch carries shift_labels (a padding-free collator): chunk-recurrent steps take "
                         "labels aligned with input_ids.")
    positions = inputs.get("position_ids")
    if positions is not None:
        expected = torch.arange(input_ids.shape[1], device=positions.device).expand_as(positions)
        if not torch.equal(positions, expected):
            raise ValueError("the batch's position_ids restart inside a row (packed sequences), which chunk-"
                             "recurrent steps do not support.")
    mask = inputs.get("attention_mask")
    if mask is not None:
        mask = mask.bool()
        # Right padding: each row is ones then zeros, so no real token comes after a pad.
        if bool((mask[:, 1:] & ~mask[:, :-1]).any()):
            raise ValueError("the batch is left-padded (or has holes in attention_mask): chunk-recurrent steps "
                             "need right padding (tokenizer.padding_side = 'right').")
        labels = labels.masked_fill(~mask.to(labels.device), IGNORE_INDEX)
    return input_ids, labels


class OOMBHFTrainer(OOMBTrainerMixin, Trainer):
    """``transformers.Trainer`` whose training micro-batches run as chunk-recurrent steps."""


def oomb_sft_trainer(**kwargs):
    """TRL's ``SFTTrainer`` with chunk-recurrent training steps (the same keyword arguments, plus
    ``oomb_config`` and ``oomb_store``). Needs ``trl``."""
    return _sft_trainer_class()(**kwargs)


def _sft_trainer_class():
    from trl import SFTTrainer

    global OOMBSFTTrainer
    if OOMBSFTTrainer is None:
        OOMBSFTTrainer = type("OOMBSFTTrainer", (OOMBTrainerMixin, SFTTrainer),
                              {"__doc__": "TRL's SFTTrainer whose training micro-batches run as chunk-recurrent "
                                          "steps (Note [Trainer steps through OOMB])."})
    return OOMBSFTTrainer


# Made on first use by oomb_sft_trainer, so that importing this module does not need TRL.
OOMBSFTTrainer = None
