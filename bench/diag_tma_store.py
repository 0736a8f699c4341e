"""Does a TMA store of the output tile beat the masked pointer store of our TMA kernel? (issue 14)

    python bench/diag_tma_store.py [--Ms 4096,8192] [--dtypes bf16,fp8_row]

A stand-alone persistent matmul shaped like kernels/persistent_matmul.py's plain TMA launch
(same tile order, the same K loop and epilogue), whose output store is a constexpr:
  ptr: tl.store of the masked tile (what the package's kernel does),
  tma: the tile through a host TensorDescriptor of C (asynchronous: the next tile's loads need
       not wait for it),
  tma2: the same in two halves of BLOCK_N / 2 columns (less shared memory for the staging).
GPU times from CUDA graphs (median, bench/common.bench_us; with --rounds, the providers
interleaved and the median over rounds), against cuBLAS (torch.mm, or torch._scaled_mm with
fast accumulation) and the package's own kernel (pkg: its default plan; pkg_whole: whole tiles;
pkg_whole_tma: whole tiles with its TMA store on), same run, same inputs.
"""

import argparse
import os
import sys

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import bench_us, with_graphs, with_setting  # noqa: E402

from mptp_kernels.kernels import persistent_matmul as pm  # noqa: E402

SHAPES = [(7168, 8192), (8192, 3584), (1280, 8192), (3584, 4096), (4096, 1792), (768, 4096)]  # (N, K)


@triton.jit
def _coords(t, pid_m_per, num_pid_n, GROUP_M: tl.constexpr):
    group_size = GROUP_M * num_pid_n
    first_m = (t // group_size) * GROUP_M
    gm = min(pid_m_per - first_m, GROUP_M)
    return first_m + (t % group_size) % gm, (t % group_size) // gm


@triton.jit
def _kernel(a_desc, b_desc, c_desc, C, A_SCALE, B_SCALE, M, N, K,
            SCALED: tl.constexpr, B_KMAJOR: tl.constexpr, STORE: tl.constexpr,
            BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
            NUM_SMS: tl.constexpr):  # fmt: skip
    pid = tl.program_id(0)
    pid_m_per = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    tiles = pid_m_per * num_pid_n
    k_tiles = tl.cdiv(K, BLOCK_K)
    for t in tl.range(pid, tiles, NUM_SMS):
        pid_m, pid_n = _coords(t, pid_m_per, num_pid_n, GROUP_M)
        off_m = pid_m * BLOCK_M
        off_n = pid_n * BLOCK_N
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for kk in range(0, k_tiles):
            a = a_desc.load([off_m, kk * BLOCK_K])
            if B_KMAJOR:
                b = b_desc.load([off_n, kk * BLOCK_K]).T
            else:
                b = b_desc.load([kk * BLOCK_K, off_n])
            acc = tl.dot(a, b, acc)
        offs_m = off_m + tl.arange(0, BLOCK_M)
        offs_n = off_n + tl.arange(0, BLOCK_N)
        if SCALED:
            acc = acc * tl.load(A_SCALE + offs_m, mask=offs_m < M, other=0.0)[:, None]
            acc = acc * tl.load(B_SCALE + offs_n, mask=offs_n < N, other=0.0)[None, :]
        out = acc.to(C.dtype.element_ty)
        if STORE == 0:
            ptrs = C + offs_m.to(tl.int64)[:, None] * N + offs_n[None, :]
            tl.store(ptrs, out, mask=(offs_m < M)[:, None] & (offs_n < N)[None, :])
        elif STORE == 1:
            c_desc.store([off_m, off_n], out)
        else:
            halves = tl.reshape(out, (BLOCK_M, 2, BLOCK_N // 2))
            halves = tl.permute(halves, (0, 2, 1))
            lo, hi = tl.split(halves)
            c_desc.store([off_m, off_n], lo)
            c_desc.store([off_m, off_n + BLOCK_N // 2], hi)


def run(A, B, C, cfg, store, a_s=None, b_s=None):
    M, K = A.shape
    N = B.shape[1]
    kmajor = B.stride(1) != 1
    a_desc = TensorDescriptor.from_tensor(A, [cfg.BLOCK_M, cfg.BLOCK_K])
    b_desc = (TensorDescriptor.from_tensor(B.t(), [cfg.BLOCK_N, cfg.BLOCK_K]) if kmajor
              else TensorDescriptor.from_tensor(B, [cfg.BLOCK_K, cfg.BLOCK_N]))  # fmt: skip
    c_desc = TensorDescriptor.from_tensor(C, [cfg.BLOCK_M, cfg.BLOCK_N // (2 if store == 2 else 1)])
    sms = pm.sm_count(A.device)
    tiles = triton.cdiv(M, cfg.BLOCK_M) * triton.cdiv(N, cfg.BLOCK_N)
    grid = (min(sms, tiles),)
    dummy = a_s if a_s is not None else C
    _kernel[grid](a_desc, b_desc, c_desc, C, dummy, b_s if b_s is not None else dummy, M, N, K,
                  SCALED=a_s is not None, B_KMAJOR=kmajor, STORE=store, BLOCK_M=cfg.BLOCK_M, BLOCK_N=cfg.BLOCK_N,
                  BLOCK_K=cfg.BLOCK_K, GROUP_M=cfg.GROUP_M, NUM_SMS=grid[0], num_warps=cfg.num_warps,
                  num_stages=cfg.num_stages)  # fmt: skip


def _tma_store(fn, on):
    """fn with the package's TMA store forced on (128 x 256 tiles) or off while it runs."""
    return with_setting(pm, "TMA_STORE_BLOCK_N", 256 if on else None, fn)


def case(M, N, K, dtype, lines, rounds=1):
    torch.manual_seed(0)
    A = torch.randn(M, K, device="cuda")
    B = torch.randn(K, N, device="cuda") / K**0.5
    C = torch.empty(M, N, device="cuda", dtype=torch.bfloat16)
    if dtype == "bf16":
        A, B = A.bfloat16(), B.bfloat16()
        a_s = b_s = None
        ref = A.float() @ B.float()
        pkw = {}
        fns = {"cublas": lambda: torch.mm(A, B)}
    else:
        A = A.to(torch.float8_e4m3fn)
        B = B.t().contiguous().to(torch.float8_e4m3fn).t()
        a_s = torch.rand(M, 1, device="cuda") + 0.5
        b_s = torch.rand(1, N, device="cuda") + 0.5
        ref = (A.float() @ B.float()) * a_s * b_s
        pkw = dict(A_scale=a_s, B_scales=[b_s], fast_accum=True)
        fns = {"cublas": lambda: torch._scaled_mm(A, B, a_s, b_s, out_dtype=torch.bfloat16, use_fast_accum=True)}
    # The package: its default plan, whole tiles, whole tiles with the TMA store (pointer store otherwise).
    fns["pkg"] = _tma_store(lambda: pm.persistent_matmul(A, [B], outs=[C], **pkw), False)
    fns["pkg_whole"] = _tma_store(lambda: pm.persistent_matmul(A, [B], outs=[C], stream_k=False, **pkw), False)
    fns["pkg_whole_tma"] = _tma_store(lambda: pm.persistent_matmul(A, [B], outs=[C], stream_k=False, **pkw), True)
    cfg = pm.pick_config(A.dtype, M, [N], K)
    fs, bs = (a_s.view(-1), b_s.view(-1)) if a_s is not None else (None, None)
    for name, st in (("ptr", 0), ("tma", 1), ("tma2", 2)):
        fns[name] = lambda st=st: run(A, B, C, cfg, st, fs, bs)
    for name in ("pkg", "pkg_whole", "pkg_whole_tma", "ptr", "tma", "tma2"):
        C.fill_(float("nan"))
        try:
            fns[name]()
        except Exception as e:  # noqa: BLE001 - a variant that does not compile is a row, not the run
            print(f"  {name}: {type(e).__name__}: {str(e)[:200]}")
            fns.pop(name)
            continue
        err = ((C.float() - ref).norm() / ref.norm()).item()
        assert err < 3e-2, (name, err)
    g = {k: v for k, v in with_graphs(fns).items() if k.endswith("@graph")}
    # Rounds interleave the providers (a slow stretch of the GPU hits every provider alike); the
    # median over rounds per provider.
    runs = {k[:-6]: [] for k in g}
    for _ in range(rounds):
        for k, v in g.items():
            runs[k[:-6]].append(bench_us(v))
    res = {k: sorted(v)[len(v) // 2] for k, v in runs.items()}
    base = res["cublas"]
    row = f"{dtype:8s} M={M:5d} N={N:5d} K={K:5d} cfg={cfg.BLOCK_M}x{cfg.BLOCK_N}x{cfg.BLOCK_K} " + "  ".join(
        f"{k} {v:7.1f} ({base / v:.3f}x)" for k, v in res.items())
    print(row, flush=True)
    lines.append((dtype, res))


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--Ms", default="4096,8192")
    p.add_argument("--dtypes", default="bf16,fp8_row")
    p.add_argument("--Ns", default=None, help="only these N (comma-separated)")
    p.add_argument("--rounds", type=int, default=1, help="interleaved rounds per shape (median reported)")
    a = p.parse_args()
    print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}, Triton {triton.__version__}; "
          "us from CUDA graphs (median); (x) = cuBLAS time / this time")  # fmt: skip
    lines = []
    for dtype in a.dtypes.split(","):
        for M in map(int, a.Ms.split(",")):
            for N, K in SHAPES:
                if a.Ns and N not in [int(n) for n in a.Ns.split(",")]:
                    continue
                case(M, N, K, dtype, lines, a.rounds)
    import math

    for dtype in a.dtypes.split(","):
        rows = [r for d, r in lines if d == dtype]
        for k in ("pkg", "pkg_whole", "pkg_whole_tma", "ptr", "tma", "tma2"):
            got = [r["cublas"] / r[k] for r in rows if k in r]
            if got:
                print(f"geomean {dtype:8s} {k:5s} {math.exp(sum(map(math.log, got)) / len(got)):.3f} ({len(got)} shapes)")


if __name__ == "__main__":
    main()
