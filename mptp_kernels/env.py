"""Every MPTP_* environment variable, read in one place.

MPTP_TIMEOUT_S       bound on every wait, in seconds, 0.001 to 1e6. Unset: waits for a peer
                     that may legitimately be late (the host-side rendezvous and agreement,
                     the reference path's collectives) use the process group's own timeout,
                     as its collectives would (a rank saving a checkpoint is not a dead
                     peer); device-side waits, which start once every rank reached the call,
                     and the watchdog use 60.
MPTP_LOG             1: log each fusion / fallback decision at INFO (default 0).
MPTP_DISABLE_FUSED   1: always run the reference path (default 0).
MPTP_FORCE_FUSED     1: skip the cost model (ops/cost.py) and fuse whenever possible (default 0).
MPTP_CHECK_AGREEMENT on groups without an mptp workspace, check with one small collective
                     per call that every rank makes the same call: 1 on; 0 or "auto"
                     (default) off: the reference path then sends exactly the collectives
                     of the unfused ops, so a rank that runs the op interoperates with one
                     that runs the plain collective (torch.compile may fuse on one rank
                     only: the graphs of the ranks may differ). Groups with a workspace
                     always check, through shared memory.
MPTP_ASYNC_ERROR_HANDLING  what the watchdog does after a timed-out wait: 0 the next
                     call raises; 1 abort at once; 2 (default) the next call raises,
                     and the process aborts if none did within MPTP_TIMEOUT_S.
MPTP_CE_COPIES       0: never ask for copy-engine chunk copies in the fused all-gather
                     (default 1: cuMemcpyBatchAsync with the prefer-overlap hint, where the
                     driver has it and the stream is not capturing a CUDA graph, except for a
                     call that gathers row-wise scales on a GPU its ranks share).
MPTP_RESERVE_SMS     SMs the all-gather consumer leaves free for chunk copies that may run as
                     kernels where a peer shares this GPU, 1 to 64 (default 8; at most 2 where
                     the copies asked for a copy engine).
MPTP_RS_REDUCE       where the fused matmul-reduce-scatter sums its chunk: "pass" (default) after
                     the matmul and a barrier, by one memory-bound kernel over every SM;
                     "kernel": inside the matmul, each tile of the rank's own chunk summed by the
                     program that computed it once the peers' partials have arrived (no barrier,
                     no pass; measured 0-6% slower on one H100, bench/NOTES.md item 22; on a GPU
                     the ranks share, their kernels are then time-sliced: slow). NOTE: its
                     programs hold their SMs while they wait for the peers' partials: a kernel
                     beside it that needs SMs and itself waits on a peer (an NCCL collective on
                     another stream, an MPS SM limit) can stall both ranks until the timeout
                     (NaN and an error). The ranks take the in-matmul sum only if all can, and
                     only once a TMA launch has run in each process.
MPTP_SKIP_CUDA_BUILD 1 at install time: build no extension (read by setup.py).
"""

import logging
import os
import weakref
from typing import Optional

logger = logging.getLogger("mptp_kernels")

# NOTE (issue 14): the ops read about fifteen of these per call. os.environ.get encodes the name
# and decodes the value each time; the mapping's own bytes dict (CPython, POSIX) answers the same
# question without either, and os.environ's setters (monkeypatch.setenv too) keep it current.
# os.environ is looked up on every read: a test may rebind it (mock.patch("os.environ", {...});
# found by a hostile review: a value read from the old mapping was stale).
_POSIX = os.name == "posix"
_BNAMES: dict = {}
_BTUPLES: dict = {}


def _bytes_dict():
    d = getattr(os.environ, "_data", None) if _POSIX else None
    return d if d.__class__ is dict else None


def _bname(name: str) -> bytes:
    b = _BNAMES.get(name)
    if b is None:
        b = _BNAMES[name] = os.fsencode(name)
    return b


def raw(name: str) -> Optional[str]:
    """os.environ.get(name), faster."""
    d = _bytes_dict()
    if d is None:
        return os.environ.get(name)
    v = d.get(_bname(name))
    return None if v is None else os.fsdecode(v)


def raw_many(names: tuple) -> tuple:
    """The raw values of `names` (a cheap key of their state)."""
    d = _bytes_dict()
    if d is None:
        return tuple(os.environ.get(n) for n in names)
    bnames = _BTUPLES.get(names)
    if bnames is None:
        bnames = _BTUPLES[names] = tuple(map(_bname, names))
    return tuple(map(d.get, bnames))


def _flag(name: str) -> bool:
    return (raw(name) or "0").strip().lower() in ("1", "true", "yes", "on")


_PARSED: dict = {}  # (name, raw value, default) -> parsed value of a valid setting


def _number(name: str, default: str, kind, ok) -> float:
    r = raw(name)
    hit = _PARSED.get((name, r, default))
    if hit is not None:
        return hit
    val = (r or "").strip() or default  # set but empty: unset
    try:
        v = kind(val)
    except ValueError:
        v = None
    if v is None or not ok(v):
        raise ValueError(f"{name}: expected {kind.__name__} {ok.__doc__}, got {val!r}")
    if len(_PARSED) > 256:
        _PARSED.clear()
    _PARSED[(name, r, default)] = v
    return v


def _positive(v):
    """> 0"""
    return v > 0


def _mode(v):
    """in (0, 1, 2)"""
    return v in (0, 1, 2)


def _timeout_range(v):
    """between 0.001 and 1e6 (a timedelta has millisecond resolution, and 0 ms means no timeout)"""
    return 0.001 <= v <= 1e6


def _sms_range(v):
    """between 1 and 64 (0 would let a copy that needs an SM wait behind the consumer for good)"""
    return 1 <= v <= 64


def _switch(name: str, default: str, auto: Optional[bool] = None) -> bool:
    """An on/off variable: 1/true/yes/on or 0/false/no/off; with `auto`, also "auto" (and empty)."""
    r = raw(name)
    val = (default if r is None else r).strip().lower()
    if auto is not None and val in ("", "auto"):
        return auto
    if val in ("1", "true", "yes", "on"):
        return True
    if val in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"{name}: expected {'auto, ' if auto is not None else ''}1 or 0, got {val!r}")


def ce_copies_enabled() -> bool:
    return _switch("MPTP_CE_COPIES", "1")


def c_binder_enabled() -> bool:
    """Whether kernel launches bind their arguments in C (kernels/prepare_c.py); read once."""
    return _switch("MPTP_C_BINDER", "1")


def launch_memo_enabled() -> bool:
    """Whether persistent-matmul launches may reuse an earlier launch's bound arguments
    (kernels/persistent_matmul.py, the launch memo); read at the first launch."""
    return _switch("MPTP_LAUNCH_MEMO", "1")


def rs_reduce() -> str:
    """MPTP_RS_REDUCE: "pass" or "kernel" (see the module docstring)."""
    val = (raw("MPTP_RS_REDUCE") or "").strip().lower() or "pass"
    if val not in ("pass", "kernel"):
        raise ValueError(f"MPTP_RS_REDUCE: expected pass or kernel, got {val!r}")
    return val


def reserve_sms() -> int:
    return int(_number("MPTP_RESERVE_SMS", "8", int, _sms_range))


def timeout_s() -> float:
    return _number("MPTP_TIMEOUT_S", "60", float, _timeout_range)


_GROUP_TIMEOUTS = weakref.WeakKeyDictionary()  # pg -> {device: seconds or None}


def group_timeout_s(pg, device: str = "cpu") -> Optional[float]:
    """The process group's own timeout in seconds (init_process_group / new_group), or None.

    Looked up once per group and device (a backend lookup that fails raises from C++: hundreds of
    microseconds per call, measured on the H200 host); a group's timeout is fixed when it is made.
    """
    try:
        per_device = _GROUP_TIMEOUTS.get(pg)
    except TypeError:  # not weakly referenceable: no cache
        per_device = None
    if per_device is not None and device in per_device:
        return per_device[device]
    import torch

    found = None
    for dev in dict.fromkeys((device, "cpu", "cuda")):
        try:
            t = pg._get_backend(torch.device(dev)).options._timeout.total_seconds()
        except Exception:  # noqa: BLE001 - no such backend (fake groups, another device type)
            continue
        if t > 0:
            found = t
            break
    try:
        _GROUP_TIMEOUTS.setdefault(pg, {})[device] = found
    except TypeError:
        pass
    return found


def host_timeout_s(pg=None, device: str = "cpu") -> float:
    """Bound on a host-side wait for peers that may legitimately be late: MPTP_TIMEOUT_S where
    set, else the group's own timeout, else timeout_s()'s default."""
    if (raw("MPTP_TIMEOUT_S") or "").strip() or pg is None:
        return timeout_s()
    t = group_timeout_s(pg, device)
    return t if t is not None else timeout_s()


def host_timeout_s_or_default(pg=None, device: str = "cpu") -> float:
    """host_timeout_s(), or the default where MPTP_TIMEOUT_S is invalid: the exchange that tells
    the peers about that error must still run, and be bounded."""
    try:
        return host_timeout_s(pg, device)
    except ValueError:
        return 60.0 if pg is None else (group_timeout_s(pg, device) or 60.0)


def timeout_source() -> str:
    """Where a host-side bound came from, for error messages."""
    if (raw("MPTP_TIMEOUT_S") or "").strip():
        return "MPTP_TIMEOUT_S"
    return "the process group's timeout; MPTP_TIMEOUT_S overrides"


def check_agreement(nccl: bool) -> bool:
    """Whether a call on a group without a workspace checks agreement with one collective.

    Off unless MPTP_CHECK_AGREEMENT=1: the check is one collective more than the unfused ops
    make, so a rank whose compiled graph runs the op would pair it with a peer's plain
    collective (the pass decides per rank, from that rank's graph). `nccl` (CUDA tensors on
    NCCL: reading the answer synchronizes the stream) does not change the answer."""
    del nccl
    return _switch("MPTP_CHECK_AGREEMENT", "auto", auto=False)


def async_error_handling() -> int:
    return int(_number("MPTP_ASYNC_ERROR_HANDLING", "2", int, _mode))


def log_enabled() -> bool:
    return _flag("MPTP_LOG")


def fused_disabled() -> bool:
    return _flag("MPTP_DISABLE_FUSED")


def force_fused() -> bool:
    return _flag("MPTP_FORCE_FUSED")


def log(msg: str, *args) -> None:
    """Logs at INFO when MPTP_LOG=1, at DEBUG otherwise."""
    if log_enabled():
        if not logger.handlers and not logging.getLogger().handlers:
            logging.basicConfig(level=logging.INFO, format="[mptp] %(message)s")
        logger.setLevel(logging.INFO)
        logger.info(msg, *args)
    else:
        logger.debug(msg, *args)


_logged_once: set = set()


def log_once(key, msg: str, *args) -> None:
    if key in _logged_once:
        return
    _logged_once.add(key)
    log(msg, *args)
