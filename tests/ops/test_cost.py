"""The dispatcher's cost model (mptp_kernels/ops/cost.py): its picks against the H100 run it
was calibrated on, and the properties the decision must have whatever the constants."""

import csv
import os

import pytest

from mptp_kernels.ops.cost import Link, Work, estimate, prefer_fused

# The runs the constants come from: both paths of each op forced and timed in one run (W = 8
# loopback on an H100, bench/check_cost_model.py). The record (9134f4e, --plans) also timed the
# fused path with whole default tiles, what an FP8 consumer now runs (SK_FP8_CONSUMER): its FP8
# all-gather rows are read from those. The run before it (47c8526) is held for bf16 only: its FP8
# consumer ran the large-tile plan.
RESULTS = os.path.join(os.path.dirname(__file__), "..", "..", "bench", "results")
RECORD = os.path.join(RESULTS, "h100_cost_model_plans_9134f4e.csv")
BEFORE = os.path.join(RESULTS, "h100_cost_model_47c8526.csv")
# Other runs on other H100 machines: two earlier ones (7f43c97, 1f014ba; whole tiles then) and the
# first after the recalibration (73425a8, not fitted to). Their GPU times agree with the record's
# within the run-to-run noise; their hosts were slower and noisier (eager calls up to 2x the
# record's; in 73425a8 the FP8 all-gather's reference took 859 us in eager for 127 us of GPU
# time, where the two paths' host times are within 4% of each other on the record), so only
# their CUDA-graph rows are held.
EARLIER = [os.path.join(RESULTS, f"h100_cost_model_{c}.csv") for c in ("7f43c97", "1f014ba", "73425a8")]
# The reduce-scatter's matmul is the TMA kernel since 8dadce7 (the pointer kernel before: the runs
# above): its rows are held on the run after that change (00c978a, H200, both paths forced), and
# only the all-gather's rows on the runs above.
RS_RECORD = os.path.join(RESULTS, "h200_cost_model_rs_00c978a.csv")
# ... and on an H100 after the refit (8fb6b35, not fitted to).
RS_AFTER = os.path.join(RESULTS, "h100_cost_model_rs_8fb6b35.csv")
# The host times changed since those runs: the fused all-gather's transfers became one C call
# (406ed43) and the call memo came (261ac37), so the fused path's eager host time fell from about
# 343 us to 237 at W = 8 (results/h100_profile_floor_90b1cc3.txt). The model's fused host time was
# refitted to that (session 20); this run, both ops and both paths timed on one host, is held for
# every row, eager too (not fitted to). The older runs' eager rows timed the older code's host.
CURRENT = os.path.join(RESULTS, "h100_cost_model_b936c3c.csv")
# A second run of the same code after the refit (34195eb, not fitted to). One of its eager rows is
# an outlier: the fused bf16 all-gather at N = 4096, K = 1792 took 528 us there, 216 us in the
# loopback bench of the same call minutes later (results/h100_loopback_34195eb.txt).
CURRENT_2 = os.path.join(RESULTS, "h100_cost_model_34195eb.csv")
LLAMA_TP8_NK = [(7168, 8192), (8192, 3584), (1280, 8192), (3584, 4096), (4096, 1792), (768, 4096)]
H200 = dict(sms=132, capability=(9, 0))


def _record(path=RECORD):
    """{(op, dtype, W, M, N, K): {provider: measured us}} of a run (default: the run of record)."""
    rows = {}
    with open(path) as f:
        for r in csv.DictReader(f):
            key = (r["op"], r["dtype"], int(r["world_size"]), int(r["M"]), int(r["N"]), int(r["K"]))
            rows.setdefault(key, {})[r["provider"]] = float(r["median_us"])
    for (op, dtype, *_), m in rows.items():  # what an FP8 consumer runs now, where timed
        if op == "ag" and dtype != "bf16":
            m.update({p.replace("_whole_tiles", ""): v for p, v in list(m.items()) if "_whole_tiles" in p})
    return rows


def _picks(path=RECORD, dtypes=("bf16", "fp8_row"), ops=None):
    """(case, mode, measured fused, measured reference, the model's pick) per row and mode; ops:
    the runs before the reduce-scatter's TMA producer hold their all-gather rows only."""
    ops = ops or (("ag", "rs") if path in (RS_RECORD, RS_AFTER, CURRENT, CURRENT_2) else ("ag",))
    out = []
    for (op, dtype, W, M, N, K), m in _record(path).items():
        if dtype not in dtypes or op not in ops:
            continue
        fp8 = dtype != "bf16"
        w = Work(op, M, K, N, 1 if fp8 else 2, 2, fp8, ce_copies=dtype != "fp8_row")
        for capturing, suffix in ((False, ""), (True, "@graph")):
            # The consumer's SMs left free on a shared GPU: all of MPTP_RESERVE_SMS where its copies
            # are plain (capture; the row-wise scaled call since af158e4), 2 where they ask for a
            # copy engine.
            reserve = 8 if capturing or not w.ce_copies else 2
            fused, ref = estimate(w, Link(W, shares_device=True, reserve_sms=reserve, **H200), capturing)
            out.append(((op, dtype, N, K), "graph" if capturing else "eager", m["fused" + suffix],
                        m["reference" + suffix], "fused" if fused < ref else "reference"))  # fmt: skip
    return out


def test_the_model_picks_well_on_the_current_code():
    """Every row of the run of the current code (the all-gather in bf16 and FP8 row-wise, the
    reduce-scatter in bf16; the six Llama-3 TP-8 shapes at M = 8192, eager and from CUDA graphs;
    not fitted to): the path the model picks is at most 10% slower than the faster one from CUDA
    graphs, and at most 30% in eager, where both paths are host-bound on most rows and the same
    call's host time varies 20-30% between rows. (Before the refit of the fused path's host
    time, 14 of its 36 picks were the slower path, eager regrets up to 51%.)"""
    picks = _picks(CURRENT)
    assert len(picks) == 36, len(picks)
    bad = [p for p in picks if _regret(*p[2:]) > (0.10 if p[1] == "graph" else 0.30)]
    assert not bad, bad
    wrong = sum(_regret(*p[2:]) > 0 for p in picks)
    assert wrong <= 7, wrong


@pytest.mark.parametrize("path", [CURRENT, CURRENT_2])
def test_eager_picks_cost_little_in_total_on_the_current_code(path):
    """Both runs of the current code: the eager picks of all 18 rows together take at most 8%
    longer than always taking the faster path (2.0% and 5.5% measured; with the fused host time
    before the refit 10.2% and 6.9%), and every graph pick is within 10% of the faster path."""
    picks = _picks(path)
    assert len(picks) == 36, len(picks)
    eager = [p for p in picks if p[1] == "eager"]
    took = sum(p[2] if p[4] == "fused" else p[3] for p in eager)
    best = sum(min(p[2], p[3]) for p in eager)
    assert took <= 1.08 * best, (took, best)
    _graph_picks_hold(picks, 36)


def _graph_picks_hold(picks, n):
    assert len(picks) == n, len(picks)
    bad = [p for p in picks if p[1] == "graph" and _regret(*p[2:]) > 0.10]
    assert not bad, bad


def test_graph_picks_hold_on_the_runs_of_record():
    """From CUDA graphs (no host time) on the runs the GPU terms were fitted on: every pick
    within 10% of the faster path."""
    _graph_picks_hold(_picks() + _picks(RS_RECORD), 36)


def test_reduce_scatter_graph_picks_hold_on_the_run_after_the_refit():
    """The H100 run after the reduce-scatter's refit (8fb6b35, not fitted to), from CUDA graphs."""
    _graph_picks_hold(_picks(RS_AFTER), 12)


def _regret(fused, ref, pick):
    return (fused if pick == "fused" else ref) / min(fused, ref) - 1


def test_bf16_graph_picks_hold_on_the_run_before():
    """The run before the record (same GPU code for bf16, another machine), from CUDA graphs."""
    _graph_picks_hold(_picks(BEFORE, dtypes=("bf16",)), 12)


@pytest.mark.parametrize("path", EARLIER)
def test_graph_picks_hold_on_earlier_runs(path):
    """From CUDA graphs (no host time) the picks stay within 10% of the faster path on the other
    runs. (Their eager rows are not held: those hosts were up to 2x slower and
    noisier, and the eager picks follow the host.)"""
    picks = [p for p in _picks(path) if p[1] == "graph"]
    assert len(picks) == 12, len(picks)
    bad = [p for p in picks if _regret(*p[2:]) > 0.10]
    assert not bad, bad


def test_shared_gpu_graphs_never_fuse_bf16():
    """From CUDA graphs on a GPU its ranks share, the fused bf16 all-gather lost to the
    reference on every row of the run of record (its transfers cannot overlap the matmul there):
    the model picks the reference on each of those rows. (Not on every shape: where the
    matmul takes under about 70 us and N > 1024 the model's fixed costs favour the fused path.)"""
    for case, mode, fused, ref, pick in _picks():
        if mode == "graph" and case[0] == "ag" and case[1] == "bf16":
            assert pick == "reference" and fused > ref, (case, fused, ref)


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
    """Eager: a call whose GPU time is far below both paths' host times takes the path of the
    lower host time: against NCCL's functional collectives (a reference of a few launches) the
    reference; against the package's own transport, the fused path, whose host time is now the
    lower (237 against 265 us modelled at W = 8; 223 against 244 measured, b936c3c). A call far
    above them is fused where there is communication to hide."""
    nccl = Link(8, shares_device=False, symm_reference=False, **H200)
    symm = Link(8, shares_device=False, **H200)
    tiny = Work("ag", 1024, 1024, 1024, 2, 2, False)
    assert not prefer_fused(tiny, nccl)[0]
    assert prefer_fused(tiny, symm)[0]
    for link in (nccl, symm):
        assert prefer_fused(Work("ag", 65536, 8192, 28672, 2, 2, False), link)[0]


def test_estimates_grow_with_the_work():
    link = Link(8, shares_device=False, **H200)
    for op in ("ag", "rs"):
        last = (0.0, 0.0)
        for M in (1024, 4096, 16384, 65536):
            now = estimate(Work(op, M, 4096, 4096, 2, 2, False), link, capturing=True)
            assert now[0] > last[0] and now[1] > last[1], (op, M, now, last)
            last = now


@pytest.mark.parametrize("shares_device", [False, True])
@pytest.mark.parametrize("capturing", [False, True])
@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("op", ["ag", "rs"])
def test_more_columns_are_never_estimated_faster(op, fp8, capturing, shares_device):
    """Each path's estimate never falls as N grows (N = 1 .. 4096, across the small-N factor's
    ramp), at several M and K."""
    link = Link(8, shares_device=shares_device, reserve_sms=8 if shares_device else 0, **H200)
    for M, K in ((64, 4096), (4096, 4096), (8192, 16384)):
        last = (0.0, 0.0)
        for N in range(1, 4097):
            now = estimate(Work(op, M, K, N, 1 if fp8 else 2, 2, fp8), link, capturing)
            assert now[0] >= last[0] and now[1] >= last[1], (M, K, N, now, last)
            last = now


def test_unknown_gpus_get_a_finite_estimate():
    """An architecture the table does not name still gets an estimate (a conservative rate)."""
    f, r = estimate(
        Work("ag", 8192, 4096, 4096, 2, 2, False),
        Link(4, sms=80, capability=(7, 5), shares_device=False),
    )
    assert 0 < f < 1e7 and 0 < r < 1e7
