"""Matmul-reduce-scatter: fused (mptp) against the baselines, measured in the same run.

Every mode's "mptp" row except --mode loopback's times the op as a user calls it
(op_call: torch.ops.mptp.fused_matmul_reduce_scatter on a group name) and records
the path the op took by default (path column, mptp_kernels.path_counts());
"@graph" rows replay the same work from a CUDA graph.

Loopback op (one GPU, one process):  python bench/bench_matmul_reduce_scatter.py --mode loopback-op
    The op on a loopback group of W simulated ranks
    (mptp_kernels.symm.loopback.init_loopback_group). Providers:
      mptp          the op, end to end
      matmul_only   torch.mm
      comm_only     the W-1 chunk copies (copy engine) a reduce-scatter would send, then
                    the sum of the W partials of this rank's chunk (torch.sum), NCCL-free
      copy_cublas   torch.mm, then comm_only (what a user would run instead)
      reduce_only   the op's own reduction of one chunk (what hiding it could save at most)
      mptp_kernel   the op with MPTP_RS_REDUCE=kernel (the sum inside the matmul)
      mptp_pointer  the op with its matmul on the pointer kernel (as before 8dadce7)
Loopback pipeline (one GPU):        python bench/bench_matmul_reduce_scatter.py --mode loopback
    Not the op: rank 0 of W simulated ranks assembled by hand. The producer kernel
    stores chunk c of its partial product straight into slot 0 of "rank c's" buffer
    (separate buffers on this GPU), then rank 0 reduces the W slots of its own
    buffer in fp32. Providers:
      mptp          producer scatter-store + reduction
      matmul_only   our persistent kernel, plain
      cublas_only   torch.mm
      comm_only     the unfused data movement: W-1 chunk copies + the reduction
      copy_cublas   torch.mm, then the copies and the reduction (the unfused pattern)
Real (one process per GPU):         torchrun --nproc-per-node 8 bench/bench_matmul_reduce_scatter.py --mode real
    Providers: mptp, nccl_cublas (mm + reduce_scatter_tensor), symm_mem
    (torch.ops.symm_mem.fused_matmul_reduce_scatter), matmul_only, comm_only.
Rows go to bench/results/matmul_reduce_scatter.csv (columns timed = op | pipeline, path).
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
    op_path,
    parse_fused_args,
    run_cases,
    with_env,
    with_graphs,
)

from mptp_kernels.kernels import persistent_matmul as pm  # noqa: E402
from mptp_kernels.kernels.reduce import reduce_partials  # noqa: E402
from mptp_kernels.symm.primitives import pull_chunks  # noqa: E402


def _inputs(M, N, K):
    A = (torch.randn(M, K, device="cuda") / 2).bfloat16()
    B = (torch.randn(K, N, device="cuda") / K**0.5).bfloat16()
    return A, B


def op_call(group_name, A, B):
    """(op name, fn): this rank's call of the op on its A [M, K] (partial sums), as a user makes it."""
    name = "fused_matmul_reduce_scatter"
    return name, lambda: torch.ops.mptp.fused_matmul_reduce_scatter(A, B, "sum", 0, group_name)


def loopback_op(group_name, W, M, N, K):
    """The op on a loopback group, and the NCCL-free baselines. Returns (providers, columns)."""
    A, B = _inputs(M, N, K)
    name, fn = op_call(group_name, A, B)
    path = op_path(fn, name)
    Mc = M // W
    C = torch.empty(M, N, device="cuda", dtype=torch.bfloat16)
    slots = torch.empty(W, Mc, N, device="cuda", dtype=torch.bfloat16)  # the peers' partials of my chunk
    out = torch.empty(Mc, N, device="cuda", dtype=torch.bfloat16)
    copies = [(slots[c], C[c * Mc : (c + 1) * Mc], None) for c in range(1, W)]

    def comm_only():
        pull_chunks(copies, 1, torch.cuda.current_stream())
        torch.sum(slots, 0, out=out)

    def copy_cublas():
        torch.mm(A, B, out=C)
        comm_only()

    # reduce_only: the fused path's own reduction of this rank's chunk (W partials, fp32 sums, the
    # kernel the op runs after its barrier): what hiding the reduction could save at most.
    # Variants of "mptp" (the op as it runs by default: the sum after the matmul and a barrier),
    # timed only where "mptp" is fused:
    fns = {"mptp": fn, "matmul_only": lambda: torch.mm(A, B, out=C), "comm_only": comm_only,
           "copy_cublas": copy_cublas, "reduce_only": lambda: reduce_partials(slots, out)}  # fmt: skip
    # mptp_kernel: MPTP_RS_REDUCE=kernel (the sum inside the matmul); mptp_pointer: the matmul on
    # the pointer kernel (pm.USE_TMA off for the call: the reduce-scatter's matmul before 8dadce7).
    if path == "fused":
        fns["mptp_kernel"] = with_env({"MPTP_RS_REDUCE": "kernel"}, fn)
        fns["mptp_pointer"] = _without_tma(fn)
    return with_graphs(fns), {"timed": "op", "path": path}


def _without_tma(fn):
    def call():
        old = pm.USE_TMA
        pm.USE_TMA = False
        try:
            return fn()
        finally:
            pm.USE_TMA = old

    return call


def loopback(W, M, N, K):
    A, B = _inputs(M, N, K)
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


def real(group_name, M, N, K):
    """The op on a real group (one process per GPU) and the NCCL baselines. Returns (providers, columns)."""
    import torch.distributed as dist

    W = dist.get_world_size()
    A, B = _inputs(M, N, K)
    name, fn = op_call(group_name, A, B)
    path = op_path(fn, name)
    C = torch.mm(A, B)
    out = torch.empty(M // W, N, device="cuda", dtype=torch.bfloat16)
    fns = {
        "mptp": fn,
        "nccl_cublas": lambda: dist.reduce_scatter_tensor(out, torch.mm(A, B)),
        "matmul_only": lambda: torch.mm(A, B),
        "comm_only": lambda: dist.reduce_scatter_tensor(out, C),
    }
    fns["mptp_args"] = (A, B, "sum", 0, group_name)
    add_symm_mem(fns, "fused_matmul_reduce_scatter", group_name)
    return fns, {"timed": "op", "path": path}


def main():
    a, W, group_name = parse_fused_args(())
    envc = env_columns()
    cases = [{"world_size": W, "mode": a.mode, "dtype": "bf16", "M": M, "N": N, "K": K}
             for M, (N, K) in itertools.product(map(int, a.Ms.split(",")), LLAMA_TP8_NK)]

    def make(c):
        if a.mode == "loopback":
            return with_graphs(loopback(W, c["M"], c["N"], c["K"])), {"timed": "pipeline"}
        if a.mode == "loopback-op":
            return loopback_op(group_name, W, c["M"], c["N"], c["K"])
        return real(group_name, c["M"], c["N"], c["K"])

    def summarize(c, t):
        head = f"bf16 W={W} M={c['M']:5d} N={c['N']:5d} K={c['K']:5d}"
        if c.get("path"):
            head += f" path={c['path']}"
        if a.mode == "real":
            return f"{head} " + " ".join(f"{k} {v:.1f}us" for k, v in t.items())
        return f"{head} | {loopback_summary(t)}"

    write = a.mode != "real" or torch.distributed.get_rank() == 0
    run_cases("matmul_reduce_scatter.csv", cases, make, envc, summarize, a.out, write)


if __name__ == "__main__":
    main()
