"""Shared benchmark utilities: timing, environment columns, CSV rows."""

import csv
import datetime
import math
import os
import subprocess

import torch

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")

# Per-rank TP-8 (N, K) of Llama-3: 70B then 8B.
LLAMA_TP8_NK = [(7168, 8192), (8192, 3584), (1280, 8192), (3584, 4096), (4096, 1792), (768, 4096)]


def env_columns() -> dict:
    import triton

    try:
        commit = subprocess.check_output(["git", "rev-parse", "--short", "HEAD"], text=True,
                                         stderr=subprocess.DEVNULL).strip()  # fmt: skip
    except Exception:  # noqa: BLE001
        commit = "unknown"
    return {
        "date": datetime.date.today().isoformat(),
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        "torch": torch.__version__,
        "triton": triton.__version__,
        "commit": commit,
    }


def bench_us(fn, warmup_ms=25, rep_ms=100) -> float:
    """Median time of fn in microseconds (triton.testing.do_bench, CUDA events)."""
    import triton.testing

    return triton.testing.do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="median") * 1e3


def append_rows(name: str, rows: list) -> str:
    path = os.path.join(RESULTS, name)
    os.makedirs(RESULTS, exist_ok=True)
    new = not os.path.exists(path)
    with open(path, "a", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0].keys()))
        if new:
            w.writeheader()
        w.writerows(rows)
    return path


def geomean(xs) -> float:
    xs = [x for x in xs if x > 0]
    return math.exp(sum(math.log(x) for x in xs) / len(xs)) if xs else float("nan")
