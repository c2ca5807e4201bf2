"""Next-token cross-entropy through a frozen output layer without full-vocabulary logits.

Note [Chunked linear cross-entropy]
Rationale: at batch 4 x 2048 and a 152K vocabulary the logits alone are 4.6 GiB in fp32, and
HF's loss keeps them (and their gradient) alive. Checkpointing the loss in pieces bounds the
memory but computes every piece's logits twice (forward, then again in backward), an extra
lm_head matmul as large as a whole decoder layer's.
Approach: one autograd function whose forward walks the tokens in chunks; per chunk it computes
the fp32 logits (on the GPU straight from a bf16 GEMM with fp32 output), one fused log-softmax
pass, the loss, and right away the gradient of the loss with respect to the chunk's hidden
states: softmax - one_hot (exp of the log-softmax, in place), times the output weight (and, when
the weight is trainable, adds the chunk's weight gradient). About five passes over the chunk's
[n, V] fp32 values in all (a logsumexp-based version took twice that: 17 ms of 52 at 7B). Only one chunk's logits exist at a time, and the hidden-state
gradient [tokens, hidden] (as small as one activation) is kept for backward, which just scales
it by the incoming gradient. No logit is computed twice.
Limitations: the gradient is computed even if backward never runs (the forward costs what forward
plus backward would); the loss is a mean over the non-ignored tokens (or a sum).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

IGNORE_INDEX = -100


class _ChunkedLinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, bias, labels, chunk_tokens, reduction):
        # hidden [N, H], weight [V, H], bias [V] or None, labels [N] int64.
        tokens = hidden.shape[0]
        valid = labels != IGNORE_INDEX
        count = valid.sum()
        needs_hidden_grad = ctx.needs_input_grad[0]
        needs_weight_grad = ctx.needs_input_grad[1]
        needs_bias_grad = bias is not None and ctx.needs_input_grad[2]
        grad_hidden = torch.empty_like(hidden) if needs_hidden_grad else None
        grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if needs_weight_grad else None
        grad_bias = torch.zeros(bias.shape, dtype=torch.float32, device=bias.device) if needs_bias_grad else None
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        # On the GPU, bf16 x bf16 -> fp32 logits straight from cuBLAS (no bf16 copy to widen).
        direct_fp32 = hidden.is_cuda and hidden.dtype in (torch.bfloat16, torch.float16) and bias is None
        for start in range(0, tokens, chunk_tokens):
            end = min(start + chunk_tokens, tokens)
            piece = hidden[start:end]                                    # [n, H]
            piece_labels = labels[start:end]                              # [n]
            piece_valid = valid[start:end]
            if direct_fp32:
                logits = torch.mm(piece, weight.t(), out_dtype=torch.float32)  # [n, V] fp32
            else:
                logits = F.linear(piece, weight, bias).float()           # [n, V] fp32
            # One fused pass for log-softmax; the loss is its value at the labels.
            log_probs = torch.log_softmax(logits, dim=-1)                # [n, V] fp32
            del logits
            safe_labels = piece_labels.clamp(min=0)
            total -= (log_probs.gather(1, safe_labels[:, None]).squeeze(1) * piece_valid).sum()
            if grad_hidden is None and grad_weight is None and grad_bias is None:
                continue
            # d(sum of losses) / d logits = softmax - one_hot. Ignored positions are zeroed on the
            # small side of each product (rows of the hidden gradient, the hidden states, a
            # weighted sum for the bias), not on the [n, V] tensor.
            probabilities = log_probs.exp_()
            probabilities.scatter_add_(1, safe_labels[:, None],
                                       torch.full((end - start, 1), -1.0, device=hidden.device))
            grad_logits = probabilities.to(hidden.dtype)                 # [n, V]
            valid_rows = piece_valid[:, None].to(hidden.dtype)
            if grad_hidden is not None:
                torch.mm(grad_logits, weight.to(hidden.dtype), out=grad_hidden[start:end])
                grad_hidden[start:end].mul_(valid_rows)
            if grad_weight is not None:
                grad_weight.add_(grad_logits.t().float() @ (piece.float() * valid_rows.float()))
            if grad_bias is not None:
                grad_bias.add_(piece_valid.float() @ probabilities)
            del probabilities, log_probs, grad_logits
        scale = (1.0 / count.clamp(min=1).float()) if reduction == "mean" else torch.ones((), device=hidden.device)
        ctx.save_for_backward(*(t for t in (grad_hidden, grad_weight, grad_bias, scale) if t is not None))
        ctx.present = (grad_hidden is not None, grad_weight is not None, grad_bias is not None)
        return total * scale

    @staticmethod
    def backward(ctx, grad_loss):
        saved = list(ctx.saved_tensors)
        scale = saved.pop()
        factor = grad_loss * scale
        grad_hidden, grad_weight, grad_bias = (saved.pop(0) if present else None for present in ctx.present)
        if grad_hidden is not None:
            grad_hidden = grad_hidden * factor.to(grad_hidden.dtype)
        if grad_weight is not None:
            grad_weight = grad_weight * factor
        if grad_bias is not None:
            grad_bias = grad_bias * factor
        return grad_hidden, grad_weight, grad_bias, None, None, None


def chunked_linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
                                 bias: torch.Tensor | None = None, chunk_tokens: int = 1024,
                                 reduction: str = "mean") -> torch.Tensor:
    """Cross-entropy of ``hidden [..., H] @ weight[V, H]^T (+ bias)`` against ``labels [...]``
    (IGNORE_INDEX = -100 positions skipped), one chunk of ``chunk_tokens`` tokens of fp32 logits
    at a time, gradients computed in the forward (Note [Chunked linear cross-entropy]).
    ``reduction``: "mean" over the counted tokens, or "sum"."""
    if reduction not in ("mean", "sum"):
        raise ValueError(f"reduction must be 'mean' or 'sum', got {reduction!r}")
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be at least 1, got {chunk_tokens}")
    if hidden.shape[:-1] != labels.shape:
        raise ValueError(f"hidden {tuple(hidden.shape)} and labels {tuple(labels.shape)} must agree on the "
                         "leading (token) dimensions")
    if weight.dim() != 2 or weight.shape[1] != hidden.shape[-1]:
        raise ValueError(f"weight must be [vocab, {hidden.shape[-1]}], got {tuple(weight.shape)}")
    flat_hidden = hidden.reshape(-1, hidden.shape[-1])
    if not flat_hidden.is_contiguous():
        flat_hidden = flat_hidden.contiguous()
    return _ChunkedLinearCrossEntropy.apply(flat_hidden, weight, bias, labels.reshape(-1).long(), int(chunk_tokens),
                                            reduction)


def causal_lm_loss(model, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                   labels: torch.Tensor | None = None, chunk_tokens: int = 1024) -> torch.Tensor:
    """Mean next-token loss of an HF causal LM (``model.model`` the decoder, ``model.lm_head`` the
    output layer) without full-vocabulary logits. ``labels`` default to ``input_ids``."""
    hidden = model.model(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state  # [B, T, H]
    labels = input_ids if labels is None else labels
    shifted = labels[:, 1:]
    if attention_mask is not None:
        shifted = shifted.masked_fill(attention_mask[:, 1:] == 0, IGNORE_INDEX)
    head = model.lm_head
    return chunked_linear_cross_entropy(hidden[:, :-1, :], head.weight, shifted, bias=head.bias,
                                        chunk_tokens=chunk_tokens)
