"""The host-time floor of a fused call: its driver calls alone, replayed without our Python (issue 14).

    python bench/profile_floor.py [--W 2] [--calls 200]

One call of each fused op on a loopback group (W simulated ranks on one GPU, M = 8192 N = 4096
K = 1792, as profile_stages.py) is recorded: every call into the extension (signals, waits, the
guarded copy, the copy-engine pulls and their flag memops, finish), every Triton launcher call
(the matmul, the reduce-scatter's sum), every event record / stream wait, record_stream and
output allocation (torch.empty), in order, with their arguments. The recording is then replayed
as it is -- the same driver calls on the same addresses, with the GPU protocol intact (each
replay signals and waits like the call did) -- and timed like the op itself (host microseconds
per call, bursts from an idle GPU: profile_host.host_stats). What remains of the op's time
beyond the replay is our Python (validation, agreement, dispatch, plans, glue); the replay is
what any implementation of this design pays, less ctypes' own cost per call (about a
microsecond each). Rows are printed and appended to results/profile_floor.csv (or
$MPTP_RESULTS_DIR).
"""

import argparse
import os
import sys
from collections import Counter

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import append_rows, env_columns  # noqa: E402
from profile_host import BURST, host_stats  # noqa: E402
from profile_loopback import PATHS  # noqa: E402
from profile_stages import loopback_ops  # noqa: E402

import mptp_kernels  # noqa: E402,F401
from mptp_kernels.kernels import launch as L  # noqa: E402
from mptp_kernels.kernels import persistent_matmul as pm  # noqa: E402
from mptp_kernels.symm import _C  # noqa: E402
from mptp_kernels.symm.loopback import mirror_loopback_buffers  # noqa: E402


class _Recorder:
    """Stands in for the extension (a ctypes CDLL): each function call is logged, then made."""

    def __init__(self, real, log):
        self._real, self._log = real, log

    def __getattr__(self, name):
        fn = getattr(self._real, name)

        def call(*a):
            self._log.append((name, fn, a, {}))
            return fn(*a)

        return call


def record(fn):
    """(result of fn(), [(kind, callable, args, kwargs)]): every driver-level call fn made."""
    log = []
    saved = []

    def patch(obj, attr, kind):
        orig = getattr(obj, attr)

        def spy(*a, **k):
            log.append((kind, orig, a, k))
            return orig(*a, **k)

        saved.append((obj, attr, orig))
        setattr(obj, attr, spy)

    kernels = {id(k): k for k in L._KERNELS.values()}
    for entry in pm._MEMO.values():
        kernels.setdefault(id(entry[0]), entry[0])
    for k in kernels.values():
        run = k.run  # CompiledKernel.run returns _run (Triton 3.3 to 3.8)
        saved.append((k, "_run", run))

        def spy(*a, run=run):
            log.append(("triton launcher", run, a, {}))
            return run(*a)

        k._run = spy
    real_lib = _C._lib
    _C._lib = _Recorder(real_lib, log)
    patch(torch.cuda.Event, "record", "event record")
    patch(torch.cuda.Stream, "wait_event", "stream wait_event")
    patch(torch.Tensor, "record_stream", "record_stream")
    patch(torch, "empty", "torch.empty")
    try:
        out = fn()
        torch.cuda.synchronize()
    finally:
        _C._lib = real_lib
        for obj, attr, orig in reversed(saved):
            setattr(obj, attr, orig)
    return out, log


def replay(log):
    def run():
        for _, f, a, k in log:
            f(*a, **k)

    return run


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--W", type=int, default=2)
    p.add_argument("--calls", type=int, default=200)
    a = p.parse_args()
    M, N, K = 8192, 4096, 1792
    g, ops = loopback_ops(a.W, M, N, K)
    os.environ.update(dict(PATHS)["fused"])
    for fn in ops.values():
        for _ in range(3):
            fn()
    mirror_loopback_buffers(g)
    torch.cuda.synchronize()
    envc = env_columns()
    rows = []
    print(f"host microseconds per call, W={a.W} loopback, M={M} N={N} K={K}, {a.calls} calls in bursts of {BURST} "
          "(mean, median, min of the bursts); the floor: the op's recorded driver calls replayed alone")  # fmt: skip
    keep = []
    for name, fn in ops.items():
        op = host_stats(fn, a.calls)
        out, log = record(fn)
        keep.append(out)  # the replay writes where this call's outputs live: they must stay allocated
        floor = host_stats(replay(log), a.calls)
        kinds = Counter(k for k, *_ in log)
        print(f"  {name:36s} op {op[0]:7.1f} {op[1]:7.1f} {op[2]:7.1f}   floor {floor[0]:7.1f} {floor[1]:7.1f} "
              f"{floor[2]:7.1f}   ({len(log)} calls: " + ", ".join(f"{n} {k}" for k, n in sorted(kinds.items())) + ")",
              flush=True)  # fmt: skip
        for what, st in (("op", op), ("floor", floor)):
            rows.append({**envc, "op": name, "W": a.W, "M": M, "N": N, "K": K, "what": what,
                         "mean_us": round(st[0], 1), "median_us": round(st[1], 1), "min_us": round(st[2], 1),
                         "driver_calls": len(log)})  # fmt: skip
    torch.cuda.synchronize()
    append_rows("profile_floor.csv", rows)


if __name__ == "__main__":
    main()
