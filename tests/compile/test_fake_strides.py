"""The ops' fake (torch.compile, export) gives the strides of the real op and of torch's own fake.

Found by a hostile review: for a shard with size-1 dims (e.g. [1, 3, 16] gathered on dim 1),
mptp's fake returned A_full with other strides in the size-1 dims than the real op and than
torch.ops.symm_mem's fake (a view's stride for a size-1 dim is not one thing). Swept here over
2-D to 4-D shards with size-1 dims, every gather / scatter dim, with and without return_A.
"""

import itertools

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import mptp_kernels  # noqa: F401

from .conftest import _register_fake_group


def _layout(x):
    if isinstance(x, torch.Tensor):
        return (tuple(x.shape), x.stride(), x.dtype)
    if x is None:
        return None
    return [_layout(y) for y in x]


def _ag_shapes():
    for dims in itertools.product([1, 2, 3], [1, 2, 4], [1, 3]):
        for nd in (2, 3, 4):
            s = (*dims, 16)[-nd:]
            for gd in range(nd - 1):
                yield s, gd


def _rs_shapes(W):
    for dims in itertools.product([1, 2, 4], [2, 4], [1, 2]):
        for nd in (2, 3, 4):
            s = (*dims, 16)[-nd:]
            for sd in range(nd):
                out = [*s[:-1], 8]
                if out[sd] % W == 0:
                    yield s, sd


def test_fake_strides_equal_the_real_ops(pg1):
    """W = 1 (a real gloo group in this process): fake and real outputs, layout for layout."""
    mode = FakeTensorMode()
    for (s, gd), ret in itertools.product(_ag_shapes(), (True, False)):
        A, Bs = torch.randn(s), [torch.randn(16, 8)]
        real = torch.ops.mptp.fused_all_gather_matmul(A, Bs, gd, pg1, return_A=ret)
        with mode:
            fake = torch.ops.mptp.fused_all_gather_matmul(mode.from_tensor(A), [mode.from_tensor(Bs[0])], gd, pg1,
                                                          return_A=ret)  # fmt: skip
        assert _layout(fake) == _layout(real), (s, gd, ret)
    for s, sd in _rs_shapes(1):
        A, B = torch.randn(s), torch.randn(16, 8)
        real = torch.ops.mptp.fused_matmul_reduce_scatter(A, B, "sum", sd, pg1)
        with mode:
            fake = torch.ops.mptp.fused_matmul_reduce_scatter(mode.from_tensor(A), mode.from_tensor(B), "sum", sd, pg1)
        assert _layout(fake) == _layout(real), (s, sd)


@pytest.mark.parametrize("W", [2, 3])
def test_fake_strides_equal_torchs_fake(pg1, W):
    """A fake group of W: mptp's fake against torch.ops.symm_mem's, where torch's accepts the call."""
    name = f"fake_strides_{W}"
    _register_fake_group(name, W)
    mptp_kernels.enable_symm_mem_for_group(name)
    compared = 0
    with FakeTensorMode():
        for (s, gd), ret in itertools.product(_ag_shapes(), (True, False)):
            A, Bs = torch.randn(s), [torch.randn(16, 8)]
            try:
                theirs = torch.ops.symm_mem.fused_all_gather_matmul(A, Bs, gd, name, return_A=ret)
            except Exception:  # noqa: BLE001 - a call torch's fake refuses: nothing to compare
                continue
            ours = torch.ops.mptp.fused_all_gather_matmul(A, Bs, gd, name, return_A=ret)
            assert _layout(ours) == _layout(theirs), (s, gd, ret)
            compared += 1
        for s, sd in _rs_shapes(W):
            A, B = torch.randn(s), torch.randn(16, 8)
            try:
                theirs = torch.ops.symm_mem.fused_matmul_reduce_scatter(A, B, "sum", sd, name)
            except Exception:  # noqa: BLE001
                continue
            assert _layout(torch.ops.mptp.fused_matmul_reduce_scatter(A, B, "sum", sd, name)) == _layout(theirs), (s, sd)
            compared += 1
    assert compared > 100, compared
