"""The reduction of matmul-reduce-scatter: out = sum_p partials[p] in fp32, in rank order."""

import torch
import triton
import triton.language as tl


@triton.jit
def _reduce_partials_kernel(P, OUT, numel, W, scale, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    offs = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < numel
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    # NOTE: fixed order p = 0..W-1, so every rank gets bitwise-deterministic results.
    for p in range(W):
        acc += tl.load(P + p * numel + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(OUT + offs, (acc * scale).to(OUT.dtype.element_ty), mask=mask)


def reduce_partials(partials: torch.Tensor, out: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
    """out[...] = scale * sum over dim 0 of partials, accumulated in fp32.

    Args:
        partials: [W, *S] contiguous (bf16/fp16/fp32).
        out: [*S] contiguous, any float dtype.
    """
    W = partials.shape[0]
    numel = out.numel()
    assert partials.is_contiguous() and out.is_contiguous() and partials[0].numel() == numel
    BLOCK = 2048
    _reduce_partials_kernel[(triton.cdiv(numel, BLOCK),)](partials, out, numel, W, scale, BLOCK=BLOCK, num_warps=8)
    return out
