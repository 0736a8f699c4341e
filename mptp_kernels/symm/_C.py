"""Loads the compiled extension (a plain C ABI) with ctypes.

NOTE: the library links cudart statically and never libcuda, so loading it
works on machines without a GPU driver; CUDA calls fail there at run time.
"""

import ctypes
import glob
import os
from typing import Optional

# The C ABI this Python code calls (csrc/bindings.cpp mptp_abi_version); an extension built from
# other sources is refused rather than called with the wrong arguments.
ABI_VERSION = 5
_lib = None
_why: Optional[str] = None
_P, _U64, _I32 = ctypes.c_void_p, ctypes.c_uint64, ctypes.c_int32
MAX_PEERS = 32  # csrc/symm/symm.h kMaxPeers


class AgBeginArgs(ctypes.Structure):
    """csrc/symm/symm.h AgBeginArgs (its size is checked against the library's at load)."""

    _fields_ = [
        ("main", _P), ("side", _P), ("fork", _P), ("scales_in", _P),
        ("done_slots", _P), ("done_expected", _P), ("done_sig", _P),
        ("ready_slots", _P), ("ready_expected", _P), ("ready_sig", _P), ("own_flag", _P),
        ("timeout_ns", _U64),
        ("world_size", _I32), ("mask", ctypes.c_uint32), ("tag", _I32), ("done_channel", _I32),
        ("ready_channel", _I32), ("ncopy", _I32), ("npull", _I32), ("nscale", _I32), ("use_ce", _I32),
        ("pad_", _I32),
        ("copy_dst", _P * 4), ("copy_src", _P * 4), ("copy_bytes", ctypes.c_size_t * 4),
        ("full_base", _U64), ("chunk_bytes", _U64), ("scale_base", _U64), ("scale_bytes", _U64),
        ("scale_src_off", _U64),
        ("pull_src", _P * MAX_PEERS), ("pull_flag", _P * MAX_PEERS), ("peers", _I32 * MAX_PEERS),
    ]  # fmt: skip


def _find() -> Optional[str]:
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    for pattern in ("_C.so", "_C.*.so"):
        hits = sorted(glob.glob(os.path.join(here, pattern)))
        if hits:
            return hits[0]
    return None


def _declare(lib) -> None:
    c = ctypes
    sigs = {
        "mptp_abi_version": (c.c_int, []),
        "mptp_last_error": (c.c_char_p, []),
        "mptp_ipc_handle_bytes": (c.c_int, []),
        "mptp_driver_available": (c.c_int, []),
        "mptp_alloc": (c.c_int, [c.c_size_t, c.POINTER(c.c_void_p), c.POINTER(c.c_size_t)]),
        "mptp_free": (c.c_int, [c.c_void_p]),
        "mptp_export_handle": (c.c_int, [c.c_void_p, c.c_void_p]),
        "mptp_import_handle": (c.c_int, [c.c_void_p, c.POINTER(c.c_void_p)]),
        "mptp_close_handle": (c.c_int, [c.c_void_p]),
        "mptp_error_record": (c.c_int, [c.POINTER(c.c_void_p), c.POINTER(c.c_void_p)]),
        "mptp_signal": (c.c_int, [c.c_void_p, c.c_void_p, c.c_int]),
        "mptp_wait": (
            c.c_int,
            [c.c_void_p, c.c_void_p, c.c_void_p, c.c_int, c.c_uint32, c.c_uint64, c.c_int, c.c_int],
        ),
        "mptp_signal_wait": (
            c.c_int,
            [c.c_void_p, c.c_void_p, c.c_void_p, c.c_void_p, c.c_int, c.c_uint32, c.c_uint64, c.c_int, c.c_int],
        ),
        "mptp_write_value": (c.c_int, [c.c_void_p, c.c_void_p, c.c_uint32]),
        "mptp_pull_chunks": (
            c.c_int,
            [c.c_void_p, c.c_void_p, c.c_void_p, c.c_void_p, c.c_void_p, c.c_uint32, c.c_int, c.c_int],
        ),
        "mptp_ce_copies": (c.c_int, [c.c_void_p]),
        "mptp_fail_latch": (c.c_int, [c.POINTER(c.c_void_p)]),
        "mptp_copy_guarded": (c.c_int, [c.c_void_p, c.c_void_p, c.c_void_p, c.c_void_p, c.c_int]),
        "mptp_finish": (c.c_int, [c.c_void_p, c.c_void_p, c.c_void_p, c.c_int, c.c_void_p, c.c_int, c.c_void_p]),
        "mptp_stream_wait_value": (c.c_int, [c.c_void_p, c.c_void_p, c.c_uint32]),
        "mptp_device_count": (c.c_int, [c.POINTER(c.c_int)]),
        "mptp_ag_begin": (c.c_int, [c.POINTER(AgBeginArgs)]),
        "mptp_ag_begin_args_bytes": (c.c_int, []),
        "mptp_ag_begin_args_layout": (c.c_int, [c.POINTER(c.c_uint64), c.c_int]),
        "mptp_ag_end": (c.c_int, [c.c_void_p] * 3 + [c.c_void_p, c.c_void_p, c.c_int, c.c_void_p, c.c_int, c.c_void_p]),
        "mptp_finish_signal": (
            c.c_int, [c.c_void_p, c.c_void_p, c.c_void_p, c.c_int, c.c_void_p, c.c_int, c.c_void_p, c.c_void_p, c.c_int]
        ),
        "mptp_event_create": (c.c_int, [c.POINTER(c.c_void_p)]),
        "mptp_event_destroy": (c.c_int, [c.c_void_p]),
        "mptp_event_record": (c.c_int, [c.c_void_p, c.c_void_p]),
        "mptp_stream_wait_event": (c.c_int, [c.c_void_p, c.c_void_p]),
    }
    for name, (res, args) in sigs.items():
        fn = getattr(lib, name)
        fn.restype, fn.argtypes = res, args


def ag_begin_layout(handle):
    """(the library's AgBeginArgs (size, field offsets), this mirror's)."""
    n = len(AgBeginArgs._fields_)
    out = (ctypes.c_uint64 * (n + 1))()
    got = handle.mptp_ag_begin_args_layout(out, n + 1)
    theirs = (handle.mptp_ag_begin_args_bytes(), list(out[: max(got, 0)]))
    mine = (ctypes.sizeof(AgBeginArgs), [getattr(AgBeginArgs, f[0]).offset for f in AgBeginArgs._fields_])
    return theirs, mine


def lib():
    """The loaded library, or None (see why_unavailable())."""
    global _lib, _why
    if _lib is None and _why is None:
        path = _find()
        if path is None:
            try:
                from .._build_info import SKIP_REASON
            except ImportError:
                SKIP_REASON = "the package was not installed with pip"
            _why = f"the CUDA extension mptp_kernels/_C.so was not built ({SKIP_REASON})"
        else:
            try:
                handle = ctypes.CDLL(path)
                # NOTE: the version first: a stale build lacks newer symbols, and must be refused
                # with a reason (every op then runs its reference path), not fail in _declare.
                abi = getattr(handle, "mptp_abi_version", None)
                abi = abi() if abi is not None else None
                if abi != ABI_VERSION:
                    _why = (f"{path} has C ABI {abi}, this package needs {ABI_VERSION}: rebuild it "
                            "(pip install --no-build-isolation -e .)")
                else:
                    _declare(handle)
                    layout = ag_begin_layout(handle)
                    if layout[0] != layout[1]:  # the struct the two sides share
                        _why = (f"{path}: AgBeginArgs has (size, field offsets) {layout[0]} there, {layout[1]} "
                                "here: rebuild it (pip install --no-build-isolation -e .)")
                    else:
                        _lib = handle
            except (OSError, AttributeError) as e:
                _why = f"cannot load {path}: {e}"
    return _lib


def why_unavailable() -> Optional[str]:
    lib()
    return _why


def check(rc: int, what: str) -> None:
    """Raises RuntimeError with the extension's message when rc != 0."""
    if rc != 0:
        msg = _lib.mptp_last_error().decode(errors="replace") if _lib is not None else ""
        raise RuntimeError(f"{what} failed: {msg}")
