"""Reference implementations: functional collectives + matmul / _scaled_mm.

They define the ops' semantics, serve as the test oracle's shape/stride model,
run on any backend (gloo on CPU, NCCL on GPU) and are the fused path's
fallback. They are also the fake implementations: under FakeTensorMode the
functional collectives only compute metadata.
"""

import functools
import math
from typing import List, Optional, Sequence

import torch

from . import transport, validate
from .validate import ScaleMode


def all_gather(t: torch.Tensor, W: int, group_name: str) -> torch.Tensor:
    """Gathers `t` along dim 0 on the call's transport (functional collectives by default)."""
    t = t.contiguous()
    tr = transport.current()
    if tr is not None:
        return tr.all_gather(t, W, group_name)
    return transport.funcol_all_gather(t, W, group_name)


def reduce_scatter(t: torch.Tensor, reduce_op: str, scatter_dim: int, W: int, group_name: str):
    """Reduce-scatters `t` along `scatter_dim`; the result is contiguous, in t's dtype.

    On NCCL and gloo (functional collectives, or gloo staged through the host) this is the
    unfused collective itself: the same dtype, the same reduce op ("avg" of floats is the
    backend's "avg"), the same bytes. A rank whose graph the FX pass rewrote then still pairs
    with a peer whose graph it did not (a rank-0-only print, say): any other dtype or op would
    send other bytes (gloo aborts; NCCL's ring hangs or mixes sums), and it rounds as the unfused
    graph does: fp16 and bf16 are summed in their own dtype there. Integer "avg" (which the
    backends refuse) is the sum divided by W, truncating, so the dtype is kept. Integers that
    gloo and NCCL cannot sum (int16, uint16, ...) are widened to int64 and wrapped back: the op
    serves them where the unfused collective raises (so a peer whose graph the pass left alone
    raises at once, and this rank's wait ends in a timeout error, never a wrong value).

    FP8 partials are summed (and averaged) in fp32 and rounded once, saturating, on every
    transport (gloo cannot reduce FP8, and the FX pass never fuses an FP8-output reduce-scatter).
    On mptp's own transport (every rank is in the op: the call was agreed through the group's
    rendezvous) bf16, fp16 and fp32 are summed in fp32 in rank order and averaged before their
    one rounding, as the fused path does: there a running fp16 sum never overflows to inf where
    the sum or the average fits, unlike the backends' fp16 sums.
    """
    if scatter_dim != 0:
        # Stack the W chunks along dim 0: rank r receives the reduced chunk r.
        t = torch.cat(t.chunk(W, dim=scatter_dim), dim=0)
    if t.dtype in validate.FP8_DTYPES:
        out = reduce_scatter(t.float(), reduce_op, 0, W, group_name)
        fmax = torch.finfo(t.dtype).max
        return out.clamp(-fmax, fmax).to(t.dtype)
    t = t.contiguous()
    tr = transport.current()
    avg, floats = reduce_op == "avg", t.is_floating_point() or t.is_complex()
    if isinstance(tr, transport.SymmTransport):
        if t.dtype in (torch.float16, torch.bfloat16, torch.float32):
            return tr.reduce_scatter(t, W, group_name, scale=1.0 / W if avg else 1.0)
        op = "sum"  # fp64, complex and integers: summed in their dtype, in rank order
        out = tr.reduce_scatter(t, W, group_name)
    else:
        op = "avg" if avg and floats else "sum"
        if tr is not None:
            out = tr.reduce_scatter(t, W, group_name, op)
        else:
            out = transport.funcol_reduce_scatter(t, W, group_name, op)
    if avg and op == "sum":
        out = out / W if floats else torch.div(out, W, rounding_mode="trunc")
    return out


def _gather_dim_major(A_shard: torch.Tensor, gather_dim: int, W: int, group_name: str):
    """All-gathers A_shard along gather_dim; returns it with gather_dim moved first.

    A_shard: [*S] -> [W * S[gather_dim], *S without gather_dim], contiguous.
    """
    gathered = all_gather(A_shard, W, group_name)
    out = gathered.view(W, *A_shard.shape).movedim(gather_dim + 1, 1).flatten(0, 1)
    if all(type(n) is int for n in A_shard.shape):  # NOTE: not for symbolic shapes: no guards
        same = size1_restrided(out, out.shape, _gather_dim_major_strides(tuple(A_shard.shape), W, gather_dim))
        if same is not None:
            out = same
    return out


def size1_restrided(t: torch.Tensor, shape, stride) -> Optional[torch.Tensor]:
    """t with (shape, stride), without a copy, where they differ from t's in size-1 dims' strides
    only (the same elements); else None."""
    if tuple(t.shape) != tuple(shape) or any(n != 1 and a != b for n, a, b in zip(t.shape, t.stride(), stride)):
        return None
    return t if t.stride() == tuple(stride) else t.as_strided(shape, stride)


@functools.lru_cache(maxsize=1024)
def _gather_dim_major_strides(shape: tuple, W: int, gather_dim: int) -> tuple:
    """The strides _gather_dim_major's views give a real (ATen) tensor.

    NOTE: found by a hostile review: a view's stride for a size-1 dim is not one thing (ATen's
    view and the Python one fake tensors run pick different ones), so the fake returned other
    strides than the real op for, e.g., a [1, S, K] shard gathered on dim 1. The fake takes the
    real op's: these views, run by ATen on a meta tensor (no mode: neither fake nor tracing, and no
    Python dispatcher: on while torch.compile traces, it gave the Python views' strides, which this
    cache then kept for every later eager call; found by another hostile review)."""
    with validate.real_mode():
        g = torch.empty((W * shape[0], *shape[1:]), device="meta")
        return tuple(g.view(W, *shape).movedim(gather_dim + 1, 1).flatten(0, 1).stride())


def all_gather_matmul(
    A: torch.Tensor,
    Bs: Sequence[torch.Tensor],
    gather_dim: int,
    group_name: str,
    *,
    return_A: bool = True,
):
    """A_full = all_gather(A, gather_dim); returns (A_full or None, [A_full @ B for B in Bs]).

    A: [*S, K] (N-D, >= 2 dims), the local shard; each B: [K, N_i] (or [W*K, N_i]
    when gathering the last dim). Outputs: A_full [*S with S[gather_dim]*W, K] and
    [*A_full.shape[:-1], N_i] in A's dtype.
    """
    W, gather_dim = validate.all_gather_matmul(A, Bs, gather_dim, group_name, scaled=False)
    if gather_dim == A.dim() - 1:
        A_mm = torch.cat(all_gather(A, W, group_name).chunk(W), dim=-1)
        outs = [torch.matmul(A_mm, B) for B in Bs]
        return (A_mm if return_A else None), outs
    A_gm = _gather_dim_major(A, gather_dim, W, group_name)
    outs = [torch.matmul(A_gm, B).movedim(0, gather_dim) for B in Bs]
    return (A_gm.movedim(0, gather_dim) if return_A else None), outs


# (dtypes of A, B, the scales and the bias, scale modes, out dtype, fast accum) -> torch's CPU
# kernel takes such calls. NOTE: a refusal for another reason (a layout) keeps the formula for
# the key: the same values but for the last bits.
_CPU_SCALED_MM: dict = {}


def _cpu_scaled_mm(A, B, A_scale, B_scale, bias, out_dtype, use_fast_accum):
    """torch's CPU _scaled_mm, or None where it refuses such a call (remembered per key)."""
    key = (A.dtype, B.dtype, A_scale.dtype, B_scale.dtype, A_scale.numel() == 1, B_scale.numel() == 1,
           None if bias is None else bias.dtype, out_dtype, use_fast_accum)  # fmt: skip
    if not _CPU_SCALED_MM.get(key, True):
        return None
    try:
        out = torch._scaled_mm(A, B, A_scale, B_scale, bias=bias, out_dtype=out_dtype, use_fast_accum=use_fast_accum)
    except (RuntimeError, NotImplementedError, ValueError, TypeError):  # e.g. mixed FP8 with bf16 scales
        if _real(A):  # (a fake or traced call's refusal is not the CPU kernel's)
            _CPU_SCALED_MM[key] = False
        return None
    return out


def _real(t) -> bool:
    """t is a plain tensor and no dispatch mode is on: what a kernel refuses here, it refuses."""
    return type(t) is torch.Tensor and not torch._C._len_torch_dispatch_stack()


def scaled_mm(A, B, A_scale, B_scale, bias=None, result_scale=None, out_dtype=None, use_fast_accum=False):
    """torch._scaled_mm as the ops define it, the same on every device and torch version.

    A: [M, K] FP8; B: [K, N] FP8 (column-major on CUDA); A_scale: one element or [M, 1];
    B_scale: one element or [1, N]; out_dtype: default A's dtype (an FP8 output).
    Non-FP8 outputs on CUDA are torch._scaled_mm itself. FP8 outputs are
    y = (sa * sb * A @ B + bias) * result_scale in fp32, saturated to the FP8 range,
    rounded to nearest: cuBLASLt's D-scale convention (on the CPU the fp32 product is
    torch's CPU _scaled_mm where it takes the scales, so that in range the output is the
    one torch's CPU FP8 output gives). NOTE: torch's own FP8 output is not
    one thing: CUDA _scaled_mm ignores scale_result in torch 2.10-2.11 (pytorch/pytorch#190449)
    and the CPU divides by it where out_dtype is given and ignores it where out_dtype is None
    (torch 2.14.1), so the result scale is applied here, always as a multiplier. Non-FP8 outputs on the CPU
    are torch._scaled_mm where it takes the scales (torch 2.11's CPU kernel has no row-wise
    scales), else computed in fp32.
    """
    want = out_dtype or A.dtype
    fp8_out = want in validate.FP8_DTYPES
    # NOTE: scales and bias as contiguous tensors: CUDA's row-wise _scaled_mm refuses strided
    # scales, which the fused kernels take (a scale sliced from a table is a valid input).
    A_scale, B_scale = A_scale.contiguous(), B_scale.contiguous()
    bias = bias.contiguous() if bias is not None else None
    if A.is_cuda and not fp8_out:
        return torch._scaled_mm(A, B, A_scale, B_scale, bias=bias, out_dtype=want, use_fast_accum=use_fast_accum)
    # NOTE: real tensors only (not fake), and K > 0: torch's CPU kernel leaves a K = 0 output
    # unwritten (garbage) where the product is zeros (plus the bias).
    y = None
    if type(A) is torch.Tensor and A.device.type == "cpu" and A.shape[-1] > 0:
        # NOTE: torch's own CPU _scaled_mm where it takes these scales (row-wise from torch 2.12),
        # so a graph the pass rewrote rounds as the graph it replaced (fp32 products summed
        # in another order differ in the last bits, and an FP8 output then rounds one step
        # off: found by a port of PyTorch's test). An FP8 output takes its fp32 result, which
        # rounds as torch's FP8 output does within range (checked on 800 random cases).
        # Elsewhere the fp32 definition below.
        y = _cpu_scaled_mm(A, B, A_scale, B_scale, None if fp8_out else bias,
                           torch.float32 if fp8_out else want, use_fast_accum)  # fmt: skip
        if y is not None and not fp8_out:
            return y
    if y is None and A.is_cuda and A_scale.numel() == 1 and B_scale.numel() == 1:
        y = torch._scaled_mm(A, B, A_scale, B_scale, out_dtype=torch.float32, use_fast_accum=use_fast_accum)
    elif y is None:  # (CUDA's row-wise _scaled_mm writes bf16 only)
        y = (A.float() @ B.float()) * A_scale.float() * B_scale.float()
    if bias is not None:
        y = y + bias.float()
    if not fp8_out:
        return y.to(want)
    if result_scale is not None:  # one element of any shape (validated): a scalar, not a broadcast
        y = y * result_scale.float().reshape(())
    fmax = torch.finfo(want).max
    return y.clamp(-fmax, fmax).to(want)


def _scaled_mm_nd(A, B, A_scale, B_scale, bias, result_scale, out_dtype, use_fast_accum):
    lead = A.shape[:-1]
    out = scaled_mm(A.flatten(0, -2), B, A_scale, B_scale, bias, result_scale, out_dtype, use_fast_accum)
    return out.unflatten(0, lead)


def gathered_A_scale(A, A_scale, mode: ScaleMode, gather_dim: int, W: int, group_name: str):
    """A_scale in the row order of the gather-dim-major, flattened A_full."""
    if mode == ScaleMode.ROW_WISE_SHARDED:
        s = all_gather(A_scale.contiguous(), W, group_name)
        return s.view(W, *A_scale.shape).movedim(gather_dim + 1, 1).flatten(0, -2)
    if mode == ScaleMode.ROW_WISE_REPLICATED:
        return A_scale.movedim(gather_dim, 0).flatten(0, -2).contiguous()
    return A_scale


def all_gather_scaled_matmul(
    A: torch.Tensor,
    Bs: Sequence[torch.Tensor],
    A_scale: torch.Tensor,
    B_scales: Sequence[torch.Tensor],
    gather_dim: int,
    group_name: str,
    biases: Sequence[Optional[torch.Tensor]],
    result_scales: Sequence[Optional[torch.Tensor]],
    out_dtypes: Sequence,
    use_fast_accum: Sequence[bool],
):
    """The FP8 all-gather-matmul: `_scaled_mm(A_full, B_i, ...)` for each B; always returns A_full.

    A: [*S, K] float8; A_scale: one element (tensor-wise), [*S[:-1]... , 1] matching
    the shard (row-wise sharded, gathered with A) or matching A_full (row-wise
    replicated), float32. Each B: [K, N_i] float8, column-major; B_scales[i]: one
    element or [1, N_i] float32. Outputs: A_full and [*A_full.shape[:-1], N_i] in
    out_dtypes[i] (default A's dtype as _scaled_mm defines it).
    """
    A_scale = validate.one_element_scale(A_scale, A)  # (the fake impl is this function too)
    W, gather_dim = validate.all_gather_matmul(A, Bs, gather_dim, group_name, scaled=True)
    mode = validate.all_gather_scaled_lists(
        A, Bs, A_scale, B_scales, biases, result_scales, out_dtypes, use_fast_accum, gather_dim, W
    )
    out_dtypes = [validate.scaled_out_dtype(d, f"out_dtypes[{i}]") for i, d in enumerate(out_dtypes)]
    A_gm = _gather_dim_major(A, gather_dim, W, group_name)
    scale = gathered_A_scale(A, A_scale, mode, gather_dim, W, group_name)
    outs = [
        _scaled_mm_nd(A_gm, B, scale, bs, bias, rs, dt, fa).movedim(0, gather_dim)
        for B, bs, bias, rs, dt, fa in zip(Bs, B_scales, biases, result_scales, out_dtypes, use_fast_accum)
    ]
    return A_gm.movedim(0, gather_dim), outs


def matmul_reduce_scatter(
    A: torch.Tensor, B: torch.Tensor, reduce_op: str, scatter_dim: int, group_name: str
) -> torch.Tensor:
    """reduce_scatter(A @ B, reduce_op, scatter_dim).

    A: [*S, K]; B: [K, N], same dtype. Output: [*S, N] with dim scatter_dim divided
    by the world size, contiguous, A's dtype. reduce_op: "sum" or "avg".
    """
    W, scatter_dim = validate.matmul_reduce_scatter(A, B, reduce_op, scatter_dim, group_name, False)
    return reduce_scatter(torch.matmul(validate.matmul_operand(A), B), reduce_op, scatter_dim, W, group_name)


def scaled_matmul_reduce_scatter(
    A: torch.Tensor,
    B: torch.Tensor,
    A_scale: torch.Tensor,
    B_scale: torch.Tensor,
    reduce_op: str,
    orig_scatter_dim: int,
    scatter_dim_after_maybe_reshape: int,
    group_name: str,
    output_shape: Optional[List[int]],
    bias: Optional[torch.Tensor] = None,
    result_scale: Optional[torch.Tensor] = None,
    out_dtype=None,
    use_fast_accum: bool = False,
) -> torch.Tensor:
    """reduce_scatter(_scaled_mm(A, B, ...), reduce_op, orig_scatter_dim).

    A: [*S, K] float8 (or already flattened to 2-D by a reshape, with the
    original shape in output_shape = [*S, N]); A_scale: one element or
    [*A.shape[:-1], 1]; B: [K, N] float8 column-major. Output: output_shape with
    dim orig_scatter_dim divided by the world size, in out_dtype.
    """
    A_scale = validate.one_element_scale(A_scale, A)  # (the fake impl is this function too)
    W, _ = validate.matmul_reduce_scatter(A, B, reduce_op, None, group_name, scaled=True)
    validate.scaled_rs_extras(A, A_scale, B_scale, bias, result_scale, B.shape[1])
    out_dtype = validate.scaled_out_dtype(out_dtype)
    if output_shape is None:
        output_shape = [*A.shape[:-1], B.shape[1]]
    output_shape = validate.resolve_output_shape(output_shape, math.prod(A.shape[:-1]), B.shape[1])
    validate.check_output_shape(output_shape, math.prod(A.shape[:-1]), B.shape[1])
    validate.scatter_dim_after_reshape(scatter_dim_after_maybe_reshape, A)
    orig_scatter_dim = validate.norm_dim(orig_scatter_dim, len(output_shape), "orig_scatter_dim")
    validate.check_divisible(output_shape, orig_scatter_dim, W, "orig_scatter_dim")
    if A_scale.numel() != 1:  # row-wise, zero rows included
        A_scale = A_scale.flatten(0, -2).contiguous()
    C = scaled_mm(A.flatten(0, -2).contiguous(), B, A_scale, B_scale, bias, result_scale, out_dtype,
                  use_fast_accum)
    C = C.view(*output_shape[:-1], B.shape[1])
    return reduce_scatter(C, reduce_op, orig_scatter_dim, W, group_name)
