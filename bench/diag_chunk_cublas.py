"""What a cuBLAS-per-chunk consumer could give the fused all-gather (issue 14, small N).

    python bench/diag_chunk_cublas.py [--kinds bf16,fp8_row] [--Ms 4096,8192] [--world-size 8]

Issue 14 names, for small N, "a second consumer that waits on the chunk flags at stream level
and runs cuBLAS per chunk group". Its matmul time can be no better than cuBLAS run on the
chunk groups one after another, with nothing else on the GPU. For each Llama-3 TP-8 shape this
times, from CUDA graphs (median of do_bench), on one stream:
  cublas        one cuBLAS call on the whole gathered A (torch.mm / torch._scaled_mm, out=);
  cublas/G      the same rows in G groups of W/G chunks, one cuBLAS call per group (out= slices):
                the best such a consumer can do with G stream-level waits (G = W: one per chunk);
  mptp          our persistent kernel as the fused path's consumer, flags pre-set (no waits).
A ratio is cublas (whole) / the row's time (>= 1: as fast as one cuBLAS call).
"""

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_persistent_matmul import make  # noqa: E402
from common import LLAMA_TP8_NK, bench_us, env_columns, with_graphs  # noqa: E402

from mptp_kernels.kernels import persistent_matmul as pm  # noqa: E402


def fns_for(M, N, K, kind, W):
    A, B, sa, sb = make(M, N, K, kind)
    C = torch.empty(M, N, device="cuda", dtype=torch.bfloat16)

    def mm(rows):
        a = A[rows]
        if kind == "bf16":
            return lambda: torch.mm(a, B, out=C[rows])
        s = sa[rows] if sa.numel() > 1 else sa
        return lambda: torch._scaled_mm(a, B, s, sb, out_dtype=torch.bfloat16, use_fast_accum=True, out=C[rows])

    def grouped(G):
        step = M // G
        parts = [mm(slice(g * step, (g + 1) * step)) for g in range(G)]

        def run():
            for p in parts:
                p()

        return run

    fns = {"cublas": mm(slice(0, M))}
    for G in sorted({2, 4, W}):
        if M % G == 0 and G <= W:
            fns[f"cublas/{G}"] = grouped(G)
    flags = torch.ones(W, dtype=torch.int32, device="cuda")
    order = torch.arange(W, dtype=torch.int32, device="cuda")
    kw = {} if kind == "bf16" else dict(A_scale=sa, B_scales=[sb], out_dtype=torch.bfloat16, fast_accum=True)
    fns["mptp"] = lambda: pm.persistent_matmul(A, [B], outs=[C], num_chunks=W, order=order, flags=flags, epoch=1,
                                               mode=pm.MODE_CONSUMER, **kw)  # fmt: skip
    # Every provider computes the same C: checked against the whole cuBLAS call.
    fns["cublas"]()
    ref = C.float().clone()
    for name, fn in fns.items():
        C.fill_(float("nan"))
        fn()
        torch.cuda.synchronize()
        err = (C.float() - ref).abs().max().item()
        tol = 2e-2 * ref.abs().max().item() + 1e-3
        if not err <= tol:
            raise AssertionError(f"{kind} M={M} N={N} K={K} {name}: max error {err} > {tol}")
    return fns


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--kinds", default="bf16,fp8_row")
    p.add_argument("--Ms", default="4096,8192")
    p.add_argument("--world-size", type=int, default=8)
    a = p.parse_args()
    W = a.world_size
    e = env_columns()
    print(f"# {e['gpu']}, torch {e['torch']}, Triton {e['triton']}, tree {e['commit']}; W = {W} chunks; "
          "us from CUDA graphs (median); ratio = one cuBLAS call / row")  # fmt: skip
    for kind in a.kinds.split(","):
        for M in map(int, a.Ms.split(",")):
            for N, K in LLAMA_TP8_NK:
                fns = fns_for(M, N, K, kind, W)
                graphs = {k[: -len("@graph")]: f for k, f in with_graphs(fns).items() if k.endswith("@graph")}
                t = {k: bench_us(f) for k, f in graphs.items()}
                whole = t["cublas"]
                cols = "  ".join(f"{k} {v:7.1f} ({whole / v:.3f})" for k, v in t.items())
                print(f"{kind:8s} M={M:5d} N={N:5d} K={K:5d}  {cols}", flush=True)


if __name__ == "__main__":
    main()
