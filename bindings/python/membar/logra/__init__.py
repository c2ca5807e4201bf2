"""LoGRA: low-rank gradient sketches for memory-lean full-parameter updates (issue 5).

Per targeted weight W [d, k] (attention and MLP projections; everything else frozen), a
random projection A [r, k] with entries +-1/sqrt(r) comes from a counter-based generator keyed
by (seed, matrix_id, step) and is never stored. The forward saves x A^T instead of x, the
backward accumulates the sketch S = G A^T [d, r] without forming the dense gradient G, an
optimizer on S gives U, and W <- W - alpha * eta * U A is applied by one fused kernel.

  apply_logra(model, rank, targets)      wrap HF Qwen2 / Llama projections (LoGRALinear)
  LoGRAOptimizer(logra, lr, ...)         Adam / SGD on the sketches, A redraw policy,
                                         predicted-KL step control (KLControl)
  predict_kl(...)                        q(D) from one forward-mode pass (Note [Predicted KL])
  PolicyPublisher / PolicySubscriber     seed-based policy sync over a shared-memory ring

Adam's moments on a redraw of A: see Note [Adam moments when A is redrawn] in optimizer.py
(default: reset the first moment, keep the second). States (sketches, moments, masters) are
plain tensors from membar.logra.state.allocate_state, the one place that will hand out
runtime pages once the runtime can page them.
"""
from membar.logra.kl import KLPrediction, measured_kl, predict_kl, softmax_fisher_quadratic, step_scale
from membar.logra.linear import (DEFAULT_TARGETS, KeyState, LoGRALinear, LoGRAModel, apply_logra, target_linears,
                                 target_weights)
from membar.logra.ops import ProjectionKey, fused_update_, generate, project, sketch_accumulate_
from membar.logra.optimizer import KLControl, LoGRAOptimizer, StepResult
from membar.logra.state import allocate_state
from membar.logra.sync import PolicyPublisher, PolicySubscriber, SharedMemoryRing, SyncOverrun

__all__ = [
    "DEFAULT_TARGETS", "KLControl", "KLPrediction", "KeyState", "LoGRALinear", "LoGRAModel", "LoGRAOptimizer",
    "PolicyPublisher", "PolicySubscriber", "ProjectionKey", "SharedMemoryRing", "StepResult", "SyncOverrun",
    "allocate_state", "apply_logra", "fused_update_", "generate", "measured_kl", "predict_kl", "project",
    "sketch_accumulate_", "softmax_fisher_quadratic", "step_scale", "target_linears", "target_weights",
]
