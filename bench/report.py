"""The README's performance tables and one plot per benchmark, from the CSVs of record.

    python bench/report.py                    # print the Markdown tables, write the PNGs
    python bench/report.py --readme README.md # also replace the README's generated block
    python bench/report.py --commit 27bb80f   # one run's rows instead of each CSV's newest run
    python bench/report.py --no-plots         # tables only

Rows of record: in each bench/results/<bench>.csv, the rows of the run appended
last (its commit), unless --commit picks one. Every table names that commit,
the machine (GPU, torch, Triton) and the date; the fused-op tables say for each
row which path the op takes by default: the CSV's `path` column where the bench
recorded it (mptp_kernels.path_counts()), else "unknown". Plots (<bench>.png beside the CSV) need matplotlib; without
it the tables are still printed.
"""

import argparse
import csv
import functools
import math
import os
import sys
from collections import defaultdict

HERE = os.path.dirname(os.path.abspath(__file__))
RESULTS = os.path.join(HERE, "results")
BEGIN = "<!-- bench/report.py: begin (generated; edit bench/report.py, not this block) -->"
END = "<!-- bench/report.py: end -->"
# The design's bar for the persistent matmul (DESIGN.md, performance targets).
FLOOR = 0.90


def load(name, commit=None):
    """(rows of record, their commit) of results/<name>: the last run appended, or `commit`'s."""
    path = os.path.join(RESULTS, name)
    if not os.path.exists(path):
        return [], None
    with open(path) as f:
        rows = list(csv.DictReader(f))
    if not rows:
        return [], None
    commit = commit or rows[-1]["commit"]
    return [r for r in rows if r["commit"] == commit], commit


def machine(rows):
    """'NVIDIA H200, torch 2.11.0+cu130, Triton 3.6.0, 2026-12-02' (every distinct value, if mixed)."""

    def one(key):
        return "/".join(sorted({r[key] for r in rows}))

    return f"{one('gpu')}, torch {one('torch')}, Triton {one('triton')}, {one('date')}"


def geomean(xs):
    return math.exp(sum(math.log(x) for x in xs) / len(xs)) if xs else float("nan")


# -- persistent matmul ---------------------------------------------------------------------------


def persistent_ratios(rows):
    """{(dtype, scale): [(M, N, K, eager ratio, graph ratio or None)]}: cuBLAS time / ours."""
    by = defaultdict(dict)
    for r in rows:
        by[(r["dtype"], r["scale"], int(r["M"]), int(r["N"]), int(r["K"]))][r["provider"]] = float(
            r["median_us"]
        )
    out = defaultdict(list)
    for (dt, sc, M, N, K), t in sorted(by.items()):
        if "cublas" not in t or "mptp" not in t:
            continue
        g = (
            t["cublas@graph"] / t["mptp@graph"]
            if "cublas@graph" in t and "mptp@graph" in t
            else None
        )
        out[(dt, sc)].append((M, N, K, t["cublas"] / t["mptp"], g))
    return out


def persistent_table(rows, commit):
    ratios = persistent_ratios(rows)
    if not ratios:
        return ""

    def worst(xs, i):
        M, N, K, *r = min(xs, key=lambda x: x[i])
        return f"{r[i - 3]:.3f} (M={M} N={N} K={K})"

    out = [
        f"Run {commit} on {machine(rows)}. cuBLAS time / ours per shape (> 1: ours faster); "
        f"geomean over the shapes, the worst shape, and how many shapes fall below the "
        f"design's floor of {FLOOR:.2f}x.",
        "",
        "| dtype | scales | shapes | geomean, eager | geomean, CUDA graphs | worst, eager | "
        f"worst, CUDA graphs | below {FLOOR:.2f}x (eager / graphs) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for (dt, sc), xs in sorted(ratios.items()):
        graphs = [x for x in xs if x[4] is not None]
        g_geo = f"{geomean([x[4] for x in graphs]):.3f}" if graphs else "n/a"
        g_worst = worst(graphs, 4) if graphs else "n/a"
        below = f"{sum(x[3] < FLOOR for x in xs)} / " + (
            f"{sum(x[4] < FLOOR for x in graphs)}" if graphs else "n/a"
        )
        out.append(f"| {dt} | {sc} | {len(xs)} | {geomean([x[3] for x in xs]):.3f} | {g_geo} | "
                   f"{worst(xs, 3)} | {g_worst} | {below} |")  # fmt: skip
    return "\n".join(out)


def persistent_plot(rows, commit, path, plt):
    ratios = persistent_ratios(rows)
    if not ratios:
        return None
    fig, axes = plt.subplots(len(ratios), 1, figsize=(13, 3.2 * len(ratios)), squeeze=False)
    for ax, ((dt, sc), xs) in zip(axes[:, 0], sorted(ratios.items())):
        xs = sorted(xs)
        x = range(len(xs))
        ax.bar([i - 0.2 for i in x], [r[3] for r in xs], 0.4, label="eager")
        ax.bar([i + 0.2 for i in x], [r[4] or 0 for r in xs], 0.4, label="CUDA graphs")
        ax.axhline(1.0, color="k", lw=0.8)
        ax.axhline(FLOOR, color="r", lw=0.8, ls="--", label=f"floor {FLOOR:.2f}x")
        ax.set_xticks(list(x), [f"{M}\n{N}x{K}" for M, N, K, *_ in xs], fontsize=7)
        ax.set_ylabel("cuBLAS / ours")
        ax.set_ylim(0, 1.15)
        ax.set_title(f"{dt}, scales: {sc}", fontsize=10)
        ax.legend(fontsize=7, loc="lower right", ncol=3)
    axes[-1, 0].set_xlabel("M, then N x K")
    fig.suptitle(f"persistent matmul vs cuBLAS: run {commit}, {machine(rows)}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


# -- fused ops (all-gather-matmul, matmul-reduce-scatter) -----------------------------------------


def fused_cases(rows):
    """[(case key, {provider: us}, default path, whether the path was recorded)], sorted."""
    by, paths = defaultdict(dict), {}
    for r in rows:
        key = (r["mode"], int(r["world_size"]), r["dtype"], int(r["M"]), int(r["N"]), int(r["K"]))
        by[key][r["provider"]] = float(r["median_us"])
        if r.get("path") and r["provider"] == "mptp":
            paths[key] = r["path"]
    out = []
    for key, t in sorted(by.items(), key=lambda kv: (kv[0][2], kv[0][3], -kv[0][4] * kv[0][5])):
        # NOTE: a row without a recorded path predates the cost model: its default path is unknown.
        out.append((key, t, paths.get(key, "unknown"), key in paths))
    return out


def _speedups(t, sfx):
    unfused = t.get(f"copy_cublas{sfx}", t.get(f"nccl_cublas{sfx}"))
    mptp = t.get(f"mptp{sfx}")
    bound = max(t.get(f"matmul_only{sfx}", 0), t.get(f"comm_only{sfx}", 0))
    if unfused is None or mptp is None:
        return None, None, None
    return mptp, unfused / mptp, (100 * (mptp / bound - 1) if bound else None)


def fused_table(rows, commit, pipeline):
    """pipeline: what the loopback bench assembled by hand, for CSVs without a path column."""
    cases = fused_cases(rows)
    if not cases:
        return ""
    n_ref = sum(c[2] == "reference" for c in cases)
    # Rows before the `timed` column came from the hand-assembled pipeline.
    timed = {r.get("timed") or "pipeline" for r in rows if r["provider"] == "mptp"}
    if timed == {"op"}:
        what = "`mptp` times `torch.ops.mptp.*` end to end."
    else:
        what = (f"`mptp` times the fused pipeline assembled by hand ({pipeline}), not the op: it "
                "leaves out validation, dispatch, the copy into the symmetric buffer, the signals and "
                "the layout step.")  # fmt: skip
        if "op" in timed:
            what += " (Rows with a recorded path time the op.)"
    if all(c[3] for c in cases):
        what += " The path column is what the op took (`mptp_kernels.path_counts()`)."
    else:
        what += " Rows without a recorded path show it as unknown."
    out = [
        f"Run {commit} on {machine(rows)}. {what} {n_ref} of {len(cases)} rows run the reference "
        "path by default (MPTP_FORCE_FUSED=1 fuses them).",
        "",
        "| mode | W | dtype | M | N | K | GFLOP | default path | mptp us | unfused us | speedup | "
        "vs max(matmul, comm) | mptp us, CUDA graphs | speedup, CUDA graphs |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for (mode, W, dt, M, N, K), t, path, _rec in cases:
        mptp, sp, vs = _speedups(t, "")
        g_mptp, g_sp, _ = _speedups(t, "@graph")
        unfused = t.get("copy_cublas", t.get("nccl_cublas"))
        shown = path
        out.append(
            f"| {mode} | {W} | {dt} | {M} | {N} | {K} | {2 * M * N * K / 1e9:.0f} | {shown} | "
            f"{mptp:.1f} | {unfused:.1f} | {sp:.2f}x | "
            + (f"{vs:+.1f}%" if vs is not None else "n/a")
            + (f" | {g_mptp:.1f} | {g_sp:.2f}x |" if g_sp else " | n/a | n/a |")
        )
    return "\n".join(out)


def fused_plot(rows, commit, path, plt, title):
    cases = fused_cases(rows)
    if not cases:
        return None
    fig, (a1, a2) = plt.subplots(2, 1, figsize=(13, 7), sharex=True)
    x = list(range(len(cases)))
    for sfx, dx, label in (("", -0.2, "eager"), ("@graph", 0.2, "CUDA graphs")):
        sp = [_speedups(t, sfx)[1] or 0 for _, t, _, _ in cases]
        vs = [_speedups(t, sfx)[2] or 0 for _, t, _, _ in cases]
        a1.bar([i + dx for i in x], sp, 0.4, label=label)
        a2.bar([i + dx for i in x], vs, 0.4, label=label)
    for i, (_, _, p, _) in enumerate(cases):
        if p != "fused":  # shade the rows a user's call would not fuse by default
            for ax in (a1, a2):
                ax.axvspan(i - 0.5, i + 0.5, color="0.85", zorder=0, lw=0)
    a1.axhline(1.0, color="k", lw=0.8)
    a1.set_ylabel("unfused time / mptp")
    a2.axhline(3.0, color="r", lw=0.8, ls="--", label="target +3%")
    a2.axhline(0.0, color="k", lw=0.8)
    a2.set_ylabel("mptp vs max(matmul, comm), %")
    a2.set_xticks(x, [f"{dt}\n{M}x{N}x{K}" for (_, _, dt, M, N, K), *_ in cases], fontsize=7)
    how = "recorded" if all(c[3] for c in cases) else "recorded where known"
    a2.set_xlabel(f"dtype, M x N x K (grey: the op runs the reference path by default, {how})")
    a1.legend(fontsize=7)
    a2.legend(fontsize=7)
    mode, W = cases[0][0][0], cases[0][0][1]
    op = {r.get("timed") for r in rows if r["provider"] == "mptp"} == {"op"}
    timed = "torch.ops.mptp" if op else "hand-assembled pipeline, not the op"
    fig.suptitle(f"{title} ({timed}), {mode} W={W}: run {commit}, {machine(rows)}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


# -- main ----------------------------------------------------------------------------------------

BENCHES = [
    # (title, CSV, table(rows, commit), plot(rows, commit, png, plt))
    ("persistent matmul", "persistent_matmul.csv", persistent_table, persistent_plot),
    ("all-gather-matmul", "all_gather_matmul.csv",
     functools.partial(fused_table, pipeline="copy-engine pulls feeding the consumer kernel"),
     functools.partial(fused_plot, title="all-gather-matmul")),
    ("matmul-reduce-scatter", "matmul_reduce_scatter.csv",
     functools.partial(fused_table, pipeline="the producer kernel's scatter-stores, then the reduction"),
     functools.partial(fused_plot, title="matmul-reduce-scatter")),
]  # fmt: skip


def _pyplot():
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        return plt
    except ImportError:
        print("matplotlib not installed: no plots (pip install matplotlib)", file=sys.stderr)
        return None


def report(commit=None, plots=True):
    """The Markdown of every table; writes results/<bench>.png where plots and matplotlib allow."""
    plt = _pyplot() if plots else None
    parts = []
    for title, name, table, plot in BENCHES:
        rows, run = load(name, commit)
        if not rows:
            continue
        png = os.path.join(RESULTS, name.replace(".csv", ".png"))
        if plt is not None and plot(rows, run, png, plt):
            print(f"wrote {os.path.relpath(png)}", file=sys.stderr)
        rel = os.path.relpath(png, os.path.join(HERE, ".."))
        fig = f"\n\n![{title}]({rel})" if os.path.exists(png) else ""
        parts.append(f"#### {title}\n\n{table(rows, run)}{fig}\n")
    return "\n".join(parts)


def replace_block(readme, text):
    with open(readme) as f:
        doc = f.read()
    if BEGIN not in doc or END not in doc:
        sys.exit(f"{readme}: no generated block ({BEGIN!r} ... {END!r})")
    head, rest = doc.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    with open(readme, "w") as f:
        f.write(f"{head}{BEGIN}\n\n{text}\n{END}{tail}")


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--commit", default=None, help="one run's rows (default: each CSV's last run)")
    p.add_argument("--readme", default=None, help="replace this file's generated block")
    p.add_argument("--no-plots", action="store_true")
    a = p.parse_args()
    text = report(a.commit, plots=not a.no_plots)
    print(text)
    if a.readme:
        replace_block(a.readme, text)


if __name__ == "__main__":
    main()
