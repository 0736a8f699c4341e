"""Host-side cost per call (CPU microseconds, GPU left to queue) and where it goes.

    python bench/profile_host.py [--calls 300]

Small matmuls are launch-bound in eager mode: this prints, for each piece of
the fused path and for cuBLAS, the host time per call measured back-to-back
without synchronising (its rows also appended to results/profile_host.csv, or
$MPTP_RESULTS_DIR/profile_host.csv), then a cProfile of the heaviest callables.
"""

import argparse
import cProfile
import io
import os
import pstats
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_persistent_matmul import make  # noqa: E402
from common import append_rows, env_columns, with_setting  # noqa: E402

from mptp_kernels.kernels import launch as L  # noqa: E402
from mptp_kernels.kernels import persistent_matmul as pm  # noqa: E402
from mptp_kernels.symm.primitives import pull_chunks, write_value  # noqa: E402

BURST = 8  # calls per timed burst (see host_us)


def host_us(fn, calls, burst=BURST):
    """Host microseconds per call (the mean over all calls): see host_stats."""
    return host_stats(fn, calls, burst)[0]


def host_stats(fn, calls, burst=BURST):
    """(mean, median, min) host microseconds per call, timed in bursts of `burst` calls from an
    idle GPU; the median and min are over the bursts' per-call times (a burst that the OS
    interrupted, or that met a busy host, counts once instead of skewing the mean).

    NOTE: calls issued back to back without end fill CUDA's launch queue (about a thousand
    launches) whenever the GPU is slower than the host, and the host then waits in a launch:
    that measures GPU time, not host time. A burst of a few calls stays far below the queue.
    """
    for _ in range(10):
        fn()
    torch.cuda.synchronize()
    per_burst, total, done = [], 0.0, 0
    while done < calls:
        n = min(burst, calls - done)
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        dt = time.perf_counter() - t0
        total += dt
        per_burst.append(dt / n)
        done += n
        torch.cuda.synchronize()
    return total / calls * 1e6, statistics.median(per_burst) * 1e6, min(per_burst) * 1e6


def launcher_only(fn):
    """fn's last Triton launcher call (kernel.run with its bound arguments), replayed as is: the
    floor of a launch through Triton's launcher, all of our Python left out."""
    fn()
    fn()  # the first call of a key is Triton's own launch; later ones are direct
    rec = {}
    saved = []
    for k in list(L._KERNELS.values()):
        run = k.run
        saved.append((k, run))

        def spy(*a, run=run):
            rec["call"] = (run, a)
            return run(*a)

        k._run = spy  # CompiledKernel.run returns _run (Triton 3.3 to 3.8)
    try:
        fn()
        torch.cuda.synchronize()
    finally:
        for k, run in saved:
            k._run = run
    run, a = rec["call"]
    return lambda: run(*a)


def with_launch_flag(fn, flag):
    """fn with kernels.launch's switch `flag` off (C_PREPARE: the arguments bound by the Python
    loop; INT_POINTERS: CUDA tensors handed to the launcher as tensors)."""
    return with_setting(L, flag, False, fn)


def profile(fn, calls, top=25, sorts=("tottime",)):
    for _ in range(10):
        fn()
    torch.cuda.synchronize()
    pr = cProfile.Profile()
    pr.enable()
    for _ in range(calls):
        fn()
    pr.disable()
    torch.cuda.synchronize()
    s = io.StringIO()
    for key in sorts:
        pstats.Stats(pr, stream=s).sort_stats(key).print_stats(top)
    return s.getvalue()


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--calls", type=int, default=300)
    p.add_argument("--rounds", type=int, default=3)
    a = p.parse_args()
    M, N, K, W = 8192, 768, 4096, 8
    fns = {}
    A, B, _, _ = make(M, N, K, "bf16")
    out = [torch.empty(M, N, device="cuda", dtype=torch.bfloat16)]
    fns["torch.mm bf16"] = lambda: torch.mm(A, B)
    for k in ("auto", "pointer", "tma", "tma_flat"):
        fns[f"persistent_matmul bf16 {k}"] = lambda k=k: pm.persistent_matmul(A, [B], outs=out, kernel=k)
    A8, B8, sa, sb = make(M, N, K, "fp8_row")
    fns["torch._scaled_mm fp8 row"] = lambda: torch._scaled_mm(A8, B8, sa, sb, out_dtype=torch.bfloat16,
                                                               use_fast_accum=True)  # fmt: skip
    for k in ("pointer", "tma"):
        fns[f"persistent_matmul fp8 row {k}"] = lambda k=k: pm.persistent_matmul(
            A8, [B8], outs=out, A_scale=sa, B_scales=[sb], kernel=k)  # fmt: skip
    # Same run, same shapes: CUDA tensors handed to the launcher as tensors (the old way), the
    # arguments bound by the Python loop instead of the C binder (the old way), and the launcher
    # call alone (what is left once all of our Python is gone).
    for k in ("auto", "pointer"):
        fns[f"persistent_matmul bf16 {k}, tensor pointers"] = with_launch_flag(
            fns[f"persistent_matmul bf16 {k}"], "INT_POINTERS")  # fmt: skip
    for k in ("auto", "pointer"):
        fns[f"persistent_matmul bf16 {k}, Python binder"] = with_launch_flag(
            fns[f"persistent_matmul bf16 {k}"], "C_PREPARE")  # fmt: skip
    # Same run: without the launch memo (pm.MEMO), and also with the launch plan, descriptor
    # templates and static constexprs rebuilt on every call (the host path before either was
    # cached; clearing four dicts costs well under a microsecond).
    def uncached(fn):
        def call():
            pm._TMA_PLANS.clear(), pm._DESCS.clear(), L._STATIC.clear()
            return fn()

        return call

    def memo(fn, on):
        return with_setting(pm, "MEMO", on, fn)

    for name in ("persistent_matmul bf16 auto", "persistent_matmul fp8 row tma"):
        fns[f"{name}, launch memo"] = memo(fns[name], True)
        fns[f"{name}, no launch memo"] = memo(fns[name], False)
        fns[f"{name}, no memo, plans rebuilt per call"] = memo(uncached(fns[name]), False)

    for k in ("auto", "pointer"):
        try:
            fns[f"Triton launcher alone, bf16 {k}"] = launcher_only(fns[f"persistent_matmul bf16 {k}"])
        except Exception as e:  # noqa: BLE001 - a row, not the run
            print(f"launcher row {k} skipped: {type(e).__name__}: {e}")
    flags = torch.ones(W, dtype=torch.int32, device="cuda")
    order = torch.arange(W, dtype=torch.int32, device="cuda")
    fns["persistent_matmul bf16 consumer"] = lambda: pm.persistent_matmul(
        A, [B], outs=out, num_chunks=W, order=order, flags=flags, epoch=1, mode=pm.MODE_CONSUMER)  # fmt: skip
    fns["persistent_matmul bf16 consumer, no launch memo"] = memo(fns["persistent_matmul bf16 consumer"], False)
    rows = M // W
    peers = [A[i * rows : (i + 1) * rows].clone() for i in range(W)]
    A_full = torch.empty_like(A)
    scratch = torch.zeros(W, dtype=torch.int32, device="cuda")
    pulls = [(A_full[i * rows : (i + 1) * rows], peers[i], scratch[i]) for i in range(1, W)]
    fns["pull_chunks x7"] = lambda: pull_chunks(pulls, 1)
    fns["write_value"] = lambda: write_value(scratch[0], 1)
    fns["tensor.zero_ (int32 x8)"] = lambda: scratch.zero_()
    side = torch.cuda.Stream()
    fns["stream.wait_stream"] = lambda: side.wait_stream(torch.cuda.current_stream())

    try:  # the whole op on a world of one (validation, dispatch, layout, matmul)
        import torch.distributed as dist

        import mptp_kernels

        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29533")
        dist.init_process_group("gloo", rank=0, world_size=1)
        g = dist.group.WORLD.group_name
        mptp_kernels.enable_symm_mem_for_group(g)
        os.environ["MPTP_FORCE_FUSED"] = "1"
        fns["op fused_all_gather_matmul W=1"] = lambda: torch.ops.mptp.fused_all_gather_matmul(A, [B], 0, g)
        fns["op fused_all_gather_matmul W=1, no launch memo"] = memo(fns["op fused_all_gather_matmul W=1"], False)
        fns["op fused_scaled_matmul_reduce_scatter W=1"] = lambda: torch.ops.mptp.fused_scaled_matmul_reduce_scatter(
            A8, B8, sa, sb, "sum", 0, 0, g, [M, N], out_dtype=torch.bfloat16, use_fast_accum=True)  # fmt: skip
    except Exception as e:  # noqa: BLE001 - the op rows are optional
        print(f"op rows skipped: {type(e).__name__}: {e}")

    print(f"host microseconds per call, {a.calls} calls in bursts of {BURST} (M={M} N={N} K={K}); "
          f"{a.rounds} rounds, every row once per round:")  # fmt: skip
    print(f"  {'':52s} {'mean':>8s} {'median':>8s} {'min':>8s}  (median of the rounds' mean, median, min)")
    res = {name: [] for name in fns}
    for _ in range(a.rounds):  # rows interleaved: a slow phase of the host hits every row alike
        for name, fn in fns.items():
            try:
                res[name].append(host_stats(fn, a.calls))
            except Exception as e:  # noqa: BLE001
                res[name] = f"failed: {type(e).__name__}: {str(e)[:200]}"
    rows = []
    for name, r in res.items():
        if isinstance(r, str):
            print(f"  {name:52s} {r}")
            continue
        stats = [statistics.median(x[i] for x in r) for i in range(3)]
        print(f"  {name:52s} " + " ".join(f"{v:8.1f}" for v in stats), flush=True)
        rows.append({"M": M, "N": N, "K": K, "row": name, "mean_us": round(stats[0], 1),
                     "median_us": round(stats[1], 1), "min_us": round(stats[2], 1)})  # fmt: skip
    try:  # the rows above are printed already: a failure here loses only the CSV
        env = env_columns()
        if rows:
            print(f"rows appended to {append_rows('profile_host.csv', [{**env, **r} for r in rows])}")
    except Exception as e:  # noqa: BLE001
        print(f"CSV not written: {type(e).__name__}: {e}")
    for name in ("persistent_matmul bf16 auto", "persistent_matmul fp8 row pointer", "op fused_all_gather_matmul W=1"):
        if name in fns:
            print(f"\n=== cProfile: {name} ===")
            print(profile(fns[name], a.calls))


if __name__ == "__main__":
    main()
