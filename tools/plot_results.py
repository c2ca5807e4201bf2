#!/usr/bin/env python3
"""Plots for the README from committed benchmark results (bench/results/**.json) into docs/img/.

    .venv/bin/python tools/plot_results.py [attention head_sizes runtime logra oomb store_paths device_order sparse_1m]

Each plot is drawn only when its results exist; the newest file of each kind that the plot can draw
wins. Names draw only those plots.
"""
from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "bench" / "results"
IMG = REPO / "docs" / "img"


def _natural(text: str) -> list:
    # "session9" before "session17": digit runs compare as numbers.
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", text)]


def candidates(pattern: str) -> list[Path]:
    """The results matching `pattern`, newest first. Session folders (and files directly in
    bench/results) are named by date first, then machine and session; inside one, calls by number.
    Variant sweeps are not benchmark results of the defaults."""
    files = [p for p in RESULTS.rglob(pattern) if "sweep" not in p.name]
    files.sort(key=lambda p: [_natural(part) for part in p.relative_to(RESULTS).parts], reverse=True)
    return files


def newest(pattern: str) -> Path | None:
    files = candidates(pattern)
    return files[0] if files else None


def _save(fig, name: str) -> Path:
    """Lays out, writes docs/img/NAME and closes the figure."""
    fig.tight_layout()
    out = IMG / name
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def plot_runtime(path: Path) -> Path:
    data = json.loads(path.read_text())
    rows = data["bandwidth"]
    names = [r["name"].replace("/", "\n", 1) for r in rows]
    fig, ax = plt.subplots(figsize=(11, 4))
    ax.bar(range(len(rows)), [r["backend_gbps"] for r in rows], label="membar backend", color="#3465a4")
    ax.plot(range(len(rows)), [r["raw_gbps"] for r in rows], "k_", markersize=18, mew=2,
            label="raw cudaMemcpyAsync (same run)")
    ax.set_xticks(range(len(rows)), names, fontsize=6, rotation=90)
    ax.set_ylabel("GB/s")
    ax.set_title(f"Page transfers through membard's CUDA backend vs raw copies, {data['machine']['gpu']}")
    ax.legend(loc="upper left")
    return _save(fig, "runtime_bandwidth.png")


def plot_attention(path: Path) -> Path:
    data = json.loads(path.read_text())
    dense = data["dense"]
    hist = [d["history"] // 1024 for d in dense]
    fig, ax = plt.subplots(figsize=(10, 4))
    fwd = [d.get("forward_default_tflops", d["membar_forward_tflops"]) for d in dense]
    chosen = data.get("layouts", {}).get("forward", "")
    ax.plot(hist, fwd, "o-", label=f"membar forward ({chosen})" if chosen else "membar forward", color="#3465a4")
    # Forward layouts the bench timed by name (--try-dense-layouts), and the dense path's cuDNN forward.
    tried = [name for name in dense[0].get("tried_dense_forward", {}) if all(name in d.get("tried_dense_forward", {}) for d in dense)]
    for index, name in enumerate(tried):
        ax.plot(hist, [d["tried_dense_forward"][name]["tflops"] for d in dense], "o-", label=f"membar forward ({name})",
                color=["#4e9a06", "#75507b", "#204a87"][index % 3])
    if all("cudnn_dense_forward" in d for d in dense):
        ax.plot(hist, [d["cudnn_dense_forward"]["tflops"] for d in dense], "^:", label="cuDNN forward (dense path)",
                color="#f57900")
    ax.plot(hist, [d["sdpa_forward_tflops"] for d in dense], "o--", label="SDPA flash forward", color="#729fcf")
    ax.plot(hist, [d["membar_backward_tflops"] for d in dense], "s-", label="membar backward", color="#cc0000")
    ax.plot(hist, [d["sdpa_backward_tflops"] for d in dense], "s--", label="SDPA flash backward", color="#ef2929")
    if all("split_backward_tflops" in d for d in dense):   # the mma.sync backward Hopper ran before session 25
        ax.plot(hist, [d["split_backward_tflops"] for d in dense], "s:", label="membar mma.sync backward (before)",
                color="#888a85")
    ax.set_xlabel("history (K tokens), chunk of 4096 queries")
    ax.set_ylabel("TFLOP/s")
    ax.set_ylim(0, None)
    machine = str(data.get("machine", "H200")).replace(" (vm)", "")
    ax.set_title(f"Paged attention, Qwen2.5-7B shape (28/4 heads, D=128), {machine}", fontsize=9)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.02, 1.0))
    return _save(fig, "attention_tflops.png")


def plot_head_sizes(path: Path) -> Path | None:
    """Forward and backward TFLOP/s per head size beside SDPA flash (the bench's head-size table,
    bf16 rows), with the backward layout the bench tried beside the chosen one where it did."""
    data = json.loads(path.read_text())
    rows = [r for r in data.get("head_dims", []) if r.get("dtype") == "bfloat16"]
    # A run that timed only some head sizes (a follow-up call) gives way to the last whole table.
    if {r["head_dim"] for r in rows} < {64, 96, 128, 256}:
        return None
    labels = [str(r["head_dim"]) for r in rows]
    # Head size 128 is the main table's shape: its mma.sync (split) backward is timed there.
    split = {d["history"]: d.get("split_backward_tflops", 0.0) for d in data.get("dense", [])}

    def before(row):
        tried = row.get("tried_backward_tflops") or {}
        return next(iter(tried.values())) if tried else (split.get(row["history"], 0.0) if row["head_dim"] == 128 else 0.0)

    series = [("membar forward", [r["membar_forward_tflops"] for r in rows], "#3465a4"),
              ("SDPA flash forward", [r["sdpa_forward_tflops"] for r in rows], "#729fcf"),
              ("membar backward", [r["membar_backward_tflops"] for r in rows], "#cc0000"),
              ("SDPA flash backward", [r["sdpa_backward_tflops"] for r in rows], "#ef2929"),
              ("membar mma.sync backward (before)", [before(r) for r in rows], "#888a85")]
    fig, ax = plt.subplots(figsize=(8, 4))
    width = 0.8 / len(series)
    for index, (label, values, color) in enumerate(series):
        ax.bar([i + (index - (len(series) - 1) / 2) * width for i in range(len(rows))], values, width,
               label=label, color=color)
    ax.set_xticks(range(len(rows)), labels)
    ax.set_xlabel(f"head size (bf16, {rows[0]['history'] // 1024}K history, chunk of {rows[0]['chunk']} queries)")
    ax.set_ylabel("TFLOP/s")
    ax.set_title("Paged attention by head size, H200")
    ax.set_ylim(0, 1.4 * max(max(values) for _, values, _ in series))
    ax.legend(fontsize=8, ncol=2, loc="upper left")
    return _save(fig, "attention_head_sizes.png")


def plot_logra(path: Path) -> Path | None:
    data = json.loads(path.read_text())
    rows = data if isinstance(data, list) else data.get("results", [])
    rows = [r for r in rows if r.get("peak_gib") is not None]
    if not rows:
        return None
    models = sorted({r["model"] for r in rows})
    fig, axes = plt.subplots(1, len(models), figsize=(6 * len(models), 4), squeeze=False)
    for ax, model in zip(axes[0], models):
        mine = [r for r in rows if r["model"] == model]
        ax.barh([r["variant"] for r in mine], [r["peak_gib"] for r in mine],
                color=["#3465a4" if r["variant"].startswith("logra") else "#babdb6" for r in mine])
        ax.set_xlabel("peak GPU memory (GiB)")
        ax.set_title(f"one update, {model} shape, batch 4 x 2048")
    return _save(fig, "logra_memory.png")


def plot_oomb(path: Path) -> Path | None:
    data = json.loads(path.read_text())
    rows = [r for r in data.get("results", []) if r.get("peak_gpu_gib") is not None]
    # The plot compares chunk-recurrent training with full-sequence training: a run without the
    # full-sequence baseline (most device steps time variants against each other) gives way.
    if not any(r["variant"] == "full" for r in rows):
        return None
    fig, (ax_mem, ax_time) = plt.subplots(1, 2, figsize=(12, 4.5))
    for variant in sorted({r["variant"] for r in rows}):
        mine = sorted((r for r in rows if r["variant"] == variant), key=lambda r: r["tokens"])
        whole = [r for r in mine if not r.get("partial_step")]
        partial = [r for r in mine if r.get("partial_step")]
        x = [r["tokens"] // 1024 for r in mine]
        (line,) = ax_mem.plot(x, [r["peak_gpu_gib"] for r in mine], "o-", label=variant)
        if whole:
            ax_time.plot([r["tokens"] // 1024 for r in whole], [r["step_seconds"] for r in whole], "o-",
                         color=line.get_color(), label=variant)
        # A partial step (Note [Partial steps]): all of stage 1 and the longest stage-2 chunks ran;
        # the point is the estimate of the whole step, the bar reaches its upper bound.
        for r in partial:
            estimate = r["estimated_step_seconds"]
            ax_time.errorbar([r["tokens"] // 1024], [estimate], yerr=[[0], [r["step_seconds_upper_bound"] - estimate]],
                             fmt="o", mfc="none", color=line.get_color(), capsize=3,
                             label=f"{variant} (partial step: estimate, upper bound)")
    contexts = sorted({r["tokens"] // 1024 for r in rows})
    for ax in (ax_mem, ax_time):
        ax.set_xscale("log", base=2)
        ax.set_xticks(contexts, [f"{c // 1024}M" if c >= 1024 else f"{c}K" for c in contexts])
        ax.set_xlabel("context (tokens)")
        ax.legend(fontsize=7, loc="upper left")
    ax_time.set_yscale("log")
    ax_mem.set_ylabel("peak GPU memory (GiB)")
    ax_time.set_ylabel("seconds per step (fwd + bwd)")
    fig.suptitle(f"Chunk-recurrent training vs full-sequence, {data.get('model')} shape, H200")
    return _save(fig, "oomb_memory_time.png")


def _cli_rate(log: Path) -> float | None:
    """Mean tokens/s of steps 2.. of one `membar-train --json` log (tools/cli_summary.py's rule)."""
    lines = [line for line in log.read_text().splitlines() if line.startswith("{")]
    steps = json.loads(lines[-1])["steps"][1:] if lines else []
    return sum(s["tokens_per_second"] for s in steps) / len(steps) if steps else None


def plot_store_paths(folder: Path) -> Path | None:
    """membar-train embedded vs through membard (tools/h200_session.sh cli), dense and --offload;
    beside it the 128K offload step of both from the same session, when there."""
    rates = {log.stem: _cli_rate(log) for log in folder.glob("*.log")}
    bars = [(name, rates.get(name)) for name in ("embedded-dense", "membard-dense", "embedded-offload", "membard-offload")]
    bars = [(name, rate) for name, rate in bars if rate]
    if not bars:
        return None
    long = {}
    for store, pattern in (("embedded", "oomb_bench_embedded_128k-*.json"), ("membard", "oomb_bench_daemon_128k-*.json")):
        files = sorted(folder.parent.glob(pattern))
        rows = json.loads(files[-1].read_text())["results"] if files else []
        long.update({store: r["step_seconds"] for r in rows if r.get("step_seconds")})
    fig, axes = plt.subplots(1, 2 if long else 1, figsize=(11 if long else 6, 4), squeeze=False)
    colors = ["#729fcf" if name.startswith("embedded") else "#3465a4" for name, _ in bars]
    ax = axes[0][0]
    ax.bar(range(len(bars)), [rate for _, rate in bars], color=colors)
    ax.set_xticks(range(len(bars)), [name.replace("-", "\n") for name, _ in bars])
    for i, (_, rate) in enumerate(bars):
        ax.text(i, rate, f"{rate:,.0f}", ha="center", va="bottom", fontsize=8)
    ax.set_ylabel("tokens/s (membar-train, steps 2-3)")
    ax.set_title("7B shape, 32K tokens: embedded runtime vs membard")
    if long:
        ax = axes[0][1]
        names = [name for name in ("embedded", "membard") if name in long]
        ax.bar(range(len(names)), [long[name] for name in names], color=["#729fcf", "#3465a4"][: len(names)])
        ax.set_xticks(range(len(names)), names)
        for i, name in enumerate(names):
            ax.text(i, long[name], f"{long[name]:.1f} s", ha="center", va="bottom", fontsize=8)
        ax.set_ylabel("seconds per step (fwd + bwd)")
        ax.set_title("7B shape, 128K tokens, pages offloaded")
    fig.suptitle("Pages in membar's runtime on an H200: in-process or through the daemon")
    return _save(fig, "runtime_paths.png")


def plot_device_order(order_json: Path) -> Path | None:
    """Embedded offload against plain tensors before and after Note [Device-ordered copies], from one
    session's h200_session steps (any of its calls): `gap` (host order was the default), `order` (device order, and
    "+hostorder" beside it), `order256`. Each ratio is against plain tensors of the same run."""
    session = order_json.parents[2]   # bench/results/<date>-<machine>-<session>/<call>/order/
    ratios: dict[str, dict[int, float]] = {"copies ordered on the host (trainer waits on the host)": {},
                                           "copies ordered on the GPU (Note [Device-ordered copies])": {}}
    host, device = list(ratios)
    for step, default_order in (("gap", host), ("order", device), ("order256", device)):
        path = next(iter(sorted(session.rglob(f"{step}/oomb_bench.json"))), None)
        if path is None:
            continue
        rows = [r for r in json.loads(path.read_text())["results"] if r.get("step_seconds")]
        plain = {r["tokens"]: r["step_seconds"] for r in rows if r["variant"] == "dense+plain"}
        for r in rows:
            if r["tokens"] not in plain:
                continue
            order = {"dense-offload": default_order, "dense-offload+hostorder": host}.get(r["variant"])
            if order is not None:
                ratios[order][r["tokens"]] = plain[r["tokens"]] / r["step_seconds"]
    contexts = sorted({t for by_context in ratios.values() for t in by_context})
    if not ratios[device]:
        return None
    fig, ax = plt.subplots(figsize=(8, 4))
    width = 0.38
    for k, (name, by_context) in enumerate(ratios.items()):
        xs = [i + (k - 0.5) * width for i, t in enumerate(contexts) if t in by_context]
        ys = [by_context[t] for t in contexts if t in by_context]
        ax.bar(xs, ys, width, label=name, color=["#729fcf", "#3465a4"][k])
        for x, y in zip(xs, ys):
            ax.text(x, y, f"{y:.3f}", ha="center", va="bottom", fontsize=8)
    ax.axhline(0.98, color="k", linestyle=":", linewidth=1, label="goal 0.98x")
    ax.set_xticks(range(len(contexts)), [f"{t // 1024}K" for t in contexts])
    ax.set_ylim(0.7, 1.05)
    ax.set_xlabel("context (tokens), 7B shape, pages offloaded to host memory")
    ax.set_ylabel("throughput vs pages in plain GPU tensors")
    ax.set_title("Embedded runtime with offload on an H200 (same-run ratios)")
    ax.legend(fontsize=7, loc="lower left")
    return _save(fig, "device_order.png")


def _progress(log: Path) -> list[tuple[float, int]]:
    """(seconds, chunks done over both stages) from a step's progress lines ("[oomb] stage 2: 38 of
    256 chunks after 137 s"), the warm-up sequence's lines (2 chunks) left out."""
    import re

    points, total = [], None
    for line in log.read_text(errors="replace").splitlines():
        match = re.match(r"\[oomb\] stage ([12]): (\d+) of (\d+) chunks after (\d+) s", line)
        if not match:
            continue
        stage, done, count, seconds = (int(g) for g in match.groups())
        if count <= 2:   # the warm-up sequence
            continue
        total = count
        points.append((float(seconds), done + (count if stage == 2 else 0)))
    return [(0.0, 0)] + points if total else []


def plot_sparse_1m(newest_log: Path) -> Path | None:
    """The whole 1M sparse step through membard, session by session: seconds per chunk along the
    step (stage 1's chunks, then stage 2's), from the trainer's progress lines."""
    runs = []
    for log in sorted(RESULTS.rglob("bench.log")):
        if "sparse1m" not in str(log.relative_to(RESULTS)):
            continue
        points = _progress(log)
        if len(points) < 3:
            continue
        session = log.relative_to(RESULTS).parts[0].split("-")[-1].replace("session", "session ")
        row = next(iter(json.loads(p.read_text())["results"] for p in [log.parent / "oomb_bench.json"]
                        if p.exists()), [{}])[0]
        how = "selections in one call" if row.get("selections_in_one_call") else "selections block by block"
        runs.append((session, how, points))
    if not runs:
        return None
    fig, ax = plt.subplots(figsize=(8, 4))
    for session, how, points in runs:
        xs, ys = [], []
        for (t0, c0), (t1, c1) in zip(points, points[1:]):
            if c1 > c0:
                xs += [c0, c1]
                ys += [(t1 - t0) / (c1 - c0)] * 2
        ax.plot(xs, ys, label=f"{session}: {how}, last chunk after {points[-1][0]:.0f} s")
    half = max(c for _, _, points in runs for _, c in points) // 2
    ax.axvline(half, color="k", linestyle=":", linewidth=1)
    low, high = ax.get_ylim()
    ax.text(half, low + 0.03 * (high - low), " stage 2 (longest history first)", fontsize=8, va="bottom")
    ax.text(half, low + 0.03 * (high - low), "stage 1 ", fontsize=8, va="bottom", ha="right")
    ax.set_xlabel("chunks of 4096 tokens done (stage 1, then stage 2)")
    ax.set_ylabel("seconds per chunk")
    ax.set_title("One whole sparse step at 1M tokens through membard (7B shape, top-64, H200)")
    ax.legend(fontsize=8, loc="upper right")
    return _save(fig, "sparse_1m.png")


def main() -> int:
    IMG.mkdir(parents=True, exist_ok=True)
    made = []
    # Names on the command line (e.g. "attention head_sizes") draw only those plots.
    wanted = set(sys.argv[1:])
    for pattern, plot in (("runtime_bench.json", plot_runtime), ("*attention*.json", plot_attention),
                          ("*attention*.json", plot_head_sizes),
                          ("logra_bench.json", plot_logra),
                          ("oomb_bench.json", plot_oomb), ("cli-*", plot_store_paths),
                          ("order/oomb_bench.json", plot_device_order), ("bench.log", plot_sparse_1m)):
        if wanted and plot.__name__.removeprefix("plot_") not in wanted:
            continue
        # The newest result a plot can draw: one without its rows (a plot returns None) gives way
        # to the one before (e.g. an attention run without the head-size table).
        for path in candidates(pattern):
            try:
                out = plot(path)
            except (KeyError, TypeError, ValueError) as error:
                print(f"skipped {path}: {type(error).__name__}: {error}", file=sys.stderr)
                break
            if out:
                made.append(out)
                print(f"{path.relative_to(REPO)} -> {out.relative_to(REPO)}")
                break
    return 0 if made else 1


if __name__ == "__main__":
    sys.exit(main())
