"""Cases a hostile fuzzer found (session 20, helper-51), 2 gloo ranks with the agreement check on:
a valid scaled matmul-reduce-scatter with zero rows and a row-wise A_scale returns the empty
output on every rank (it raised a broadcasting error: the scale was flattened only where it had
more than one element); an FP8 A of 3 dims that torch.matmul would multiply with bmm (which has no
FP8 kernel on the CPU) is multiplied as ATen's fold would (a copy, then mm), on every rank (it was
a NotImplementedError after the agreement, on the rank whose layout it was; a refusal instead
failed an Inductor compile that eager takes)."""

import pytest
import torch
import torch.distributed as dist

from dist.harness import Workers

TIMEOUT_S = 120
F8 = torch.float8_e4m3fn


@pytest.fixture(scope="module")
def agree2():
    w = Workers(2, env={"MPTP_CHECK_AGREEMENT": "1", "MPTP_TIMEOUT_S": "10"})
    yield w
    w.close()


def _zero_rows(modes):
    g = dist.group.WORLD.group_name
    A = torch.zeros(0, 4, 4).to(F8)
    B = torch.randn(4, 5).to(F8)
    if modes[dist.get_rank()] == "row":
        A_scale, B_scale = torch.ones(0, 4, 1), torch.ones(1, 5)
    else:
        A_scale, B_scale = torch.ones(()), torch.ones(())
    out = torch.ops.mptp.fused_scaled_matmul_reduce_scatter(A, B, A_scale, B_scale, "sum", 1, 1, g, [0, 4, 5], None,
                                                             None, torch.bfloat16, False)  # fmt: skip
    return tuple(out.shape), out.dtype


@pytest.mark.parametrize("modes", [("row", "row"), ("tensor", "row")])
def test_zero_rows_with_row_wise_scales(agree2, modes):
    assert agree2.run(_zero_rows, modes, timeout_s=TIMEOUT_S) == [((0, 2, 5), torch.bfloat16)] * 2


def _fp8_layout_result(transposed_ranks):
    """This rank's output and the float64 reduce-scatter of every rank's product (all ranks use
    the same A values: only the layout differs)."""
    g = dist.group.WORLD.group_name
    gen = torch.Generator().manual_seed(0)
    A = torch.randn(4, 2, 6, generator=gen).to(F8)
    B = torch.randn(6, 5, generator=gen).to(F8)
    want = (A.double() @ B.double()) * dist.get_world_size()
    if dist.get_rank() in transposed_ranks:
        A = A.transpose(0, 1).contiguous().transpose(0, 1)  # the same values, leading dims not one run
    out = torch.ops.mptp.fused_matmul_reduce_scatter(A, B, "sum", 0, g)
    r = dist.get_rank()
    return out.shape, float((out.double() - want[2 * r : 2 * r + 2]).abs().max())


@pytest.mark.parametrize("transposed_ranks", [(), (1,), (0, 1)])
def test_an_fp8_layout_torch_matmul_would_send_to_bmm_is_multiplied(agree2, transposed_ranks):
    for shape, err in agree2.run(_fp8_layout_result, transposed_ranks, timeout_s=TIMEOUT_S):
        # FP8 products summed in FP8's own output dtype (the unscaled op keeps A's dtype):
        # within FP8 e4m3's rounding of the sum (|values| < 64, 3 mantissa bits).
        assert tuple(shape) == (2, 2, 5) and err <= 8.0, (shape, err)
