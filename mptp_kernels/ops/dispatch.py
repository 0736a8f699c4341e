"""Every call of a torch.ops.mptp op on real tensors comes here (CPU and CUDA).

Per call, on every rank:
  1. validate the inputs locally (a bad input is not raised yet where peers can be told);
  2. where the group has an mptp workspace (CUDA, extension built, group enabled,
     ranks on one host): exchange the call's signature and local decisions
     through the workspace's host rendezvous; elsewhere, with MPTP_CHECK_AGREEMENT=1,
     with one small collective (off by default: the reference path then sends exactly
     the unfused ops' collectives, so a rank running the op pairs with a peer whose
     compiled graph runs the plain collective). Every rank then raises the same
     ValueError if any rank rejected its inputs or the calls disagree;
  3. decide fused or reference from what every rank published (fused only if
     every rank's call qualifies; workspace grown to the largest need), so the
     decision is identical on every rank by construction;
  4. run: the fused path, or the reference on the group's transport (mptp
     symmetric memory, NCCL functional collectives, or host staging for gloo
     with CUDA tensors).
The path taken is counted in PATH_COUNTS ((op, "fused" | "reference") -> calls of
CUDA tensors) and logged once per reason under MPTP_LOG=1.
"""

import contextlib
import functools
import math
import threading
from collections import Counter

import torch
import torch.distributed as dist

from .. import env
from . import agreement, cost, reference, transport, validate
from .agreement import Call, dtype_code, shape_fields

# (op name, "fused" | "reference") -> number of calls on CUDA tensors; tests read it.
PATH_COUNTS: Counter = Counter()
# (op name, transport name) -> calls of the reference path on CUDA tensors.
TRANSPORT_COUNTS: Counter = Counter()

_GROUP_ARG = {
    "fused_all_gather_matmul": 3,
    "fused_all_gather_scaled_matmul": 5,
    "fused_matmul_reduce_scatter": 4,
    "fused_scaled_matmul_reduce_scatter": 7,
}
_REFERENCE = {
    "fused_all_gather_matmul": reference.all_gather_matmul,
    "fused_all_gather_scaled_matmul": reference.all_gather_scaled_matmul,
    "fused_matmul_reduce_scatter": reference.matmul_reduce_scatter,
    "fused_scaled_matmul_reduce_scatter": reference.scaled_matmul_reduce_scatter,
}
_UNSERVABLE = agreement.PerGroup()  # process group -> {device: why no workspace can serve it}


def _fused_module():
    try:
        from . import fused
    except ImportError as e:  # triton missing
        return None, f"fused path unavailable: {e}"
    return fused, None


def _enabled(group_name: str) -> bool:
    from . import is_symm_mem_enabled_for_group

    if is_symm_mem_enabled_for_group(group_name):
        return True
    try:  # a group enabled through PyTorch's own API counts too
        from torch.distributed._symmetric_memory import (
            is_symm_mem_enabled_for_group as torch_enabled,
        )

        return bool(torch_enabled(group_name))
    except Exception:  # noqa: BLE001
        return False


def _ceil256(n: int) -> int:
    return (n + 255) // 256 * 256


# -- 1. the call's signature -----------------------------------------------------------------------


def _backward_collective(name: str, A, Bs) -> list:
    """Whether this call's backward will communicate: it must agree (A needing a gradient on one
    rank only left the other out of a backward reduce-scatter). All-gather-matmul's backward
    communicates for dA only (dB is local); matmul-reduce-scatter's for dA or dB (both need the
    gathered dC). Grad mode is the caller's (the op itself runs below autograd, grad disabled)."""
    from .autograd import grad_mode_at_call

    if not grad_mode_at_call():
        return [("backward_collective", 0)]
    ts = [A] if name == "fused_all_gather_matmul" else [A, *Bs]
    return [("backward_collective", int(any(isinstance(t, torch.Tensor) and t.requires_grad for t in ts)))]


def describe(name: str, args, kwargs, W: int) -> Call:
    """Validates the call (raises ValueError) and returns its signature and workspace need."""
    A = args[0]
    if name in ("fused_all_gather_matmul", "fused_all_gather_scaled_matmul"):
        scaled = name == "fused_all_gather_scaled_matmul"
        Bs, gather_dim = args[1], args[4 if scaled else 2]
        validate.check_list("Bs", Bs)
        _, gd = validate.all_gather_matmul(A, Bs, gather_dim, args[_GROUP_ARG[name]], scaled=scaled)
        must = [("A.dtype", dtype_code(A.dtype)), ("gather_dim", gd)] + shape_fields("A", A.shape)
        if not scaled:  # (the scaled ops are forward-only)
            must += _backward_collective(name, A, Bs)
        free = [("num_Bs", len(Bs))] + [(f"Bs[{i}].N", B.shape[1]) for i, B in enumerate(Bs)]
        need = A.numel() * A.element_size()
        if scaled:
            A_scale, B_scales, biases, result_scales, out_dtypes, fast = args[2], args[3], *args[6:10]
            mode = validate.all_gather_scaled_lists(A, Bs, A_scale, B_scales, biases, result_scales,
                                                    out_dtypes, fast, gd, W)  # fmt: skip
            for i, d in enumerate(out_dtypes):
                validate.scaled_out_dtype(d, f"out_dtypes[{i}]")
            # A row-wise sharded A_scale travels with A: its dtype must agree too (gloo aborts otherwise).
            must += [("A_scale.mode", list(validate.ScaleMode).index(mode)),
                     ("A_scale.dtype", dtype_code(A_scale.dtype))]
            if mode == validate.ScaleMode.ROW_WISE_SHARDED:
                need = _ceil256(need) + A_scale.numel() * 4
        return Call(name, must, free, need=need)
    # matmul-reduce-scatter
    scaled = name == "fused_scaled_matmul_reduce_scatter"
    B, reduce_op = args[1], args[4 if scaled else 2]
    if scaled:
        A_scale, B_scale, orig_sd, _, group_name, output_shape, bias, result_scale, out_dtype = (
            args[2], args[3], args[5], args[6], args[7], args[8], *args[9:12])  # fmt: skip
        validate.matmul_reduce_scatter(A, B, reduce_op, None, group_name, scaled=True)
        validate.scaled_rs_extras(A, A_scale, B_scale, bias, result_scale, B.shape[1])
        out_dtype = validate.scaled_out_dtype(out_dtype) or A.dtype
        out_shape = list(output_shape) if output_shape is not None else [*A.shape[:-1], B.shape[1]]
        rows = math.prod(A.shape[:-1])  # NOTE: not A.numel() // K, which is 0 when K == 0
        validate.check_output_shape(out_shape, rows, B.shape[1])
        validate.scatter_dim_after_reshape(args[6], A)
        sd = validate.norm_dim(orig_sd, len(out_shape), "orig_scatter_dim")
        validate.check_divisible(out_shape, sd, W, "orig_scatter_dim")
        must = [("out.dtype", dtype_code(out_dtype)), ("scatter_dim", sd)] + shape_fields("out", out_shape)
    else:
        _, sd = validate.matmul_reduce_scatter(A, B, reduce_op, args[3], args[4], scaled=False)
        out_dtype = A.dtype
        out_shape = [*A.shape[:-1], B.shape[1]]
        must = [("out.dtype", dtype_code(out_dtype)), ("scatter_dim", sd)] + shape_fields("out", out_shape)
    must += [("A.dtype", dtype_code(A.dtype)), ("reduce_op", validate._REDUCE_OPS.index(reduce_op))]
    if not scaled:
        must += _backward_collective(name, A, [B])
    # FP8 partials are reduced in fp32 (reference.reduce_scatter): 4 bytes per element on the transport.
    item = 4 if out_dtype in validate.FP8_DTYPES else torch.empty((), dtype=out_dtype).element_size()
    need = math.prod(out_shape) * item
    return Call(name, must, [("K", A.shape[-1])], need=need)


# -- 2.-4. --------------------------------------------------------------------------------------


def _workspace(group_name: str, device, need: int):
    """The group's workspace (created at the group's first call), or None with why not."""
    P = _prims()
    _C = P._C
    if _C.lib() is None:
        return None, _C.why_unavailable()
    if not _enabled(group_name):
        return None, f"group {group_name!r} is not enabled (mptp_kernels.enable_symm_mem_for_group)"
    pg = P._group(group_name)
    why = _UNSERVABLE.get(pg, {}).get(str(device))
    if why is not None:
        return None, why
    ws = P.lookup(group_name, device)
    if ws is not None:
        return ws, None
    try:
        return P.get_workspace(group_name, max(need, 1), device), None
    except RuntimeError as e:
        if torch.cuda.is_current_stream_capturing():
            raise
        # NOTE: creation agrees on every rank (SymmetricMemory raises on all), so they all fall back.
        per_device = _UNSERVABLE.get(pg)
        if per_device is None:
            per_device = _UNSERVABLE[pg] = {}
        per_device[str(device)] = str(e)
        env.log_once(("unservable", group_name), "mptp: %s", e)
        return None, str(e)


def _link(ws, device, W: int, capturing: bool, ce: bool = True) -> cost.Link:
    """What the cost model needs of this group's GPU and link (the same on every rank of a group
    of like GPUs; where they differ, the decision is still combined over ranks)."""
    from ..kernels import persistent_matmul as pm

    sms = pm.sm_count(device)
    shares = bool(getattr(ws, "shares_device", False))
    reserve = 0
    if shares and capturing:  # the chunk copies of a capture cannot ask for a copy engine
        reserve = env.reserve_sms()
    elif shares:
        from . import fused

        reserve = sms - fused._consumer_sms(ws, device, ce)
    return cost.Link(W, sms, _capability(device.index if device.index is not None else torch.cuda.current_device()),
                     shares, reserve, symm_reference=ws is not None)  # fmt: skip


@functools.lru_cache(maxsize=None)
def _capability(index: int):
    return torch.cuda.get_device_capability(index)


def _cuda_transport(group_name: str):
    pg = dist.distributed_c10d._resolve_process_group(group_name)
    if "nccl" in str(dist.get_backend(pg)).lower():
        return None
    return transport.HostTransport()


def _check_agreement(group_name: str, is_cuda: bool) -> bool:
    """Whether this call on a group without a workspace checks agreement with one collective."""
    pg = dist.distributed_c10d._resolve_process_group(group_name)
    try:
        backend = str(dist.get_backend(pg)).lower()
    except (ValueError, RuntimeError):  # outside the world's group map: c10d's collectives refuse it too
        return False
    if backend == "fake":  # a fake group moves no data: there is nothing to agree with
        return False
    return env.check_agreement(nccl=is_cuda and "nccl" in backend)


def _count(name: str, path: str, A) -> None:
    if isinstance(A, torch.Tensor) and A.is_cuda:
        PATH_COUNTS[(name, path)] += 1


@functools.lru_cache(maxsize=None)
def _signature(name: str):
    import inspect

    return inspect.signature(_REFERENCE[name])


@functools.lru_cache(maxsize=None)
def _arity(name: str):
    """(number of positional parameters, {keyword-only name: default}) of the op's reference."""

    ps = _signature(name).parameters.values()
    pos = [p for p in ps if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    return len(pos), {p.name: p.default for p in ps if p.kind == p.KEYWORD_ONLY}


def _normalize(name: str, args, kwargs):
    """All positional parameters in args, keyword-only ones (with defaults) in kwargs."""
    npos, kwonly = _arity(name)
    if len(args) == npos and all(k in kwonly for k in kwargs):  # the dispatcher's form: no binding needed
        return args, {**kwonly, **kwargs}
    bound = _signature(name).bind(*args, **kwargs)
    bound.apply_defaults()
    return bound.args, bound.kwargs


def _canonical(name: str, args):
    """A [1, N] bias of a scaled op as its [N] view (what _scaled_mm makes of it); the rest as given."""

    def flat(b):
        return b.view(-1) if isinstance(b, torch.Tensor) and b.dim() == 2 and b.shape[0] == 1 else b

    scalar = validate.one_element_scale

    if name == "fused_all_gather_scaled_matmul" and isinstance(args[6], (list, tuple)):
        return (args[0], args[1], scalar(args[2], args[0]), *args[3:6], [flat(b) for b in args[6]], *args[7:])
    if name == "fused_scaled_matmul_reduce_scatter":
        a = list(args)
        A, B = a[0], a[1]
        a[2] = scalar(a[2], A)
        if a[8] is not None and isinstance(A, torch.Tensor) and isinstance(B, torch.Tensor) and B.dim() == 2:
            a[8] = validate.resolve_output_shape(a[8], math.prod(A.shape[:-1]), B.shape[1])
        if len(a) > 9:
            a[9] = flat(a[9])
        return tuple(a)
    return args


_LOCKS: dict = {}
_NULL = contextlib.nullcontext()


def run(name: str, *args, **kwargs):
    """One call: agreement, decision and run, atomic per group within this process (calls of
    one group from two threads would otherwise interleave their collectives)."""
    group_name = args[_GROUP_ARG[name]] if len(args) > _GROUP_ARG[name] else kwargs.get("group_name")
    lock = _LOCKS.get(group_name)
    if lock is None:
        lock = _LOCKS.setdefault(group_name, threading.RLock())
    A = args[0] if args else kwargs.get("A")
    # NOTE: every CUDA call runs on A's device, as a C++ op's device guard would make it: the
    # workspace's creation and growth, its signals, the reference path's transfers and every
    # launch take the current device (a rank that never called set_device is on GPU 0).
    device = _NULL
    if isinstance(A, torch.Tensor) and A.is_cuda:
        index = A.get_device()
        if index != torch._C._cuda_getDevice():  # (CUDA is initialized: A is on it)
            device = torch.cuda.device(index)
    with lock, validate.no_autocast(A), device:
        return _run(name, *args, **kwargs)


def _decide(name: str, args, kwargs, W: int, is_cuda: bool):
    """(call, local error, runner, why): validation, the call's signature and the fused plan."""
    A = args[0]
    try:
        call = describe(name, args, kwargs, W)
        # A bad MPTP_* value is this rank's error: its peers are told where the call checks
        # agreement (a workspace, or MPTP_CHECK_AGREEMENT=1); elsewhere they time out.
        env.timeout_s(), env.reserve_sms(), env.ce_copies_enabled(), env.c_binder_enabled(), env.launch_memo_enabled()
        env.rs_reduce()
        local_err = None
    except (ValueError, TypeError, IndexError) as e:
        call, local_err = Call(name, error=f"{type(e).__name__}: {e}"), e
    if local_err is not None and not isinstance(A, torch.Tensor):
        raise local_err

    fused_mod, why = (None, "A is not a CUDA tensor") if not is_cuda else _fused_module()
    runner = None
    if fused_mod is not None and local_err is None:
        if env.fused_disabled():
            why = "MPTP_DISABLE_FUSED=1"
        elif name in ("fused_all_gather_matmul", "fused_all_gather_scaled_matmul") and len(args[1]) == 0:
            why = "no Bs: a plain all-gather (as PyTorch's ops accept)"
        else:
            runner, why = fused_mod.plan(name, W, *args, **kwargs)
    return call, local_err, runner, why


# -- the call memo ----------------------------------------------------------------------------------
# NOTE (issue 14): validation, the call's signature (describe) and the fused plan are functions of
# the call's signature alone: the arguments' types, shapes, strides, dtypes, devices and
# requires_grad, every scalar argument, the group's name and size, the caller's grad mode and the
# MPTP_* settings they read. A call with the signature of an earlier one that passed takes them
# from here. What depends on more is done on every call: the error record, a broken group, the
# workspace lookup, the cost model (the workspace's link), the options, the agreement exchange.
_MEMO: dict = {}
_MEMO_MAX = 256
MEMO_STATS: Counter = Counter()  # "hit" / "miss" / "none" (not memoized) per call; tests read it
_MEMO_ENV = ("MPTP_TIMEOUT_S", "MPTP_RESERVE_SMS", "MPTP_CE_COPIES", "MPTP_C_BINDER", "MPTP_LAUNCH_MEMO",
             "MPTP_RS_REDUCE", "MPTP_DISABLE_FUSED", "MPTP_FORCE_FUSED")  # fmt: skip
_SCALAR = (int, bool, str, type(None), torch.dtype)


class _NoMemo(Exception):
    pass


def _sig(x):
    cls = x.__class__
    if cls is torch.Tensor or cls is torch.nn.Parameter:
        return (cls, x.shape, x.stride(), x.dtype, x.device, x.requires_grad)
    if cls in _SCALAR or (cls is float and x == x):  # (a NaN would never match itself)
        return (cls, x)
    if cls is list or cls is tuple:
        return (cls, *map(_sig, x))
    raise _NoMemo  # a tensor subclass, another type: validated on every call


def _memo_key(name: str, args, kwargs, W: int):
    from .autograd import grad_mode_at_call

    try:
        key = [name, W, grad_mode_at_call(), env.raw_many(_MEMO_ENV), *map(_sig, args)]
        for k, v in kwargs.items():
            key += (k, _sig(v))
        return tuple(key)
    except (_NoMemo, RecursionError):  # (a list that holds itself: validation names it)
        return None


class _Entry:
    """What a call of one signature decided: its Call's fields, and its plan (bind) or why not."""

    __slots__ = ("must", "free", "need", "bind", "why", "encoded")

    def __init__(self, call: Call, runner, why):
        self.must, self.free, self.need = call.must, call.free, call.need
        self.bind, self.why = (runner.bind if runner is not None else None), why
        self.encoded = {}  # (fusable, options) -> Call.encode()


def _encode(call: Call, entry) -> bytes:
    if entry is None:
        return call.encode()
    k = (call.fusable, call.options)
    b = entry.encoded.get(k)
    if b is None:
        b = entry.encoded[k] = call.encode()
    return b


def _run(name: str, *args, **kwargs):
    args, kwargs = _normalize(name, args, kwargs)
    args = _canonical(name, args)
    A = args[0]
    group_name = args[_GROUP_ARG[name]]
    ref_fn = _REFERENCE[name]
    W = validate.group_size(group_name)  # an unknown group is raised at once: no peer to tell
    is_cuda = isinstance(A, torch.Tensor) and A.is_cuda
    if is_cuda:
        P = _prims()
        if P._C.lib() is not None and P._ErrorRecord.read() is not None:  # (the rank only to name an error)
            P.check_errors(group_name, dist.get_rank() if dist.is_initialized() else -1)
    if agreement.BROKEN and W > 1:
        agreement.check_broken(dist.distributed_c10d._resolve_process_group(group_name))
    key = _memo_key(name, args, kwargs, W)
    entry = _MEMO.get(key) if key is not None else None
    MEMO_STATS["none" if key is None else "miss" if entry is None else "hit"] += 1
    if entry is not None:
        call, local_err = Call(name, entry.must, entry.free, need=entry.need), None
        runner, why = (entry.bind(args), None) if entry.bind is not None else (None, entry.why)
    else:
        call, local_err, runner, why = _decide(name, args, kwargs, W, is_cuda)
        if key is not None and local_err is None:
            if len(_MEMO) >= _MEMO_MAX:
                _MEMO.clear()
            entry = _MEMO[key] = _Entry(call, runner, why)

    ws, ws_why = (None, None)
    if is_cuda and W > 1:
        ws, ws_why = _workspace(group_name, A.device, call.need)
    if ws is not None and getattr(ws, "broken", None):
        raise RuntimeError(ws.broken)
    if ws is None and runner is not None and W > 1:
        runner, why = None, ws_why
    if runner is not None and not env.force_fused():
        try:
            capturing = torch.cuda.is_current_stream_capturing()
            fuse, cost_why = cost.prefer_fused(runner.work, _link(ws, A.device, W, capturing, runner.work.ce_copies),
                                                capturing)  # fmt: skip
        except Exception as e:  # noqa: BLE001 - raised here, on one rank only, it would leave the peers waiting
            fuse, cost_why = False, f"the cost model failed ({type(e).__name__}: {e})"
        if not fuse:
            runner, why = None, cost_why
    call.fusable = runner is not None
    if runner is not None and ws is not None:
        try:
            call.options = runner.options(ws)
        except Exception as e:  # noqa: BLE001 - raised here, on one rank only, it would leave the peers waiting
            env.log_once(("options", type(e).__name__), "%s: no fused-path options (%s: %s)", name, type(e).__name__, e)
            call.options = 0

    payloads, options = None, 0
    what = f"mptp {name} on group {group_name!r}"
    if W > 1 and ws is not None:
        PeerTimeout = _prims().PeerTimeout
        try:
            pg = dist.distributed_c10d._resolve_process_group(group_name)
            payloads = ws.rendezvous.exchange(_encode(call, entry), what,
                                              env.host_timeout_s_or_default(pg, A.device.type))  # fmt: skip
        except PeerTimeout as e:
            ws.broken = str(e)  # the call numbers are out of step for good
            raise RuntimeError(str(e)) from None
    elif W > 1 and _check_agreement(group_name, is_cuda):
        payloads = agreement.exchange_collective(_encode(call, entry), group_name, what)
    if payloads is not None:
        rank = ws.rank if ws is not None else dist.get_rank(dist.distributed_c10d._resolve_process_group(group_name))
        try:
            fuse, need, options = agreement.resolve(call, payloads, rank, group_name)
        except ValueError as e:
            if local_err is not None:
                raise local_err from e
            raise
        if not fuse and runner is not None:
            runner, why = None, "a peer rank's call does not qualify for the fused path"
        if ws is not None and need > ws.nbytes:
            from ..symm import primitives as P

            ws = P.get_workspace(group_name, need, A.device)  # every rank grows: same max
    elif local_err is not None:
        raise local_err

    if runner is not None:
        _count(name, "fused", A)
        env.log_once((name, "fused"), "%s: fused path", name)
        with _guard(ws, what):
            return runner(ws, options)
    _count(name, "reference", A)
    tr = None
    if is_cuda and W > 1:
        tr = transport.SymmTransport(ws) if ws is not None else _cuda_transport(group_name)
        TRANSPORT_COUNTS[(name, tr.name if tr is not None else "nccl")] += 1
    env.log_once((name, why, getattr(tr, "name", None)), "%s: reference path (%s) over %s", name, why,
                 getattr(tr, "name", "functional collectives"))  # fmt: skip
    with _guard(ws, what), transport.using(tr, what):
        return ref_fn(*args, **kwargs)


_PRIMS = []


def _prims():
    """symm.primitives (and through it symm._C), imported on first use: a CPU-only call never needs
    it, and an import statement in the per-call path costs a microsecond or more each time."""
    if not _PRIMS:
        from ..symm import primitives

        _PRIMS.append(primitives)
    return _PRIMS[0]


class _guard:
    """Runs one call on the workspace: ordered after the previous call, and marked broken if it
    raises after its rendezvous.

    Order: every call shares the workspace's flags, signal counters and buffers, and enqueues
    on the caller's current stream; a call on another stream than the previous one first waits
    for the previous one's end (an event), so two calls never overlap on the GPU.
    NOTE: not inside CUDA-graph capture (an event recorded outside a capture cannot order it;
    capture from the stream of the eager calls, or synchronize before capturing).
    Broken: a call that raises may leave signals and buffers half-way through the protocol, so
    every later call on the workspace raises instead of pairing with a peer's other call.
    (A class, not a generator: the context costs a microsecond less per call, issue 14.)"""

    __slots__ = ("ws", "what", "stream", "capturing", "last")

    def __init__(self, ws, what: str):
        self.ws, self.what = ws, what

    def __enter__(self):
        ws = self.ws
        if ws is None:
            return self
        P = _prims()
        self.stream = stream = P.raw_stream(ws.device)  # raw handles: no Stream or Event object per call
        self.capturing = torch.cuda.is_current_stream_capturing()
        self.last = last = getattr(ws, "last_call", None)
        if last is not None and not self.capturing and last[0] != stream:
            P.stream_wait_event(stream, last[1])
        return self

    def __exit__(self, typ, e, tb):
        ws = self.ws
        if ws is None:
            return False
        if typ is not None:
            ws.broken = (f"{self.what}: an earlier call raised part-way on rank {ws.rank} "
                         f"({typ.__name__}: {e}); this group's mptp state is out of step with its "
                         "peers: restart the job")  # fmt: skip
            return False
        if self.capturing:
            ws.last_call = None  # replays run on the capture's stream: no eager event orders them
        else:
            ev = ws.raw_events()[3]
            _prims().event_record(ev, self.stream)
            ws.last_call = (self.stream, ev)
        return False


def _op(name):
    return functools.partial(run, name)


all_gather_matmul = _op("fused_all_gather_matmul")
all_gather_scaled_matmul = _op("fused_all_gather_scaled_matmul")
matmul_reduce_scatter = _op("fused_matmul_reduce_scatter")
scaled_matmul_reduce_scatter = _op("fused_scaled_matmul_reduce_scatter")
