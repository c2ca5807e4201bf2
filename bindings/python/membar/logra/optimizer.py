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

States are flat buffers of membar.logra.state.LoGRAStates (Note [LoGRA state storage]): every
elementwise step of the optimizer runs once over all layers, and U is computed over the sketch
buffer (the sketches are consumed by the update), so no [d, r] tensor is allocated per layer.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable

import torch

from membar.logra import kl as kl_module
from membar.logra import ops, sharding
from membar.logra.linear import LoGRAModel

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
    # With a process group: what this rank sent to average the sketches (d x r per matrix, fp32,
    # never the d x k gradients) and how long the all-reduce took (0 without one).
    reduced_bytes: int = 0
    reduce_seconds: float = 0.0


class LoGRAOptimizer:
    """Consumes the sketches of a :class:`LoGRAModel` once per update.

    ``step()`` blocks: it computes U for all layers at once, optionally predicts the KL (one
    forward-mode pass of ``kl_probe``), applies W -= alpha * lr * U A with the fused kernel,
    publishes the update if a publisher is attached, zeroes the sketches, redraws A when due and,
    with ``offload_moments``, hands the moments to host memory until the next update. Call it
    from the training thread after every backward of the update."""

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
        offload_moments: bool = False,
        exact_update: bool = False,
        process_group=None,
    ):
        if algorithm not in ("adam", "sgd"):
            raise ValueError(f"algorithm must be 'adam' or 'sgd', got {algorithm!r}")
        if moments_on_redraw not in MOMENT_POLICIES:
            raise ValueError(f"moments_on_redraw must be one of {MOMENT_POLICIES}, got {moments_on_redraw!r}")
        if redraw_every < 1:
            raise ValueError(f"redraw_every must be at least 1 (updates per draw of A), got {redraw_every}")
        if lr <= 0:
            raise ValueError(f"the learning rate must be positive, got {lr}")
        if algorithm == "sgd" and momentum != 0.0 and redraw_every == 1 and moments_on_redraw != "keep":
            # The momentum buffer lives in the coordinates of one draw of A and is reset on every
            # redraw (Note [Adam moments when A is redrawn]): redrawn after every update, it never
            # holds more than the current sketch, and momentum would change nothing.
            raise ValueError(f"SGD momentum {momentum} has no effect when A is redrawn after every update "
                             f"(redraw_every=1): the momentum buffer is reset on each redraw. Use redraw_every > 1, "
                             f"moments_on_redraw='keep', or momentum=0.")
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
        # Keep the moments in host memory between updates (Note [LoGRA state storage]).
        self.offload_moments = offload_moments
        # On the GPU: the CUDA-core update kernel, bit-identical to the CPU, instead of the
        # tensor-core one (Note [LoGRA tensor-core update]). Receivers must use the same choice
        # to stay bit-identical.
        self.exact_update = exact_update
        # Data parallel (Note [Sharded frozen weights] in sharding.py): the ranks' sketches and
        # predicted KLs are averaged before each update, so every rank applies the same U.
        self.process_group = process_group
        if any(layer.split is not None for layer in logra.layers):
            # Note [LoGRA over split heads]: what is not split yet.
            if kl_control is not None:
                raise ValueError("predicted-KL step control is not supported on a head-parallel (tensor-parallel) "
                                 "model: its forward-mode pass does not cross the split layers' all-reduces; use "
                                 "kl_control=None or data parallel.")
            if publisher is not None:
                raise ValueError("publishing updates from a head-parallel (tensor-parallel) model is not supported: "
                                 "receivers apply (seed, U) to whole weights, whose column blocks this rank updates "
                                 "in another order; publish from a data-parallel run.")
        if publisher is not None and getattr(publisher, "snapshot_every", 0) and any(
                sharding.is_sharded(layer.weight) for layer in logra.layers):
            raise ValueError("a PolicyPublisher with snapshots (snapshot_every > 0) needs whole weights, and these are "
                             "sharded: publish updates only (snapshot_every=0) or use BroadcastPublisher.")
        self.update_index = 0
        self._first_count = 0   # updates folded into the first moments since their last reset
        self._second_count = 0  # the same for the second moments

    @property
    def states(self):
        return self.logra.states

    @torch.no_grad()
    def _directions(self) -> torch.Tensor:
        """U for every layer at once, written over the flat sketch buffer [total] (the sketches
        are consumed: zeroed after the update). One pass of each elementwise op over all layers."""
        sketch = self.states.flat("sketch")
        if self.algorithm == "sgd":
            if self.momentum != 0.0:
                buffer = self.states.flat("first_moment")
                buffer.mul_(self.momentum).add_(sketch)
                sketch.copy_(buffer)
            return sketch
        beta1, beta2 = self.betas
        first, second = self.states.flat("first_moment"), self.states.flat("second_moment")
        first.mul_(beta1).add_(sketch, alpha=1 - beta1)
        second.mul_(beta2).addcmul_(sketch, sketch, value=1 - beta2)
        first_correction = 1 - beta1 ** (self._first_count + 1)
        second_correction = 1 - beta2 ** (self._second_count + 1)
        # U = (m / c1) / (sqrt(v / c2) + eps), computed into the sketch buffer.
        torch.div(second, second_correction, out=sketch)
        sketch.sqrt_().add_(self.eps)
        torch.div(first, sketch, out=sketch)
        return sketch.div_(first_correction)

    def step(self, kl_probe: Callable | None = None) -> StepResult:
        layers = self.logra.layers
        key_step = self.logra.key_state.step
        rounding_seed = ops.rounding_seed_for(self.logra.key_state.seed, self.update_index) if self.stochastic_rounding else 0
        if self.kl_control is not None and kl_probe is None:
            raise ValueError("this optimizer has KL control: pass kl_probe to step()")
        alpha = 1.0
        predicted = None
        reduced_bytes, reduce_seconds = 0, 0.0
        if self.process_group is not None:
            reduced_bytes, reduce_seconds = self._average_sketches()
        directions = self._directions()
        updates = self.states.views("sketch")  # per layer [d, r] views of `directions`
        if self.kl_control is not None:
            prediction = kl_module.predict_kl(self.logra.model, layers, updates, self.lr, kl_probe)
            predicted = prediction.predicted_kl
            if self.process_group is not None:
                predicted = self._average(predicted)
            alpha = kl_module.step_scale(predicted, self.kl_control.delta, self.kl_control.alpha_max)
        # The scaled update is what travels to rollout processes; the trainer applies the very
        # same tensor with coefficient 1 so both sides compute the same bits.
        directions.mul_(alpha * self.lr)
        for layer, update in zip(layers, updates):
            self._apply(layer, update, rounding_seed)
        if self.publisher is not None:
            self.publisher.publish(self.update_index, self.logra.key_state.seed, key_step,
                                   [(layer.matrix_id, update) for layer, update in zip(layers, updates)],
                                   stochastic_rounding=self.stochastic_rounding)
        self._first_count += 1
        self._second_count += 1
        self.logra.zero_sketches()
        result = StepResult(update_index=self.update_index, alpha=alpha, predicted_kl=predicted, key_step=key_step,
                            reduced_bytes=reduced_bytes, reduce_seconds=reduce_seconds)
        self.update_index += 1
        if self.update_index % self.redraw_every == 0:
            self._redraw()
        if self.offload_moments:
            self.states.offload([kind for kind in ("first_moment", "second_moment") if self.states.allocated(kind)],
                                prefetch_on_sketch_use=True)
        return result

    def _average_sketches(self) -> tuple[int, float]:
        """Averages the sketches over the process group; returns (bytes sent, seconds)."""
        from membar.collectives import dist

        if not self.states.allocated("sketch"):
            return 0, 0.0
        sketch = self.states.flat("sketch")
        started = time.perf_counter()
        dist().all_reduce(sketch, group=self.process_group)
        sketch.div_(dist().get_world_size(self.process_group))
        if sketch.is_cuda:
            torch.cuda.current_stream(sketch.device).synchronize()
        return sketch.numel() * sketch.element_size(), time.perf_counter() - started

    def _average(self, value: float) -> float:
        from membar.collectives import device_for, dist

        tensor = torch.tensor([value], dtype=torch.float64, device=device_for(self.process_group))
        dist().all_reduce(tensor, group=self.process_group)
        return float(tensor.item()) / dist().get_world_size(self.process_group)

    @torch.no_grad()
    def _apply(self, layer, scaled_update: torch.Tensor, rounding_seed: int) -> None:
        """W -= scaled_update A (into the fp32 master when kept, then copied to W)."""
        if sharding.is_sharded(layer.weight):
            self._apply_rows(layer, scaled_update, rounding_seed)
            return
        if layer.split is not None:
            self._apply_split(layer, scaled_update, rounding_seed)
            return
        target = layer.master if layer.master is not None else layer.weight
        ops.fused_update_(target, scaled_update, 1.0, layer.current_key(),
                          rounding_seed if target.dtype == torch.bfloat16 else 0, exact=self.exact_update)
        if layer.master is not None:
            layer.weight.copy_(layer.master)

    def _apply_rows(self, layer, scaled_update: torch.Tensor, rounding_seed: int) -> None:
        """This rank's rows of W -= scaled_update A (Note [Sharded frozen weights])."""
        weight, first = sharding.local_rows(layer.weight)
        rows = weight.shape[0]
        if rows == 0:
            return
        target = layer.master if layer.master is not None else weight
        seed = rounding_seed if target.dtype == torch.bfloat16 else 0
        ops.fused_update_(target, scaled_update[first: first + rows].contiguous(), 1.0, layer.current_key(), seed,
                          exact=self.exact_update, first_element=first * layer.in_features)
        if layer.master is not None:
            weight.copy_(layer.master)

    def _apply_split(self, layer, scaled_update: torch.Tensor, rounding_seed: int) -> None:
        """A head-parallel layer's part of W -= scaled_update A (Note [LoGRA over split heads])."""
        target = layer.master if layer.master is not None else layer.weight
        key = layer.current_key()
        if layer.split.dim == 1:   # this rank's columns: U [d, r] times A's columns, in fp32
            target.sub_(torch.matmul(scaled_update, layer.columns_of_a(key)).to(target.dtype))
        else:   # this rank's rows, in runs contiguous in the whole matrix, rounded as its rows
            seed = rounding_seed if target.dtype == torch.bfloat16 else 0
            for local, whole, rows in layer.split.row_ranges(target.shape[0]):
                ops.fused_update_(target[local: local + rows], scaled_update[local: local + rows].contiguous(), 1.0,
                                  key, seed, exact=self.exact_update,
                                  first_element=whole * layer.in_features if seed else 0)
        if layer.master is not None:
            layer.weight.copy_(layer.master)

    def _redraw(self) -> None:
        self.logra.key_state.step += 1
        if self.moments_on_redraw == "keep":
            return
        # SGD's momentum buffer lives in the same sketch coordinates as Adam's first moment.
        if self.states.allocated("first_moment"):
            self.states.flat("first_moment").zero_()
        self._first_count = 0
        if self.moments_on_redraw == "reset_both":
            if self.states.allocated("second_moment"):
                self.states.flat("second_moment").zero_()
            self._second_count = 0

    def moment(self, kind: str, index: int) -> torch.Tensor | None:
        """Layer ``index``'s first or second moment [d, r] (None before the first update). Brings
        offloaded moments back."""
        if kind not in ("first_moment", "second_moment"):
            raise ValueError(f"kind must be 'first_moment' or 'second_moment', got {kind!r}")
        return self.states.view(kind, index) if self.states.allocated(kind) else None

    def state_bytes(self) -> int:
        """Bytes held by sketches, moments (resident or offloaded) and masters."""
        total = self.states.nbytes()
        for layer in self.logra.layers:
            if layer.master is not None:
                total += layer.master.numel() * layer.master.element_size()
        return total
