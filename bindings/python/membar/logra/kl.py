"""Predicted KL of a LoGRA update, from one forward-mode (JVP) pass on a probe batch.

Note [Predicted KL]
Rationale: step control needs q(D), the KL between the current policy and the policy after the
update D, before D is applied. To second order, KL(pi || pi + D) = 0.5 E_tokens[v^T F v] with
v = J D the change of the logits along D and F = diag(p) - p p^T the softmax Fisher; the KL is
quadratic in the step size, so after a step alpha * D it is alpha^2 q(D), and
alpha = min(alpha_max, sqrt(delta / q(D))) makes the predicted KL delta.
Approach: one forward pass with dual numbers (torch.autograd.forward_ad). Each LoGRA layer's
weight change is dW = -c U A, so the extra output tangent of that layer is
x dW^T = -c (x A^T) U^T: the projection kernel plus a [tokens, r] x [r, d] matmul. The dense dW
[d, k] is never formed. Everything between layers (norms, attention, activations) is
differentiated by PyTorch's forward-mode AD; attention runs through a plain-math SDPA for this
pass because the fused SDPA kernels have no forward-mode formula.
Limitations: the cost is about two forwards of the probe batch plus forward-mode AD's per-op
overhead (callers pass a few sequences, not the whole rollout batch): on the H200 a 512-token
probe added 0.15 s to a 0.76 s update at 7B and 0.34 s to a 0.23 s update at 1.5B, where the
per-op overhead dominates; the quadratic is a local model, so large steps deviate (the alpha_max
cap bounds the damage); full-vocabulary logits of the probe batch are materialised.
"""
from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass
from typing import Callable, Sequence

import torch
import torch.autograd.forward_ad as forward_ad
import torch.nn.functional as F

from membar.logra.linear import LoGRALinear

# A probe returns logits [..., vocab] (dual tensors during the pass), or (logits, mask) where
# mask [...] selects the positions that count.
Probe = Callable[[], "torch.Tensor | tuple[torch.Tensor, torch.Tensor]"]


def _math_attention(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    """scaled_dot_product_attention in plain operations (forward-mode differentiable).

    Masked scores use the dtype's lowest finite value rather than -inf, so a fully masked row
    (left padding) gives a finite uniform average instead of NaN, as eager attention does."""
    if dropout_p != 0.0:
        raise ValueError("the predicted-KL pass runs without dropout")
    query_length, key_length = query.shape[-2], key.shape[-2]
    scale = 1.0 / math.sqrt(query.shape[-1]) if scale is None else scale
    if enable_gqa and key.shape[-3] != query.shape[-3]:
        repeats = query.shape[-3] // key.shape[-3]
        key = key.repeat_interleave(repeats, dim=-3)
        value = value.repeat_interleave(repeats, dim=-3)
    scores = torch.matmul(query, key.transpose(-2, -1)) * scale
    lowest = torch.finfo(scores.dtype).min
    if is_causal:
        allowed = torch.ones(query_length, key_length, dtype=torch.bool, device=query.device)
        scores = scores.masked_fill(~allowed.tril(key_length - query_length), lowest)
    if attn_mask is not None:
        if attn_mask.dtype == torch.bool:
            scores = scores.masked_fill(~attn_mask, lowest)
        else:
            scores = scores + attn_mask.clamp(min=lowest)
    return torch.matmul(torch.softmax(scores, dim=-1), value)


@contextlib.contextmanager
def forward_mode_attention():
    """Routes torch.nn.functional.scaled_dot_product_attention through :func:`_math_attention`
    for the duration of the block (HF models look the function up at call time)."""
    original = F.scaled_dot_product_attention
    F.scaled_dot_product_attention = _math_attention
    try:
        yield
    finally:
        F.scaled_dot_product_attention = original


def softmax_fisher_quadratic(logits: torch.Tensor, tangent: torch.Tensor) -> torch.Tensor:
    """0.5 * v^T (diag(p) - p p^T) v per position, p = softmax(logits), v = tangent. [...]."""
    probabilities = torch.softmax(logits.float(), dim=-1)
    tangent = tangent.float()
    mean = (probabilities * tangent).sum(-1)
    return 0.5 * ((probabilities * tangent * tangent).sum(-1) - mean * mean)


def _masked_mean(values: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    if mask is None:
        return values.mean()
    mask = mask.to(values.dtype)
    return (values * mask).sum() / mask.sum().clamp(min=1.0)


@dataclass
class KLPrediction:
    predicted_kl: float   # q(D) for the full step D
    positions: int        # how many positions the estimate averages


def predict_kl(
    model: torch.nn.Module,
    layers: Sequence[LoGRALinear],
    updates: Sequence[torch.Tensor],
    coefficient: float,
    probe: Probe,
) -> KLPrediction:
    """q(D) for D: W_l -= coefficient * updates[l] A_l for every layer l (updates[l] [d, r] fp32).

    Runs ``probe`` once under forward-mode AD with the model in eval mode and no autograd graph.
    Blocks until the pass is done; call it from the training thread between backward and step."""
    if len(layers) != len(updates):
        raise ValueError(f"predict_kl got {len(updates)} updates for {len(layers)} layers")
    was_training = model.training
    model.eval()
    try:
        for layer, update in zip(layers, updates):
            layer._tangent_update = update
            layer._tangent_coefficient = float(coefficient)
        with torch.no_grad(), forward_ad.dual_level(), forward_mode_attention():
            result = probe()
            logits, mask = result if isinstance(result, tuple) else (result, None)
            primal, tangent = forward_ad.unpack_dual(logits)
            if tangent is None:
                raise RuntimeError("predict_kl: the probe's logits carry no tangent; "
                                   "does the probe run the model that holds these LoGRA layers?")
            per_position = softmax_fisher_quadratic(primal, tangent)
            value = _masked_mean(per_position, mask)
            positions = int(per_position.numel() if mask is None else mask.sum().item())
    finally:
        for layer in layers:
            layer._tangent_update = None
            layer._tangent_coefficient = 0.0
        model.train(was_training)
    return KLPrediction(predicted_kl=float(value), positions=positions)


def step_scale(predicted_kl: float, delta: float, alpha_max: float) -> float:
    """alpha = min(alpha_max, sqrt(delta / q)); alpha_max when q is zero (nothing would change)."""
    if delta <= 0 or alpha_max <= 0:
        raise ValueError(f"delta and alpha_max must be positive, got {delta}, {alpha_max}")
    if not math.isfinite(predicted_kl):
        raise ValueError(f"the predicted KL is not finite ({predicted_kl}); refusing to step")
    if predicted_kl <= 0:
        return alpha_max
    return min(alpha_max, math.sqrt(delta / predicted_kl))


def measured_kl(logits_before: torch.Tensor, logits_after: torch.Tensor, mask: torch.Tensor | None = None) -> float:
    """E over positions of KL(softmax(before) || softmax(after)), for checks and logging."""
    log_before = torch.log_softmax(logits_before.float(), dim=-1)
    log_after = torch.log_softmax(logits_after.float(), dim=-1)
    per_position = (log_before.exp() * (log_before - log_after)).sum(-1)
    return float(_masked_mean(per_position, mask))
