"""What one fused call runs on the host, counted (issue 14): a deterministic profile (cProfile) of
each of the four profiled ops on a loopback group, per op call.

    python bench/profile_calls.py [--W 2] [--calls 200] [--top 40]

For each op (bench/profile_stages.loopback_ops, the fused path): the host microseconds per call
without the profiler (profile_host.host_stats), the Python and builtin calls per op call, and the
callables by own time and by calls per op call. cProfile's own cost per call inflates the times
(read them as shares); the call counts are exact. Where the samples of py-spy (spy_loop.py) say
"spread over many functions", this says which calls there are and how many.
"""

import argparse
import cProfile
import io
import os
import pstats
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from profile_host import host_stats  # noqa: E402
from profile_loopback import PATHS  # noqa: E402
from profile_stages import loopback_ops  # noqa: E402

import mptp_kernels  # noqa: E402,F401
from mptp_kernels.symm.loopback import mirror_loopback_buffers  # noqa: E402


def counted(fn, calls: int):
    """(pstats.Stats, total primitive calls per op call) of `calls` calls of fn, in bursts of 8."""
    pr = cProfile.Profile()
    for i in range(0, calls, 8):
        pr.enable()
        for _ in range(min(8, calls - i)):
            fn()
        pr.disable()
        torch.cuda.synchronize()
    st = pstats.Stats(pr)
    return st, st.total_calls / calls


def table(st, calls: int, key: str, top: int) -> str:
    """The top callables by `key` ("tottime" or "ncalls"): calls per op call, own and cumulative
    microseconds per op call (under the profiler)."""
    rows = []
    for (path, line, fn), (_cc, nc, tt, ct, _) in st.stats.items():
        where = f"{os.path.basename(path)}:{line}({fn})" if path != "~" else fn
        rows.append((nc / calls, tt / calls * 1e6, ct / calls * 1e6, where))
    rows.sort(key=(lambda r: -r[1]) if key == "tottime" else (lambda r: (-r[0], -r[1])))
    out = io.StringIO()
    out.write(f"  {'calls/op':>9} {'own us':>8} {'cum us':>8}  callable (sorted by {key})\n")
    for n, tt, ct, where in rows[:top]:
        out.write(f"  {n:9.2f} {tt:8.2f} {ct:8.2f}  {where}\n")
    return out.getvalue()


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--W", type=int, default=2)
    p.add_argument("--calls", type=int, default=200)
    p.add_argument("--top", type=int, default=40)
    a = p.parse_args()
    g, ops = loopback_ops(a.W)
    os.environ.update(dict(PATHS)["fused"])
    for fn in ops.values():
        fn()
    mirror_loopback_buffers(g)
    for name, fn in ops.items():
        mean, med, low = host_stats(fn, a.calls)
        st, per_call = counted(fn, a.calls)
        print(f"=== {name}, fused, W={a.W} loopback: host {med:.1f} us per call (median of bursts, no "
              f"profiler); {per_call:.1f} profiled calls per op call (torch {torch.__version__})")  # fmt: skip
        print(table(st, a.calls, "tottime", a.top))
        print(table(st, a.calls, "ncalls", a.top), flush=True)


if __name__ == "__main__":
    main()
