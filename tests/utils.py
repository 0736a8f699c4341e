"""Shared test helpers: seeded inputs and the tolerance rule."""

import torch


def randn(shape, seed, dtype=torch.float32, scale=1.0, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=g, dtype=torch.float64) * scale).to(dtype).to(device)


def rel_err(x: torch.Tensor, ref: torch.Tensor) -> float:
    x, ref = x.double().cpu(), ref.double().cpu()
    return ((x - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def assert_matmul_close(out, ref64, eager, k=2.0, atol=1e-6, what="output"):
    """Tolerance rule: error vs float64 <= k * (error of the eager low-precision
    result vs float64) + atol. Inputs are scaled so products stay O(1), so a
    relative-norm atol is meaningful; NaN never passes."""
    assert out.shape == ref64.shape, f"{what}: shape {tuple(out.shape)} != {tuple(ref64.shape)}"
    assert not torch.isnan(out.float()).any(), f"{what}: NaN"
    e, e_eager = rel_err(out, ref64), rel_err(eager, ref64)
    assert e <= k * e_eager + atol, f"{what}: rel err {e:.3e} > {k} * {e_eager:.3e} + {atol}"


def fused_unavailable():
    """Why the fused CUDA path cannot run here (no GPU, or the extension was not built), or None."""
    if not torch.cuda.is_available():
        return "needs a GPU"
    from mptp_kernels.symm import _C

    return None if _C.lib() is not None else _C.why_unavailable()


def skip_without_fused():
    import pytest

    why = fused_unavailable()
    return pytest.mark.skipif(why is not None, reason=str(why))


def cpu_rowwise_scaled_mm() -> bool:
    """Whether torch._scaled_mm takes row-wise scales on the CPU (torch 2.11's CPU kernel is
    tensor-wise only; the ops' own reference does not use it there)."""
    fp8 = torch.float8_e4m3fn
    A, B = torch.ones(2, 16).to(fp8), torch.ones(16, 16).to(fp8).t()
    try:
        torch._scaled_mm(A, B.t(), torch.ones(2, 1), torch.ones(1, 16), out_dtype=torch.bfloat16)
        return True
    except RuntimeError:
        return False
