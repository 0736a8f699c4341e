"""Cases a hostile fuzzer found (session 20, helper-51), 2 gloo ranks with the agreement check on:
a valid scaled matmul-reduce-scatter with zero rows and a row-wise A_scale returns the empty
output on every rank (it raised a broadcasting error: the scale was flattened only where it had
more than one element); an FP8 A of 3 dims that torch.matmul would multiply with bmm (which has no
FP8 kernel on the CPU) is a ValueError naming A on every rank, before any communication (it was a
NotImplementedError after the agreement, on the rank whose layout it was)."""

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


def _fp8_layout(transposed_ranks):
    g = dist.group.WORLD.group_name
    gen = torch.Generator().manual_seed(0)
    A = torch.randn(4, 2, 6, generator=gen).to(F8)
    if dist.get_rank() in transposed_ranks:
        A = A.transpose(0, 1).contiguous().transpose(0, 1)  # the same values, leading dims not one run
    B = torch.randn(6, 5, generator=gen).to(F8)
    try:
        out = torch.ops.mptp.fused_matmul_reduce_scatter(A, B, "sum", 0, g)
        return "returned", tuple(out.shape)
    except Exception as e:  # noqa: BLE001
        return type(e).__name__, str(e)


@pytest.mark.parametrize("transposed_ranks", [(1,), (0, 1)])
def test_an_fp8_layout_torch_matmul_cannot_take_is_refused_on_every_rank(agree2, transposed_ranks):
    for kind, msg in agree2.run(_fp8_layout, transposed_ranks, timeout_s=TIMEOUT_S):
        assert kind == "ValueError" and "A: torch.matmul cannot multiply" in msg, (kind, msg)


def test_an_fp8_layout_torch_matmul_takes_runs(agree2):
    assert agree2.run(_fp8_layout, (), timeout_s=TIMEOUT_S) == [("returned", (2, 2, 5))] * 2
