"""What the data-parallel tests and their ranks (dist_worker.py) share: the model and the data."""
from __future__ import annotations

import torch
from transformers import Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM

TOKENS = 300   # not a multiple of the chunk (96) or the page (32): partial chunks and pages
VOCAB = 97


def small_model() -> Qwen2ForCausalLM:
    torch.manual_seed(0)
    return Qwen2ForCausalLM(Qwen2Config(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                        num_key_value_heads=2, head_dim=16, intermediate_size=96,
                                        vocab_size=VOCAB))


def global_batch(size: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (size, TOKENS), generator=torch.Generator().manual_seed(7))


def split_model(family: str):
    """Models for the head-parallel tests: qwen2 (GQA 4/2, q/k/v biases) splits 2 ways; qwen3
    (GQA 8/4, q_norm/k_norm applied per head) splits 2 or 4 ways."""
    torch.manual_seed(0)
    if family == "qwen2":
        return small_model()
    if family == "qwen3":
        return Qwen3ForCausalLM(Qwen3Config(hidden_size=64, num_hidden_layers=2, num_attention_heads=8,
                                            num_key_value_heads=4, head_dim=16, intermediate_size=96,
                                            vocab_size=VOCAB, attention_bias=True))
    raise ValueError(family)
