"""Every layout of the CUDA attention kernels (torch.ops.membar.attention_cuda_layouts, Note [Layout
choice] in kernels/include/membar/kernels/attention_cuda.h), asked for by name through the ops'
`layout` argument, against the CPU ops: the truth is the CPU op in float64 on the same
(bf16-rounded) inputs; a layout's error may be at most twice that of the CPU op run in bf16 (fp32
accumulation), plus a small slack for the bf16 rounding of P and dS that tensor cores need. Shapes
cover what a layout may meet: dense and sparse histories with partial last pages, pages of 64
(where a layout that does not fit leaves the call to the chosen one), no history, and a history
block without the chunk (attend_chunk=False)."""
import math

import pytest
import torch

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)

import membar  # noqa: E402  (loads the ops library)

ops = torch.ops.membar

if not hasattr(ops, "attention_cuda_layouts"):
    pytest.skip("the ops library was built without CUDA", allow_module_level=True)

FORWARD_LAYOUTS = ops.attention_cuda_layouts("forward")
BACKWARD_LAYOUTS = ops.attention_cuda_layouts("backward")

CASES = [
    # (chunk_tokens, history_tokens, page_tokens, q_heads, kv_heads, sparse tile or 0, top_k, attend_chunk)
    (300, 1000, 128, 8, 2, 0, 0, True),
    (200, 333, 64, 7, 1, 0, 0, True),
    (256, 0, 128, 4, 4, 0, 0, True),
    (384, 2000, 128, 8, 1, 128, 4, True),
    (192, 1100, 128, 4, 1, 64, 3, True),
    (250, 700, 128, 8, 2, 0, 0, False),
]
# Keys whose scale grows along the history (and the chunk's larger still), so that the running
# maximum of a row jumps by many powers of two across blocks and every rescale path runs.
GROWING_CASE = (260, 1500, 128, 8, 2, 0, 0, True)


def make_problem(case, seed):
    chunk_tokens, history_tokens, page_tokens, q_heads, kv_heads, tile, top_k, attend_chunk = case
    generator = torch.Generator().manual_seed(seed)
    num_pages = (history_tokens + page_tokens - 1) // page_tokens
    pool_pages = num_pages + 2

    def randn(*shape, scale=1.0):
        return (torch.randn(*shape, generator=generator) * scale).to(torch.bfloat16)

    p = {
        "q": randn(chunk_tokens, q_heads, 128, scale=1.5), "k": randn(chunk_tokens, kv_heads, 128),
        "v": randn(chunk_tokens, kv_heads, 128), "dout": randn(chunk_tokens, q_heads, 128),
        "k_pool": randn(pool_pages, page_tokens, kv_heads, 128), "v_pool": randn(pool_pages, page_tokens, kv_heads, 128),
        "history_tokens": history_tokens, "scale": 1.0 / math.sqrt(128), "tile": tile or 128,
        "attend_chunk": attend_chunk, "selection": None,
    }
    for name in ("k_index", "v_index", "dk_index", "dv_index"):
        p[name] = torch.randperm(pool_pages, generator=generator)[:num_pages].to(torch.int32)
    if case == GROWING_CASE:
        growth = torch.linspace(0.2, 3.0, pool_pages).reshape(-1, 1, 1, 1)
        p["k_pool"] = (p["k_pool"].float() * growth[torch.randperm(pool_pages, generator=generator)]).to(torch.bfloat16)
        p["k"] = (p["k"].float() * 4.0).to(torch.bfloat16)
    p["dk_pool0"] = (torch.randn(p["k_pool"].shape, generator=generator) * 0.1)
    p["dv_pool0"] = (torch.randn(p["k_pool"].shape, generator=generator) * 0.1)
    if tile:
        tiles = (chunk_tokens + tile - 1) // tile
        selection = torch.full((tiles, top_k), -1, dtype=torch.int32)
        for t in range(tiles):
            chosen = torch.randperm(num_pages, generator=generator)[:top_k - 1].to(torch.int32)
            selection[t, :chosen.numel()] = chosen
        p["selection"] = selection
    return p


def run(p, device, dtype=None, deterministic=False, forward_layout="", backward_layout=""):
    """Forward and backward through the ops on `device`; floating inputs converted to `dtype`;
    the CUDA layouts asked for by name ("" for the chosen ones)."""
    def move(value):
        if not isinstance(value, torch.Tensor):
            return value
        value = value.to(device)
        return value.to(dtype) if dtype is not None and value.is_floating_point() else value

    t = {name: move(value) for name, value in p.items()}
    grad_dtype = torch.float64 if dtype == torch.float64 else torch.float32
    out, lse = ops.paged_attention_forward(t["q"], t["k"], t["v"], t["k_pool"], t["k_index"], t["v_pool"], t["v_index"],
                                           t["history_tokens"], t["scale"], t["selection"], t["tile"], t["attend_chunk"],
                                           forward_layout)
    # The backward gets the truth's out and lse (a blocked caller passes the final merged ones).
    given_out = t["given_out"] if "given_out" in t else out
    given_lse = t["given_lse"].to(lse.dtype) if "given_lse" in t else lse
    dk_pool, dv_pool = t["dk_pool0"].to(grad_dtype).clone(), t["dv_pool0"].to(grad_dtype).clone()
    dq, dk, dv = ops.paged_attention_backward(t["q"], t["k"], t["v"], t["k_pool"], t["k_index"], t["v_pool"],
                                              t["v_index"], given_out, t["dout"], given_lse, dk_pool, t["dk_index"],
                                              dv_pool, t["dv_index"], t["history_tokens"], t["scale"], t["selection"],
                                              t["tile"], deterministic, t["attend_chunk"], backward_layout)
    return {"out": out, "lse": lse, "dq": dq, "dk": dk, "dv": dv, "dk_pool": dk_pool, "dv_pool": dv_pool}


def errors(result, truth):
    error = {}
    for name, want in truth.items():
        got = result[name].double().cpu()
        finite = torch.isfinite(want)
        error[name] = (got[finite] - want[finite]).abs().max().item() if finite.any() else 0.0
        assert torch.equal(torch.isfinite(got), finite) or name != "lse", name
    return error


@pytest.fixture(scope="module")
def problems():
    prepared = []
    for index, case in enumerate(CASES + [GROWING_CASE]):
        p = make_problem(case, seed=100 + index)
        truth = {k: v.double() for k, v in run(p, "cpu", torch.float64).items()}
        # Without the chunk a history block's backward is given the rows' final out and lse;
        # the block's own stand in for them here (any out and lse are valid inputs).
        p["given_out"] = truth["out"].to(torch.bfloat16)
        p["given_lse"] = truth["lse"].float()
        truth = {k: v.double() for k, v in run(p, "cpu", torch.float64).items()}
        plain = errors(run(p, "cpu"), truth)
        prepared.append((case, p, truth, plain))
    return prepared


def check_layout(problems, names, modes=(False,), **layout):
    """Every problem through the layout (each deterministic mode in `modes`) against the truth."""
    for case, p, truth, plain in problems:
        for deterministic in modes:
            got = errors(run(p, "cuda", deterministic=deterministic, **layout), truth)
            for tensor in names:
                slack = (1e-4 if tensor == "lse" else 4e-3) * max(1.0, truth[tensor].abs().max().item())
                assert got[tensor] <= 2 * plain[tensor] + slack, (
                    layout, case, deterministic, tensor, got[tensor], plain[tensor])


@pytest.mark.parametrize("name", FORWARD_LAYOUTS)
def test_forward_layout_matches_cpu(problems, name):
    check_layout(problems, ("out", "lse"), forward_layout=name)


@pytest.mark.parametrize("name", BACKWARD_LAYOUTS)
def test_backward_layout_matches_cpu(problems, name):
    check_layout(problems, ("dq", "dk", "dv", "dk_pool", "dv_pool"), modes=(False, True), backward_layout=name)


def test_unknown_layout_is_a_clear_error(problems):
    _, p, _, _ = problems[0]
    with pytest.raises(RuntimeError, match="names no layout of the CUDA kernels"):
        run(p, "cuda", forward_layout="no_such_layout")


def test_layout_from_the_environment(problems, monkeypatch):
    """$MEMBAR_CUDA_BACKWARD_LAYOUT runs the layout it names where the op is given none (a whole
    training step's A/B), the same bits as asking for it by name; a name it does not know is a
    clear error naming the variable."""
    _, p, _, _ = problems[0]
    for name in BACKWARD_LAYOUTS:
        asked = run(p, "cuda", deterministic=True, backward_layout=name)
        monkeypatch.setenv("MEMBAR_CUDA_BACKWARD_LAYOUT", name)
        from_environment = run(p, "cuda", deterministic=True)
        monkeypatch.delenv("MEMBAR_CUDA_BACKWARD_LAYOUT")
        for tensor in ("dq", "dk", "dv", "dk_pool", "dv_pool"):
            assert torch.equal(asked[tensor], from_environment[tensor]), (name, tensor)
    monkeypatch.setenv("MEMBAR_CUDA_FORWARD_LAYOUT", "no_such_layout")
    with pytest.raises(RuntimeError, match=r"\$MEMBAR_CUDA_FORWARD_LAYOUT=\"no_such_layout\" names no layout"):
        run(p, "cuda")


def test_dq_pass_from_the_environment(problems, monkeypatch):
    """The deterministic backward's dQ passes (Note [Warp-specialised dQ pass]): the chosen one and,
    with $MEMBAR_CUDA_DQ_PASS=warpgroup, the one before it, each against the CPU truth on every
    problem (the sparse tiles of 64 rows keep the warpgroup pass either way); an unknown name is a
    clear error naming the variable."""
    check_layout(problems, ("dq", "dk", "dv"), modes=(True,))
    monkeypatch.setenv("MEMBAR_CUDA_DQ_PASS", "warpgroup")
    check_layout(problems, ("dq", "dk", "dv"), modes=(True,))
    monkeypatch.setenv("MEMBAR_CUDA_DQ_PASS", "no_such_pass")
    with pytest.raises(RuntimeError, match=r"\$MEMBAR_CUDA_DQ_PASS=\"no_such_pass\" names no dQ pass"):
        run(problems[0][1], "cuda", deterministic=True)
