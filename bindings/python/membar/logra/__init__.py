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
  PolicyPublisher / PolicySubscriber     seed-based policy sync over a shared-memory ring (runtime
                                         channels of membard, or POSIX shared memory)
  BroadcastPublisher / BroadcastReceiver the same updates by torch.distributed broadcast, to rollout
                                         ranks on other GPUs or nodes (membar.logra.broadcast)
  shard_weights(logra, group)            the frozen weights sharded over data-parallel ranks with
                                         FSDP2 (Note [Sharded frozen weights], membar.logra.sharding)
  causal_lm_loss / chunked_linear_cross_entropy
                                         next-token loss without full-vocabulary logits, gradient
                                         computed in the forward (Note [Chunked linear cross-entropy])

Adam's moments on a redraw of A: see Note [Adam moments when A is redrawn] in optimizer.py
(default: reset the first moment, keep the second). Sketches and moments are flat buffers
(LoGRAStates, Note [LoGRA state storage]): plain tensors, or pages of a membar runtime
(``apply_logra(..., runtime=rt or "auto")``), with the moments optionally offloaded to host
memory between updates (``LoGRAOptimizer(..., offload_moments=True)``).
"""
from membar.logra.kl import KLPrediction, measured_kl, predict_kl, softmax_fisher_quadratic, step_scale
from membar.logra.linear import (DEFAULT_TARGETS, KeyState, LoGRALinear, LoGRAModel, apply_logra, state_pool_bytes,
                                 target_linears, target_weights)
from membar.logra.loss import causal_lm_loss, chunked_linear_cross_entropy
from membar.logra.ops import ProjectionKey, fused_update_, generate, project, sketch_accumulate_
from membar.logra.optimizer import KLControl, LoGRAOptimizer, StepResult
from membar.logra.state import LoGRAStates, allocate_state
from membar.logra.sync import PolicyPublisher, PolicySubscriber, SharedMemoryRing, SyncOverrun
from membar.logra.broadcast import BroadcastPublisher, BroadcastReceiver
from membar.logra.sharding import full_weights, shard_weights

__all__ = [
    "BroadcastPublisher", "BroadcastReceiver", "DEFAULT_TARGETS", "KLControl", "KLPrediction", "KeyState", "LoGRALinear", "LoGRAModel", "LoGRAOptimizer",
    "LoGRAStates", "causal_lm_loss", "chunked_linear_cross_entropy",
    "PolicyPublisher", "PolicySubscriber", "ProjectionKey", "SharedMemoryRing", "StepResult", "SyncOverrun",
    "allocate_state", "apply_logra", "full_weights", "shard_weights", "fused_update_", "generate", "measured_kl", "predict_kl", "project",
    "sketch_accumulate_", "softmax_fisher_quadratic", "state_pool_bytes", "step_scale", "target_linears", "target_weights",
]
