"""Regression tests from a hostile review of the CPU (gloo) reference path.

Each case asserts the exact outcome on every rank, within a hard timeout: the correct
result, or an error on every rank; never a hang, a process abort or a wrong value.
Before the fixes: a 10-D A differing past dim 8 aborted gloo on one rank and returned
garbage on the other; a rank that skipped a call left its peer's pending agreement to
pair with its next call (garbage, or a 30-minute gloo wait in the data collective);
gradients requested on one rank only left the other out of the backward's
reduce-scatter; a dtype torch.matmul refuses failed after the collective on one rank
only; a bad MPTP_TIMEOUT_S on one rank was read after its peers were waiting; a
one-element 3-D scale broke the reference after the gather; complex "avg" failed after
communicating; two threads interleaved their calls' collectives.

Cases that leave a group out of step run on a fresh subgroup of their own. The agreement
check is opt-in (MPTP_CHECK_AGREEMENT=1): without it the reference path sends exactly the
collectives of the unfused ops, and behaves as they do (tests/compile/test_rank_divergent.py).
"""

import datetime
import os
import random
import threading
import time

import pytest
import torch
import torch.distributed as dist

from dist.harness import Workers
from utils import randn

SEED = random.randrange(1 << 30)
ENV = {"MPTP_TIMEOUT_S": "3", "MPTP_CHECK_AGREEMENT": "1"}
TIMEOUT_S = 120  # hard bound on every multi-process run


@pytest.fixture(scope="module")
def hostile2():
    w = Workers(2, env=ENV)
    yield w
    w.close()


def _sub():
    """A fresh gloo group of every rank: a case that breaks it leaves the world group intact."""
    return dist.new_group(list(range(dist.get_world_size())), backend="gloo")


def _outcome(fn):
    try:
        fn()
        return "ok", ""
    except Exception as e:  # noqa: BLE001 - the outcome is what the test asserts
        return type(e).__name__, str(e)


def _deep_shapes():
    g, r = _sub(), dist.get_rank()
    A = torch.randn(*([1] * 8), 2 + r, 4)  # 10-D: only dim 8 differs between the ranks
    ag = _outcome(lambda: torch.ops.mptp.fused_all_gather_matmul(A, [torch.randn(4, 3)], 0, g.group_name))
    A9 = torch.randn(2, *([1] * 7), 4)  # 9-D output [2, 1 x 7, N]: N differs between the ranks
    rs = _outcome(lambda: torch.ops.mptp.fused_matmul_reduce_scatter(A9, torch.randn(4, 3 + r), "sum", 0, g.group_name))
    return ag, rs


def test_shapes_deeper_than_the_named_dims_must_agree(hostile2):
    for ag, rs in hostile2.run(_deep_shapes, timeout_s=TIMEOUT_S):
        assert ag[0] == "ValueError" and "disagree" in ag[1], ag
        assert rs[0] == "ValueError" and "disagree" in rs[1], rs


def _skip_then_continue(seed):
    g, r = _sub(), dist.get_rank()
    A, B = randn((4, 8), seed + r), randn((8, 3), seed + 9)
    call = lambda: torch.ops.mptp.fused_all_gather_matmul(A, [B], 0, g.group_name)  # noqa: E731
    if r == 0:
        out = [_outcome(call)]
    else:  # rank 1 skips the first call, and calls again after rank 0 has timed out
        time.sleep(float(ENV["MPTP_TIMEOUT_S"]) + 1.5)
        out = []
    return out + [_outcome(call), _outcome(call)]


def test_a_rank_that_skips_a_call_never_gets_a_result(hostile2):
    """Rank 0 times out (naming rank 1); every later call on the group raises on both ranks."""
    r0, r1 = hostile2.run(_skip_then_continue, SEED, timeout_s=TIMEOUT_S)
    assert r0[0][0] == "RuntimeError" and "peer rank(s) [1]" in r0[0][1], r0[0]
    for kind, msg in r0[1:] + r1:
        assert kind == "RuntimeError" and "restart the job" in msg, (kind, msg)


def _one_rank_wants_grads():
    g, r = _sub(), dist.get_rank()
    A = torch.randn(4, 8, requires_grad=r == 0)
    B = torch.randn(8, 3)
    ag = _outcome(lambda: torch.ops.mptp.fused_all_gather_matmul(A, [B], 0, g.group_name))
    rs = _outcome(lambda: torch.ops.mptp.fused_matmul_reduce_scatter(A, B, "sum", 0, g.group_name))
    # Allowed: a B frozen on one rank (all-gather-matmul's dB is local), and anything under no_grad.
    Bf = torch.randn(8, 3, requires_grad=r == 0)
    A2 = torch.randn(4, 8, requires_grad=True)
    frozen = _outcome(lambda: torch.ops.mptp.fused_all_gather_matmul(A2, [Bf], 0, g.group_name)[1][0].sum().backward())
    with torch.no_grad():
        nograd = _outcome(lambda: torch.ops.mptp.fused_matmul_reduce_scatter(A, B, "sum", 0, g.group_name))
    return ag, rs, frozen, nograd


def test_gradients_requested_on_one_rank_only_raise_everywhere(hostile2):
    """Where the backward would communicate on some ranks only, every rank raises in the forward."""
    for ag, rs, frozen, nograd in hostile2.run(_one_rank_wants_grads, timeout_s=TIMEOUT_S):
        assert ag[0] == "ValueError" and "backward_collective" in ag[1], ag
        assert rs[0] == "ValueError" and "backward_collective" in rs[1], rs
        assert frozen == ("ok", "") and nograd == ("ok", ""), (frozen, nograd)


def _unsupported_dtype():
    g, r = _sub(), dist.get_rank()
    K = 0 if r else 4  # K may differ per rank; with K = 0 the matmul would not even run
    A, B = torch.zeros(4, K, dtype=torch.uint16), torch.zeros(K, 6, dtype=torch.uint16)
    return _outcome(lambda: torch.ops.mptp.fused_matmul_reduce_scatter(A, B, "sum", 0, g.group_name))


def test_a_dtype_matmul_refuses_is_a_value_error_before_communicating(hostile2):
    for kind, msg in hostile2.run(_unsupported_dtype, timeout_s=TIMEOUT_S):
        assert kind == "ValueError" and "torch.matmul does not support" in msg, (kind, msg)


def _bad_env_on_one_rank():
    g, r = _sub(), dist.get_rank()
    old = os.environ.get("MPTP_TIMEOUT_S")
    if r == 1:
        os.environ["MPTP_TIMEOUT_S"] = "0"
    try:
        return _outcome(lambda: torch.ops.mptp.fused_all_gather_matmul(torch.randn(4, 8), [torch.randn(8, 3)], 0,
                                                                        g.group_name))  # fmt: skip
    finally:
        os.environ["MPTP_TIMEOUT_S"] = old


def test_a_bad_timeout_on_one_rank_raises_on_every_rank(hostile2):
    r0, r1 = hostile2.run(_bad_env_on_one_rank, timeout_s=TIMEOUT_S)
    assert r1[0] == "ValueError" and "MPTP_TIMEOUT_S" in r1[1], r1
    assert r0[0] == "ValueError" and "peer rank 1 rejected" in r0[1] and "MPTP_TIMEOUT_S" in r0[1], r0


def _odd_scales_and_dtypes(seed):
    W, r = dist.get_world_size(), dist.get_rank()
    FP8 = torch.float8_e4m3fn
    shards = [randn((4, 16), seed + p, scale=0.5).to(FP8) for p in range(W)]
    B = randn((8, 16), seed + 50, scale=0.5).to(FP8).t()
    g = dist.group.WORLD.group_name
    sa, sb = torch.full((1, 1, 1), 0.5), torch.tensor(2.0)  # a one-element 3-D A_scale: tensor-wise
    _, (out,) = torch.ops.mptp.fused_all_gather_scaled_matmul(shards[r], [B], sa, [sb], 0, g, [None], [None],
                                                              [torch.float32], [False])  # fmt: skip
    ref = torch.cat(shards).double() @ B.double()  # 0.5 * 2.0 = 1
    torch.testing.assert_close(out.double(), ref, rtol=1e-6, atol=1e-6)
    # A 3-D B_scale: torch._scaled_mm rejects it; a ValueError naming it, before communicating.
    for call in (lambda: torch.ops.mptp.fused_all_gather_scaled_matmul(shards[r], [B], sa, [sa], 0, g, [None], [None],
                                                                       [torch.float32], [False]),
                 lambda: torch.ops.mptp.fused_scaled_matmul_reduce_scatter(shards[r], B, sb, sa, "sum", 0, 0, g, None,
                                                                           None, None, torch.float32, False)):  # fmt: skip
        kind, msg = _outcome(call)
        assert kind == "ValueError" and "B_scale" in msg and "at most 2 dims" in msg, (kind, msg)
    # complex "avg": the sum divided by W, in the dtype
    As = [torch.randn(4, 8, dtype=torch.complex64, generator=torch.Generator().manual_seed(seed + p)) for p in range(W)]
    Bc = torch.randn(8, 5, dtype=torch.complex64, generator=torch.Generator().manual_seed(seed + 77))
    got = torch.ops.mptp.fused_matmul_reduce_scatter(As[r], Bc, "avg", 0, dist.group.WORLD.group_name)
    want = (sum(a.to(torch.complex128) @ Bc.to(torch.complex128) for a in As) / W).chunk(W)[r]
    assert got.dtype == torch.complex64
    torch.testing.assert_close(got.to(torch.complex128), want, rtol=1e-5, atol=1e-5)


def test_one_element_nd_scales_and_complex_avg(hostile2):
    hostile2.run(_odd_scales_and_dtypes, SEED, timeout_s=TIMEOUT_S)


def _two_threads(seed):
    W, r = dist.get_world_size(), dist.get_rank()
    g = _sub()
    shards = [randn((3, 8), seed + p) for p in range(W)]
    B = randn((8, 4), seed + 40)
    want = torch.cat(shards) @ B
    bad = []

    def worker():
        for _ in range(10):
            _, (out,) = torch.ops.mptp.fused_all_gather_matmul(shards[r], [B], 0, g.group_name)
            if not torch.allclose(out, want, rtol=1e-5, atol=1e-5):
                bad.append(out)

    threads = [threading.Thread(target=worker) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not any(t.is_alive() for t in threads), "a thread hung"
    assert not bad, f"{len(bad)} of 20 calls returned a wrong result"


def test_calls_from_two_threads_do_not_interleave_their_collectives(hostile2):
    hostile2.run(_two_threads, SEED, timeout_s=TIMEOUT_S)


def _rank_2_skips(seed):
    g, r = _sub(), dist.get_rank()
    if r == 2:
        return "ok", ""
    return _outcome(lambda: torch.ops.mptp.fused_all_gather_matmul(randn((2, 8), seed), [randn((8, 3), seed)], 0,
                                                                    g.group_name))  # fmt: skip


def test_the_timeout_names_the_peer_that_did_not_arrive():
    w = Workers(3, env=ENV)
    try:
        res = w.run(_rank_2_skips, SEED, timeout_s=TIMEOUT_S)
    finally:
        w.close()
    for kind, msg in res[:2]:
        assert kind == "RuntimeError" and "peer rank(s) [2]" in msg and "MPTP_TIMEOUT_S" in msg, (kind, msg)


# -- a second round (no processes unless needed) ---------------------------------------------------


@pytest.mark.parametrize("raw", ["inf", "1e20", "nan", "0.0005", "0", "-1"])
def test_a_timeout_a_timedelta_cannot_hold_is_rejected(monkeypatch, raw):
    """inf / 1e20 overflowed timedelta after the agreement was posted (a peer then paired its data
    collective with the next call's agreement: a wrong value); under 1 ms it meant no timeout."""
    from mptp_kernels import env

    monkeypatch.setenv("MPTP_TIMEOUT_S", raw)
    with pytest.raises(ValueError, match="MPTP_TIMEOUT_S"):
        env.timeout_s()


def test_the_late_peer_diagnosis_never_blocks_on_the_store(monkeypatch):
    """A stalled store host made the timeout error wait for the store's own timeout."""
    import time as _time

    from mptp_kernels.ops import agreement

    class Stalled:
        def check(self, keys):
            _time.sleep(30)

        def get(self, key):
            _time.sleep(30)

    monkeypatch.setattr(agreement, "_store", lambda: Stalled())
    t0 = _time.monotonic()
    assert agreement._missing("g", 2, (0, 1), wait_s=0.5) == ""
    assert _time.monotonic() - t0 < 5


def test_parameters_take_the_bounded_collectives(pg1):
    from mptp_kernels.ops import transport

    assert transport._bounded_group(torch.nn.Parameter(torch.randn(2, 2)), pg1) is not None
    assert transport._bounded_group(torch.randn(2, 2), pg1) is not None


def test_one_element_nd_a_scale_under_fake_tensors(pg1):
    from torch._subclasses.fake_tensor import FakeTensorMode

    FP8 = torch.float8_e4m3fn
    with FakeTensorMode():
        A = torch.empty(8, 16, dtype=FP8)
        B = torch.empty(8, 16, dtype=FP8).t()
        A_full, (out,) = torch.ops.mptp.fused_all_gather_scaled_matmul(
            A, [B], torch.ones(1, 1, 1), [torch.ones(())], 0, pg1, [None], [None], [torch.float32], [False])
        assert tuple(out.shape) == (8, 8) and out.dtype == torch.float32


def _fnuz_reduce_scatter(seed):
    W, r = dist.get_world_size(), dist.get_rank()
    g = _sub()
    dt = torch.float8_e4m3fnuz
    As = [randn((4, 8), seed + p, scale=0.25).to(dt) for p in range(W)]
    B = randn((8, 6), seed + 30, scale=0.25).to(dt)
    out = torch.ops.mptp.fused_matmul_reduce_scatter(As[r], B, "sum", 0, g.group_name)
    partials = [(a.double() @ B.double()).chunk(W)[r] for a in As]
    want = sum(partials)
    assert out.dtype == dt
    # Each partial rounds to the FP8 dtype (as the unfused A @ B does), and so does their sum: each
    # rounding is within half an ulp, 2**-4 of its value (3 mantissa bits), or half the subnormal
    # spacing (2**-11). Where the partials cancel, their roundings dominate the small sum: the bound
    # is on the partials' magnitudes (twice the worst case), not on the sum's.
    bound = 2 * (2**-4 * (sum(p.abs() for p in partials) + want.abs()) + (W + 1) * 2**-11)
    err = (out.double() - want).abs()
    assert bool((err <= bound).all()), (err - bound).max().item()
    # and the group still works (entered together: the file's MPTP_TIMEOUT_S of 3 s bounds how far
    # apart ranks may arrive, and a loaded 2-core CI machine once exceeded it here). Bounded: where
    # the call above timed out on one rank only (load), a plain barrier would wait for good.
    dist.monitored_barrier(timeout=datetime.timedelta(seconds=60))
    torch.ops.mptp.fused_all_gather_matmul(torch.randn(2, 8), [torch.randn(8, 3)], 0, g.group_name)


def test_a_dtype_gloo_cannot_sum_is_reduced_in_fp32(hostile2):
    """float8_e4m3fnuz passed the checks, then gloo raised "Invalid scalar type", reported as a
    timeout, and the group was marked broken for a valid call."""
    hostile2.run(_fnuz_reduce_scatter, SEED, timeout_s=TIMEOUT_S)


# -- a call rejected on one rank ------------------------------------------------------------------


@pytest.fixture(scope="module")
def plain2():
    """Agreement off (the default); MPTP_TIMEOUT_S bounds a regression to a timeout, not a hang."""
    w = Workers(2, env={"MPTP_TIMEOUT_S": "20", "MPTP_CHECK_AGREEMENT": ""})
    yield w
    w.close()


def _rejected_on_one_rank(seed, op, bad_ranks):
    """Two calls per rank; in the first, `bad_ranks` pass a bad argument. Returns per call the
    outcome: ("ok", max error vs float64) or (exception type, message)."""
    g, r, W = _sub(), dist.get_rank(), dist.get_world_size()
    FP8 = torch.float8_e4m3fn
    out = []
    for call in (1, 2):
        bad = call == 1 and r in bad_ranks
        shards = [randn((4, 8), seed + 10 * call + p) for p in range(W)]
        B = randn((8, 6), seed + 100 + call)
        A_full = torch.cat(shards)
        try:
            if op == "ag":
                Bc = randn((7, 6), seed) if bad else B  # bad: K 7, A has K 8
                A_got, (C,) = torch.ops.mptp.fused_all_gather_matmul(shards[r], [Bc], 0, g.group_name)
                err = max((A_got.double() - A_full.double()).abs().max().item(),
                          (C.double() - A_full.double() @ B.double()).abs().max().item())  # fmt: skip
            elif op == "ag_scaled_row":
                A8 = [s.to(FP8) for s in shards]
                sa = [randn((4, 1), seed + 500 + p).abs() + 0.5 for p in range(W)]
                B8 = B.to(FP8).t().contiguous().t()
                sb = (randn((1, 6), seed + 600).abs() + 0.5).to(torch.float64 if bad else torch.float32)  # bad: fp64
                A_got, (C,) = torch.ops.mptp.fused_all_gather_scaled_matmul(
                    A8[r], [B8], sa[r], [sb], 0, g.group_name, [None], [None], [torch.float32], [False])  # fmt: skip
                ref = (torch.cat(A8).double() * torch.cat(sa).double()) @ (B8.double() * sb.double())
                err = (C.double() - ref).abs().max().item() / ref.abs().max().item()
            else:  # "rs": rank p's partial is shards[p] @ B; rank r gets rows 2r, 2r + 1 of their sum
                Bc = randn((7, 6), seed) if bad else B
                C = torch.ops.mptp.fused_matmul_reduce_scatter(shards[r], Bc, "sum", 0, g.group_name)
                ref = sum(s.double() @ B.double() for s in shards)[2 * r : 2 * r + 2]
                err = (C.double() - ref).abs().max().item()
            out.append(("ok", err))
        except Exception as e:  # noqa: BLE001 - the outcome is what the test asserts
            out.append((type(e).__name__, str(e)))
    return out


@pytest.mark.parametrize("op", ["ag", "ag_scaled_row", "rs"])
def test_a_call_rejected_on_one_rank_raises_everywhere_with_the_check(hostile2, op):
    """Found by a hostile review: with the agreement check off (the default), a rank that
    rejected its call raised before the collective, and its peer's collective paired with that
    rank's next call (silently wrong values on both). With MPTP_CHECK_AGREEMENT=1 every rank
    raises and the next call is right everywhere (the README says to set it for this)."""
    res = hostile2.run(_rejected_on_one_rank, SEED, op, (1,), timeout_s=TIMEOUT_S)
    (kind0, msg0), (kind1, msg1) = res[0][0], res[1][0]
    assert kind1 == "ValueError" and ("B" in msg1 or "scale" in msg1), res
    assert kind0 == "ValueError" and "rank 1" in msg0, res
    for rank_res in res:  # the second call: right on every rank
        kind, err = rank_res[1]
        assert kind == "ok" and err < (1e-5 if op != "ag_scaled_row" else 1e-2), res


def test_a_call_rejected_on_every_rank_raises_everywhere_and_stays_in_step(plain2):
    res = plain2.run(_rejected_on_one_rank, SEED, "ag", (0, 1), timeout_s=TIMEOUT_S)
    assert [x[0][0] for x in res] == ["ValueError", "ValueError"], res
    assert all(x[1][0] == "ok" and x[1][1] < 1e-5 for x in res), res
