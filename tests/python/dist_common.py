"""What the data-parallel tests and their ranks (dist_worker.py) share: the model and the data."""
from __future__ import annotations

import torch
from transformers import Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM

TOKENS = 300   # not a multiple of the chunk (96) or the page (32): partial chunks and pages
VOCAB = 97
SPLIT_VOCAB = 100   # tokens are drawn below VOCAB; a vocabulary that 2 and 4 ranks split


def small_model() -> Qwen2ForCausalLM:
    torch.manual_seed(0)
    return Qwen2ForCausalLM(Qwen2Config(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                        num_key_value_heads=2, head_dim=16, intermediate_size=96,
                                        vocab_size=VOCAB))


def global_batch(size: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (size, TOKENS), generator=torch.Generator().manual_seed(7))


def split_config(mode: str = "dense"):
    """The head-parallel tests' trainer settings; sparse keeps 2 of up to 9 history pages."""
    from membar.oomb import OOMBConfig

    if mode == "sparse":
        return OOMBConfig(chunk_tokens=96, page_tokens=32, mode="sparse", top_k=2, query_tile_tokens=32)
    return OOMBConfig(chunk_tokens=96, page_tokens=32)


def split_model(family: str):
    """Models for the head-parallel tests: qwen2 (GQA 4/2, q/k/v biases) splits 2 ways; qwen3
    (GQA 8/4, q_norm/k_norm applied per head, tied embeddings) splits 2 or 4 ways; gemma2 (a sliding-window layer,
    attention and final logit soft-caps) and qwen3_moe (MoE blocks, which stay whole) 2 ways."""
    torch.manual_seed(0)
    if family == "qwen2":
        return small_model()
    if family == "gemma2":   # eager attention: the reference must apply the soft-cap (SDPA ignores it)
        from transformers import AutoModelForCausalLM, Gemma2Config

        config = Gemma2Config(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                              head_dim=16, intermediate_size=96, vocab_size=SPLIT_VOCAB, sliding_window=64,
                              query_pre_attn_scalar=24, attn_logit_softcapping=2.0, final_logit_softcapping=3.0,
                              layer_types=["sliding_attention", "full_attention"])
        return AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    if family == "phi3":   # fused qkv_proj and gate_up_proj
        from transformers import Phi3Config, Phi3ForCausalLM

        return Phi3ForCausalLM(Phi3Config(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                          num_key_value_heads=2, intermediate_size=96, vocab_size=SPLIT_VOCAB,
                                          pad_token_id=0, bos_token_id=1, eos_token_id=2))
    if family == "qwen3_moe":
        from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

        return Qwen3MoeForCausalLM(Qwen3MoeConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                                  num_key_value_heads=2, head_dim=16, intermediate_size=96,
                                                  vocab_size=VOCAB, num_experts=4, num_experts_per_tok=2,
                                                  moe_intermediate_size=32, norm_topk_prob=True))
    if family == "qwen3":
        # A vocabulary of 100 splits 2 and 4 ways (Note [Vocabulary split]); tied embeddings.
        return Qwen3ForCausalLM(Qwen3Config(hidden_size=64, num_hidden_layers=2, num_attention_heads=8,
                                            num_key_value_heads=4, head_dim=16, intermediate_size=96,
                                            vocab_size=SPLIT_VOCAB, attention_bias=True, tie_word_embeddings=True))
    raise ValueError(family)
