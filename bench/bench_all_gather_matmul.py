"""All-gather-matmul: fused (mptp) against the baselines, measured in the same run.

Every mode's "mptp" row except --mode loopback's times the op as a user calls it
(op_call: torch.ops.mptp.fused_all_gather_matmul, or the scaled op for FP8, on a
group name), and records the path the op took by default (path column,
mptp_kernels.path_counts()); "@graph" rows replay the same work from a CUDA graph.

Loopback op (one GPU, one process):  python bench/bench_all_gather_matmul.py --mode loopback-op
    The op on a loopback group of W simulated ranks
    (mptp_kernels.symm.loopback.init_loopback_group): the same code as a real
    group, the peers' buffers local, the copy engine doing their transfers. Providers:
      mptp          the op, end to end
      matmul_only   cuBLAS (torch.mm / torch._scaled_mm) on the full A
      comm_only     the W-1 shard copies (copy engine) a gather would do, NCCL-free
      copy_cublas   copies, then cuBLAS (what a user would run instead)
Loopback pipeline (one GPU):        python bench/bench_all_gather_matmul.py --mode loopback
    Not the op: the fused pipeline assembled by hand. The other W-1 shards live in
    separate buffers on this GPU and reach A_full through the copy engine, chunk by
    chunk; the consumer kernel waits on each chunk's flag. It leaves out what a call
    also pays (validation, dispatch, the copy into the symmetric buffer, READY/DONE,
    the layout step). Providers:
      mptp          copies on a side stream feeding the consumer kernel (overlapped)
      matmul_only   our persistent kernel with all data present (flags pre-set)
      cublas_only   torch.mm on the full A
      comm_only     the W-1 copies alone
      copy_cublas   copies, then torch.mm (the unfused pattern)
Real (one process per GPU):         torchrun --nproc-per-node 8 bench/bench_all_gather_matmul.py --mode real
    Providers: mptp, nccl_cublas (all_gather_into_tensor + mm), symm_mem
    (torch.ops.symm_mem.fused_all_gather_matmul), matmul_only, comm_only.
Target: mptp within 3% of max(matmul_only, comm_only).
Rows go to bench/results/all_gather_matmul.csv (columns timed = op | pipeline, path).
"""

import itertools
import os
import sys
from types import SimpleNamespace

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_persistent_matmul import make  # noqa: E402
from common import (  # noqa: E402
    LLAMA_TP8_NK,
    add_symm_mem,
    env_columns,
    loopback_summary,
    op_path,
    parse_fused_args,
    run_cases,
    with_graphs,
)

from mptp_kernels.kernels import persistent_matmul as pm  # noqa: E402
from mptp_kernels.ops.fused import _consumer_sms  # noqa: E402
from mptp_kernels.symm.loopback import mirror_loopback_buffers  # noqa: E402
from mptp_kernels.symm.primitives import pull_chunks, write_value  # noqa: E402

FP8 = torch.float8_e4m3fn
_SHARED = None  # loopback(): the consumer's view of its group (every simulated peer shares this GPU)


def _inputs(M, N, K, kind):
    """(A, B, kwargs of persistent_matmul) for one benchmark case."""
    A, B, sa, sb = make(M, N, K, kind)
    if kind == "bf16":
        return A, B, {}
    return A, B, dict(A_scale=sa, B_scales=[sb], out_dtype=torch.bfloat16, fast_accum=True)


def _cublas(A, B, kw):
    """What a user runs instead of the fused op's matmul: torch.mm, or _scaled_mm for FP8."""
    if not kw:
        return lambda: torch.mm(A, B)
    sa, sb = kw["A_scale"], kw["B_scales"][0]
    return lambda: torch._scaled_mm(A, B, sa, sb, out_dtype=torch.bfloat16, use_fast_accum=True)


def op_call(group_name, A, B, kw):
    """(op name, fn): this rank's call of the op on its shard A [M / W, K], as a user makes it.

    kw (from _inputs) empty: fused_all_gather_matmul (bf16); else fused_all_gather_scaled_matmul
    with kw's scales (a row-wise A_scale is this shard's [M / W, 1]), bf16 output, fast accum.
    """
    if not kw:
        return "fused_all_gather_matmul", lambda: torch.ops.mptp.fused_all_gather_matmul(A, [B], 0, group_name)
    sa, sb = kw["A_scale"], kw["B_scales"][0]
    name = "fused_all_gather_scaled_matmul"
    return name, lambda: torch.ops.mptp.fused_all_gather_scaled_matmul(
        A, [B], sa, [sb], 0, group_name, [None], [None], [torch.bfloat16], [True])  # fmt: skip


def _shard(A, kw, rank, rows):
    """Rank `rank`'s rows of A and of a row-wise A_scale."""
    kw = dict(kw)
    if kw and kw["A_scale"].numel() > 1:
        kw["A_scale"] = kw["A_scale"][rank * rows : (rank + 1) * rows].contiguous()
    return A[rank * rows : (rank + 1) * rows].contiguous(), kw


def loopback_op(group_name, W, M, N, K, kind):
    """The op on a loopback group, and the NCCL-free baselines. Returns (providers, columns)."""
    A, B, kw = _inputs(M, N, K, kind)
    rows = M // W
    shard, shard_kw = _shard(A, kw, 0, rows)
    name, fn = op_call(group_name, shard, B, shard_kw)
    path = op_path(fn, name)
    # NOTE: the peers' buffers then hold data like this rank's shard, not zeros (a matmul over
    # zeros draws less power and runs faster than cuBLAS on real data).
    mirror_loopback_buffers(group_name)
    peers = [_shard(A, {}, p, rows)[0] for p in range(1, W)]  # the shards the gather moves
    A_full = torch.empty_like(A)
    copies = [(A_full[p * rows : (p + 1) * rows], peers[p - 1], None) for p in range(1, W)]
    cublas, cublas_full = _cublas(A, B, kw), _cublas(A_full, B, kw)

    def comm_only():
        pull_chunks(copies, 1, torch.cuda.current_stream())

    def copy_cublas():
        comm_only()
        return cublas_full()

    fns = {"mptp": fn, "matmul_only": cublas, "comm_only": comm_only, "copy_cublas": copy_cublas}
    return with_graphs(fns), {"timed": "op", "path": path}


def loopback(W, M, N, K, kind):
    A, B, kw = _inputs(M, N, K, kind)
    global _SHARED
    _SHARED = SimpleNamespace(shares_device=True, side=None)
    rows = M // W
    peers = [A[p * rows : (p + 1) * rows].clone() for p in range(W)]  # the simulated peers' buffers
    A_full = torch.empty_like(A)
    flags = torch.zeros(W, dtype=torch.int32, device="cuda")
    order = torch.arange(W, dtype=torch.int32, device="cuda")  # rank 0's view: own chunk first
    out = [torch.empty(M, N, device="cuda", dtype=torch.bfloat16)]
    side = torch.cuda.Stream()
    cur = torch.cuda.current_stream  # looked up per call: a graph capture runs on its own stream
    ckw = dict(num_chunks=W, order=order, flags=flags, epoch=1, mode=pm.MODE_CONSUMER, outs=out, **kw)

    pulls = [(A_full[p * rows : (p + 1) * rows], peers[p], flags[p]) for p in range(1, W)]
    _SHARED.side = side

    scratch = torch.zeros(W, dtype=torch.int32, device="cuda")  # flags of the unfused providers
    pulls_unfused = [(d, src, scratch[i]) for i, (d, src, _) in enumerate(pulls)]

    def copies(stream, pulls=pulls):
        pull_chunks(pulls, 1, stream)  # what the fused op does: copy engine + flag memops

    def fused():
        A_full[:rows].copy_(peers[0])
        main = cur()
        write_value(flags[0], 1, main)
        side.wait_stream(main)
        with torch.cuda.stream(side):
            copies(side)
        # NOTE: as the op (ops/fused.py _consumer_sms): these copies are device-local, so the
        # consumer leaves SMs free for them (8, or 2 where they asked for a copy engine).
        pm.persistent_matmul(A_full, [B], num_sms=_consumer_sms(_SHARED, torch.device("cuda")), **ckw)
        flags.zero_()
        main.wait_stream(side)

    ones = torch.ones(W, dtype=torch.int32, device="cuda")

    def matmul_only():
        pm.persistent_matmul(A, [B], **{**ckw, "flags": ones})

    def cublas_only():
        if kind == "bf16":
            return torch.mm(A, B)
        sa = kw["A_scale"]
        return torch._scaled_mm(A, B, sa, kw["B_scales"][0], out_dtype=torch.bfloat16, use_fast_accum=True)

    def comm_only():
        copies(cur(), pulls_unfused)

    def copy_cublas():
        copies(cur(), pulls_unfused)
        cublas_only()

    fused()
    torch.cuda.synchronize()
    got, ref = out[0].float(), cublas_only().float()
    err = ((got - ref).norm() / ref.norm()).item()
    assert err < 2e-2, f"loopback result wrong: rel err {err:.3e}"
    return {"mptp": fused, "matmul_only": matmul_only, "cublas_only": cublas_only,
            "comm_only": comm_only, "copy_cublas": copy_cublas}  # fmt: skip


def real(group_name, M, N, K, kind):
    """The op on a real group (one process per GPU) and the NCCL baselines. Returns (providers, columns)."""
    import torch.distributed as dist

    W = dist.get_world_size()
    g = group_name
    A, B, kw = _inputs(M // W, N, K, kind)
    name, fn = op_call(g, A, B, kw)
    path = op_path(fn, name)
    A_full = torch.randn(M, K, device="cuda").to(A.dtype)
    fns = {"mptp": fn}
    if kind == "bf16":
        fns["nccl_cublas"] = lambda: torch.mm(torch.ops._c10d_functional.wait_tensor(
            torch.ops._c10d_functional.all_gather_into_tensor(A, W, g)), B)
        fns["matmul_only"] = lambda: torch.mm(A_full, B)
        fns["comm_only"] = lambda: dist.all_gather_into_tensor(A_full, A)
        fns["mptp_args"] = (A, [B], 0, g)
        add_symm_mem(fns, "fused_all_gather_matmul", g)
    else:
        sa_full = kw["A_scale"] if kw["A_scale"].numel() == 1 else torch.rand(M, 1, device="cuda") + 0.5
        sb = kw["B_scales"][0]

        def gather8():
            out = torch.ops._c10d_functional.all_gather_into_tensor(A.view(torch.uint8), W, g)
            return torch.ops._c10d_functional.wait_tensor(out).view(FP8)

        fns["nccl_cublas"] = lambda: torch._scaled_mm(
            gather8(), B, sa_full, sb, out_dtype=torch.bfloat16, use_fast_accum=True)
        fns["matmul_only"] = lambda: torch._scaled_mm(
            A_full, B, sa_full, sb, out_dtype=torch.bfloat16, use_fast_accum=True)
        fns["comm_only"] = lambda: dist.all_gather_into_tensor(A_full.view(torch.uint8), A.view(torch.uint8))
    return fns, {"timed": "op", "path": path}


def main():
    a, W, group_name = parse_fused_args((("--kinds", {"default": "bf16,fp8_row"}),))
    envc = env_columns()
    cases = [{"world_size": W, "mode": a.mode, "dtype": kind, "M": M, "N": N, "K": K}
             for kind, M, (N, K) in itertools.product(a.kinds.split(","), map(int, a.Ms.split(",")), LLAMA_TP8_NK)]

    def make(c):
        if a.mode == "loopback":
            return with_graphs(loopback(W, c["M"], c["N"], c["K"], c["dtype"])), {"timed": "pipeline"}
        if a.mode == "loopback-op":
            return loopback_op(group_name, W, c["M"], c["N"], c["K"], c["dtype"])
        return real(group_name, c["M"], c["N"], c["K"], c["dtype"])

    def summarize(c, t):
        head = f"{c['dtype']:10s} W={W} M={c['M']:5d} N={c['N']:5d} K={c['K']:5d}"
        if c.get("path"):
            head += f" path={c['path']}"
        if a.mode == "real":
            return f"{head} " + " ".join(f"{k} {v:.1f}us" for k, v in t.items())
        return f"{head} | {loopback_summary(t)}"

    write = a.mode != "real" or torch.distributed.get_rank() == 0
    run_cases("all_gather_matmul.csv", cases, make, envc, summarize, a.out, write)


if __name__ == "__main__":
    main()
