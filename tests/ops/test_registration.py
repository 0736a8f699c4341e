"""Registration of every torch.ops.mptp op, as PyTorch's custom-op tests check it (world size 1, gloo).

Ported from PyTorch's own checks of custom ops (test/test_custom_ops.py, torch.library.opcheck's
test_utils): opcheck with every test_util, with and without requires_grad; torch.compile
(fullgraph=True, static and dynamic=True) of functions calling the ops, forward and
backward; torch.export of them (strict and not, with a dynamic dim); FakeTensorMode and meta
outputs with the real call's shapes, strides and dtypes (non-contiguous inputs and every
gather/scatter dim included); torch.no_grad and torch.inference_mode calls; float64 gradcheck
on the unscaled ops; a clear error from the scaled ops when a gradient is requested, eager
and compiled. Multi-rank numerics are in tests/dist/.
"""

import pytest
import torch

import mptp_kernels  # noqa: F401

FP8 = torch.float8_e4m3fn
F64 = torch.float64
ALL_UTILS = (
    "test_schema",
    "test_autograd_registration",
    "test_faketensor",
    "test_aot_dispatch_dynamic",
)
# SchemaCheckMode (test_schema) compares inputs with allclose, which has no float8 kernel.
FP8_UTILS = ("test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")


def _rnd(*shape, dtype=torch.float32, grad=False):
    return torch.randn(*shape, dtype=dtype).requires_grad_(grad)


def _fp8(*shape):
    return (torch.randn(*shape) * 0.5).to(FP8)


def _unscaled_samples(g, grad):
    A = _rnd(4, 3, 16, grad=grad)
    At = _rnd(3, 4, 16, grad=grad).transpose(0, 1)  # not contiguous
    B, B2 = _rnd(16, 8, grad=grad), _rnd(8, 16, grad=grad).t()  # B2: column-major
    return {
        "fused_all_gather_matmul": [
            ((A, [B, B2], 0, g), {"return_A": True}),
            ((At, [B], 1, g), {"return_A": False}),
            ((A, [B2], -1, g), {}),
            ((At, [B, B2], -2, g), {"return_A": True}),
        ],
        "fused_matmul_reduce_scatter": [
            ((A, B, "sum", 0, g), {}),
            ((At, B2, "avg", 1, g), {}),
            ((A, B, "sum", -1, g), {}),
        ],
    }


def _scaled_samples(g, grad):
    A8, At8 = _fp8(4, 16), _fp8(3, 4, 16)
    B8 = _fp8(8, 16).t()  # column-major, as _scaled_mm wants
    one = torch.ones((), requires_grad=grad)
    row = (torch.rand(4, 1) + 0.5).requires_grad_(grad)
    col = (torch.rand(1, 8) + 0.5).requires_grad_(grad)
    bias = torch.zeros(8, dtype=torch.bfloat16, requires_grad=grad)
    return {
        "fused_all_gather_scaled_matmul": [
            ((A8, [B8], row, [col], 0, g, [None], [None], [torch.bfloat16], [False]), {}),
            (
                (
                    At8,
                    [B8, B8],
                    one,
                    [one, one],
                    1,
                    g,
                    [bias, None],
                    [None, None],
                    [torch.bfloat16, torch.float32],
                    [True, False],
                ),
                {},
            ),  # fmt: skip
        ],
        "fused_scaled_matmul_reduce_scatter": [
            ((A8, B8, one, one, "sum", 0, 0, g, [4, 8], bias, None, torch.bfloat16, False), {}),
            ((At8, B8, one, one, "avg", 1, 1, g, None, None, None, torch.float32, False), {}),
        ],
    }


def _op(name):
    return getattr(torch.ops.mptp, name).default


@pytest.mark.parametrize("grad", [False, True], ids=["no_grad", "requires_grad"])
def test_opcheck_every_util_unscaled(pg1, grad):
    for name, samples in _unscaled_samples(pg1, grad).items():
        for args, kwargs in samples:
            res = torch.library.opcheck(_op(name), args, kwargs, test_utils=ALL_UTILS)
            assert all(v == "SUCCESS" for v in res.values()), (name, args[2:], kwargs, res)


def test_opcheck_scaled_no_grad(pg1):
    for name, samples in _scaled_samples(pg1, False).items():
        for args, kwargs in samples:
            res = torch.library.opcheck(_op(name), args, kwargs, test_utils=FP8_UTILS)
            assert all(v == "SUCCESS" for v in res.values()), (name, res)


def test_opcheck_scaled_requires_grad(pg1):
    """With inputs that require grad the registration and fake checks pass."""
    for name, samples in _scaled_samples(pg1, True).items():
        for args, kwargs in samples:
            utils = ("test_autograd_registration", "test_faketensor")
            res = torch.library.opcheck(_op(name), args, kwargs, test_utils=utils)
            assert all(v == "SUCCESS" for v in res.values()), (name, res)
    # NOTE: no test_aot_dispatch_dynamic here: it sums every output to backpropagate, and
    # float8 has no sum kernel; the backward's error is test_scaled_backward_raises_*.


# -- fake / meta layout --------------------------------------------------------------------------


def _flat(out):
    if isinstance(out, torch.Tensor) or out is None:
        return [out]
    return [t for o in out for t in _flat(o)]


def _layout(t):
    return None if t is None else (tuple(t.shape), t.stride(), t.dtype, t.device.type)


def _all_samples(g):
    return {**_unscaled_samples(g, False), **_scaled_samples(g, False)}


def test_fake_and_meta_match_real(pg1):
    from torch._subclasses.fake_tensor import FakeTensorMode

    def conv(x, f):
        if isinstance(x, torch.Tensor):
            return f(x)
        if isinstance(x, (list, tuple)):
            return type(x)(conv(y, f) for y in x)
        return x

    for name, samples in _all_samples(pg1).items():
        for args, kwargs in samples:
            real = [_layout(t) for t in _flat(_op(name)(*args, **kwargs))]
            with FakeTensorMode() as mode:
                fargs = conv(args, mode.from_tensor)
                fake = [_layout(t) for t in _flat(_op(name)(*fargs, **kwargs))]
            assert [r[:3] if r else r for r in real] == [f[:3] if f else f for f in fake], (
                name,
                args[2:],
            )
            meta = [
                _layout(t) for t in _flat(_op(name)(*conv(args, lambda t: t.to("meta")), **kwargs))
            ]
            assert [r[:3] if r else r for r in real] == [m[:3] if m else m for m in meta], (
                name,
                args[2:],
            )
            assert all(m is None or m[3] == "meta" for m in meta)


# -- no_grad / inference_mode -------------------------------------------------------------------


@pytest.mark.parametrize("ctx", [torch.no_grad, torch.inference_mode])
def test_no_grad_and_inference_mode(pg1, ctx):
    for grad in (False, True):
        samples = {**_unscaled_samples(pg1, grad), **_scaled_samples(pg1, grad)}
        for name, cases in samples.items():
            for args, kwargs in cases:
                ref = _op(name)(*args, **kwargs)
                with ctx():
                    out = _op(name)(*args, **kwargs)
                assert [_layout(t) for t in _flat(out)] == [_layout(t) for t in _flat(ref)], name
                for o, r in zip(_flat(out), _flat(ref)):
                    if o is not None:
                        assert not o.requires_grad
                        assert torch.equal(o.float(), r.detach().float()), name
                        assert ctx is torch.no_grad or o.is_inference()
    # inference tensors used outside inference mode (a cached KV, a frozen weight)
    with torch.inference_mode():
        A, B = torch.randn(4, 16), torch.randn(16, 8)
    _, (C,) = torch.ops.mptp.fused_all_gather_matmul(A, [B], 0, pg1, return_A=False)
    torch.testing.assert_close(C, A @ B)


# -- torch.compile ------------------------------------------------------------------------------


def _chain(g, gather_dim, scatter_dim, return_A):
    def f(a, b1, b2):
        a_full, (c1, c2) = torch.ops.mptp.fused_all_gather_matmul(
            a, [b1, b2], gather_dim, g, return_A=return_A
        )
        out = torch.ops.mptp.fused_matmul_reduce_scatter(
            torch.relu(c1) * c2, b1.t(), "sum", scatter_dim, g
        )
        return out + a_full.sin() if return_A else out

    return f


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dynamic"])
def test_compile_fullgraph_forward_backward(pg1, backend, dynamic):
    for gather_dim, scatter_dim, return_A in ((0, 0, True), (1, 1, False), (-2, 0, False)):
        torch._dynamo.reset()
        f = _chain(pg1, gather_dim, scatter_dim, return_A)
        cf = torch.compile(f, fullgraph=True, dynamic=dynamic, backend=backend)
        for seq in (4, 6, 10):  # new shapes: one dynamic graph, or a recompile each when static
            a = _rnd(2, seq, 16, dtype=F64, grad=True)
            b1, b2 = _rnd(16, 8, dtype=F64, grad=True), _rnd(16, 8, dtype=F64, grad=True)
            leaves = [a, b1, b2]
            ref_leaves = [t.detach().clone().requires_grad_() for t in leaves]
            out, ref = cf(*leaves), f(*ref_leaves)
            torch.testing.assert_close(out, ref)
            gy = torch.randn_like(ref)
            got = torch.autograd.grad(out, leaves, gy)
            want = torch.autograd.grad(ref, ref_leaves, gy)
            for x, y in zip(got, want):
                torch.testing.assert_close(x, y)


def test_compile_dynamic_no_recompile(pg1):
    torch._dynamo.reset()
    cf = torch.compile(_chain(pg1, 1, 1, False), fullgraph=True, dynamic=True, backend="aot_eager")
    b = _rnd(16, 8, grad=True)
    with torch._dynamo.config.patch(error_on_recompile=True):
        for seq in (4, 6, 10):
            cf(_rnd(2, seq, 16, grad=True), b, b).sum().backward()


def test_compile_scaled_forward(pg1):
    torch._dynamo.reset()
    for name, samples in _scaled_samples(pg1, False).items():
        for args, kwargs in samples:
            op = _op(name)
            cf = torch.compile(
                lambda *a, op=op: op(*a, **kwargs), fullgraph=True, backend="aot_eager"
            )
            for o, r in zip(_flat(cf(*args)), _flat(op(*args, **kwargs))):
                assert torch.equal(o.float(), r.float()), name


def test_scaled_backward_raises_eager_and_compiled(pg1):
    torch._dynamo.reset()
    for name, samples in _scaled_samples(pg1, True).items():
        for args, kwargs in samples:
            op = _op(name)
            out = _flat(op(*args, **kwargs))[-1]
            leaves = [t for a in args for t in (a if isinstance(a, list) else [a])
                      if isinstance(t, torch.Tensor) and t.requires_grad]  # fmt: skip
            with pytest.raises(RuntimeError, match=f"{name} is forward-only"):
                torch.autograd.grad(out.float().sum(), leaves)
            cf = torch.compile(
                lambda *a, op=op: op(*a, **kwargs), fullgraph=True, backend="aot_eager"
            )
            with pytest.raises(Exception, match="forward-only"):
                _flat(cf(*args))[-1].float().sum().backward()


# -- torch.export --------------------------------------------------------------------------------


class _Mod(torch.nn.Module):
    def __init__(self, fn):
        super().__init__()
        self.fn = fn

    def forward(self, *args):
        return self.fn(*args)


@pytest.mark.parametrize("strict", [False, True], ids=["nonstrict", "strict"])
def test_export(pg1, strict):
    for name, samples in _all_samples(pg1).items():
        for args, kwargs in samples:
            tensors = [a for a in args if isinstance(a, torch.Tensor)]
            pos = [i for i, a in enumerate(args) if isinstance(a, torch.Tensor)]

            def fn(*ts, args=args, pos=pos, name=name, kwargs=kwargs):
                full = list(args)
                for i, t in zip(pos, ts):
                    full[i] = t
                return _op(name)(*full, **kwargs)

            ep = torch.export.export(_Mod(fn), tuple(tensors), strict=strict)
            targets = {str(n.target) for n in ep.graph.nodes if n.op == "call_function"}
            assert f"mptp.{name}.default" in targets, (name, targets)
            got, want = _flat(ep.module()(*tensors)), _flat(_op(name)(*args, **kwargs))
            for o, r in zip(got, want):
                assert (o is None) == (r is None)
                if o is not None:
                    assert _layout(o) == _layout(r) and torch.equal(o.float(), r.float()), name


def test_export_dynamic_gather_dim(pg1):
    """A dynamic sequence dim through the all-gather-matmul stays dynamic in the exported program."""
    b = torch.randn(16, 8)

    class Mod(torch.nn.Module):
        def forward(self, a):
            return torch.ops.mptp.fused_all_gather_matmul(a, [b], 1, pg1, return_A=False)[1][0]

    seq = torch.export.Dim("seq", min=2, max=64)
    ep = torch.export.export(Mod(), (torch.randn(2, 4, 16),), dynamic_shapes={"a": {1: seq}})
    a = torch.randn(2, 9, 16)
    torch.testing.assert_close(ep.module()(a), a @ b)


# -- gradcheck ------------------------------------------------------------------------------------


def test_gradcheck_mixed_and_noncontiguous(pg1):
    """float64 gradcheck / gradgradcheck: non-contiguous A and Bs, one B not requiring grad."""
    A = _rnd(3, 2, 5, dtype=F64).transpose(0, 1).requires_grad_()
    B1 = _rnd(4, 5, dtype=F64).t().requires_grad_()
    B2 = _rnd(5, 3, dtype=F64)

    def ag(A, B1):
        A_full, (c1, c2) = torch.ops.mptp.fused_all_gather_matmul(A, [B1, B2], 1, pg1)
        return A_full, c1, c2

    def rs(A, B1):
        return torch.ops.mptp.fused_matmul_reduce_scatter(A, B1, "avg", 0, pg1)

    for f in (ag, rs):
        assert torch.autograd.gradcheck(f, (A, B1))
        assert torch.autograd.gradgradcheck(f, (A, B1))
