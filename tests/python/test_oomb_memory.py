"""What a chunk-recurrent step keeps on the compute device must not grow with the sequence when
pages are offloaded (the issue's goal: <= 5 MB per 10K tokens at the 7B shape).

The step runs on the meta device: tensors there have shapes but no bits, so a tiny model trains
"at" any length in a second, and every byte on the meta device is a byte the step would keep on
the GPU, while the offloaded pages live in (real) host memory. A dispatch mode counts the live
bytes of meta storages after every allocation and keeps the peak. Comparing the peak of two
lengths gives the growth per token, which must stay a tiny fraction of one layer's K+V+dK+dV per
token. The page pools are reserved before the measured step (as membar-train does): their
address space is the whole sequence, their GPU backing the runtime's budget. The same measure
on a full-sequence step sees activations grow with the length, which shows it can fail.
"""
from __future__ import annotations

import pytest
import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

from membar.oomb import OOMBConfig, OOMBTrainer


class DeviceBytes(TorchDispatchMode):
    """Peak live bytes of the storages on `device` that ops create while active (a view of a
    storage made before, such as a reserved page pool, adds nothing)."""

    def __init__(self, device):
        super().__init__()
        self.device = torch.device(device)
        self.live: dict = {}
        self.peak = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        # Views share their input's storage: only storages no input had are new bytes.
        inputs = {StorageWeakRef(tensor.untyped_storage()).cdata
                  for tensor in torch.utils._pytree.tree_leaves((args, kwargs))
                  if isinstance(tensor, torch.Tensor) and tensor.device == self.device}
        grew = False
        for tensor in torch.utils._pytree.tree_leaves(out):
            if isinstance(tensor, torch.Tensor) and tensor.device == self.device:
                storage = tensor.untyped_storage()
                reference = StorageWeakRef(storage)
                if reference.cdata not in self.live and reference.cdata not in inputs:
                    self.live[reference.cdata] = (reference, storage.nbytes())
                    grew = True
        if grew:   # live bytes rise only when a storage appears: the peak is seen there
            for key in [key for key, (reference, _) in self.live.items() if reference.expired()]:
                del self.live[key]
            self.peak = max(self.peak, sum(size for _, size in self.live.values()))
        return out


def meta_model(kind: str):
    common = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  intermediate_size=96, vocab_size=97, max_position_embeddings=8192, attn_implementation="sdpa")
    with torch.device("meta"):
        if kind == "qwen2":
            return Qwen2ForCausalLM(Qwen2Config(**common))
        return LlamaForCausalLM(LlamaConfig(**common))


def peak_device_bytes(model, tokens: int, **options) -> int:
    trainer = OOMBTrainer(model, OOMBConfig(chunk_tokens=128, page_tokens=16, offload=True, **options))
    trainer.reserve(tokens)
    model.zero_grad(set_to_none=True)   # each measured step allocates the parameters' grads
    input_ids = torch.randint(0, 97, (1, tokens), generator=torch.Generator().manual_seed(tokens))
    with DeviceBytes("meta") as counter:
        trainer.step(input_ids)
    return counter.peak


@pytest.mark.parametrize("kind,checkpoint_layers", [("qwen2", False), ("llama", True)])
def test_device_memory_is_flat_in_sequence_length_with_offload(kind, checkpoint_layers):
    model = meta_model(kind)
    # K+V+dK+dV of one layer per token (float32 pages): 2 KV heads x 16 dims x 4 bytes x 4.
    layer_bytes_per_token = 2 * 16 * 4 * 4
    short, long = 512, 1024
    options = dict(history_block_tokens=128, checkpoint_layers=checkpoint_layers)
    growth = (peak_device_bytes(model, long, **options) - peak_device_bytes(model, short, **options)) / (long - short)
    assert growth <= 0.01 * layer_bytes_per_token, (
        f"device memory grows by {growth:.2f} bytes per token with offload and streamed history")
    # The same measure on a full-sequence step sees its activations grow with the length.
    plain = meta_model(kind)   # the trainer routed `model`'s attention through membar
    full = (full_sequence_peak(plain, long) - full_sequence_peak(plain, short)) / (long - short)
    assert full >= layer_bytes_per_token


def full_sequence_peak(model, tokens: int) -> int:
    input_ids = torch.randint(0, 97, (1, tokens), generator=torch.Generator().manual_seed(tokens))
    model.zero_grad(set_to_none=True)
    with DeviceBytes("meta") as counter:
        model(input_ids.to("meta"), labels=input_ids.to("meta")).loss.backward()
    return counter.peak
