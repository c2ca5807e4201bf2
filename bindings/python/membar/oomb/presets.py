"""Model shapes for random-initialisation runs (CLI --model NAME, benchmarks)."""
from __future__ import annotations

PRESETS = {
    # Tiny models for tests and the CPU demo.
    "tiny-qwen2": ("qwen2", dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                 intermediate_size=128, vocab_size=512)),
    "tiny-llama": ("llama", dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                 intermediate_size=128, vocab_size=512)),
    # The recall demo: small enough to train at 16K+ tokens on two CPU cores in minutes.
    # One narrow attention head keeps the O(tokens^2) attention cheap on a CPU. Tied embeddings make
    # "copy a token of the context" one skill for every key, and a vocabulary of 1024 makes the
    # average of the random filler small beside a key the context repeats.
    "demo": ("qwen2", dict(hidden_size=64, num_hidden_layers=1, num_attention_heads=1, num_key_value_heads=1,
                           head_dim=16, intermediate_size=128, vocab_size=1024, tie_word_embeddings=True)),
    # Qwen2.5 shapes (random init), as in /work/shared/probes/torch_baseline.py.
    "qwen2.5-0.5b": ("qwen2", dict(hidden_size=896, num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
                                   intermediate_size=4864, vocab_size=151936)),
    "qwen2.5-1.5b": ("qwen2", dict(hidden_size=1536, num_hidden_layers=28, num_attention_heads=12, num_key_value_heads=2,
                                   intermediate_size=8960, vocab_size=151936)),
    "qwen2.5-7b": ("qwen2", dict(hidden_size=3584, num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4,
                                 intermediate_size=18944, vocab_size=152064)),
}


def preset_config(name: str, max_positions: int = 32768):
    """A transformers config of a preset shape (rope_theta 1e6 as Qwen2.5; untied embeddings unless the
    preset ties them)."""
    if name not in PRESETS:
        raise ValueError(f"unknown model preset {name!r}; known: {', '.join(sorted(PRESETS))}.")
    from transformers import LlamaConfig, Qwen2Config

    family, shape = PRESETS[name]
    common = dict({"tie_word_embeddings": False}, **shape, max_position_embeddings=max(max_positions, 32768))
    if family == "qwen2":
        return Qwen2Config(**common, rope_theta=1e6)
    return LlamaConfig(**common, rope_theta=5e5)


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
