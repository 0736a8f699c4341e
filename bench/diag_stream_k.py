"""Where the stream-K split's time goes (issue 14): GPU times from CUDA graphs of the same shapes
with whole tiles and with the split, and a split whose shares are whole tiles (no pieces).

    python bench/diag_stream_k.py
"""

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import bench_us, with_graphs  # noqa: E402

from mptp_kernels.kernels import persistent_matmul as pm  # noqa: E402

BIG = pm.Config(128, 256, 64, 8, 8, 3)
SMALL = pm.Config(128, 128, 64, 8, 4, 4)


def case(M, N, K, variants):
    A = torch.randn(M, K, device="cuda").bfloat16()
    B = (torch.randn(K, N, device="cuda") / K**0.5).bfloat16()
    out = torch.empty(M, N, device="cuda", dtype=torch.bfloat16)
    ref = (A.float() @ B.float())
    fns = {"cublas": lambda: torch.mm(A, B)}
    for name, (cfg, sk) in variants.items():
        fns[name] = (lambda cfg=cfg, sk=sk: pm.persistent_matmul(A, [B], outs=[out], config=cfg, kernel="tma",
                                                                stream_k=sk))  # fmt: skip
        out.fill_(float("nan"))
        fns[name]()
        err = ((out.float() - ref).norm() / ref.norm()).item()
        assert err < 2e-2, (name, err)
    g = with_graphs(fns)
    res = {k: bench_us(v) for k, v in g.items() if k.endswith("@graph")}
    print(f"M={M} N={N} K={K} " + "  ".join(f"{k[:-6]} {v:.1f}" for k, v in res.items()), flush=True)


def main():
    torch.manual_seed(0)
    for M, N, K in [(8192, 768, 4096), (4096, 768, 4096), (4096, 1280, 8192)]:
        tiles = (M // 128) * -(-N // 256)
        case(M, N, K, {"dp_big": (BIG, False), "stream_big": (BIG, pm.stream_k_tiles(tiles, 132, K // 64)),
                       "split_big": (BIG, True), "dp_small": (SMALL, False), "split_small": (SMALL, True),
                       "stream_big_132": (BIG, 132)})  # fmt: skip
    # 264 tiles of 128 x 256: split over 132 shares, each exactly two whole tiles (no pieces).
    case(8448, 1024, 4096, {"dp_big": (BIG, False), "stream_big_whole": (BIG, 264)})


if __name__ == "__main__":
    main()
