"""Runs each torch.ops.mptp op on W processes and prints a table.

CPU: W gloo processes (default 2). GPUs: one NCCL process per GPU.
Each op is compared with a float64 computation of the same math, and the
table says which path each call took (fused, or the reference path, which is
all there is on CPU or where the CUDA extension was not built).

    python examples/demo.py [--world-size W]
"""

import argparse
import os
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _rel(x, ref):
    return ((x.double().cpu() - ref).norm() / ref.norm()).item()


def _timed(fn, device):
    """(output, ms of the second call, path the calls took)."""
    import mptp_kernels

    before = mptp_kernels.path_counts()
    fn()  # warm-up
    if device.type == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    out = fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    ms = (time.perf_counter() - t0) * 1e3
    # path_counts() counts CUDA calls only: CPU calls always run the reference path.
    took = {p for (o, p), n in mptp_kernels.path_counts().items() if n > before.get((o, p), 0)}
    return out, ms, "+".join(sorted(took)) if device.type == "cuda" else "reference"


def _worker(rank, W, store_path, results):
    import mptp_kernels

    use_cuda = torch.cuda.is_available() and torch.cuda.device_count() >= W
    device = torch.device("cuda", rank) if use_cuda else torch.device("cpu")
    if use_cuda:
        torch.cuda.set_device(device)
    dist.init_process_group(
        "nccl" if use_cuda else "gloo", store=dist.FileStore(store_path, W), rank=rank, world_size=W
    )
    group = dist.group.WORLD
    mptp_kernels.enable_symm_mem_for_group(group.group_name)
    dtype = torch.bfloat16 if use_cuda else torch.float32
    M, K, N = (4096, 4096, 4096) if use_cuda else (256, 256, 256)
    g = torch.Generator().manual_seed(1234)
    shards = [torch.randn(M // W, K, generator=g) for _ in range(W)]
    B = torch.randn(K, N, generator=g) / K**0.5
    rows = []

    # all-gather-matmul
    A_full64 = torch.cat(shards).double()
    fn = lambda: mptp_kernels.fused_all_gather_matmul(shards[rank].to(device, dtype), [B.to(device, dtype)], 0, group)  # noqa: E731
    (A_out, (C,)), ms, path = _timed(fn, device)
    rows.append(("fused_all_gather_matmul", f"[{M // W},{K}]x[{K},{N}]", dtype, _rel(C, A_full64 @ B.double()), ms, path))

    # matmul-reduce-scatter
    # Rank r holds a full-size A (its partial sum's input): the shards rotated by r.
    As = [torch.cat([shards[(r + i) % W] for i in range(W)]) for r in range(W)]
    ref = sum(a.double() @ B.double() for a in As).chunk(W)[rank]
    fn = lambda: mptp_kernels.fused_matmul_reduce_scatter(As[rank].to(device, dtype), B.to(device, dtype), "sum", 0, group)  # noqa: E731
    out, ms, path = _timed(fn, device)
    rows.append(("fused_matmul_reduce_scatter", f"[{M},{K}]x[{K},{N}]", dtype, _rel(out, ref), ms, path))

    # FP8 variants (tensor-wise scales)
    f8 = torch.float8_e4m3fn
    A8 = [(s * 0.5).to(f8) for s in shards]
    B8 = (B * 4).t().contiguous().to(f8).t()
    one = torch.ones((), device=device)
    fn = lambda: mptp_kernels.fused_all_gather_scaled_matmul(  # noqa: E731
        A8[rank].to(device), [B8.to(device)], one, [one], 0, group, out_dtypes=[torch.bfloat16])
    (_, (C8,)), ms, path = _timed(fn, device)
    ref8 = torch.cat(A8).double() @ B8.double()
    rows.append(("fused_all_gather_scaled_matmul", f"[{M // W},{K}]x[{K},{N}]", "fp8e4m3", _rel(C8, ref8), ms, path))

    A8rs = [(a * 0.5).to(f8) for a in As]
    fn = lambda: mptp_kernels.fused_scaled_matmul_reduce_scatter(  # noqa: E731
        A8rs[rank].to(device), B8.to(device), one, one, "sum", 0, group, out_dtype=torch.bfloat16)
    out8, ms, path = _timed(fn, device)
    ref8 = sum(a.double() @ B8.double() for a in A8rs).chunk(W)[rank]
    rows.append(("fused_scaled_matmul_reduce_scatter", f"[{M},{K}]x[{K},{N}]", "fp8e4m3", _rel(out8, ref8), ms, path))

    if rank == 0:
        results.put((device.type, W, rows))
    dist.barrier()
    dist.destroy_process_group()


def main():
    # One line up front: is the fused path built, and if not why (the repo's scripts/build_status.py).
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "scripts"))
    from build_status import status

    print(status())
    p = argparse.ArgumentParser()
    p.add_argument("--world-size", type=int, default=None)
    a = p.parse_args()
    W = a.world_size or (torch.cuda.device_count() if torch.cuda.device_count() >= 2 else 2)
    fd, store = tempfile.mkstemp()
    os.close(fd)
    os.unlink(store)
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    mp.start_processes(_worker, args=(W, store, q), nprocs=W, start_method="spawn")
    device, W, rows = q.get(timeout=600)
    print(f"\nmptp_kernels demo: {W} ranks on {device}\n")
    print(f"{'op':36s} {'shapes (per rank)':24s} {'dtype':16s} {'rel err vs fp64':>16s} {'time ms':>9s}  path")
    for op, shapes, dtype, err, ms, path in rows:
        print(f"{op:36s} {shapes:24s} {str(dtype):16s} {err:16.2e} {ms:9.2f}  {path}")


if __name__ == "__main__":
    main()
