"""LoGRA in Hugging Face Trainers: TRL's ``GRPOTrainer`` trained through gradient sketches.

    from membar.integrations.logra import LoGRAGRPOTrainer, LoGRASettings
    trainer = LoGRAGRPOTrainer(model=model, reward_funcs=reward, args=GRPOConfig(...),
                               train_dataset=prompts, processing_class=tokenizer,
                               logra=LoGRASettings(rank=32, kl_delta=5e-3))
    trainer.train()

Note [LoGRA inside a Trainer]
  Rationale: GRPO's cost is the policy's optimizer state and the weights that travel to the
  sampler after every update; LoGRA replaces both (rank-r sketches and moments, (seed, U)
  messages), and should do so without rewriting TRL's loop (rollouts, rewards, advantages,
  clipping, logging, checkpoints).
  Approach: before TRL builds anything, :func:`~membar.logra.apply_logra` wraps the policy's
  projections, so every backward TRL runs accumulates sketches instead of dense gradients.
  :class:`LoGRATorchOptimizer` gives :class:`~membar.logra.LoGRAOptimizer` the face of a
  ``torch.optim.Optimizer`` (param_groups with a learning rate that the Trainer's scheduler
  drives, step, zero_grad, state_dict), and is handed to the Trainer as its optimizer. The
  predicted-KL step control keeps working: every training micro-batch's inputs become the
  probe of the next update (its first ``probe_sequences`` prompt + completion rows, completion
  positions only). Generation: TRL's in-process path (``use_vllm=False``) samples from the
  trained model itself, which the fused update changes in place: nothing is copied. Other
  processes follow through a ``PolicyPublisher`` (``sync_channel``): (seed, step,
  alpha * eta * U) per update, applied by ``PolicySubscriber`` with the trainer's kernel.
  Limitations: TRL's vLLM paths (``use_vllm=True``) still copy whole weights after every update
  (``VLLMGeneration.sync_weights``: an NCCL broadcast to ``trl vllm-serve``, or ``load_weights``
  in colocate mode); receiving (seed, U) there needs a subscriber inside vLLM's worker, which
  TRL's server does not let a caller install, and whose fused qkv/gate-up weights would need the
  update split per projection. ``max_grad_norm`` clips nothing (there are no dense gradients;
  the KL control bounds the step instead). One process (no DDP/FSDP/DeepSpeed). A reference
  model (beta > 0) is TRL's own frozen copy, untouched by LoGRA.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from membar.logra.linear import DEFAULT_TARGETS, LoGRAModel, apply_logra
from membar.logra.optimizer import KLControl, LoGRAOptimizer, StepResult


@dataclass
class LoGRASettings:
    """What :class:`LoGRAGRPOTrainer` wraps and how it updates. The learning rate (eta) is the
    Trainer's ``learning_rate`` under its scheduler; ``kl_delta`` None turns the predicted-KL
    step control off (alpha = 1)."""

    rank: int = 32
    targets: tuple[str, ...] = DEFAULT_TARGETS
    seed: int = 0
    algorithm: str = "adam"
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    momentum: float = 0.0
    redraw_every: int = 1
    moments_on_redraw: str = "reset_first"
    kl_delta: float | None = 5e-3
    alpha_max: float = 1.0
    probe_sequences: int = 8
    master_weights: bool = False


class LoGRATorchOptimizer(torch.optim.Optimizer):
    """A :class:`~membar.logra.LoGRAOptimizer` as a ``torch.optim.Optimizer``, for Trainers and
    LR schedulers. ``param_groups[0]["lr"]`` is eta at every step (a scheduler changes it);
    ``kl_probe`` is the probe of the next step (set by the trainer); ``step()`` blocks as
    LoGRAOptimizer.step does; ``zero_grad()`` does nothing (the step consumes the sketches)."""

    def __init__(self, logra_optimizer: LoGRAOptimizer,
                 on_step: Callable[[StepResult], None] | None = None):
        weights = logra_optimizer.logra.authoritative_weights()
        super().__init__(weights, {"lr": logra_optimizer.lr})
        self.logra_optimizer = logra_optimizer
        self.kl_probe: Callable | None = None
        self.on_step = on_step
        self.last_result: StepResult | None = None

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        core = self.logra_optimizer
        core.lr = float(self.param_groups[0]["lr"])
        probe = self.kl_probe if core.kl_control is not None else None
        if core.kl_control is not None and probe is None:
            raise RuntimeError("LoGRA's predicted-KL step control needs a probe batch: set kl_probe before step() "
                               "(LoGRAGRPOTrainer sets it from each training micro-batch).")
        if core.lr == 0.0:
            # A scheduler's warm-up can start at 0: the update would be zero (and its predicted KL too).
            core.logra.zero_sketches()
            self.last_result = None
            return loss
        self.last_result = core.step(kl_probe=probe)
        if self.on_step is not None:
            self.on_step(self.last_result)
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Nothing to clear: the sketches are consumed by step(); the wrapped weights are frozen."""

    def state_dict(self) -> dict:
        """The learning rate, LoGRA's update count, draw of A and bias-correction counts, and the
        optimizer moments (on the host): what resuming from a Trainer checkpoint needs."""
        core = self.logra_optimizer
        states = core.states
        moments = {kind: states.flat(kind).detach().cpu().clone()
                   for kind in ("first_moment", "second_moment") if states.allocated(kind)}
        return {"param_groups": [{"lr": group["lr"], "initial_lr": group.get("initial_lr", group["lr"])}
                                 for group in self.param_groups],
                "logra": {"update_index": core.update_index, "key_step": core.logra.key_state.step,
                          "first_count": core._first_count, "second_count": core._second_count,
                          "moments": moments}}

    def load_state_dict(self, state: dict) -> None:
        """Restores what :meth:`state_dict` returned (into an optimizer over the same LoGRA layers)."""
        core = self.logra_optimizer
        for group, saved in zip(self.param_groups, state["param_groups"]):
            group.update(saved)
        saved = state["logra"]
        core.update_index = saved["update_index"]
        core.logra.key_state.step = saved["key_step"]
        core._first_count, core._second_count = saved["first_count"], saved["second_count"]
        for kind, values in saved["moments"].items():
            core.states.flat(kind).copy_(values)


def completion_probe(model, inputs: dict, sequences: int) -> Callable:
    """A predicted-KL probe over a GRPO micro-batch: the logits that predict the completion tokens
    of its first ``sequences`` rows, masked to the real completion tokens."""
    prompt_ids, prompt_mask = inputs["prompt_ids"][:sequences], inputs["prompt_mask"][:sequences]
    completion_ids, completion_mask = inputs["completion_ids"][:sequences], inputs["completion_mask"][:sequences]
    input_ids = torch.cat([prompt_ids, completion_ids], dim=1).detach()
    attention_mask = torch.cat([prompt_mask, completion_mask], dim=1).detach()
    mask = completion_mask.detach().bool()
    first = prompt_ids.shape[1] - 1

    def probe():
        logits = model(input_ids=input_ids, attention_mask=attention_mask).logits
        return logits[:, first:first + completion_ids.shape[1], :], mask

    return probe


def _grpo_trainer_class():
    from trl import GRPOTrainer

    class LoGRAGRPOTrainer(GRPOTrainer):
        """TRL's ``GRPOTrainer`` whose policy trains through LoGRA (Note [LoGRA inside a Trainer]).

        Takes GRPOTrainer's arguments (``model`` must be a loaded ``PreTrainedModel`` already on
        its device and in its dtype; ``optimizers`` is LoGRA's) plus ``logra`` (a
        :class:`LoGRASettings`), ``sync_channel`` (a name: publish every update for
        ``PolicySubscriber`` processes) and ``sync_runtime`` (a membar Runtime whose channels carry
        them; POSIX shared memory without). Attributes: ``logra_model`` (what apply_logra made),
        ``logra_optimizer``, ``policy_publisher`` (or None)."""

        def __init__(self, model, *args, logra: LoGRASettings | None = None, sync_channel: str | None = None,
                     sync_runtime=None, **kwargs):
            if isinstance(model, str):
                raise ValueError("LoGRAGRPOTrainer needs the loaded model (from_pretrained, on its device and in its "
                                 "dtype): LoGRA wraps its projections before the trainer is built.")
            optimizers = kwargs.pop("optimizers", (None, None))
            if optimizers[0] is not None:
                raise ValueError("LoGRAGRPOTrainer brings its own optimizer (LoGRAOptimizer on the sketches); pass "
                                 "optimizers=(None, scheduler) or nothing.")
            settings = logra if logra is not None else LoGRASettings()
            training = kwargs.get("args")
            if training is None:
                raise ValueError("LoGRAGRPOTrainer needs args=GRPOConfig(...) as a keyword (its learning_rate is "
                                 "LoGRA's eta).")
            if training.gradient_checkpointing:
                # Reentrant checkpointing needs an input that requires grad; LoGRA freezes every
                # parameter, so the recomputation must be the non-reentrant kind.
                training.gradient_checkpointing_kwargs = {**(training.gradient_checkpointing_kwargs or {}),
                                                          "use_reentrant": False}
            handle = apply_logra(model, settings.rank, settings.targets, seed=settings.seed,
                                 master_weights=settings.master_weights,
                                 projection="backward" if training.gradient_checkpointing else "forward")
            publisher = None
            if sync_channel is not None:
                from membar.logra.sync import PolicyPublisher

                publisher = PolicyPublisher(sync_channel, handle, runtime=sync_runtime)
            kl_control = (KLControl(delta=settings.kl_delta, alpha_max=settings.alpha_max)
                          if settings.kl_delta is not None else None)
            core = LoGRAOptimizer(handle, lr=training.learning_rate,
                                  algorithm=settings.algorithm, betas=settings.betas, eps=settings.eps,
                                  momentum=settings.momentum, redraw_every=settings.redraw_every,
                                  moments_on_redraw=settings.moments_on_redraw, kl_control=kl_control,
                                  publisher=publisher)
            self.logra_model: LoGRAModel = handle
            self.logra_optimizer = core
            self.policy_publisher = publisher
            self.logra_settings = settings
            self._logra_torch_optimizer = LoGRATorchOptimizer(core, on_step=self._record_logra_step)
            super().__init__(model, *args, optimizers=(self._logra_torch_optimizer, optimizers[1]), **kwargs)
            if self.accelerator.num_processes > 1:
                raise ValueError("LoGRAGRPOTrainer runs in one process (the sketches are not reduced across ranks).")

        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            if model.training and self.logra_optimizer.kl_control is not None:
                self._logra_torch_optimizer.kl_probe = completion_probe(
                    self.accelerator.unwrap_model(model), inputs, self.logra_settings.probe_sequences)
            return super().compute_loss(model, inputs, return_outputs=return_outputs,
                                        num_items_in_batch=num_items_in_batch)

        def _record_logra_step(self, result: StepResult) -> None:
            metrics = self._metrics["train"]
            metrics["logra/alpha"].append(result.alpha)
            if result.predicted_kl is not None:
                metrics["logra/predicted_kl"].append(result.predicted_kl)

    return LoGRAGRPOTrainer


def __getattr__(name: str):
    # LoGRAGRPOTrainer subclasses TRL's GRPOTrainer: made when first asked for, so that this
    # module (and LoGRATorchOptimizer) imports without TRL.
    if name == "LoGRAGRPOTrainer":
        cls = _grpo_trainer_class()
        globals()[name] = cls
        return cls
    raise AttributeError(name)
