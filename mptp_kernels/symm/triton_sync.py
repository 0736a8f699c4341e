"""Triton-callable synchronisation helpers for kernels that share symmetric memory.

Memory ordering:
  * signal_release(ptr, value): an atomic exchange with release semantics at
    system scope: every store the program made before it is visible to any
    reader (another process, another GPU) that observes `value`.
  * wait_acquire(ptr, value, ...): spins on an atomic read with acquire
    semantics until *ptr >= value; loads after it see what the signaller wrote
    before signalling.

CUDA graphs: both are plain device code; values come from kernel arguments,
so a captured kernel waits for the same value on every replay (reset the
flag after use, as the fused ops do).

NOTE: a kernel that may occupy every SM must only wait on flags written by a
copy engine, a stream memory operation or another GPU, never on a flag that
another kernel of the same GPU (which might not be resident) would write.

Pseudo-code:
    producer:  store tile ...; signal_release(flag, epoch)
    consumer:  wait_acquire(flag, epoch, timeout, err, peer, tag); load tile ...
    after the consumer's launch: poison_if_error(output, err)  (one read of err per output)
"""

import triton
import triton.language as tl


@triton.jit
def globaltimer():
    """Nanoseconds from the GPU's global timer (inline PTX: not for the interpreter)."""
    return tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64, is_pure=False, pack=1)


@triton.jit
def _elapsed_ns(start):
    """globaltimer() - start, the same value in every thread of the program.

    NOTE: each thread reads %globaltimer itself, so a branch on the raw value can split
    a program's threads, and the atomics below (one thread issues, a barrier broadcasts)
    would then hang at mismatched barriers. The block-wide max makes the branch uniform.
    """
    t = tl.full([1024], 0, tl.int64) + (globaltimer() - start)
    return tl.max(t, axis=0)


@triton.jit
def signal_release(ptr, value):
    """*ptr = value with release semantics, system scope."""
    tl.atomic_xchg(ptr, value, sem="release", scope="sys")


@triton.jit
def wait_acquire(ptr, value, timeout_ns, err_ptr, peer, tag, POLLS: tl.constexpr = 2048,
                 CHANNEL: tl.constexpr = -1):
    """Spins (acquire, system scope) until *ptr >= value, at most timeout_ns.

    On timeout the first timed-out waiter of the process fills the int32[6]
    error record at err_ptr (csrc/symm/symm.h ErrorRecord: failed=1,
    channel=CHANNEL (-1: a chunk flag; a pad channel: a flag of that channel of this
    rank's signal pad), peer, expected=value, seen, tag = the op's tag)
    and every waiter returns; the host raises from it
    (mptp_kernels.symm.check_errors). A wait that finds the record already
    failed gives up at once, as the C++ wait kernel does, so one dead peer costs
    one timeout, not one per chunk. It returns nothing: what the launch wrote is
    poisoned after it (kernels/poison.py) if err_ptr[0] is set; the record is host
    memory, so it is not read per program here.
    """
    seen = tl.atomic_add(ptr, 0, sem="acquire", scope="sys")
    if seen < value:
        start = globaltimer()
        while seen < value:
            # NOTE: the flag is device memory, the error record host memory: every read of the
            # record crosses PCIe. While 132 programs read it on every spin, the copies that set
            # the flags took 300-650 us per 8 MB instead of 5 (H200), so the record and the clock
            # are read once per POLLS reads of the flag.
            n = 0
            while (seen < value) & (n < POLLS):
                seen = tl.atomic_add(ptr, 0, sem="acquire", scope="sys")
                n += 1
            if seen < value:
                # NOTE: an atomic read is broadcast to every thread (a volatile load is not).
                if tl.atomic_add(err_ptr, 0, sem="relaxed", scope="sys") != 0:
                    seen = value  # an earlier wait of this process failed
                elif _elapsed_ns(start) > timeout_ns:
                    if tl.atomic_cas(err_ptr, 0, 1, sem="relaxed", scope="sys") == 0:
                        tl.store(err_ptr + 1, CHANNEL)
                        tl.store(err_ptr + 2, peer)
                        tl.store(err_ptr + 3, value)
                        tl.store(err_ptr + 4, seen)
                        # Release: the fields above are visible before the tag.
                        tl.atomic_xchg(err_ptr + 5, tag, sem="release", scope="sys")
                    seen = value


@triton.jit
def wait_nonzero(ptr, timeout_ns):
    """Spins (acquire, GPU scope) until *ptr != 0; returns False if timeout_ns passed first.

    For a flag another program of the same kernel sets, one known to be running (the matmul's
    split tiles: kernels/persistent_matmul.py). Unlike wait_acquire it neither reads nor fills
    the process's error record: the caller decides what a timeout means (NaN there).
    """
    seen = tl.atomic_add(ptr, 0, sem="acquire", scope="gpu")
    if seen == 0:
        start = globaltimer()
        while seen == 0:
            n = 0
            while (seen == 0) & (n < 1024):
                seen = tl.atomic_add(ptr, 0, sem="acquire", scope="gpu")
                n += 1
            if seen == 0:
                if _elapsed_ns(start) > timeout_ns:
                    seen = -1
    return seen > 0
