"""The dispatcher's cost model (mptp_kernels/ops/cost.py): its estimates against the H200 run it
was calibrated on, and the properties the decision must have whatever the constants."""

import os
import re

import pytest

from mptp_kernels.ops.cost import Link, Work, estimate, prefer_fused

RECORD = os.path.join(
    os.path.dirname(__file__), "..", "..", "bench", "results", "h200_record_74ef7b1.log"
)
LLAMA_TP8_NK = [(7168, 8192), (8192, 3584), (1280, 8192), (3584, 4096), (4096, 1792), (768, 4096)]
H200 = dict(sms=132, capability=(9, 0))
_ROW = re.compile(
    r"(\w+)\s+W=(\d+) M=\s*(\d+) N=\s*(\d+) K=\s*(\d+) path=(\w+) \| @graph: mptp\s+([\d.]+)us.*"
    r"@eager: mptp\s+([\d.]+)us"
)


def _record_rows():
    op, rows = None, []
    with open(RECORD) as f:
        for line in f:
            if line.startswith("== all_gather_matmul"):
                op = "ag"
            elif line.startswith("== matmul_reduce_scatter"):
                op = "rs"
            m = _ROW.match(line)
            if m:
                kind, W, M, N, K, path, graph_us, eager_us = m.groups()
                rows.append(
                    (
                        op,
                        kind,
                        int(W),
                        int(M),
                        int(N),
                        int(K),
                        path,
                        float(graph_us),
                        float(eager_us),
                    )
                )
    return rows


def _work(op, kind, M, N, K):
    fp8 = kind.startswith("fp8")
    return Work(op, M, K, N, 1 if fp8 else 2, 2, fp8)


def test_estimates_track_the_recorded_run():
    """Every row of the run of record (W = 8 loopback on the H200, both ops, bf16 and FP8
    row-wise, eager and from CUDA graphs): the estimate of the path the op took is within 25%
    of the measured time (the constants come from that run; 25%: its eager host times vary
    that much between shapes of one path)."""
    rows = _record_rows()
    assert len(rows) == 18, rows
    bad = []
    for op, kind, W, M, N, K, path, graph_us, eager_us in rows:
        w = _work(op, kind, M, N, K)
        for capturing, measured in ((False, eager_us), (True, graph_us)):
            reserve = 8 if capturing else 2  # the consumer's SMs left free on a shared GPU
            fused, ref = estimate(
                w, Link(W, shares_device=True, reserve_sms=reserve, **H200), capturing
            )
            est = fused if path == "fused" else ref
            if abs(est / measured - 1) > 0.25:
                bad.append(
                    (op, kind, N, K, path, "graph" if capturing else "eager", round(est), measured)
                )
    assert not bad, bad


@pytest.mark.parametrize("capturing", [False, True])
@pytest.mark.parametrize("op", ["ag", "rs"])
def test_one_rank_never_fuses(op, capturing):
    """W = 1: nothing to overlap, and the persistent kernel is not faster than cuBLAS."""
    for N, K in LLAMA_TP8_NK:
        ok, why = prefer_fused(
            Work(op, 16384, K, N, 2, 2, False), Link(1, shares_device=False, **H200), capturing
        )
        assert not ok and "cost model" in why and "MPTP_FORCE_FUSED" in why


@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("op", ["ag", "rs"])
def test_graphs_over_nvlink_fuse_every_llama_shape(op, fp8):
    """From CUDA graphs (no host time) on GPUs linked by NVLink, the communication a fused call
    hides is worth fusing for each Llama-3 TP-8 shape at M = 8192."""
    for N, K in LLAMA_TP8_NK:
        w = Work(op, 8192, K, N, 1 if fp8 else 2, 2, fp8)
        ok, why = prefer_fused(w, Link(8, shares_device=False, **H200), capturing=True)
        assert ok, (N, K, why)


def test_eager_host_time_decides_small_calls():
    """Eager: a call whose GPU time is far below the fused path's host time is not fused; a
    call far above it is, where there is communication to hide."""
    link = Link(8, shares_device=False, **H200)
    assert not prefer_fused(Work("ag", 1024, 1024, 1024, 2, 2, False), link)[0]
    assert prefer_fused(Work("ag", 65536, 8192, 28672, 2, 2, False), link)[0]


def test_estimates_grow_with_the_work():
    link = Link(8, shares_device=False, **H200)
    for op in ("ag", "rs"):
        last = (0.0, 0.0)
        for M in (1024, 4096, 16384, 65536):
            now = estimate(Work(op, M, 4096, 4096, 2, 2, False), link, capturing=True)
            assert now[0] > last[0] and now[1] > last[1], (op, M, now, last)
            last = now


def test_unknown_gpus_get_a_finite_estimate():
    """An architecture the table does not name still gets an estimate (a conservative rate)."""
    f, r = estimate(
        Work("ag", 8192, 4096, 4096, 2, 2, False),
        Link(4, sms=80, capability=(7, 5), shares_device=False),
    )
    assert 0 < f < 1e7 and 0 < r < 1e7
