"""The reduction of matmul-reduce-scatter: out = sum_p partials[p] in fp32, in rank order."""

from typing import Optional

import torch
import triton
import triton.language as tl

from . import epilogue
from .epilogue import to_output
from .launch import launch
from .poison import poison_if_error


@triton.jit
def _reduce_partials_kernel(P, OUT, numel, W, scale, E5M2_INF: tl.constexpr, SOFT_FP8: tl.constexpr,
                            BLOCK: tl.constexpr):  # fmt: skip
    pid = tl.program_id(0)
    offs = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < numel
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    # NOTE: fixed order p = 0..W-1, so every rank gets bitwise-deterministic results. The
    # pointer advances by numel per partial: 64-bit, where p * numel in int32 would pass 2**31.
    ptrs = P + offs
    for _ in range(W):
        acc += tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)
        ptrs += numel
    acc = acc * scale
    tl.store(OUT + offs, to_output(acc, OUT.dtype.element_ty, E5M2_INF, SOFT_FP8), mask=mask)


def reduce_partials(
    partials: torch.Tensor, out: torch.Tensor, scale: float = 1.0, err: Optional[torch.Tensor] = None
) -> torch.Tensor:
    """out[...] = scale * sum over dim 0 of partials, accumulated in fp32.

    Args:
        partials: [W, *S] contiguous (bf16/fp16/fp32/FP8).
        out: [*S] contiguous, any float dtype (FP8 rounded as persistent_matmul rounds it).
        scale: applied to the fp32 sum (e.g. 1 / W for "avg").
        err: optional int32[6] error record (csrc/symm/symm.h ErrorRecord); if err[0] != 0
            once the sum is written (a wait of this call timed out: the partials may be
            stale), out is overwritten with NaN, never a plausible sum. NOTE: read once,
            after the reduction (poison.py): the record is host memory, and one read per
            program cost about 30 ms per call on the H200.
    """
    W = partials.shape[0]
    numel = out.numel()
    assert partials.is_contiguous() and out.is_contiguous() and partials[0].numel() == numel
    if err is not None:
        assert err.dtype == torch.int32 and err.numel() >= 6, "err must be an int32[6] error record"
    fp8 = epilogue.fp8_out_constexprs(out.device, out.dtype, False)
    BLOCK = 2048
    launch(_reduce_partials_kernel, (triton.cdiv(numel, BLOCK),),
           [partials, out, numel, W, float(scale)],
           dict(E5M2_INF=fp8["E5M2_INF"], SOFT_FP8=fp8["SOFT_FP8"], BLOCK=BLOCK), num_warps=8)  # fmt: skip
    if err is not None:
        poison_if_error(out, err)
    return out
