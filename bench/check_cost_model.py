"""The dispatcher's cost model (mptp_kernels/ops/cost.py) against both paths measured.

For each Llama-3 TP-8 shape, the real op on a loopback group (one GPU, W simulated ranks) is
timed twice, forced onto each path (MPTP_FORCE_FUSED=1, then MPTP_DISABLE_FUSED=1), eager and
replayed from a CUDA graph, next to the model's estimate of each; the line says which path the
model picks, which one was faster, and what the pick cost against the faster one (regret).

    python bench/check_cost_model.py [--ops ag,rs] [--kinds bf16,fp8_row] [--Ms 8192] [--world-size 8]
                                     [--plans]

--plans also times the fused path with the persistent kernel's launch plan off (whole tiles of
the default config, persistent_matmul.STREAM_K = None): provider fused_whole_tiles.

Rows go to bench/results/cost_model.csv (providers fused / reference, with '@graph'; columns
model_fused_us / model_reference_us for eager and capture, pick).
"""

import argparse
import itertools
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_all_gather_matmul as ag_bench  # noqa: E402
import bench_matmul_reduce_scatter as rs_bench  # noqa: E402
from common import (  # noqa: E402
    LLAMA_TP8_NK,
    append_rows,
    bench_us,
    env_columns,
    with_env,
    with_graphs,
    with_setting,
)
from profile_loopback import PATHS as _PATHS  # noqa: E402

from mptp_kernels.kernels import persistent_matmul as pm  # noqa: E402
from mptp_kernels.ops import cost, dispatch  # noqa: E402
from mptp_kernels.symm import primitives as P  # noqa: E402
from mptp_kernels.symm.loopback import init_loopback_group, mirror_loopback_buffers  # noqa: E402

PATHS = dict(_PATHS)  # path -> the environment that makes the op take it


def _on_path(fn, path):
    """fn run with the path forced (the dispatcher reads MPTP_* at every call, capture included)."""
    return with_env(PATHS[path], fn)


def _whole_tiles(fn):
    """fn with the launch plan off (whole tiles of the default config; the plan's cache keys on
    STREAM_K, so each setting has its own plans)."""

    return with_setting(pm, "STREAM_K", None, fn)


def _case(op, group_name, W, M, N, K, kind):
    """(op call, cost.Work) of one case, as the benches make the call."""
    if op == "ag":
        A, B, kw = ag_bench._inputs(M, N, K, kind)
        shard, shard_kw = ag_bench._shard(A, kw, 0, M // W)
        _, fn = ag_bench.op_call(group_name, shard, B, shard_kw)
        fp8 = kind != "bf16"
        return fn, cost.Work("ag", M, K, N, 1 if fp8 else 2, 2, fp8, ce_copies=kind != "fp8_row")
    A, B = rs_bench._inputs(M, N, K)
    _, fn = rs_bench.op_call(group_name, A, B)
    return fn, cost.Work("rs", M, K, N, 2, 2, False)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--ops", default="ag,rs")
    p.add_argument("--kinds", default="bf16,fp8_row", help="all-gather only; reduce-scatter runs bf16")
    p.add_argument("--Ms", default="8192")
    p.add_argument("--world-size", type=int, default=8)
    p.add_argument("--plans", action="store_true", help="also time the fused path with whole default tiles")
    a = p.parse_args()
    W = a.world_size
    group_name = init_loopback_group(W)
    dev = torch.device("cuda", torch.cuda.current_device())
    envc = env_columns()
    picks = []
    for op, kind, M, (N, K) in itertools.product(a.ops.split(","), a.kinds.split(","), map(int, a.Ms.split(",")),
                                                 LLAMA_TP8_NK):  # fmt: skip
        if op == "rs" and kind != "bf16":
            continue
        fn, work = _case(op, group_name, W, M, N, K, kind)
        _on_path(fn, "fused")()  # creates the workspace at its size
        mirror_loopback_buffers(group_name)
        ws = P.lookup(group_name, dev)
        paths = {path: _on_path(fn, path) for path in PATHS}
        if a.plans:
            paths["fused_whole_tiles"] = _whole_tiles(paths["fused"])
        fns = with_graphs(paths)
        t = {name: bench_us(f) for name, f in fns.items()}
        est = {}
        for capturing, sfx in ((False, ""), (True, "@graph")):
            fu, re = cost.estimate(work, dispatch._link(ws, dev, W, capturing, work.ce_copies), capturing)
            est[sfx] = (fu, re)
        line = f"{op} {kind:8s} W={W} M={M:5d} N={N:5d} K={K:5d}"
        row_extra = {}
        for sfx in ("", "@graph"):
            fu, re = est[sfx]
            pick = "fused" if fu < re else "reference"
            mf, mr = t.get(f"fused{sfx}"), t.get(f"reference{sfx}")
            if mf is None or mr is None:
                line += f" | {sfx or '@eager'}: not timed"
                continue
            best = "fused" if mf < mr else "reference"
            regret = 100 * ((mf if pick == "fused" else mr) / min(mf, mr) - 1)
            picks.append(regret)
            line += (f" | {sfx or '@eager'}: fused {mf:7.1f}us (model {fu:7.1f}) reference {mr:7.1f}us "
                     f"(model {re:7.1f}) pick {pick}{'' if pick == best else ' WRONG'} regret {regret:4.1f}%")  # fmt: skip
            if f"fused_whole_tiles{sfx}" in t:
                line += f" whole tiles {t[f'fused_whole_tiles{sfx}']:7.1f}us"
            row_extra[f"model_fused_us{sfx}"] = round(fu, 1)
            row_extra[f"model_reference_us{sfx}"] = round(re, 1)
            row_extra[f"pick{sfx}"] = pick
        print(line, flush=True)
        case = {"op": op, "world_size": W, "dtype": kind, "M": M, "N": N, "K": K}
        append_rows("cost_model.csv", [{**envc, **case, **row_extra, "provider": name, "median_us": round(us, 2)}
                                       for name, us in t.items()])  # fmt: skip
    if picks:
        print(f"cost model: {sum(r == 0 for r in picks)} of {len(picks)} picks were the faster path; "
              f"worst regret {max(picks):.1f}%")  # fmt: skip


if __name__ == "__main__":
    main()
