"""Sweep of the CUDA attention kernels' layouts (the sweep target of kernels/sweep/: the shipped
layouts, the contenders that lost and the experimental ones; Note [Layout choice] in
kernels/include/membar/kernels/attention_cuda.h) at the Qwen2.5-7B attention shape: 28 q heads,
4 KV heads, head_dim 128, bf16, a chunk of 4096 queries after a history of 32K and 128K tokens in
pages of 128, beside torch SDPA with the flash backend. docs/kernels.md keeps the results.

The layouts run through the sweep module (torch.ops.membar_sweep, the library
membar_attention_sweep.so that `cmake --build <build> --target membar_attention_sweep` writes into
<build>/lib; --library or $MEMBAR_SWEEP_LIBRARY name another). For each history the shipped
library's own choice (torch.ops.membar) gives the reference outputs; every layout runs once on the
same random inputs and must agree with them up to rounding (norm of the difference / norm of the
reference <= 1e-2, and no element off by more than 10% of the reference's largest magnitude),
then is timed (median of 5 runs after a warm-up). A layout that does not fit the shape (pages of
64 only) is listed as such. FLOPs are counted as in attention_bench.py:
4 * Tc * Hq * D * (history + Tc / 2) for the forward, 2.5 times that for the backward. Registers
and local memory (stack and spills) per thread come from cudaFuncGetAttributes of each layout's
kernel.

A layout that crashes the CUDA context or hangs must not take the others with it: the work runs
in a child process that writes one JSON line per finished measurement; when the child dies, the
parent marks the layout it was on as failed and starts a new child for the rest.

Writes attention_sweep.json and attention_sweep.txt into $MEMBAR_RESULTS_DIR (default
bench/results/latest). Usage (about a minute on an H200, once the module is built):
  PYTHONPATH=bindings/python python3 bench/attention_sweep.py [--histories 32768,131072]
      [--forward NAME,...] [--backward NAME,...] [--library PATH]
"""
import argparse
import json
import math
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

Q_HEADS, KV_HEADS, HEAD_DIM, PAGE_TOKENS, CHUNK = 28, 4, 128, 128, 4096
NORM_TOLERANCE = 1e-2
MAX_TOLERANCE = 0.1
CHILD_TIMEOUT_S = 150
REPOSITORY = Path(__file__).resolve().parent.parent
LIBRARY_NAME = "membar_attention_sweep.so"


def find_sweep_library(explicit=""):
    """The sweep module's path: `explicit`, $MEMBAR_SWEEP_LIBRARY, $MEMBAR_BUILD_DIR/lib, or the
    lib/ of a build directory of this checkout (build-gpu, build, build-*); None when not built."""
    candidates = [explicit, os.environ.get("MEMBAR_SWEEP_LIBRARY", "")]
    if os.environ.get("MEMBAR_BUILD_DIR"):
        candidates.append(os.path.join(os.environ["MEMBAR_BUILD_DIR"], "lib", LIBRARY_NAME))
    candidates += [str(REPOSITORY / name / "lib" / LIBRARY_NAME) for name in ("build-gpu", "build")]
    candidates += sorted(str(path) for path in REPOSITORY.glob("build-*/lib/" + LIBRARY_NAME))
    for candidate in candidates:
        if candidate and os.path.exists(candidate):
            return Path(candidate)
    return None


def forward_flops(history):
    return 4.0 * CHUNK * Q_HEADS * HEAD_DIM * (history + CHUNK / 2)


# ---------------------------------------------------------------------------------------------
# Child: measures and writes JSON lines.

def child_main(args):
    import torch

    import membar  # noqa: F401  (loads the ops library)

    torch.ops.load_library(args.library)
    ops, sweep = torch.ops.membar, torch.ops.membar_sweep
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
        inputs = (q, k, v, k_pool, k_index, v_pool, v_index)

        def forward(layout=None):
            if layout is None:
                return ops.paged_attention_forward(*inputs, history, scale, None, 128)
            return sweep.paged_attention_forward(layout, *inputs, history, scale, None, 128)

        def backward(out, lse, dk, dv, layout=None):
            arguments = (*inputs, out, dout, lse, dk, k_index, dv, v_index, history, scale, None, 128, False)
            if layout is None:
                return ops.paged_attention_backward(*arguments)
            return sweep.paged_attention_backward(layout, *arguments)

        reference_out, reference_lse = forward()
        dk_reference, dv_reference = torch.zeros_like(dk_pool), torch.zeros_like(dv_pool)
        reference_grads = backward(reference_out, reference_lse, dk_reference, dv_reference)
        reference_grads = list(reference_grads) + [dk_reference, dv_reference]
        torch.cuda.synchronize()

        if ("sdpa", "flash") in [tuple(item) for item in todo]:
            emit({"kind": "sdpa", "layout": "flash", "history": history, "started": True})
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
            emit({"kind": "sdpa", "layout": "flash", "history": history, "forward_ms": forward_ms,
                  "backward_ms": both_ms - forward_ms,
                  "forward_tflops": fwd_flops / (forward_ms * 1e-3) / 1e12,
                  "backward_tflops": 2.5 * fwd_flops / ((both_ms - forward_ms) * 1e-3) / 1e12,
                  "max_abs_diff_vs_shipped": difference})
            del sq, sk, sv, state
            torch.cuda.empty_cache()

        for kind, name in todo:
            if kind == "sdpa":
                continue
            emit({"kind": kind, "layout": name, "history": history, "started": True})
            record = {"kind": kind, "layout": name, "history": history}
            try:
                if kind == "forward":
                    out, lse = forward(name)
                    out_rel = compare(out, reference_out)
                    lse_difference = (lse - reference_lse).abs().max().item()
                    record["checks"] = {"out": out_rel[:2], "lse_max_abs": lse_difference}
                    record["ok"] = out_rel[2] and lse_difference <= 1e-3
                    milliseconds = time_ms(lambda: forward(name))
                    record["ms"] = milliseconds
                    record["tflops"] = fwd_flops / (milliseconds * 1e-3) / 1e12
                else:
                    dk, dv = torch.zeros_like(dk_pool), torch.zeros_like(dv_pool)
                    grads = list(backward(reference_out, reference_lse, dk, dv, name)) + [dk, dv]
                    record["checks"] = {}
                    record["ok"] = True
                    for label, got, want in zip(("dq", "dk_chunk", "dv_chunk", "dk_pages", "dv_pages"), grads,
                                                reference_grads):
                        norm_rel, max_rel, ok = compare(got, want)
                        record["checks"][label] = [norm_rel, max_rel]
                        record["ok"] = record["ok"] and ok
                    del grads, dk, dv
                    milliseconds = time_ms(lambda: backward(reference_out, reference_lse, dk_pool, dv_pool, name))
                    record["ms"] = milliseconds
                    record["tflops"] = 2.5 * fwd_flops / (milliseconds * 1e-3) / 1e12
                torch.cuda.synchronize()
            except RuntimeError as error:
                message = str(error).splitlines()[0][:300]
                if "does not fit" in message:
                    record["skipped"] = "does not fit this shape or device"
                else:
                    record["ok"] = False
                    record["error"] = message
                    if "CUDA" in str(error) and "launch" not in str(error):
                        raise  # the context may be gone: the parent marks this layout and starts a new child
            emit(record)
        del q, k, v, dout, k_pool, v_pool, dk_pool, dv_pool, reference_out, reference_lse, reference_grads
        torch.cuda.empty_cache()
    out_file.close()


# ---------------------------------------------------------------------------------------------
# Parent: plans the work, restarts children, prints and writes the results.

def run_children(todo, histories, out_path, library):
    """Runs the todo list in children until every item finished or failed; returns the records."""
    failed = []
    for _attempt in range(len(todo) + 1):
        records = [json.loads(line) for line in open(out_path)] if os.path.exists(out_path) else []
        finished = {(r["kind"], r["layout"], r["history"]) for r in records if not r.get("started")}
        failed_keys = {(f["kind"], f["layout"], f["history"]) for f in failed}
        remaining = [(kind, name) for kind, name in todo
                     if any((kind, name, h) not in finished and (kind, name, h) not in failed_keys for h in histories)]
        if not remaining:
            break
        pending_histories = [h for h in histories
                             if any((kind, name, h) not in finished and (kind, name, h) not in failed_keys
                                    for kind, name in remaining)]
        command = [sys.executable, __file__, "--child-out", out_path, "--library", str(library), "--histories",
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
        finished = {(r["kind"], r["layout"], r["history"]) for r in records if not r.get("started")}
        culprit = None
        for record in records:
            key = (record["kind"], record["layout"], record["history"])
            if record.get("started") and key not in finished:
                culprit = key
        if culprit is None:
            print(f"[sweep] a child failed before starting any layout: {' '.join(message)}", flush=True)
            break
        print(f"[sweep] {culprit} took its process down: {' '.join(message)}", flush=True)
        # A layout that crashes at one history is not trusted at the others either.
        for h in histories:
            failed.append({"kind": culprit[0], "layout": culprit[1], "history": h, "ok": False,
                           "error": "crashed or hung: " + " ".join(message)})
    records = [json.loads(line) for line in open(out_path)] if os.path.exists(out_path) else []
    results = {}
    for record in records + failed:
        if record.get("started"):
            continue
        results.setdefault((record["kind"], record["layout"], record["history"]), record)
    return list(results.values())


def render_table(records, todo, histories, standings, resources, header):
    """The text table of a sweep and the fastest layout of each kind that agreed with the shipped
    library at every history: (lines, {kind: name})."""
    by_key = {(r["kind"], r["layout"], r["history"]): r for r in records}
    marks = {"shipped": " *", "experimental": " (exp)", "contender": ""}
    lines = [header,
             "Qwen2.5-7B attention: 28 q heads, 4 kv heads, D=128, bf16, chunk 4096, pages of 128, fp32 grad pages; "
             "TFLOP/s (ratio to SDPA); check = |diff| norm / max relative to the shipped library's output",
             f"{'kind':<9}{'layout':<44}{'regs':>5}{'local':>6}" +
             "".join(f"{'h=' + str(h // 1024) + 'K':>18}" for h in histories) + "  check (norm, max) / error"]
    for kind, name in todo:
        usage = resources.get((kind, name)) if kind != "sdpa" else None
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
            if "skipped" in record:
                cells.append(f"{'n/a':>18}")
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
        label = name + marks.get(standings.get((kind, name), ""), "")
        reg_text = f"{usage[0]:>5}{usage[1]:>6}" if usage else f"{'':>5}{'':>6}"
        lines.append(f"{kind:<9}{label:<44}{reg_text}" + "".join(cells) + "  " + "; ".join(notes))
    lines.append("* = shipped; (exp) = experimental; ! = disagrees with the shipped library (not a candidate); "
                 "n/a = does not fit pages of 128; regs/local = registers and local bytes per thread "
                 "(cudaFuncGetAttributes)")
    best = {}
    for kind in ("forward", "backward"):
        candidates = [r for r in records if r["kind"] == kind and r.get("ok") and "tflops" in r]
        names = sorted({r["layout"] for r in candidates})
        complete = [n for n in names if all(by_key.get((kind, n, h), {}).get("ok") for h in histories)]
        if complete:
            score = {n: sum(by_key[(kind, n, h)]["tflops"] for h in histories) for n in complete}
            best[kind] = max(complete, key=score.get)
    return lines, best


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--histories", default="32768,131072")
    parser.add_argument("--forward", default="", help="forward layouts to run (default: all of the sweep)")
    parser.add_argument("--backward", default="", help="backward layouts to run (default: all of the sweep)")
    parser.add_argument("--library", default="", help=f"path of {LIBRARY_NAME} (default: see find_sweep_library)")
    parser.add_argument("--child-out", default="", help=argparse.SUPPRESS)
    parser.add_argument("--todo", default="", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child_out:
        child_main(args)
        return

    started = time.time()
    import torch

    import membar  # noqa: F401

    if not torch.cuda.is_available():
        sys.exit("attention_sweep: needs a CUDA device.")
    if not hasattr(torch.ops.membar, "attention_cuda_layouts"):
        sys.exit("attention_sweep: the loaded membar library was built without CUDA.")
    library = find_sweep_library(args.library)
    if library is None:
        sys.exit(f"attention_sweep: {LIBRARY_NAME} not found; build it with "
                 "`cmake --build <build> --target membar_attention_sweep` or pass --library.")
    torch.ops.load_library(str(library))
    sweep = torch.ops.membar_sweep
    standings, names = {}, {}
    for kind in ("forward", "backward"):
        kind_names, kind_standings = sweep.layouts(kind)
        names[kind] = list(kind_names)
        standings.update({(kind, n): s for n, s in zip(kind_names, kind_standings)})
    if args.forward:
        names["forward"] = args.forward.split(",")
    if args.backward:
        names["backward"] = args.backward.split(",")
    histories = [int(h) for h in args.histories.split(",")]
    todo = [("sdpa", "flash")] + [("forward", n) for n in names["forward"]] + [("backward", n) for n in names["backward"]]
    resources = {(kind, n): tuple(sweep.resources(kind, n)) for kind, n in todo if kind != "sdpa"}

    with tempfile.TemporaryDirectory() as scratch:
        records = run_children(todo, histories, os.path.join(scratch, "records.jsonl"), library)

    # MEMBAR_COMMIT first: on the lent device the tree's .git may be an older copy than its files.
    commit = os.environ.get("MEMBAR_COMMIT", "")
    if not commit:
        try:
            commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                                    cwd=Path(__file__).parent).stdout.strip()
        except OSError:
            commit = ""
    header = (f"attention kernel layouts vs SDPA flash, {torch.cuda.get_device_name()}, commit {commit[:12]}, "
              f"{time.strftime('%Y-%m-%d %H:%M:%S UTC', time.gmtime())}")
    lines, best = render_table(records, todo, histories, standings, resources, header)
    lines.append("fastest correct: " + ", ".join(f"{k} {v}" for k, v in best.items()) +
                 f"; sweep took {time.time() - started:.0f} s")
    text = "\n".join(lines) + "\n"
    print(text)
    results = {
        "benchmark": "attention kernel layouts vs torch SDPA (flash), Qwen2.5-7B attention shape",
        "commit": commit or "unknown",
        "machine": f"{torch.cuda.get_device_name()} ({platform.node()})",
        "torch": torch.__version__,
        "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
        "histories": histories,
        "standings": {f"{kind}:{n}": s for (kind, n), s in standings.items()},
        "fastest_correct": best,
        "resources": {f"{kind}:{n}": list(v) for (kind, n), v in resources.items()},
        "records": records,
    }
    out_dir = Path(os.environ.get("MEMBAR_RESULTS_DIR", Path(__file__).parent / "results" / "latest"))
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "attention_sweep.json").write_text(json.dumps(results, indent=2) + "\n")
    (out_dir / "attention_sweep.txt").write_text(text)


if __name__ == "__main__":
    main()
