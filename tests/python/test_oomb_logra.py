"""Both methods on one runtime: chunk-recurrent training (OOMB) whose optimizer is LoGRA. The
sketches the chunks' backwards accumulate equal those of one full-sequence backward, with the
pages offloaded through a small GPU budget and LoGRA's states in the same runtime, and the merged
update matches the full-sequence one (SGD on the sketches: Adam's first step is the sign of the
gradient, which no rounding-level comparison can check)."""
from __future__ import annotations

import copy
import json

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from membar import logra
from membar.oomb import OOMBConfig, OOMBTrainer
from membar.oomb.runtime_store import RuntimeKVStore
from membar.train import main as train_main

_MIB = 1 << 20


@pytest.fixture(autouse=True)
def _one_thread(one_thread):
    yield


def small_model():
    torch.manual_seed(0)
    # Pages of 128 tokens x 4 KV heads x 256 dims in float32 (512 KiB): enough frames to offload.
    return Qwen2ForCausalLM(Qwen2Config(hidden_size=128, num_hidden_layers=2, num_attention_heads=4,
                                        num_key_value_heads=4, head_dim=256, intermediate_size=192, vocab_size=97))


def sketches(handle) -> torch.Tensor:
    return torch.cat([layer.sketch.flatten().clone() for layer in handle.layers])


def relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


@pytest.mark.parametrize("mode", ["plain", "offload"])
def test_chunk_sketches_equal_full_sequence_sketches_and_the_update_matches(mode):
    base = small_model()
    input_ids = torch.randint(0, 97, (1, 2000), generator=torch.Generator().manual_seed(1))
    # Reference: one full-sequence backward into LoGRA sketches (states in plain tensors).
    reference = copy.deepcopy(base)
    ref_handle = logra.apply_logra(reference, rank=8, seed=3, runtime=None)
    reference(input_ids, labels=input_ids).loss.backward()
    ref_sketches = sketches(ref_handle)
    # A large rate makes the update, not the weight's float32 rounding, what the comparison sees.
    before = [layer.weight.clone() for layer in ref_handle.layers]
    logra.LoGRAOptimizer(ref_handle, lr=100.0, algorithm="sgd").step()
    ref_updates = [layer.weight - weight for layer, weight in zip(ref_handle.layers, before)]

    model = copy.deepcopy(base)
    offload = mode == "offload"
    store = RuntimeKVStore("cpu", offload=offload, gpu_budget_bytes=20 * _MIB if offload else None,
                           extra_bytes=(logra.state_pool_bytes(model, 8),) * 2)
    trainer = OOMBTrainer(model, OOMBConfig(chunk_tokens=128, page_tokens=128, offload=offload,
                                            history_block_tokens=256), store=store)
    trainer.reserve(input_ids.shape[1])
    handle = logra.apply_logra(model, rank=8, seed=3, runtime=store.runtime)
    assert handle.states.storage.describe().startswith("runtime pages")
    trainer.step(input_ids)
    if offload:
        assert trainer.stats["pages_to_host"] > 0
    assert relative_error(sketches(handle), ref_sketches) <= 1e-5
    before = [layer.weight.clone() for layer in handle.layers]
    logra.LoGRAOptimizer(handle, lr=100.0, algorithm="sgd").step()
    for layer, weight, expected in zip(handle.layers, before, ref_updates):
        assert relative_error(layer.weight - weight, expected) <= 2e-5
    # Both methods' spaces live in one runtime.
    names = {space["name"] for space in store.runtime.stats()["spaces"]}
    assert {"L000.k", "L001.dv"} <= names and any(name.startswith("logra.") for name in names)


def test_membar_train_with_logra_updates_the_projections(tmp_path, capsys):
    out = tmp_path / "model"
    code = train_main(["--model", "tiny-qwen2", "--seq-len", "512", "--chunk", "128", "--page-tokens", "32",
                       "--steps", "3", "--optimizer", "logra", "--logra-rank", "8", "--lr", "1e-2",
                       "--offload", "--no-progress", "--json", "--save", str(out)])
    assert code == 0
    lines = capsys.readouterr().out.strip().splitlines()
    summary = json.loads(lines[-1])
    assert summary["optimizer"] == "logra" and summary["steps_run"] == 3
    assert any(line.startswith("optimizer: LoGRA rank 8") for line in lines)
    assert all(torch.isfinite(torch.tensor(step["loss"])) for step in summary["steps"])
    from transformers import AutoModelForCausalLM

    from membar.oomb.presets import build_model

    trained = AutoModelForCausalLM.from_pretrained(out)
    initial = build_model("tiny-qwen2", dtype=torch.float32, device=torch.device("cpu"), max_positions=512, seed=0)
    changed = {name for name, p in trained.named_parameters()
               if not torch.equal(p, dict(initial.named_parameters())[name])}
    assert any("q_proj" in name for name in changed) and any("down_proj" in name for name in changed)
    assert not any("embed_tokens" in name or "norm" in name for name in changed)   # frozen under LoGRA
