# GPU frames mapped per step (Note [Remapping a position] in engine/frames.cpp) when the GPU budget
# is far smaller than the history, as in dense-offload at 256K: a 2-layer model with the 7B shape's
# KV pages (4 KV heads x 128, pages of 128 tokens), 16K tokens, chunks of 1024, history blocks of
# 2K, three steps through the embedded runtime (host backend on a CPU, CUDA on a GPU). Prints each
# step's map calls beside its frame placements (prefetch hits + misses), bytes moved and the host
# time inside the store's runtime calls. Session 14 (CPU): 561 maps for 568 placements per step.
# Session 15 (CPU, 32K, PROBE_CHUNK=2048 PROBE_BLOCK=8192): 326 maps for 236 placements;
# MEMBAR_DISPLACE_RANK=64: 200 for 286 (Note [Eviction order]).
# Usage: PYTHONPATH=bindings/python python bench/probes/maps_probe.py [TOKENS]
#        (PROBE_CHUNK, PROBE_BLOCK: chunk and history block tokens, default 1024 and 2048)
import os
import sys

import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from membar.oomb import OOMBConfig, OOMBTrainer

torch.manual_seed(0)
device = "cuda" if torch.cuda.is_available() else "cpu"
# bf16 on a GPU: the CUDA attention kernels take bfloat16 or float16 only.
model = Qwen2ForCausalLM(Qwen2Config(hidden_size=512, num_hidden_layers=2, num_attention_heads=4,
                                     num_key_value_heads=4, intermediate_size=256, vocab_size=97)).to(
    device, torch.bfloat16 if device == "cuda" else torch.float32)
tokens = int(sys.argv[1]) if len(sys.argv) > 1 else 16384
ids = torch.randint(0, 97, (1, tokens))
chunk = int(os.environ.get("PROBE_CHUNK", 1024))
block = int(os.environ.get("PROBE_BLOCK", 2048))
trainer = OOMBTrainer(model, OOMBConfig(chunk_tokens=chunk, page_tokens=128, offload=True, history_block_tokens=block))
trainer.reserve(tokens)
for step in range(3):
    model.zero_grad()
    trainer.step(ids)
    s = trainer.stats
    print(f"step {step}: {s['seconds']:.1f} s, {s['gpu_maps']} GPU maps for "
          f"{s['prefetch_hits'] + s['prefetch_misses']} placements, {s['bytes_moved'] / 2**30:.2f} GiB moved, "
          f"{s['store_host_seconds']:.3f} s of host time in the store's runtime calls, "
          f"{s['fence_waits']} fence waits ({s['store_fence_wait_seconds']:.3f} s); runtime calls "
          + ", ".join(f"{part} {seconds:.3f} s" for part, seconds in s['store_call_seconds'].items()), flush=True)
