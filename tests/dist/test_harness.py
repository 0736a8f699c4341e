"""The multi-process harness itself: a run that times out fails the test, says which ranks
answered and what they raised, and leaves fresh workers for the next test (a rank still inside
the timed-out run would otherwise take the next test's task late, or never); a rank that dies
fails its run at once, naming the signal, with the survivors' errors; a rank that answered and
then exited is not blamed for a hang."""

import os
import time

import pytest

from dist.harness import Workers


def _die_or_raise_late():
    import torch.distributed as dist

    if dist.get_rank() == 1:
        os.abort()
    time.sleep(2)  # the survivor learns of its peer's death a little later
    raise ValueError("rank 0 saw its peer die")


def _answer_then_exit_while_other_hangs():
    import threading

    import torch.distributed as dist

    if dist.get_rank() == 1:
        threading.Timer(0.5, os._exit, (0,)).start()
        return "rank 1 answered"
    time.sleep(30)


def _rank():
    import torch.distributed as dist

    return dist.get_rank()


def _one_rank_stuck():
    import torch.distributed as dist

    if dist.get_rank() == 0:
        time.sleep(1000)
    raise ValueError("rank 1 gave up")


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


@pytest.fixture
def fresh2():
    w = Workers(2)
    yield w
    w.close()


def test_a_dead_rank_fails_the_run_at_once_with_the_survivors_errors(fresh2):
    t = time.monotonic()
    with pytest.raises(AssertionError) as e:
        fresh2.run(_die_or_raise_late, timeout_s=120)
    msg = str(e.value)
    assert time.monotonic() - t < 60, msg
    assert "rank 1: killed by SIGABRT" in msg and "dead ranks: [1]" in msg, msg
    assert "ValueError: rank 0 saw its peer die" in msg, msg
    assert fresh2.run(_rank) == [0, 1]  # restarted clean


def test_a_rank_that_answered_is_not_blamed_for_a_hang(fresh2):
    assert fresh2.run(_rank) == [0, 1]  # started (the timeout below counts from the call)
    with pytest.raises(AssertionError, match=r"no answer from every rank within 10s \(answered: \[1\]"):
        fresh2.run(_answer_then_exit_while_other_hangs, timeout_s=10)
    assert fresh2.run(_rank) == [0, 1]


def _crash_once(marker, sig_name):
    import signal

    import torch.distributed as dist

    if dist.get_rank() == 1 and not os.path.exists(marker):
        open(marker, "w").close()
        os.kill(os.getpid(), getattr(signal, sig_name))
    return dist.get_rank()


def test_crash_retries_repeats_a_run_a_crash_signal_killed(fresh2, tmp_path):
    """crash_retries (tests whose workers compile): a run a SIGSEGV killed is repeated once in
    fresh workers, with a warning naming the signal; without it, or where the crash repeats, or
    where the rank was SIGKILLed (not a crash), the run fails as before."""
    with pytest.warns(UserWarning, match=r"_crash_once: rank\(s\) died \(rank 1: killed by SIGSEGV\); repeated"):
        assert fresh2.run(_crash_once, str(tmp_path / "a"), "SIGSEGV", timeout_s=120, crash_retries=1) == [0, 1]
    with pytest.raises(AssertionError, match="rank 1: killed by SIGSEGV"):
        fresh2.run(_crash_once, str(tmp_path / "b"), "SIGSEGV", timeout_s=120)
    with pytest.raises(AssertionError, match="rank 1: killed by SIGABRT"), pytest.warns(UserWarning):
        fresh2.run(_die_or_raise_late, timeout_s=120, crash_retries=1)  # crashes every time
    with pytest.raises(AssertionError, match="rank 1: killed by SIGKILL"):
        fresh2.run(_crash_once, str(tmp_path / "c"), "SIGKILL", timeout_s=120, crash_retries=1)
    assert fresh2.run(_rank) == [0, 1]
