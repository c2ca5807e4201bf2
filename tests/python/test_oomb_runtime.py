"""OOMB pages in membar's runtime (embedded, host backend): the same gradient bits as plain tensor
pools, with and without offload, and the trainer's access plan driving the runtime's prefetch."""
from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

from membar.oomb import OOMBConfig, OOMBTrainer
from membar.oomb.runtime_store import RuntimeKVStore


@pytest.fixture(autouse=True)
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def model_for_runtime(kind: str):
    # A page of 128 tokens x 2 KV heads x 64 dims in float32 is 64 KiB: the runtime's smallest page.
    torch.manual_seed(0)
    common = dict(hidden_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                  intermediate_size=128, vocab_size=97, attn_implementation="sdpa")
    if kind == "qwen2":
        return Qwen2ForCausalLM(Qwen2Config(**common))
    return LlamaForCausalLM(LlamaConfig(**common))


def grads_after(model, input_ids, store, **options):
    model.zero_grad()
    trainer = OOMBTrainer(model, OOMBConfig(page_tokens=128, deterministic=True, **options), store=store)
    loss = trainer.step(input_ids)
    grads = {name: parameter.grad.clone() for name, parameter in model.named_parameters()}
    model.zero_grad()
    return loss, grads, trainer


@pytest.mark.parametrize("kind,mode", [("qwen2", "dense"), ("llama", "dense"), ("qwen2", "sparse")])
def test_runtime_pages_change_no_gradient_bit(kind, mode):
    model = model_for_runtime(kind)
    input_ids = torch.randint(0, 97, (1, 420), generator=torch.Generator().manual_seed(1))
    options = dict(chunk_tokens=128, mode=mode, top_k=1, query_tile_tokens=64)
    loss, reference, _ = grads_after(model, input_ids, None, **options)
    for offload in (False, True):
        store = RuntimeKVStore("cpu", offload=offload)
        loss_runtime, grads, trainer = grads_after(model, input_ids, store, **options)
        assert loss_runtime == loss
        for name in reference:
            assert torch.equal(grads[name], reference[name]), f"{name} differs (runtime, offload={offload})"
        # A second step reuses the spaces and frees every page it wrote.
        grads_after(model, input_ids, store, **options)
        assert store.stats.pages_live["current"] == 0
        if offload:
            assert trainer.stats["pages_to_host"] > 0 and trainer.stats["pages_to_device"] > 0
            assert trainer.stats["prefetch_hits"] > 0


def test_runtime_store_rejects_pages_the_runtime_cannot_hold():
    model = model_for_runtime("qwen2")
    trainer = OOMBTrainer(model, OOMBConfig(chunk_tokens=64, page_tokens=64), store=RuntimeKVStore("cpu"))
    with pytest.raises(ValueError, match="powers of two from 64 KiB to 2 MiB"):
        trainer.step(torch.randint(0, 97, (1, 100)))


@pytest.mark.parametrize("mode", ["dense", "sparse"])
def test_runtime_pages_streamed_in_blocks(mode):
    """With offload, the runtime store's layers stream their history one page-block at a time:
    the gradients equal those of one call over the whole history up to float32 rounding."""
    model = model_for_runtime("qwen2")
    input_ids = torch.randint(0, 97, (1, 520), generator=torch.Generator().manual_seed(2))
    options = dict(chunk_tokens=128, mode=mode, top_k=2, query_tile_tokens=64)
    _, reference, _ = grads_after(model, input_ids, None, **options)
    store = RuntimeKVStore("cpu", offload=True)
    _, grads, trainer = grads_after(model, input_ids, store, history_block_tokens=128, **options)
    error = max(float((grads[name] - ref).abs().max() / ref.abs().max()) for name, ref in reference.items())
    assert error <= 2e-5, f"max relative gradient error {error:.3g}"
    assert trainer.stats["prefetch_hits"] > 0
    assert store.stats.pages_live["current"] == 0
