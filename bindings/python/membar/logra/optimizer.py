"""LoGRAOptimizer: Adam or SGD on the sketches, merged update W <- W - alpha * eta * U A.

Note [Adam moments when A is redrawn]
Rationale: Adam's moments live in the sketch coordinates: column j of S = G A^T is the gradient
seen along row j of A. When A is redrawn, column j means a fresh random direction.
 - First moment: E over independent A_old, A_new of m_old A_old A_new^T is zero; a kept m would
   push along a direction unrelated to its history (noise with no expected descent), and
   transporting it (m A_old A_new^T, r^2 k work) gives back mostly noise too, since m A_old is a
   rank-r shadow of the dense momentum. So it is reset.
 - Second moment: E[S_ij^2] = sum_c G_ic^2 A_jc^2 + (zero-mean cross terms) = ||G_i||^2 / r for
   every j and every draw of A: the scale it tracks does not depend on A. So it is kept, which
   keeps Adam's per-row normalisation warm across redraws.
Approach: the default policy "reset_first" zeroes m (and restarts m's bias correction) on every
redraw and keeps v with its own bias-correction count. "reset_both" zeroes both (Adam then
degenerates to sign-like steps at every redraw), "keep" keeps both (for experiments with a
fixed A, where nothing changes meaning). With the paper's default of redrawing every update and
"reset_first", the step is U = S / (sqrt(v_hat) + eps): RMSprop on the sketch with Adam's v.
Limitations: weight decay is not applied (W is frozen apart from the sketch updates).

States come from membar.logra.state.allocate_state (plain tensors today, runtime pages later).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from membar.logra import kl as kl_module
from membar.logra import ops
from membar.logra.linear import LoGRAModel
from membar.logra.state import allocate_state

MOMENT_POLICIES = ("reset_first", "reset_both", "keep")


@dataclass
class KLControl:
    """Predicted-KL step control: alpha = min(alpha_max, sqrt(delta / q(D)))."""

    delta: float = 2e-4
    alpha_max: float = 1.0


@dataclass
class StepResult:
    update_index: int        # index of the update just applied (0 for the first)
    alpha: float             # the step scale used
    predicted_kl: float | None  # q(D) of the full (alpha = 1) step, when KL control ran
    key_step: int            # the draw of A the update used


class LoGRAOptimizer:
    """Consumes the sketches of a :class:`LoGRAModel` once per update.

    ``step()`` blocks: it computes U per layer, optionally predicts the KL (one forward-mode pass
    of ``kl_probe``), applies W -= alpha * lr * U A with the fused kernel, publishes the update
    if a publisher is attached, zeroes the sketches and redraws A when due. Call it from the
    training thread after every backward of the update."""

    def __init__(
        self,
        logra: LoGRAModel,
        lr: float,
        algorithm: str = "adam",
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        momentum: float = 0.0,
        redraw_every: int = 1,
        moments_on_redraw: str = "reset_first",
        kl_control: KLControl | None = None,
        publisher=None,
        stochastic_rounding: bool = True,
    ):
        if algorithm not in ("adam", "sgd"):
            raise ValueError(f"algorithm must be 'adam' or 'sgd', got {algorithm!r}")
        if moments_on_redraw not in MOMENT_POLICIES:
            raise ValueError(f"moments_on_redraw must be one of {MOMENT_POLICIES}, got {moments_on_redraw!r}")
        if redraw_every < 1:
            raise ValueError(f"redraw_every must be at least 1 (updates per draw of A), got {redraw_every}")
        if lr <= 0:
            raise ValueError(f"the learning rate must be positive, got {lr}")
        self.logra = logra
        self.lr = float(lr)
        self.algorithm = algorithm
        self.betas = betas
        self.eps = eps
        self.momentum = momentum
        self.redraw_every = redraw_every
        self.moments_on_redraw = moments_on_redraw
        self.kl_control = kl_control
        self.publisher = publisher
        # bf16 weights without fp32 masters are updated with deterministic stochastic rounding
        # (Note [LoGRA stochastic rounding] in membar/kernels/logra.h); fp32 targets ignore it.
        self.stochastic_rounding = stochastic_rounding
        self.update_index = 0
        self._first_moments: list[torch.Tensor | None] = [None] * len(logra.layers)
        self._second_moments: list[torch.Tensor | None] = [None] * len(logra.layers)
        self._first_count = 0   # updates folded into the first moments since their last reset
        self._second_count = 0  # the same for the second moments

    # The per-layer direction U [d, r] fp32 from the sketch, updating the moments.
    def _direction(self, index: int, sketch: torch.Tensor) -> torch.Tensor:
        layer = self.logra.layers[index]
        if self.algorithm == "sgd":
            if self.momentum == 0.0:
                return sketch.clone()
            if self._first_moments[index] is None:
                self._first_moments[index] = allocate_state(sketch.shape, sketch.device, "first_moment")
            buffer = self._first_moments[index]
            buffer.mul_(self.momentum).add_(sketch)
            return buffer.clone()
        beta1, beta2 = self.betas
        if self._first_moments[index] is None:
            self._first_moments[index] = allocate_state((layer.out_features, layer.rank), sketch.device, "first_moment")
            self._second_moments[index] = allocate_state((layer.out_features, layer.rank), sketch.device, "second_moment")
        first, second = self._first_moments[index], self._second_moments[index]
        first.mul_(beta1).add_(sketch, alpha=1 - beta1)
        second.mul_(beta2).addcmul_(sketch, sketch, value=1 - beta2)
        first_hat = first / (1 - beta1 ** (self._first_count + 1))
        second_hat = second / (1 - beta2 ** (self._second_count + 1))
        return first_hat.div_(second_hat.sqrt_().add_(self.eps))

    def step(self, kl_probe: Callable | None = None) -> StepResult:
        layers = self.logra.layers
        key_step = self.logra.key_state.step
        rounding_seed = ops.rounding_seed_for(self.logra.key_state.seed, self.update_index) if self.stochastic_rounding else 0
        alpha = 1.0
        predicted = None
        if self.kl_control is None and self.publisher is None:
            # Nothing needs every U at once: compute and apply layer by layer, so only one
            # layer's U [d, r] exists at a time.
            for index, layer in enumerate(layers):
                self._apply(layer, self._direction(index, layer.sketch_for_accumulation()).mul_(self.lr), rounding_seed)
        else:
            updates = [self._direction(index, layer.sketch_for_accumulation()) for index, layer in enumerate(layers)]
            if self.kl_control is not None:
                if kl_probe is None:
                    raise ValueError("this optimizer has KL control: pass kl_probe to step()")
                prediction = kl_module.predict_kl(self.logra.model, layers, updates, self.lr, kl_probe)
                predicted = prediction.predicted_kl
                alpha = kl_module.step_scale(predicted, self.kl_control.delta, self.kl_control.alpha_max)
            published = []
            for layer, update in zip(layers, updates):
                # The scaled update is what travels to rollout processes; the trainer applies the
                # very same tensor with coefficient 1 so both sides compute the same bits.
                scaled = update.mul_(alpha * self.lr)
                self._apply(layer, scaled, rounding_seed)
                published.append((layer.matrix_id, scaled))
            if self.publisher is not None:
                self.publisher.publish(self.update_index, self.logra.key_state.seed, key_step, published,
                                       stochastic_rounding=self.stochastic_rounding)
        self._first_count += 1
        self._second_count += 1
        self.logra.zero_sketches()
        result = StepResult(update_index=self.update_index, alpha=alpha, predicted_kl=predicted, key_step=key_step)
        self.update_index += 1
        if self.update_index % self.redraw_every == 0:
            self._redraw()
        return result

    @torch.no_grad()
    def _apply(self, layer, scaled_update: torch.Tensor, rounding_seed: int) -> None:
        """W -= scaled_update A (into the fp32 master when kept, then copied to W)."""
        target = layer.master if layer.master is not None else layer.weight
        ops.fused_update_(target, scaled_update, 1.0, layer.current_key(),
                          rounding_seed if target.dtype == torch.bfloat16 else 0)
        if layer.master is not None:
            layer.weight.copy_(layer.master)

    def _redraw(self) -> None:
        self.logra.key_state.step += 1
        if self.moments_on_redraw == "keep":
            return
        # SGD's momentum buffer lives in the same sketch coordinates as Adam's first moment.
        for moment in self._first_moments:
            if moment is not None:
                moment.zero_()
        self._first_count = 0
        if self.moments_on_redraw == "reset_both":
            for moment in self._second_moments:
                if moment is not None:
                    moment.zero_()
            self._second_count = 0

    def state_bytes(self) -> int:
        """Bytes held by sketches, moments and masters (what the runtime will page)."""
        total = 0
        tensors = [layer.sketch for layer in self.logra.layers] + [layer.master for layer in self.logra.layers]
        tensors += self._first_moments + self._second_moments
        for tensor in tensors:
            if tensor is not None:
                total += tensor.numel() * tensor.element_size()
        return total
