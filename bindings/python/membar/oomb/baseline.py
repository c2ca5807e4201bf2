"""Full-sequence training, the way anyone would try first (the reference OOMB is measured against).

The whole sequence goes through the model at once (SDPA attention, optionally with gradient
checkpointing), and the loss is computed in checkpointed pieces so full-vocabulary logits of the
whole sequence never exist. Used as the gradient reference by the tests and as the baseline by
bench/oomb_bench.py.
"""
from __future__ import annotations

import torch
from torch.utils.checkpoint import checkpoint

from .models import attention_softcaps, final_logit_softcap
from .trainer import IGNORE_INDEX, _piece_loss


def reference_attention(model) -> str:
    """The attention implementation that computes the model exactly: SDPA, or eager for models that
    soft-cap their attention scores (transformers' SDPA path ignores softcap)."""
    return "eager" if attention_softcaps(model) else "sdpa"


def full_sequence_step(model, input_ids: torch.Tensor, labels: torch.Tensor | None = None,
                       loss_piece_tokens: int = 4096, attn_implementation: str | None = "auto") -> float:
    """Forward + backward of input_ids [batch, tokens] in one piece; returns the mean loss.

    Same loss as OOMBTrainer.step: position t predicts labels[t + 1], -100 ignored, mean over the
    batch's predicted tokens (with Gemma's final logit soft-cap where the model has one).
    Gradients accumulate into .grad. attn_implementation: "auto" (reference_attention), a name,
    or None to keep the model's.
    """
    if attn_implementation == "auto":
        attn_implementation = reference_attention(model)
    if attn_implementation is not None and model.config._attn_implementation != attn_implementation:
        model.set_attn_implementation(attn_implementation)
    if input_ids.dim() == 1:
        input_ids = input_ids.unsqueeze(0)
    labels = input_ids if labels is None else (labels.unsqueeze(0) if labels.dim() == 1 else labels)
    targets = torch.cat([labels[:, 1:], labels.new_full((labels.shape[0], 1), IGNORE_INDEX)], dim=1)
    predicted = int((targets != IGNORE_INDEX).sum())
    decoder, lm_head = model.get_decoder(), model.get_output_embeddings()
    softcap = final_logit_softcap(model)
    hidden = decoder(input_ids=input_ids, use_cache=False).last_hidden_state   # [batch, tokens, hidden]
    total = None
    for row in range(hidden.shape[0]):
        for start in range(0, hidden.shape[1], loss_piece_tokens):
            piece_targets = targets[row, start: start + loss_piece_tokens]
            part = checkpoint(_piece_loss, lm_head, hidden[row, start: start + loss_piece_tokens],
                              piece_targets, softcap, use_reentrant=False)
            total = part if total is None else total + part
    loss = total / predicted
    loss.backward()
    return float(loss.detach())
