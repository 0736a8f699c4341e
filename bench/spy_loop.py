"""One op on one path in a loop, for a sampling profiler (py-spy) to see where host time goes.

    py-spy record -r 1000 -f raw -o ag.txt -- python bench/spy_loop.py --op ag --path fused

The real op on a loopback group (W simulated ranks on one GPU, M = 8192 N = 4096 K = 1792), in
bursts of a few calls from an idle GPU (see profile_host.host_us), for --seconds seconds. Prints
the host microseconds per call (without the profiler's overhead only when run alone).
"""

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from profile_host import BURST  # noqa: E402
from profile_loopback import PATHS  # noqa: E402

import mptp_kernels  # noqa: E402,F401
from mptp_kernels.symm.loopback import init_loopback_group, mirror_loopback_buffers  # noqa: E402


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--op", choices=("ag", "ag8", "rs", "mm"), default="ag",
                   help="mm: persistent_matmul alone (bf16, M=8192 N=768 K=4096, the TMA kernel)")
    p.add_argument("--path", choices=("fused", "reference"), default="fused")
    p.add_argument("--W", type=int, default=8)
    p.add_argument("--seconds", type=float, default=8.0)
    a = p.parse_args()
    os.environ.update(dict(PATHS)[a.path])
    g = init_loopback_group(a.W)
    M, N, K = 8192, 4096, 1792
    A = torch.randn(M // a.W, K, device="cuda").bfloat16()
    B = (torch.randn(K, N, device="cuda") * K**-0.5).bfloat16()
    if a.op == "ag":
        fn = lambda: torch.ops.mptp.fused_all_gather_matmul(A, [B], 0, g)  # noqa: E731
    elif a.op == "ag8":
        A8 = A.float().to(torch.float8_e4m3fn)
        B8 = B.float().t().contiguous().to(torch.float8_e4m3fn).t()
        sa = torch.rand(M // a.W, 1, device="cuda") + 0.5
        sb = torch.rand(1, N, device="cuda") + 0.5
        fn = lambda: torch.ops.mptp.fused_all_gather_scaled_matmul(  # noqa: E731
            A8, [B8], sa, [sb], 0, g, [None], [None], [torch.bfloat16], [True])
    elif a.op == "mm":
        from mptp_kernels.kernels import persistent_matmul as pm

        Am = torch.randn(M, 4096, device="cuda").bfloat16()
        Bm = torch.randn(4096, 768, device="cuda").bfloat16()
        out = [torch.empty(M, 768, device="cuda", dtype=torch.bfloat16)]
        fn = lambda: pm.persistent_matmul(Am, [Bm], outs=out)  # noqa: E731
    else:
        A_rs = torch.randn(M, K, device="cuda").bfloat16()
        fn = lambda: torch.ops.mptp.fused_matmul_reduce_scatter(A_rs, B, "sum", 0, g)  # noqa: E731
    for _ in range(20):
        fn()
    mirror_loopback_buffers(g)
    torch.cuda.synchronize()
    calls, host = 0, 0
    end = time.monotonic() + a.seconds
    while time.monotonic() < end:
        t0 = time.perf_counter_ns()
        for _ in range(BURST):
            fn()
        host += time.perf_counter_ns() - t0
        calls += BURST
        torch.cuda.synchronize()
    print(f"{a.op} {a.path} W={a.W}: {host / calls / 1e3:.1f} us host per call over {calls} calls")


if __name__ == "__main__":
    main()
