"""Which path each Llama-3 TP-8 call takes by default (no MPTP_FORCE_FUSED), eager and under
CUDA-graph capture, on a loopback group, and why: a check that the dispatcher's cost model runs
(a failing model silently takes the reference path; its reason says so).

    python bench/check_default_paths.py [--kinds bf16,fp8_row,fp8_tensor] [--M 8192] [--world-size 8]
"""

import argparse
import logging
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from check_cost_model import _case  # noqa: E402
from common import LLAMA_TP8_NK  # noqa: E402

import mptp_kernels  # noqa: E402
from mptp_kernels.symm.loopback import init_loopback_group, mirror_loopback_buffers  # noqa: E402


class _Reasons(logging.Handler):
    def __init__(self):
        super().__init__()
        self.lines, self.every = [], []

    def emit(self, record):
        self.lines.append(record.getMessage())
        self.every.append(record.getMessage())


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--kinds", default="bf16,fp8_row,fp8_tensor")
    p.add_argument("--M", type=int, default=8192)
    p.add_argument("--world-size", type=int, default=8)
    a = p.parse_args()
    for k in ("MPTP_FORCE_FUSED", "MPTP_DISABLE_FUSED"):
        os.environ.pop(k, None)
    os.environ["MPTP_LOG"] = "1"
    reasons = _Reasons()
    logging.getLogger("mptp_kernels").addHandler(reasons)
    logging.getLogger("mptp_kernels").setLevel(logging.INFO)
    W = a.world_size
    g = init_loopback_group(W)
    for kind in a.kinds.split(","):
        for N, K in LLAMA_TP8_NK:
            fn, _ = _case("ag", g, W, a.M, N, K, kind)
            fn()
            mirror_loopback_buffers(g)
            paths = []
            for capture in (False, True):
                before = dict(mptp_kernels.path_counts())
                reasons.lines.clear()
                if capture:
                    s = torch.cuda.Stream()
                    s.wait_stream(torch.cuda.current_stream())
                    with torch.cuda.stream(s), torch.cuda.graph(torch.cuda.CUDAGraph(), stream=s):
                        fn()
                else:
                    fn()
                torch.cuda.synchronize()
                after = mptp_kernels.path_counts()
                took = [k[1] for k, v in after.items() if v > before.get(k, 0)]
                why = [r for r in reasons.lines if "cost model" in r or "reference path" in r]
                paths.append(f"{'graph' if capture else 'eager'} {'/'.join(took)}" + (f" ({why[-1]})" if why and "reference" in took else ""))
            print(f"ag {kind:10s} W={W} M={a.M} N={N:5d} K={K:5d}: " + "; ".join(paths), flush=True)
    # NOTE: each reason is logged once (the first call of a shape, its warm-up, says it; later
    # calls of the same shape stay silent): failures are counted over every line logged.
    failed = sum("cost model failed" in r for r in reasons.every)
    print("cost model failures:", failed)
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
