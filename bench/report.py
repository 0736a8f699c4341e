"""Summarizes bench/results/*.csv as Markdown tables (the README's performance table).

    python bench/report.py [--commit SHA]

Uses the newest date in each CSV (optionally one commit's rows).
"""

import argparse
import csv
import math
import os
from collections import defaultdict

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


def _rows(name, commit=None):
    path = os.path.join(RESULTS, name)
    if not os.path.exists(path):
        return []
    with open(path) as f:
        rows = list(csv.DictReader(f))
    if commit:
        rows = [r for r in rows if r["commit"] == commit]
    if not rows:
        return []
    last = max(r["date"] for r in rows)
    return [r for r in rows if r["date"] == last]


def _geo(xs):
    return math.exp(sum(math.log(x) for x in xs) / len(xs)) if xs else float("nan")


def persistent(commit):
    rows = _rows("persistent_matmul.csv", commit)
    by = defaultdict(dict)
    for r in rows:
        by[(r["dtype"], r["scale"], r["M"], r["N"], r["K"])][r["provider"]] = float(r["median_us"])
    ratios = defaultdict(list)
    for (dt, sc, *_), t in by.items():
        for kind in ("", "@graph"):
            if f"cublas{kind}" in t and f"mptp{kind}" in t:
                ratios[(dt, sc, kind)].append(t[f"cublas{kind}"] / t[f"mptp{kind}"])
    if not ratios:
        return ""
    out = ["| dtype | scales | shapes | cuBLAS time / ours, eager | same, CUDA graphs |", "|---|---|---|---|---|"]
    for dt, sc in sorted({(d, s) for d, s, _ in ratios}):
        eager, graph = ratios.get((dt, sc, ""), []), ratios.get((dt, sc, "@graph"), [])
        g = f"{_geo(graph):.3f}" if graph else "n/a"
        out.append(f"| {dt} | {sc} | {len(eager)} | {_geo(eager):.3f} | {g} |")
    return "\n".join(out)


def fused(name, commit):
    rows = _rows(name, commit)
    by = defaultdict(dict)
    for r in rows:
        by[(r["mode"], r["world_size"], r["dtype"], int(r["M"]), int(r["N"]), int(r["K"]))][r["provider"]] = float(r["median_us"])
    if not by:
        return ""
    out = ["| mode | W | dtype | M | N | K | mptp us | unfused us | speedup | vs max(matmul, comm) | speedup, CUDA graphs |",
           "|---|---|---|---|---|---|---|---|---|---|---|"]
    for key, t in sorted(by.items()):
        unfused = t.get("copy_cublas", t.get("nccl_cublas"))
        bound = max(t.get("matmul_only", 0), t.get("comm_only", 0))
        g_unfused = t.get("copy_cublas@graph", t.get("nccl_cublas@graph"))
        g = f"{g_unfused / t['mptp@graph']:.2f}x" if g_unfused and "mptp@graph" in t else "n/a"
        out.append(f"| {' | '.join(map(str, key))} | {t['mptp']:.1f} | {unfused:.1f} | {unfused / t['mptp']:.2f}x | "
                   f"{100 * (t['mptp'] / bound - 1):+.1f}% | {g} |")
    return "\n".join(out)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--commit", default=None)
    a = p.parse_args()
    for title, text in [("persistent matmul", persistent(a.commit)),
                        ("all-gather-matmul", fused("all_gather_matmul.csv", a.commit)),
                        ("matmul-reduce-scatter", fused("matmul_reduce_scatter.csv", a.commit))]:
        if text:
            print(f"### {title}\n\n{text}\n")


if __name__ == "__main__":
    main()
