"""Autograd for the torch.ops.mptp ops. Every backward is itself a torch.ops.mptp call,
so it takes the fused path wherever the forward can (CUDA, enabled group).

All-gather-matmul, C_i = A_full @ B_i with A_full = all_gather(A, gather_dim):
    dA   = reduce_scatter(sum_i dC_i @ B_i^T, gather_dim)
         = fused_matmul_reduce_scatter([dC_0 | dC_1 | ...], [B_0 | B_1 | ...]^T)   (one call)
    dB_i = A_full^T @ dC_i        (A_full saved by the forward: no second all-gather)
  Gathering the last (K) dim is the same formula: dC_i @ B_i^T is [*S, W*K] and the
  reduce-scatter splits its last dim. A gradient flowing into the returned A_full
  joins the same reduce-scatter through identity rows (rare: only when A_full is used).
Matmul-reduce-scatter, C = reduce_scatter(A @ B, scatter_dim):
    dC_full, dA = fused_all_gather_matmul(dC, [B^T], scatter_dim, return_A=True)
    dB   = A^T @ dC_full          (the gathered dC of that call)
    reduce_op "avg" divides dC by the world size first.
The scaled (FP8) ops are forward-only: backpropagating through one raises.
Forward-mode AD (torch.func.jvp, torch.autograd.forward_ad) is not supported by any of the ops: a
dual input raises NotImplementedError. (Without that check the tangent of the output was silently
zero or None, as for any torch.library custom op without a jvp: found by a hostile review.)

NOTE: the all-gather-matmul forward needs A_full for dB even when the caller asked
for return_A=False. Its autograd kernel is the one torch.library.register_autograd
builds (torch._library.autograd.make_autograd_impl), wrapped so that the op below
autograd runs with return_A=True whenever a gradient is needed and A_full is then
dropped from what the caller sees. Where that builder is missing, plain
register_autograd is used and the backward gathers A again.
"""

import math
import threading

import torch
import torch.distributed.distributed_c10d as c10d

from .validate import no_autocast

_CALL = threading.local()


def grad_mode_at_call() -> bool:
    """Grad mode where the user called the op. The op below autograd runs with grad disabled
    (inside the autograd Function's forward), so the autograd kernels record it here."""
    on = getattr(_CALL, "grad", None)
    return torch.is_grad_enabled() if on is None else on


_SCALED = ("fused_all_gather_scaled_matmul", "fused_scaled_matmul_reduce_scatter")


def _refuse_forward_ad(name: str, args) -> None:
    """NotImplementedError where an input carries a forward-mode tangent (jvp, forward_ad)."""
    fwad = torch.autograd.forward_ad
    if getattr(fwad, "_current_level", 0) < 0:  # no dual level: no tangent anywhere (one global read)
        return
    for a in args:
        for t in a if isinstance(a, (list, tuple)) else (a,):
            if isinstance(t, torch.Tensor) and fwad.unpack_dual(t).tangent is not None:
                raise NotImplementedError(
                    f"mptp::{name} does not support forward-mode AD (torch.func.jvp, "
                    "torch.autograd.forward_ad): its output would carry no tangent. Use reverse mode "
                    "(.backward() or torch.autograd.grad; torch.func's transforms are not supported), "
                    "or the unfused collective + matmul."
                )


def _rows(t: torch.Tensor, dim: int) -> torch.Tensor:
    """[*S, X] -> [prod(S), X], rows in `dim`-major order (a free view for the ops' layouts).

    When dim is the last one (the K gather / N scatter), rows keep their natural order.
    """
    if dim != t.dim() - 1:
        t = t.movedim(dim, 0)
    return t.reshape(math.prod(t.shape[:-1]), t.shape[-1])  # (-1 is ambiguous with 0 columns)


def _h(t: torch.Tensor) -> torch.Tensor:
    """The conjugate transpose of a 2-D tensor (the transpose of a real one): the gradients of
    C = A @ B are dC @ B^H and A^H @ dC."""
    return t.t().conj().resolve_conj() if t.is_complex() else t.t()


def _dense(t: torch.Tensor) -> torch.Tensor:
    """t itself if its rows are dense, else a contiguous copy (a broadcast gradient, stride 0).

    NOTE: a gradient usually has the forward output's (gather-dim-major) strides, which
    the ops consume without a copy; forcing .contiguous() would copy it twice.
    """
    dense = t.stride(-1) == 1 and all(st != 0 or n == 1 for st, n in zip(t.stride(), t.shape))
    return t if dense else t.contiguous()


def _gather(A: torch.Tensor, gather_dim: int, group_name: str) -> torch.Tensor:
    """all_gather(A, gather_dim) through the op itself (any transport), with a one-column B."""
    W = c10d._get_group_size_by_name(group_name)
    k = A.shape[-1] * (W if gather_dim == A.dim() - 1 else 1)
    A_full, _ = torch.ops.mptp.fused_all_gather_matmul(
        A, [A.new_zeros(k, 1)], gather_dim, group_name, return_A=True
    )
    return A_full


# -- all-gather-matmul ----------------------------------------------------------------------------


def _ag_setup_context(ctx, inputs, keyword_only_inputs, output):
    A, Bs, gather_dim, group_name = inputs
    A_full = output[0]
    ctx.gather_dim = gather_dim % A.dim()
    ctx.group_name = group_name
    # Unused outputs (often A_full) get None, not a materialized zero gradient.
    ctx.set_materialize_grads(False)
    ctx.regather = A_full is None  # only without the return_A rewrite (see register)
    # A_full (or A) only where a dB needs it, as the unfused matmul saves its input: otherwise a
    # caller may change the returned A in place (autograd checks what was saved, on unpack).
    need_B = any(isinstance(B, torch.Tensor) and B.requires_grad for B in Bs)
    ctx.save_for_backward((A if A_full is None else A_full) if need_B else None, *Bs)
    # An output no input's gradient flows from does not require grad, as unfused: A_full where A
    # does not, C_i where neither A nor B_i does.
    dead = [] if A.requires_grad or A_full is None else [A_full]
    dead += [C for C, B in zip(output[1], Bs) if not (A.requires_grad or B.requires_grad)]
    if dead:
        ctx.mark_non_differentiable(*dead)


def _ag_backward(ctx, dA_full, dCs):
    # NOTE: saved_tensors is unpacked once: non-reentrant activation checkpointing refuses a
    # second unpack.
    saved = ctx.saved_tensors
    with no_autocast(next((t for t in saved if t is not None), None)):
        return _ag_backward_impl(ctx, saved, dA_full, dCs)


def _ag_backward_impl(ctx, saved, dA_full, dCs):
    A_full, *Bs = saved
    d, g = ctx.gather_dim, ctx.group_name
    need_A, need_Bs = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
    live = [(dC, B) for dC, B in zip(dCs, Bs) if dC is not None]
    dA = None
    if need_A and (live or dA_full is not None):
        cols = [dC for dC, _ in live]
        rows = [_h(B) for _, B in live]
        if dA_full is not None:
            k_full = dA_full.shape[-1]
            cols.append(dA_full)
            rows.append(torch.eye(k_full, dtype=dA_full.dtype, device=dA_full.device))
        G = _dense(cols[0]) if len(cols) == 1 else torch.cat(cols, dim=-1)
        Bt = rows[0] if len(rows) == 1 else torch.cat(rows, dim=0)
        dA = torch.ops.mptp.fused_matmul_reduce_scatter(G, Bt, "sum", d, g)
    dBs = [None] * len(Bs)
    if any(need_Bs) and live:
        if ctx.regather:
            A_full = _gather(A_full, d, g)
        A2t = _h(_rows(A_full, d))
        for i, (dC, need) in enumerate(zip(dCs, need_Bs)):
            if need and dC is not None:
                dBs[i] = A2t @ _rows(dC, d)
    return dA, dBs, None, None


def _register(lib, name: str, backward, setup_context=None, body=None) -> None:
    """Autograd for mptp::name as torch.library.register_autograd builds it (make_autograd_impl),
    behind the forward-mode check and with the caller's grad mode recorded; body(inner, keyset,
    *args, **kwargs), where given, calls the built kernel instead of a plain call. Where that
    builder is missing, plain register_autograd (no check)."""
    try:
        from torch._library.autograd import Info, make_autograd_impl
    except ImportError:
        torch.library.register_autograd(f"mptp::{name}", backward, setup_context=setup_context, lib=lib)
        return
    op = getattr(torch.ops.mptp, name).default
    inner = make_autograd_impl(op, Info(backward, setup_context))
    below = torch._C._after_autograd_keyset
    any_requires_grad = torch._C._any_requires_grad

    def autograd_kernel(keyset, *args, **kwargs):
        _refuse_forward_ad(name, args)
        # the caller's grad mode, recorded for grad_mode_at_call (inline, not a generator context: issue 14)
        grad = torch.is_grad_enabled()
        prev, _CALL.grad = getattr(_CALL, "grad", None), grad
        try:
            if not (grad and any_requires_grad(*args)):
                # What the built kernel does then (no graph to record; body's rewrite is for a
                # gradient only), without its layers: a few microseconds per call (issue 14).
                with torch._C._AutoDispatchBelowAutograd():
                    return op.redispatch(keyset & below, *args, **kwargs)
            if body is None:
                return inner(keyset, *args, **kwargs)
            return body(inner, keyset, *args, **kwargs)
        finally:
            _CALL.grad = prev

    lib.impl(name, autograd_kernel, "Autograd", with_keyset=True)


def _ag_kernel(inner, keyset, *args, **kwargs):
    """Runs the op below autograd with return_A=True whenever a gradient is needed (dB needs
    A_full), then drops A_full from what the caller asked not to see."""
    if kwargs.get("return_A", True) or not (torch.is_grad_enabled() and torch._C._any_requires_grad(*args)):
        return inner(keyset, *args, **kwargs)
    _, outs = inner(keyset, *args, **{**kwargs, "return_A": True})
    return None, outs


# -- matmul-reduce-scatter ------------------------------------------------------------------------


def _rs_setup_context(ctx, inputs, output):
    A, B, reduce_op, scatter_dim, group_name = inputs
    ctx.scatter_dim = scatter_dim % A.dim()
    ctx.group_name = group_name
    ctx.world_size = c10d._get_group_size_by_name(group_name) if reduce_op == "avg" else 1
    ctx.save_for_backward(A, B)


def _rs_backward(ctx, dC):
    saved = ctx.saved_tensors  # once: see _ag_backward
    with no_autocast(saved[0]):
        return _rs_backward_impl(ctx, saved, dC)


def _rs_backward_impl(ctx, saved, dC):
    A, B = saved
    need_A, need_B = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
    if ctx.world_size > 1:
        dC = dC / ctx.world_size
    # Only dB wanted: a one-column B keeps the all-gather and drops the matmul.
    Bt = _h(B) if need_A else _h(B)[:, :1]
    dC_full, (dA,) = torch.ops.mptp.fused_all_gather_matmul(
        _dense(dC), [Bt], ctx.scatter_dim, ctx.group_name, return_A=True
    )
    dB = _h(_rows(A, ctx.scatter_dim)) @ _rows(dC_full, ctx.scatter_dim) if need_B else None
    return (dA if need_A else None), dB, None, None, None


# -- scaled (FP8) ops: forward-only ---------------------------------------------------------------


def _forward_only(name: str):
    def backward(ctx, *grads):
        raise RuntimeError(
            f"mptp::{name} is forward-only: it has no backward (FP8 training needs a scaling "
            "recipe such as torchao.float8's). Run it under torch.no_grad() or on inputs that "
            "do not require grad; for training use the bf16/fp16 ops, which are differentiable."
        )

    return backward


def register(lib) -> None:
    """Registers autograd for every torch.ops.mptp op (called once, by _library)."""
    _register(lib, "fused_all_gather_matmul", _ag_backward, _ag_setup_context, _ag_kernel)
    _register(lib, "fused_matmul_reduce_scatter", _rs_backward, _rs_setup_context)
    for name in _SCALED:
        _register(lib, name, _forward_only(name))
