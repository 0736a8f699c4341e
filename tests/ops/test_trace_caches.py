"""Caches the ops keep for every later call must hold what an eager call would find, whatever ran
first in the process: a torch.compile trace (Python dispatcher on, fake tensors) must not fill them
with its own answers (found by a hostile review, session 20: after a compile, eager calls returned
other size-1 strides than PyTorch's fallback, and an unsupported dtype's ValueError before any
communication became a failure after the all-gather, or a stall where only one rank had traced)."""

import pytest
import torch
from torch._dispatch.python import enable_python_dispatcher
from torch._subclasses.fake_tensor import FakeTensorMode

from mptp_kernels.ops import reference, validate


@pytest.mark.parametrize("dtype", [torch.uint16, torch.uint32, torch.bool])
def test_a_dtype_probe_under_a_fake_mode_is_the_cpu_kernels_answer(dtype):
    validate._CPU_MATMUL.pop(dtype, None)
    with FakeTensorMode():
        assert not validate.matmul_supports(dtype, torch.device("cpu"))
    assert not validate.matmul_supports(dtype, torch.device("cpu"))
    validate._CPU_MATMUL.pop(torch.float32, None)
    with FakeTensorMode():
        assert validate.matmul_supports(torch.float32, torch.device("cpu"))


@pytest.mark.parametrize("shape,W,gd", [((1, 3, 16), 2, 1), ((2, 1, 3, 8), 3, 2), ((1, 1, 4), 4, 1), ((5, 1, 8), 2, 0)])
def test_size1_strides_under_the_python_dispatcher_are_atens(shape, W, gd):
    def aten():
        g = torch.empty((W * shape[0], *shape[1:]))
        return tuple(g.view(W, *shape).movedim(gd + 1, 1).flatten(0, 1).stride())

    want = aten()
    reference._gather_dim_major_strides.cache_clear()
    with enable_python_dispatcher():
        assert reference._gather_dim_major_strides(shape, W, gd) == want
    assert reference._gather_dim_major_strides(shape, W, gd) == want


def test_a_refusal_under_a_fake_mode_is_not_remembered(monkeypatch):
    """_cpu_scaled_mm remembers where torch's CPU kernel refuses a kind of call; a fake tensor's
    refusal is not the kernel's."""
    A = torch.randn(4, 8).to(torch.float8_e4m3fn)
    B = torch.randn(8, 4).to(torch.float8_e4m3fn)
    one = torch.ones(())
    key_args = (A, B, one, one, None, torch.bfloat16, False)
    reference._CPU_SCALED_MM.clear()
    calls = []

    def refuse(*a, **k):
        calls.append(1)
        raise RuntimeError("refused")

    monkeypatch.setattr(torch, "_scaled_mm", refuse)
    with FakeTensorMode() as mode:
        fa, fb = mode.from_tensor(A), mode.from_tensor(B)
        assert reference._cpu_scaled_mm(fa, fb, mode.from_tensor(one), mode.from_tensor(one), None, torch.bfloat16, False) is None
    assert not reference._CPU_SCALED_MM  # nothing remembered
    assert reference._cpu_scaled_mm(*key_args) is None
    assert list(reference._CPU_SCALED_MM.values()) == [False]  # a real refusal is
