"""Sweep of the compiled CUDA attention kernel variants (Note [Forward variants] in
kernels/cuda/attention_forward.cu, Note [Backward variants] in attention_backward.cu) at the
Qwen2.5-7B attention shape: 28 q heads, 4 KV heads, head_dim 128, bf16, a chunk of 4096 queries
after a history of 32K and 128K tokens in pages of 128, beside torch SDPA with the flash backend.

For each history: the default variants' outputs are the reference; every variant runs once on the
same random inputs and must agree with them up to rounding (norm of the difference / norm of the
reference <= 1e-2, and no element off by more than 10% of the reference's largest magnitude),
then is timed (median of 5 runs after a warm-up). FLOPs are counted as in attention_bench.py:
4 * Tc * Hq * D * (history + Tc / 2) for the forward, 2.5 times that for the backward.

Registers and stack (spill) bytes per kernel come from `cuobjdump --dump-resource-usage` on the
loaded ops library.

A variant that crashes the CUDA context or hangs must not take the others with it: the work runs
in a child process that writes one JSON line per finished measurement; when the child dies, the
parent marks the variant it was on as failed and starts a new child for the rest.

Writes attention_sweep.json and attention_sweep.txt into $MEMBAR_RESULTS_DIR (default
bench/results/latest). Usage (about a minute on an H200):
  PYTHONPATH=bindings/python python3 bench/attention_sweep.py [--histories 32768,131072]
      [--forward NAME,...] [--backward NAME,...]
"""
import argparse
import json
import math
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

Q_HEADS, KV_HEADS, HEAD_DIM, PAGE_TOKENS, CHUNK = 28, 4, 128, 128, 4096
NORM_TOLERANCE = 1e-2
MAX_TOLERANCE = 0.1
CHILD_TIMEOUT_S = 150


def forward_flops(history):
    return 4.0 * CHUNK * Q_HEADS * HEAD_DIM * (history + CHUNK / 2)


# ---------------------------------------------------------------------------------------------
# Child: measures and writes JSON lines.

def child_main(args):
    import torch

    import membar  # noqa: F401  (loads the ops library)

    ops = torch.ops.membar
    out_file = open(args.child_out, "a", buffering=1)

    def emit(record):
        out_file.write(json.dumps(record) + "\n")
        out_file.flush()

    from attention_bench import time_ms as bench_time_ms   # bench/ is this script's directory

    def time_ms(function):
        return bench_time_ms(function, warmup=1)

    def compare(got, want):
        difference = (got.float() - want.float())
        norm = want.float().norm().item()
        largest = want.float().abs().max().item()
        norm_rel = difference.norm().item() / max(norm, 1e-30)
        max_rel = difference.abs().max().item() / max(largest, 1e-30)
        finite = bool(torch.isfinite(got.float()).all().item())
        return norm_rel, max_rel, finite and norm_rel <= NORM_TOLERANCE and max_rel <= MAX_TOLERANCE

    todo = [item.split(":", 1) for item in args.todo.split(",") if item]
    histories = [int(h) for h in args.histories.split(",")]
    for history in histories:
        torch.manual_seed(1234 + history)
        device, dtype = "cuda", torch.bfloat16
        num_pages = history // PAGE_TOKENS
        q = torch.randn(CHUNK, Q_HEADS, HEAD_DIM, device=device, dtype=dtype)
        k = torch.randn(CHUNK, KV_HEADS, HEAD_DIM, device=device, dtype=dtype)
        v = torch.randn(CHUNK, KV_HEADS, HEAD_DIM, device=device, dtype=dtype)
        dout = torch.randn(CHUNK, Q_HEADS, HEAD_DIM, device=device, dtype=dtype)
        k_pool = torch.randn(num_pages, PAGE_TOKENS, KV_HEADS, HEAD_DIM, device=device, dtype=dtype)
        v_pool = torch.randn(num_pages, PAGE_TOKENS, KV_HEADS, HEAD_DIM, device=device, dtype=dtype)
        k_index = torch.randperm(num_pages, device=device).to(torch.int32)
        v_index = torch.randperm(num_pages, device=device).to(torch.int32)
        scale = 1.0 / math.sqrt(HEAD_DIM)
        dk_pool = torch.zeros(k_pool.shape, device=device, dtype=torch.float32)
        dv_pool = torch.zeros(v_pool.shape, device=device, dtype=torch.float32)
        fwd_flops = forward_flops(history)

        def forward():
            return ops.paged_attention_forward(q, k, v, k_pool, k_index, v_pool, v_index, history, scale, None, 128)

        def backward(out, lse, dk, dv):
            return ops.paged_attention_backward(q, k, v, k_pool, k_index, v_pool, v_index, out, dout, lse, dk,
                                                k_index, dv, v_index, history, scale, None, 128, False)

        os.environ.pop("MEMBAR_ATTENTION_FORWARD_VARIANT", None)
        os.environ.pop("MEMBAR_ATTENTION_BACKWARD_VARIANT", None)
        reference_out, reference_lse = forward()
        dk_reference, dv_reference = torch.zeros_like(dk_pool), torch.zeros_like(dv_pool)
        reference_grads = backward(reference_out, reference_lse, dk_reference, dv_reference)
        reference_grads = list(reference_grads) + [dk_reference, dv_reference]
        torch.cuda.synchronize()

        if ("sdpa", "flash") in [tuple(item) for item in todo]:
            emit({"kind": "sdpa", "variant": "flash", "history": history, "started": True})
            from torch.nn.attention import SDPBackend, sdpa_kernel
            from torch.nn.attention.bias import causal_lower_right

            group = Q_HEADS // KV_HEADS
            keys = torch.cat([k_pool[k_index.long()].reshape(-1, KV_HEADS, HEAD_DIM), k])
            values = torch.cat([v_pool[v_index.long()].reshape(-1, KV_HEADS, HEAD_DIM), v])
            sq = q.transpose(0, 1).unsqueeze(0).detach().requires_grad_()
            sk = keys.repeat_interleave(group, dim=1).transpose(0, 1).unsqueeze(0).detach().requires_grad_()
            sv = values.repeat_interleave(group, dim=1).transpose(0, 1).unsqueeze(0).detach().requires_grad_()
            del keys, values
            sdout = dout.transpose(0, 1).unsqueeze(0)
            mask = causal_lower_right(sq.shape[2], sk.shape[2])
            state = {}

            def sdpa_forward():
                with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
                    state["out"] = torch.nn.functional.scaled_dot_product_attention(sq, sk, sv, attn_mask=mask)

            def sdpa_forward_backward():
                sdpa_forward()
                state["out"].backward(sdout)
                sq.grad = sk.grad = sv.grad = None

            forward_ms = time_ms(sdpa_forward)
            both_ms = time_ms(sdpa_forward_backward)
            sdpa_forward()
            difference = (state["out"][0].transpose(0, 1).float() - reference_out.float()).abs().max().item()
            emit({"kind": "sdpa", "variant": "flash", "history": history, "forward_ms": forward_ms,
                  "backward_ms": both_ms - forward_ms,
                  "forward_tflops": fwd_flops / (forward_ms * 1e-3) / 1e12,
                  "backward_tflops": 2.5 * fwd_flops / ((both_ms - forward_ms) * 1e-3) / 1e12,
                  "max_abs_diff_vs_default": difference})
            del sq, sk, sv, state
            torch.cuda.empty_cache()

        for kind, name in todo:
            if kind == "sdpa":
                continue
            emit({"kind": kind, "variant": name, "history": history, "started": True})
            variable = "MEMBAR_ATTENTION_FORWARD_VARIANT" if kind == "forward" else "MEMBAR_ATTENTION_BACKWARD_VARIANT"
            os.environ[variable] = name
            record = {"kind": kind, "variant": name, "history": history}
            try:
                if kind == "forward":
                    out, lse = forward()
                    out_rel = compare(out, reference_out)
                    lse_difference = (lse - reference_lse).abs().max().item()
                    record["checks"] = {"out": out_rel[:2], "lse_max_abs": lse_difference}
                    record["ok"] = out_rel[2] and lse_difference <= 1e-3
                    milliseconds = time_ms(forward)
                    record["ms"] = milliseconds
                    record["tflops"] = fwd_flops / (milliseconds * 1e-3) / 1e12
                else:
                    dk, dv = torch.zeros_like(dk_pool), torch.zeros_like(dv_pool)
                    grads = list(backward(reference_out, reference_lse, dk, dv)) + [dk, dv]
                    record["checks"] = {}
                    record["ok"] = True
                    for label, got, want in zip(("dq", "dk_chunk", "dv_chunk", "dk_pages", "dv_pages"), grads,
                                                reference_grads):
                        norm_rel, max_rel, ok = compare(got, want)
                        record["checks"][label] = [norm_rel, max_rel]
                        record["ok"] = record["ok"] and ok
                    del grads, dk, dv
                    milliseconds = time_ms(lambda: backward(reference_out, reference_lse, dk_pool, dv_pool))
                    record["ms"] = milliseconds
                    record["tflops"] = 2.5 * fwd_flops / (milliseconds * 1e-3) / 1e12
                torch.cuda.synchronize()
            except RuntimeError as error:
                record["ok"] = False
                record["error"] = str(error).splitlines()[0][:300]
                if "CUDA" in str(error) and "launch" not in str(error):
                    raise  # the context may be gone: the parent marks this variant and starts a new child
            finally:
                os.environ.pop(variable, None)
            emit(record)
        del q, k, v, dout, k_pool, v_pool, dk_pool, dv_pool, reference_out, reference_lse, reference_grads
        torch.cuda.empty_cache()
    out_file.close()


# ---------------------------------------------------------------------------------------------
# Parent: plans the work, restarts children, prints and writes the results.

def resource_usage(library):
    """{demangled kernel name: (registers, stack bytes)} from cuobjdump, or {} when unavailable."""
    tool = shutil.which("cuobjdump") or "/usr/local/cuda/bin/cuobjdump"
    if not os.path.exists(tool):
        return {}
    try:
        text = subprocess.run([tool, "--dump-resource-usage", str(library)], capture_output=True, text=True,
                              timeout=60).stdout
    except (OSError, subprocess.TimeoutExpired):
        return {}
    usage = {}
    current = None
    for line in text.splitlines():
        match = re.search(r"Function (\S+):", line)
        if match:
            current = match.group(1)
            continue
        match = re.search(r"REG:(\d+) STACK:(\d+)", line)
        if match and current and "attention" in current:
            usage[current] = (int(match.group(1)), int(match.group(2)))
            current = None
    return demangle_keys(usage)


def tensor_core_instructions(library):
    """{demangled kernel name: number of HMMA (mma.sync) plus HGMMA (wgmma) instructions in its SASS}, from
    `cuobjdump -sass`, or {} when cuobjdump is unavailable: the issue asks to check that the
    kernels run on tensor cores."""
    tool = shutil.which("cuobjdump") or "/usr/local/cuda/bin/cuobjdump"
    if not os.path.exists(tool):
        return {}
    try:
        text = subprocess.run([tool, "-sass", str(library)], capture_output=True, text=True, timeout=120).stdout
    except (OSError, subprocess.TimeoutExpired):
        return {}
    counts = {}
    current = None
    for line in text.splitlines():
        match = re.search(r"Function : (\S+)", line)
        if match:
            current = match.group(1) if "attention" in match.group(1) else None
            if current:
                counts[current] = 0
            continue
        if current and re.search(r"\bHMMA\b|\bHGMMA\b", line):
            counts[current] += 1
    return demangle_keys(counts)


def resource_usage_from_ptxas(log_path):
    """{demangled kernel name: (registers, spill store bytes)} from the ptxas -v lines of a build
    log (kernels/CMakeLists.txt compiles with -Xptxas=-v; tools/gpu_check.sh keeps build.log)."""
    try:
        text = Path(log_path).read_text(errors="replace")
    except OSError:
        return {}
    usage = {}
    pattern = re.compile(r"Compiling entry function '([^']+)' for 'sm_\w+'\s*\n(?:[^\n]*\n){0,3}?[^\n]*?"
                         r"(\d+) bytes spill stores[^\n]*\n[^\n]*?Used (\d+) registers")
    for mangled, spill, registers in pattern.findall(text):
        if "attention" in mangled:
            usage[mangled] = (int(registers), int(spill))
    return demangle_keys(usage)


def demangle_keys(usage):
    """The same mapping keyed by c++filt's names, without this project's namespaces."""
    if usage and shutil.which("c++filt"):
        names = list(usage)
        demangled = subprocess.run(["c++filt"], input="\n".join(names), capture_output=True, text=True).stdout.split("\n")
        usage = {d.strip().replace("membar::kernels::cuda::(anonymous namespace)::", ""): usage[n]
                 for n, d in zip(names, demangled)}
    return usage


def variant_kernel_pattern(kind, name):
    """The template arguments (as c++filt prints them) of the bf16, D=128 kernel of a variant."""
    if kind == "forward":
        match = re.match(r"wgmma_w8r64_k(\d+)_s(\d)$", name)   # kernels/cuda/attention_forward_wgmma.cu
        if match:
            return f"paged_attention_forward_wgmma_kernel<{match.group(1)}, {match.group(2)}, 1>"
        match = re.match(r"w(\d+)r(\d+)_k(\d+)_s(\d+)(_qreg)?(_skip)?(_shift)?(_2cta)?(_pad)?(_pipe)?(_seq)?(_lazy)?$",
                         name)
        if not match:
            return None
        warps, rows, keys, stages, qreg, skip, shift, two, pad, pipe, seq, lazy = match.groups()
        flag = lambda value: "true" if value else "false"  # noqa: E731
        config = (f"ForwardConfig<{warps}, {int(rows) // 16}, {keys}, {stages}, {flag(qreg)}, {flag(skip)}, "
                  f"{2 if two else 1}, {flag(skip or shift)}, {flag(pad)}, {flag(pipe)}, {flag(seq)}, {flag(lazy)}>")
        return f"paged_attention_forward_kernel<__nv_bfloat16, 128, {config} >"
    match = re.match(r"w(\d+)_k(\d+)_dq(\d+)(_pad)?$", name)
    if match:
        warps, keys, columns = (int(g) for g in match.groups()[:3])
        pieces = (HEAD_DIM // (warps // 4)) // columns
        padded = "true" if match.group(4) else "false"
        return f"paged_attention_backward_kv_kernel<__nv_bfloat16, 128, {warps}, {pieces}, {padded}>"
    match = re.match(r"w8_k128_split_s(\d)(_pad)?(_dq4)?$", name)
    if match:
        padded = "true" if match.group(2) else "false"
        quad = "true" if match.group(3) else "false"
        return f"paged_attention_backward_split_kernel<__nv_bfloat16, 128, {match.group(1)}, {padded}, {quad}>"
    return None


def lookup_usage(usage, kind, name):
    pattern = variant_kernel_pattern(kind, name)
    if pattern is None:
        return None
    for kernel, values in usage.items():
        if pattern in kernel:
            return values
    return None


def run_children(todo, histories, out_path):
    """Runs the todo list in children until every item finished or failed; returns the records."""
    failed = []
    for _attempt in range(len(todo) + 1):
        records = [json.loads(line) for line in open(out_path)] if os.path.exists(out_path) else []
        finished = {(r["kind"], r["variant"], r["history"]) for r in records if not r.get("started")}
        failed_keys = {(f["kind"], f["variant"], f["history"]) for f in failed}
        remaining = [(kind, name) for kind, name in todo
                     if any((kind, name, h) not in finished and (kind, name, h) not in failed_keys for h in histories)]
        if not remaining:
            break
        pending_histories = [h for h in histories
                             if any((kind, name, h) not in finished and (kind, name, h) not in failed_keys
                                    for kind, name in remaining)]
        command = [sys.executable, __file__, "--child-out", out_path, "--histories",
                   ",".join(str(h) for h in pending_histories),
                   "--todo", ",".join(f"{kind}:{name}" for kind, name in remaining)]
        try:
            result = subprocess.run(command, timeout=CHILD_TIMEOUT_S, capture_output=True, text=True)
            crashed = result.returncode != 0
            message = (result.stderr or "").strip().splitlines()[-1:] if crashed else []
        except subprocess.TimeoutExpired:
            crashed, message = True, ["timed out"]
        if not crashed:
            continue
        # The last started item without a result is the one that took the child down.
        records = [json.loads(line) for line in open(out_path)] if os.path.exists(out_path) else []
        finished = {(r["kind"], r["variant"], r["history"]) for r in records if not r.get("started")}
        culprit = None
        for record in records:
            key = (record["kind"], record["variant"], record["history"])
            if record.get("started") and key not in finished:
                culprit = key
        if culprit is None:
            print(f"[sweep] a child failed before starting any variant: {' '.join(message)}", flush=True)
            break
        print(f"[sweep] {culprit} took its process down: {' '.join(message)}", flush=True)
        # A variant that crashes at one history is not trusted at the others either.
        for h in histories:
            failed.append({"kind": culprit[0], "variant": culprit[1], "history": h, "ok": False,
                           "error": "crashed or hung: " + " ".join(message)})
    records = [json.loads(line) for line in open(out_path)] if os.path.exists(out_path) else []
    results = {}
    for record in records + failed:
        if record.get("started"):
            continue
        results.setdefault((record["kind"], record["variant"], record["history"]), record)
    return list(results.values())


def render_table(records, todo, histories, defaults, usage, usage_source, header):
    """The text table of a sweep and the fastest variant of each kind that agreed with the default
    at every history: (lines, {kind: name})."""
    by_key = {(r["kind"], r["variant"], r["history"]): r for r in records}
    lines = [header,
             "Qwen2.5-7B attention: 28 q heads, 4 kv heads, D=128, bf16, chunk 4096, pages of 128, fp32 grad pages; "
             "TFLOP/s (ratio to SDPA); check = |diff| norm / max relative to the default variant's output",
             f"{'kind':<9}{'variant':<36}{'regs':>5}{'stack':>6}" +
             "".join(f"{'h=' + str(h // 1024) + 'K':>18}" for h in histories) + "  check (norm, max) / error"]
    for kind, name in todo:
        regs = lookup_usage(usage, kind, name) if kind != "sdpa" else None
        cells, notes = [], []
        for h in histories:
            record = by_key.get((kind, name, h))
            sdpa = by_key.get(("sdpa", "flash", h))
            if record is None:
                cells.append(f"{'-':>18}")
                continue
            if kind == "sdpa":
                cells.append(f"{record.get('forward_tflops', 0):>8.1f}/{record.get('backward_tflops', 0):>6.1f} f/b")
                continue
            if "tflops" not in record:
                cells.append(f"{'FAILED':>18}")
                notes.append(record.get("error", "?")[:80])
                continue
            reference = sdpa.get(f"{kind}_tflops") if sdpa else None
            ratio = f"({record['tflops'] / reference:.2f})" if reference else ""
            flag = "" if record.get("ok") else "!"
            cells.append(f"{flag + format(record['tflops'], '.1f'):>10} {ratio:>7}")
            checks = record.get("checks", {})
            worst = max((c for c in checks.values() if isinstance(c, list)), key=lambda c: c[0], default=None)
            if worst:
                notes.append(f"{worst[0]:.1e},{worst[1]:.1e}" + ("" if record.get("ok") else " MISMATCH"))
        default = defaults.get(kind) == name
        label = name + (" *" if default else "")
        reg_text = f"{regs[0]:>5}{regs[1]:>6}" if regs else f"{'':>5}{'':>6}"
        lines.append(f"{kind:<9}{label:<36}{reg_text}" + "".join(cells) + "  " + "; ".join(notes))
    lines.append("* = default; ! = disagrees with the default (not a candidate); regs/stack from " + usage_source)
    best = {}
    for kind in ("forward", "backward"):
        candidates = [r for r in records if r["kind"] == kind and r.get("ok") and "tflops" in r]
        names = sorted({r["variant"] for r in candidates})
        complete = [n for n in names if all(by_key.get((kind, n, h), {}).get("ok") for h in histories)]
        if complete:
            score = {n: sum(by_key[(kind, n, h)]["tflops"] for h in histories) for n in complete}
            best[kind] = max(complete, key=score.get)
    return lines, best


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--histories", default="32768,131072")
    parser.add_argument("--forward", default="", help="forward variants to run (default: all compiled)")
    parser.add_argument("--backward", default="", help="backward variants to run (default: all compiled)")
    parser.add_argument("--ptxas-log", default="", help="build log with ptxas -v lines, used when cuobjdump is "
                        "missing (default: $MEMBAR_RESULTS_DIR/build.log)")
    parser.add_argument("--child-out", default="", help=argparse.SUPPRESS)
    parser.add_argument("--todo", default="", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child_out:
        child_main(args)
        return

    started = time.time()
    import torch

    import membar

    if not torch.cuda.is_available():
        sys.exit("attention_sweep: needs a CUDA device.")
    if not hasattr(torch.ops.membar, "attention_cuda_variants"):
        sys.exit("attention_sweep: the loaded membar library was built without CUDA.")
    forward_names, forward_default = torch.ops.membar.attention_cuda_variants("forward")
    backward_names, backward_default = torch.ops.membar.attention_cuda_variants("backward")
    if args.forward:
        forward_names = args.forward.split(",")
    if args.backward:
        backward_names = args.backward.split(",")
    histories = [int(h) for h in args.histories.split(",")]
    todo = [("sdpa", "flash")] + [("forward", n) for n in forward_names] + [("backward", n) for n in backward_names]

    with tempfile.TemporaryDirectory() as scratch:
        records = run_children(todo, histories, os.path.join(scratch, "records.jsonl"))

    library = Path(os.environ.get("MEMBAR_LIBRARY") or Path(membar.__file__).parent / "_C.so")
    hmma = tensor_core_instructions(library)
    usage = resource_usage(library)
    usage_source = "cuobjdump (REG, STACK bytes)"
    if not usage:
        log = args.ptxas_log or os.path.join(os.environ.get("MEMBAR_RESULTS_DIR", ""), "build.log")
        usage = resource_usage_from_ptxas(log)
        usage_source = f"ptxas -v in {log} (registers, spill store bytes)"
    # MEMBAR_COMMIT first: on the lent device the tree's .git may be an older copy than its files.
    commit = os.environ.get("MEMBAR_COMMIT", "")
    if not commit:
        try:
            commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                                    cwd=Path(__file__).parent).stdout.strip()
        except OSError:
            commit = ""
    header = (f"attention kernel variants vs SDPA flash, {torch.cuda.get_device_name()}, commit {commit[:12]}, "
              f"{time.strftime('%Y-%m-%d %H:%M:%S UTC', time.gmtime())}")
    lines, best = render_table(records, todo, histories, {"forward": forward_default, "backward": backward_default},
                               usage, usage_source, header)
    if hmma:
        counted = [(kind, name, lookup_usage(hmma, kind, name)) for kind, name in todo if kind != "sdpa"]
        lines.append("tensor-core instructions in the SASS (HMMA, or HGMMA for wgmma; cuobjdump -sass): " +
                     ", ".join(f"{name} {count}" for kind, name, count in counted if count is not None))
    lines.append("fastest correct: " + ", ".join(f"{k} {v}" for k, v in best.items()) +
                 f"; sweep took {time.time() - started:.0f} s")
    text = "\n".join(lines) + "\n"
    print(text)
    results = {
        "benchmark": "attention kernel variants vs torch SDPA (flash), Qwen2.5-7B attention shape",
        "commit": commit or os.environ.get("MEMBAR_COMMIT", "unknown"),
        "machine": f"{torch.cuda.get_device_name()} ({platform.node()})",
        "torch": torch.__version__,
        "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
        "histories": histories,
        "defaults": {"forward": forward_default, "backward": backward_default},
        "fastest_correct": best,
        "resource_usage": {k: list(v) for k, v in usage.items()},
        "resource_usage_source": usage_source,
        "hmma_instructions": hmma,
        "records": records,
    }
    out_dir = Path(os.environ.get("MEMBAR_RESULTS_DIR", Path(__file__).parent / "results" / "latest"))
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "attention_sweep.json").write_text(json.dumps(results, indent=2) + "\n")
    (out_dir / "attention_sweep.txt").write_text(text)


if __name__ == "__main__":
    main()
