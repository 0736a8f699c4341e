"""Cross-rank agreement: every rank makes the same call, and takes the same decisions.

Each call builds a Call: the fields that must agree on every rank (op, shapes
that travel, dtypes, dims, reduce op), fields that may differ (per-rank N of an
all-gather-matmul's Bs, per-rank K of a matmul-reduce-scatter), the local
decisions (can this rank's call be fused, how many workspace bytes it needs)
and a local validation error, if any. The encoded Calls are exchanged (through
the group's host rendezvous where it has a workspace, else, with
one small collective, with MPTP_CHECK_AGREEMENT=1), and resolve() returns
the same answer on every rank: a ValueError naming both calls when they
disagree or any rank rejected its inputs, else (fused on every rank, max bytes).
"""

import os
import queue
import struct
import threading
import weakref
import zlib
from dataclasses import dataclass, field
from datetime import timedelta
from typing import List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from .. import env

OPS = (
    "fused_all_gather_matmul",
    "fused_all_gather_scaled_matmul",
    "fused_matmul_reduce_scatter",
    "fused_scaled_matmul_reduce_scatter",
)
_DTYPES = (
    None, torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.float8_e4m3fn,
    torch.float8_e5m2, torch.int8, torch.uint8, torch.int16, torch.int32, torch.int64, torch.bool,
)  # fmt: skip
MAX_DIMS = 8
PAYLOAD_BYTES = 512
_EXCHANGE_BYTES = 8 + PAYLOAD_BYTES + 3  # length word, payload, padding to an odd size (exchange_collective)
# Call.options: matmul-reduce-scatter sums its chunk inside the matmul (MPTP_RS_REDUCE=kernel):
# the ranks' protocols differ (arrival flags against a barrier), so all take it or none does.
OPT_KERNEL_REDUCE = 1
_HEAD = struct.Struct("<5q")  # op, fusable, need, n_must, n_free


def dtype_code(d) -> int:
    """A code that differs for every pair of dtypes (the same on every rank)."""
    if d in _DTYPES:
        return _DTYPES.index(d)
    # NOTE: one shared code for every other dtype let complex64 vs complex128 through (gloo aborts).
    return 1000 + zlib.crc32(str(d).encode())


def shape_fields(name: str, shape: Sequence[int]) -> List[Tuple[str, int]]:
    """ndim and the first MAX_DIMS dims by name; a deeper shape adds a digest of all its dims
    (the dims past MAX_DIMS must agree too: a 10-D A differing in dim 8 aborted gloo)."""
    dims = [int(d) for d in shape]
    fields = [(f"{name}.ndim", len(dims))] + [(f"{name}[{i}]", d) for i, d in enumerate(dims[:MAX_DIMS])]
    if len(dims) > MAX_DIMS:
        fields.append((f"{name}.dims_crc", zlib.crc32(repr(dims).encode())))
    return fields


@dataclass
class Call:
    op: str
    must: List[Tuple[str, int]] = field(default_factory=list)
    free: List[Tuple[str, int]] = field(default_factory=list)
    fusable: bool = False
    need: int = 0
    error: Optional[str] = None
    # Fused-path variants this rank's call can take (bits: OPT_*); the ranks take those all can.
    options: int = 0

    def encode(self) -> bytes:
        # The free fields are informative only (never compared): keep as many as fit in the payload,
        # so a call with many Bs still fits (it overflowed the payload past ~55 Bs).
        room_free = max((PAYLOAD_BYTES - _HEAD.size - 8 * len(self.must)) // 8, 0)
        free = self.free[:room_free]
        head = _HEAD.pack(OPS.index(self.op), int(bool(self.fusable)) | (int(self.options) << 1), int(self.need),
                          len(self.must), len(free))  # fmt: skip
        vals = [v for _, v in self.must] + [v for _, v in free]
        body = struct.pack(f"<{len(vals)}q", *vals)
        room = PAYLOAD_BYTES - len(head) - len(body)
        err = (self.error or "").encode(errors="replace")[: max(room, 0)]
        return head + body + err


@dataclass
class Decoded:
    op: str
    fusable: bool
    need: int
    must: bytes
    must_vals: Tuple[int, ...]
    free_vals: Tuple[int, ...]
    error: Optional[str]
    options: int = 0


def decode(b: bytes) -> Decoded:
    try:
        op, fusable, need, nm, nf = _HEAD.unpack_from(b, 0)
        off = _HEAD.size
        must = b[off : off + 8 * nm]
        mv = struct.unpack_from(f"<{nm}q", b, off)
        fv = struct.unpack_from(f"<{nf}q", b, off + 8 * nm)
    except struct.error:
        # NOTE: what a peer sent is not an mptp call's signature: it is in another collective
        # on this group (calls must be made in the same order on every rank).
        raise RuntimeError(
            "mptp: a peer rank's message is not an mptp call (it is in another collective on this "
            "group: every rank must make the same calls on a group, in the same order)"
        ) from None
    err = b[off + 8 * (nm + nf) :].decode(errors="replace") or None
    return Decoded(OPS[op] if 0 <= op < len(OPS) else f"op#{op}", bool(fusable & 1), need, must, mv, fv, err,
                   fusable >> 1)  # fmt: skip


def _describe(d: Decoded, names: List[str]) -> str:
    if len(names) == len(d.must_vals):
        fields = ", ".join(f"{n}={_pretty(n, v)}" for n, v in zip(names, d.must_vals))
    else:
        fields = ", ".join(str(v) for v in d.must_vals)
    return f"{d.op}({fields})"


def _pretty(name: str, v: int) -> str:
    if name.endswith("dtype") and 0 <= v < len(_DTYPES):
        return str(_DTYPES[v]).replace("torch.", "")
    if name.endswith("dtype") and v >= 1000:
        for d in vars(torch).values():
            if isinstance(d, torch.dtype) and dtype_code(d) == v:
                return str(d).replace("torch.", "")
    if name == "A_scale.mode":
        from .validate import ScaleMode

        return list(ScaleMode)[v].value if 0 <= v < len(ScaleMode) else str(v)
    if name == "reduce_op":
        return ("sum", "avg")[v] if v in (0, 1) else str(v)
    return str(v)


_RESOLVED: dict = {}  # payloads -> (fuse, need, options) of an agreeing call: a pure function of the payloads


def resolve(call: Call, payloads: List[bytes], rank: int, group_name: str) -> Tuple[bool, int, int]:
    """Returns (fuse, need, options) identically on every rank (options: the OPT_* bits every rank
    set), or raises the same ValueError on every rank."""
    key = tuple(payloads)
    hit = _RESOLVED.get(key)
    if hit is not None:  # NOTE: only agreeing calls are cached; a disagreement is decoded each time
        return hit
    out = _resolve(call, payloads, rank, group_name)
    if len(_RESOLVED) >= 256:
        _RESOLVED.clear()
    _RESOLVED[key] = out
    return out


def _resolve(call: Call, payloads: List[bytes], rank: int, group_name: str) -> Tuple[bool, int, int]:
    ds = [decode(p) for p in payloads]
    bad = [(p, d.error) for p, d in enumerate(ds) if d.error]
    if bad:
        p, msg = bad[0]
        who = "this rank" if p == rank else f"peer rank {p}"
        raise ValueError(
            f"mptp {call.op} on group {group_name!r}: {who} rejected its inputs, so every rank "
            f"raises: {msg}" + (f" (ranks {[q for q, _ in bad]} rejected theirs)" if len(bad) > 1 else "")
        )
    names = [n for n, _ in call.must]
    for p, d in enumerate(ds):
        if d.op != ds[0].op or d.must != ds[0].must:
            raise ValueError(
                f"mptp {call.op} on group {group_name!r}: the ranks disagree on the call, so every "
                f"rank raises (rank {rank} sees this). Rank 0 called {_describe(ds[0], names)}; "
                f"rank {p} called {_describe(d, names)}. Every rank must pass the same shapes "
                "(except the per-rank N of all-gather-matmul's Bs and K of matmul-reduce-scatter), "
                "dtypes, dims and reduce op."
            )
    options = ds[0].options
    for d in ds[1:]:
        options &= d.options
    return all(d.fusable for d in ds), max(d.need for d in ds), options


def _collective_device(pg) -> torch.device:
    backend = str(dist.get_backend(pg)).lower()
    if "gloo" in backend and ("cpu:" not in backend or "cpu:gloo" in backend):
        return torch.device("cpu")
    return torch.device("cuda", torch.cuda.current_device())


class PerGroup:
    """A value per process group that does not keep the group alive: a destroyed group's sockets
    and threads must be freed (a strong reference leaked about 5 descriptors and 3 threads per
    destroyed group: found by a hostile review). A group that takes no weak reference is held
    by id, with the group itself checked on every read (ids are reused)."""

    def __init__(self):
        self._weak = weakref.WeakKeyDictionary()
        self._strong: dict = {}

    def get(self, pg, default=None):
        try:
            return self._weak.get(pg, default)
        except TypeError:
            hit = self._strong.get(id(pg))
            return hit[1] if hit is not None and hit[0] is pg else default

    def __setitem__(self, pg, value) -> None:
        try:
            self._weak[pg] = value
        except TypeError:
            self._strong[id(pg)] = (pg, value)

    def __bool__(self) -> bool:
        return len(self._weak) > 0 or bool(self._strong)

    def clear(self) -> None:
        self._weak.clear()
        self._strong.clear()


_SEQ = PerGroup()  # pg -> (generation, this rank's number of counted exchanges on it): _arrive
_STORE_OPS: "queue.Queue" = None  # fire-and-forget store writes (a stalled store must not stall a call)


def _store():
    try:
        return dist.distributed_c10d._get_default_store()
    except Exception:  # noqa: BLE001 - no store (a custom init): peers are not named
        return None


def _store_writer():
    while True:
        store, key, value = _STORE_OPS.get()
        try:
            store.set(key, value)
        except Exception:  # noqa: BLE001 - diagnostics only
            pass


_GENS: dict = {}  # group name -> how many group objects of that name this process has counted on, less one


def _arrive(pg, group_name: str, rank: int) -> Tuple[int, int]:
    """Counts this rank's exchanges on the group and publishes the count (naming who is missing).
    Returns (generation, count): the generation tells this group from an earlier one of the same
    name (destroyed and made again on the same store), whose counts a peer that has not counted on
    this one yet would otherwise show (found by a hostile review: such a peer was not named).
    Every rank of a group counts its generations alike: each makes and uses the same groups."""
    global _STORE_OPS
    hit = _SEQ.get(pg)
    if hit is None:
        gen = _GENS[group_name] = _GENS.get(group_name, -1) + 1
        seq = 1
    else:
        gen, seq = hit[0], hit[1] + 1
    _SEQ[pg] = (gen, seq)
    store = _store()
    if store is not None:
        if _STORE_OPS is None:
            _STORE_OPS = queue.Queue()
            threading.Thread(target=_store_writer, name="mptp-store-writer", daemon=True).start()
        _STORE_OPS.put((store, f"mptp/arrived/{group_name}/{gen}/{rank}", str(seq)))
    return gen, seq


def _missing(group_name: str, W: int, arrival: Tuple[int, int], wait_s: float = 1.0) -> str:
    """', peer ranks [..] had not reached this call' from the published counts (arrival: this
    rank's (generation, count), from _arrive), or '' (also when the store does not answer within
    wait_s: the diagnosis must not outlast the timeout)."""
    store = _store()
    if store is None:
        return ""
    gen, seq = arrival
    late: list = []

    def read():
        for p in range(W):
            key = f"mptp/arrived/{group_name}/{gen}/{p}"
            n = int(store.get(key)) if store.check([key]) else 0
            if n < seq:
                late.append(p)
        late.append(None)  # done

    t = threading.Thread(target=read, name="mptp-store-reader", daemon=True)
    t.start()
    t.join(wait_s)
    if not late or late[-1] is not None:
        return ""
    late = late[:-1]
    return f"; peer rank(s) {late} had not reached this call (their call count is lower)" if late else ""


def exchange_collective(payload: bytes, group_name: str, what: str) -> List[bytes]:
    """One all-gather of a fixed-size byte tensor over the group, bounded by env.host_timeout_s."""
    from torch.distributed.distributed_c10d import _resolve_process_group

    pg = _resolve_process_group(group_name)
    W = dist.get_world_size(pg)
    dev = _collective_device(pg)
    # NOTE: an odd number of bytes (length word, payload, padding). Where MPTP_CHECK_AGREEMENT
    # differs between ranks, this collective pairs with a peer's data collective: gloo then
    # fails on the size mismatch for any tensor of elements wider than a byte, where 520 bytes
    # (130 fp32 values) went through and the peer returned our payload as data (found by a hostile
    # review). The variable must be set alike on every rank (README, Safety).
    buf = torch.zeros(_EXCHANGE_BYTES, dtype=torch.uint8)
    buf[:8] = torch.tensor([len(payload)], dtype=torch.int64).view(torch.uint8)
    buf[8 : 8 + len(payload)] = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
    buf = buf.to(dev)
    outs = [torch.empty_like(buf) for _ in range(W)]
    # NOTE: read before the collective starts. A bad value is this rank's local error, which this
    # very exchange reports to the peers (the dispatcher put it in the payload).
    timeout = env.host_timeout_s_or_default(pg, dev.type)
    arrival = _arrive(pg, group_name, dist.get_rank(pg))
    work = dist.all_gather(outs, buf, group=pg, async_op=True)
    wait_bounded(work, pg, what, group_name, timeout,
                 lambda: f"did not hear from every peer{_missing(group_name, W, arrival)}")  # fmt: skip
    res = []
    for o in outs:
        o = o.cpu()
        n = int(o[:8].view(torch.int64).item())
        res.append(bytes(o[8 : 8 + n].tolist()))
    return res


# Groups whose collectives timed out part-way (a gloo op left pending pairs with the next one):
# pg -> message. Every later call on such a group raises at once, before communicating.
BROKEN = PerGroup()


def mark_broken(pg, msg: str) -> None:
    BROKEN[pg] = msg


def check_broken(pg) -> None:
    msg = BROKEN.get(pg)
    if msg is not None:
        raise RuntimeError(msg)


class _Waiter:
    """A daemon thread that waits for c10d works handed to it, one at a time; idle ones are reused
    (a thread per wait cost about 100 us on a CPU host, a handoff to a waiting one a fraction)."""

    idle: List["_Waiter"] = []
    lock = threading.Lock()

    def __init__(self):
        self.jobs: "queue.SimpleQueue" = queue.SimpleQueue()
        threading.Thread(target=self._loop, name="mptp-wait", daemon=True).start()

    @classmethod
    def take(cls) -> "_Waiter":
        with cls.lock:
            return cls.idle.pop() if cls.idle else cls()

    def _loop(self) -> None:
        while True:
            work, inference, grad, done, box = self.jobs.get()
            try:
                with torch.inference_mode(inference), torch.set_grad_enabled(grad):
                    box["ok"] = work.wait()
            except BaseException as e:  # noqa: BLE001 - handed to the caller
                box["error"] = e
            finally:
                # NOTE: nothing of the job stays with an idle thread: the work holds the caller's
                # output, and an error's traceback the caller's frames (found by a hostile review).
                del work
                # NOTE: back in the pool before the caller wakes, so that its next wait reuses this
                # thread; only once the wait returned: a wait given up keeps its thread out of it.
                with _Waiter.lock:
                    _Waiter.idle.append(self)
                done.set()
                del done, box

    @classmethod
    def _after_fork(cls) -> None:
        # NOTE: a forked child has none of the parent's threads (found by a hostile review: a
        # child took a waiter that did not exist and timed out), and maybe a lock held by one.
        cls.idle = []
        cls.lock = threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_Waiter._after_fork)


def _wait_in_thread(work, timeout: float):
    """work.wait() on a helper thread, given up after timeout seconds (RuntimeError "timed out").

    NOTE: found by a hostile review: gloo's reduce-scatter work ignores wait(timeout) (its
    all-gather honours it) and never reports is_completed(), so a matmul-reduce-scatter whose
    peer skipped the call waited for gloo's own timeout, 30 minutes by default. A wait given up
    leaves its thread blocked in gloo until then (out of the pool of idle waiters); the group is
    marked broken, so no later call runs on it."""
    done, box = threading.Event(), {}
    # NOTE: grad and inference modes are per thread, and the work's wait writes the output (an
    # inference tensor where the caller runs under inference_mode): the waiter takes the caller's.
    _Waiter.take().jobs.put((work, torch.is_inference_mode_enabled(), torch.is_grad_enabled(), done, box))
    del work
    if not done.wait(timeout):
        raise RuntimeError(f"the collective timed out: no answer within {timeout:g}s")
    if "error" in box:
        raise box["error"]
    return box["ok"]


def wait_bounded(work, pg, what: str, group_name: str, timeout=None, why=None, in_thread=False) -> None:
    """Waits for a c10d work at most `timeout` s (default env.host_timeout_s: MPTP_TIMEOUT_S, else
    the group's own timeout); a timeout marks the group broken and raises a RuntimeError naming
    op, group, rank and (why(), where it can tell) the peers. in_thread: for works whose wait
    ignores its timeout (gloo's reduce-scatter), see _wait_in_thread."""
    timeout = env.host_timeout_s(pg) if timeout is None else timeout
    try:
        if in_thread:
            ok = _wait_in_thread(work, timeout)
        else:
            ok = work.wait(timeout=timedelta(seconds=timeout))
    except RuntimeError as e:
        if "timed out" not in str(e).lower() and "timeout" not in str(e).lower():
            # Not a timeout (e.g. a dtype the backend refuses): the collective failed on this rank.
            msg = (f"{what}: a collective on group {group_name!r} failed on rank {dist.get_rank(pg)} "
                   f"({e}); this group's collectives may be out of step, so every later mptp call on "
                   "it raises: restart the job")  # fmt: skip
        else:
            what_happened = why() if why is not None else "timed out in a collective of the reference path"
            msg = (f"{what}: rank {dist.get_rank(pg)} of group {group_name!r} {what_happened} within "
                   f"{timeout:g}s ({env.timeout_source()}): a peer skipped the call, called it on another group, "
                   f"made another one, or died ({e}); this group's collectives are now out of step, so "
                   "every later mptp call on it raises: restart the job")  # fmt: skip
        mark_broken(pg, msg)
        raise RuntimeError(msg) from None
    if ok is False:
        mark_broken(pg, f"{what}: a collective on group {group_name!r} failed")
        raise RuntimeError(f"{what}: a collective on group {group_name!r} failed")
