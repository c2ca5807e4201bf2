"""Model shapes for random-initialisation runs (CLI --model NAME, benchmarks)."""
from __future__ import annotations

_QWEN2 = dict(rope_theta=1e6)
_LLAMA = dict(rope_theta=5e5)

# name -> (model_type, config fields). Fields not given take transformers' defaults for the type.
PRESETS = {
    # Tiny models for tests and the CPU demo.
    "tiny-qwen2": ("qwen2", dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                 intermediate_size=128, vocab_size=512, **_QWEN2)),
    "tiny-llama": ("llama", dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                 intermediate_size=128, vocab_size=512, **_LLAMA)),
    # The recall demo: small enough to train at 16K+ tokens on two CPU cores in minutes.
    # One narrow attention head keeps the O(tokens^2) attention cheap on a CPU. Tied embeddings make
    # "copy a token of the context" one skill for every key, and a vocabulary of 1024 makes the
    # average of the random filler small beside a key the context repeats.
    "demo": ("qwen2", dict(hidden_size=64, num_hidden_layers=1, num_attention_heads=1, num_key_value_heads=1,
                           head_dim=16, intermediate_size=128, vocab_size=1024, tie_word_embeddings=True, **_QWEN2)),
    # Qwen2.5 shapes (random init).
    "qwen2.5-0.5b": ("qwen2", dict(hidden_size=896, num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
                                   intermediate_size=4864, vocab_size=151936, **_QWEN2)),
    "qwen2.5-1.5b": ("qwen2", dict(hidden_size=1536, num_hidden_layers=28, num_attention_heads=12,
                                   num_key_value_heads=2, intermediate_size=8960, vocab_size=151936, **_QWEN2)),
    "qwen2.5-7b": ("qwen2", dict(hidden_size=3584, num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4,
                                 intermediate_size=18944, vocab_size=152064, **_QWEN2)),
    # The shapes of the model-coverage table (bench/model_coverage_bench.py), from the published configs.
    "qwen3-8b": ("qwen3", dict(hidden_size=4096, num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8,
                               head_dim=128, intermediate_size=12288, vocab_size=151936, rms_norm_eps=1e-6,
                               rope_theta=1e6)),
    "llama-3.1-8b": ("llama", dict(hidden_size=4096, num_hidden_layers=32, num_attention_heads=32,
                                   num_key_value_heads=8, intermediate_size=14336, vocab_size=128256,
                                   rms_norm_eps=1e-5, max_position_embeddings=131072,
                                   rope_parameters={"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0,
                                                    "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                                    "original_max_position_embeddings": 8192})),
    # Every layer soft-caps its scores (50) and every other one is local (window 4096): Gemma 2
    # trains on the PyTorch attention path (Note [Attention in PyTorch] in torch_attention.py).
    "gemma-2-9b": ("gemma2", dict(hidden_size=3584, num_hidden_layers=42, num_attention_heads=16,
                                  num_key_value_heads=8, head_dim=256, intermediate_size=14336, vocab_size=256000,
                                  query_pre_attn_scalar=256, sliding_window=4096, attn_logit_softcapping=50.0,
                                  final_logit_softcapping=30.0, rope_theta=1e4, tie_word_embeddings=True)),
    # Mistral-7B v0.3 (no sliding window); v0.1 had sliding_window=4096, vocab 32000, rope_theta 1e4.
    "mistral-7b": ("mistral", dict(hidden_size=4096, num_hidden_layers=32, num_attention_heads=32,
                                   num_key_value_heads=8, head_dim=128, intermediate_size=14336, vocab_size=32768,
                                   sliding_window=None, rope_theta=1e6)),
}


def preset_config(name: str, max_positions: int = 32768):
    """A transformers config of a preset shape (untied embeddings unless the preset ties them;
    max_position_embeddings at least max_positions and 32768 unless the preset sets it)."""
    if name not in PRESETS:
        raise ValueError(f"unknown model preset {name!r}; known: {', '.join(sorted(PRESETS))}.")
    from transformers import AutoConfig

    model_type, shape = PRESETS[name]
    fields = dict({"tie_word_embeddings": False, "max_position_embeddings": max(max_positions, 32768)}, **shape)
    fields["max_position_embeddings"] = max(fields["max_position_embeddings"], max_positions)
    return AutoConfig.for_model(model_type, **fields)


def build_model(name_or_path: str, dtype=None, device=None, max_positions: int = 32768, seed: int = 0):
    """A causal LM from a local checkpoint directory, a config.json file, or a preset name."""
    import os

    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    if os.path.isdir(name_or_path):
        model = AutoModelForCausalLM.from_pretrained(name_or_path, dtype=dtype, attn_implementation="sdpa")
    else:
        if os.path.isfile(name_or_path):
            config = AutoConfig.from_pretrained(name_or_path)
        else:
            config = preset_config(name_or_path, max_positions)
        config._attn_implementation = "sdpa"
        torch.manual_seed(seed)
        with torch.device(device or "cpu"):
            model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
        if dtype is not None:
            model = model.to(dtype)
    if device is not None:
        model = model.to(device)
    return model
