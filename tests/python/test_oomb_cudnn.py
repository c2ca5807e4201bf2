"""Dense chunk attention through cuDNN (Note [cuDNN for dense history] in cudnn_attention.py)
against a float32 reference and against membar's own paged kernels, on fresh random inputs.

Needs a Hopper GPU; on the CPU only the routing (membar's kernels everywhere) is checked.
"""
from __future__ import annotations

import copy

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from membar.attention import reference_chunk_attention, reference_chunk_attention_backward
from membar.oomb import OOMBConfig, OOMBTrainer, cudnn_attention
from membar.oomb.kernels import GradView, HistoryView, attention_backward, attention_forward

hopper = pytest.mark.skipif(not (torch.cuda.is_available() and torch.cuda.get_device_capability() >= (9, 0)),
                            reason="needs a Hopper (sm90+) GPU")


def test_cpu_and_deterministic_calls_keep_membar_kernels():
    q = torch.randn(8, 4, 64)
    history = HistoryView(torch.zeros(1, 16, 2, 64), torch.zeros(1, 16, 2, 64), torch.zeros(0, dtype=torch.int32), 0)
    assert not cudnn_attention.usable(q, history, None, False, "auto")
    with pytest.raises(ValueError, match="dense_kernel"):
        OOMBConfig(dense_kernel="flash")


def test_cudnn_falls_back_per_shape_and_never_on_out_of_memory(caplog):
    """Note [When cuDNN is not used]: a failing shape is logged once and left to membar's kernels;
    other shapes keep cuDNN; an out-of-memory error reaches the caller and decides nothing."""
    q, k = torch.randn(8, 4, 64), torch.randn(8, 2, 64)
    wider = torch.randn(8, 4, 128)

    def unsupported():
        raise RuntimeError("cuDNN Frontend error: no valid execution plan")

    def out_of_memory():
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    try:
        with caplog.at_level("WARNING", logger="membar.oomb"):
            assert cudnn_attention.attempt("forward", q, k, unsupported) is None
            assert cudnn_attention.attempt("forward", q, k, unsupported) is None
        assert len([record for record in caplog.records if "cuDNN attention forward fails" in record.message]) == 1
        assert cudnn_attention.shape_key(q, k, "forward") in cudnn_attention._failed_shapes
        assert "no valid execution plan" in cudnn_attention.disabled_reason()
        assert cudnn_attention.attempt("forward", wider, k, lambda: "cudnn ran") == "cudnn ran"
        with pytest.raises(torch.OutOfMemoryError):
            cudnn_attention.attempt("backward", q, k, out_of_memory)
        assert cudnn_attention.shape_key(q, k, "backward") not in cudnn_attention._failed_shapes
    finally:
        cudnn_attention._failed_shapes.clear()


def _case(tokens, history_pages, page_tokens, q_heads, kv_heads, dim, first_row, grad_dtype, seed):
    generator = torch.Generator(device="cuda").manual_seed(seed)

    def randn(*shape, dtype=torch.bfloat16):
        return torch.randn(*shape, generator=generator, device="cuda", dtype=torch.float32).to(dtype)

    pool_pages = first_row + history_pages + 2
    k_pool = randn(pool_pages, page_tokens, kv_heads, dim)
    v_pool = randn(pool_pages, page_tokens, kv_heads, dim)
    index = torch.arange(first_row, first_row + history_pages, dtype=torch.int32, device="cuda")
    history = HistoryView(k_pool, v_pool, index, history_pages * page_tokens, first_row=first_row)
    q, k, v = randn(tokens, q_heads, dim), randn(tokens, kv_heads, dim), randn(tokens, kv_heads, dim)
    start = randn(pool_pages, page_tokens, kv_heads, dim, dtype=grad_dtype)
    return q, k, v, history, start


def _errors(got, want):
    return float((got.float() - want.float()).abs().max() / want.float().abs().max())


@pytest.mark.gpu
@hopper
@pytest.mark.parametrize("tokens,history_pages,page_tokens,q_heads,kv_heads,dim,grad_dtype", [
    (4096 // 8, 6, 128, 28, 4, 128, torch.float32),     # the 7B shape's heads (group 7)
    (300, 3, 64, 8, 2, 64, torch.float32),              # chunk not a multiple of any tile
    (256, 0, 64, 4, 4, 128, torch.float32),             # no history (the first chunk)
    (384, 5, 128, 32, 8, 128, torch.bfloat16),          # bf16 grad pages
])
def test_cudnn_matches_reference_and_membar_kernels(tokens, history_pages, page_tokens, q_heads, kv_heads, dim,
                                                     grad_dtype):
    scale = dim ** -0.5
    q, k, v, history, start = _case(tokens, history_pages, page_tokens, q_heads, kv_heads, dim, 3, grad_dtype, 11)
    calls = dict(cudnn_attention.calls)
    out, lse = attention_forward(q, k, v, history, scale, None, 128, kernel="auto")
    out_m, lse_m = attention_forward(q, k, v, history, scale, None, 128, kernel="membar")
    assert cudnn_attention.calls["forward"] > calls["forward"], cudnn_attention.disabled_reason()
    ref_out, ref_lse = reference_chunk_attention(q, k, v, history.k_pool, history.page_index, history.v_pool,
                                                 history.page_index, history.history_tokens, scale)
    e_cudnn, e_membar = _errors(out, ref_out), _errors(out_m, ref_out)
    print(f"\nout error: cudnn {e_cudnn:.3g}, membar {e_membar:.3g}")
    assert e_cudnn <= 2 * e_membar + 1e-3
    assert torch.allclose(lse, ref_lse.float(), atol=2e-2, rtol=0)

    dout = torch.randn_like(out)
    grads = {}
    for kernel in ("auto", "membar"):
        dk_pool, dv_pool = start.clone(), start.clone().mul_(-1)
        index = history.page_index
        view = GradView(dk_pool, dv_pool, index, first_row=3)
        dq, dk, dv = attention_backward(q, k, v, history, scale, out, dout, lse, view, None, 128, False, kernel=kernel)
        grads[kernel] = (dq, dk, dv, dk_pool, dv_pool)
    assert cudnn_attention.calls["backward"] > calls["backward"], cudnn_attention.disabled_reason()
    ref = reference_chunk_attention_backward(q, k, v, history.k_pool, history.page_index, history.v_pool,
                                             history.page_index, out, dout, history.history_tokens, scale)
    rows = slice(3, 3 + history_pages)
    want = {"dq": ref[0], "dk": ref[1], "dv": ref[2],
            "history dk": start[rows].float().flatten(0, 1) + ref[3], "history dv": -start[rows].float().flatten(0, 1) + ref[4]}
    for kernel, (dq, dk, dv, dk_pool, dv_pool) in grads.items():
        got = {"dq": dq, "dk": dk, "dv": dv, "history dk": dk_pool[rows].flatten(0, 1),
               "history dv": dv_pool[rows].flatten(0, 1)}
        # Pages outside the history are untouched.
        assert torch.equal(dk_pool[:3], start[:3]) and torch.equal(dk_pool[3 + history_pages:], start[3 + history_pages:])
        grads[kernel] = {name: _errors(got[name], want[name]) for name in want if want[name].numel()}
    print(f"grad errors: cudnn {grads['auto']}, membar {grads['membar']}")
    for name, error in grads["auto"].items():
        assert error <= 2 * grads["membar"][name] + 2e-3, name


@pytest.mark.gpu
@hopper
def test_cudnn_history_block_without_the_chunk():
    """attend_chunk=False (one block of a streamed history): same out/lse and history grads as
    membar's kernels; the chunk's dk/dv are zeros."""
    scale = 128 ** -0.5
    q, k, v, history, start = _case(512, 4, 128, 28, 4, 128, 0, torch.float32, 12)
    out, lse = attention_forward(q, k, v, history, scale, None, 128, attend_chunk=False, kernel="auto")
    out_m, lse_m = attention_forward(q, k, v, history, scale, None, 128, attend_chunk=False, kernel="membar")
    assert _errors(out, out_m) < 2e-2 and torch.allclose(lse, lse_m, atol=2e-2, rtol=0)
    dout = torch.randn_like(out)
    results = []
    for kernel in ("auto", "membar"):
        pools = (start.clone(), start.clone())
        dq, dk, dv = attention_backward(q, k, v, history, scale, out, dout, lse,
                                        GradView(*pools, history.page_index, first_row=0), None, 128, False,
                                        attend_chunk=False, kernel=kernel)
        results.append((dq, dk, dv) + pools)
    (dq, dk, dv, dk_pool, dv_pool), (dq_m, _, _, dk_pool_m, dv_pool_m) = results
    assert not dk.any() and not dv.any()
    assert _errors(dq, dq_m) < 2e-2
    assert _errors(dk_pool - start, dk_pool_m - start) < 2e-2 and _errors(dv_pool - start, dv_pool_m - start) < 2e-2


def _model(seed):
    config = Qwen2Config(hidden_size=512, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         intermediate_size=512, vocab_size=97, max_position_embeddings=8192,
                         attn_implementation="sdpa")   # head_dim 128
    torch.manual_seed(seed)
    return Qwen2ForCausalLM(config).cuda()


def _grads(model, ids, **options):
    model.zero_grad()
    OOMBTrainer(model, OOMBConfig(**options)).step(ids)
    grads = {name: p.grad.detach().float().clone() for name, p in model.named_parameters()}
    model.zero_grad()
    return grads


@pytest.mark.gpu
@hopper
def test_trainer_with_cudnn_matches_float32_like_full_sequence_bf16():
    """bf16 training through cuDNN (resident, and offloaded with the history streamed in blocks):
    gradient error against a float32 full-sequence reference at most 2x that of full-sequence bf16."""
    from membar.oomb.baseline import full_sequence_step

    model = _model(21)
    ids = torch.randint(0, 97, (1, 2000), device="cuda")
    model.float().zero_grad()
    full_sequence_step(model, ids, loss_piece_tokens=512, attn_implementation="sdpa")
    reference = {name: p.grad.detach().clone() for name, p in model.named_parameters()}
    bf16 = copy.deepcopy(model).to(torch.bfloat16)
    bf16.zero_grad()
    full_sequence_step(bf16, ids, loss_piece_tokens=512, attn_implementation="sdpa")
    full = {name: p.grad.detach().float() for name, p in bf16.named_parameters()}

    def error(grads):
        return max(float((grads[n] - r).abs().max() / r.abs().max()) for n, r in reference.items())

    before = cudnn_attention.calls["backward"]
    trainer = OOMBTrainer(bf16, OOMBConfig(chunk_tokens=512, page_tokens=128))
    bf16.zero_grad()
    trainer.step(ids)
    assert trainer.stats["cudnn_attention_calls"] > 0
    resident = _grads(bf16, ids, chunk_tokens=512, page_tokens=128)
    streamed = _grads(bf16, ids, chunk_tokens=512, page_tokens=128, offload=True, history_block_tokens=512,
                      checkpoint_layers=True)
    membar = _grads(bf16, ids, chunk_tokens=512, page_tokens=128, dense_kernel="membar")
    assert cudnn_attention.calls["backward"] > before, cudnn_attention.disabled_reason()
    errors = {"full bf16": error(full), "cudnn": error(resident), "cudnn streamed": error(streamed),
              "membar kernels": error(membar)}
    print(f"\nmax relative gradient error vs float32: {errors}")
    assert errors["cudnn"] <= 2 * errors["full bf16"]
    assert errors["cudnn streamed"] <= 2 * errors["full bf16"]
