"""Chunk-recurrent training of the decoder families people train gives full-sequence gradients.

Every case is a tiny random-init model of one family (2 layers, float32, odd vocabulary of 101,
chunk 1024, pages of 128) trained on one sequence, against full-sequence training of the same
model (transformers' SDPA, or its eager attention for Gemma 2, whose soft-cap SDPA ignores).
Error measure as in test_oomb.py: for every parameter max |g - g_full| / max |g_full|, worst
parameter, <= 1e-4.

Lengths: the cases marked `long` run 10,000 tokens (10 chunks, the last partial); the others run
3,000 (3 chunks). membar's CPU reference kernels take ~15 s for a 10K case, and every mechanism
under test (pages, windows that cross chunk and page boundaries, RoPE computed for the whole
length, soft-caps, MoE routing) is exercised at 3,000 tokens with chunks of 1024; the RoPE
variants that depend on the length run past max_position_embeddings either way.
"""
from __future__ import annotations

import copy

import pytest
import torch
import transformers

from membar.oomb import OOMBConfig, OOMBTrainer
from membar.oomb.baseline import full_sequence_step
from membar.oomb.hf_attention import ChunkContext
from membar.oomb.models import TESTED_FAMILIES, LayerAttention, check_layers

VOCAB = 101          # odd on purpose
LONG, SHORT = 10_000, 3_000
WINDOW = 700         # crosses page (128) and chunk (1024) boundaries


@pytest.fixture(autouse=True)
def _one_thread(one_thread):
    yield


def _small(**overrides):
    # Two query heads of 16 dims over one K/V head keep the CPU reference kernels fast. Weights of
    # std 0.1 (not 0.02) give peaked attention, as trained models have: near-uniform attention over
    # thousands of keys leaves q/k gradients a million times smaller than the rest, where float32
    # cancellation alone (in the full-sequence reference too) reaches 1e-4 of them.
    shape = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                 intermediate_size=48, vocab_size=VOCAB, max_position_embeddings=16384, pad_token_id=0,
                 bos_token_id=1, eos_token_id=2, initializer_range=0.1)
    shape.update(overrides)
    return shape


def _rope(kind: str, theta: float = 10000.0) -> dict:
    half = 8   # head_dim 16 / 2 frequencies
    return {
        "default": {"rope_type": "default", "rope_theta": theta},
        "linear": {"rope_type": "linear", "factor": 2.0, "rope_theta": theta},
        "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                   "original_max_position_embeddings": 1024, "rope_theta": theta},
        "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024, "rope_theta": theta},
        "dynamic": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": theta},
        "longrope": {"rope_type": "longrope", "short_factor": [1.0 + 0.1 * i for i in range(half)],
                     "long_factor": [2.0 + 0.5 * i for i in range(half)], "original_max_position_embeddings": 1024,
                     "rope_theta": theta},
    }[kind]


def family_config(case: str):
    """(transformers config, tokens) of a test case: a family, or a family with one option."""
    t = transformers
    if case.startswith("rope-"):
        kind = case[len("rope-"):]
        # dynamic scales past max_position_embeddings; longrope switches to its long factors past
        # original_max_position_embeddings (max_position_embeddings sets its attention factor).
        max_positions = 1024 if kind == "dynamic" else 8192
        tokens = LONG if kind in ("dynamic", "longrope") else SHORT
        return t.LlamaConfig(**_small(max_position_embeddings=max_positions), rope_parameters=_rope(kind)), tokens
    configs = {
        "llama": (t.LlamaConfig(**_small(), attention_bias=True, mlp_bias=True), LONG),
        "qwen2": (t.Qwen2Config(**_small()), SHORT),
        # Layer 0 global, layer 1 local (max_window_layers=1).
        "qwen2-sliding": (t.Qwen2Config(**_small(), use_sliding_window=True, sliding_window=WINDOW,
                                        max_window_layers=1), SHORT),
        "qwen3": (t.Qwen3Config(**_small(), tie_word_embeddings=True), SHORT),
        "mistral": (t.MistralConfig(**_small(), sliding_window=WINDOW), LONG),
        "mistral-global": (t.MistralConfig(**_small(), sliding_window=None), SHORT),
        # Small soft-caps so that tanh bends the scores and logits of a random model.
        "gemma2": (t.Gemma2Config(**_small(), sliding_window=WINDOW, query_pre_attn_scalar=24,
                                  attn_logit_softcapping=2.0, final_logit_softcapping=3.0,
                                  layer_types=["sliding_attention", "full_attention"]), SHORT),
        "gemma3_text": (t.Gemma3TextConfig(**_small(), sliding_window=WINDOW, query_pre_attn_scalar=24,
                                           layer_types=["sliding_attention", "full_attention"]), SHORT),
        "phi3": (t.Phi3Config(**{k: v for k, v in _small().items() if k != "head_dim"}), SHORT),
        "phi3-longrope": (t.Phi3Config(**{k: v for k, v in _small(max_position_embeddings=8192).items()
                                          if k != "head_dim"}, original_max_position_embeddings=1024,
                                       rope_parameters=_rope("longrope")), SHORT),
        "qwen3_moe": (t.Qwen3MoeConfig(**_small(), num_experts=4, num_experts_per_tok=2, moe_intermediate_size=24,
                                       norm_topk_prob=True), SHORT),
        "mixtral": (t.MixtralConfig(**_small(), num_local_experts=4, num_experts_per_tok=2), SHORT),
    }
    return configs[case]


def build(config, seed: int = 0):
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").float()
    # Random init leaves norms at 1 and biases at 0: widen them so every gradient is non-trivial.
    with torch.no_grad():
        for parameter in model.parameters():
            if parameter.dim() == 1:
                parameter.add_(0.1 * torch.randn_like(parameter))
    return model


def grads_of(model):
    return {name: p.grad.detach().clone() for name, p in model.named_parameters() if p.grad is not None}


def max_relative_error(grads, reference):
    assert grads.keys() == reference.keys()
    return max(float((grads[name] - ref).abs().max() / ref.abs().max()) for name, ref in reference.items())


def compare(model, tokens: int, seed: int = 0, **options):
    """(loss, full-sequence loss, max relative gradient error, trainer) of one step."""
    input_ids = torch.randint(0, VOCAB, (1, tokens), generator=torch.Generator().manual_seed(seed))
    reference_model = copy.deepcopy(model)
    loss_full = full_sequence_step(reference_model, input_ids, loss_piece_tokens=4096)
    reference = grads_of(reference_model)
    model.zero_grad()
    options = dict(dict(chunk_tokens=1024, page_tokens=128), **options)
    trainer = OOMBTrainer(model, OOMBConfig(**options))
    loss = trainer.step(input_ids)
    return loss, loss_full, max_relative_error(grads_of(model), reference), trainer


CASES = ["llama", "qwen2", "qwen2-sliding", "qwen3", "mistral", "mistral-global", "gemma2", "gemma3_text", "phi3",
         "phi3-longrope", "qwen3_moe", "mixtral"] + [f"rope-{kind}" for kind in
                                                     ("default", "linear", "llama3", "yarn", "dynamic", "longrope")]


def _marks(case):
    return [pytest.mark.slow] if family_config(case)[1] == LONG else []


@pytest.mark.parametrize("case", [pytest.param(case, marks=_marks(case)) for case in CASES])
def test_chunk_recurrent_gradients_equal_full_sequence(case):
    config, tokens = family_config(case)
    model = build(config)
    loss, loss_full, error, trainer = compare(model, tokens)
    assert abs(loss - loss_full) <= 1e-5 * abs(loss_full), (loss, loss_full)
    assert error <= 1e-4, f"{case}: max relative gradient error {error:.3g}"
    assert trainer.stats["chunks"] == -(-tokens // 1024)


def test_every_tested_family_has_a_case():
    families = {family_config(case)[0].model_type for case in CASES}
    assert set(TESTED_FAMILIES) <= families


@pytest.mark.parametrize("q_heads,kv_heads", [(4, 4), (4, 2), (6, 2), (8, 1), (16, 1)])
def test_head_ratios_from_mha_to_sixteen_queries_per_key(q_heads, kv_heads):
    config = transformers.Qwen3Config(**_small(num_attention_heads=q_heads, num_key_value_heads=kv_heads, head_dim=8,
                                               hidden_size=48, attention_bias=True))
    loss, loss_full, error, _ = compare(build(config, seed=q_heads), 1500, chunk_tokens=512)
    assert abs(loss - loss_full) <= 1e-5 * abs(loss_full)
    assert error <= 1e-4, f"{q_heads}/{kv_heads} heads: max relative gradient error {error:.3g}"


def test_length_dependent_rope_without_the_hooks_is_wrong():
    """Note [RoPE that depends on the sequence length]: with the hooks removed, each chunk rotates
    with its own length's frequencies, and the gradients are far from full-sequence ones."""
    config, _ = family_config("rope-dynamic")
    model = build(config)
    input_ids = torch.randint(0, VOCAB, (1, 2500), generator=torch.Generator().manual_seed(1))
    reference_model = copy.deepcopy(model)
    full_sequence_step(reference_model, input_ids)
    reference = grads_of(reference_model)
    trainer = OOMBTrainer(model, OOMBConfig(chunk_tokens=512, page_tokens=128))
    assert trainer.rotary.modules, "the dynamic rotary embedding was not hooked"
    trainer.rotary.remove()
    trainer.step(input_ids)
    assert max_relative_error(grads_of(model), reference) > 1e-2


def test_a_shorter_sequence_after_a_longer_one_gets_its_own_rope():
    """"dynamic" caches the longest length it has seen; each sequence must get the frequencies a
    fresh model gives it in full-sequence training."""
    config, _ = family_config("rope-dynamic")
    model = build(config)
    trainer = OOMBTrainer(model, OOMBConfig(chunk_tokens=512, page_tokens=128))
    trainer.step(torch.randint(0, VOCAB, (1, 3000), generator=torch.Generator().manual_seed(2)))
    model.zero_grad()
    input_ids = torch.randint(0, VOCAB, (1, 1800), generator=torch.Generator().manual_seed(3))
    trainer.step(input_ids)
    fresh = build(config)
    full_sequence_step(fresh, input_ids)
    assert max_relative_error(grads_of(model), grads_of(fresh)) <= 1e-4


def test_window_layers_read_only_their_window_pages():
    """A local layer's chunk reads the pages holding its window only (so with offload, pages
    older than the window never travel), and the gradients stay exact (also with history streamed
    in blocks, which exercises the PyTorch path's log-sum-exp merge)."""
    window, page, chunk, tokens = 300, 64, 256, 2000
    local = transformers.MistralConfig(**_small(), sliding_window=window)
    options = dict(chunk_tokens=chunk, page_tokens=page, offload=True)
    _, _, error, trainer = compare(build(local), tokens, **options)
    assert error <= 1e-4
    # Per layer and chunk c > 0, each of stage 1, the stage-2 forward and backward reads the K and
    # V pages of its window: at most ceil((window - 1) / page) + 1 pages back from the chunk.
    chunks = -(-tokens // chunk)
    pages_per_read = -(-(window - 1) // page) + 1
    reads_per_chunk = 3 * 2 + 2   # K/V in three passes, dK/dV once (each counted K and V)
    bound = 2 * (chunks - 1) * pages_per_read * reads_per_chunk
    read = trainer.stats["pages_read"]
    assert 0 < read <= bound, (read, bound)
    _, _, _, global_trainer = compare(build(transformers.MistralConfig(**_small(), sliding_window=None)), tokens,
                                      **options)
    assert global_trainer.stats["pages_read"] > 3 * read
    # Gemma 2 (a global soft-capped layer beside a local one) with history streamed in blocks of 2 pages.
    config, _ = family_config("gemma2")
    _, _, error, _ = compare(build(config), 1600, chunk_tokens=256, page_tokens=64, offload=True,
                             history_block_tokens=128)
    assert error <= 1e-4


def test_history_first_page_of_a_window():
    config, _ = family_config("qwen2-sliding")
    trainer = OOMBTrainer(build(config), OOMBConfig(chunk_tokens=1024, page_tokens=128))
    assert [record.sliding_window for record in trainer.layers] == [None, WINDOW]

    def context(first_token, chunk_tokens=1024):
        return ChunkContext(store=trainer.store, config=trainer.config, layers=trainer.layers, stage=1, chunk=0,
                            first_token=first_token, chunk_tokens=chunk_tokens, sequence_tokens=5000)

    # The first query of the chunk at 2048 sees keys 1349 .. 2048: from page 10 (1280 .. 1407) on.
    assert context(2048).history_first_page(1) == 10 and context(2048).history_first_page(0) == 0
    assert [access.first_page for access in context(2048).history_accesses(1, "stage1")] == [10]
    # The window hides keys inside the first chunk already (its last query sees 324 .. 1023) ...
    assert context(0).window_hides(1) and not context(0).window_hides(0)
    assert context(0).sliding_window(1) == WINDOW and context(0).sliding_window(0) == 0
    # ... but not inside a first chunk of 512 tokens: the kernels run it without a window.
    assert not context(0, chunk_tokens=512).window_hides(1) and context(512, chunk_tokens=512).window_hides(1)
    assert context(0, chunk_tokens=512).sliding_window(1) == 0


def test_soft_capped_layers_take_the_kernels_where_they_are_verified(monkeypatch):
    """Gemma 2's global layers soft-cap their scores: the paged kernels take the cap on the CPU; on
    CUDA they do where kernels.cuda_softcap_kernels() says so (MEMBAR_CUDA_SOFTCAP overrides), else
    the PyTorch path runs them."""
    monkeypatch.delenv("MEMBAR_CUDA_WINDOW", raising=False)
    config, _ = family_config("gemma2")
    trainer = OOMBTrainer(build(config), OOMBConfig(chunk_tokens=1024, page_tokens=128))
    assert [record.sliding_window for record in trainer.layers] == [WINDOW, None]
    assert [record.needs_torch_path for record in trainer.layers] == [True, False]
    context = ChunkContext(store=trainer.store, config=trainer.config, layers=trainer.layers, stage=1, chunk=1,
                           first_token=1024, chunk_tokens=1024, sequence_tokens=3000)
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert not context.torch_path(0, cpu) and not context.torch_path(1, cpu) and context.softcap(1) == 2.0
    monkeypatch.setenv("MEMBAR_CUDA_SOFTCAP", "1")
    assert not context.torch_path(1, cuda)
    monkeypatch.setenv("MEMBAR_CUDA_SOFTCAP", "0")
    assert context.torch_path(1, cuda) and not context.torch_path(1, cpu)
    # The PyTorch path takes no selection: sparse mode with capped layers needs the kernels.
    capped_only = [LayerAttention(layer=0, num_q_heads=4, num_kv_heads=2, head_dim=8, scaling=0.3, softcap=2.0)]
    with pytest.raises(ValueError, match="MEMBAR_CUDA_SOFTCAP=0"):
        check_layers(capped_only, "sparse")
    monkeypatch.setenv("MEMBAR_CUDA_SOFTCAP", "1")
    check_layers(capped_only, "sparse")


def test_windowed_layers_take_the_kernels_where_they_are_verified(monkeypatch):
    """A local layer whose window hides keys runs on the paged kernels (Note [Sliding window] in
    membar/kernels/attention.h) when its visible history goes to one call with the chunk: always on
    the CPU; on CUDA where kernels.cuda_window_kernels() says so (MEMBAR_CUDA_WINDOW overrides; on
    by default since the GPU tests passed), else the PyTorch path. A history streamed in blocks keeps
    the PyTorch path (a block alone does not know where the queries sit), and so does a window that
    hides nothing (then the kernels run without it)."""
    from membar.oomb import kernels

    monkeypatch.delenv("MEMBAR_CUDA_WINDOW", raising=False)
    config, _ = family_config("gemma2")
    trainer = OOMBTrainer(build(config), OOMBConfig(chunk_tokens=1024, page_tokens=128))
    context = ChunkContext(store=trainer.store, config=trainer.config, layers=trainer.layers, stage=1, chunk=1,
                           first_token=1024, chunk_tokens=1024, sequence_tokens=3000)
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert context.window_hides(0) and context.sliding_window(0) == WINDOW and context.sliding_window(1) == 0
    assert not context.torch_path(0, cpu) and not context.torch_path(0)
    assert kernels.cuda_window_kernels() and not context.torch_path(0, cuda)
    monkeypatch.setenv("MEMBAR_CUDA_WINDOW", "1")
    assert kernels.cuda_window_kernels() and not context.torch_path(0, cuda)
    monkeypatch.setenv("MEMBAR_CUDA_WINDOW", "0")
    assert context.torch_path(0, cuda) and not context.torch_path(0, cpu)
    # The global layer never takes the PyTorch path for a window it does not have.
    assert not context.torch_path(1, cuda)
    # Offloaded history streamed in blocks of 2 pages (the window reaches 6 pages back): PyTorch.
    streamed = OOMBTrainer(build(config), OOMBConfig(chunk_tokens=1024, page_tokens=128, offload=True,
                                                     history_block_tokens=256))
    streaming = ChunkContext(store=streamed.store, config=streamed.config, layers=streamed.layers, stage=1,
                             chunk=2, first_token=2048, chunk_tokens=1024, sequence_tokens=4000)
    assert streaming.streams(0) and streaming.torch_path(0, cpu)
    check_layers([LayerAttention(layer=0, num_q_heads=4, num_kv_heads=2, head_dim=8, scaling=0.3,
                                 sliding_window=64)], "sparse")   # Note [Local layers in sparse mode]


@pytest.mark.parametrize("case", ["qwen2-sliding", "gemma2", "gemma3_text"])
def test_windowed_layers_run_on_the_cpu_kernels(monkeypatch, case):
    """The local layers' chunks whose window hides keys go to the windowed paged kernels on the CPU
    (none to the PyTorch path), and the gradients equal full-sequence training."""
    from membar import attention
    from membar.oomb import torch_attention

    windows = []
    forward = attention.paged_attention_forward

    def counting_forward(*args, **kwargs):
        windows.append(kwargs.get("sliding_window", 0))
        return forward(*args, **kwargs)

    def refuse(*args, **kwargs):
        raise AssertionError("a windowed layer took the PyTorch path")

    monkeypatch.setattr(attention, "paged_attention_forward", counting_forward)
    monkeypatch.setattr(torch_attention, "forward", refuse)
    monkeypatch.setattr(torch_attention, "backward", refuse)
    config, tokens = family_config(case)
    loss, loss_full, error, _ = compare(build(config), tokens)
    assert abs(loss - loss_full) <= 1e-5 * abs(loss_full), (loss, loss_full)
    assert error <= 1e-4, f"{case}: max relative gradient error {error:.3g}"
    assert WINDOW in windows, windows


def test_models_that_cannot_train_exactly_get_a_sentence():
    t = transformers
    with pytest.raises(ValueError, match="no rotary position embedding"):
        OOMBTrainer(t.GPT2LMHeadModel(t.GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=50)))
    with pytest.raises(ValueError, match="encoder-decoder"):
        OOMBTrainer(t.T5ForConditionalGeneration(t.T5Config(d_model=32, d_ff=32, num_layers=1, num_heads=2,
                                                            d_kv=16, vocab_size=50)))
    with pytest.raises(ValueError, match="not causal"):
        OOMBTrainer(build(t.Gemma3TextConfig(**_small(), use_bidirectional_attention=True)))
    with pytest.raises(ValueError, match="load-balancing loss"):
        OOMBTrainer(build(t.MixtralConfig(**_small(), num_local_experts=4, output_router_logits=True)))
    with pytest.raises(ValueError, match="attention_dropout"):
        OOMBTrainer(build(t.LlamaConfig(**_small(), attention_dropout=0.1)))


def test_soft_capped_models_still_run_outside_the_trainer_and_predict_like_them():
    config, _ = family_config("gemma2")
    model = build(config)
    input_ids = torch.randint(0, VOCAB, (1, 300), generator=torch.Generator().manual_seed(4))
    model.set_attn_implementation("eager")
    with torch.no_grad():
        before = model(input_ids=input_ids).logits
        trainer = OOMBTrainer(model, chunk_tokens=128, page_tokens=64)
        after = model(input_ids=input_ids).logits
    assert torch.allclose(before, after, atol=1e-5)
    positions = [0, 127, 128, 299]
    assert torch.allclose(trainer.predict(input_ids[0], positions), before[0, positions], atol=1e-5)


gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("case", ["qwen3", "mistral", "gemma2", "gemma3_text", "qwen3_moe", "rope-longrope"])
def test_gpu_bf16_error_at_most_twice_full_sequence_bf16(case):
    """CUDA, bf16: chunk-recurrent gradients against a float32 full-sequence reference are at most
    2x as far off as full-sequence bf16 training's (head size 128: the kernels' and cuDNN's size;
    local layers where kernels.cuda_window_kernels() sends them, by default the kernels)."""
    full_error, oomb_error = _gpu_bf16_errors(case)
    assert oomb_error <= 2 * full_error


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("case", ["mistral", "gemma2", "gemma3_text"])
def test_gpu_bf16_windowed_kernels_error_at_most_twice_full_sequence_bf16(monkeypatch, case):
    """The same with the local layers on the windowed CUDA kernels (MEMBAR_CUDA_WINDOW=1; Note
    [Sliding window] in membar/kernels/attention.h), none on the PyTorch path."""
    from membar.oomb import torch_attention

    def refuse(*args, **kwargs):
        raise AssertionError("a windowed layer took the PyTorch path")

    monkeypatch.setenv("MEMBAR_CUDA_WINDOW", "1")
    monkeypatch.setattr(torch_attention, "forward", refuse)
    monkeypatch.setattr(torch_attention, "backward", refuse)
    full_error, oomb_error = _gpu_bf16_errors(case)
    assert oomb_error <= 2 * full_error


def _gpu_bf16_errors(case):
    """(full-sequence bf16, chunk-recurrent bf16) max relative gradient errors against float32."""
    config, _ = family_config(case)
    for field, value in dict(hidden_size=256, num_attention_heads=4, num_key_value_heads=2, head_dim=128,
                             intermediate_size=512).items():
        setattr(config, field, value)
    if case == "rope-longrope":
        config.rope_parameters = dict(config.rope_parameters, short_factor=[1.0] * 64,
                                      long_factor=[2.0 + 0.05 * i for i in range(64)])
    model = build(config).cuda()
    input_ids = torch.randint(0, VOCAB, (1, 3000), generator=torch.Generator().manual_seed(5))
    reference_model = copy.deepcopy(model)
    full_sequence_step(reference_model, input_ids.cuda())
    reference = {name: g.float() for name, g in grads_of(reference_model).items()}
    bf16 = copy.deepcopy(model).to(torch.bfloat16)
    full_sequence_step(bf16, input_ids.cuda())
    full_error = max_relative_error({n: g.float() for n, g in grads_of(bf16).items()}, reference)
    bf16.zero_grad(set_to_none=True)
    OOMBTrainer(bf16, OOMBConfig(chunk_tokens=1024, page_tokens=128)).step(input_ids)
    oomb_error = max_relative_error({n: g.float() for n, g in grads_of(bf16).items()}, reference)
    print(f"\n{case} bf16 max relative gradient error: full sequence {full_error:.3g}, "
          f"chunk-recurrent {oomb_error:.3g}")
    return full_error, oomb_error


def test_local_layers_read_their_window_in_sparse_mode():
    """Note [Local layers in sparse mode]: with a global and a local layer (Qwen2 with
    use_sliding_window), sparse mode selects pages for the global layer only; the gradients equal
    full-sequence training with the global layer's selections as a mask and the local layer's
    window, and the local layer's stage-1 window reads are in the step's plan."""
    from test_oomb import _MASKS, _masked_attention, _sparse_masks
    from transformers import AttentionInterface

    config, tokens = family_config("qwen2-sliding")
    model = build(config)
    chunk_tokens, page_tokens, tile = 1024, 128, 256
    input_ids = torch.randint(0, VOCAB, (1, tokens), generator=torch.Generator().manual_seed(3))
    trainer = OOMBTrainer(model, OOMBConfig(chunk_tokens=chunk_tokens, page_tokens=page_tokens, mode="sparse",
                                            top_k=3, query_tile_tokens=tile))
    loss = trainer.step(input_ids)
    sparse = grads_of(model)
    selections = trainer.last_selections
    assert any(selections.get((0, chunk)) is not None for chunk in range(3)), "the global layer selected nothing"
    assert all(selections.get((1, chunk)) is None for chunk in range(3)), "the local layer selected pages"
    plan = trainer._stage1_plan(trainer._chunks(tokens), {"summaries": {}, "selections": {}})
    assert any(access.layer == 1 and access.chunk == 2 for access in plan)
    assert not any(access.layer == 0 and access.chunk == 2 for access in plan)
    masks = _sparse_masks(selections, tokens, chunk_tokens, page_tokens, tile, 2)
    positions = torch.arange(tokens)
    masks[1] &= (positions.unsqueeze(1) - positions.unsqueeze(0)) < WINDOW
    _MASKS.clear()
    _MASKS.update(masks)
    AttentionInterface.register("membar_test_masked", _masked_attention)
    model.zero_grad()
    loss_masked = full_sequence_step(model, input_ids, attn_implementation="membar_test_masked")
    masked = grads_of(model)
    assert abs(loss - loss_masked) <= 1e-5 * abs(loss_masked), (loss, loss_masked)
    assert max_relative_error(sparse, masked) <= 1e-4
