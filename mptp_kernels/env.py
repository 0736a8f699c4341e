"""Every MPTP_* environment variable, read in one place.

MPTP_TIMEOUT_S       bound on every wait, in seconds, 0.001 to 1e6 (default 60).
MPTP_LOG             1: log each fusion / fallback decision at INFO (default 0).
MPTP_DISABLE_FUSED   1: always run the reference path (default 0).
MPTP_FORCE_FUSED     1: skip the size heuristic and fuse whenever possible (default 0).
MPTP_CHECK_AGREEMENT on groups without an mptp workspace, check with one small collective
                     per call that every rank makes the same call: "auto" (default) on
                     gloo and other host-synchronous paths, off for CUDA tensors on NCCL
                     (reading the answer would synchronize the stream); 1 always; 0 never.
                     Groups with a workspace always check, through shared memory.
MPTP_ASYNC_ERROR_HANDLING  what the watchdog does after a timed-out wait: 0 the next
                     call raises; 1 abort at once; 2 (default) the next call raises,
                     and the process aborts if none did within MPTP_TIMEOUT_S.
MPTP_SKIP_CUDA_BUILD 1 at install time: build no extension (read by setup.py).
"""

import logging
import os

logger = logging.getLogger("mptp_kernels")


def _flag(name: str) -> bool:
    return os.environ.get(name, "0").strip().lower() in ("1", "true", "yes", "on")


def _number(name: str, default: str, kind, ok) -> float:
    raw = os.environ.get(name, default)
    try:
        v = kind(raw)
    except ValueError:
        v = None
    if v is None or not ok(v):
        raise ValueError(f"{name}: expected {kind.__name__} {ok.__doc__}, got {raw!r}")
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


def timeout_s() -> float:
    return _number("MPTP_TIMEOUT_S", "60", float, _timeout_range)


def timeout_s_or_default() -> float:
    """timeout_s(), or its default where MPTP_TIMEOUT_S is invalid: the exchange that tells the
    peers about that error must still run, and be bounded."""
    try:
        return timeout_s()
    except ValueError:
        return 60.0


def check_agreement(nccl: bool) -> bool:
    """Whether a call on a group without a workspace checks agreement (nccl: CUDA tensors on NCCL)."""
    raw = os.environ.get("MPTP_CHECK_AGREEMENT", "auto").strip().lower()
    if raw in ("", "auto"):
        return not nccl
    if raw in ("1", "true", "yes", "on"):
        return True
    if raw in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"MPTP_CHECK_AGREEMENT: expected auto, 1 or 0, got {raw!r}")


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
