"""PyTorch's tests of its own async-TP pass, ported to CPU against the mptp pass.

Source: pytorch test/distributed/tensor/parallel/test_micro_pipeline_tp.py (the
MicroPipelineTPTest / MicroPipelineTP4GPUTest cases: find_all_gather_patterns,
find_reduce_scatter_patterns, get_unexposed_collectives, fuse_all_gather_matmul,
fuse_all_gather_matmul_view_optimization, fuse_all_gather_matmul_slice_cat[_trim],
fuse_all_gather_scaled_matmul, fuse_matmul_reduce_scatter[_slice_cat],
fuse_scaled_matmul_reduce_scatter[_rowwise_scales_reshape_mm_reshape],
dtensor_seq_par, extra_collectives, fusion_without_deprecated_enable). The file
has no test_no_all_gathers_or_reduce_scatters nor test_unsuccessful_fusion; the
two cases below with those names cover what the names say.

Structure tests trace each graph as PyTorch's tests do (make_fx with Inductor's
decompositions, remove_noop_ops, view_to_reshape) on a fake 2-rank group and run
PyTorch's own pass (torch._inductor.fx_passes.micro_pipeline_tp, under
symm_mem._test_mode) on one copy and ours on another: every symm_mem.fused_* op
PyTorch emits must come out of ours as the mptp.fused_* of the same name, every
output must keep its shape, strides and dtype, and where PyTorch's test pins an
answer we pin it too.

Numeric tests compile the same functions with the pass (fullgraph=True) on 2 gloo
processes and compare with eager and with a float64 reference, by the rule of
tests/utils.assert_matmul_close (error vs float64 <= 2 x eager's error + 1e-6,
relative norm); gathered tensors are compared bitwise. FP8 inputs are small
integers with power-of-two scales, so their products are exact.
"""

import collections
import warnings
from unittest import mock

import pytest
import torch
import torch.distributed as dist
from torch.utils._pytree import tree_leaves
from utils import cpu_rowwise_scaled_mm

import mptp_kernels
from mptp_kernels.compile import micro_pipeline
from mptp_kernels.compile.micro_pipeline import micro_pipeline_pass, recording

c10d = torch.ops._c10d_functional
aten = torch.ops.aten
FP8 = torch.float8_e4m3fn
W = 2


# ---------------------------------------------------------------- graphs


# NOTE: before torch 2.13 (seen on 2.11.0 and 2.12.1) Dynamo cannot trace funcol's gather on a
# dim other than 0 (it calls torch._utils._maybe_view_chunk_cat, marked as skipped): there the
# gather is written out as funcol's reference form (gather on dim 0, chunks concatenated on d).
# PyTorch's own pass there has no slice/cat form either.
_OLD_TORCH = tuple(int(v) for v in torch.__version__.split(".")[:2]) < (2, 13)


def _ag(x, d, g):
    import torch.distributed._functional_collectives as funcol

    if _OLD_TORCH and d % x.dim() != 0:
        full = funcol.all_gather_tensor(x, 0, g)
        return torch.cat(torch.chunk(full, full.shape[0] // x.shape[0], 0), d)
    return getattr(funcol, "all_gather_single", funcol.all_gather_tensor)(x, d, g)


def _rs(x, op, d, g):
    import torch.distributed._functional_collectives as funcol

    return getattr(funcol, "reduce_scatter_single", funcol.reduce_scatter_tensor)(x, op, d, g)


def _fp8_ag(x, d, g, as_bytes=False):
    """PyTorch's _fp8_all_gather (DTensor + float8): gather on dim 0, chunks viewed as bytes, cat, view back.

    as_bytes sends the shard as bytes (gloo cannot all-gather FP8): the graph differs only
    by a no-op view.
    """
    ag = _ag(x.view(torch.uint8) if as_bytes else x, 0, g)
    if d == 0:
        return ag.view(x.dtype)
    chunks = [c.view(torch.uint8) for c in ag.chunk(W)]
    return torch.cat(chunks, dim=d).view(x.dtype)


def _shape(A_dims, d=None):
    s = [64, 32] if A_dims == 2 else [2, 64, 32]
    if d is not None:
        s[d] //= W
    return s


def _ag_mm(g, gather_dim, return_A):
    def f(A_shard, B):
        A = _ag(A_shard, gather_dim, g)
        return (A, A @ B) if return_A else (A @ B,)

    return f


def _scaled(A, B, sa, sb):
    if A.dim() > 2:
        return torch._scaled_mm(A.flatten(0, -2), B, sa, sb, out_dtype=torch.bfloat16).view(
            *A.shape[:-1], -1
        )
    return torch._scaled_mm(A, B, sa, sb, out_dtype=torch.bfloat16)


def _ag_scaled_mm(g, gather_dim, return_A, as_bytes=False):
    def f(A_shard, B, sa, sb):
        A = _fp8_ag(A_shard, gather_dim, g, as_bytes)
        C = _scaled(A, B, sa, sb)
        return (A, C) if return_A else (C,)

    return f


def _mm_rs(g, scatter_dim, op="avg"):
    def f(A, B):
        return (_rs(A @ B, op, scatter_dim, g),)

    return f


def _scaled_mm_rs(g, scatter_dim, op="avg"):
    def f(A, B, sa, sb):
        return (_rs(_scaled(A, B, sa, sb), op, scatter_dim, g),)

    return f


def _reshape_mm_reshape(g, scatter_dim):
    def f(A, B, sa, sb):  # row-wise scales, reshaped together with A (PyTorch's case)
        orig = A.shape
        A = A.reshape(-1, orig[-1])
        sa = torch.reciprocal(sa.reshape(-1, sa.shape[-1]))
        C = torch._scaled_mm(A, B, sa, sb, out_dtype=torch.bfloat16)
        return (_rs(C.view(*orig[:-1], C.shape[-1]), "sum", scatter_dim, g),)

    return f


def _ag_slice_cat(g, trim=None):
    def f(A_shard, B):
        full, c = _ag(A_shard, 0, g), A_shard.shape[0]
        A = torch.cat([full.narrow(0, 0, c), full.narrow(0, c, c)], dim=1)
        return ((A if trim is None else A.narrow(1, 0, trim)) @ B,)

    return f


def _rs_slice_cat(g):
    def f(A, B):
        C, h = A @ B, B.shape[1] // 2
        return (_rs(torch.cat([C.narrow(1, 0, h), C.narrow(1, h, h)], dim=0), "avg", 0, g),)

    return f


# ---------------------------------------------------------------- structure: PyTorch's pass vs ours


@pytest.fixture(scope="module")
def fake2(pg1):
    """A fake 2-rank group enabled for symmetric memory (as PyTorch's tests: backend "fake", W = 2)."""
    from .conftest import _register_fake_group

    try:
        _register_fake_group("mptp_fake2", W)
    except Exception as e:  # noqa: BLE001 - the private API moved
        pytest.skip(f"cannot register a fake process group in this torch: {e}")
    mptp_kernels.enable_symm_mem_for_group("mptp_fake2")
    return "mptp_fake2"


def _post_grad_fx(f, *args, tracing_mode="fake", decompose=True):
    from torch._inductor.decomposition import decompositions
    from torch._inductor.fx_passes.post_grad import remove_noop_ops, view_to_reshape
    from torch.fx.experimental.proxy_tensor import make_fx

    gm = make_fx(
        lambda *a: f(*a), decompositions if decompose else None, tracing_mode=tracing_mode
    )(*args)
    if decompose:
        remove_noop_ops(gm.graph)
        view_to_reshape(gm)
    return gm


def _fused_ops(gm, ns):
    return sorted(
        str(n.target).split(".")[1] for n in gm.graph.nodes if str(n.target).startswith(ns + ".")
    )


def _torch_pass(gm, groups=None):
    """PyTorch's own pass, as its tests run it; returns the symm_mem ops it emitted."""
    from torch._inductor.fx_passes.micro_pipeline_tp import micro_pipeline_tp_pass
    from torch.distributed._symmetric_memory import _test_mode

    # NOTE: it skips everything without NCCL; here it only rewrites graphs, never runs them.
    with (
        _test_mode(groups),
        mock.patch.object(dist, "is_nccl_available", lambda: True),
        warnings.catch_warnings(),
    ):
        warnings.simplefilter("ignore")
        micro_pipeline_tp_pass(gm.graph)
    return _fused_ops(gm, "symm_mem")


def _layouts(gm):
    out = next(n for n in gm.graph.nodes if n.op == "output")
    return [
        (tuple(v.shape), tuple(v.stride()), v.dtype)
        for v in (a.meta["val"] for a in tree_leaves(out.args))
    ]


def _mptp_pass(gm):
    """Our pass; asserts every output kept its layout; returns (mptp ops emitted, decisions)."""
    before = _layouts(gm)
    with recording([]) as decisions, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        micro_pipeline_pass(gm.graph)
    gm.recompile()
    assert _layouts(gm) == before, "the pass changed an output's layout"
    return _fused_ops(gm, "mptp"), decisions


def _parity(f, *args, groups=None, **trace):
    """Runs both passes on two traces of f; every op PyTorch fuses must be fused by ours. Returns both lists."""
    theirs = _torch_pass(_post_grad_fx(f, *args, **trace), groups)
    gm = _post_grad_fx(f, *args, **trace)
    ours, decisions = _mptp_pass(gm)
    missing = collections.Counter(theirs) - collections.Counter(ours)
    assert not missing, f"PyTorch fuses {theirs}, mptp only {ours}: {[str(d) for d in decisions]}"
    return theirs, ours, gm


def _fp8(shape, lo=-2, hi=3):
    return torch.randint(lo, hi, shape).float().to(FP8)


def _cm(B):
    """B in the column-major layout _scaled_mm wants."""
    return B.t().contiguous().t()


def test_find_all_gather_patterns(fake2):
    def f(inp):
        a = _ag(inp, 0, fake2)
        b = _ag(inp, 1, fake2)
        c = _fp8_ag(inp, 0, fake2)
        d = _fp8_ag(inp, 1, fake2)
        e_full = _ag(inp, 0, fake2)
        e = torch.cat([e_full.narrow(0, 0, 64), e_full.narrow(0, 64, 64)], dim=1)
        f_full = _ag(inp, 0, fake2)
        f_cat = torch.cat([f_full.narrow(0, 0, 64), f_full.narrow(0, 64, 64)], dim=1)
        return a, b, c, d, e, f_cat.narrow(1, 0, 32)

    gm = _post_grad_fx(f, torch.rand(64, 32))
    ags = [n for n in gm.graph.nodes if n.target is c10d.all_gather_into_tensor.default]
    matches = [micro_pipeline._match_all_gather(n) for n in ags]
    assert all(m is not None for m in matches)
    assert [m.gather_dim for m in matches] == [0, 1, 0, 1, 1, 1]
    assert {m.group_name for m in matches} == {fake2}
    # PyTorch's res nodes, except the last: its trimming slice is a user of ours (a cat).
    assert [m.res.target for m in matches] == [
        c10d.wait_tensor.default, aten.cat.default, c10d.wait_tensor.default,
        aten.view.dtype, aten.cat.default, aten.cat.default,
    ]  # fmt: skip


def test_find_reduce_scatter_patterns(fake2):
    """PyTorch's three forms, each traced alone: ours reads a split or narrow reassembly only where
    it is the source's only user (a fusable matmul result has no other; PyTorch's pass agrees)."""
    from torch.fx.experimental.proxy_tensor import make_fx

    forms = [
        lambda inp: _rs(inp, "sum", 0, fake2),
        lambda inp: _rs(inp, "avg", 1, fake2),
        lambda inp: _rs(
            torch.cat([inp.narrow(1, 0, 16), inp.narrow(1, 16, 16)], dim=0), "avg", 0, fake2
        ),
    ]
    matches = []
    for f in forms:
        gm = make_fx(f)(torch.rand(64, 32))
        (rs,) = [n for n in gm.graph.nodes if n.target is c10d.reduce_scatter_tensor.default]
        matches.append(micro_pipeline._match_reduce_scatter(rs))
    assert all(m.inp.op == "placeholder" for m in matches)
    assert all(m.wait.target is c10d.wait_tensor.default for m in matches)
    assert [(m.reduce_op, m.scatter_dim, m.group_name) for m in matches] == [
        ("sum", 0, fake2), ("avg", 1, fake2), ("avg", 1, fake2),
    ]  # fmt: skip


def _exposure_graph(g):
    def f(inp):
        a = inp @ inp.T
        b = _ag(inp, 0, g)  # hidden by a
        c = b @ inp.T
        d = _rs(b, "avg", 0, g)  # hidden by c
        e = _ag(d, 0, g)  # exposed
        return a, c, e

    return f


def test_get_unexposed_collectives(fake2):
    from torch._inductor.fx_passes.micro_pipeline_tp import _get_unexposed_collectives
    from torch.fx.experimental.proxy_tensor import make_fx

    gm = make_fx(_exposure_graph(fake2))(torch.rand(64, 32))
    theirs = _get_unexposed_collectives(gm.graph)
    ours = micro_pipeline._hidden_collectives(
        gm.graph, (c10d.all_gather_into_tensor.default, c10d.reduce_scatter_tensor.default)
    )
    assert [str(n) for n in theirs] == ["all_gather_into_tensor", "reduce_scatter_tensor"]
    assert ours == set(theirs)


def test_independent_addmm_hides_nothing_as_in_pytorch(fake2):
    """PyTorch counts only aten.mm as hiding a collective: with an independent addmm (a
    Linear with bias) and reorder_for_compute_comm_overlap on, it still fuses; so must we."""

    def f(A_shard, B, x, w, b):
        return _ag(A_shard, 0, fake2) @ B, torch.nn.functional.linear(x, w, b)

    args = (
        torch.rand(32, 32),
        torch.rand(32, 16),
        torch.rand(8, 16),
        torch.rand(16, 16),
        torch.rand(16),
    )
    with torch._inductor.config.patch(reorder_for_compute_comm_overlap=True):
        theirs, ours, _ = _parity(f, *args)
    assert theirs == ours == ["fused_all_gather_matmul"]


@pytest.mark.parametrize("return_A", [True, False])
@pytest.mark.parametrize("A_dims,gather_dim", [(2, 0), (2, 1), (3, 0), (3, 1), (3, 2)])
def test_fuse_all_gather_matmul(fake2, A_dims, gather_dim, return_A):
    f = _ag_mm(fake2, gather_dim, return_A)
    theirs, ours, gm = _parity(f, torch.rand(*_shape(A_dims, gather_dim)), torch.rand(32, 16))
    if gather_dim == A_dims - 1:
        # K < 1024 is too small to decompose (PyTorch's pass, and ours: PyTorch's test asserts
        # that the compiled code has no fused_all_gather_matmul here).
        assert theirs == ours == []
        assert c10d.all_gather_into_tensor.default in [n.target for n in gm.graph.nodes]
    else:
        assert theirs == ours == ["fused_all_gather_matmul"]
        assert c10d.all_gather_into_tensor.default not in [n.target for n in gm.graph.nodes]
        (node,) = [
            n for n in gm.graph.nodes if n.target is torch.ops.mptp.fused_all_gather_matmul.default
        ]
        assert node.kwargs["return_A"] is return_A


@pytest.mark.parametrize("return_A", [True, False])
@pytest.mark.parametrize("A_dims", [2, 3])
def test_fuse_all_gather_matmul_last_dim_large_K(fake2, A_dims, return_A):
    """A last-dim gather of a shard with K >= 1024: PyTorch's pass decomposes it when nothing
    but the matmuls needs the gathered A; ours decides the same."""
    shard = torch.rand(*([2] * (A_dims - 1)), 1024)
    theirs, ours, _ = _parity(_ag_mm(fake2, A_dims - 1, return_A), shard, torch.rand(1024 * W, 16))
    assert ours == ([] if return_A else ["fused_all_gather_matmul"])
    assert theirs == ours


def test_fuse_all_gather_matmul_view_optimization(fake2):
    """Batch 1, gather_dim 1: Inductor later turns the cat into a view; the pass still sees the gather."""
    theirs, ours, _ = _parity(_ag_mm(fake2, 1, False), torch.rand(1, 32, 32), torch.rand(32, 16))
    assert ours == ["fused_all_gather_matmul"]


@pytest.mark.parametrize("trim", [None, 4096, 2048])
def test_fuse_all_gather_matmul_slice_cat(fake2, trim):
    args = torch.rand(64, 2048), torch.rand(trim or 4096, 16)
    if trim == 2048:
        # A real trim (not in PyTorch's tests): PyTorch's pass rewrites it into a gather of the
        # untrimmed [64, 4096] A times B [2048, 16], which cannot run. Ours must leave it alone.
        gm = _post_grad_fx(_ag_slice_cat(fake2, trim), *args)
        assert _torch_pass(gm) == ([] if _OLD_TORCH else ["fused_all_gather_matmul"])
        assert _mptp_pass(_post_grad_fx(_ag_slice_cat(fake2, trim), *args))[0] == []
        return
    theirs, ours, _ = _parity(_ag_slice_cat(fake2, trim), *args)
    assert ours == ["fused_all_gather_matmul"]
    assert theirs == ours or (_OLD_TORCH and theirs == [])  # before 2.13 PyTorch's pass has no slice/cat form


@pytest.mark.parametrize("scales", ["tensor", "row"])
@pytest.mark.parametrize("return_A", [True, False])
@pytest.mark.parametrize("A_dims,gather_dim", [(2, 0), (2, 1), (3, 0), (3, 1), (3, 2)])
def test_fuse_all_gather_scaled_matmul(fake2, A_dims, gather_dim, return_A, scales):
    last = gather_dim == A_dims - 1
    shard = _fp8(
        _shape(A_dims, None if last else gather_dim)
    )  # last: K is gathered, B has W * 32 rows
    M = shard.numel() // 32 * (1 if last else W)
    sa = torch.tensor(0.1) if scales == "tensor" else torch.rand(M, 1)
    sb = torch.tensor(0.1) if scales == "tensor" else torch.rand(1, 16)
    f = _ag_scaled_mm(fake2, gather_dim, return_A)
    if last:
        theirs, ours, gm = _parity(f, shard, _cm(_fp8((32 * W, 16))), sa, sb)
        assert theirs == ours == []  # the scaled op cannot gather K (PyTorch's answer too)
        assert c10d.all_gather_into_tensor.default in [n.target for n in gm.graph.nodes]
        return
    theirs, ours, gm = _parity(f, shard, _cm(_fp8((32, 16))), sa, sb)
    assert theirs == ours == ["fused_all_gather_scaled_matmul"]
    assert c10d.all_gather_into_tensor.default not in [n.target for n in gm.graph.nodes]


@pytest.mark.parametrize("A_dims,scatter_dim", [(2, 0), (2, 1), (3, 0), (3, 1), (3, 2)])
def test_fuse_matmul_reduce_scatter(fake2, A_dims, scatter_dim):
    theirs, ours, gm = _parity(
        _mm_rs(fake2, scatter_dim), torch.rand(*_shape(A_dims)), torch.rand(32, 16)
    )
    assert theirs == ours == ["fused_matmul_reduce_scatter"]
    assert c10d.reduce_scatter_tensor.default not in [n.target for n in gm.graph.nodes]


def test_fuse_matmul_reduce_scatter_slice_cat(fake2):
    theirs, ours, _ = _parity(_rs_slice_cat(fake2), torch.rand(64, 32), torch.rand(32, 16))
    assert ours == ["fused_matmul_reduce_scatter"]
    assert theirs == ours or (_OLD_TORCH and theirs == [])  # before 2.13 PyTorch's pass has no slice/cat form


@pytest.mark.parametrize("A_dims,scatter_dim", [(2, 0), (2, 1), (3, 0), (3, 1), (3, 2)])
def test_fuse_scaled_matmul_reduce_scatter(fake2, A_dims, scatter_dim):
    args = _fp8(_shape(A_dims)), _cm(_fp8((32, 16))), torch.tensor(0.1), torch.tensor(0.1)
    theirs, ours, gm = _parity(_scaled_mm_rs(fake2, scatter_dim), *args)
    # PyTorch's test stops at scatter_dim < A_dims - 1 (its pass skips the last dim); ours fuses it too.
    assert theirs == (["fused_scaled_matmul_reduce_scatter"] if scatter_dim < A_dims - 1 else [])
    assert ours == ["fused_scaled_matmul_reduce_scatter"]
    assert c10d.reduce_scatter_tensor.default not in [n.target for n in gm.graph.nodes]


@pytest.mark.parametrize("scatter_dim", [0, 1])
def test_fuse_scaled_matmul_reduce_scatter_rowwise_scales_reshape_mm_reshape(fake2, scatter_dim):
    args = (
        _fp8((2, 16, 32)),
        _cm(_fp8((32, 64))),
        torch.full((2, 16, 1), 0.1),
        torch.full((1, 64), 0.1),
    )
    theirs, ours, _ = _parity(_reshape_mm_reshape(fake2, scatter_dim), *args)
    assert theirs == ours == ["fused_scaled_matmul_reduce_scatter"]


def test_extra_collectives(fake2, fake4):
    """PyTorch's 4-GPU case: only the collectives of the enabled ("tp") group fuse."""
    other = "mptp_parity_other2"
    from .conftest import _register_fake_group

    _register_fake_group(other, W)  # never enabled

    def f(inp, w1, w2):
        hidden = _ag(inp, 0, fake2) @ w1.t()
        full_hidden = _ag(hidden, 0, other)
        full_hidden = full_hidden / full_hidden.pow(2).sum().sqrt()
        hidden = _rs(full_hidden, "avg", 0, other)
        return _rs(hidden @ w2.t(), "avg", 0, fake2)

    args = torch.rand(8, 10), torch.rand(7, 10), torch.rand(10, 7)
    theirs, ours, gm = _parity(f, *args, groups={fake2})
    assert theirs == ours == ["fused_all_gather_matmul", "fused_matmul_reduce_scatter"]
    targets = [n.target for n in gm.graph.nodes]
    assert (
        c10d.all_gather_into_tensor.default in targets
        and c10d.reduce_scatter_tensor.default in targets
    )


def test_fusion_without_deprecated_enable(pg1):
    """PyTorch's newest tests fuse on a group never enabled for symmetric memory (pytorch#193027);
    the installed torch's pass, like ours, still requires the enable: neither fuses here."""
    from .conftest import _register_fake_group

    g = "mptp_parity_not_enabled2"
    _register_fake_group(g, W)
    for f, args in [
        (_ag_mm(g, 0, False), (torch.rand(32, 32), torch.rand(32, 16))),
        (_mm_rs(g, 0), (torch.rand(64, 32), torch.rand(32, 16))),
    ]:
        theirs = _torch_pass(_post_grad_fx(f, *args), groups=set())
        ours, decisions = _mptp_pass(_post_grad_fx(f, *args))
        assert theirs == ours == []
        assert "not enabled" in decisions[0].detail


def test_no_all_gathers_or_reduce_scatters(fake2, caplog):
    def f(x, w):
        return torch.relu(x @ w), (x * 2).sum()

    gm = _post_grad_fx(f, torch.rand(8, 16), torch.rand(16, 4))
    code = gm.code
    with warnings.catch_warnings(), caplog.at_level("WARNING", "mptp_kernels"):
        warnings.simplefilter("error")
        assert micro_pipeline_pass(gm.graph) == 0
    assert not any("fused none" in r.getMessage() for r in caplog.records)  # nothing to fuse is not "fused none of N"
    gm.recompile()
    assert gm.code == code


def test_unsuccessful_fusion(fake2, caplog):
    """Collectives the pass cannot fuse: the graph's code is untouched and it says so, in the
    log: a warning would fail the compile of a valid program under -W error."""

    def f(x, w, b):
        A = _ag(x, 0, fake2)
        y = torch.nn.functional.linear(A, w, b)  # addmm: not fused (neither by PyTorch)
        return y, _rs(torch.relu(y), "sum", 0, fake2)  # no matmul feeds it

    args = torch.rand(8, 16), torch.rand(4, 16), torch.rand(4)
    theirs = _torch_pass(_post_grad_fx(f, *args))
    gm = _post_grad_fx(f, *args)
    code = gm.code
    with recording([]) as decisions, warnings.catch_warnings(), caplog.at_level("WARNING", "mptp_kernels"):
        warnings.simplefilter("error")
        assert micro_pipeline_pass(gm.graph) == 0
    assert any("fused none of 2" in r.getMessage() and r.levelname == "WARNING" for r in caplog.records)
    gm.recompile()
    assert theirs == [] and gm.code == code
    assert [d.fused for d in decisions] == [False, False]


# ---------------------------------------------------------------- adversarial structure


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float64])
def test_dtypes(fake2, dtype):
    for f, args in [
        (
            _ag_mm(fake2, 1, True),
            (torch.rand(2, 32, 32, dtype=dtype), torch.rand(32, 16, dtype=dtype)),
        ),
        (_mm_rs(fake2, 1), (torch.rand(2, 64, 32, dtype=dtype), torch.rand(32, 16, dtype=dtype))),
    ]:
        theirs, ours, _ = _parity(f, *args)
        assert theirs == ours and len(ours) == 1


def test_views_instead_of_reshapes(fake2):
    """Graphs that keep aten.view (no view_to_reshape, no decompositions): PyTorch's patterns
    want reshape and miss them; ours must still fuse."""

    def f(A_shard, B, X, B2):
        A = _ag(A_shard, 1, fake2)
        C = A.view(-1, 32).mm(B).view(2, 64, 16)
        return C, _rs(X.view(-1, 32).mm(B2).view(2, 64, 16), "sum", 1, fake2)

    args = torch.rand(2, 32, 32), torch.rand(32, 16), torch.rand(2, 64, 32), torch.rand(32, 16)
    _, ours, _ = _parity(f, *args, decompose=False)
    assert ours == ["fused_all_gather_matmul", "fused_matmul_reduce_scatter"]


def test_extra_users_of_intermediates(fake2):
    def ag_extra(A_shard, B):  # the gathered A and its 2-D reshape have other users
        A = _ag(A_shard, 1, fake2)
        A2 = A.reshape(-1, 32)
        return A2 @ B, A2.sum(0), A.amax()

    def rs_extra(A, B):  # the matmul result has another user: not fused (PyTorch neither)
        C = A @ B
        return _rs(C, "sum", 1, fake2), C.sum()

    def rs_reshape_extra(A, B):  # the 3-D view of the result has another user
        C = (A.reshape(-1, 32) @ B).reshape(2, 64, 16)
        return _rs(C, "sum", 1, fake2), C * 2

    theirs, ours, _ = _parity(ag_extra, torch.rand(2, 32, 32), torch.rand(32, 16))
    assert ours == ["fused_all_gather_matmul"]
    for f in (rs_extra, rs_reshape_extra):
        theirs, ours, _ = _parity(f, torch.rand(2, 64, 32), torch.rand(32, 16))
        assert theirs == ours == []


def test_symbolic_shapes_fuse_like_pytorch(fake2):
    """PyTorch fuses a dim-0 gather / scatter of a 2-D A with symbolic sizes; so do we, without a guard."""
    for f, args in [
        (_ag_mm(fake2, 0, False), (torch.rand(32, 32), torch.rand(32, 16))),
        (_ag_mm(fake2, 0, True), (torch.rand(32, 32), torch.rand(32, 16))),
        (_mm_rs(fake2, 0, "sum"), (torch.rand(64, 32), torch.rand(32, 16))),
    ]:
        gm = _post_grad_fx(f, *args, tracing_mode="symbolic")
        shape_env = next(n.meta["val"] for n in gm.graph.nodes if n.op == "placeholder").fake_mode.shape_env
        guards = len(shape_env.guards)
        ours, _ = _mptp_pass(gm)
        assert len(shape_env.guards) == guards, shape_env.guards[guards:]
        theirs, ours, _ = _parity(f, *args, tracing_mode="symbolic")
        assert len(theirs) == 1 and ours == theirs


def test_symbolic_shapes_beyond_2d_fuse_as_pytorch(fake2):
    """A 3-D A with symbolic sizes, gathered or scattered on dim 1 (its strides are symbolic):
    fused wherever PyTorch's pass fuses it (it was left alone before: a gap found by a hostile
    review), every output keeping its layout (_mptp_pass)."""
    for f, args, op in [
        (_ag_mm(fake2, 1, False), (torch.rand(2, 8, 32), torch.rand(32, 16)), "fused_all_gather_matmul"),
        (_ag_mm(fake2, 1, True), (torch.rand(2, 8, 32), torch.rand(32, 16)), "fused_all_gather_matmul"),
        (_mm_rs(fake2, 1, "sum"), (torch.rand(2, 8, 32), torch.rand(32, 16)), "fused_matmul_reduce_scatter"),
    ]:
        theirs, ours, _ = _parity(f, *args, tracing_mode="symbolic")
        assert ours == [op], (theirs, ours)


# ---------------------------------------------------------------- numerics on 2 gloo processes


def _ints(shape, seed, lo=-2, hi=3):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(lo, hi, shape, generator=g).float()


def _rand(shape, seed):
    from utils import randn

    return randn(shape, seed, scale=0.5)


def _fp32_cases(g, r):
    """(name, fn, args, collectives the pass must fuse) for PyTorch's fp32 cases, plus ours."""
    cases = []
    for A_dims, d in [(2, 0), (2, 1), (3, 0), (3, 1), (3, 2)]:
        for return_A in (True, False):
            fuses = int(d != A_dims - 1)  # (a last-dim shard's K of 16 is below 1024: not decomposed)
            f = _ag_mm(g, d, return_A)
            cases.append(
                (
                    f"ag{A_dims}d{d}A{int(return_A)}",
                    f,
                    (_rand(_shape(A_dims, d), r), _rand((32, 16), 7)),
                    fuses,
                )
            )
        cases.append(
            (
                f"rs{A_dims}d{d}",
                _mm_rs(g, d, "sum"),
                (_rand(_shape(A_dims), r + 10), _rand((32, 16), 8)),
                1,
            )
        )
    cases += [
        ("ag_view_opt", _ag_mm(g, 1, False), (_rand((1, 32, 32), r + 20), _rand((32, 16), 9)), 1),
        ("ag_slice_cat", _ag_slice_cat(g), (_rand((4, 1024), r + 30), _rand((2048, 16), 11)), 1),
        ("ag_last_K1024", _ag_mm(g, 1, False), (_rand((4, 1024), r + 70), _rand((1024 * W, 8), 15)), 1),
        ("rs_slice_cat", _rs_slice_cat(g), (_rand((16, 32), r + 40), _rand((32, 16), 12)), 1),
        ("ag_bf16", _ag_mm(g, 1, True), (_rand((2, 32, 32), r + 50).bfloat16(), _rand((32, 16), 13).bfloat16()), 1),
        ("rs_bf16", _mm_rs(g, 1, "sum"), (_rand((2, 64, 32), r + 60).bfloat16(), _rand((32, 16), 14).bfloat16()), 1),
    ]  # fmt: skip
    return cases


_ROW = cpu_rowwise_scaled_mm()  # torch 2.11's CPU _scaled_mm is tensor-wise only


def _fp8_cases(g, r, eager=False):
    """FP8 cases; eager=True sends shards as bytes everywhere (gloo cannot all-gather FP8)."""
    cases = []
    for A_dims, d in [(2, 0), (2, 1), (3, 0), (3, 1), (3, 2)]:
        last = d == A_dims - 1
        for scales in ("tensor",) if last or not _ROW else ("tensor", "row"):
            shard = _ints(_shape(A_dims, None if last else d), r * 7 + d).to(FP8)
            M = shard.numel() // 32 * (1 if last else W)
            sa = 2.0 ** _ints((M, 1), 3, -1, 2) if scales == "row" else torch.tensor(0.5)
            sb = 2.0 ** _ints((1, 16), 4, -1, 2) if scales == "row" else torch.tensor(2.0)
            B = _cm(_ints((32 * (W if last else 1), 16), 5).to(FP8))
            f = _ag_scaled_mm(
                g, d, True, as_bytes=eager or last
            )  # PyTorch's own pattern where it fuses
            cases.append((f"sag{A_dims}d{d}{scales}", f, (shard, B, sa, sb), int(not last)))
        args = (_ints(_shape(A_dims), r * 5 + d).to(FP8), _cm(_ints((32, 16), 6).to(FP8)), torch.tensor(0.5),
                torch.tensor(0.25))  # fmt: skip
        cases.append((f"srs{A_dims}d{d}", _scaled_mm_rs(g, d, "sum"), args, 1))
    for d in (0, 1) if _ROW else ():
        args = (_ints((2, 16, 32), r + d).to(FP8), _cm(_ints((32, 64), 9).to(FP8)), 2.0 ** _ints((2, 16, 1), 10, -1, 2),
                2.0 ** _ints((1, 64), 11, -1, 2))  # fmt: skip
        cases.append((f"srs_rowwise_rmr_d{d}", _reshape_mm_reshape(g, d), args, 1))
    return cases


def _ref64(fn, args):
    """fn in float64; FP8 operands travel as bytes and _scaled_mm becomes a float64 matmul of the scaled operands."""

    def as_fp8(t):
        return t.view(FP8) if t.dtype == torch.uint8 else t

    def scaled_mm(A, B, sa, sb, out_dtype=None):
        return (as_fp8(A).double() * sa.double()) @ (as_fp8(B).double() * sb.double())

    with mock.patch.object(torch, "_scaled_mm", scaled_mm):
        return fn(*[a.view(torch.uint8) if a.dtype == FP8 else a.double() for a in args])


def _compile(fn, *args, with_pass=True, **kwargs):
    """torch.compile(fn, fullgraph=True) with (or without) the pass; returns (outputs, decisions)."""
    import contextlib

    cfg = torch._inductor.config
    fast = {"force_disable_caches": True, "compile_threads": 1, "cpp.vec_isa_ok": False}
    decisions = []
    torch._dynamo.reset()
    ctx = mptp_kernels.enable_micro_pipeline_tp() if with_pass else contextlib.nullcontext()
    with cfg.patch(fast), ctx, recording(decisions), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = torch.compile(fn, fullgraph=True, **kwargs)(*args)
    return out, decisions


def _compare(name, out, eager, ref):
    """compiled vs eager: same layout; values by assert_matmul_close against float64
    (eager's error there is 0 for gathered tensors, so they must be exact); FP8 bitwise."""
    from utils import assert_matmul_close

    assert (out.shape, out.stride(), out.dtype) == (eager.shape, eager.stride(), eager.dtype), (
        f"{name}: {list(out.shape)} {out.stride()} {out.dtype} vs eager {list(eager.shape)} {eager.stride()} {eager.dtype}"
    )
    if eager.dtype == FP8:
        assert torch.equal(out.view(torch.uint8), eager.view(torch.uint8)), (
            f"{name}: differs from eager"
        )
    elif not torch.equal(out, eager):
        assert_matmul_close(out, ref, eager, what=name)


def _numerics(kind, dynamic=False):
    mptp_kernels.enable_symm_mem_for_group(dist.group.WORLD.group_name)
    g, r = dist.group.WORLD.group_name, dist.get_rank()
    cases = _fp32_cases(g, r) if kind == "fp32" else _fp8_cases(g, r)
    eager_cases = cases if kind == "fp32" else _fp8_cases(g, r, eager=True)
    if dynamic:
        cases = eager_cases = [c for c in cases if c[0] in ("ag2d0A1", "ag3d1A0", "rs2d0", "rs3d1")]

    def f(*flat):
        outs, i = [], 0
        for _, fn, args, _ in cases:
            outs.extend(fn(*flat[i : i + len(args)]))
            i += len(args)
        return outs

    compiled, decisions = _compile(f, *[a for c in cases for a in c[2]], dynamic=dynamic or None)
    errors, i = [], 0
    for (name, _, args, _), (_, fn, _, _) in zip(cases, eager_cases):
        for j, (e, ref) in enumerate(zip(fn(*args), _ref64(fn, args))):
            try:
                _compare(f"{name}[{j}]", compiled[i], e, ref)
            except AssertionError as err:
                errors.append(str(err))
            i += 1
    fused = sum(d.fused for d in decisions)
    expected = sum(c[3] for c in cases)  # dynamic: symbolic sizes fuse as static ones
    if fused != expected:
        errors.append(
            f"fused {fused} collectives, expected {expected}: {[str(d) for d in decisions]}"
        )
    return errors


def _assert_ranks_ok(results):
    failures = [f"rank {r}: {e}" for r, errs in enumerate(results) for e in errs]
    assert not failures, "\n".join(failures)


def test_compiled_numerics_fp32(workers2):
    """PyTorch's fp32 cases (test_fuse_all_gather_matmul, test_fuse_matmul_reduce_scatter, slice/cat,
    view optimization) and bf16 ones, compiled in one graph with the pass: equal to eager."""
    _assert_ranks_ok(workers2.run(_numerics, "fp32", timeout_s=300, crash_retries=1))


def test_compiled_numerics_fp8(workers2):
    """test_fuse_all_gather_scaled_matmul (tensor- and row-wise scales, PyTorch's _fp8_all_gather
    form), test_fuse_scaled_matmul_reduce_scatter and its row-wise reshape -> mm -> reshape case."""
    _assert_ranks_ok(workers2.run(_numerics, "fp8", timeout_s=300, crash_retries=1))


def test_compiled_numerics_dynamic(workers2):
    """dynamic=True: the 2-D dim-0 cases and the 3-D dim-1 ones fuse; values equal eager."""
    _assert_ranks_ok(workers2.run(_numerics, "fp32", True, timeout_s=300, crash_retries=1))


def _dynamic_rows():
    """One dynamic compile serves every row count: fused once, equal to eager at each M."""
    from utils import assert_matmul_close

    mptp_kernels.enable_symm_mem_for_group(dist.group.WORLD.group_name)
    g, r = dist.group.WORLD.group_name, dist.get_rank()

    def f(x, w1, w2):
        h = _ag(x, 0, g) @ w1  # column-parallel
        return _rs(h @ w2, "sum", 0, g)  # row-parallel

    w1, w2 = _rand((32, 24), 7), _rand((24, 16), 8)
    cfg = torch._inductor.config
    fast = {"force_disable_caches": True, "compile_threads": 1, "cpp.vec_isa_ok": False}
    decisions, errors = [], []
    torch._dynamo.reset()
    with cfg.patch(fast), mptp_kernels.enable_micro_pipeline_tp(), recording(decisions):
        cf = torch.compile(f, fullgraph=True, dynamic=True)
        for M in (4, 6, 10):
            x = _rand((M, 32), 100 * M + r)
            out, eager = cf(x, w1, w2), f(x, w1, w2)
            ref = f(x.double(), w1.double(), w2.double())
            try:
                assert out.shape == eager.shape == (M, 16)
                assert_matmul_close(out, ref, eager, what=f"M={M}")
            except AssertionError as e:
                errors.append(str(e))
    fused = [str(d) for d in decisions if d.fused]
    if len(fused) != 2 or len(decisions) != 2:  # one compile, both collectives fused
        errors.append(f"expected one compile fusing both collectives: {[str(d) for d in decisions]}")
    return errors


def test_one_dynamic_compile_fuses_every_row_count(workers2):
    _assert_ranks_ok(workers2.run(_dynamic_rows, timeout_s=300, crash_retries=1))


def _seq_par():
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    mesh = init_device_mesh("cpu", (W,))
    mptp_kernels.enable_symm_mem_for_group(mesh.get_group().group_name)

    def model(shard_dim, dtype):
        torch.manual_seed(0)
        # PyTorch's MLPModule (common_dtensor), bias=False; that module needs expecttest to import.
        m = torch.nn.Sequential()
        m.add_module("net1", torch.nn.Linear(10, 16, bias=False))
        m.add_module("relu", torch.nn.ReLU())
        m.add_module("net2", torch.nn.Linear(16, 10, bias=False))
        m = m.to(dtype)
        plan = {"net1": ColwiseParallel(input_layouts=Shard(shard_dim)),
                "net2": RowwiseParallel(output_layouts=Shard(shard_dim))}  # fmt: skip
        return parallelize_module(m, mesh, plan)

    r = dist.get_rank()
    x0, x1 = _rand((8, 10), r), _rand((2, 8, 10), r + 1)
    m0, m1 = model(0, torch.float32), model(1, torch.float32)

    def both(x0, x1):
        return m0(x0), m1(x1)

    local = lambda t: t.to_local() if hasattr(t, "to_local") else t  # noqa: E731
    with torch.no_grad():
        eager = [local(t) for t in both(x0, x1)]
        ref = [
            local(t)
            for t in (model(0, torch.float64)(x0.double()), model(1, torch.float64)(x1.double()))
        ]
        compiled, decisions = _compile(both, x0, x1)
    errors = []
    for name, out, e, r64 in zip(("shard_dim0", "shard_dim1"), compiled, eager, ref):
        try:
            _compare(name, local(out), e, r64)
        except AssertionError as err:
            errors.append(str(err))
    kinds = [(d.kind, d.fused) for d in decisions]
    if kinds != [("all-gather", True)] * 2 + [("reduce-scatter", True)] * 2:
        errors.append(f"decisions: {[str(d) for d in decisions]}")
    return errors


def test_dtensor_seq_par(workers2):
    """PyTorch's DTensor sequence-parallel MLP (shard_dim 0 and 1): both collectives of each fused."""
    _assert_ranks_ok(workers2.run(_seq_par, timeout_s=300, crash_retries=1))


def _toggle_and_cache(cache_dir):
    """Compiles one function several times in one process: pass on, off, on again, with the FX
    graph cache on; a compile without the pass must never be served a graph made with it, nor
    the other way round, and every result equals eager."""
    import os

    from torch._dynamo.utils import counters
    from torch._inductor.utils import run_and_get_code

    g, r = dist.group.WORLD.group_name, dist.get_rank()
    mptp_kernels.enable_symm_mem_for_group(g)
    fn = _ag_mm(g, 1, False)
    args = (_rand((2, 32, 32), r), _rand((32, 16), 3))
    (eager,) = fn(*args)
    cfg = torch._inductor.config
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(cache_dir, f"rank{r}")
    cache = {
        "fx_graph_cache": True,
        "force_disable_caches": False,
        "compile_threads": 1,
        "cpp.vec_isa_ok": False,
    }
    errors, seen = [], []
    for step, with_pass in enumerate((True, False, True, False)):
        torch._dynamo.reset()
        counters.clear()
        with cfg.patch(cache), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            if with_pass:
                with mptp_kernels.enable_micro_pipeline_tp():
                    (out,), code = run_and_get_code(torch.compile(fn, fullgraph=True), *args)
            else:
                (out,), code = run_and_get_code(torch.compile(fn, fullgraph=True), *args)
        c = counters["inductor"]
        seen.append((with_pass, c["fxgraph_cache_hit"], c["fxgraph_cache_miss"]))
        code = "\n".join(code)
        if ("mptp.fused_all_gather_matmul" in code) != with_pass:
            errors.append(
                f"step {step} (pass {'on' if with_pass else 'off'}): wrong graph served\n{seen}"
            )
        if not torch.allclose(out, eager, rtol=1e-5, atol=1e-5):  # fp32, K = 32, O(1) values
            errors.append(f"step {step}: differs from eager")
    if [h for _, h, _ in seen[2:]] != [1, 1]:  # the later compiles hit their own earlier entries
        errors.append(f"expected cache hits on the repeated compiles: {seen}")
    assert micro_pipeline._sinks == []
    return errors


def test_pass_toggled_between_compiles_with_fx_graph_cache(workers2, tmp_path):
    _assert_ranks_ok(workers2.run(_toggle_and_cache, str(tmp_path), timeout_s=300, crash_retries=1))
