"""Matmul-reduce-scatter: fused (mptp) against the baselines, measured in the same run.

Loopback (one GPU, one process):  python bench/bench_matmul_reduce_scatter.py --mode loopback
    Rank 0 of W simulated ranks: the producer kernel stores chunk c of its
    partial product straight into slot 0 of "rank c's" buffer (separate
    buffers on this GPU), then rank 0 reduces the W slots of its own buffer
    in fp32. Providers:
      mptp          producer scatter-store + reduction (what the fused op runs)
      matmul_only   our persistent kernel, plain
      cublas_only   torch.mm
      comm_only     the unfused data movement: W-1 chunk copies + the reduction
      copy_cublas   torch.mm, then the copies and the reduction (the unfused pattern)
Real (one process per GPU):        torchrun --nproc-per-node 8 bench/bench_matmul_reduce_scatter.py --mode real
    Providers: mptp, nccl_cublas (mm + reduce_scatter_tensor), symm_mem
    (torch.ops.symm_mem.fused_matmul_reduce_scatter), matmul_only, comm_only.
Rows go to bench/results/matmul_reduce_scatter.csv.
"""

import itertools
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import (  # noqa: E402
    LLAMA_TP8_NK,
    add_symm_mem,
    env_columns,
    loopback_summary,
    parse_fused_args,
    run_cases,
    with_graphs,
)

from mptp_kernels.kernels import persistent_matmul as pm  # noqa: E402
from mptp_kernels.kernels.reduce import reduce_partials  # noqa: E402


def loopback(W, M, N, K):
    A = (torch.randn(M, K, device="cuda") / 2).bfloat16()
    B = (torch.randn(K, N, device="cuda") / K**0.5).bfloat16()
    Mc = M // W
    bufs = [torch.randn(W, Mc, N, device="cuda").bfloat16() for _ in range(W)]  # rank c's slots
    dests = [bufs[c][0] for c in range(W)]  # our partial of chunk c goes to slot 0 of rank c
    order = torch.tensor([(1 + i) % W for i in range(W)], dtype=torch.int32, device="cuda")
    out = torch.empty(Mc, N, device="cuda", dtype=torch.bfloat16)
    C = torch.empty(M, N, device="cuda", dtype=torch.bfloat16)

    def fused():
        pm.persistent_matmul(A, [B], num_chunks=W, order=order, scatter_to=dests)
        reduce_partials(bufs[0], out)

    def comm_only():
        for c in range(1, W):
            dests[c].copy_(C[c * Mc : (c + 1) * Mc], non_blocking=True)
        reduce_partials(bufs[0], out)

    def copy_cublas():
        torch.mm(A, B, out=C)
        comm_only()

    fused()
    torch.cuda.synchronize()
    ref = (A.float() @ B.float())
    for c in range(W):
        err = ((dests[c].float() - ref[c * Mc : (c + 1) * Mc]).norm() / ref[c * Mc : (c + 1) * Mc].norm()).item()
        assert err < 1e-2, f"chunk {c}: rel err {err:.3e}"
    return {"mptp": fused, "matmul_only": lambda: pm.persistent_matmul(A, [B], outs=[C]),
            "cublas_only": lambda: torch.mm(A, B, out=C), "comm_only": comm_only,
            "copy_cublas": copy_cublas}  # fmt: skip


def real(M, N, K):
    import torch.distributed as dist

    import mptp_kernels

    W = dist.get_world_size()
    g = dist.group.WORLD.group_name
    mptp_kernels.enable_symm_mem_for_group(g)
    A = (torch.randn(M, K, device="cuda") / 2).bfloat16()
    B = (torch.randn(K, N, device="cuda") / K**0.5).bfloat16()
    C = torch.mm(A, B)
    out = torch.empty(M // W, N, device="cuda", dtype=torch.bfloat16)
    fns = {
        "mptp": lambda: torch.ops.mptp.fused_matmul_reduce_scatter(A, B, "sum", 0, g),
        "nccl_cublas": lambda: dist.reduce_scatter_tensor(out, torch.mm(A, B)),
        "matmul_only": lambda: torch.mm(A, B),
        "comm_only": lambda: dist.reduce_scatter_tensor(out, C),
    }
    fns["mptp_args"] = (A, B, "sum", 0, g)
    add_symm_mem(fns, "fused_matmul_reduce_scatter", g)
    return fns


def main():
    a, W = parse_fused_args(())
    envc = env_columns()
    cases = [{"world_size": W, "mode": a.mode, "dtype": "bf16", "M": M, "N": N, "K": K}
             for M, (N, K) in itertools.product(map(int, a.Ms.split(",")), LLAMA_TP8_NK)]

    def make(c):
        return with_graphs(loopback(W, c["M"], c["N"], c["K"])) if a.mode == "loopback" else real(c["M"], c["N"], c["K"])

    def summarize(c, t):
        head = f"bf16 W={W} M={c['M']:5d} N={c['N']:5d} K={c['K']:5d}"
        if a.mode != "loopback":
            return f"{head} " + " ".join(f"{k} {v:.1f}us" for k, v in t.items())
        return f"{head} | {loopback_summary(t)}"

    write = a.mode != "real" or torch.distributed.get_rank() == 0
    run_cases("matmul_reduce_scatter.csv", cases, make, envc, summarize, a.out, write)


if __name__ == "__main__":
    main()
