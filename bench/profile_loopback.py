"""Host cost of the real ops on a loopback group (W simulated ranks, one GPU), fused and reference.

    python bench/profile_loopback.py [--W 8] [--calls 200] [--N 4096 --K 1792 --M 8192]

Prints host microseconds per call (back to back, GPU left to queue) for each op and path,
then a cProfile (by cumulative and by own time) of each.
"""

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from profile_host import host_us, profile  # noqa: E402

from mptp_kernels.symm.loopback import init_loopback_group  # noqa: E402

# (path, the environment that makes the op take it)
PATHS = (("fused", {"MPTP_FORCE_FUSED": "1", "MPTP_DISABLE_FUSED": "0"}),
         ("reference", {"MPTP_FORCE_FUSED": "0", "MPTP_DISABLE_FUSED": "1"}))  # fmt: skip


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--W", type=int, default=8)
    p.add_argument("--calls", type=int, default=200)
    p.add_argument("--M", type=int, default=8192)
    p.add_argument("--N", type=int, default=4096)
    p.add_argument("--K", type=int, default=1792)
    a = p.parse_args()
    g = init_loopback_group(a.W)
    rows = a.M // a.W
    A = torch.randn(rows, a.K, device="cuda").bfloat16()
    A_rs = torch.randn(a.M, a.K, device="cuda").bfloat16()
    B = (torch.randn(a.K, a.N, device="cuda") * a.K**-0.5).bfloat16()
    fns = {
        "all_gather_matmul": lambda: torch.ops.mptp.fused_all_gather_matmul(A, [B], 0, g),
        "matmul_reduce_scatter": lambda: torch.ops.mptp.fused_matmul_reduce_scatter(A_rs, B, "sum", 0, g),
    }
    print(f"host microseconds per call, W={a.W} loopback, M={a.M} N={a.N} K={a.K}, {a.calls} calls:")
    for path, env in PATHS:
        os.environ.update(env)
        for name, fn in fns.items():
            print(f"  {name:25s} {path:10s} {host_us(fn, a.calls):8.1f}", flush=True)
    for path, env in PATHS:
        os.environ.update(env)
        print(f"\n=== cProfile: all_gather_matmul {path} ===")
        print(profile(fns["all_gather_matmul"], a.calls, top=45, sorts=("cumulative", "tottime")))


if __name__ == "__main__":
    main()
