"""The multi-process harness itself: a run that times out fails the test, says which ranks
answered and what they raised, and leaves fresh workers for the next test (a rank still inside
the timed-out run would otherwise take the next test's task late, or never)."""

import time

import torch.distributed as dist

from dist.harness import Workers


def _one_rank_stuck():
    if dist.get_rank() == 0:
        time.sleep(1000)
    raise ValueError("rank 1 gave up")


def _rank():
    return dist.get_rank()


def test_a_timed_out_run_reports_the_answers_and_restarts_the_workers():
    w = Workers(2)
    try:
        assert w.run(_rank, timeout_s=120) == [0, 1]  # started (spawn and imports take seconds)
        try:
            w.run(_one_rank_stuck, timeout_s=5)
        except AssertionError as e:
            assert "answered: [1]" in str(e) and "rank 1 gave up" in str(e), e
        else:
            raise AssertionError("the stuck run did not time out")
        assert w.run(_rank, timeout_s=60) == [0, 1]
    finally:
        w.close()
