"""apply_logra on the decoder families chunk-recurrent training covers (Note [LoGRA targets]).

For each family, apply_logra with the default targets must wrap the family's attention and MLP
projections (Phi-3's fused qkv_proj and gate_up_proj included), and the sketch each wrapped layer
accumulates must equal the dense gradient of its weight times A^T (S = G A^T, G from plain
autograd on an unwrapped copy), float32 on the CPU. Layouts LoGRA cannot wrap (fused MoE expert
weights, non-linear modules under a targeted name) get one error naming them.
"""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import transformers

from membar.logra import apply_logra
from membar.logra import ops
from membar.logra.linear import unsupported_targets

VOCAB = 101
ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP = ("gate_proj", "up_proj", "down_proj")


def _small(**overrides):
    shape = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                 intermediate_size=48, vocab_size=VOCAB, pad_token_id=0, bos_token_id=1, eos_token_id=2,
                 initializer_range=0.1)
    shape.update(overrides)
    return shape


def _configs():
    t = transformers
    no_head_dim = {k: v for k, v in _small().items() if k != "head_dim"}
    return {
        "llama": (t.LlamaConfig(**_small(), mlp_bias=True), ATTENTION + MLP),
        "qwen2": (t.Qwen2Config(**_small()), ATTENTION + MLP),
        "qwen3": (t.Qwen3Config(**_small(), tie_word_embeddings=True), ATTENTION + MLP),
        "mistral": (t.MistralConfig(**_small()), ATTENTION + MLP),
        "gemma2": (t.Gemma2Config(**_small()), ATTENTION + MLP),
        "gemma3_text": (t.Gemma3TextConfig(**_small()), ATTENTION + MLP),
        "phi3": (t.Phi3Config(**no_head_dim), ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")),
        # MoE decoders: the attention projections (their experts are fused 3-D weights).
        "qwen3_moe": (t.Qwen3MoeConfig(**_small(), num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16),
                      ATTENTION),
        "mixtral": (t.MixtralConfig(**_small(), num_local_experts=4, num_experts_per_tok=2), ATTENTION),
    }


def _build(config):
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager").float()
    with torch.no_grad():
        for parameter in model.parameters():
            if parameter.dim() == 1:
                parameter.add_(0.1 * torch.randn_like(parameter))
    return model


@pytest.mark.parametrize("family", list(_configs()))
def test_sketches_equal_dense_gradient_times_a_transpose(family):
    config, projections = _configs()[family]
    model = _build(config)
    input_ids = torch.randint(0, VOCAB, (2, 24), generator=torch.Generator().manual_seed(1))
    dense = copy.deepcopy(model)
    dense(input_ids=input_ids, labels=input_ids).loss.backward()
    dense_grads = {name: parameter.grad for name, parameter in dense.named_parameters()}

    moe = family in ("qwen3_moe", "mixtral")
    targets = ATTENTION if moe else None
    logra = apply_logra(model, rank=4, seed=3, **({"targets": targets} if targets else {}))
    assert {name.rsplit(".", 1)[1] for name in logra.names} == set(projections)
    assert len(logra.names) == config.num_hidden_layers * len(projections)
    model(input_ids=input_ids, labels=input_ids).loss.backward()
    for name, layer in zip(logra.names, logra.layers):
        a = ops.generate(layer.current_key(), layer.rank, layer.in_features)     # [r, k]
        expected = dense_grads[f"{name}.weight"] @ a.t()                           # [d, r]
        error = float((layer.sketch - expected).abs().max() / expected.abs().max())
        assert error <= 1e-4, f"{family} {name}: sketch relative error {error:.3g}"


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
def test_fused_expert_weights_are_named_in_the_error(family):
    config, _ = _configs()[family]
    model = _build(config)
    before = [parameter.requires_grad for parameter in model.parameters()]
    with pytest.raises(ValueError, match=r"layers\.0\.mlp\.experts\.gate_up_proj \(a \(4, \d+, 32\) parameter"):
        apply_logra(model, rank=4)
    # Nothing was frozen or wrapped by the failed call.
    assert [parameter.requires_grad for parameter in model.parameters()] == before
    assert unsupported_targets(model, ATTENTION) == []


def test_a_module_of_another_kind_under_a_targeted_name_is_named():
    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.q_proj = nn.Linear(8, 8)
            self.o_proj = nn.Conv1d(8, 8, 1)

    with pytest.raises(ValueError, match=r"o_proj \(Conv1d\)"):
        apply_logra(nn.Sequential(Block()), rank=2)
