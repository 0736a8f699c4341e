"""Ranks that disagree get a clear error on every rank, never a hang or a silent result.

CPU, gloo, reference path with MPTP_CHECK_AGREEMENT=1 (one small collective per
call). Each case asserts the exact outcome on every rank: the correct result,
or the same ValueError (or a RuntimeError naming the missing peer) within the
case's hard timeout. The GPU twin (the fused path, where the check rides on
the workspace's host rendezvous and is always on) is tests/dist/test_safety_gpu.py.
"""

import random

import pytest
import torch
import torch.distributed as dist

from dist.harness import Workers
from utils import assert_matmul_close, randn

SEED = random.randrange(1 << 30)
ENV = {"MPTP_CHECK_AGREEMENT": "1", "MPTP_TIMEOUT_S": "5"}


@pytest.fixture(scope="module")
def agree2():
    w = Workers(2, env=ENV)
    yield w
    w.close()


def _g():
    return dist.group.WORLD.group_name


def _expect_value_error(fn, *needles):
    try:
        fn()
    except ValueError as e:
        msg = str(e)
        for n in needles:
            assert n in msg, f"{n!r} not in: {msg}"
        return msg
    raise AssertionError("expected a ValueError on this rank, the call returned")


def _ag_mismatch(seed, what):
    r = dist.get_rank()
    M, K, N, dtype = 8, 16, 12, torch.float16
    if r == 1:
        if what == "M":
            M = 6
        elif what == "K":
            K = 8
        elif what == "dtype":
            dtype = torch.bfloat16
        elif what == "empty":
            M = 0
        elif what == "gather_dim":
            pass
    A = randn((2, M, K), seed + r).to(dtype)
    B = randn((K, N), seed + 9).to(dtype)
    gd = 1 if (what == "gather_dim" and r == 1) else 0
    return _expect_value_error(lambda: torch.ops.mptp.fused_all_gather_matmul(A, [B], gd, _g()), "disagree")


@pytest.mark.parametrize("what", ["M", "K", "dtype", "empty", "gather_dim"])
def test_all_gather_matmul_disagreement_raises_on_every_rank(agree2, what):
    msgs = agree2.run(_ag_mismatch, SEED, what, timeout_s=60)
    assert all("rank 1 called" in m for m in msgs), msgs


def _rs_mismatch(seed, what):
    r = dist.get_rank()
    M, K, N, sd = 8, 16, 12, 0
    if r == 1:
        if what == "M":
            M = 6
        elif what == "N":
            N = 10
        elif what == "scatter_dim":
            sd = 1
    A = randn((M, K), seed + r)
    B = randn((K, N), seed + 9)
    return _expect_value_error(
        lambda: torch.ops.mptp.fused_matmul_reduce_scatter(A, B, "sum", sd, _g()), "disagree")


@pytest.mark.parametrize("what", ["M", "N", "scatter_dim"])
def test_matmul_reduce_scatter_disagreement_raises_on_every_rank(agree2, what):
    agree2.run(_rs_mismatch, SEED, what, timeout_s=60)


def _one_rank_rejects(seed):
    r = dist.get_rank()
    A = randn((8, 16), seed + r)
    # Rank 1's B has the wrong number of rows: only rank 1 can see it.
    B = randn((16 if r == 0 else 15, 12), seed + 9)
    return _expect_value_error(lambda: torch.ops.mptp.fused_all_gather_matmul(A, [B], 0, _g()), "Bs[0]")


def test_bad_input_on_one_rank_raises_on_every_rank(agree2):
    msgs = agree2.run(_one_rank_rejects, SEED, timeout_s=60)
    assert "peer rank 1 rejected" in msgs[0], msgs[0]


def _allowed_differences(seed):
    """Per-rank N (all-gather) and per-rank K (reduce-scatter) are allowed: correct results."""
    W, r = dist.get_world_size(), dist.get_rank()
    shards = [randn((4, 16), seed + i) for i in range(W)]
    B = randn((16, 8 + 4 * r), seed + 50 + r, dtype=torch.float64, scale=0.25)
    A_out, (out,) = torch.ops.mptp.fused_all_gather_matmul(shards[r], [B.float()], 0, _g())
    full = torch.cat(shards)
    assert torch.equal(A_out, full)
    assert_matmul_close(out, full.double() @ B, full @ B.float())
    # Reduce-scatter with K differing per rank (a rank's slice of a sharded contraction).
    Ks = [8 + 8 * i for i in range(W)]
    As = [randn((4 * W, Ks[i]), seed + 70 + i) for i in range(W)]
    Bs = [randn((Ks[i], 6), seed + 90 + i, dtype=torch.float64, scale=0.25) for i in range(W)]
    out = torch.ops.mptp.fused_matmul_reduce_scatter(As[r], Bs[r].float(), "sum", 0, _g())
    ref = sum(As[i].double() @ Bs[i] for i in range(W)).chunk(W)[r]
    eager = sum(As[i] @ Bs[i].float() for i in range(W)).chunk(W)[r]
    assert_matmul_close(out, ref, eager)


def test_allowed_per_rank_differences_give_correct_results(agree2):
    agree2.run(_allowed_differences, SEED, timeout_s=60)


def _other_op(seed):
    """Rank 1 skips an all-gather-matmul and calls a matmul-reduce-scatter instead."""
    r = dist.get_rank()
    A, B = randn((8, 16), seed), randn((16, 8), seed + 1)
    if r == 0:
        call = lambda: torch.ops.mptp.fused_all_gather_matmul(A, [B], 0, _g())  # noqa: E731
    else:
        call = lambda: torch.ops.mptp.fused_matmul_reduce_scatter(A, B, "sum", 0, _g())  # noqa: E731
    return _expect_value_error(call, "disagree")


def test_a_rank_calling_another_op_raises_on_every_rank(agree2):
    agree2.run(_other_op, SEED, timeout_s=60)


def _skips(seed):
    import time

    r = dist.get_rank()
    if r == 1:
        return None  # never calls
    A, B = randn((8, 16), seed), randn((16, 8), seed + 1)
    t0 = time.time()
    with pytest.raises(RuntimeError) as info:
        torch.ops.mptp.fused_all_gather_matmul(A, [B], 0, _g())
    assert time.time() - t0 < 30
    msg = str(info.value)
    assert "fused_all_gather_matmul" in msg and "MPTP_TIMEOUT_S" in msg and _g() in msg, msg
    return msg


def test_a_rank_that_skips_the_call_times_out_with_a_clear_error():
    # Own workers: the skipped collective leaves the group out of step on purpose.
    w = Workers(2, env={**ENV, "MPTP_TIMEOUT_S": "3"})
    try:
        msgs = w.run(_skips, SEED, timeout_s=90)
    finally:
        w.close()
    assert msgs[0] is not None


def _skips_op(op):
    import time

    r, g = dist.get_rank(), _g()
    if r == 1:
        time.sleep(7)  # never calls; stays alive past rank 0's timeout
        return None
    A, B = torch.ones(4, 6), torch.ones(6, 4)
    calls = {
        "all_gather_matmul": lambda: torch.ops.mptp.fused_all_gather_matmul(A, [B], 0, g),
        "matmul_reduce_scatter": lambda: torch.ops.mptp.fused_matmul_reduce_scatter(A, B, "sum", 0, g),
        "matmul_reduce_scatter avg": lambda: torch.ops.mptp.fused_matmul_reduce_scatter(A, B, "avg", 1, g),
    }
    t0 = time.monotonic()
    with pytest.raises(RuntimeError) as info:
        calls[op]()
    took = time.monotonic() - t0
    msg = str(info.value)
    assert took < 8, f"raised after {took:.1f}s, not within MPTP_TIMEOUT_S=2"
    assert "MPTP_TIMEOUT_S" in msg and g in msg and "rank 0" in msg, msg
    return msg


@pytest.mark.parametrize("check", ["0", "1"], ids=["agreement_off", "agreement_on"])
@pytest.mark.parametrize("op", ["all_gather_matmul", "matmul_reduce_scatter", "matmul_reduce_scatter avg"])
def test_every_op_times_out_on_a_skipping_peer(op, check):
    """Found by a hostile review: gloo's reduce-scatter work ignores wait(timeout), so with the
    agreement check off (the default) a matmul-reduce-scatter whose peer skipped the call
    waited for gloo's own timeout (30 minutes). It is now waited on a thread given up at the bound."""
    w = Workers(2, env={"MPTP_CHECK_AGREEMENT": check, "MPTP_TIMEOUT_S": "2"})
    try:
        msgs = w.run(_skips_op, op, timeout_s=60)
    finally:
        w.close()
    assert msgs[0] is not None


def _same_group_after_mismatch(seed):
    """After a disagreement raised, the group is still in step and usable."""
    W, r = dist.get_world_size(), dist.get_rank()
    A = randn((8 if r == 0 else 4, 16), seed + r)
    B = randn((16, 8), seed + 9)
    _expect_value_error(lambda: torch.ops.mptp.fused_all_gather_matmul(A, [B], 0, _g()), "disagree")
    shards = [randn((4, 16), seed + 20 + i) for i in range(W)]
    A_out, _ = torch.ops.mptp.fused_all_gather_matmul(shards[r], [B], 0, _g())
    assert torch.equal(A_out, torch.cat(shards))


def test_group_stays_usable_after_a_disagreement(agree2):
    agree2.run(_same_group_after_mismatch, SEED, timeout_s=60)


def test_gloo_reduce_scatter_waits_reuse_one_thread(pg1):
    """The bounded wait of gloo's reduce-scatter runs on a waiter thread (its work ignores
    wait(timeout)); sequential calls reuse one idle waiter instead of starting a thread each
    (about 120 us per call on a CPU host) or piling threads up."""
    import threading

    A, B = torch.randn(8, 16), torch.randn(16, 8)
    for _ in range(50):
        out = torch.ops.mptp.fused_matmul_reduce_scatter(A, B, "sum", 0, pg1)
    torch.testing.assert_close(out, A @ B)
    assert sum(t.name == "mptp-wait" for t in threading.enumerate()) == 1


class _StandInWork:
    """A c10d work stand-in holding an "output", whose wait returns or raises."""

    def __init__(self, error=None):
        self.out, self.error = torch.empty(1024), error

    def wait(self):
        if self.error:
            raise self.error
        return True


def test_a_failed_wait_leaves_nothing_with_the_idle_waiter():
    """An error's traceback reaches the caller's frames (and the work, and its output): the idle
    waiter must not keep it (found by a hostile review: a 64 MiB output stayed alive)."""
    import gc
    import time
    import weakref

    from mptp_kernels.ops import agreement

    def call(work):  # a caller frame holding the work, as wait_bounded's does
        return agreement._wait_in_thread(work, 5)

    work = _StandInWork(RuntimeError("boom"))
    out = weakref.ref(work.out)
    with pytest.raises(RuntimeError, match="boom"):
        call(work)
    del work
    deadline = time.monotonic() + 5
    while out() is not None and time.monotonic() < deadline:
        gc.collect()
        time.sleep(0.01)
    assert out() is None, "the output of a failed wait is still alive"


def test_a_forked_child_starts_its_own_waiters(pg1):
    """A child forked after a gloo reduce-scatter has none of the parent's waiter threads (found by
    a hostile review: it took one from the copied pool and timed out)."""
    import multiprocessing as mp

    from mptp_kernels.ops import agreement

    A, B = torch.randn(8, 16), torch.randn(16, 8)
    torch.ops.mptp.fused_matmul_reduce_scatter(A, B, "sum", 0, pg1)
    assert agreement._Waiter.idle, "the parent has an idle waiter"
    ctx = mp.get_context("fork")
    q = ctx.Queue()

    def child():
        q.put((len(agreement._Waiter.idle), agreement._wait_in_thread(_StandInWork(), 5)))

    p = ctx.Process(target=child)
    p.start()
    try:
        assert q.get(timeout=30) == (0, True)
    finally:
        p.join(10)
        if p.is_alive():
            p.kill()
