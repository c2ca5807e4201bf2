"""The CUDA paged-attention ops (bindings/csrc/cuda/attention_cuda.cpp) against a plain torch
reference on the GPU (fp32 math on the gathered history + chunk, autograd for the gradients),
torch SDPA, and the ops' own CPU implementation.

Error bound (FlashAttention's rule): the CUDA op's error against the fp32 reference may be at
most twice the error of the CPU op run in the same precision (bf16 inputs, fp32 accumulation),
plus a small slack for the bf16 rounding of P and dS that tensor cores need."""
import math

import pytest
import torch

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)

import membar  # noqa: E402  (loads the ops library)

ops = torch.ops.membar
DEVICE = "cuda"


def make_problem(chunk_tokens, history_tokens, page_tokens, q_heads, kv_heads, head_dim, generator, dtype=torch.bfloat16,
                 spare_pages=3):
    num_pages = (history_tokens + page_tokens - 1) // page_tokens
    pool_pages = num_pages + spare_pages

    def randn(*shape, scale=1.0):
        return (torch.randn(*shape, generator=generator) * scale).to(dtype)

    problem = {
        "q": randn(chunk_tokens, q_heads, head_dim, scale=1.5),
        "k": randn(chunk_tokens, kv_heads, head_dim),
        "v": randn(chunk_tokens, kv_heads, head_dim),
        "dout": randn(chunk_tokens, q_heads, head_dim),
        "k_pool": randn(pool_pages, page_tokens, kv_heads, head_dim),
        "v_pool": randn(pool_pages, page_tokens, kv_heads, head_dim),
    }
    for name in ("k_index", "v_index", "dk_index", "dv_index"):
        problem[name] = torch.randperm(pool_pages, generator=generator)[:num_pages].to(torch.int32)
    problem["history_tokens"] = history_tokens
    problem["scale"] = 1.0 / math.sqrt(head_dim)
    return problem


def to_device(problem, device):
    return {k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in problem.items()}


def gathered(pool, index, history_tokens):
    return pool.index_select(0, index.long()).reshape(-1, *pool.shape[2:])[:history_tokens]


def visibility_mask(chunk_tokens, history_tokens, page_tokens, selection, tile, device, window=0):
    """[Tc, history + Tc] bool: history visible (or the tile's selected pages), chunk causal; with a
    window, Hugging Face's kv_idx > q_idx - window (history at positions 0.., chunk token i at
    history_tokens + i)."""
    history = torch.ones(chunk_tokens, history_tokens, dtype=torch.bool, device=device)
    if selection is not None:
        history = torch.zeros_like(history)
        for t in range(selection.shape[0]):
            for page in selection[t].tolist():
                if page >= 0:
                    history[t * tile:(t + 1) * tile, page * page_tokens:(page + 1) * page_tokens] = True
    causal = torch.ones(chunk_tokens, chunk_tokens, dtype=torch.bool, device=device).tril()
    mask = torch.cat([history, causal], dim=1)
    if window:
        q_idx = history_tokens + torch.arange(chunk_tokens, device=device)[:, None]
        kv_idx = torch.arange(history_tokens + chunk_tokens, device=device)[None, :]
        mask &= kv_idx > q_idx - window
    return mask


def reference(p, selection=None, tile=128, softcap=0.0, window=0):
    """fp32 attention over [history; chunk] with autograd: out, lse, and the gradients (softcap > 0:
    scores through softcap * tanh(s / softcap) first, Gemma 2's soft-cap; window > 0: a sliding
    window)."""
    history_tokens = p["history_tokens"]
    page_tokens = p["k_pool"].shape[1]
    q = p["q"].float().requires_grad_()
    k_hist = gathered(p["k_pool"], p["k_index"], history_tokens).float().requires_grad_()
    v_hist = gathered(p["v_pool"], p["v_index"], history_tokens).float().requires_grad_()
    k = p["k"].float().requires_grad_()
    v = p["v"].float().requires_grad_()
    group = q.shape[1] // k.shape[1]
    keys = torch.cat([k_hist, k]).repeat_interleave(group, dim=1)
    values = torch.cat([v_hist, v]).repeat_interleave(group, dim=1)
    scores = torch.einsum("thd,shd->hts", q, keys) * p["scale"]
    if softcap:
        scores = torch.tanh(scores / softcap) * softcap
    mask = visibility_mask(q.shape[0], history_tokens, page_tokens, selection, tile, q.device, window)
    scores = scores.masked_fill(~mask, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    out = torch.einsum("hts,shd->thd", torch.softmax(scores, dim=-1), values)
    out.backward(p["dout"].float())
    return {"out": out.detach(), "lse": lse.detach(), "dq": q.grad, "dk": k.grad, "dv": v.grad,
            "dk_hist": k_hist.grad, "dv_hist": v_hist.grad}


def run_ops(p, grad_dtype, selection=None, tile=128, deterministic=False, softcap=0.0, window=0):
    out, lse = ops.paged_attention_forward(p["q"], p["k"], p["v"], p["k_pool"], p["k_index"], p["v_pool"],
                                           p["v_index"], p["history_tokens"], p["scale"], selection, tile,
                                           logit_softcap=softcap, sliding_window=window)
    dk_pool = p["dk_pool0"].to(grad_dtype).clone()
    dv_pool = p["dv_pool0"].to(grad_dtype).clone()
    dq, dk, dv = ops.paged_attention_backward(p["q"], p["k"], p["v"], p["k_pool"], p["k_index"], p["v_pool"],
                                              p["v_index"], out, p["dout"], lse, dk_pool, p["dk_index"], dv_pool,
                                              p["dv_index"], p["history_tokens"], p["scale"], selection, tile,
                                              deterministic, logit_softcap=softcap, sliding_window=window)
    history_tokens = p["history_tokens"]
    return {"out": out, "lse": lse, "dq": dq, "dk": dk, "dv": dv,
            "dk_hist": gathered(dk_pool, p["dk_index"], history_tokens).double()
            - gathered(p["dk_pool0"].to(grad_dtype), p["dk_index"], history_tokens).double(),
            "dv_hist": gathered(dv_pool, p["dv_index"], history_tokens).double()
            - gathered(p["dv_pool0"].to(grad_dtype), p["dv_index"], history_tokens).double(),
            "dk_pool": dk_pool, "dv_pool": dv_pool}


def max_error(a, b):
    return (a.double().cpu() - b.double().cpu()).abs().max().item() if a.numel() else 0.0


CASES = [
    # (chunk_tokens, history_tokens, page_tokens, q_heads, kv_heads, head_dim, sparse tile or 0, top_k, dtype)
    (200, 300, 128, 8, 2, 128, 0, 0, torch.bfloat16),
    (77, 130, 64, 7, 1, 64, 0, 0, torch.bfloat16),
    (256, 0, 128, 4, 4, 128, 0, 0, torch.bfloat16),
    (300, 1100, 128, 8, 1, 128, 128, 4, torch.bfloat16),
    (130, 700, 64, 4, 1, 64, 64, 5, torch.bfloat16),
    # Every head size the CUDA kernels take, in bf16 and fp16.
    (100, 500, 128, 8, 1, 64, 0, 0, torch.float16),
    (200, 300, 128, 8, 2, 96, 0, 0, torch.bfloat16),
    (150, 700, 64, 4, 2, 96, 64, 4, torch.float16),
    (130, 300, 128, 8, 2, 256, 0, 0, torch.bfloat16),
    (200, 1000, 64, 2, 2, 256, 128, 3, torch.float16),
    (90, 900, 128, 7, 1, 256, 64, 2, torch.bfloat16),
    (150, 400, 64, 4, 1, 128, 0, 0, torch.float16),
]


# Gemma 2's soft-capped scores (Note [Soft-capped scores] in membar/kernels/attention.h) at every
# head size, dense and sparse: a cap of 2 bends most of these scores (|s| up to ~6), 50 is Gemma 2's.
SOFTCAP_CASES = [
    (130, 300, 128, 8, 4, 256, 0, 0, torch.bfloat16, 2.0),
    (200, 1000, 64, 2, 2, 256, 128, 3, torch.float16, 2.0),
    (150, 500, 128, 8, 4, 256, 0, 0, torch.bfloat16, 50.0),
    (200, 300, 128, 8, 2, 128, 0, 0, torch.bfloat16, 2.0),
    (300, 1100, 128, 8, 1, 128, 128, 4, torch.float16, 2.0),
    (77, 130, 64, 7, 1, 64, 0, 0, torch.bfloat16, 2.0),
    (100, 500, 128, 8, 1, 64, 0, 0, torch.float16, 2.0),
    (200, 300, 128, 8, 2, 96, 0, 0, torch.bfloat16, 2.0),
]


# Sliding windows (Note [Sliding window] in membar/kernels/attention.h) at every head size, bf16 and
# fp16: below a 64-key block, between 64 and 128, past a page, several pages, one position, with a
# soft-cap, without history, and long chunks whose later tiles skip whole pages. (..., cap, window)
WINDOW_CASES = [
    (300, 500, 128, 8, 2, 128, 0, 0, torch.bfloat16, 0.0, 30),
    (260, 400, 64, 8, 4, 128, 0, 0, torch.float16, 0.0, 100),
    (700, 800, 64, 8, 2, 128, 0, 0, torch.bfloat16, 0.0, 150),
    (400, 1000, 128, 8, 2, 128, 0, 0, torch.bfloat16, 0.0, 700),
    (300, 600, 128, 4, 2, 64, 0, 0, torch.bfloat16, 0.0, 200),
    (200, 300, 64, 8, 2, 64, 0, 0, torch.float16, 0.0, 129),
    (250, 300, 128, 4, 2, 96, 0, 0, torch.bfloat16, 0.0, 77),
    (300, 700, 64, 4, 2, 96, 0, 0, torch.float16, 0.0, 300),
    (200, 400, 128, 4, 2, 256, 0, 0, torch.bfloat16, 0.0, 64),
    (300, 900, 64, 4, 2, 256, 0, 0, torch.float16, 0.0, 500),
    (260, 600, 128, 8, 4, 256, 0, 0, torch.bfloat16, 2.0, 90),
    (200, 300, 128, 8, 2, 128, 0, 0, torch.float16, 2.0, 45),
    (150, 200, 128, 2, 2, 128, 0, 0, torch.bfloat16, 0.0, 1),
    (300, 0, 128, 4, 2, 128, 0, 0, torch.bfloat16, 0.0, 50),
]


@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", CASES)
def test_ops_match_reference(case, grad_dtype):
    check_case(case, grad_dtype)


@pytest.mark.parametrize("case", SOFTCAP_CASES)
def test_soft_capped_ops_match_reference(case):
    check_case(case[:-1], torch.float32, softcap=case[-1])


@pytest.mark.parametrize("case", WINDOW_CASES)
def test_windowed_ops_match_reference(case):
    """The windowed ops against the fp32 reference with Hugging Face's mask; the window must change
    the reference's answer (else a kernel ignoring it would pass)."""
    check_case(case[:-2], torch.float32, softcap=case[-2], window=case[-1])


def test_windowed_op_refusals_do_not_crash():
    """A window with a sparse selection or without attend_chunk is refused with a RuntimeError. On the
    H200 (session 19) the call without attend_chunk crashed the process (segmentation fault), so the
    probe runs in a process of its own: a crash fails this test, not the whole session."""
    import subprocess
    import sys
    from pathlib import Path

    import os

    import membar

    probe = Path(__file__).resolve().parents[2] / "bench" / "probes" / "window_refusal_probe.py"
    package_root = str(Path(membar.__file__).resolve().parents[1])
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [package_root, os.environ.get("PYTHONPATH")])))
    run = subprocess.run([sys.executable, str(probe)], capture_output=True, text=True, timeout=120, env=env)
    assert run.returncode == 0, f"the probe died ({run.returncode}):\n{run.stdout}\n{run.stderr[-2000:]}"
    assert run.stdout.count("RuntimeError") == 3, run.stdout
    assert "needs attend_chunk" in run.stdout and "sparse page selection" in run.stdout, run.stdout


def check_case(case, grad_dtype, softcap=0.0, window=0):
    chunk_tokens, history_tokens, page_tokens, q_heads, kv_heads, head_dim, tile, top_k, dtype = case
    generator = torch.Generator().manual_seed(torch.seed() % (2**31))
    host = make_problem(chunk_tokens, history_tokens, page_tokens, q_heads, kv_heads, head_dim, generator, dtype)
    pool_shape = host["k_pool"].shape
    host["dk_pool0"] = (torch.randn(pool_shape, generator=generator) * 0.1).to(grad_dtype).float()
    host["dv_pool0"] = (torch.randn(pool_shape, generator=generator) * 0.1).to(grad_dtype).float()
    selection = None
    if tile:
        num_pages = host["k_index"].shape[0]
        tiles = (chunk_tokens + tile - 1) // tile
        selection = torch.full((tiles, top_k), -1, dtype=torch.int32)
        for t in range(tiles):
            chosen = torch.randperm(num_pages, generator=generator)[:top_k - 1].to(torch.int32)
            selection[t, :chosen.numel()] = chosen
            selection[t] = selection[t][torch.randperm(top_k, generator=generator)]
    tile_or_default = tile or 128
    gpu = to_device(host, DEVICE)
    gpu_selection = selection.to(DEVICE) if selection is not None else None

    truth = reference(gpu, gpu_selection, tile_or_default, softcap, window)
    if window:
        unwindowed = reference(gpu, gpu_selection, tile_or_default, softcap)
        assert max_error(unwindowed["out"], truth["out"]) > 0.02 * truth["out"].abs().max().item()
    cpu = run_ops(host, grad_dtype, selection, tile_or_default, softcap=softcap, window=window)
    for deterministic in (False, True):
        result = run_ops(gpu, grad_dtype, gpu_selection, tile_or_default, deterministic, softcap, window)
        for name in ("out", "lse", "dq", "dk", "dv", "dk_hist", "dv_hist"):
            if truth[name] is None or truth[name].numel() == 0:
                continue
            error = max_error(result[name], truth[name])
            cpu_error = max_error(cpu[name], truth[name])
            slack = (1e-4 if name == "lse" else 4e-3) * max(1.0, truth[name].abs().max().item())
            assert error <= 2 * cpu_error + slack, (name, deterministic, error, cpu_error)


def test_deterministic_backward_repeats_bit_for_bit():
    generator = torch.Generator().manual_seed(torch.seed() % (2**31))
    p = to_device(make_problem(300, 1000, 128, 8, 2, 128, generator), DEVICE)
    p["dk_pool0"] = torch.randn(p["k_pool"].shape, device=DEVICE)
    p["dv_pool0"] = torch.randn(p["k_pool"].shape, device=DEVICE)
    first = run_ops(p, torch.float32, deterministic=True)
    second = run_ops(p, torch.float32, deterministic=True)
    for name in ("dq", "dk", "dv", "dk_pool", "dv_pool"):
        assert torch.equal(first[name], second[name]), name


def test_forward_matches_sdpa_without_history():
    """No history: the op is plain causal attention, which SDPA computes directly."""
    generator = torch.Generator().manual_seed(torch.seed() % (2**31))
    p = to_device(make_problem(512, 0, 128, 8, 2, 128, generator), DEVICE)
    out, _ = ops.paged_attention_forward(p["q"], p["k"], p["v"], p["k_pool"], p["k_index"], p["v_pool"], p["v_index"],
                                         0, p["scale"], None, 128)
    q = p["q"].transpose(0, 1).unsqueeze(0)
    k = p["k"].repeat_interleave(4, dim=1).transpose(0, 1).unsqueeze(0)
    v = p["v"].repeat_interleave(4, dim=1).transpose(0, 1).unsqueeze(0)
    expected = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)[0].transpose(0, 1)
    truth = reference(p)["out"]
    sdpa_error = max_error(expected, truth)
    assert max_error(out, truth) <= 2 * sdpa_error + 1e-3


def test_summary_and_select_match_cpu():
    generator = torch.Generator().manual_seed(torch.seed() % (2**31))
    host = make_problem(300, 5000, 128, 8, 2, 128, generator)
    history_tokens = host["history_tokens"]
    mean, low, high = ops.page_summary(host["k_pool"], host["k_index"], history_tokens, True)
    gpu_mean, gpu_low, gpu_high = ops.page_summary(host["k_pool"].to(DEVICE), host["k_index"].to(DEVICE),
                                                   history_tokens, True)
    torch.testing.assert_close(gpu_mean.cpu(), mean, rtol=1e-5, atol=1e-5)
    assert torch.equal(gpu_low.cpu(), low) and torch.equal(gpu_high.cpu(), high)
    for bounds in (False, True):
        args = (low, high) if bounds else (None, None)
        expected = ops.page_select(host["q"], mean, *args, 8, 128)
        got = ops.page_select(host["q"].to(DEVICE), mean.to(DEVICE),
                              *(a.to(DEVICE) if a is not None else None for a in args), 8, 128).cpu()
        # Scores summed in another order may swap a near-tie at the k-th place in one tile at most.
        assert (expected != got).any(dim=1).sum().item() <= 1
        assert torch.equal(got, got.sort(dim=1).values)


def test_page_select_in_pytorch_on_cuda_matches_cpu():
    """Note [Page selection in PyTorch]: the trainer's CUDA selection (page_select_scores) picks the
    CPU reference kernel's pages for a 7B-shaped chunk (28 q heads, 4 kv heads) over 2,048 pages,
    one tile per chunk and tiles of 128, up to a near-tie at the k-th place in one tile."""
    from membar.attention import page_select_scores

    generator = torch.Generator().manual_seed(torch.seed() % (2**31))
    q = torch.randn(4096, 28, 128, generator=generator).to(torch.bfloat16)
    mean = torch.randn(2048, 4, 128, generator=generator)
    for tile in (4096, 128):
        expected = ops.page_select(q, mean, None, None, 64, tile)
        got = page_select_scores(q.to(DEVICE), mean.to(DEVICE), 64, tile).cpu()
        assert got.shape == expected.shape and got.dtype == torch.int32
        assert (expected != got).any(dim=1).sum().item() <= 1
        assert torch.equal(got, got.sort(dim=1).values)


def test_unsupported_shape_is_a_clear_error():
    generator = torch.Generator().manual_seed(1)
    p = to_device(make_problem(64, 64, 64, 2, 2, 80, generator), DEVICE)
    with pytest.raises(RuntimeError, match=r"support head_dim 64, 96, 128 or 256 \(got 80\)\."):
        ops.paged_attention_forward(p["q"], p["k"], p["v"], p["k_pool"], p["k_index"], p["v_pool"], p["v_index"],
                                    64, p["scale"], None, 128)


def test_bad_page_index_is_a_clear_error():
    generator = torch.Generator().manual_seed(2)
    p = to_device(make_problem(64, 256, 128, 2, 2, 64, generator), DEVICE)
    bad_index = p["k_index"].clone()
    bad_index[0] = 1000
    with pytest.raises(RuntimeError, match="k_page_index"):
        ops.paged_attention_forward(p["q"], p["k"], p["v"], p["k_pool"], bad_index, p["v_pool"], p["v_index"],
                                    256, p["scale"], None, 128)


def test_checked_page_index_is_read_again_after_an_in_place_write():
    """Note [Checked page indices]: a storage's bounds are remembered per version, so a view of a
    checked index passes without a read, a view of a storage with values outside the pool is judged
    by its own values, and an in-place write (which bumps the version) is seen."""
    generator = torch.Generator().manual_seed(3)
    p = to_device(make_problem(64, 256, 128, 2, 2, 64, generator), DEVICE)   # 2 history pages, pool of 5

    def forward(k_index):
        return ops.paged_attention_forward(p["q"], p["k"], p["v"], p["k_pool"], k_index, p["v_pool"], p["v_index"],
                                           256, p["scale"], None, 128)[0]

    expected = forward(p["k_index"])
    numbers = torch.arange(64, dtype=torch.int32, device=DEVICE)
    numbers[:2] = p["k_index"]
    assert torch.equal(forward(numbers[:2]), expected)   # the storage holds up to 63, the view fits
    index = p["k_index"].clone()
    assert torch.equal(forward(index), expected)
    assert torch.equal(forward(index[:]), expected)      # remembered
    index[1] = 1000
    with pytest.raises(RuntimeError, match=r"k_page_index holds values in \[\d+, 1000\] but its pool has 5 pages"):
        forward(index)
