"""What the data-parallel tests and their ranks (dist_worker.py) share: the model and the data."""
from __future__ import annotations

import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

TOKENS = 300   # not a multiple of the chunk (96) or the page (32): partial chunks and pages
VOCAB = 97


def small_model() -> Qwen2ForCausalLM:
    torch.manual_seed(0)
    return Qwen2ForCausalLM(Qwen2Config(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                        num_key_value_heads=2, head_dim=16, intermediate_size=96,
                                        vocab_size=VOCAB))


def global_batch(size: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (size, TOKENS), generator=torch.Generator().manual_seed(7))
