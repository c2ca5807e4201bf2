"""Chunk-recurrent long-context training (the OOMB method) for Hugging Face causal LMs.

    from membar.oomb import OOMBTrainer, OOMBConfig
    trainer = OOMBTrainer(model, OOMBConfig(chunk_tokens=4096, page_tokens=128, mode="dense"))
    loss = trainer.step(input_ids)   # .grad as full-sequence training would leave it

See docs/oomb.md.
"""
from .config import OOMBConfig, ResidencyPlan, plan_gpu_resident_layers, pool_bytes_per_layer
from .hf_attention import ATTENTION_NAME, register
from .kv_store import Access, KVStore, PageLayout
from .runtime_store import RuntimeKVStore
from .trainer import IGNORE_INDEX, OOMBTrainer

__all__ = ["OOMBConfig", "pool_bytes_per_layer", "plan_gpu_resident_layers", "ResidencyPlan", "OOMBTrainer",
           "KVStore", "RuntimeKVStore", "PageLayout", "Access", "ATTENTION_NAME", "IGNORE_INDEX", "register"]
