"""Schemas, fakes and opcheck of every torch.ops.mptp op (world size 1, gloo)."""

import pytest
import torch

import mptp_kernels  # noqa: F401
from mptp_kernels import _library

FP8 = torch.float8_e4m3fn


def test_schemas_match_symm_mem():
    import torch.distributed._symmetric_memory  # noqa: F401

    for name in _library.SCHEMAS:
        ours = getattr(torch.ops.mptp, name).default._schema
        theirs = getattr(torch.ops.symm_mem, name).default._schema
        assert str(ours).replace("mptp::", "") == str(theirs).replace("symm_mem::", ""), name
        assert torch._C.Tag.needs_fixed_stride_order in getattr(torch.ops.mptp, name).default.tags


def _samples(g):
    A = torch.randn(4, 3, 16)
    B = torch.randn(16, 8)
    A8 = torch.randn(4, 16).to(FP8)
    B8 = torch.randn(8, 16).to(FP8).t()
    one = torch.ones(())
    return {
        "fused_all_gather_matmul": [((A, [B, B], 0, g), {"return_A": True}), ((A, [B], 1, g), {"return_A": False})],
        "fused_all_gather_scaled_matmul": [
            ((A8, [B8], torch.rand(4, 1) + 0.5, [torch.rand(1, 8) + 0.5], 0, g, [None], [None], [torch.bfloat16], [False]), {}),
            ((A8, [B8, B8], one, [one, one], 0, g, [None, None], [None, None], [None, torch.float32], [True, False]), {}),
        ],
        "fused_matmul_reduce_scatter": [((A, B, "sum", 0, g), {}), ((A, B, "avg", 1, g), {})],
        "fused_scaled_matmul_reduce_scatter": [
            ((A8, B8, one, one, "sum", 0, 0, g, [4, 8], None, None, torch.bfloat16, False), {}),
        ],
    }  # fmt: skip


@pytest.mark.parametrize("name", sorted(_library.SCHEMAS))
def test_opcheck(pg1, name):
    op = getattr(torch.ops.mptp, name).default
    for args, kwargs in _samples(pg1)[name]:
        if "scaled" not in name:
            torch.library.opcheck(op, args, kwargs)
            continue
        # SchemaCheckMode compares inputs with allclose, which has no float8
        # kernel: check the schema's no-mutation promise on the raw bytes instead.
        utils = ("test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")
        torch.library.opcheck(op, args, kwargs, test_utils=utils)
        tensors = [t for a in args for t in (a if isinstance(a, list) else [a]) if isinstance(t, torch.Tensor)]
        before = [t.view(torch.uint8).clone() if t.dtype == FP8 else t.clone() for t in tensors]
        op(*args, **kwargs)
        for t, b in zip(tensors, before):
            assert torch.equal(t.view(torch.uint8) if t.dtype == FP8 else t, b), f"{name} mutated an input"


def test_fake_matches_reference_layout(pg1):
    from torch._subclasses.fake_tensor import FakeTensorMode

    for name, samples in _samples(pg1).items():
        op = getattr(torch.ops.mptp, name)
        for args, kwargs in samples:
            real = op(*args, **kwargs)
            with FakeTensorMode(allow_non_fake_inputs=True) as mode:
                fargs = [mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in args]
                fake = op(*fargs, **kwargs)
            flat_r = real if isinstance(real, tuple) else (real,)
            flat_f = fake if isinstance(fake, tuple) else (fake,)
            for r, f in zip(flat_r, flat_f):
                for rr, ff in zip(r if isinstance(r, list) else [r], f if isinstance(f, list) else [f]):
                    assert (rr is None) == (ff is None)
                    if rr is not None:
                        assert (rr.shape, rr.stride(), rr.dtype) == (ff.shape, ff.stride(), ff.dtype), name


def test_compile_fullgraph_smoke(pg1):
    A, B = torch.randn(8, 16), torch.randn(16, 4)

    @torch.compile(fullgraph=True, backend="aot_eager")
    def f(a, b):
        _, (out,) = torch.ops.mptp.fused_all_gather_matmul(a, [b], 0, pg1)
        return torch.ops.mptp.fused_matmul_reduce_scatter(out, b.t().contiguous(), "sum", 0, pg1)

    ref = (A @ B) @ B.t()
    torch.testing.assert_close(f(A, B), ref)


def test_helpers_restride_and_enable(pg1):
    t = torch.randn(2, 3, 4)
    r = mptp_kernels.restride_A_shard_for_fused_all_gather_matmul(t, 1)
    assert torch.equal(r, t) and r.movedim(1, 0).is_contiguous()
    r = mptp_kernels.restride_A_for_fused_matmul_reduce_scatter(t, 2)
    assert torch.equal(r, t) and r.movedim(2, 0).is_contiguous()
    assert not mptp_kernels.is_symm_mem_enabled_for_group("some-group")
    mptp_kernels.enable_symm_mem_for_group("some-group")
    assert mptp_kernels.is_symm_mem_enabled_for_group("some-group")
