"""Bad input gets a ValueError naming the argument, on every rank, before any
communication (checked with 2 processes: a collective would hang or mismatch)."""

import pytest
import torch
import torch.distributed as dist

FP8 = torch.float8_e4m3fn


def _g():
    return dist.group.WORLD.group_name


def _ag(A, Bs, gather_dim=0, group=None):
    return torch.ops.mptp.fused_all_gather_matmul(A, Bs, gather_dim, group or _g())


def _rs(A, B, reduce_op="sum", scatter_dim=0, group=None):
    return torch.ops.mptp.fused_matmul_reduce_scatter(A, B, reduce_op, scatter_dim, group or _g())


def _ags(A_scale_shape=(1,), n_lists=1, gather_dim=0, B_scales_device="cpu"):
    A = torch.zeros(4, 16).to(FP8)
    B = torch.zeros(8, 16).to(FP8).t()
    bs = torch.ones((), device=B_scales_device)
    n = n_lists
    return torch.ops.mptp.fused_all_gather_scaled_matmul(
        A, [B], torch.ones(A_scale_shape), [bs] * n, gather_dim, _g(), [None] * n, [None] * n,
        [None] * n, [False] * n,
    )  # fmt: skip


CASES = {
    "A_1d": (lambda: _ag(torch.zeros(8), [torch.zeros(8, 4)]), "A:"),
    "B_not_2d": (lambda: _ag(torch.zeros(4, 8), [torch.zeros(8, 4, 1)]), "Bs[0]:"),
    "K_mismatch": (lambda: _ag(torch.zeros(4, 8), [torch.zeros(8, 4), torch.zeros(9, 4)]), "Bs[1]:"),
    "dtype_mismatch": (lambda: _ag(torch.zeros(4, 8), [torch.zeros(8, 4, dtype=torch.float16)]), "Bs[0]:"),
    "empty_Bs": (lambda: _ag(torch.zeros(4, 8), []), "Bs:"),
    "gather_dim_range": (lambda: _ag(torch.zeros(4, 8), [torch.zeros(8, 4)], gather_dim=2), "gather_dim:"),
    "unknown_group": (lambda: _ag(torch.zeros(4, 8), [torch.zeros(8, 4)], group="no-such-group"), "group_name:"),
    "scaled_list_lengths": (lambda: _ags(n_lists=2), "B_scales:"),
    "scaled_A_scale_shape": (lambda: _ags(A_scale_shape=(3, 1)), "A_scale:"),
    "device_mismatch": (lambda: _ags(B_scales_device="meta"), "B_scales[0]:"),
    "rs_reduce_op": (lambda: _rs(torch.zeros(4, 8), torch.zeros(8, 4), reduce_op="max"), "reduce_op:"),
    "rs_scatter_dim_range": (lambda: _rs(torch.zeros(4, 8), torch.zeros(8, 4), scatter_dim=-3), "scatter_dim:"),
    "rs_not_divisible": (lambda: _rs(torch.zeros(5, 8), torch.zeros(8, 4)), "scatter_dim:"),
    "rs_K_mismatch": (lambda: _rs(torch.zeros(4, 8), torch.zeros(7, 4)), "B:"),
    "rs_A_1d": (lambda: _rs(torch.zeros(8), torch.zeros(8, 4)), "A:"),
}  # fmt: skip


def _expect_error(case):
    fn, prefix = CASES[case]
    with pytest.raises(ValueError) as info:
        fn()
    msg = str(info.value)
    assert msg.startswith(prefix), f"{case}: message {msg!r} does not name {prefix!r}"
    # The group still works afterwards: nothing was half-communicated.
    t = torch.ones(2)
    dist.all_reduce(t)
    assert t[0].item() == dist.get_world_size()
    return msg


@pytest.mark.parametrize("case", sorted(CASES))
def test_bad_input_raises_on_every_rank(workers2, case):
    msgs = workers2.run(_expect_error, case)
    assert msgs[0] == msgs[1]


def test_scalar_type_ints_are_accepted(pg1):
    from mptp_kernels.ops.validate import to_dtype

    assert to_dtype(15) is torch.bfloat16 and to_dtype(6) is torch.float32
    assert to_dtype(torch.float16) is torch.float16 and to_dtype(None) is None
    with pytest.raises(ValueError, match="out_dtypes"):
        to_dtype(99)
