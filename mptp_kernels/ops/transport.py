"""Collectives of the reference (decomposed) path, on a transport that works for the group.

  * SymmTransport: the group's mptp symmetric memory. All-gather: the local
    shard into my buffer, READY, copy-engine pulls of every peer's shard, DONE.
    Reduce-scatter: copy-engine pushes of chunk c into slot r of rank c's
    buffer, READY, an fp32 reduction in rank order, DONE. Raw bytes, so every
    dtype travels; every wait is bounded and a timed-out call's output is NaN.
  * None (functional collectives): NCCL groups, and every CPU call.
  * HostTransport: gloo groups with CUDA tensors and no workspace: staged
    through host memory (gloo's all-gather-into-tensor crashes on CUDA tensors,
    pytorch/pytorch#152645).
reference.py calls all_gather / reduce_scatter, which use the transport the
dispatcher installed for the call (using()), else functional collectives.
"""

import contextlib
import threading

import torch

from ..symm import primitives as P

_funcol = torch.ops._c10d_functional
_current = threading.local()
_TAG = P.register_tag("reference path collective")


@contextlib.contextmanager
def using(transport, what: str = None):
    """The transport of this thread's reference-path collectives; `what` names the op in errors."""
    prev = getattr(_current, "t", None), getattr(_current, "what", None)
    _current.t, _current.what = transport, what
    try:
        yield
    finally:
        _current.t, _current.what = prev


def current():
    return getattr(_current, "t", None)


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(-1).view(torch.uint8)


# dtypes every backend (gloo included) all-gathers and sums natively; others travel as bytes / are widened.
_NATIVE = (torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int32, torch.int64, torch.uint8,
           torch.complex64, torch.complex128)  # fmt: skip
# dtypes gloo and NCCL both sum natively (int8: the unfused collective sends int8, so must we).
_NATIVE_SUM = _NATIVE + (torch.int8,)


_PLAIN_DISPATCH = torch.Tensor.__torch_dispatch__


def _plain(t) -> bool:
    """A tensor whose ops run as a plain tensor's: no __torch_dispatch__ of its own."""
    cls = type(t)
    return cls is torch.Tensor or cls is torch.nn.Parameter or getattr(cls, "__torch_dispatch__", None) is _PLAIN_DISPATCH


def _bounded_group(t: torch.Tensor, group_name: str):
    """The process group when this collective runs eagerly on gloo with a real CPU tensor, else None.

    There the reference's collectives are c10d ops whose wait is bounded by MPTP_TIMEOUT_S: a
    functional collective on gloo waits for gloo's own timeout (30 minutes by default) when a
    peer skipped the call. Fake and traced tensors (the fake impls, torch.compile) keep the
    functional collectives, which only compute metadata there.
    """
    # NOTE: plain tensors, parameters (a Parameter's .contiguous() is itself) and any subclass
    # that leaves dispatch alone (x.as_subclass(Sub), a Parameter's subclass: found by a hostile
    # review, it waited for gloo's own timeout); fake, functional and wrapper tensors (DTensor)
    # override __torch_dispatch__.
    if not _plain(t) or t.device.type != "cpu":
        return None
    import torch.distributed as dist

    pg = dist.distributed_c10d._resolve_process_group(group_name)
    try:
        return pg if "gloo" in str(dist.get_backend(pg)).lower() else None
    except (ValueError, RuntimeError):
        return None


def _gather_bytes(t: torch.Tensor, W: int, group_name: str) -> torch.Tensor:
    """All-gathers t ([n, ...] contiguous, a dtype the backend sends) into [W * n, ...]."""
    pg = _bounded_group(t, group_name)
    if pg is None:
        return _funcol.wait_tensor(_funcol.all_gather_into_tensor(t, W, group_name))
    out = t.new_empty((W * t.shape[0], *t.shape[1:]) if t.dim() else (W,))
    # NOTE: torch 2.14 renamed all_gather_into_tensor (deprecated there) to all_gather_single.
    return _bounded("all_gather_single", "all_gather_into_tensor", out, t, pg, group_name, "mptp all-gather")


def _bounded(name, old_name, out, t, pg, group_name, what, **kw):
    """out = c10d.<name>(t) on pg (<old_name> before torch 2.14), waited at most env.host_timeout_s."""
    import torch.distributed as dist

    from . import agreement

    op = getattr(dist, name, None) or getattr(dist, old_name)
    call = getattr(_current, "what", None)
    # NOTE: counted like the agreement exchanges (a store write, no collective), so that a
    # timeout names the peers that had not reached this collective.
    arrival = agreement._arrive(pg, group_name, dist.get_rank(pg))
    W = dist.get_world_size(pg)
    agreement.wait_bounded(op(out, t, group=pg, async_op=True, **kw), pg, call or what, group_name,
                           why=lambda: f"timed out in the reference path's {what.removeprefix('mptp ')}"
                                       f"{agreement._missing(group_name, W, arrival)}",
                           in_thread="reduce_scatter" in name)  # fmt: skip
    return out


def funcol_all_gather(t: torch.Tensor, W: int, group_name: str) -> torch.Tensor:
    if t.dtype not in _NATIVE:  # FP8, int8, int16, bool, ... travel as bytes (gloo cannot send FP8 or int16)
        flat = t.contiguous().reshape(-1).view(torch.uint8)
        out = _gather_bytes(flat, W, group_name).view(t.dtype)
        return out.view(W * t.shape[0], *t.shape[1:]) if t.dim() else out
    return _gather_bytes(t, W, group_name)


def funcol_reduce_scatter(t: torch.Tensor, W: int, group_name: str, reduce_op: str = "sum") -> torch.Tensor:
    """reduce_op ("sum", or "avg" of floats) reduce-scatter along dim 0, in t's dtype: the collective
    the unfused graph runs, byte for byte, wherever the backend sums the dtype (integers it cannot
    sum are widened, then wrapped back; floats it cannot sum are summed in fp32)."""
    if t.dtype not in _NATIVE_SUM and not t.is_floating_point() and t.dtype != torch.bool:
        return funcol_reduce_scatter(t.to(torch.int64), W, group_name, reduce_op).to(t.dtype)
    if t.dtype not in _NATIVE_SUM and t.is_floating_point():  # e.g. the fnuz FP8s: gloo cannot sum them
        return funcol_reduce_scatter(t.float(), W, group_name, reduce_op).to(t.dtype)
    pg = _bounded_group(t, group_name)
    if pg is None:
        return _funcol.wait_tensor(_funcol.reduce_scatter_tensor(t, reduce_op, W, group_name))
    import torch.distributed as dist

    out = t.new_empty((t.shape[0] // W, *t.shape[1:]))
    op = dist.ReduceOp.AVG if reduce_op == "avg" else dist.ReduceOp.SUM
    return _bounded("reduce_scatter_single", "reduce_scatter_tensor", out, t.contiguous(), pg, group_name,
                    "mptp reduce-scatter", op=op)  # fmt: skip


class HostTransport:
    """gloo with CUDA tensors: copy to the host, run the collective there, copy back."""

    name = "host-staged gloo"

    def all_gather(self, t, W, group_name):
        return funcol_all_gather(t.cpu(), W, group_name).to(t.device)

    def reduce_scatter(self, t, W, group_name, reduce_op="sum"):
        if t.dtype.itemsize == 1 and t.is_floating_point():  # FP8 sums in fp32 on the host, rounded once
            return funcol_reduce_scatter(t.cpu().float(), W, group_name, reduce_op).to(t.device, t.dtype)
        return funcol_reduce_scatter(t.cpu(), W, group_name, reduce_op).to(t.device)


class SymmTransport:
    """The group's mptp workspace (ranks of one host): copy-engine moves of raw bytes."""

    name = "mptp symmetric memory"

    def __init__(self, ws: "P.SymmetricMemory"):
        self.ws = ws

    def all_gather(self, t: torch.Tensor, W: int, group_name: str) -> torch.Tensor:
        ws, r = self.ws, self.ws.rank
        src = _as_bytes(t)
        n = src.numel()
        assert n <= ws.nbytes, (n, ws.nbytes)
        out = torch.empty(W, n, dtype=torch.uint8, device=t.device)
        if torch.cuda.is_current_stream_capturing():
            ws.captured = True
        ws.check()
        ws.wait_signal(P.CH_DONE, tag=_TAG)
        # NOTE: raw addresses (rank p's buffer as mapped here; its shard at the start): no view
        # per peer, each costs several microseconds of host time.
        stream = P.raw_stream(t.device)
        P.copy_guarded_at(stream, [ws._buf_ptrs[r]], [src.data_ptr()], [n])  # nothing once a wait timed out
        ws.barrier(P.CH_READY, tag=_TAG)
        o = out.data_ptr()
        P.pull_at(stream, [o + p * n for p in range(W)],
                  [src.data_ptr() if p == r else ws._buf_ptrs[p] for p in range(W)], [n] * W, [None] * W)
        ws.put_signal(P.CH_DONE)
        P.finish([out], ws.err, stream=stream)  # NaN if a wait timed out
        return out.view(t.dtype).view(W * t.shape[0], *t.shape[1:]) if t.dim() else out.view(t.dtype)

    def reduce_scatter(self, t: torch.Tensor, W: int, group_name: str, scale: float = 1.0) -> torch.Tensor:
        """t: [W * c, ...] contiguous; returns the sum over ranks of chunk `rank` ([c, ...], t's dtype),
        times scale (16-bit and 32-bit floats and FP8 only: applied in fp32, before the rounding)."""
        from ..kernels.reduce import reduce_partials

        ws, r = self.ws, self.ws.rank
        t = t.contiguous()
        chunks = _as_bytes(t).view(W, -1)
        n = chunks.shape[1]
        assert W * n <= ws.nbytes, (W * n, ws.nbytes)
        if torch.cuda.is_current_stream_capturing():
            ws.captured = True
        ws.check()
        ws.wait_signal(P.CH_DONE, tag=_TAG)
        # Slot r of rank c's buffer receives my chunk c (over the peer mapping); nothing once a
        # wait has timed out (fail-stop: a slow peer may still be reducing its slots).
        base = chunks.data_ptr()
        P.copy_guarded_at(P.raw_stream(t.device), [ws._buf_ptrs[c] + r * n for c in range(W)],
                          [base + c * n for c in range(W)], [n] * W)  # fmt: skip
        ws.barrier(P.CH_READY, tag=_TAG)
        mine = ws.buffers[r][: W * n].view(t.dtype).view(W, -1)
        out_shape = (t.shape[0] // W, *t.shape[1:])
        if t.dtype in (torch.float16, torch.bfloat16, torch.float32, torch.float8_e4m3fn, torch.float8_e5m2):
            out = torch.empty(out_shape, dtype=t.dtype, device=t.device)
            reduce_partials(mine, out.view(-1), scale=scale)  # NOTE: fp32, rank order: deterministic
        else:  # fp64 and integers: exact enough, in the dtype itself, in rank order
            assert scale == 1.0, "scale: floats of at most 32 bits only"
            out = mine[0].clone()
            for p in range(1, W):
                out += mine[p]
            out = out.view(out_shape)
        ws.put_signal(P.CH_DONE)
        P.finish([out], ws.err, stream=P.raw_stream(t.device))  # NaN if a wait timed out
        return out
