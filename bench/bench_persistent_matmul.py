"""Persistent matmul (plain, and consumer with flags pre-set) vs cuBLAS / _scaled_mm.

    python bench/bench_persistent_matmul.py [--quick] [--tune] [--out DIR]

Rows go to bench/results/persistent_matmul.csv (and DIR if given); the script
prints the geometric-mean ratio cuBLAS time / ours per dtype (>1: ours faster).
"""

import argparse
import itertools
import os
import shutil
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import (  # noqa: E402
    LLAMA_TP8_NK,
    append_rows,
    bench_us,
    env_columns,
    geomean,
    with_graphs,
    with_setting,
)

from mptp_kernels.kernels import persistent_matmul as pm  # noqa: E402

FP8 = torch.float8_e4m3fn


def make(M, N, K, kind):
    A = torch.randn(M, K, device="cuda") / 2
    B = torch.randn(N, K, device="cuda") / K**0.5
    if kind == "bf16":
        return A.bfloat16(), B.bfloat16().t().contiguous(), None, None
    A8, B8 = A.to(FP8), (B * 8).to(FP8).t()  # B column-major, as _scaled_mm wants
    if kind == "fp8_tensor":
        return A8, B8, torch.tensor(0.5, device="cuda"), torch.tensor(0.125, device="cuda")
    return A8, B8, torch.rand(M, 1, device="cuda") + 0.5, torch.rand(1, N, device="cuda") / 8


def providers(M, N, K, kind, cfg=None, W=8, kernels=("pointer", "tma", "tma_flat"), stream_k=True, tune_sk=False,
              lean=False):
    A, B, sa, sb = make(M, N, K, kind)
    if kind == "bf16":
        cublas = lambda: torch.mm(A, B)  # noqa: E731
        kw = {}
    else:
        cublas = lambda: torch._scaled_mm(A, B, sa, sb, out_dtype=torch.bfloat16, use_fast_accum=True)  # noqa: E731
        kw = dict(A_scale=sa, B_scales=[sb], out_dtype=torch.bfloat16, fast_accum=True)
    out = [torch.empty(M, N, device="cuda", dtype=torch.bfloat16)]
    flags = torch.ones(W, dtype=torch.int32, device="cuda")  # pre-set: all chunks arrived
    order = torch.arange(W, dtype=torch.int32, device="cuda")
    def run(kernel="auto", consumer=False, stream_k=None):
        extra = dict(num_chunks=W, order=order, flags=flags, epoch=1, mode=pm.MODE_CONSUMER) if consumer else {}
        return lambda: pm.persistent_matmul(A, [B], outs=out, config=cfg, kernel=kernel, stream_k=stream_k,
                                            **extra, **kw)  # fmt: skip

    # Correctness guard: a fast wrong kernel is worthless.
    ref = cublas().float()
    fns = {"cublas": cublas, "mptp": run(), "mptp_consumer": run(consumer=True)}
    if stream_k:  # the default path with whole tiles only, and with each way of splitting the last wave
        fns["mptp_whole_tiles"] = run(stream_k=False)
    # The default path with the masked pointer store everywhere (no TMA store of whole tiles):
    # where TMA_STORE_BLOCK_N is None (the default) the same kernel as "mptp".
    fns["mptp_ptr_store"] = with_setting(pm, "TMA_STORE_BLOCK_N", None, run())
    if stream_k and not lean:
        fns["mptp_split"] = run(stream_k="split")
        fns["mptp_stream"] = run(stream_k="stream")
        fns["mptp_consumer_split"] = run(consumer=True, stream_k="split")
    if cfg is not None and tune_sk:  # --tune --sk: this config with the split wherever it applies
        fns["mptp_sk"] = run(stream_k=True)
    for k in kernels:
        fns[f"mptp_{k}"] = run(k)
    for name in list(fns)[1:]:
        try:
            out[0].fill_(float("nan"))
            fns[name]()
            err = ((out[0].float() - ref).norm() / ref.norm()).item()
            assert err < 2e-2, f"rel err {err:.3e} vs cuBLAS"
        except Exception as e:  # noqa: BLE001 - a variant that does not compile here is reported, not fatal
            if name in ("mptp", "mptp_consumer"):
                raise
            print(f"{kind} M={M} N={N} K={K} {name}: dropped ({type(e).__name__}: {str(e)[:200]})", flush=True)
            del fns[name]
    return fns


def tune(kinds, Ms, out_dir, kernel="auto", Ns=None, sk=False):
    """Config sweep, each candidate timed from a CUDA graph (GPU time, no launch cost)."""

    def graph_us(fn):
        return bench_us(with_graphs({"f": fn})["f@graph"])

    cands = [pm.Config(*c) for c in [
        (128, 256, 64, 8, 8, 3), (128, 256, 64, 8, 8, 4), (128, 128, 64, 8, 4, 4), (128, 128, 64, 8, 8, 4),
        (256, 128, 64, 8, 8, 3), (128, 256, 128, 8, 8, 3), (128, 128, 128, 8, 8, 4), (128, 128, 128, 8, 4, 4),
        (64, 256, 64, 8, 4, 4), (128, 64, 64, 8, 4, 4), (64, 128, 64, 8, 4, 4), (64, 128, 128, 8, 4, 4),
        (128, 64, 128, 8, 4, 4), (64, 128, 64, 8, 4, 6),
    ]]  # fmt: skip
    lines = []
    for kind in kinds:
        for M, (N, K) in itertools.product(Ms, LLAMA_TP8_NK):
            if Ns and N not in Ns:
                continue
            base = graph_us(providers(M, N, K, kind, cands[0], kernels=())["cublas"])
            res = []
            for c in cands:
                if kind == "bf16" and c.BLOCK_K == 128 and c.num_stages > 3:
                    continue
                try:
                    fns = providers(M, N, K, kind, c, kernels=() if kernel == "auto" else (kernel,), stream_k=False,
                                    tune_sk=sk)  # fmt: skip
                    res.append((graph_us(fns["mptp" if kernel == "auto" else f"mptp_{kernel}"]), c))
                    if "mptp_sk" in fns:
                        res.append((graph_us(fns["mptp_sk"]), f"{c} stream-K"))
                except Exception as e:  # noqa: BLE001 - out of shared memory etc.
                    print(f"skip {c}: {type(e).__name__}")
            t, c = min(res, key=lambda x: x[0])
            lines.append(f"{kind} {kernel} M={M} N={N} K={K} cublas={base:.1f}us best={t:.1f}us ratio={base / t:.3f} {c}")
            print(lines[-1], flush=True)
    if out_dir:
        with open(os.path.join(out_dir, f"tune_{kernel}{'_sk' if sk else ''}.txt"), "a") as f:
            f.write("\n".join(lines) + "\n")


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--quick", action="store_true", help="M=8192 only")
    p.add_argument("--Ms", default="4096,8192,16384")
    p.add_argument("--tune", action="store_true", help="sweep configs instead of benchmarking")
    p.add_argument("--kinds", default="bf16,fp8_tensor,fp8_row")
    p.add_argument("--kernel", default="auto", help="--tune: which kernel family (persistent_matmul kernel=)")
    p.add_argument("--Ns", default=None, help="only these N (comma-separated)")
    p.add_argument("--sk", action="store_true", help="--tune: also each config with the stream-K split")
    p.add_argument("--out", default=None, help="also copy the CSV here")
    p.add_argument("--lean", action="store_true", help="only cuBLAS, the default path (plain, consumer), whole tiles and the pointer store")
    p.add_argument("--kernels", default="", help="also these kernel families forced (pointer,tma,tma_flat)")
    a = p.parse_args()
    Ms = [8192] if a.quick else [int(m) for m in a.Ms.split(",")]
    kinds = a.kinds.split(",")
    if a.tune:
        return tune(kinds, Ms, a.out, a.kernel, [int(n) for n in a.Ns.split(",")] if a.Ns else None, a.sk)
    envc = env_columns()
    rows, ratios = [], {(k, t): [] for k in kinds for t in ("", "@graph")}
    ptr_ratios = {}  # the same with the pointer store (provider mptp_ptr_store)
    for kind in kinds:
        for M, (N, K) in itertools.product(Ms, LLAMA_TP8_NK):
            if a.Ns and N not in [int(n) for n in a.Ns.split(",")]:
                continue
            fns = providers(M, N, K, kind, kernels=a.kernels.split(",") if a.kernels else (), lean=a.lean)
            # GPU time without host launch cost, for cuBLAS and ours alike (see bench/NOTES.md).
            fns.update(with_graphs({k: fns[k] for k in ("cublas", "mptp", "mptp_consumer", "mptp_whole_tiles",
                                                        "mptp_ptr_store", "mptp_split", "mptp_stream",
                                                        "mptp_consumer_split")
                                    if k in fns}))  # fmt: skip
            times = {name: bench_us(fn) for name, fn in fns.items()}
            for name, us in times.items():
                base = times["cublas@graph" if name.endswith("@graph") else "cublas"]
                rows.append({**envc, "dtype": "bf16" if kind == "bf16" else "fp8_e4m3",
                             "scale": {"bf16": "none", "fp8_tensor": "tensor", "fp8_row": "row"}[kind],
                             "M": M, "N": N, "K": K, "provider": name, "median_us": round(us, 2),
                             "tflops": round(2 * M * N * K / us / 1e6, 1),
                             "ratio_vs_cublas": round(base / us, 4)})  # fmt: skip
            for t in ("", "@graph"):
                if f"mptp{t}" in times and f"cublas{t}" in times:
                    ratios[(kind, t)].append(times[f"cublas{t}"] / times[f"mptp{t}"])
                if f"mptp_ptr_store{t}" in times and f"cublas{t}" in times:
                    ptr_ratios.setdefault((kind, t), []).append(times[f"cublas{t}"] / times[f"mptp_ptr_store{t}"])
            append_rows("persistent_matmul.csv", rows[-len(times):])  # per case: a cut-off run keeps its rows
            print(f"{kind:10s} M={M:5d} N={N:5d} K={K:5d} " + " ".join(f"{n} {t:7.1f}" for n, t in times.items())
                  + f"  ratio {times['cublas'] / times['mptp']:.3f}", flush=True)  # fmt: skip
    from common import RESULTS

    path = os.path.join(RESULTS, "persistent_matmul.csv")
    if a.out and os.path.abspath(a.out) != os.path.abspath(RESULTS):
        shutil.copy(path, os.path.join(a.out, "persistent_matmul.csv"))
    print("\ngeometric mean of cuBLAS time / mptp time (>= 1.0 means at least cuBLAS speed):")
    for (kind, t), r in ratios.items():
        ptr = ptr_ratios.get((kind, t))
        print(f"  {kind:10s} {'eager' if not t else 'CUDA graph':10s} {geomean(r):.3f}"
              + (f"   (pointer store: {geomean(ptr):.3f})" if ptr else ""))


if __name__ == "__main__":
    main()
