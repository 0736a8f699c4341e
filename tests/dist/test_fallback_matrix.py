"""Every call that is not fused still runs, on every transport (issue 17).

A matrix over dtype {bf16, fp16, fp32, FP8 tensor-wise, FP8 row-wise} x gather /
scatter dim {0, 1, last} x out dtype x return_A, for the four ops, each cell
checked against float64 and against the unfused computation on the same
device, and the path the call took recorded. Modes:
  cpu          gloo, CPU tensors (runs in CI);
  cuda-symm    CUDA tensors on a group enabled for mptp: the reference rides on
               mptp symmetric memory unless the call qualifies for fusion;
  cuda-host    CUDA tensors on a gloo group that is not enabled: host staging;
  cuda-forced  like cuda-symm with MPTP_FORCE_FUSED=1: fused wherever it can be.
Set MPTP_FALLBACK_LOG=<file> to append one line per cell with the path taken.
"""

import os
import random

import pytest
import torch
import torch.distributed as dist

from dist.harness import Workers
from utils import assert_matmul_close, randn

SEED = random.randrange(1 << 30)
BF16, FP16, FP32, FP8 = torch.bfloat16, torch.float16, torch.float32, torch.float8_e4m3fn
_GPU = torch.cuda.is_available()
MODES = [("cpu", 2)] + ([("cuda-symm", 2), ("cuda-symm", 4), ("cuda-host", 2), ("cuda-forced", 2)] if _GPU else [])


@pytest.fixture(scope="module", params=MODES, ids=lambda m: f"{m[0]}-W{m[1]}")
def matrix_workers(request):
    mode, W = request.param
    env = {"MPTP_TIMEOUT_S": "20", "MPTP_ASYNC_ERROR_HANDLING": "0"}
    if mode == "cuda-forced":
        env["MPTP_FORCE_FUSED"] = "1"
    w = Workers(W, backend="gloo", env=env)
    w.run(_setup, mode)
    w.mode = mode
    yield w
    w.close()


def _setup(mode):
    import mptp_kernels

    if mode in ("cuda-symm", "cuda-forced"):
        mptp_kernels.enable_symm_mem_for_group(dist.group.WORLD.group_name)


def _dev(mode):
    return "cpu" if mode == "cpu" else "cuda"


def _paths():
    from mptp_kernels.ops.dispatch import PATH_COUNTS, TRANSPORT_COUNTS

    return dict(PATH_COUNTS), dict(TRANSPORT_COUNTS)


def _took(before, after):
    moved = [f"{k[1]}" for k, v in after[0].items() if v != before[0].get(k, 0)]
    moved += [f"via {k[1]}" for k, v in after[1].items() if v != before[1].get(k, 0)]
    return " ".join(moved) or "cpu reference"


def _log(mode, W, cell, took):
    path = os.environ.get("MPTP_FALLBACK_LOG")
    if path and dist.get_rank() == 0:
        with open(path, "a") as f:
            f.write(f"{mode} W={W} {cell}: {took}\n")


def _ag(seed, mode, dtype, gd, return_A):
    W, r, dev = dist.get_world_size(), dist.get_rank(), _dev(mode)
    shape = [4, 6, 32]
    K = shape[-1] * (W if gd == 2 else 1)
    shards = [randn(shape, seed + i) for i in range(W)]
    Bs64 = [randn((K, n), seed + 100 + j, dtype=torch.float64, scale=K**-0.5) for j, n in enumerate((24, 40))]
    full = torch.cat([s.to(dtype) for s in shards], dim=gd)
    before = _paths()
    A_out, outs = torch.ops.mptp.fused_all_gather_matmul(
        shards[r].to(dev, dtype), [b.to(dev, dtype) for b in Bs64], gd, dist.group.WORLD.group_name, return_A=return_A)
    took = _took(before, _paths())
    if return_A:
        assert torch.equal(A_out.cpu(), full), "gathered A must be bitwise the concatenated shards"
    else:
        assert A_out is None
    for j, (out, B64) in enumerate(zip(outs, Bs64)):
        assert out.dtype == dtype and out.device.type == dev
        eager = (full.to(dev) @ B64.to(dev, dtype)).cpu()
        assert_matmul_close(out, full.double() @ B64, eager, k=2.0, atol=1e-4, what=f"outs[{j}]")
    _log(mode, W, f"all_gather_matmul {dtype} gather_dim={gd} return_A={return_A}", took)
    return took


@pytest.mark.parametrize("return_A", [True, False])
@pytest.mark.parametrize("gd", [0, 1, 2])
@pytest.mark.parametrize("dtype", [BF16, FP16, FP32], ids=str)
def test_all_gather_matmul(matrix_workers, dtype, gd, return_A):
    matrix_workers.run(_ag, SEED, matrix_workers.mode, dtype, gd, return_A, timeout_s=120)


def _ag_scaled(seed, mode, scale_mode, out_dtype, gd):
    W, r, dev = dist.get_world_size(), dist.get_rank(), _dev(mode)
    shape = [2, 16, 32]
    shards = [randn(shape, seed + i, scale=0.5).to(FP8) for i in range(W)]
    full = torch.cat(shards, dim=gd)
    if scale_mode == "tensor":
        A_scale = full_scale = torch.tensor(0.75)
        B_scales = [torch.tensor(0.5), torch.tensor(0.25)]
    else:
        row = [randn([*shape[:-1], 1], seed + 50 + i).abs() + 0.5 for i in range(W)]
        A_scale, full_scale = row[r], torch.cat(row, dim=gd)
        B_scales = [randn((1, n), seed + 60 + j).abs() + 0.1 for j, n in enumerate((32, 48))]
    Bs = [(randn((n, 32), seed + 200 + j) * 2).to(FP8).t() for j, n in enumerate((32, 48))]
    rs = torch.tensor(1.5) if out_dtype == FP8 else None
    before = _paths()
    cu = lambda t: t.to(dev) if t is not None else None  # noqa: E731
    A_out, outs = torch.ops.mptp.fused_all_gather_scaled_matmul(
        shards[r].to(dev), [cu(b) for b in Bs], A_scale.to(dev), [cu(s) for s in B_scales], gd,
        dist.group.WORLD.group_name, [None, None], [cu(rs), cu(rs)], [out_dtype, out_dtype], [False, True])
    took = _took(before, _paths())
    assert torch.equal(A_out.cpu().view(torch.uint8), full.view(torch.uint8))
    for j, (out, B, bs) in enumerate(zip(outs, Bs, B_scales)):
        ref = (full.double() * full_scale.double()) @ (B.double() * bs.double())
        if rs is not None:
            ref = ref * rs.double()
        want = out_dtype or FP8
        assert out.dtype == want, (out.dtype, want)
        # The unfused computation as the ops define _scaled_mm (torch 2.11's CPU _scaled_mm has no
        # row-wise scales; CUDA's ignores scale_result in 2.10-2.11): reference.scaled_mm.
        from mptp_kernels.ops.reference import scaled_mm

        eager = scaled_mm(full.flatten(0, -2).to(dev), B.to(dev), full_scale.flatten(0, -2).to(dev)
                          if scale_mode == "row" else full_scale.to(dev), bs.to(dev), None, cu(rs), want,
                          bool(j) and dev == "cuda")
        eager = eager.unflatten(0, full.shape[:-1]).cpu()
        assert_matmul_close(out.cpu().float(), ref, eager.float(), k=2.0, atol=2e-3, what=f"outs[{j}]")
    _log(mode, W, f"all_gather_scaled_matmul {scale_mode}-wise out={out_dtype} gather_dim={gd}", took)
    return took


@pytest.mark.parametrize("gd", [0, 1])
@pytest.mark.parametrize("scale_mode,out_dtype", [("tensor", None), ("tensor", BF16), ("tensor", FP32), ("row", BF16)],
                         ids=str)  # fmt: skip
def test_all_gather_scaled_matmul(matrix_workers, scale_mode, out_dtype, gd):
    matrix_workers.run(_ag_scaled, SEED, matrix_workers.mode, scale_mode, out_dtype, gd, timeout_s=120)


def _rs(seed, mode, dtype, sd, reduce_op):
    W, r, dev = dist.get_world_size(), dist.get_rank(), _dev(mode)
    shape, N = [4, 8, 32], 16
    As = [randn(shape, seed + i) for i in range(W)]
    B64 = randn((32, N), seed + 99, dtype=torch.float64, scale=32**-0.5)
    div = W if reduce_op == "avg" else 1
    ref = (sum(a.to(dtype).double() @ B64.to(dtype).double() for a in As) / div).chunk(W, dim=sd)[r]
    eager = (sum((a.to(dev, dtype) @ B64.to(dev, dtype)).double().cpu() for a in As) / div).chunk(W, dim=sd)[r]
    before = _paths()
    out = torch.ops.mptp.fused_matmul_reduce_scatter(As[r].to(dev, dtype), B64.to(dev, dtype), reduce_op, sd,
                                                     dist.group.WORLD.group_name)  # fmt: skip
    took = _took(before, _paths())
    assert out.dtype == dtype and out.is_contiguous()
    # k=3: partials are rounded to the dtype before the (fp32) reduction, as with NCCL.
    assert_matmul_close(out, ref, eager.to(dtype), k=3.0, atol=1e-3)
    _log(mode, W, f"matmul_reduce_scatter {dtype} scatter_dim={sd} {reduce_op}", took)
    return took


@pytest.mark.parametrize("sd,reduce_op", [(0, "sum"), (1, "avg"), (2, "sum")])
@pytest.mark.parametrize("dtype", [BF16, FP16, FP32], ids=str)
def test_matmul_reduce_scatter(matrix_workers, dtype, sd, reduce_op):
    matrix_workers.run(_rs, SEED, matrix_workers.mode, dtype, sd, reduce_op, timeout_s=120)


def _rs_scaled(seed, mode, scale_mode, out_dtype, sd):
    W, r, dev = dist.get_world_size(), dist.get_rank(), _dev(mode)
    shape, N = [4, 8, 32], 32
    As = [randn(shape, seed + i, scale=0.5).to(FP8) for i in range(W)]
    if scale_mode == "tensor":
        scales = [torch.tensor(0.5 + 0.25 * i) for i in range(W)]
        B_scale = torch.tensor(0.25)
    else:
        scales = [randn([*shape[:-1], 1], seed + 70 + i).abs() + 0.5 for i in range(W)]
        B_scale = randn((1, N), seed + 98).abs() + 0.1
    B = (randn((N, 32), seed + 99) * 2).to(FP8).t()
    parts = [(a.double() * s.double()) @ (B.double() * B_scale.double()) for a, s in zip(As, scales)]
    ref = sum(parts).chunk(W, dim=sd)[r]
    from mptp_kernels.ops.reference import scaled_mm

    eager = sum(
        scaled_mm(a.flatten(0, -2).to(dev), B.to(dev), s.flatten(0, -2).to(dev) if s.numel() > 1 else s.to(dev),
                  B_scale.to(dev), out_dtype=out_dtype).double().cpu().unflatten(0, shape[:-1])
        for a, s in zip(As, scales)).chunk(W, dim=sd)[r]  # fmt: skip
    before = _paths()
    out = torch.ops.mptp.fused_scaled_matmul_reduce_scatter(
        As[r].to(dev), B.to(dev), scales[r].to(dev), B_scale.to(dev), "sum", sd, sd, dist.group.WORLD.group_name,
        [*shape[:-1], N], None, None, out_dtype, False)
    took = _took(before, _paths())
    assert out.dtype == out_dtype
    assert_matmul_close(out.float(), ref, eager.to(out_dtype).float(), k=3.0, atol=2e-3)
    _log(mode, W, f"scaled_matmul_reduce_scatter {scale_mode}-wise out={out_dtype} scatter_dim={sd}", took)
    return took


@pytest.mark.parametrize("sd", [0, 1, 2])
@pytest.mark.parametrize("scale_mode,out_dtype", [("tensor", BF16), ("tensor", FP32), ("row", BF16)], ids=str)
def test_scaled_matmul_reduce_scatter(matrix_workers, scale_mode, out_dtype, sd):
    matrix_workers.run(_rs_scaled, SEED, matrix_workers.mode, scale_mode, out_dtype, sd, timeout_s=120)
