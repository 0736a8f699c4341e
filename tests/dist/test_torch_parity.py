"""torch.ops.mptp.* against PyTorch's own unfused fallbacks, on CPU (gloo, 2 and 3 processes).

A port of what PyTorch's test/distributed/test_symmetric_memory.py (AsyncTPTest)
checks for these ops, run differentially: every call is made twice, once through
torch.ops.mptp and once through torch.distributed._symmetric_memory's
`_fused_*_fallback` on the same inputs, and the two must agree on outputs (values,
shapes, strides, dtypes, devices, None positions) or both raise. Each output is
also checked against a float64 computation made without communication (every
rank regenerates every rank's inputs from per-rank seeds; seeds are fresh per
run). On top of PyTorch's parametrizations (gather / scatter dim, return_A, 3-D
A, several Bs, "sum" / "avg", tensor- / row-wise scales, orig_scatter_dim /
scatter_dim_after_maybe_reshape / output_shape, out_dtype, bias, keyword calls,
opcheck), the edge cases a user porting code would try: negative dims,
non-contiguous A, transposed and stride-0 B, K = 1, N = 1, N not a multiple of
16, fp16 / bf16 / fp32 / fp64, FP8 e4m3 and e5m2, an empty Bs list, a group
given by name or object, subgroups and one-rank groups.

Where the fallback cannot be the oracle, the case says why and pins mptp's
behaviour instead (float64, or the error PyTorch's own CUDA op raises).

Each rank runs many cases per round trip (spawning workers is slow) and records
a case's failure instead of leaving the loop, so the ranks stay in lockstep and a
failure never turns into a hang; every run has a hard timeout.
"""

import contextlib
import random

import pytest
import torch
import torch.distributed as dist

from dist.harness import Workers
from utils import assert_matmul_close, randn, rel_err

SEED = random.randrange(1 << 30)
TIMEOUT_S = 120  # hard bound on every multi-process run
ENV = {"MPTP_TIMEOUT_S": "20"}
F32, F16, BF16, F64 = torch.float32, torch.float16, torch.bfloat16, torch.float64
E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
FP8 = (E4M3, E5M2)
_MANTISSA = {E4M3: 3, E5M2: 2, BF16: 7, F16: 10, F32: 23, F64: 52}


@pytest.fixture(scope="module")
def parity2():
    # Own workers (not the session ones): a run that times out leaves its processes behind.
    w = Workers(2, env=ENV)
    yield w
    w.close()


@pytest.fixture(scope="module")
def parity3():
    w = Workers(3, env=ENV)
    yield w
    w.close()


# -- helpers (run on every rank) ------------------------------------------------------------------


def _g():
    return dist.group.WORLD.group_name


class _Cases:
    """Collects failing cases; every rank runs every case, so collectives stay matched."""

    def __init__(self, terms=1):
        self.failures = []
        self.n = 0
        # Partial products summed per output element (a reduce-scatter's W): each carries its
        # own rounding, so value tolerances scale with it.
        self.terms = terms

    @contextlib.contextmanager
    def case(self, what):
        self.n += 1
        try:
            yield
        except Exception as e:  # noqa: BLE001 - record and go on: the peers run the next case too
            self.failures.append(f"{what}: {type(e).__name__}: {str(e)[:600]}")

    def done(self):
        if self.failures:
            head = f"rank {dist.get_rank()}: {len(self.failures)} of {self.n} cases differ from PyTorch"
            raise AssertionError(head + "\n" + "\n".join(self.failures))
        return self.n


def _outcome(fn):
    try:
        return fn(), None
    except Exception as e:  # noqa: BLE001
        return None, e


def _flat(x):
    if isinstance(x, (list, tuple)):
        return [t for y in x for t in _flat(y)]
    return [x]


def _ulp(x: torch.Tensor, dtype) -> torch.Tensor:
    """The spacing of `dtype` at |x| (float64), subnormals included."""
    tiny = torch.finfo(dtype).smallest_normal
    e = torch.floor(torch.log2(x.double().abs().clamp_min(tiny)))
    return torch.exp2(e - _MANTISSA[dtype])


def _same_layout(ours, theirs, what):
    """The structure, and per tensor shape, stride, dtype and device, of PyTorch's result."""
    assert type(ours) is type(theirs) or {type(ours), type(theirs)} <= {list, tuple}, (
        f"{what}: {type(ours).__name__} vs PyTorch's {type(theirs).__name__}")  # fmt: skip
    fo, ft = _flat(ours), _flat(theirs)
    assert len(fo) == len(ft), f"{what}: {len(fo)} outputs vs PyTorch's {len(ft)}"
    for i, (a, b) in enumerate(zip(fo, ft)):
        if a is None or b is None:
            assert a is None and b is None, f"{what}[{i}]: {type(a).__name__} where PyTorch has {type(b).__name__}"
            continue
        got = (tuple(a.shape), a.stride(), a.dtype, a.device)
        want = (tuple(b.shape), b.stride(), b.dtype, b.device)
        assert got == want, f"{what}[{i}]: (shape, stride, dtype, device) {got} != PyTorch's {want}"


def _close_to_fallback(a, b, what, fp8_ulps=0, terms=1):
    """Values equal to the fallback's up to rounding.

    Both sides run the same CPU kernels on the same inputs, so they differ at most by
    the BLAS blocking of a differently strided operand: 4 ulps of the output dtype,
    relative to the output's largest magnitude (a dot product's rounding scales with
    its terms, not its sum), times the number of partials summed (terms: a reduce-scatter
    adds W products, each rounded on its own). FP8 outputs: equal (fp8_ulps = 0), as PyTorch's
    test asks (torch.allclose of the two): on the CPU mptp's FP8 output is the fp32 result of
    torch's own _scaled_mm, rounded once, which is what torch's FP8 output holds in range.
    """
    if a.dtype in FP8:
        a64, b64 = a.double(), b.double()
        bound = fp8_ulps * _ulp(torch.maximum(a64.abs(), b64.abs()), a.dtype)
        bad = (a64 - b64).abs() > bound
        assert not bad.any(), f"{what}: {int(bad.sum())} elements more than {fp8_ulps} FP8 ulp from PyTorch's"
        return
    if not a.is_floating_point():
        assert torch.equal(a, b), f"{what}: integer result differs from PyTorch's"
        return
    eps = torch.finfo(a.dtype).eps
    scale = b.double().abs().max().item() if b.numel() else 0.0
    torch.testing.assert_close(a.double(), b.double(), rtol=4 * eps * terms, atol=4 * eps * terms * scale + 1e-300, msg=lambda m: f"{what}: {m}")


def _differential(c, what, ours_fn, theirs_fn):
    """Runs both; they must both raise, or agree in layout and values. Returns (ours, theirs) or None."""
    with c.case(what):
        ours, oe = _outcome(ours_fn)
        theirs, te = _outcome(theirs_fn)
        if oe is not None or te is not None:
            assert oe is not None and te is not None, (
                f"mptp {'raised ' + repr(oe) if oe else 'returned'}, PyTorch's fallback "
                f"{'raised ' + repr(te) if te else 'returned'}")  # fmt: skip
            assert isinstance(oe, (ValueError, RuntimeError)), f"mptp raised {type(oe).__name__}: {oe}"
            return None
        _same_layout(ours, theirs, what)
        for i, (a, b) in enumerate(zip(_flat(ours), _flat(theirs))):
            if a is not None:
                _close_to_fallback(a, b, f"{what}[{i}]", terms=c.terms)
        return ours, theirs


def _raises(c, what, fn, exc=ValueError, needle=None):
    with c.case(what):
        _, e = _outcome(fn)
        assert isinstance(e, exc), f"expected {exc.__name__}, got {'no error' if e is None else repr(e)}"
        assert needle is None or needle in str(e), f"{needle!r} not in {e}"


@contextlib.contextmanager
def _fp8_gathers_as_bytes():
    """gloo cannot all-gather FP8 ("Invalid scalar type"): the fallback's all-gather moves the bytes.

    Only the transport changes (byte-exact, as on NCCL); the fallback's reshapes,
    scale handling and _scaled_mm calls run as PyTorch wrote them.
    """
    ns = torch.ops._c10d_functional
    orig = ns.all_gather_into_tensor

    def all_gather_into_tensor(t, W, group_name):
        if t.dtype in FP8:
            return orig(t.view(torch.uint8), W, group_name).view(t.dtype)
        return orig(t, W, group_name)

    ns.all_gather_into_tensor = all_gather_into_tensor
    try:
        yield
    finally:
        ns.all_gather_into_tensor = orig


def _ranks_inputs(shape, seed, dtype, scale=1.0):
    """Every rank's input (rank i seeds seed + i), so each rank can build the float64 oracle."""
    return [randn(shape, seed + i, scale=scale).to(dtype) for i in range(dist.get_world_size())]


def _B_variants(K, seed, dtype, Ns=(24, 17, 8, 1)):
    """Row-major, transposed (column-major, N = 17), stride-0 (expanded) and N = 1 weights."""
    n0, n1, n2, n3 = Ns
    s = K**-0.5  # keeps products O(1)
    return [
        randn((K, n0), seed, scale=s).to(dtype),
        randn((n1, K), seed + 1, scale=s).to(dtype).t(),
        randn((K, 1), seed + 2, scale=s).to(dtype).expand(K, n2),
        randn((K, n3), seed + 3, scale=s).to(dtype),
    ]


def _noncontig(t):
    """The same values with a non-contiguous layout (leading dims reversed in memory)."""
    perm = list(range(t.dim() - 1))[::-1] + [t.dim() - 1]
    inv = [perm.index(i) for i in range(t.dim())]
    out = t.permute(perm).contiguous().permute(inv)
    assert torch.equal(out, t) and (t.dim() < 3 or not out.is_contiguous())
    return out if t.dim() > 2 else t.t().contiguous().t()


# -- fused_all_gather_matmul ----------------------------------------------------------------------


def _ag_parity(seed, dtypes):
    from torch.distributed._symmetric_memory import _fused_all_gather_matmul_fallback as fallback

    W, r, c = dist.get_world_size(), dist.get_rank(), _Cases()
    op = torch.ops.mptp.fused_all_gather_matmul
    i = 0
    for dtype in dtypes:
        for shard_shape in ((3, 4, 16), (5, 16)):
            nd = len(shard_shape)
            for gd in range(-nd, nd):
                gdn = gd % nd
                K = shard_shape[-1] * (W if gdn == nd - 1 else 1)  # gathering K: B has W*K rows
                shards = _ranks_inputs(shard_shape, seed + 100 * i, dtype)
                A = shards[r] if i % 2 == 0 else _noncontig(shards[r])
                Bs = _B_variants(K, seed + 100 * i + 50, dtype)
                A_full64 = torch.cat([s.double() for s in shards], dim=gdn)
                for return_A in (True, False):
                    i += 1
                    what = f"all_gather_matmul {dtype} A{list(shard_shape)} gather_dim={gd} return_A={return_A}"
                    if i % 2:
                        ours_fn = lambda: op(A, Bs, gd, _g(), return_A=return_A)  # noqa: E731
                    else:  # keyword form, as PyTorch's test calls it
                        ours_fn = lambda: op(A=A, Bs=Bs, gather_dim=gd, group_name=_g(), return_A=return_A)  # noqa: E731
                    # NOTE: the fallback takes gather_dim == -1 but no other negative dim (it
                    # moves dim gather_dim + 1): it gets the normalized dim.
                    res = _differential(c, what, ours_fn, lambda: fallback(A, Bs, gdn, _g(), return_A=return_A))
                    if res is None:
                        with c.case(what):
                            raise AssertionError("both raised on valid inputs")
                        continue
                    with c.case(what + " vs float64"):
                        A_out, outs = res[0]
                        assert (A_out is None) == (not return_A)
                        if return_A:
                            assert torch.equal(A_out.double(), A_full64), "gathered A is not bitwise the shards"
                        for j, (o, B) in enumerate(zip(outs, Bs)):
                            ref = A_full64 @ B.double()
                            eager = (A_full64.to(dtype) @ B).double()
                            # k=2: one rounding of each product into the dtype, accumulated in fp32.
                            assert_matmul_close(o, ref, eager, k=2.0, atol=1e-6, what=f"outs[{j}]")
    return c.done()


@pytest.mark.parametrize("world,dtypes", [(2, (F32, BF16, F16)), (3, (F32,))], ids=["W2", "W3"])
def test_all_gather_matmul_parity(request, world, dtypes):
    request.getfixturevalue(f"parity{world}").run(_ag_parity, SEED, dtypes, timeout_s=TIMEOUT_S)


def _ag_edges(seed):
    import mptp_kernels
    from torch.distributed._symmetric_memory import _fused_all_gather_matmul_fallback as fallback

    W, r, c = dist.get_world_size(), dist.get_rank(), _Cases()
    op = torch.ops.mptp.fused_all_gather_matmul
    A = randn((4, 8), seed + r)
    B = randn((8, 6), seed + 99)
    for gd in (0, 1):
        # An empty Bs list: a plain all-gather, ([A_full], []) as PyTorch returns it.
        _differential(c, f"empty Bs gather_dim={gd}", lambda: op(A, [], gd, _g()), lambda: fallback(A, [], gd, _g()))
        _differential(c, f"empty Bs return_A=False gather_dim={gd}", lambda: op(A, [], gd, _g(), return_A=False),
                      lambda: fallback(A, [], gd, _g(), return_A=False))  # fmt: skip
    A1, B1 = randn((6, 1), seed + 10 + r), randn((1, 5), seed + 98)
    _differential(c, "K=1", lambda: op(A1, [B1], 0, _g()), lambda: fallback(A1, [B1], 0, _g()))
    B1k = randn((W, 5), seed + 97)  # gathering the K=1 dim: W rows
    _differential(c, "K=1 gather_dim=-1", lambda: op(A1, [B1k], -1, _g()), lambda: fallback(A1, [B1k], -1, _g()))
    Ai, Bi = torch.randint(-4, 4, (3, 5)), torch.randint(-4, 4, (5, 2))
    _differential(c, "int64", lambda: op(Ai, [Bi], 0, _g()), lambda: fallback(Ai, [Bi], 0, _g()))
    A64, B64 = randn((3, 2, 8), seed + r, dtype=F64), randn((8, 3), seed + 96, dtype=F64)
    _differential(c, "float64 3-D gather_dim=1", lambda: op(A64, [B64], 1, _g()), lambda: fallback(A64, [B64], 1, _g()))
    Az = torch.zeros(0, 8)
    _differential(c, "M=0 shard", lambda: op(Az, [B], 0, _g()), lambda: fallback(Az, [B], 0, _g()))
    # return_A=False: None in the first position of a 2-tuple, as PyTorch returns.
    with c.case("return_A=False structure"):
        out = op(A, [B, B], 0, _g(), return_A=False)
        assert isinstance(out, tuple) and len(out) == 2 and out[0] is None and len(out[1]) == 2, out
    # The group as a ProcessGroup, its name or None: the same bits.
    ref = op(A, [B], 0, _g())
    for what, group in (("ProcessGroup", dist.group.WORLD), ("group name", _g()), ("default group", None)):
        with c.case(f"wrapper with {what}"):
            out = mptp_kernels.fused_all_gather_matmul(A, [B], 0, group)
            assert torch.equal(out[0], ref[0]) and torch.equal(out[1][0], ref[1][0])
    # Rejected by PyTorch's own op (its CUDA impl raises "B must be a matrix"); its fallback
    # broadcasts a batched B through torch.matmul: not a contract, mptp raises before communicating.
    _raises(c, "3-D B", lambda: op(A, [torch.zeros(2, 8, 3)], 0, _g()), needle="Bs[0]")
    _raises(c, "gather_dim out of range", lambda: op(A, [B], 2, _g()), needle="gather_dim")
    _raises(c, "B of the wrong K", lambda: op(A, [torch.zeros(9, 3)], 0, _g()), needle="Bs[0]")
    return c.done()


@pytest.mark.parametrize("world", [2, 3])
def test_all_gather_matmul_edges(request, world):
    request.getfixturevalue(f"parity{world}").run(_ag_edges, SEED, timeout_s=TIMEOUT_S)


# -- fused_matmul_reduce_scatter ------------------------------------------------------------------


def _rs_parity(seed, dtypes):
    from torch.distributed._symmetric_memory import _fused_matmul_reduce_scatter_fallback as fallback

    W, r, c = dist.get_world_size(), dist.get_rank(), _Cases(terms=dist.get_world_size())
    op = torch.ops.mptp.fused_matmul_reduce_scatter
    i = 0
    for dtype in dtypes:
        for shape in ((6, 6, 16), (6, 16)):  # 6: divisible by 2 and 3
            nd, K = len(shape), shape[-1]
            for sd in range(-nd, nd):
                As = _ranks_inputs(shape, seed + 100 * i, dtype)
                A = As[r] if i % 2 == 0 else _noncontig(As[r])
                # N = 12 and 6 divide by 2 and 3 (scattering the last dim); N = 1 only elsewhere.
                Bs = _B_variants(K, seed + 100 * i + 50, dtype, Ns=(12, 6, 6, 1))
                if sd % nd == nd - 1:
                    Bs = Bs[:3]
                for j, B in enumerate(Bs):
                    for reduce_op in ("sum", "avg"):
                        i += 1
                        what = f"matmul_reduce_scatter {dtype} A{list(shape)} B#{j} scatter_dim={sd} {reduce_op}"
                        if i % 2:
                            ours_fn = lambda: op(A, B, reduce_op, sd, _g())  # noqa: E731
                        else:
                            ours_fn = lambda: op(A=A, B=B, reduce_op=reduce_op, scatter_dim=sd, group_name=_g())  # noqa: E731
                        res = _differential(c, what, ours_fn, lambda: fallback(A, B, reduce_op, sd, _g()))
                        if res is None:
                            with c.case(what):
                                raise AssertionError("both raised on valid inputs")
                            continue
                        with c.case(what + " vs float64"):
                            out, theirs = res
                            div = W if reduce_op == "avg" else 1
                            ref = (sum(a.double() @ B.double() for a in As) / div).chunk(W, dim=sd)[r]
                            mag = (sum(a.double().abs() @ B.double().abs() for a in As) / div).chunk(W, dim=sd)[r]
                            _check_reduced_vs_float64(out, ref, theirs, W, mag=mag, K=K)
                            assert out.is_contiguous()
    return c.done()


@pytest.mark.parametrize("world,dtypes", [(2, (F32, BF16, F16)), (3, (F32,))], ids=["W2", "W3"])
def test_matmul_reduce_scatter_parity(request, world, dtypes):
    request.getfixturevalue(f"parity{world}").run(_rs_parity, SEED, dtypes, timeout_s=TIMEOUT_S)


def _rs_edges(seed):
    import mptp_kernels
    from torch.distributed._symmetric_memory import _fused_matmul_reduce_scatter_fallback as fallback

    W, r, c = dist.get_world_size(), dist.get_rank(), _Cases(terms=dist.get_world_size())
    op = torch.ops.mptp.fused_matmul_reduce_scatter
    A1, B1 = randn((6, 1), seed + r), randn((1, 6), seed + 99)
    _differential(c, "K=1", lambda: op(A1, B1, "sum", 0, _g()), lambda: fallback(A1, B1, "sum", 0, _g()))
    A, B = randn((6, 8), seed + 10 + r), randn((8, 1), seed + 98)
    _differential(c, "N=1 scatter_dim=0", lambda: op(A, B, "avg", 0, _g()), lambda: fallback(A, B, "avg", 0, _g()))
    A64, B64 = randn((2, 6, 8), seed + r, dtype=F64), randn((8, 6), seed + 97, dtype=F64)
    _differential(c, "float64 3-D scatter_dim=-2", lambda: op(A64, B64, "sum", -2, _g()),
                  lambda: fallback(A64, B64, "sum", -2, _g()))  # fmt: skip
    gen = lambda q: torch.Generator().manual_seed(seed + q)  # noqa: E731
    Ai, Bi = torch.randint(-4, 4, (6, 5), generator=gen(20 + r)), torch.randint(-4, 4, (5, 3), generator=gen(30))
    _differential(c, "int64 sum", lambda: op(Ai, Bi, "sum", 0, _g()), lambda: fallback(Ai, Bi, "sum", 0, _g()))
    with c.case("int64 avg"):
        # PyTorch's fallback raises here (funcol's avg cannot write a Long); mptp documents a
        # truncating average that keeps the dtype.
        all_A = [torch.randint(-4, 4, (6, 5), generator=gen(20 + q)) for q in range(W)]
        out = op(all_A[r], Bi, "avg", 0, _g())
        want = torch.div(sum(a @ Bi for a in all_A), W, rounding_mode="trunc").chunk(W)[r]
        assert out.dtype == torch.int64 and torch.equal(out, want)
    with c.case("wrapper with a ProcessGroup / name / None"):
        ref = op(A, B, "sum", 0, _g())
        for group in (dist.group.WORLD, _g(), None):
            assert torch.equal(mptp_kernels.fused_matmul_reduce_scatter(A, B, "sum", 0, group), ref)
    # PyTorch's own op raises "reduce_op must be sum or avg" (its fallback lets funcol take "max").
    _raises(c, "reduce_op max", lambda: op(A, B, "max", 0, _g()), needle="reduce_op")
    _raises(c, "3-D B", lambda: op(A, torch.zeros(2, 8, 3), "sum", 0, _g()), needle="B")
    # Both raise: the scattered dim does not divide by the world size.
    A7 = randn((7 if W != 7 else 8, 8), seed + r)
    _differential(c, "scatter dim not divisible", lambda: op(A7, B, "sum", 0, _g()),
                  lambda: fallback(A7, B, "sum", 0, _g()))  # fmt: skip
    return c.done()


@pytest.mark.parametrize("world", [2, 3])
def test_matmul_reduce_scatter_edges(request, world):
    request.getfixturevalue(f"parity{world}").run(_rs_edges, SEED, timeout_s=TIMEOUT_S)


def _check_reduced_vs_float64(out, ref, theirs, W, mag=None, K=None):
    """A reduce-scattered result vs float64.

    With ``mag`` (the float64 sum over ranks of |A_r| @ |B|, reduced like ``ref``) and ``K``:
    the worst-case forward error bound of a dot product (Higham, gamma_n = n u, u = eps / 2),
    elementwise: K roundings per partial, W for the sum, 2 for the average and the output,
    times 2 for headroom: |out - ref| <= (K + W + 2) eps mag. It holds for every seed whatever
    the cancellation; a statistical relative-norm bound (20 eps) was exceeded by a seed whose
    outputs cancel (fp32, K = 16, W = 3: 2.8e-6), and so would a bound relative to the
    fallback's error, which depends on the fallback's summation order.

    Without it (the scaled ops), and for bf16 / fp16 also with it: within 2x the fallback's error (rounded partials summed in the dtype, as gloo does) plus
    one rounding, and a relative-norm bound of 4 (W + 2) roundings, which keeps the check
    independent of the fallback (a wrong chunk or a missing term is O(1) off).
    """
    eps = torch.finfo(out.dtype).eps
    if mag is not None:
        bound = (K + W + 2) * eps * mag + torch.finfo(out.dtype).tiny
        bad = (out.double() - ref).abs() > bound
        assert not bad.any(), f"{int(bad.sum())} of {bad.numel()} elements beyond the forward error bound"
        if eps < 1e-4:
            return
        # NOTE: for bf16 / fp16 that bound is loose enough (K = 16: 0.16 mag) to let a
        # missing term pass, so the yardstick below applies too; their error is dominated by
        # the output rounding, which both paths share.
    assert_matmul_close(out, ref, theirs, k=2.0, atol=eps)
    bound = 4 * (W + 2) * eps
    assert rel_err(out, ref) <= bound, f"rel err {rel_err(out, ref):.3e} > {bound:.3e}"


# -- fused_all_gather_scaled_matmul ---------------------------------------------------------------


def _scaled_ref(A64, A_scale64, B, B_scale, bias, result_scale, out_dtype):
    """float64 _scaled_mm as the ops define it: (sa * sb * A @ B + bias), times result_scale for FP8 outputs."""
    y = (A64 * A_scale64) @ (B.double() * B_scale.double())
    if bias is not None:
        y = y + bias.double()
    if out_dtype in FP8 and result_scale is not None:
        y = y * result_scale.double()
    return y


def _check_vs_float64(out, ref, fallback_out, what):
    if out.dtype in FP8:
        # One FP8 ulp: a correctly rounded result is within half an ulp; fp32 accumulation
        # can move a near-tie across. (Values are O(1): no saturation.)
        bad = (out.double() - ref).abs() > _ulp(ref, out.dtype)
        assert not bad.any(), f"{what}: {int(bad.sum())} elements more than 1 FP8 ulp from float64"
    else:
        # k=2 of the fallback's own error: both round one fp32 accumulation into out_dtype.
        assert_matmul_close(out, ref, fallback_out, k=2.0, atol=1e-5, what=what)


def _ag_scaled_parity(seed, a_dtypes):
    from torch.distributed._symmetric_memory import _fused_all_gather_scaled_matmul_fallback

    def fallback(*args):
        with _fp8_gathers_as_bytes():
            return _fused_all_gather_scaled_matmul_fallback(*args)

    W, r, c = dist.get_world_size(), dist.get_rank(), _Cases()
    op = torch.ops.mptp.fused_all_gather_scaled_matmul
    i = 0
    for a_dtype in a_dtypes:
        other_fp8 = E5M2 if a_dtype == E4M3 else E4M3
        for shard_shape in ((2, 6, 32), (6, 32)):
            nd, K = len(shard_shape), shard_shape[-1]
            for gd in [d for d in range(-nd, nd) if d % nd != nd - 1]:  # the scaled op cannot gather K
                gdn = gd % nd
                shards = _ranks_inputs(shard_shape, seed + 100 * i, a_dtype, scale=0.5)
                A = shards[r] if i % 2 == 0 else _noncontig(shards[r])
                Ns = (16, 7, 8)  # column-major; row-major N=7; stride-0 N=8
                Bs = [randn((16, K), seed + 100 * i + 40, scale=0.5).to(a_dtype).t(),
                      randn((K, 7), seed + 100 * i + 41, scale=0.5).to(a_dtype),
                      randn((K, 1), seed + 100 * i + 42, scale=0.5).to(a_dtype).expand(K, 8)]  # fmt: skip
                A_full64 = torch.cat([s.double() for s in shards], dim=gdn)
                full_lead = list(A_full64.shape[:-1])
                row_shards = [randn([*shard_shape[:-1], 1], seed + 100 * i + 60 + q).abs() + 0.5 for q in range(W)]
                for mode in ("tensor-wise", "row-wise-sharded", "row-wise-replicated"):
                    if mode == "tensor-wise":
                        A_scale = full64 = torch.tensor(0.75)
                        B_scales = [torch.tensor(0.5 + 0.25 * j) for j in range(3)]
                    elif mode == "row-wise-sharded":
                        A_scale, full64 = row_shards[r], torch.cat(row_shards, dim=gdn)
                        B_scales = [randn((1, n), seed + 100 * i + 70 + j).abs() + 0.5 for j, n in enumerate(Ns)]
                    else:
                        full64 = torch.cat(row_shards, dim=gdn)
                        A_scale = full64.clone()
                        B_scales = [randn((1, n), seed + 100 * i + 70 + j).abs() + 0.5 for j, n in enumerate(Ns)]
                    assert list(full64.shape[:-1]) == full_lead or full64.numel() == 1
                    for out_dtypes in ([None, BF16, F32], [F16, other_fp8, BF16]):
                        i += 1
                        biases = [None, randn((7,), seed + i, dtype=BF16) if out_dtypes[1] == BF16 else None,
                                  randn((8,), seed + i + 1, dtype=BF16) if out_dtypes[2] == BF16 else None]  # fmt: skip
                        # PyTorch's test passes [None] * n for use_fast_accum; mix both forms.
                        fast = [None, None, None] if i % 2 else [False, True, False]
                        args = (A, Bs, A_scale, B_scales, gd, _g(), biases, [None] * 3, out_dtypes, fast)
                        fargs = (A, Bs, A_scale, B_scales, gdn, _g(), biases, [None] * 3, out_dtypes, fast)
                        what = f"all_gather_scaled_matmul {a_dtype} A{list(shard_shape)} gather_dim={gd} {mode} {out_dtypes}"
                        if i % 3 == 0:
                            names = ("A", "Bs", "A_scale", "B_scales", "gather_dim", "group_name", "biases",
                                     "result_scales", "out_dtypes", "use_fast_accum")  # fmt: skip
                            ours_fn = lambda: op(**dict(zip(names, args)))  # noqa: E731
                        else:
                            ours_fn = lambda: op(*args)  # noqa: E731
                        res = _differential(c, what, ours_fn, lambda: fallback(*fargs))
                        if res is None:
                            with c.case(what):
                                raise AssertionError("both raised on valid inputs")
                            continue
                        (A_out, outs), theirs = res
                        with c.case(what + " vs float64"):
                            assert torch.equal(A_out.view(torch.uint8), torch.cat(shards, dim=gdn).view(torch.uint8))
                            for j, (o, B) in enumerate(zip(outs, Bs)):
                                ref = _scaled_ref(A_full64, full64.double(), B, B_scales[j], biases[j], None, out_dtypes[j])
                                assert o.dtype == (out_dtypes[j] or a_dtype)
                                _check_vs_float64(o, ref, theirs[1][j], f"outs[{j}]")
    return c.done()


@pytest.mark.parametrize("world,a_dtypes", [(2, (E4M3, E5M2)), (3, (E4M3,))], ids=["W2", "W3"])
def test_all_gather_scaled_matmul_parity(request, world, a_dtypes):
    request.getfixturevalue(f"parity{world}").run(_ag_scaled_parity, SEED, a_dtypes, timeout_s=TIMEOUT_S)


def _fp8_outputs_round_as_torch(seed):
    """FP8 outputs equal torch._scaled_mm's on the gathered A, element for element.

    Found by a port of PyTorch's test_fused_all_gather_scaled_matmul (torch.allclose of op and
    fallback): an FP8 output computed as (A @ B) * scales in fp32 sums the products in another
    order than torch's kernel, and where that result lies near a rounding boundary of FP8 it
    rounds one step off (1-2 elements in a quarter of the seeds at this size). Many seeds and
    values spread over the FP8 range, so that boundaries are hit; in range only (torch's CPU
    FP8 output overflows where mptp saturates, by design).
    """
    W, r, c = dist.get_world_size(), dist.get_rank(), _Cases()
    op = torch.ops.mptp.fused_all_gather_scaled_matmul
    rows, K, N = 32, 64, 48
    for i in range(12):
        shards = _ranks_inputs((rows, K), seed + 1000 * i, E4M3, scale=2.0)
        B = randn((N, K), seed + 1000 * i + 50, scale=2.0).to(E4M3).t()
        A_full = torch.cat(shards)
        for mode in ("tensor-wise", "row-wise"):
            if mode == "tensor-wise":
                sa = sa_full = torch.tensor(0.375)
                sb = torch.tensor(0.625)
            else:
                row = [randn((rows, 1), seed + 1000 * i + 60 + q).abs() * 0.25 + 0.25 for q in range(W)]
                sa, sa_full = row[r], torch.cat(row)
                sb = randn((1, N), seed + 1000 * i + 70).abs() * 0.25 + 0.25
            for od in (E4M3, E5M2):
                try:
                    want = torch._scaled_mm(A_full, B, sa_full, sb, out_dtype=od)
                except (RuntimeError, NotImplementedError):  # torch 2.11's CPU kernel: tensor-wise only
                    continue
                what = f"seed {i} {mode} out {od}"
                with c.case(what):
                    fmax = torch.finfo(od).max
                    assert want.float().abs().max() < fmax, "the case left the FP8 range"
                    _, (out,) = op(shards[r], [B], sa, [sb], 0, _g(), [None], [None], [od], [False])
                    bad = out.float() != want.float()
                    assert not bad.any(), (f"{int(bad.sum())} of {bad.numel()} elements differ from "
                                           f"torch._scaled_mm's, e.g. {out.float()[bad][:4].tolist()} "
                                           f"vs {want.float()[bad][:4].tolist()}")  # fmt: skip
    return c.done()


def test_fp8_outputs_round_as_torch(parity2):
    parity2.run(_fp8_outputs_round_as_torch, SEED, timeout_s=TIMEOUT_S)


def _ag_scaled_edges(seed):
    from torch.distributed._symmetric_memory import _fused_all_gather_scaled_matmul_fallback

    def fallback(*args):
        with _fp8_gathers_as_bytes():
            return _fused_all_gather_scaled_matmul_fallback(*args)

    W, r, c = dist.get_world_size(), dist.get_rank(), _Cases()
    op = torch.ops.mptp.fused_all_gather_scaled_matmul
    shards = _ranks_inputs((4, 32), seed, E4M3, scale=0.5)
    A, one = shards[r], torch.ones(())
    B = randn((16, 32), seed + 99, scale=0.5).to(E4M3).t()
    row, Brow = randn((4, 1), seed + 50 + r).abs() + 0.5, randn((1, 16), seed + 51).abs() + 0.5
    _differential(c, "empty Bs", lambda: op(A, [], one, [], 0, _g(), [], [], [], []),
                  lambda: fallback(A, [], one, [], 0, _g(), [], [], [], []))  # fmt: skip
    _differential(c, "empty Bs row-wise", lambda: op(A, [], row, [], 0, _g(), [], [], [], []),
                  lambda: fallback(A, [], row, [], 0, _g(), [], [], [], []))  # fmt: skip
    # A mixed pair is an error in _scaled_mm: both raise (mptp before communicating).
    _differential(c, "tensor-wise A_scale, row-wise B_scale",
                  lambda: op(A, [B], one, [Brow], 0, _g(), [None], [None], [BF16], [False]),
                  lambda: fallback(A, [B], one, [Brow], 0, _g(), [None], [None], [BF16], [False]))  # fmt: skip
    _differential(c, "row-wise A_scale, tensor-wise B_scale",
                  lambda: op(A, [B], row, [one], 0, _g(), [None], [None], [BF16], [False]),
                  lambda: fallback(A, [B], row, [one], 0, _g(), [None], [None], [BF16], [False]))  # fmt: skip
    _raises(c, "mixed pair names the B_scale", lambda: op(A, [B, B], one, [one, Brow], 0, _g(), [None] * 2,
                                                           [None] * 2, [BF16] * 2, [False] * 2), needle="B_scales[1]")  # fmt: skip
    # A result scale only applies to FP8 outputs (_scaled_mm ignores it otherwise): compare.
    rs = torch.tensor(2.0)
    _differential(c, "result_scale with a bf16 output", lambda: op(A, [B], one, [one], 0, _g(), [None], [rs], [BF16], [False]),
                  lambda: fallback(A, [B], one, [one], 0, _g(), [None], [rs], [BF16], [False]))  # fmt: skip
    with c.case("result_scale with an FP8 output vs float64"):
        # NOTE: not against the fallback: CPU _scaled_mm divides by scale_result, CUDA (cuBLASLt's
        # D scale) multiplies; mptp multiplies on every device (reference.scaled_mm).
        _, outs = op(A, [B], one, [one], 0, _g(), [None], [rs], [E4M3], [False])
        ref = _scaled_ref(torch.cat([s.double() for s in shards]), 1.0, B, one, None, rs, E4M3)
        _check_vs_float64(outs[0], ref, None, "outs[0]")
    B1 = randn((1, 32), seed + 98, scale=0.5).to(E4M3).t()  # N = 1
    _differential(c, "N=1 row-wise", lambda: op(A, [B1], row, [torch.ones(1, 1)], 0, _g(), [None], [None], [F32], [True]),
                  lambda: fallback(A, [B1], row, [torch.ones(1, 1)], 0, _g(), [None], [None], [F32], [True]))  # fmt: skip
    bias32 = randn((16,), seed + 5)
    _differential(c, "fp32 bias, bf16 output", lambda: op(A, [B], one, [one], 0, _g(), [bias32], [None], [BF16], [False]),
                  lambda: fallback(A, [B], one, [one], 0, _g(), [bias32], [None], [BF16], [False]))  # fmt: skip
    # What _scaled_mm rejects on every device, both raise (mptp before communicating).
    for what, args in (
        ("bf16 row-wise A_scale", (row.bfloat16(), [Brow], [None], [None], [BF16])),
        ("float64 row-wise B_scale", (row, [Brow.double()], [None], [None], [BF16])),
        ("float64 result_scale, FP8 output", (one, [one], [None], [torch.ones((), dtype=F64)], [None])),
    ):
        sa, bss, biases, rss, ods = args
        _differential(c, what, lambda: op(A, [B], sa, bss, 0, _g(), biases, rss, ods, [False]),
                      lambda: fallback(A, [B], sa, bss, 0, _g(), biases, rss, ods, [False]))  # fmt: skip
    # NOTE: CUDA _scaled_mm rejects these; CPU _scaled_mm of torch 2.14 writes them (tensor-wise).
    # mptp raises on every device, before communicating: a call that runs in a CPU test must not
    # fail on the GPU.
    for what, needle, args in (
        ("int32 out_dtype", "out_dtypes[0]", ([None], [torch.int32])),
        ("float64 out_dtype", "out_dtypes[0]", ([None], [F64])),
        ("float64 bias", "biases[0]", ([torch.zeros(16, dtype=F64)], [F32])),
    ):
        biases, ods = args
        _raises(c, what, lambda: op(A, [B], one, [one], 0, _g(), biases, [None], ods, [False]), needle=needle)
    # A [1, N] bias is the [N] one (CUDA _scaled_mm checks its numel, the CPU broadcasts it).
    bias2d = randn((1, 16), seed + 6, dtype=BF16)
    _differential(c, "[1, N] bias", lambda: op(A, [B], row, [Brow], 0, _g(), [bias2d], [None], [BF16], [False]),
                  lambda: fallback(A, [B], row, [Brow], 0, _g(), [bias2d], [None], [BF16], [False]))  # fmt: skip
    # An [N, 1] bias: CPU _scaled_mm broadcasts it as a column, CUDA's takes it as the row
    # vector; no one meaning, so mptp raises.
    _raises(c, "[N, 1] bias", lambda: op(A, [B], one, [one], 0, _g(), [bias2d.t()], [None], [BF16], [False]),
            needle="biases[0]")  # fmt: skip
    _raises(c, "A_scale of no mode", lambda: op(A, [B], torch.ones(3, 1), [one], 0, _g(), [None], [None], [BF16], [False]),
            needle="A_scale")  # fmt: skip
    BK = randn((16, 32 * W), seed + 96, scale=0.5).to(E4M3).t()  # the K of a gathered K
    _raises(c, "gathering K", lambda: op(A, [BK], one, [one], 1, _g(), [None], [None], [BF16], [False]), needle="gather_dim")
    return c.done()


@pytest.mark.parametrize("world", [2, 3])
def test_all_gather_scaled_matmul_edges(request, world):
    request.getfixturevalue(f"parity{world}").run(_ag_scaled_edges, SEED, timeout_s=TIMEOUT_S)


# -- fused_scaled_matmul_reduce_scatter -----------------------------------------------------------


def _rs_scaled_ref(As, scales, B, B_scale, bias, reduce_op, out_shape, sd, W, r, fp8=None):
    """This rank's float64 chunk; with fp8, also the bound on an FP8 result's error (see below)."""
    parts = [_scaled_ref(a.double().flatten(0, -2), s.double().flatten(0, -2) if s.numel() > 1 else s.double(),
                         B, B_scale, bias, None, None) for a, s in zip(As, scales)]  # fmt: skip
    div = W if reduce_op == "avg" else 1
    chunk = lambda t: t.view(*out_shape).chunk(W, dim=sd)[r]  # noqa: E731
    ref = chunk(sum(parts) / div)
    if fp8 is None:
        return ref
    # Each partial is rounded to FP8 (half an ulp of the partial, which may exceed the
    # sum's), the fp32 sum rounded once more; x2 for fp32 accumulation moving near-ties.
    bound = 2 * (sum(chunk(_ulp(p, fp8)) for p in parts) / (2 * div) + _ulp(ref, fp8) / 2)
    return ref, bound


def _rs_scaled_parity(seed, a_dtypes):
    from torch.distributed._symmetric_memory import _fused_scaled_matmul_reduce_scatter_fallback as fallback

    W, r, c = dist.get_world_size(), dist.get_rank(), _Cases(terms=dist.get_world_size())
    op = torch.ops.mptp.fused_scaled_matmul_reduce_scatter
    i = 0
    for a_dtype in a_dtypes:
        for shape in ((6, 2, 32), (6, 32)):  # 6: divisible by 2 and 3
            nd, K = len(shape), shape[-1]
            for sd in [d for d in range(-nd, nd) if shape[d % nd] % W == 0 or d % nd == nd - 1]:
                As = _ranks_inputs(shape, seed + 100 * i, a_dtype, scale=0.5)
                A = As[r] if i % 2 == 0 else _noncontig(As[r])
                for mode in ("tensor", "row"):
                    N = 12 if mode == "tensor" else 6
                    # Transposed (column-major) B as PyTorch's test; a row-major one when row-wise.
                    B = (randn((N, K), seed + 100 * i + 7, scale=0.5).to(a_dtype).t() if mode == "tensor"
                         else randn((K, N), seed + 100 * i + 7, scale=0.5).to(a_dtype))  # fmt: skip
                    if mode == "tensor":
                        scales, B_scale = [torch.tensor(0.5 + 0.25 * q) for q in range(W)], torch.tensor(1.25)
                    else:
                        scales = [randn([*shape[:-1], 1], seed + 100 * i + 20 + q).abs() + 0.5 for q in range(W)]
                        B_scale = randn((1, N), seed + 100 * i + 30).abs() + 0.5
                    out_shape = [*shape[:-1], N]
                    for out_dtype, reduce_op in ((BF16, "avg"), (F32, "sum"), (F16, "avg"), (None, "sum"), (E4M3, "avg")):
                        i += 1
                        bias = randn((N,), seed + i, dtype=BF16) if out_dtype == BF16 else None
                        args = (A, B, scales[r], B_scale, reduce_op, sd, sd, _g(), out_shape, bias, None, out_dtype, False)
                        what = f"scaled_matmul_reduce_scatter {a_dtype} A{list(shape)} {mode} scatter_dim={sd} out={out_dtype} {reduce_op}"
                        want_dtype = out_dtype or a_dtype
                        if want_dtype in FP8:
                            # NOTE: gloo cannot reduce FP8 ("Invalid scalar type"), so the fallback has
                            # no result here; mptp reduces in fp32 and rounds once: float64 only.
                            with c.case(what + " vs float64"):
                                out = op(*args)
                                ref, bound = _rs_scaled_ref(As, scales, B, B_scale, bias, reduce_op, out_shape,
                                                            sd, W, r, fp8=want_dtype)  # fmt: skip
                                assert (tuple(out.shape), out.dtype) == (tuple(ref.shape), want_dtype)
                                assert out.is_contiguous()
                                bad = (out.double() - ref).abs() > bound
                                assert not bad.any(), f"{int(bad.sum())} elements off"
                            continue
                        if i % 2:
                            kw = dict(zip(("A", "B", "A_scale", "B_scale", "reduce_op", "orig_scatter_dim",
                                           "scatter_dim_after_maybe_reshape", "group_name", "output_shape"), args[:9]))  # fmt: skip
                            ours_fn = lambda: op(**kw, bias=bias, out_dtype=out_dtype)  # noqa: E731
                        else:
                            ours_fn = lambda: op(*args)  # noqa: E731
                        res = _differential(c, what, ours_fn, lambda: fallback(*args[:8], list(out_shape), *args[9:]))
                        if res is None:
                            with c.case(what):
                                raise AssertionError("both raised on valid inputs")
                            continue
                        with c.case(what + " vs float64"):
                            ref = _rs_scaled_ref(As, scales, B, B_scale, bias, reduce_op, out_shape, sd, W, r)
                            _check_reduced_vs_float64(res[0], ref, res[1], W)
    return c.done()


@pytest.mark.parametrize("world,a_dtypes", [(2, (E4M3, E5M2)), (3, (E4M3,))], ids=["W2", "W3"])
def test_scaled_matmul_reduce_scatter_parity(request, world, a_dtypes):
    request.getfixturevalue(f"parity{world}").run(_rs_scaled_parity, SEED, a_dtypes, timeout_s=TIMEOUT_S)


def _rs_scaled_edges(seed):
    from torch.distributed._symmetric_memory import _fused_scaled_matmul_reduce_scatter_fallback as fallback

    W, r, c = dist.get_world_size(), dist.get_rank(), _Cases(terms=dist.get_world_size())
    op = torch.ops.mptp.fused_scaled_matmul_reduce_scatter
    Bt, M, N = 4, 6, 12
    # The micro-pipeline pass's reshape: A flattened to 2-D, output_shape and orig_scatter_dim
    # in the original 3-D shape, scatter_dim_after_maybe_reshape in A's.
    As = _ranks_inputs((Bt * M, 32), seed, E4M3, scale=0.5)
    scales = [randn((Bt * M, 1), seed + 20 + q).abs() + 0.5 for q in range(W)]
    B = randn((N, 32), seed + 99, scale=0.5).to(E4M3).t()
    B_scale = randn((1, N), seed + 98).abs() + 0.5
    A, s, one = As[r], scales[r], torch.ones(())
    for osd in (0, 1, -2):
        if [Bt, M, N][osd] % W:
            continue
        what = f"reshaped A, output_shape [{Bt}, {M}, {N}], orig_scatter_dim={osd}"
        res = _differential(c, what, lambda: op(A, B, s, B_scale, "sum", osd, 0, _g(), [Bt, M, N], None, None, BF16, False),
                            lambda: fallback(A, B, s, B_scale, "sum", osd, 0, _g(), [Bt, M, N], None, None, BF16, False))  # fmt: skip
        with c.case(what + " vs float64"):
            assert res is not None, "both raised"
            ref = _rs_scaled_ref(As, scales, B, B_scale, None, "sum", [Bt, M, N], osd, W, r)
            _check_reduced_vs_float64(res[0], ref, res[1], W)
    # output_shape None (the schema's SymInt[]?): PyTorch's fallback indexes it (TypeError);
    # mptp reads it as [*A.shape[:-1], N]: the same as passing that shape.
    _differential(c, "output_shape None", lambda: op(A, B, s, B_scale, "sum", 0, 0, _g(), None, None, None, F32, False),
                  lambda: fallback(A, B, s, B_scale, "sum", 0, 0, _g(), [Bt * M, N], None, None, F32, False))  # fmt: skip
    # Only FP8 outputs take a result scale: compare with a bf16 output.
    _differential(c, "result_scale with a bf16 output",
                  lambda: op(A, B, s, B_scale, "sum", 0, 0, _g(), [Bt * M, N], None, torch.tensor(2.0), BF16, False),
                  lambda: fallback(A, B, s, B_scale, "sum", 0, 0, _g(), [Bt * M, N], None, torch.tensor(2.0), BF16, False))  # fmt: skip
    for what, sa, sb in (("tensor-wise A_scale, row-wise B_scale", one, B_scale), ("row-wise A_scale, tensor-wise B_scale", s, one),
                         ("A_scale [M, 2]", torch.ones(Bt * M, 2), B_scale), ("A_scale [M//2, 1]", torch.ones(M, 1), B_scale)):  # fmt: skip
        _differential(c, what, lambda: op(A, B, sa, sb, "sum", 0, 0, _g(), [Bt * M, N], None, None, BF16, False),
                      lambda: fallback(A, B, sa, sb, "sum", 0, 0, _g(), [Bt * M, N], None, None, BF16, False))  # fmt: skip
    # Stride-0 B (expanded column) and a stride-0 row-wise A_scale.
    Bx = randn((32, 1), seed + 97, scale=0.5).to(E4M3).expand(32, N)
    sx = torch.tensor([[0.75]]).expand(Bt * M, 1)
    _differential(c, "stride-0 B and A_scale", lambda: op(A, Bx, sx, B_scale, "avg", 0, 0, _g(), [Bt * M, N], None, None, F32, False),
                  lambda: fallback(A, Bx, sx, B_scale, "avg", 0, 0, _g(), [Bt * M, N], None, None, F32, False))  # fmt: skip
    _raises(c, "reduce_op max", lambda: op(A, B, s, B_scale, "max", 0, 0, _g(), [Bt * M, N], None, None, BF16, False),
            needle="reduce_op")  # fmt: skip
    for what, sa, sb, bias, rs, od in (
        ("bf16 row-wise A_scale", s.bfloat16(), B_scale, None, None, BF16),
        ("float64 result_scale", s, B_scale, None, torch.ones((), dtype=F64), BF16),
    ):
        _differential(c, what, lambda: op(A, B, sa, sb, "sum", 0, 0, _g(), [Bt * M, N], bias, rs, od, False),
                      lambda: fallback(A, B, sa, sb, "sum", 0, 0, _g(), [Bt * M, N], bias, rs, od, False))  # fmt: skip
    # NOTE: CUDA _scaled_mm rejects a float64 output or bias; CPU _scaled_mm writes them (torch
    # 2.14 tensor- and row-wise, older ones row-wise only). mptp raises for every scaling and
    # device, before communicating.
    for what, bias, od, needle in (("float64 out_dtype", None, F64, "out_dtype"),
                                   ("float64 bias", torch.zeros(N, dtype=F64), F32, "bias")):  # fmt: skip
        for mode, sa, sb in (("tensor-wise", one, one), ("row-wise", s, B_scale)):
            _raises(c, f"{what}, {mode}", lambda: op(A, B, sa, sb, "sum", 0, 0, _g(), [Bt * M, N], bias, None, od, False),
                    needle=needle)  # fmt: skip
    bias2d = randn((1, N), seed + 6, dtype=BF16)
    _differential(c, "[1, N] bias", lambda: op(A, B, s, B_scale, "avg", 0, 0, _g(), [Bt * M, N], bias2d, None, BF16, False),
                  lambda: fallback(A, B, s, B_scale, "avg", 0, 0, _g(), [Bt * M, N], bias2d, None, BF16, False))  # fmt: skip
    # PyTorch's fallback ignores output_shape[-1] (it views C as [*output_shape[:-1], N]); its
    # CUDA op views the result as output_shape and fails: mptp raises before communicating.
    _raises(c, "output_shape with a wrong last dim",
            lambda: op(A, B, s, B_scale, "sum", 0, 0, _g(), [Bt * M, N + 1], None, None, BF16, False),
            needle="output_shape")  # fmt: skip
    return c.done()


@pytest.mark.parametrize("world", [2, 3])
def test_scaled_matmul_reduce_scatter_edges(request, world):
    request.getfixturevalue(f"parity{world}").run(_rs_scaled_edges, SEED, timeout_s=TIMEOUT_S)


# -- groups other than the world, by name --------------------------------------------------------


def _subgroups(seed):
    from torch.distributed._symmetric_memory import _fused_all_gather_matmul_fallback as ag_fallback
    from torch.distributed._symmetric_memory import _fused_matmul_reduce_scatter_fallback as rs_fallback

    W, r, c = dist.get_world_size(), dist.get_rank(), _Cases()
    pair = dist.new_group([0, W - 1])  # collective: every rank creates it
    singles = [dist.new_group([q]) for q in range(W)]
    A, B = randn((4, 3, 16), seed + r), randn((16, 6), seed + 99)
    groups = [("rank-1 group", singles[r])]
    if r in (0, W - 1):
        groups.append(("ranks {0, W-1}", pair))
    for what, pg in groups:
        g = pg.group_name
        for d in (0, 1, 2, -1):
            Bk = B if d % 3 != 2 else randn((16 * pg.size(), 6), seed + 98)
            _differential(c, f"all_gather_matmul on {what} gather_dim={d}", lambda: torch.ops.mptp.fused_all_gather_matmul(
                A, [Bk], d, g), lambda: ag_fallback(A, [Bk], d % 3, g))  # fmt: skip
            _differential(c, f"matmul_reduce_scatter on {what} scatter_dim={d}", lambda: torch.ops.mptp.fused_matmul_reduce_scatter(
                A, B, "avg", d, g), lambda: rs_fallback(A, B, "avg", d, g))  # fmt: skip
    return c.done()


def test_subgroups_by_name(parity3):
    parity3.run(_subgroups, SEED, timeout_s=TIMEOUT_S)


# -- opcheck across processes, and the restride helpers --------------------------------------------


def _opcheck(seed):
    W, r = dist.get_world_size(), dist.get_rank()
    g = _g()
    A, B = randn((2, 3, 16), seed + r), randn((16, 8), seed + 99)
    A8, B8 = randn((6, 32), seed + r, scale=0.5).to(E4M3), randn((16, 32), seed + 98, scale=0.5).to(E4M3).t()
    row, Brow, one = torch.rand(6, 1) + 0.5, torch.rand(1, 16) + 0.5, torch.ones(())
    samples = [
        (torch.ops.mptp.fused_all_gather_matmul, (A, [B, B.t().contiguous().t()], 1, g), {"return_A": False}),
        (torch.ops.mptp.fused_all_gather_matmul, (A, [], 0, g), {}),
        (torch.ops.mptp.fused_matmul_reduce_scatter, (A, B, "avg", 0, g), {}),
        (torch.ops.mptp.fused_all_gather_scaled_matmul,
         (A8, [B8], row, [Brow], 0, g, [None], [None], [BF16], [False]), {}),
        (torch.ops.mptp.fused_scaled_matmul_reduce_scatter,
         (A8, B8, one, one, "sum", 0, 0, g, [6, 16], None, None, F32, False), {}),
    ]  # fmt: skip
    for op, args, kwargs in samples:
        # The scaled ops skip test_schema: SchemaCheckMode compares FP8 inputs with allclose
        # (no float8 kernel), as in tests/test_library.py.
        if "scaled" in op._qualified_op_name:
            utils = ("test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")
            torch.library.opcheck(op.default, args, kwargs, test_utils=utils)
        else:
            torch.library.opcheck(op.default, args, kwargs)
    return W


def test_opcheck_across_processes(parity2):
    parity2.run(_opcheck, SEED, timeout_s=TIMEOUT_S)


@pytest.mark.parametrize("dim", [0, 1, 2])
def test_restride_helpers_match_torch(dim):
    import torch.distributed._symmetric_memory as symm_mem

    import mptp_kernels

    t = torch.rand(8, 6, 4, 5)
    for name in ("restride_A_shard_for_fused_all_gather_matmul", "restride_A_for_fused_matmul_reduce_scatter"):
        ours, theirs = getattr(mptp_kernels, name)(t, dim), getattr(symm_mem, name)(t, dim)
        assert ours.stride() == theirs.stride() and torch.equal(ours, t), name
        assert ours.movedim(dim, 0).is_contiguous(), name
