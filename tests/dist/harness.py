"""A small persistent multi-process harness (one process per rank, gloo on CPU,
NCCL or gloo on GPU). Like PyTorch's MultiProcContinuousTest: processes and the
process group live across tests, so each test costs a round trip, not a spawn.
Stable across torch 2.11-2.14, unlike the internal test classes.

Workers(W).run(fn, *args) calls the module-level fn(*args) on every rank and
returns the per-rank results; an exception on any rank becomes an
AssertionError carrying every failing rank's traceback. Every wait is bounded.
"""

import contextlib
import os
import queue
import signal
import sys
import tempfile
import time
import traceback

import torch.multiprocessing as mp


def _worker(rank, world_size, store_path, backend, sys_path, env, tasks, results):
    import faulthandler

    # NOTE: a rank killed by a signal (a crash in native code, glibc's abort on a corrupted heap)
    # prints every thread's Python stack, so the test's output shows what each was running.
    faulthandler.enable(all_threads=True)
    sys.path[:] = sys_path
    os.environ.update(env)
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    if torch.cuda.is_available():
        # With fewer GPUs than ranks, ranks share GPUs (W processes on one GPU).
        torch.cuda.set_device(rank % torch.cuda.device_count())
    store = dist.FileStore(store_path, world_size)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size)
    import mptp_kernels  # noqa: F401

    while True:
        task = tasks.get()
        if task is None:
            break
        fn, args, kwargs = task
        try:
            results.put((rank, True, fn(*args, **kwargs)))
        except BaseException as e:  # noqa: BLE001 - report everything to the parent
            results.put((rank, False, f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))
    dist.destroy_process_group()


class _Crashed(Exception):
    """A run in which a rank died of a crash signal (the others' errors then name the dead peer)."""

    def __init__(self, text: str, summary: str):
        super().__init__(text)
        self.summary = summary


_CRASH_SIGNALS = {signal.SIGSEGV, signal.SIGABRT, signal.SIGBUS, signal.SIGILL, signal.SIGFPE}
_GRACE_S = 15.0  # how long the other ranks may still answer once one has died


def _exit_name(code) -> str:
    if code is not None and code < 0:
        with contextlib.suppress(ValueError):
            return f"killed by {signal.Signals(-code).name}"
    return f"exit code {code}"


class Workers:
    def __init__(self, world_size: int, backend: str = "gloo", env=None, timeout_s: float = 300):
        self.world_size = world_size
        self.timeout_s = timeout_s
        self._backend, self._env = backend, dict(env or {})
        self._start()

    def _start(self):
        ctx = mp.get_context("spawn")
        fd, self._store = tempfile.mkstemp(prefix="mptp_store_")
        os.close(fd)
        os.unlink(self._store)
        self._tasks = [ctx.Queue() for _ in range(self.world_size)]
        self._results = ctx.Queue()
        self._procs = [
            ctx.Process(
                target=_worker,
                args=(r, self.world_size, self._store, self._backend, list(sys.path), self._env,
                      self._tasks[r], self._results),  # fmt: skip
                daemon=True,
            )
            for r in range(self.world_size)
        ]
        for p in self._procs:
            p.start()

    def _restart(self):
        """Kills every rank and starts fresh ones: after a run that timed out, a rank may still
        be inside it (a collective whose peer gave up), and the next test must not inherit it."""
        for p in self._procs:
            p.kill()
        for p in self._procs:
            p.join(timeout=30)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self._store)
        self._start()

    def run(self, fn, *args, timeout_s=None, crash_retries=0, **kwargs):
        """Runs fn on every rank; returns [result of rank 0, ..., rank W-1].

        crash_retries: how many times a run in which a rank died of a crash signal (SIGSEGV,
        SIGABRT, ...; not SIGKILL) is repeated in fresh workers, with a warning naming it. For
        tests whose workers run torch.compile: twice in CI (5ac216d, 8e96ced) a worker died of a
        corrupted heap (glibc's abort, a SIGSEGV) inside torch's own code, DTensor's eager
        scatter and a functional all-gather of an unfused compiled graph, with no mptp frame on
        the stack, and neither reproduced here (ASan on Inductor's kernels, glibc's malloc
        checker, a 20000-call stress of the gloo path). A crash that repeats still fails.
        """
        try:
            return self._run(fn, args, kwargs, timeout_s)
        except _Crashed as e:
            if crash_retries <= 0:
                raise AssertionError(str(e)) from None
            import warnings

            warnings.warn(f"{e.summary}; repeated in fresh workers ({crash_retries} repeat(s) left)", stacklevel=2)
            return self.run(fn, *args, timeout_s=timeout_s, crash_retries=crash_retries - 1, **kwargs)

    def _run(self, fn, args, kwargs, timeout_s):
        from multiprocessing.reduction import ForkingPickler

        # NOTE: a task that cannot be pickled would kill the queue's feeder thread quietly
        # and leave run() waiting for its whole timeout: fail here instead.
        ForkingPickler.dumps((fn, args, kwargs))
        for q in self._tasks:
            q.put((fn, args, kwargs))
        out, errors = [None] * self.world_size, {}
        answered: set = set()
        limit = timeout_s or self.timeout_s
        deadline = time.monotonic() + limit
        died_at = None
        while len(answered) < self.world_size:
            now = time.monotonic()
            # A rank that died without answering never will: the others get a grace period to
            # report (their errors name the dead peer), then the run fails, naming how it died,
            # instead of waiting for the whole timeout.
            dead = {r: p.exitcode for r, p in enumerate(self._procs) if not p.is_alive() and r not in answered}
            died_at = (died_at or now) if dead else None
            end = deadline if died_at is None else min(deadline, died_at + _GRACE_S)
            if now >= end:
                msg = "\n".join(f"--- rank {r} ---\n{tb}" for r, tb in sorted(errors.items()))
                gone = [r for r, p in enumerate(self._procs) if not p.is_alive()]
                self._restart()  # the next run starts clean
                how = ", ".join(f"rank {r}: {_exit_name(c)}" for r, c in sorted(dead.items()))
                what = f"rank(s) died ({how})" if dead else f"no answer from every rank within {limit}s"
                text = (f"{fn.__name__}: {what} (answered: {sorted(answered)}, dead ranks: {gone}; "
                        f"the workers were restarted)\n{msg}")  # fmt: skip
                if any(c is not None and -c in _CRASH_SIGNALS for c in dead.values()):
                    raise _Crashed(text, f"{fn.__name__}: rank(s) died ({how})")
                raise AssertionError(text) from None
            try:
                rank, ok, value = self._results.get(timeout=max(0.01, min(1.0, end - now)))
            except queue.Empty:
                continue
            answered.add(rank)
            if ok:
                out[rank] = value
            else:
                errors[rank] = value
        if errors:
            msg = "\n".join(f"--- rank {r} ---\n{tb}" for r, tb in sorted(errors.items()))
            raise AssertionError(f"{fn.__name__} failed on ranks {sorted(errors)}:\n{msg}")
        return out

    def close(self):
        for q in self._tasks:
            q.put(None)
        for p in self._procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
        with contextlib.suppress(FileNotFoundError):  # a killed rank leaves the store's file behind
            os.unlink(self._store)
