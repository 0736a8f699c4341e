"""Where the host time of one fused call goes, without cProfile's distortion.

    python bench/profile_stages.py [--W 8] [--calls 300]

cProfile charges its own overhead to every Python call, so functions made of many small calls
look several times dearer than they are. Here a handful of stage functions are wrapped with a
perf_counter_ns timer (about 0.2 us each) and the real ops run on a loopback group (W simulated
ranks on one GPU, M = 8192 N = 4096 K = 1792), in bursts of a few calls from an idle GPU
(so that no launch waits for room in CUDA's queue). Printed per
op call: the op's host time, then each stage's calls and inclusive microseconds.
"""

import argparse
import itertools
import os
import sys
import time
from collections import defaultdict

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from profile_host import BURST, host_stats  # noqa: E402
from profile_loopback import PATHS as _PATHS  # noqa: E402

import mptp_kernels  # noqa: E402,F401
from mptp_kernels.kernels import launch as L  # noqa: E402
from mptp_kernels.kernels import persistent_matmul as pm  # noqa: E402
from mptp_kernels.kernels import poison  # noqa: E402
from mptp_kernels.ops import agreement, cost, dispatch, fused, reference, transport  # noqa: E402
from mptp_kernels.symm import primitives as P  # noqa: E402
from mptp_kernels.symm.loopback import init_loopback_group, mirror_loopback_buffers  # noqa: E402

PATHS = dict(_PATHS)  # path -> the environment that makes the op take it
TOTAL = defaultdict(int)
CALLS = defaultdict(int)


def _timed(name, fn):
    def wrapper(*a, **k):
        t = time.perf_counter_ns()
        try:
            return fn(*a, **k)
        finally:
            TOTAL[name] += time.perf_counter_ns() - t
            CALLS[name] += 1

    return wrapper


def _wrap_function(module, attr, name=None):
    """Replaces module.attr, and every other mptp module's global bound to the same function."""
    orig = getattr(module, attr)
    new = _timed(name or f"{module.__name__.split('.')[-1]}.{attr}", orig)
    for m in list(sys.modules.values()):
        if getattr(m, "__name__", "").startswith("mptp_kernels") and getattr(m, attr, None) is orig:
            setattr(m, attr, new)


def _wrap_method(cls, attr):
    setattr(cls, attr, _timed(f"{cls.__name__}.{attr}", getattr(cls, attr)))


STAGES = [
    (dispatch, "_run"), (dispatch, "_normalize"), (dispatch, "describe"), (dispatch, "_workspace"),
    (dispatch, "_link"), (cost, "prefer_fused"), (fused, "plan"), (agreement, "resolve"),
    (dispatch.env, "host_timeout_s_or_default"), (P, "check_errors"), (fused, "_begin"),
    (fused, "_ag_run"), (fused, "_rs_run"), (fused, "_reference_layout"), (fused, "_restride"),
    (pm, "persistent_matmul"), (pm, "_launch_tma"), (L, "launch"), (poison, "poison_if_error"),
    (P, "pull_chunks"), (P, "pull_at"), (P, "copy_guarded_at"), (P, "write_value"), (P, "write_value_at"),
    (P, "finish"), (reference, "all_gather"),
    (reference, "reduce_scatter"), (fused, "_finish"),
]  # fmt: skip


def loopback_ops(W: int, M: int = 8192, N: int = 4096, K: int = 1792):
    """(group name, {name: one call}) of the four profiled ops on a new loopback group of W:
    bf16 all-gather-matmul, FP8 row-wise all-gather-matmul, bf16 matmul-reduce-scatter, FP8
    row-wise matmul-reduce-scatter (bf16 out, fast accumulation)."""
    g = init_loopback_group(W)
    A = torch.randn(M // W, K, device="cuda").bfloat16()
    A_rs = torch.randn(M, K, device="cuda").bfloat16()
    B = (torch.randn(K, N, device="cuda") * K**-0.5).bfloat16()
    A8 = A.float().to(torch.float8_e4m3fn)
    B8 = B.float().t().contiguous().to(torch.float8_e4m3fn).t()
    sa = torch.rand(M // W, 1, device="cuda") + 0.5
    sb = torch.rand(1, N, device="cuda") + 0.5
    A8_rs = A_rs.float().to(torch.float8_e4m3fn)
    sa_rs = torch.rand(M, 1, device="cuda") + 0.5
    return g, {
        "all_gather_matmul bf16": lambda: torch.ops.mptp.fused_all_gather_matmul(A, [B], 0, g),
        "all_gather_scaled_matmul fp8 row": lambda: torch.ops.mptp.fused_all_gather_scaled_matmul(
            A8, [B8], sa, [sb], 0, g, [None], [None], [torch.bfloat16], [True]),
        "matmul_reduce_scatter bf16": lambda: torch.ops.mptp.fused_matmul_reduce_scatter(A_rs, B, "sum", 0, g),
        "scaled_matmul_reduce_scatter fp8 row": lambda: torch.ops.mptp.fused_scaled_matmul_reduce_scatter(
            A8_rs, B8, sa_rs, sb, "sum", 0, 0, g, [M, N], out_dtype=torch.bfloat16, use_fast_accum=True),
    }  # fmt: skip


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--W", type=int, default=8)
    p.add_argument("--calls", type=int, default=300)
    a = p.parse_args()
    M, N, K = 8192, 4096, 1792
    g, ops = loopback_ops(a.W, M, N, K)
    os.environ.update(PATHS["fused"])
    for fn in ops.values():
        fn()
    mirror_loopback_buffers(g)
    print(f"host microseconds per op call, W={a.W} loopback, M={M} N={N} K={K}, {a.calls} calls in bursts of "
          f"{BURST}, no stage timers (mean, median and min of the bursts):")  # fmt: skip
    for (name, fn), path in itertools.product(ops.items(), ("fused", "reference")):
        os.environ.update(PATHS[path])
        mean, med, low = host_stats(fn, a.calls)
        print(f"  {name + ', ' + path:45s} {mean:8.1f} {med:8.1f} {low:8.1f}", flush=True)
    print()
    for module, attr in STAGES:
        _wrap_function(module, attr)
    for attr in ("put_signal", "wait_signal", "barrier"):
        _wrap_method(P.SymmetricMemory, attr)
    for attr in ("all_gather", "reduce_scatter"):
        _wrap_method(transport.SymmTransport, attr)
    print(f"with stage timers: host microseconds per op call, W={a.W} loopback, M={M} N={N} K={K}, "
          f"{a.calls} calls (torch {torch.__version__})")  # fmt: skip
    for (name, fn), path in itertools.product(ops.items(), ("fused", "reference")):
        os.environ.update(PATHS[path])
        for _ in range(20):
            fn()
        torch.cuda.synchronize()
        TOTAL.clear()
        CALLS.clear()
        elapsed = 0
        for i in range(0, a.calls, BURST):  # bursts from an idle GPU: see profile_host.host_us
            t0 = time.perf_counter_ns()
            for _ in range(min(BURST, a.calls - i)):
                fn()
            elapsed += time.perf_counter_ns() - t0
            torch.cuda.synchronize()
        print(
            f"\n{name}, {path} path: {elapsed / a.calls / 1e3:.1f} us per call (with the stage timers)"
        )
        for stage in sorted(TOTAL, key=TOTAL.get, reverse=True):
            print(
                f"  {stage:40s} {CALLS[stage] / a.calls:5.1f} calls {TOTAL[stage] / a.calls / 1e3:8.1f} us"
            )


if __name__ == "__main__":
    main()
