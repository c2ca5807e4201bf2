"""Chunk-recurrent (OOMB) training gives the gradients of full-sequence training.

CPU tests run tiny random-init Qwen2 and Llama models in float32 against full-sequence training
(torch SDPA / eager attention) of the same model on the same tokens. Error measure: for every
parameter, max |g_oomb - g_full| / max |g_full| (a relative error that is not blown up by entries
near zero); the test takes the worst parameter.
"""
from __future__ import annotations

import copy
import json
import math
import os

import pytest
import torch
from transformers import AttentionInterface, LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

from membar.oomb import OOMBConfig, OOMBTrainer, RuntimeKVStore
from membar.oomb.baseline import full_sequence_step

VOCAB = 97


@pytest.fixture(autouse=True)
def _one_thread(one_thread):
    yield


def tiny_model(kind: str, seed: int = 0, layers: int = 2):
    torch.manual_seed(seed)
    common = dict(hidden_size=64, num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                  intermediate_size=96, vocab_size=VOCAB, max_position_embeddings=4096,
                  attn_implementation="sdpa")
    if kind == "qwen2":
        model = Qwen2ForCausalLM(Qwen2Config(**common, rope_theta=10000.0))
    else:
        model = LlamaForCausalLM(Llama_config(common))
    # Random init puts tiny values in some parameters; widen them so every gradient is non-trivial.
    with torch.no_grad():
        for parameter in model.parameters():
            if parameter.dim() == 1:
                parameter.add_(0.1 * torch.randn_like(parameter))
    return model.float()


def Llama_config(common):
    return LlamaConfig(**common, rope_theta=10000.0, attention_bias=False)


def grads_of(model):
    return {name: parameter.grad.detach().clone() for name, parameter in model.named_parameters()}


def max_relative_error(grads, reference):
    return max(float((grads[name] - ref).abs().max() / ref.abs().max()) for name, ref in reference.items())


def cosine(grads, reference):
    a = torch.cat([grads[name].flatten().double() for name in reference])
    b = torch.cat([ref.flatten().double() for ref in reference.values()])
    return float(a @ b / (a.norm() * b.norm()))


def reference_grads(model, input_ids, labels=None):
    model.zero_grad()
    loss = full_sequence_step(model, input_ids, labels, loss_piece_tokens=64, attn_implementation="sdpa")
    grads = grads_of(model)
    model.zero_grad()
    return loss, grads


def oomb_grads(model, input_ids, labels=None, **options):
    model.zero_grad()
    trainer = OOMBTrainer(model, OOMBConfig(**options))
    loss = trainer.step(input_ids, labels)
    grads = grads_of(model)
    model.zero_grad()
    return loss, grads, trainer


@pytest.mark.parametrize("kind", ["qwen2", "llama"])
@pytest.mark.parametrize("chunk_tokens,page_tokens,tokens", [(32, 16, 150), (64, 16, 200), (48, 8, 97), (16, 16, 33)])
def test_dense_gradients_match_full_sequence(kind, chunk_tokens, page_tokens, tokens):
    model = tiny_model(kind)
    input_ids = torch.randint(0, VOCAB, (1, tokens), generator=torch.Generator().manual_seed(tokens))
    loss_full, reference = reference_grads(model, input_ids)
    loss, grads, trainer = oomb_grads(model, input_ids, chunk_tokens=chunk_tokens, page_tokens=page_tokens)
    assert trainer.stats["chunks"] == math.ceil(tokens / chunk_tokens)
    assert abs(loss - loss_full) <= 1e-5 * abs(loss_full)
    error = max_relative_error(grads, reference)
    assert error <= 1e-4, f"max relative gradient error {error:.3g}"


def test_batch_with_ignored_labels_matches_full_sequence():
    model = tiny_model("qwen2", seed=1)
    generator = torch.Generator().manual_seed(7)
    input_ids = torch.randint(0, VOCAB, (2, 90), generator=generator)
    labels = input_ids.clone()
    labels[0, :40] = -100          # a whole chunk of row 0 predicts nothing
    labels[1, 70:] = -100          # the tail of row 1 predicts nothing
    loss_full, reference = reference_grads(model, input_ids, labels)
    loss, grads, _ = oomb_grads(model, input_ids, labels, chunk_tokens=32, page_tokens=16)
    assert abs(loss - loss_full) <= 1e-5 * abs(loss_full)
    assert max_relative_error(grads, reference) <= 1e-4


def test_layer_checkpointing_and_bf16_grad_pages():
    model = tiny_model("llama", seed=2)
    input_ids = torch.randint(0, VOCAB, (1, 120), generator=torch.Generator().manual_seed(3))
    _, reference = reference_grads(model, input_ids)
    _, grads, _ = oomb_grads(copy.deepcopy(model), input_ids, chunk_tokens=32, page_tokens=16,
                             checkpoint_layers=True)
    assert max_relative_error(grads, reference) <= 1e-4
    # bf16 dK/dV pages round each accumulation to 8 bits of mantissa: close, not exact.
    _, grads_bf16, _ = oomb_grads(model, input_ids, chunk_tokens=32, page_tokens=16, grad_page_dtype="bf16")
    error = max_relative_error(grads_bf16, reference)
    assert 0 < error <= 3e-2, f"bf16 grad pages: max relative error {error:.3g}"


@pytest.mark.parametrize("mode,offload,checkpoint_layers", [("dense", False, False), ("dense", True, True),
                                                            ("sparse", False, True), ("sparse", True, False)])
def test_stage1_attention_reused_in_stage2_changes_no_gradient_bit(mode, offload, checkpoint_layers):
    """Note [Stage 1's attention in stage 2]: stage 2 takes stage 1's attention outputs, plans and
    reads no history in its forward, and the gradients are those of recomputing them."""
    model = tiny_model("qwen2", seed=4, layers=3)
    input_ids = torch.randint(0, VOCAB, (1, 150), generator=torch.Generator().manual_seed(6))
    options = dict(chunk_tokens=32, page_tokens=16, mode=mode, top_k=3, query_tile_tokens=16, deterministic=True,
                   offload=offload, checkpoint_layers=checkpoint_layers, history_block_tokens=32)
    if offload:
        options["gpu_budget_bytes"] = 8 * (2 << 20)   # pages travel (3 layers x 4 spaces of one frame)
    loss_recomputed, recomputed, trainer = oomb_grads(model, input_ids, **options)
    read_recomputing = trainer.stats["pages_read"]
    loss_reused, reused, trainer = oomb_grads(model, input_ids, reuse_stage1_attention=True, **options)
    assert loss_reused == loss_recomputed
    for name in recomputed:
        assert torch.equal(reused[name], recomputed[name]), f"{name} differs when stage 1's attention is reused"
    assert trainer.stats["pages_read"] < read_recomputing   # stage 2's forward read no history
    plan = trainer._stage2_plan(trainer._chunks(150), {"summaries": {}, "selections": {}, "stage1_outputs": {}})
    assert plan and not any(access.phase == "forward" for access in plan)


def test_stage1_attention_reuse_without_room_is_one_sentence(monkeypatch):
    """reuse_stage1_attention whose kept outputs exceed the memory they go to: a sentence before any work."""
    from membar.oomb import config as config_module

    model = tiny_model("qwen2", seed=4, layers=2)
    trainer = OOMBTrainer(model, OOMBConfig(chunk_tokens=32, page_tokens=16, reuse_stage1_attention=True))
    trainer.reserve(100)   # the pools first: the host memory faked below is for the kept outputs only
    need = trainer.stage1_output_bytes(100)
    layer = trainer.layers[0]
    assert need == 100 * 2 * layer.num_q_heads * (layer.head_dim * 4 + 4)   # float32 out + lse, 2 layers
    monkeypatch.setattr(config_module, "host_available_bytes", lambda: need)
    input_ids = torch.randint(0, VOCAB, (1, 100), generator=torch.Generator().manual_seed(2))
    with pytest.raises(ValueError, match="keeps stage 1's attention outputs of all 100 tokens"):
        trainer.step(input_ids)
    assert all(parameter.grad is None for parameter in model.parameters())
    monkeypatch.setattr(config_module, "host_available_bytes", lambda: 2 * need)
    trainer.step(input_ids)


@pytest.mark.parametrize("mode", ["dense", "sparse"])
def test_offload_changes_no_gradient_bit(mode, monkeypatch):
    model = tiny_model("qwen2", seed=3, layers=3)
    input_ids = torch.randint(0, VOCAB, (1, 130), generator=torch.Generator().manual_seed(5))
    options = dict(chunk_tokens=32, page_tokens=16, mode=mode, top_k=3, query_tile_tokens=16, deterministic=True)
    loss_resident, resident, _ = oomb_grads(model, input_ids, offload=False, **options)
    # A GPU budget of 5 frames for 12 spaces of one frame each (3 layers x K, V, dK, dV): pages
    # must travel between GPU and host memory. MEMBAR_DISPLACE_RANK=all: placements take the frame
    # already mapped at a page's position whenever its occupant may go (Note [Eviction order]).
    frame = 2 << 20
    for depth, budget, displace in ((0, 5 * frame, "0"), (5, 5 * frame, "0"), (2, 8 * frame, "0"),
                                    (2, 5 * frame, "all")):
        monkeypatch.setenv("MEMBAR_DISPLACE_RANK", displace)
        loss_offload, offloaded, trainer = oomb_grads(model, input_ids, offload=True, prefetch_depth=depth,
                                                      gpu_budget_bytes=budget, **options)
        assert loss_offload == loss_resident
        for name in resident:
            assert torch.equal(offloaded[name], resident[name]), (
                f"{name} differs with offload (depth {depth}, displace rank {displace})")
        assert trainer.stats["pages_moved"] > 0
        assert 0 < trainer.stats["store_host_seconds"] < trainer.stats["seconds"]
        if depth > 0:
            assert trainer.stats["prefetch_hits"] > 0


_MASKS: dict = {}


def _masked_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """Full-sequence attention restricted to a boolean mask [tokens, tokens] per layer."""
    groups = query.shape[1] // key.shape[1]
    key = key.repeat_interleave(groups, 1)
    value = value.repeat_interleave(groups, 1)
    scores = (query @ key.transpose(-1, -2)) * scaling
    scores = scores.masked_fill(~_MASKS[module.layer_idx], float("-inf"))
    return (scores.softmax(-1) @ value).transpose(1, 2), None


def _sparse_masks(selections, tokens, chunk_tokens, page_tokens, tile_tokens, layers):
    causal = torch.ones(tokens, tokens, dtype=torch.bool).tril()
    masks = {}
    for layer in range(layers):
        mask = causal.clone()
        for chunk_first in range(0, tokens, chunk_tokens):
            chunk = chunk_first // chunk_tokens
            selection = selections.get((layer, chunk))
            if selection is None:
                continue
            chunk_end = min(chunk_first + chunk_tokens, tokens)
            for tile, pages in enumerate(selection.tolist()):
                rows = slice(chunk_first + tile * tile_tokens, min(chunk_first + (tile + 1) * tile_tokens, chunk_end))
                allowed = torch.zeros(chunk_first, dtype=torch.bool)
                for page in pages:
                    if page >= 0:
                        allowed[page * page_tokens: (page + 1) * page_tokens] = True
                mask[rows, :chunk_first] = allowed
        masks[layer] = mask
    return masks


@pytest.mark.parametrize("kind", ["qwen2", "llama"])
def test_sparse_gradients_match_masked_full_sequence(kind, tmp_path):
    model = tiny_model(kind, seed=4)
    tokens, chunk_tokens, page_tokens, tile = 200, 48, 8, 16
    input_ids = torch.randint(0, VOCAB, (1, tokens), generator=torch.Generator().manual_seed(11))
    _, dense = reference_grads(model, input_ids)
    loss, sparse, trainer = oomb_grads(model, input_ids, chunk_tokens=chunk_tokens, page_tokens=page_tokens,
                                       mode="sparse", top_k=3, query_tile_tokens=tile)
    selections = trainer.last_selections
    assert any(s is not None for s in selections.values()), "no chunk had more history than top_k pages"
    # The same selection, applied as a mask to full-sequence attention, must give the same gradients.
    _MASKS.clear()
    _MASKS.update(_sparse_masks(selections, tokens, chunk_tokens, page_tokens, tile, 2))
    AttentionInterface.register("membar_test_masked", _masked_attention)
    model.zero_grad()
    loss_masked = full_sequence_step(model, input_ids, attn_implementation="membar_test_masked")
    masked = grads_of(model)
    model.zero_grad()
    assert abs(loss - loss_masked) <= 1e-5 * abs(loss_masked)
    assert max_relative_error(sparse, masked) <= 1e-4
    similarity = cosine(sparse, dense)
    print(f"\nsparse vs dense gradient cosine similarity ({kind}, top_k=3 of up to 19 pages): {similarity:.4f}")
    results = os.environ.get("MEMBAR_RESULTS_DIR")
    if results:
        os.makedirs(results, exist_ok=True)
        with open(os.path.join(results, f"oomb_sparse_cosine_{kind}.json"), "w") as out:
            json.dump({"model": kind, "tokens": tokens, "top_k": 3, "page_tokens": page_tokens,
                       "cosine_to_dense": similarity}, out)
    assert 0.5 < similarity < 1.0


class _LinearHead(torch.nn.Linear):
    """An output projection that is not exactly nn.Linear: the trainer takes the plain loss path."""


def test_head_gradient_added_in_place_equals_autograds_and_keeps_hooks(monkeypatch):
    """Note [Head gradient in place]: the output projection's weight gradient added into .grad by the
    loss pieces' backward equals autograd's, across steps that accumulate (several pieces per chunk,
    a bias on the head); a weight whose gradient hooks must fire gets it through autograd."""
    from membar.oomb import trainer as trainer_module

    in_place_adds = []
    original_backward = trainer_module._HeadLoss.backward

    def counting_backward(ctx, grad_loss):
        grads = original_backward(ctx, grad_loss)
        in_place_adds.append(grads[1] is None)
        return grads

    monkeypatch.setattr(trainer_module._HeadLoss, "backward", staticmethod(counting_backward))
    input_ids = torch.randint(0, VOCAB, (1, 300), generator=torch.Generator().manual_seed(7))
    results = []
    for head_class in (torch.nn.Linear, _LinearHead):
        model = tiny_model("qwen2", seed=3)
        old = model.lm_head
        model.lm_head = head_class(old.in_features, old.out_features, bias=True)
        with torch.no_grad():
            model.lm_head.weight.copy_(old.weight)
            model.lm_head.bias.copy_(0.1 * torch.randn(old.out_features, generator=torch.Generator().manual_seed(8)))
        trainer = OOMBTrainer(model, OOMBConfig(chunk_tokens=128, page_tokens=32, loss_piece_tokens=40))
        losses = [float(trainer.step(input_ids)) for _ in range(2)]   # the second step accumulates
        results.append((losses, grads_of(model)))
        if head_class is torch.nn.Linear:
            fired = []
            model.zero_grad()
            model.lm_head.weight.register_post_accumulate_grad_hook(lambda parameter: fired.append(1))
            trainer.step(input_ids)
            assert fired, "a hooked head weight gets its gradient through autograd"
    # Pieces of 40 tokens: 8 per sequence, the first added by autograd (no .grad yet), then in place;
    # with the hook every piece goes through autograd.
    assert sum(in_place_adds) >= 8 and not all(in_place_adds), in_place_adds
    (in_place_losses, in_place), (plain_losses, plain) = results
    assert in_place_losses == plain_losses
    for name, grad in plain.items():
        assert torch.allclose(in_place[name], grad, rtol=1e-5, atol=1e-6), name
    assert max_relative_error(in_place, plain) < 1e-5


def test_model_still_runs_outside_the_trainer():
    model = tiny_model("qwen2", seed=5)
    input_ids = torch.randint(0, VOCAB, (1, 40), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        before = model(input_ids=input_ids).logits
        OOMBTrainer(model, chunk_tokens=16, page_tokens=16)
        after = model(input_ids=input_ids).logits
    assert torch.allclose(before, after, atol=1e-5)


def test_bad_inputs_are_rejected_with_a_sentence():
    model = tiny_model("qwen2", seed=6)
    trainer = OOMBTrainer(model, chunk_tokens=16, page_tokens=16)
    with pytest.raises(TypeError, match="integer token ids"):
        trainer.step(torch.rand(1, 20))
    with pytest.raises(ValueError, match="at least 2 tokens"):
        trainer.step(torch.tensor([[3]]))
    with pytest.raises(ValueError, match=r"token ids must lie in \[0, 97\)"):
        trainer.step(torch.tensor([[1, 2, 500]]))
    with pytest.raises(ValueError, match="labels shape"):
        trainer.step(torch.tensor([[1, 2, 3]]), torch.tensor([[1, 2]]))
    with pytest.raises(ValueError, match="no token has a target"):
        trainer.step(torch.tensor([[1, 2, 3]]), torch.tensor([[1, -100, -100]]))
    with pytest.raises(ValueError, match=r"\[tokens\] or \[batch, tokens\]"):
        trainer.step(torch.zeros(1, 2, 3, dtype=torch.long))
    with pytest.raises(ValueError, match="multiple of page_tokens"):
        OOMBConfig(chunk_tokens=100, page_tokens=16)
    with pytest.raises(ValueError, match="'dense' or 'sparse'"):
        OOMBConfig(mode="banded")
    with pytest.raises(ValueError, match="float32 or bfloat16"):
        OOMBConfig(grad_page_dtype="int8")
    from transformers import GPT2Config, GPT2LMHeadModel

    with pytest.raises(ValueError, match="no rotary position embedding"):
        OOMBTrainer(GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=50)))
    with pytest.raises(ValueError, match="serves"):
        RuntimeKVStore("cpu").open_sequence(
            __import__("membar.oomb", fromlist=["PageLayout"]).PageLayout(
                1, 1, 16, 1, 8, torch.float32, torch.float32, torch.device("meta")))


gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.gpu
@gpu
def test_gpu_bf16_error_at_most_twice_full_sequence_bf16():
    """bf16 on the GPU: OOMB's gradient error against a float32 reference is at most 2x that of
    full-sequence bf16 training."""
    # The GPU kernels take head_dim 64/128 and page_tokens 64/128.
    config = Qwen2Config(hidden_size=256, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         intermediate_size=512, vocab_size=VOCAB, max_position_embeddings=8192,
                         attn_implementation="sdpa")
    torch.manual_seed(7)
    model = Qwen2ForCausalLM(config).cuda()
    input_ids = torch.randint(0, VOCAB, (1, 1000), device="cuda")
    _, reference = reference_grads(model.float(), input_ids)
    bf16 = copy.deepcopy(model).to(torch.bfloat16)
    _, full_bf16 = reference_grads(bf16, input_ids)
    _, oomb_bf16, _ = oomb_grads(bf16, input_ids, chunk_tokens=256, page_tokens=64)
    full_error = max_relative_error({k: v.float() for k, v in full_bf16.items()}, reference)
    oomb_error = max_relative_error({k: v.float() for k, v in oomb_bf16.items()}, reference)
    print(f"\nbf16 max relative gradient error: full sequence {full_error:.3g}, OOMB {oomb_error:.3g}")
    assert oomb_error <= 2 * full_error


def gpu_bf16_model(seed: int):
    """A 3-layer bf16 Qwen2 on CUDA whose pages (64 tokens x 4 KV heads x 256 dims) are 128 KiB."""
    config = Qwen2Config(hidden_size=256, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4,
                         head_dim=256, intermediate_size=512, vocab_size=VOCAB, max_position_embeddings=8192,
                         attn_implementation="sdpa")
    torch.manual_seed(seed)
    return Qwen2ForCausalLM(config).cuda().to(torch.bfloat16)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("mode", ["dense", "sparse"])
def test_gpu_offload_changes_no_gradient_bit(mode):
    # Pages of 64 tokens x 4 KV heads x 256 dims (128 KiB in bf16): 30 frames of pages in all,
    # against a GPU budget of 14 (+2 slack), so pages leave for host memory and come back.
    model = gpu_bf16_model(seed=8)
    input_ids = torch.randint(0, VOCAB, (1, 1500), device="cuda")
    options = dict(chunk_tokens=256, page_tokens=64, mode=mode, top_k=4, query_tile_tokens=64, deterministic=True)
    _, resident, _ = oomb_grads(model, input_ids, offload=False, **options)
    _, offloaded, trainer = oomb_grads(model, input_ids, offload=True, gpu_budget_bytes=28 << 20, **options)
    for name in resident:
        assert torch.equal(offloaded[name], resident[name]), name
    assert trainer.stats["pages_to_host"] > 0 and trainer.stats["pages_to_device"] > 0


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("offload", [False, True])
def test_gpu_stage1_attention_reused_changes_no_gradient_bit(offload):
    """CUDA, bf16, deterministic kernels: stage 2 taking stage 1's attention outputs (kept on the GPU,
    or in pinned host memory with offload) gives the gradient bits of recomputing them."""
    model = gpu_bf16_model(seed=10)
    input_ids = torch.randint(0, VOCAB, (1, 1500))
    options = dict(chunk_tokens=256, page_tokens=64, deterministic=True, offload=offload,
                   **({"gpu_budget_bytes": 28 << 20} if offload else {}))
    _, recomputed, _ = oomb_grads(model, input_ids, **options)
    _, reused, _ = oomb_grads(model, input_ids, reuse_stage1_attention=True, **options)
    for name in recomputed:
        assert torch.equal(reused[name], recomputed[name]), name


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("mode", ["dense", "sparse"])
def test_gpu_streamed_history_matches_one_call(mode):
    """CUDA: offloaded layers streamed in blocks of 256 tokens (copy streams, prefetch, write-back
    behind) give the gradients of the one-call path up to bf16 rounding of the per-block dq."""
    model = gpu_bf16_model(seed=9)
    input_ids = torch.randint(0, VOCAB, (1, 1500))
    options = dict(chunk_tokens=256, page_tokens=64, mode=mode, top_k=4, query_tile_tokens=64, deterministic=True)
    _, resident, _ = oomb_grads(model, input_ids, offload=False, **options)
    for checkpoint_layers in (False, True):
        _, streamed, trainer = oomb_grads(model, input_ids, offload=True, history_block_tokens=256,
                                          gpu_budget_bytes=24 << 20, checkpoint_layers=checkpoint_layers, **options)
        resident32 = {name: g.float() for name, g in resident.items()}
        error = max_relative_error({name: g.float() for name, g in streamed.items()}, resident32)
        similarity = cosine({name: g.float() for name, g in streamed.items()}, resident32)
        print(f"\nstreamed vs one call ({mode}, checkpoint {checkpoint_layers}): max relative error {error:.3g}, "
              f"cosine {similarity:.6f}")
        assert error <= 5e-2 and similarity >= 0.9995
        assert trainer.stats["pages_to_device"] > 0 and trainer.stats["prefetch_hits"] > 0


def _fail_in_backward(model):
    """A backward hook on the first layer's MLP that raises once (what an out-of-memory error in the
    middle of stage 2 does to the trainer)."""
    def hook(module, grad_input, grad_output):
        handle.remove()
        raise RuntimeError("injected failure in the backward")

    handle = model.model.layers[0].mlp.register_full_backward_hook(hook)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("offload", [False, True])
def test_gpu_failed_step_gives_its_memory_back(offload):
    """CUDA: a step that fails in its backward (an OOM, session 24: Gemma-2-9B at 128K) leaves the
    runtime usable, and a trainer dropped after it gives its GPU frames back: the next model of the
    same process must not find them taken."""
    import gc

    def free_bytes():
        gc.collect()
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        return torch.cuda.mem_get_info()[0]

    model = gpu_bf16_model(seed=11)
    input_ids = torch.randint(0, VOCAB, (1, 1500))
    options = dict(chunk_tokens=256, page_tokens=64, offload=offload,
                   **({"gpu_budget_bytes": 28 << 20, "history_block_tokens": 256} if offload else {}))
    before = free_bytes()
    trainer = OOMBTrainer(model, OOMBConfig(**options))
    trainer.reserve(64 * 1024)   # 64K tokens x 3 layers of 128 KiB pages per 64 tokens: ~1.5 GiB
    _fail_in_backward(model)
    with pytest.raises(RuntimeError, match="injected failure"):
        trainer.step(input_ids)
    model.zero_grad(set_to_none=True)
    # The same trainer trains the next step (no page left acquired, no copy left waiting).
    loss = trainer.step(input_ids)
    assert math.isfinite(loss)
    del trainer
    model.zero_grad(set_to_none=True)
    after = free_bytes()
    assert after >= before - (256 << 20), f"{(before - after) / 2**20:.0f} MiB of GPU memory not given back"


def test_failed_step_leaves_the_trainer_usable_and_collectable():
    """CPU: a step that fails in its backward frees its sequence's pages, the next step trains, and
    the trainer and its store are collected once dropped."""
    import gc
    import weakref

    model = tiny_model("qwen2")
    input_ids = torch.randint(0, VOCAB, (1, 300))
    trainer = OOMBTrainer(model, OOMBConfig(chunk_tokens=64, page_tokens=16))
    _fail_in_backward(model)
    with pytest.raises(RuntimeError, match="injected failure"):
        trainer.step(input_ids)
    assert trainer.store.stats.pages_live["current"] == 0
    model.zero_grad(set_to_none=True)
    assert math.isfinite(trainer.step(input_ids))
    store = weakref.ref(trainer.store)
    del trainer
    gc.collect()
    assert store() is None


@pytest.mark.parametrize("tile", [16, 48])
def test_page_selection_in_pytorch_trains_as_the_kernel_selects(tile, monkeypatch):
    """Note [Page selection in PyTorch]: the trainer's CUDA path (MEMBAR_PAGE_SELECT=pytorch runs it
    on the CPU) selects the kernel's pages for every layer and chunk, so the step's loss and
    gradients are the same bits; tiles of 48 are one selection per chunk."""
    model = tiny_model("qwen2", seed=4)
    input_ids = torch.randint(0, VOCAB, (1, 200), generator=torch.Generator().manual_seed(12))
    options = dict(chunk_tokens=48, page_tokens=8, mode="sparse", top_k=3, query_tile_tokens=tile)
    monkeypatch.setenv("MEMBAR_PAGE_SELECT", "kernel")
    loss, kernel, trainer = oomb_grads(model, input_ids, **options)
    want = {key: None if s is None else s.clone() for key, s in trainer.last_selections.items()}
    monkeypatch.setenv("MEMBAR_PAGE_SELECT", "pytorch")
    loss_pytorch, pytorch, trainer = oomb_grads(model, input_ids, **options)
    got = trainer.last_selections
    assert got.keys() == want.keys() and any(s is not None for s in got.values())
    for key, selection in want.items():
        assert (selection is None and got[key] is None) or torch.equal(got[key], selection), key
    assert loss_pytorch == loss
    for name, grad in kernel.items():
        assert torch.equal(pytorch[name], grad), name


def test_passkey_task_places_the_key_far_enough_back():
    from membar.oomb.tasks import PasskeyTask

    for repeats in (1, 3):
        task = PasskeyTask(vocab_size=64, tokens=600, distance=500, num_keys=8, seed=0, key_repeats=repeats)
        batch = task.batch(4)
        for row in range(4):
            ids = batch.input_ids[row]
            markers = (ids == PasskeyTask.KEY_MARKER).nonzero().flatten()
            assert len(markers) == repeats
            last_key = int(markers[-1]) + 1
            assert ids[last_key] == batch.keys[row] == ids[batch.query_position + 1]
            assert batch.query_position - last_key >= 500
            assert ids[batch.query_position] == PasskeyTask.QUERY_MARKER
            # Keys appear only in the statement and the answer: nothing else gives them away.
            assert int(((ids >= 2) & (ids < 10)).sum()) == repeats + 1
            assert (batch.labels[row] != -100).sum() == 1


def test_cli_trains_and_prints_a_json_summary(capsys):
    from membar.train import run

    summary = run(["--model", "tiny-qwen2", "--seq-len", "200", "--chunk", "64", "--page-tokens", "32",
                   "--steps", "3", "--lr", "1e-2", "--json", "--no-progress", "--offload", "--gpu-budget", "10MiB"])
    printed = capsys.readouterr().out.strip().splitlines()
    assert json.loads(printed[-1])["steps_run"] == 3
    assert summary["steps"][0]["pages_moved"] > 0
    assert summary["attention_kernels"] == "membar"     # the CPU always runs membar's kernels
    assert any(line.startswith("attention: membar kernels") for line in printed)
    # Uniform random tokens: the loss stays near log(vocab) = 6.24 (nothing to learn in 3 steps).
    assert all(abs(step["loss"] - math.log(512)) < 0.5 for step in summary["steps"])


def test_cli_reuse_stage1_attention_trains_the_same_steps(capsys):
    """membar-train --reuse-stage1-attention: the same losses step after step as recomputing
    (deterministic mode: otherwise the CPU kernels' multi-threaded dQ sums may differ in their last
    bits between runs, and step 2's loss with them)."""
    from membar.train import run

    common = ["--model", "tiny-qwen2", "--seq-len", "200", "--chunk", "64", "--page-tokens", "32", "--steps", "2",
              "--lr", "1e-2", "--json", "--no-progress", "--offload", "--gpu-budget", "10MiB", "--deterministic"]
    recomputed, reused = (run(common + extra) for extra in ([], ["--reuse-stage1-attention"]))
    capsys.readouterr()
    assert reused["reuse_stage1_attention"] and not recomputed["reuse_stage1_attention"]
    assert [step["loss"] for step in reused["steps"]] == [step["loss"] for step in recomputed["steps"]]


@pytest.mark.parametrize("mode", ["dense", "sparse"])
def test_predict_matches_the_full_forward(mode):
    model = tiny_model("llama", seed=9)
    input_ids = torch.randint(0, VOCAB, (1, 150), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        reference = model(input_ids=input_ids).logits[0]
    trainer = OOMBTrainer(model, chunk_tokens=32, page_tokens=16, mode=mode, top_k=64)
    positions = [0, 31, 32, 100, 149]
    logits = trainer.predict(input_ids[0], positions)
    assert torch.allclose(logits, reference[positions], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("mode", ["dense", "sparse"])
def test_streamed_history_matches_one_call_per_layer(mode):
    """Offloaded layers stream their history in blocks of pages (attention without the chunk's
    keys per block, merged by log-sum-exp with a chunk-only call; the backward per block given the
    final out/lse). Gradients equal the one-call path up to float32 rounding, with and without
    layer checkpointing (whose recompute reuses the stage-2 attention output)."""
    model = tiny_model("qwen2", seed=3, layers=3)
    input_ids = torch.randint(0, VOCAB, (1, 150), generator=torch.Generator().manual_seed(5))
    options = dict(chunk_tokens=32, page_tokens=16, mode=mode, top_k=3, query_tile_tokens=16, deterministic=True)
    loss_one_call, one_call, _ = oomb_grads(model, input_ids, offload=False, **options)
    for checkpoint_layers in (False, True):
        # Blocks of 2 pages: the last chunk's 128 history tokens arrive in 4 blocks.
        # A GPU budget of 6 frames for 12 spaces of one frame each: pages travel, ahead of use.
        loss, streamed, trainer = oomb_grads(model, input_ids, offload=True, history_block_tokens=32,
                                             checkpoint_layers=checkpoint_layers, gpu_budget_bytes=6 << 21, **options)
        assert abs(loss - loss_one_call) <= 1e-6 * abs(loss_one_call)
        error = max_relative_error(streamed, one_call)
        assert 0 <= error <= 2e-5, f"streamed history: max relative gradient error {error:.3g}"
        hits, misses = trainer.stats["prefetch_hits"], trainer.stats["prefetch_misses"]
        print(f"checkpoint_layers={checkpoint_layers}: {hits} prefetch hits, {misses} misses, "
              f"{trainer.stats['pages_moved']} pages moved")
        assert hits > 0 and trainer.stats["pages_moved"] > 0


def test_layer_recompute_reuses_the_attention_output():
    model = tiny_model("llama", seed=2)
    input_ids = torch.randint(0, VOCAB, (1, 120), generator=torch.Generator().manual_seed(3))
    calls = {"forward": 0}
    forward = torch.ops.membar.paged_attention_forward

    class Counting:
        def __call__(self, *args, **kwargs):
            calls["forward"] += 1
            return forward(*args, **kwargs)

    import membar.attention as attention_module

    original = attention_module._ops
    attention_module._ops = type("Ops", (), {"paged_attention_forward": Counting(),
                                             "paged_attention_backward": torch.ops.membar.paged_attention_backward,
                                             "page_summary": torch.ops.membar.page_summary,
                                             "page_select": torch.ops.membar.page_select})()
    try:
        counts = {}
        for checkpoint_layers in (False, True):
            calls["forward"] = 0
            oomb_grads(copy.deepcopy(model), input_ids, chunk_tokens=32, page_tokens=16,
                       checkpoint_layers=checkpoint_layers)
            counts[checkpoint_layers] = calls["forward"]
    finally:
        attention_module._ops = original
    # 4 chunks x 2 layers, each attended in stage 1 and once in stage 2, checkpointed or not.
    assert counts[False] == counts[True] == 2 * 4 * 2


def test_chunk_context_is_seen_from_other_threads():
    """On CUDA, autograd runs backward (and the layer recompute of checkpointing, which calls the
    attention function) on its own device thread: the chunk context must be visible there."""
    import threading

    from membar.oomb.hf_attention import chunk_context, current_context

    seen = []
    marker = object()
    with chunk_context(marker):
        worker = threading.Thread(target=lambda: seen.append(current_context()))
        worker.start()
        worker.join()
    assert seen == [marker]
    assert current_context() is None


def test_backward_on_another_thread_as_on_cuda(monkeypatch):
    """CUDA's autograd engine runs backward on a device thread, and layer checkpointing recomputes
    the decoder layers (calling the attention function) there. Running every backward of a step
    on a fresh thread reproduces that on the CPU: the gradients must not change."""
    import threading

    model = tiny_model("qwen2", seed=2)
    input_ids = torch.randint(0, VOCAB, (1, 120), generator=torch.Generator().manual_seed(3))
    options = dict(chunk_tokens=32, page_tokens=16, checkpoint_layers=True, offload=True, history_block_tokens=32,
                   deterministic=True)
    _, same_thread, _ = oomb_grads(copy.deepcopy(model), input_ids, **options)
    backward = torch.Tensor.backward

    def backward_on_a_thread(self, *args, **kwargs):
        errors = []

        def run():
            try:
                backward(self, *args, **kwargs)
            except BaseException as error:   # re-raised on the caller's thread
                errors.append(error)

        worker = threading.Thread(target=run)
        worker.start()
        worker.join()
        if errors:
            raise errors[0]

    monkeypatch.setattr(torch.Tensor, "backward", backward_on_a_thread)
    _, other_thread, _ = oomb_grads(copy.deepcopy(model), input_ids, **options)
    for name, reference in same_thread.items():
        assert torch.equal(other_thread[name], reference), name


def test_partial_step_runs_stage1_and_some_stage2_chunks():
    """Note [Partial steps]: all of stage 1, the first N chunks of stage 2, and the estimates."""
    model = tiny_model("qwen2", seed=12)
    ids = torch.randint(0, VOCAB, (1, 300))
    trainer = OOMBTrainer(model, OOMBConfig(chunk_tokens=32, page_tokens=16))
    with pytest.raises(ValueError, match="stage2_chunks"):
        trainer.step(ids, stage2_chunks=0)
    trainer.step(ids, stage2_chunks=3)
    stats = trainer.stats
    assert stats["partial_step"] and stats["stage2_chunks_run"] == 3 and stats["stage2_chunks_total"] == 10
    assert len(stats["chunk_seconds"]["stage1"]) == 10 and len(stats["chunk_seconds"]["stage2"]) == 3
    assert stats["step_seconds_upper_bound"] >= stats["stage1_seconds"] > 0
    # Only the last 3 chunks ran backward: the embeddings of tokens before them got no gradient
    # through their own positions' losses, so the partial gradient differs from the whole one.
    partial = grads_of(model)
    model.zero_grad()
    trainer.step(ids)
    assert "partial_step" not in trainer.stats
    assert any(not torch.allclose(partial[name], g) for name, g in grads_of(model).items())
