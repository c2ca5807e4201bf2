"""Paged attention (membar CUDA ops) against torch SDPA with the flash backend, at Qwen2.5-7B
attention shape: 28 q heads, 4 KV heads, head_dim 128, bf16, a chunk of 4096 queries after a
history of 32K/128K/256K tokens in pages of 128.

FLOPs are counted the same way for both: 4 * Tc * Hq * D * (history + Tc / 2) for the forward
(the chunk's own keys are causal, so half of them count), 2.5 times that for the backward (five
matrix products instead of two). SDPA gets the chunk as queries and the whole sequence as keys
(GQA heads expanded beforehand, outside the timing) with a bottom-right causal mask; it has no
paging, so it is the dense-attention ceiling a paged kernel is measured against.

Sparse: each 128-query tile attends to its top-64 history pages (page_select on page_summary
means) plus the chunk; reported as speedup of forward + backward over the dense op.

Head sizes: the same chunk (4096 queries, 28 / 4 heads) after a 32K history for every head size
the CUDA kernels take (64, 96, 128, 256) in bf16 and fp16, against SDPA flash in the same dtype;
goals forward >= 1.0x and backward >= 0.8x SDPA flash. The layouts the kernels chose are recorded,
and the forward is also timed in the mma.sync layout a GPU without wgmma runs ("mma fwd").

Writes attention.json and attention.txt into $MEMBAR_RESULTS_DIR (default bench/results/latest).
Usage: PYTHONPATH=bindings/python python3 bench/attention_bench.py [--histories 32768,131072,262144]
    [--head-dims 64,96,128,256] [--head-dim-dtypes bfloat16,float16] [--head-dim-history 32768]
    [--try-layouts 64=wgmma_w8r64_k64_s3_2cta,...]   (other compiled forward layouts, timed beside the chosen one)
    [--try-dense-layouts wgmma_w8r64_k128_s2]   (the same at every history, with the dense path's cuDNN forward)
"""
import argparse
import json
import math
import os
import platform
import subprocess
import time
from pathlib import Path

import torch

import membar  # noqa: F401  (loads the ops library)

ops = torch.ops.membar
Q_HEADS, KV_HEADS, HEAD_DIM, PAGE_TOKENS, CHUNK = 28, 4, 128, 128, 4096


def time_ms(function, warmup=2, iterations=5):
    for _ in range(warmup):
        function()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(iterations):
        start.record()
        function()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    times.sort()
    return times[len(times) // 2]


def forward_flops(chunk, history, head_dim=HEAD_DIM):
    return 4.0 * chunk * Q_HEADS * head_dim * (history + chunk / 2)


def make_inputs(history, generator_seed=0, head_dim=HEAD_DIM, dtype=torch.bfloat16):
    torch.manual_seed(generator_seed)
    device = "cuda"
    num_pages = history // PAGE_TOKENS
    q = torch.randn(CHUNK, Q_HEADS, head_dim, device=device, dtype=dtype)
    k = torch.randn(CHUNK, KV_HEADS, head_dim, device=device, dtype=dtype)
    v = torch.randn(CHUNK, KV_HEADS, head_dim, device=device, dtype=dtype)
    dout = torch.randn(CHUNK, Q_HEADS, head_dim, device=device, dtype=dtype)
    k_pool = torch.randn(num_pages, PAGE_TOKENS, KV_HEADS, head_dim, device=device, dtype=dtype)
    v_pool = torch.randn(num_pages, PAGE_TOKENS, KV_HEADS, head_dim, device=device, dtype=dtype)
    # Pages in shuffled pool order, as a runtime would hand them out.
    k_index = torch.randperm(num_pages, device=device).to(torch.int32)
    v_index = torch.randperm(num_pages, device=device).to(torch.int32)
    return dict(q=q, k=k, v=v, dout=dout, k_pool=k_pool, v_pool=v_pool, k_index=k_index, v_index=v_index,
                history=history, scale=1.0 / math.sqrt(head_dim))


def membar_runner(p, selection=None, grad_dtype=torch.float32, deterministic=False, forward_layout="", softcap=0.0):
    dk_pool = torch.zeros(p["k_pool"].shape, device="cuda", dtype=grad_dtype)
    dv_pool = torch.zeros(p["v_pool"].shape, device="cuda", dtype=grad_dtype)
    state = {}

    def forward():
        state["out"], state["lse"] = ops.paged_attention_forward(
            p["q"], p["k"], p["v"], p["k_pool"], p["k_index"], p["v_pool"], p["v_index"], p["history"], p["scale"],
            selection, 128, True, forward_layout, logit_softcap=softcap)

    def backward():
        return ops.paged_attention_backward(
            p["q"], p["k"], p["v"], p["k_pool"], p["k_index"], p["v_pool"], p["v_index"], state["out"], p["dout"],
            state["lse"], dk_pool, p["k_index"], dv_pool, p["v_index"], p["history"], p["scale"], selection, 128,
            deterministic, logit_softcap=softcap)

    return forward, backward, state


def sdpa_runner(p):
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.attention.bias import causal_lower_right

    group = Q_HEADS // KV_HEADS
    head_dim = p["q"].shape[-1]
    keys = torch.cat([p["k_pool"][p["k_index"].long()].reshape(-1, KV_HEADS, head_dim), p["k"]])
    values = torch.cat([p["v_pool"][p["v_index"].long()].reshape(-1, KV_HEADS, head_dim), p["v"]])
    q = p["q"].transpose(0, 1).unsqueeze(0).detach().requires_grad_()
    k = keys.repeat_interleave(group, dim=1).transpose(0, 1).unsqueeze(0).detach().requires_grad_()
    v = values.repeat_interleave(group, dim=1).transpose(0, 1).unsqueeze(0).detach().requires_grad_()
    dout = p["dout"].transpose(0, 1).unsqueeze(0)
    mask = causal_lower_right(q.shape[2], k.shape[2])
    state = {}

    def forward():
        with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
            state["out"] = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)

    def forward_backward():
        forward()
        state["out"].backward(dout)
        q.grad = k.grad = v.grad = None

    return forward, forward_backward, state


SPLIT_BACKWARD = "w8_k128_split_s2_pad"


def time_backward_layout(backward, layout):
    """Milliseconds of `backward` on the backward layout `layout` ($MEMBAR_CUDA_BACKWARD_LAYOUT,
    which ops given no layout follow)."""
    os.environ["MEMBAR_CUDA_BACKWARD_LAYOUT"] = layout
    try:
        return time_ms(backward)
    finally:
        del os.environ["MEMBAR_CUDA_BACKWARD_LAYOUT"]


def time_other_backward(backward, layout):
    """time_backward_layout at the 7B shape, or None where the kernels choose `layout` anyway (or
    lack it)."""
    if not hasattr(ops, "attention_cuda_layout") or layout not in ops.attention_cuda_layouts("backward"):
        return None
    if ops.attention_cuda_layout("backward", torch.bfloat16, HEAD_DIM, PAGE_TOKENS) == layout:
        return None
    return time_backward_layout(backward, layout)


def cudnn_dense_forward(p):
    """The forward of OOMB's dense path (Note [cuDNN for dense history]): cuDNN over the history's
    rows without a mask, cuDNN over the chunk causally, merged by log-sum-exp."""
    from membar.oomb import cudnn_attention
    # The history's rows in order (the runtime's pages lie at consecutive addresses).
    history_k = p["k_pool"][p["k_index"].long()].reshape(-1, KV_HEADS, p["q"].shape[-1])
    history_v = p["v_pool"][p["v_index"].long()].reshape(-1, KV_HEADS, p["q"].shape[-1])
    state = {}

    def forward():
        state["out"], state["lse"] = cudnn_attention.forward(p["q"], p["k"], p["v"], history_k, history_v, p["scale"])

    return forward, state


def time_dense_forwards(p, row, fwd_flops, chosen_state, try_dense):
    """Other compiled forward layouts at this history (--try-dense-layouts), each checked against
    the chosen layout's output on the same inputs, and the cuDNN forward the dense path runs."""
    row["tried_dense_forward"] = {}
    for name in try_dense:
        tried, _, tried_state = membar_runner(p, forward_layout=name)
        milliseconds = time_ms(tried)
        tried()
        row["tried_dense_forward"][name] = {
            "ms": milliseconds, "tflops": fwd_flops / (milliseconds * 1e-3) / 1e12,
            "out_max_abs_diff_vs_chosen": (tried_state["out"].float() - chosen_state["out"].float()).abs().max().item(),
            "lse_max_abs_diff_vs_chosen": (tried_state["lse"] - chosen_state["lse"]).abs().max().item()}
    cudnn_forward, cudnn_state = cudnn_dense_forward(p)
    milliseconds = time_ms(cudnn_forward)
    cudnn_forward()
    row["cudnn_dense_forward"] = {
        "ms": milliseconds, "tflops": fwd_flops / (milliseconds * 1e-3) / 1e12,
        "out_max_abs_diff_vs_chosen": (cudnn_state["out"].float() - chosen_state["out"].float()).abs().max().item()}
    del cudnn_state


def bench_history(history, results, try_dense=(), try_backward=()):
    p = make_inputs(history)
    fwd_flops = forward_flops(CHUNK, history)
    bwd_flops = 2.5 * fwd_flops
    row = {"history": history, "chunk": CHUNK, "forward_tflop": fwd_flops / 1e12}

    forward, backward, state = membar_runner(p)
    row["membar_forward_ms"] = time_ms(forward)
    forward()
    if try_dense:
        time_dense_forwards(p, row, fwd_flops, state, try_dense)
    row["membar_backward_ms"] = time_ms(backward)
    membar_out = state["out"]
    # The mma.sync split backward that other GPUs run (and Hopper ran before the warpgroup one),
    # where the chosen layout is another one.
    split_ms = time_other_backward(backward, SPLIT_BACKWARD)
    if split_ms is not None:
        row["split_backward_ms"] = split_ms
    # Other compiled backward layouts by name at every history (--try-history-backward-layouts).
    row["tried_backward_tflops"] = {name: bwd_flops / (time_backward_layout(backward, name) * 1e-3) / 1e12
                                    for name in try_backward}

    _, deterministic_backward, det_state = membar_runner(p, deterministic=True)
    det_state.update(state)
    row["membar_backward_deterministic_ms"] = time_ms(deterministic_backward, warmup=1, iterations=3)
    row["deterministic_ratio"] = row["membar_backward_ms"] / row["membar_backward_deterministic_ms"]
    # The dQ pass before the warp-specialised one (Note [Warp-specialised dQ pass]), in the same run.
    os.environ["MEMBAR_CUDA_DQ_PASS"] = "warpgroup"
    try:
        row["membar_backward_deterministic_warpgroup_dq_ms"] = time_ms(deterministic_backward, warmup=1, iterations=3)
        warpgroup_dq = deterministic_backward()[0].float()
    finally:
        del os.environ["MEMBAR_CUDA_DQ_PASS"]
    row["deterministic_warpgroup_dq_ratio"] = (row["membar_backward_ms"] /
                                               row["membar_backward_deterministic_warpgroup_dq_ms"])
    row["deterministic_dq_max_abs_diff_vs_warpgroup_pass"] = (
        deterministic_backward()[0].float() - warpgroup_dq).abs().max().item()
    del warpgroup_dq
    _, bf16_backward, bf16_state = membar_runner(p, grad_dtype=torch.bfloat16)
    bf16_state.update(state)
    row["membar_backward_bf16_pages_ms"] = time_ms(bf16_backward, warmup=1, iterations=3)

    sdpa_forward, sdpa_forward_backward, sdpa_state = sdpa_runner(p)
    row["sdpa_forward_ms"] = time_ms(sdpa_forward)
    row["sdpa_forward_backward_ms"] = time_ms(sdpa_forward_backward)
    row["sdpa_backward_ms"] = row["sdpa_forward_backward_ms"] - row["sdpa_forward_ms"]
    sdpa_forward()
    row["max_abs_diff_vs_sdpa"] = (membar_out - sdpa_state["out"][0].transpose(0, 1)).abs().max().item()
    del sdpa_state, sdpa_forward, sdpa_forward_backward
    torch.cuda.empty_cache()

    for who in ("membar", "sdpa"):
        row[f"{who}_forward_tflops"] = fwd_flops / (row[f"{who}_forward_ms"] * 1e-3) / 1e12
        row[f"{who}_backward_tflops"] = bwd_flops / (row[f"{who}_backward_ms"] * 1e-3) / 1e12
    if "split_backward_ms" in row:
        row["split_backward_tflops"] = bwd_flops / (row["split_backward_ms"] * 1e-3) / 1e12
    row["forward_ratio"] = row["membar_forward_tflops"] / row["sdpa_forward_tflops"]
    row["backward_ratio"] = row["membar_backward_tflops"] / row["sdpa_backward_tflops"]
    results["dense"].append(row)
    print(json.dumps(row), flush=True)

    if history == max(results["histories"]):
        # Sparse: top-64 pages per 128-query tile, selected from the page means.
        summary_select = lambda: ops.page_select(p["q"], ops.page_summary(p["k_pool"], p["k_index"], history, False)[0],
                                                 None, None, 64, 128)
        select_ms = time_ms(summary_select)
        selection = summary_select()
        sparse_forward, sparse_backward, sparse_state = membar_runner(p, selection=selection)
        sparse = {"history": history, "top_k_pages": 64, "page_tokens": PAGE_TOKENS, "summary_select_ms": select_ms}
        sparse["forward_ms"] = time_ms(sparse_forward)
        sparse_forward()
        sparse["backward_ms"] = time_ms(sparse_backward)
        sparse["tried_backward_ms"] = {name: time_backward_layout(sparse_backward, name) for name in try_backward}
        dense_total = row["membar_forward_ms"] + row["membar_backward_ms"]
        sparse["speedup_fwd_bwd_over_dense"] = dense_total / (sparse["forward_ms"] + sparse["backward_ms"])
        sparse["speedup_fwd_bwd_over_sdpa"] = row["sdpa_forward_backward_ms"] / (sparse["forward_ms"] + sparse["backward_ms"])
        results["sparse"] = sparse
        print(json.dumps(sparse), flush=True)
    del p
    torch.cuda.empty_cache()


def bench_head_dim(head_dim, dtype, history, results, try_layouts=(), softcap=0.0, try_backward=()):
    """Forward and backward TFLOP/s of membar and SDPA flash at one head size and dtype; with softcap
    also membar's soft-capped kernels (Gemma 2; SDPA has no soft-cap to compare with)."""
    p = make_inputs(history, head_dim=head_dim, dtype=dtype)
    fwd_flops = forward_flops(CHUNK, history, head_dim)
    row = {"head_dim": head_dim, "dtype": str(dtype).replace("torch.", ""), "history": history, "chunk": CHUNK}
    if hasattr(ops, "attention_cuda_layout"):
        row["layouts"] = {kind: ops.attention_cuda_layout(kind, dtype, head_dim, PAGE_TOKENS)
                          for kind in ("forward", "backward")}
    forward, backward, state = membar_runner(p)
    row["membar_forward_ms"] = time_ms(forward)
    # The mma.sync forward another GPU runs (64-row CTAs at head_dim 256), asked for by name.
    row["mma_forward_layout"] = "w4r16_k64_s2_shift_pad" if head_dim == 256 else "w8r16_k128_s3_qreg_shift"
    mma_forward, _, _ = membar_runner(p, forward_layout=row["mma_forward_layout"])
    row["mma_forward_ms"] = time_ms(mma_forward)
    # Other compiled forward layouts asked for by name (--try-layouts; one this head size does not
    # compile would run the chosen one instead, so name only compiled ones).
    row["tried_forward_tflops"] = {}
    for name in try_layouts:
        tried_forward, _, _ = membar_runner(p, forward_layout=name)
        row["tried_forward_tflops"][name] = fwd_flops / (time_ms(tried_forward) * 1e-3) / 1e12
    forward()
    row["membar_backward_ms"] = time_ms(backward)
    # Other compiled backward layouts by name (--try-backward-layouts; an opt-in layout of Note
    # [Layout choice] before the choice takes it), through $MEMBAR_CUDA_BACKWARD_LAYOUT.
    row["tried_backward_tflops"] = {}
    for name in try_backward:
        milliseconds = time_backward_layout(backward, name)
        row["tried_backward_tflops"][name] = 2.5 * fwd_flops / (milliseconds * 1e-3) / 1e12
    if softcap:
        capped_forward, capped_backward, _ = membar_runner(p, softcap=softcap)
        row["softcap"] = softcap
        row["softcap_forward_tflops"] = fwd_flops / (time_ms(capped_forward) * 1e-3) / 1e12
        capped_forward()
        row["softcap_backward_tflops"] = 2.5 * fwd_flops / (time_ms(capped_backward) * 1e-3) / 1e12
    sdpa_forward, sdpa_forward_backward, sdpa_state = sdpa_runner(p)
    row["sdpa_forward_ms"] = time_ms(sdpa_forward)
    row["sdpa_backward_ms"] = time_ms(sdpa_forward_backward) - row["sdpa_forward_ms"]
    sdpa_forward()
    row["max_abs_diff_vs_sdpa"] = (state["out"] - sdpa_state["out"][0].transpose(0, 1)).abs().max().item()
    for who in ("membar", "sdpa"):
        row[f"{who}_forward_tflops"] = fwd_flops / (row[f"{who}_forward_ms"] * 1e-3) / 1e12
        row[f"{who}_backward_tflops"] = 2.5 * fwd_flops / (row[f"{who}_backward_ms"] * 1e-3) / 1e12
    row["mma_forward_tflops"] = fwd_flops / (row["mma_forward_ms"] * 1e-3) / 1e12
    row["forward_ratio"] = row["membar_forward_tflops"] / row["sdpa_forward_tflops"]
    row["backward_ratio"] = row["membar_backward_tflops"] / row["sdpa_backward_tflops"]
    row["goals_met"] = row["forward_ratio"] >= 1.0 and row["backward_ratio"] >= 0.8
    results["head_dims"].append(row)
    print(json.dumps(row), flush=True)
    del p, state, sdpa_state
    torch.cuda.empty_cache()


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--histories", default="32768,131072,262144")
    parser.add_argument("--head-dims", default="64,96,128,256", help="head sizes to compare with SDPA ('' for none)")
    parser.add_argument("--head-dim-dtypes", default="bfloat16,float16")
    parser.add_argument("--head-dim-history", type=int, default=32768)
    parser.add_argument("--try-layouts", default="",
                        help="forward layouts to time beside the chosen one, as HEAD_DIM=NAME,... (compiled ones)")
    parser.add_argument("--try-backward-layouts", default="",
                        help="backward layouts to time beside the chosen one, as HEAD_DIM=NAME,... (compiled ones, "
                             "e.g. 64=w8_k128_split_s2_pad, the mma.sync layout other GPUs run there)")
    parser.add_argument("--try-dense-layouts", default="",
                        help="forward layouts (head size 128) to time at every history beside the chosen one and "
                             "the cuDNN forward of the dense path, each checked against the chosen one's output")
    parser.add_argument("--try-history-backward-layouts", default="",
                        help="backward layouts (head size 128) to time at every history and in the sparse call beside "
                             "the chosen one")
    parser.add_argument("--softcap", type=float, default=0.0,
                        help="also time the soft-capped kernels (Gemma 2's attn_logit_softcapping, e.g. 50)")
    args = parser.parse_args()
    histories = [int(h) for h in args.histories.split(",") if h]
    # MEMBAR_COMMIT first: on the lent device the tree's .git may be an older copy than its files.
    commit = os.environ.get("MEMBAR_COMMIT", "")
    if not commit:
        try:
            commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                                    cwd=Path(__file__).parent).stdout.strip()
        except OSError:
            commit = ""
    results = {
        "benchmark": "paged attention vs torch SDPA (flash), Qwen2.5-7B attention shape",
        "commit": commit or "unknown",
        "machine": f"{torch.cuda.get_device_name()} ({platform.node()})",
        "torch": torch.__version__,
        "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
        "shape": {"q_heads": Q_HEADS, "kv_heads": KV_HEADS, "head_dim": HEAD_DIM, "page_tokens": PAGE_TOKENS,
                  "chunk": CHUNK, "dtype": "bfloat16", "grad_pages": "float32"},
        "flop_convention": "fwd 4*Tc*Hq*D*(history + Tc/2); bwd 2.5x fwd; same for both",
        "histories": histories,
        # The layouts the kernels chose for this shape (bench/attention_sweep.py times all of them).
        "layouts": {kind: ops.attention_cuda_layout(kind, torch.bfloat16, HEAD_DIM, PAGE_TOKENS)
                    for kind in ("forward", "backward")} if hasattr(ops, "attention_cuda_layout") else {},
        "dense": [],
        "sparse": None,
        "head_dims": [],
    }
    try_dense = [name for name in args.try_dense_layouts.split(",") if name]
    try_history_backward = [name for name in args.try_history_backward_layouts.split(",") if name]
    for history in histories:
        bench_history(history, results, try_dense, try_history_backward)
    for head_dim in [int(d) for d in args.head_dims.split(",") if d]:
        for dtype_name in [d for d in args.head_dim_dtypes.split(",") if d]:
            tried = [name for entry in args.try_layouts.split(",") if entry
                     for size, name in [entry.split("=")] if int(size) == head_dim]
            tried_backward = [name for entry in args.try_backward_layouts.split(",") if entry
                              for size, name in [entry.split("=")] if int(size) == head_dim]
            bench_head_dim(head_dim, getattr(torch, dtype_name), args.head_dim_history, results, tried, args.softcap,
                           tried_backward)

    lines = [f"paged attention vs SDPA flash, {results['machine']}, commit {results['commit'][:12]}, {results['date']}",
             "Qwen2.5-7B attention: 28 q heads, 4 kv heads, D=128, bf16, chunk 4096, pages of 128, fp32 grad pages; "
             f"kernel layouts {results['layouts']}",
             f"{'history':>8} {'fwd TF/s':>9} {'SDPA fwd':>9} {'ratio':>6} {'bwd TF/s':>9} {'split bwd':>9}"
             f" {'SDPA bwd':>9} {'ratio':>6} {'bwd det ms':>10} {'bwd bf16pg ms':>13} {'|diff|':>8}"]
    for row in results["dense"]:
        lines.append(f"{row['history']:>8} {row['membar_forward_tflops']:>9.1f} {row['sdpa_forward_tflops']:>9.1f}"
                     f" {row['forward_ratio']:>6.2f} {row['membar_backward_tflops']:>9.1f}"
                     f" {row.get('split_backward_tflops', float('nan')):>9.1f}"
                     f" {row['sdpa_backward_tflops']:>9.1f} {row['backward_ratio']:>6.2f}"
                     f" {row['membar_backward_deterministic_ms']:>10.1f} {row['membar_backward_bf16_pages_ms']:>13.1f}"
                     f" {row['max_abs_diff_vs_sdpa']:>8.4f}")
        lines.append(f"{'':>8} deterministic backward {row['membar_backward_deterministic_ms']:.1f} ms"
                     f" ({row['deterministic_ratio']:.3f}x the default's speed); with the warpgroup dQ pass"
                     f" {row['membar_backward_deterministic_warpgroup_dq_ms']:.1f} ms"
                     f" ({row['deterministic_warpgroup_dq_ratio']:.3f}x); |dq - warpgroup pass's|"
                     f" {row['deterministic_dq_max_abs_diff_vs_warpgroup_pass']:.2e}")
        for name, tried in row.get("tried_dense_forward", {}).items():
            lines.append(f"{'':>8} {tried['tflops']:>9.1f}  forward layout {name}"
                         f" ({tried['tflops'] / row['membar_forward_tflops']:.2f}x chosen,"
                         f" {tried['tflops'] / row['sdpa_forward_tflops']:.2f}x SDPA flash;"
                         f" |out - chosen| {tried['out_max_abs_diff_vs_chosen']:.4f},"
                         f" |lse - chosen| {tried['lse_max_abs_diff_vs_chosen']:.5f})")
        for name, tflops in row.get("tried_backward_tflops", {}).items():
            lines.append(f"{'':>8} {tflops:>9.1f}  backward layout {name}"
                         f" ({tflops / row['membar_backward_tflops']:.2f}x chosen,"
                         f" {tflops / row['sdpa_backward_tflops']:.2f}x SDPA flash)")
        if "cudnn_dense_forward" in row:
            cudnn = row["cudnn_dense_forward"]
            lines.append(f"{'':>8} {cudnn['tflops']:>9.1f}  cuDNN forward of the dense path (history + chunk, merged;"
                         f" |out - chosen| {cudnn['out_max_abs_diff_vs_chosen']:.4f})")
    if results["sparse"]:
        s = results["sparse"]
        lines.append(f"sparse top-{s['top_k_pages']} pages at {s['history']}: fwd {s['forward_ms']:.2f} ms, "
                     f"bwd {s['backward_ms']:.2f} ms, summary+select {s['summary_select_ms']:.2f} ms; "
                     f"fwd+bwd speedup {s['speedup_fwd_bwd_over_dense']:.1f}x over dense paged, "
                     f"{s['speedup_fwd_bwd_over_sdpa']:.1f}x over SDPA")
        for name, milliseconds in s.get("tried_backward_ms", {}).items():
            lines.append(f"  sparse bwd on {name}: {milliseconds:.2f} ms ({s['backward_ms'] / milliseconds:.2f}x chosen)")
    if results["head_dims"]:
        lines.append(f"head sizes at history {args.head_dim_history} (28 / 4 heads, chunk 4096, pages of 128); "
                     "goals: forward >= 1.0x, backward >= 0.8x SDPA flash")
        lines.append(f"{'D':>4} {'dtype':>9} {'fwd TF/s':>9} {'mma fwd':>8} {'SDPA fwd':>9} {'ratio':>6} {'bwd TF/s':>9}"
                     f" {'SDPA bwd':>9} {'ratio':>6} {'goals':>6}  layouts")
        for row in results["head_dims"]:
            layouts = row.get("layouts", {})
            lines.append(f"{row['head_dim']:>4} {row['dtype']:>9} {row['membar_forward_tflops']:>9.1f}"
                         f" {row.get('mma_forward_tflops', float('nan')):>8.1f} {row['sdpa_forward_tflops']:>9.1f} {row['forward_ratio']:>6.2f}"
                         f" {row['membar_backward_tflops']:>9.1f} {row['sdpa_backward_tflops']:>9.1f}"
                         f" {row['backward_ratio']:>6.2f} {'met' if row['goals_met'] else 'NOT':>6}"
                         f"  {layouts.get('forward', '?')} / {layouts.get('backward', '?')}")
            if "softcap" in row:
                lines.append(f"{'':>4} {'':>9} {row['softcap_forward_tflops']:>9.1f}  soft-capped ({row['softcap']:g}):"
                             f" forward {row['softcap_forward_tflops'] / row['membar_forward_tflops']:.2f}x,"
                             f" backward {row['softcap_backward_tflops']:.1f} TF/s"
                             f" {row['softcap_backward_tflops'] / row['membar_backward_tflops']:.2f}x uncapped")
            for name, tflops in row.get("tried_forward_tflops", {}).items():
                lines.append(f"{'':>4} {'':>9} {tflops:>9.1f}  forward layout {name}")
            for name, tflops in row.get("tried_backward_tflops", {}).items():
                lines.append(f"{'':>4} {'':>9} {tflops:>9.1f}  backward layout {name}"
                             f" ({tflops / row['sdpa_backward_tflops']:.2f}x SDPA flash)")
    text = "\n".join(lines) + "\n"
    print(text)
    out_dir = Path(os.environ.get("MEMBAR_RESULTS_DIR", Path(__file__).parent / "results" / "latest"))
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "attention.json").write_text(json.dumps(results, indent=2) + "\n")
    (out_dir / "attention.txt").write_text(text)


if __name__ == "__main__":
    main()
