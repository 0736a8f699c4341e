"""The fused all-gather-matmul in eager with and without copy-engine chunk copies (issue 14).

    python bench/diag_eager_copies.py [--kinds bf16,fp8_row] [--Ms 8192] [--world-size 8]

In eager the fused all-gather asks for copy-engine copies (cuMemcpyBatchAsync with the
prefer-overlap hint) and its consumer leaves 2 SMs free on a GPU its ranks share (since af158e4
not a call that gathers row-wise scales there: its "CE" column is then plain copies too); with
MPTP_CE_COPIES=0 the copies are plain and the consumer leaves MPTP_RESERVE_SMS (8), as under
CUDA-graph capture. For each Llama-3 TP-8 shape on a loopback group this times (median of
do_bench) the fused path eager with CE copies, eager without, and from a CUDA graph, and the
reference path eager, to tell what the copy mechanism costs or buys in eager.
"""

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from check_cost_model import _case  # noqa: E402
from common import LLAMA_TP8_NK, bench_us, with_env, with_graphs  # noqa: E402
from profile_loopback import PATHS  # noqa: E402

from mptp_kernels.symm.loopback import init_loopback_group, mirror_loopback_buffers  # noqa: E402


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--kinds", default="bf16,fp8_row,fp8_tensor")
    p.add_argument("--Ms", default="8192")
    p.add_argument("--world-size", type=int, default=8)
    a = p.parse_args()
    W = a.world_size
    g = init_loopback_group(W)
    fused, ref = dict(PATHS)["fused"], dict(PATHS)["reference"]
    print(f"W={W} loopback, {torch.cuda.get_device_name()}: us (median); fused eager with CE copies / "
          "without (MPTP_CE_COPIES=0) / from a graph; reference eager")
    for kind in a.kinds.split(","):
        for M in map(int, a.Ms.split(",")):
            for N, K in LLAMA_TP8_NK:
                fn, _ = _case("ag", g, W, M, N, K, kind)
                with_env(fused, fn)()
                mirror_loopback_buffers(g)
                fns = {"ce": with_env({**fused, "MPTP_CE_COPIES": "1"}, fn),
                       "plain": with_env({**fused, "MPTP_CE_COPIES": "0"}, fn),
                       "ref": with_env(ref, fn)}  # fmt: skip
                fns = with_graphs({"fused": with_env(fused, fn)}) | fns
                t = {k: bench_us(f) for k, f in fns.items() if k != "fused"}
                print(f"{kind:8s} M={M:5d} N={N:5d} K={K:5d}  fused eager CE {t['ce']:7.1f}  plain {t['plain']:7.1f}"
                      f"  graph {t['fused@graph']:7.1f}   reference eager {t['ref']:7.1f}", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
