"""poison_if_error: overwrite a tensor with all-ones bytes (NaN for every float dtype) if a wait timed out.

The error record's first word is set by any timed-out wait of the process
(see mptp_kernels.symm.primitives). One program reads it once and returns at once when it is
0, so the healthy path costs one tiny launch and one read of host memory.
All-ones bytes are NaN in fp64/fp32/fp16/bf16/float8_e4m3fn/float8_e5m2 and -1 in integers.
"""

import torch
import triton
import triton.language as tl

from .launch import launch


@triton.jit
def _poison_kernel(X, err_ptr, nbytes, n_blocks, BLOCK: tl.constexpr):
    # NOTE: the record is host-mapped: a read crosses PCIe, and reads from many warps queue
    # (about a microsecond each on the H200: one per 8 KB block cost 38 ms on a 117 MB A_full,
    # 512 of them still about 0.5 ms). So one program of one warp reads it once, and writes
    # the whole tensor only when it is set.
    failed = tl.load(err_ptr, volatile=True)
    if failed != 0:
        offs = tl.arange(0, BLOCK).to(tl.int64)  # int64: tensors past 2**31 bytes
        # NOTE: n_blocks comes from the host: cdiv(nbytes, BLOCK) in int32 wraps just below 2**31.
        for _ in range(0, n_blocks):
            tl.store(X + offs, tl.full((BLOCK,), 255, tl.uint8), mask=offs < nbytes)
            offs += BLOCK


def poison_if_error(t: torch.Tensor, err: torch.Tensor) -> torch.Tensor:
    """t (contiguous) becomes all-ones bytes when err[0] != 0, stream-ordered; returns t."""
    if t.numel() == 0:
        return t
    assert t.is_contiguous()
    b = t.view(-1).view(torch.uint8) if t.element_size() > 0 else t
    BLOCK = 4096
    launch(_poison_kernel, (1,), [b, err, b.numel(), triton.cdiv(b.numel(), BLOCK)], dict(BLOCK=BLOCK), num_warps=1)
    return t
