"""The FX pass on graphs traced with make_fx (fake tensors: no communication).

Structure tests trace with world size 4 on a fake (non-communicating) group and
check which ops the pass emits and that every graph output keeps its shape,
strides and dtype; the numeric checks trace with the real (world size 1, gloo)
group and run the graph before and after the pass. Differential numerics on 2
processes live in test_differential.py.
"""

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx
from torch.utils._pytree import tree_leaves
from utils import cpu_rowwise_scaled_mm

import mptp_kernels
from mptp_kernels.compile import micro_pipeline
from mptp_kernels.compile.micro_pipeline import micro_pipeline_pass

c10d = torch.ops._c10d_functional
aten = torch.ops.aten
mptp = torch.ops.mptp
FP8 = torch.float8_e4m3fn
W4 = 4


@pytest.fixture
def group(pg1):
    mptp_kernels.enable_symm_mem_for_group(pg1)
    yield pg1


def _ag(x, W, g, dim=0):
    """What funcol.all_gather_tensor traces to (split/cat for dim > 0)."""
    out = c10d.wait_tensor(c10d.all_gather_into_tensor(x.contiguous(), W, g))
    if dim == 0:
        return out
    return torch.cat(torch.split(out, x.shape[0], 0), dim=dim)


def _rs(x, W, g, dim=0, op="sum"):
    if dim != 0:
        x = torch.cat(torch.split(x, x.shape[dim] // W, dim), 0)
    return c10d.wait_tensor(c10d.reduce_scatter_tensor(x.contiguous(), op, W, g))


def _targets(gm):
    return [n.target for n in gm.graph.nodes if n.op == "call_function"]


def _trace(fn, *args):
    return make_fx(fn, tracing_mode="fake")(*args)


def _layouts(gm):
    out = next(n for n in gm.graph.nodes if n.op == "output")
    return [
        (tuple(v.shape), tuple(v.stride()), v.dtype)
        for v in (a.meta["val"] for a in tree_leaves(out.args))
    ]


def _run_pass(gm):
    """Runs the pass; asserts every graph output kept its shape, strides and dtype."""
    before = _layouts(gm)
    n = micro_pipeline_pass(gm.graph)
    gm.recompile()
    assert _layouts(gm) == before, "the pass changed an output's layout"
    return n


def _fused(gm, op):
    return [n for n in gm.graph.nodes if n.target is op.default]


def _check_numerics(fn, args, expect_fused=1):
    gm = _trace(fn, *args)
    ref = gm(*args)
    assert _run_pass(gm) == expect_fused
    out = gm(*args)
    for r, o in zip(tree_leaves(ref), tree_leaves(out)):
        assert o.shape == r.shape and o.stride() == r.stride()
        torch.testing.assert_close(o.float(), r.float(), rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------- all-gather


def test_all_gather_dim0_two_mms_one_fused_call(fake4):
    def f(shard, B1, B2):
        A = _ag(shard, W4, fake4)
        return torch.mm(A, B1), torch.mm(A, B2)

    gm = _trace(f, torch.randn(8, 16), torch.randn(16, 4), torch.randn(16, 6))
    assert _run_pass(gm) == 1
    t = _targets(gm)
    assert t.count(mptp.fused_all_gather_matmul.default) == 1
    assert c10d.all_gather_into_tensor.default not in t and aten.mm.default not in t
    (fused,) = _fused(gm, mptp.fused_all_gather_matmul)
    assert fused.kwargs["return_A"] is False, "nothing else uses A_full"
    assert len(fused.args[1]) == 2


def test_unfused_all_gather_names_the_op_behind_the_reshape(fake4):
    """nn.Linear with a bias on 3-D input: the reason names the addmm the reshape feeds, not the
    reshape (found by a hostile review: the message said "its users: ['aten.reshape.default']")."""

    def f(shard, W_, b):
        return torch.nn.functional.linear(_ag(shard, W4, fake4), W_, b)

    gm = _trace(f, torch.randn(2, 4, 16), torch.randn(8, 16), torch.randn(8))
    log = []
    with micro_pipeline.recording(log):
        assert _run_pass(gm) == 0
    detail = " ".join(str(d) for d in log)
    assert "aten.addmm.default" in detail and "aten.reshape" not in detail.split("it reaches:")[-1], detail


def test_all_gather_result_used_elsewhere_keeps_return_A(fake4):
    def f(shard, B):
        A = _ag(shard, W4, fake4)
        return torch.mm(A, B), A.sum()

    gm = _trace(f, torch.randn(8, 16), torch.randn(16, 4))
    assert _run_pass(gm) == 1
    (fused,) = _fused(gm, mptp.fused_all_gather_matmul)
    assert fused.kwargs["return_A"] is True


@pytest.mark.parametrize("gather_dim", [0, 1, 2])
def test_all_gather_3d_matmul(fake4, gather_dim):
    def f(shard, B):
        return torch.matmul(_ag(shard, W4, fake4, gather_dim), B)

    k = 1024 if gather_dim == 2 else 16  # a last-dim gather is decomposed from K = 1024 (as PyTorch)
    K = k * (W4 if gather_dim == 2 else 1)
    gm = _trace(f, torch.randn(2, 3, k), torch.randn(K, 4))
    assert _run_pass(gm) == 1
    t = _targets(gm)
    assert aten.mm.default not in t and aten.cat.default not in t and aten.split.Tensor not in t
    (fused,) = _fused(gm, mptp.fused_all_gather_matmul)
    assert fused.args[2] == gather_dim
    # The shard is restrided so that gather_dim is outermost (not for the last dim: the op cats along K).
    restrided = fused.args[0].target is torch.ops.prims.inductor_force_stride_order.default
    assert restrided == (gather_dim == 1)


@pytest.mark.parametrize("A_dims", [2, 3])
@pytest.mark.parametrize("k", [16, 1023, 1024])
def test_all_gather_last_dim_fused_from_K_1024(fake4, A_dims, k):
    """As PyTorch's pass and its test_fuse_all_gather_matmul: a gather of the last (K) dim is
    decomposed only where the shard's K is at least 1024; below, it stays a plain all-gather."""

    def f(shard, B):
        return torch.matmul(_ag(shard, W4, fake4, A_dims - 1), B)

    shard = torch.randn(*([2] * (A_dims - 1)), k)
    gm = _trace(f, shard, torch.randn(k * W4, 4))
    fused = _run_pass(gm)
    assert fused == (1 if k >= 1024 else 0)
    t = _targets(gm)
    assert (mptp.fused_all_gather_matmul.default in t) == (k >= 1024)
    assert (c10d.all_gather_into_tensor.default in t) == (k < 1024)


# The three cases of issue 11 item 1: the output regroups A's leading dims.
def _sp_regroup(g, W):
    def f(x, w):  # x [B, S/W, D] sequence-sharded; out [B, S, H, Dh]
        A = _ag(x, W, g, 1)
        return (A.flatten(0, 1) @ w).view(A.shape[0], A.shape[1], 4, 4)

    return f, (torch.randn(2, 4, 32), torch.randn(32, 16))


def _ag_regroup(g, W):
    def f(x, B):  # all-gather [4, 16, 32] on dim 0 (to [4W, 16, 32]), out regrouped to [8W, 8, 16]
        return (_ag(x, W, g, 0).reshape(-1, 32) @ B).reshape(8 * W, 8, 16)

    return f, (torch.randn(4, 16, 32), torch.randn(32, 16))


def _rs_regroup(g, W):
    def f(x, B):  # [4, 16, 32] -> mm -> [8, 8, 16] -> reduce-scatter dim 0
        return _rs((x.reshape(-1, 32) @ B).reshape(8, 8, 16), W, g, 0)

    return f, (torch.randn(4, 16, 32), torch.randn(32, 16))


@pytest.mark.parametrize("case", [_sp_regroup, _ag_regroup, _rs_regroup], ids=lambda c: c.__name__)
def test_issue_item1_regrouped_leading_dims(fake4, group, case):
    f, args = case(fake4, W4)
    gm = _trace(f, *args)
    assert _run_pass(gm) == 1  # fused, and every output kept its shape and strides
    f1, args1 = case(group, 1)
    _check_numerics(f1, args1)


@pytest.mark.parametrize(
    "form", ["view", "flatten_unflatten", "reshape_chain", "squeeze_unsqueeze"]
)
def test_all_gather_reshape_forms(fake4, form):
    def f(x, B):
        A = _ag(x, W4, fake4, 0)  # [8, 4, 16]
        if form == "view":
            return A.view(-1, 16).mm(B).view(8, 4, 6)
        if form == "flatten_unflatten":
            return A.flatten(0, 1).mm(B).unflatten(0, (2, 16))
        if form == "reshape_chain":  # the last dim changes on the way and comes back
            return A.reshape(8, 64).reshape(32, 16).mm(B).reshape(-1)
        return A.unsqueeze(0).reshape(1, 32, 16).squeeze(0).mm(B)

    gm = _trace(f, torch.randn(2, 4, 16), torch.randn(16, 6))
    assert _run_pass(gm) == 1
    assert aten.mm.default not in _targets(gm)


def test_all_gather_bmm_with_broadcast_B(fake4):
    def f(x, w):
        A = _ag(x, W4, fake4, 1)  # [2, 12, 16]
        return torch.bmm(A, w.expand(2, 16, 8)), torch.matmul(A, w.unsqueeze(0))

    gm = _trace(f, torch.randn(2, 3, 16), torch.randn(16, 8))
    assert _run_pass(gm) == 1
    (fused,) = _fused(gm, mptp.fused_all_gather_matmul)
    assert len(fused.args[1]) == 2
    assert aten.bmm.default not in _targets(gm)


def test_all_gather_bmm_with_batched_B_not_fused(fake4):
    def f(x, w):
        return torch.bmm(_ag(x, W4, fake4, 0), w)

    gm = _trace(f, torch.randn(1, 3, 16), torch.randn(4, 16, 8))
    assert _run_pass(gm) == 0


def test_batch1_sequence_gather_as_view_chain(fake4):
    """What Inductor leaves of a batch-1 gather on dim 1: wait -> view [1, S, D] -> view [S, D] -> mm."""

    def f(x, w):
        A = c10d.wait_tensor(c10d.all_gather_into_tensor(x, W4, fake4))  # [W, s, D]
        return (A.view(1, -1, 16).view(-1, 16) @ w).view(1, -1, 8)

    gm = _trace(f, torch.randn(1, 3, 16), torch.randn(16, 8))
    assert _run_pass(gm) == 1
    (fused,) = _fused(gm, mptp.fused_all_gather_matmul)
    assert fused.args[2] == 0


def test_all_gather_transposed_before_matmul_not_fused(fake4):
    def f(x, w):
        return _ag(x, W4, fake4, 1).transpose(0, 1).reshape(-1, 16) @ w

    gm = _trace(f, torch.randn(2, 3, 16), torch.randn(16, 8))
    assert _run_pass(gm) == 0


def test_all_gather_last_dim_with_other_users_not_fused(fake4):
    def f(x, w):
        A = _ag(x, W4, fake4, 1)  # [4, 64], K gathered
        return A @ w, A.sum()

    gm = _trace(f, torch.randn(4, 16), torch.randn(64, 8))
    assert _run_pass(gm) == 0


def test_all_gather_type_erased_fp8_scaled(fake4):
    def f(shard, B, sa, sb):
        A = _ag(shard.view(torch.uint8), W4, fake4).view(FP8)  # fp8 travels as bytes
        return torch._scaled_mm(A, B, sa, sb, out_dtype=torch.bfloat16)

    shard, B = torch.randn(8, 32).to(FP8), torch.randn(16, 32).to(FP8).t()
    gm = _trace(f, shard, B, torch.tensor(1.0), torch.tensor(1.0))
    assert _run_pass(gm) == 1
    t = _targets(gm)
    assert mptp.fused_all_gather_scaled_matmul.default in t and aten._scaled_mm.default not in t


def test_all_gather_type_erased_fp8_dim1_3d(fake4):
    def f(shard, B, sa, sb):
        raw = shard.view(torch.uint8)
        out = c10d.wait_tensor(c10d.all_gather_into_tensor(raw.contiguous(), W4, fake4))
        A = torch.cat([p.view(FP8) for p in torch.split(out, raw.shape[0], 0)], dim=1)
        return torch._scaled_mm(A.reshape(-1, 32), B, sa, sb, out_dtype=torch.bfloat16).reshape(
            2, 12, 16
        )

    gm = _trace(
        f,
        torch.randn(2, 3, 32).to(FP8),
        torch.randn(16, 32).to(FP8).t(),
        torch.tensor(1.0),
        torch.tensor(1.0),
    )
    assert _run_pass(gm) == 1
    (fused,) = _fused(gm, mptp.fused_all_gather_scaled_matmul)
    assert fused.args[4] == 1


@pytest.mark.parametrize("viewed", [(0,), (3,), (1, 2), (0, 1, 2, 3)])
@pytest.mark.parametrize("gather_dim", [0, 1])
def test_all_gather_pieces_viewed_unalike_not_fused(fake4, viewed, gather_dim):
    """Found by a hostile review: int32 pieces, some viewed as float32, the rest promoted by the
    cat (their values converted, not their bytes): the pass fused them as if every piece were
    viewed. Fused only where every piece is viewed alike (here: all four)."""

    def f(shard, B):
        out = c10d.wait_tensor(c10d.all_gather_into_tensor(shard.contiguous(), W4, fake4))
        pieces = [p.view(torch.float32) if i in viewed else p for i, p in enumerate(torch.split(out, 2, 0))]
        return torch.cat(pieces, dim=gather_dim) @ B

    shard = torch.randn(2, 8) if gather_dim == 0 else torch.randn(2, 3, 8)  # gather_dim 1: 3-D
    _check_numerics(f, (shard.view(torch.int32).clone(), torch.randn(8, 5)),
                    expect_fused=1 if len(viewed) == W4 else 0)  # fmt: skip


def test_scaled_all_gather_last_dim_not_fused(fake4):
    def f(shard, B, sa, sb):
        A = _ag(shard, W4, fake4, 1)
        return torch._scaled_mm(A, B, sa, sb, out_dtype=torch.bfloat16)

    gm = _trace(
        f,
        torch.randn(16, 16).to(FP8),
        torch.randn(16, 64).to(FP8).t(),
        torch.tensor(1.0),
        torch.tensor(1.0),
    )
    assert _run_pass(gm) == 0


# ---------------------------------------------------------------- reduce-scatter


@pytest.mark.parametrize("scatter_dim", [0, 1, 2])
def test_reduce_scatter_3d(fake4, scatter_dim):
    def f(A, B):
        return _rs(torch.matmul(A, B), W4, fake4, scatter_dim)

    gm = _trace(f, torch.randn(4, 8, 16), torch.randn(16, 8))
    assert _run_pass(gm) == 1
    t = _targets(gm)
    assert c10d.reduce_scatter_tensor.default not in t and aten.mm.default not in t
    (fused,) = _fused(gm, mptp.fused_matmul_reduce_scatter)
    assert fused.args[3] == scatter_dim


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("op", ["sum", "avg"])
def test_reduce_scatter_avg_of_integers_not_fused(fake4, dtype, op):
    """gloo's "avg" of integers raises where the op truncates (found by a hostile review): the pass
    leaves an integer average to the graph, and fuses the rest."""

    def f(A, B):
        return _rs(A @ B, W4, fake4, 0, op)

    A, B = (torch.randint(-3, 4, (8, 16)), torch.randint(-3, 4, (16, 8))) if not dtype.is_floating_point else (
        torch.randn(8, 16), torch.randn(16, 8))  # fmt: skip
    gm = _trace(f, A.to(dtype), B.to(dtype))
    integer_avg = op == "avg" and not dtype.is_floating_point
    log = []
    with micro_pipeline.recording(log):
        assert _run_pass(gm) == (0 if integer_avg else 1)
    if integer_avg:
        assert c10d.reduce_scatter_tensor.default in _targets(gm)
        assert any("'avg' of" in str(r) for r in log), log


def test_reduce_scatter_last_dim_2d_slices(fake4):
    """The slice/cat form of the reassembly (what some torch versions emit)."""

    def f(A, B):
        C = A @ B  # [8, 16]
        x = torch.cat([C[:, i * 4 : (i + 1) * 4] for i in range(W4)], 0)
        return c10d.wait_tensor(c10d.reduce_scatter_tensor(x, "sum", W4, fake4))

    gm = _trace(f, torch.randn(8, 16), torch.randn(16, 16))
    assert _run_pass(gm) == 1
    (fused,) = _fused(gm, mptp.fused_matmul_reduce_scatter)
    assert fused.args[3] == 1


def test_reduce_scatter_pieces_out_of_order_not_fused(fake4):
    def f(A, B):
        C = A @ B
        x = torch.cat(
            list(reversed(torch.split(C, 4, 1))), 0
        )  # not what a reduce-scatter on dim 1 sends
        return c10d.wait_tensor(c10d.reduce_scatter_tensor(x, "sum", W4, fake4))

    gm = _trace(f, torch.randn(8, 16), torch.randn(16, 16))
    assert _run_pass(gm) == 0


def test_reduce_scatter_2d_and_result_saved_for_output(fake4):
    def f(A, B):
        out = _rs(torch.mm(A, B), W4, fake4)
        return out, out * 2  # the result feeds the output too (e.g. saved for backward)

    gm = _trace(f, torch.randn(8, 16), torch.randn(16, 6))
    assert _run_pass(gm) == 1


def test_reduce_scatter_bmm_with_broadcast_B(fake4):
    def f(A, w):
        return _rs(torch.bmm(A, w.expand(4, 16, 8)), W4, fake4, 1)

    gm = _trace(f, torch.randn(4, 8, 16), torch.randn(16, 8))
    assert _run_pass(gm) == 1


def test_reduce_scatter_regrouped_across_N_not_fused(fake4):
    def f(A, B):
        return _rs((A @ B).reshape(8, 4, 4), W4, fake4, 0)  # N = 16 split into [4, 4]

    gm = _trace(f, torch.randn(8, 16), torch.randn(16, 16))
    assert _run_pass(gm) == 0


def test_reduce_scatter_transposed_not_fused(fake4):
    def f(A, B):
        return _rs((A @ B).t(), W4, fake4, 0)

    gm = _trace(f, torch.randn(8, 16), torch.randn(16, 16))
    assert _run_pass(gm) == 0


def test_scaled_reduce_scatter(fake4):
    def f(A, B, sa, sb):
        return _rs(torch._scaled_mm(A, B, sa, sb, out_dtype=torch.bfloat16), W4, fake4)

    gm = _trace(
        f,
        torch.randn(8, 32).to(FP8),
        torch.randn(16, 32).to(FP8).t(),
        torch.tensor(1.0),
        torch.tensor(1.0),
    )
    assert _run_pass(gm) == 1
    assert mptp.fused_scaled_matmul_reduce_scatter.default in _targets(gm)


@pytest.mark.parametrize("scatter_dim", [0, 1, 2])
def test_scaled_reduce_scatter_3d_reshape(fake4, group, scatter_dim):
    def f(A, B, sa, sb, W, g):
        C = torch._scaled_mm(A.reshape(-1, 32), B, sa, sb, out_dtype=torch.bfloat16).reshape(
            4, 8, 16
        )
        return _rs(C, W, g, scatter_dim)

    args = (
        torch.randn(4, 8, 32).to(FP8),
        torch.randn(16, 32).to(FP8).t(),
        torch.tensor(1.0),
        torch.tensor(1.0),
    )
    gm = _trace(lambda *a: f(*a, W4, fake4), *args)
    assert _run_pass(gm) == 1
    (fused,) = _fused(gm, mptp.fused_scaled_matmul_reduce_scatter)
    assert fused.args[5] == scatter_dim and list(fused.args[8]) == [4, 8, 16]
    _check_numerics(lambda *a: f(*a, 1, group), args)


# ---------------------------------------------------------------- negatives and bookkeeping


def test_negative_mixed_matmul_kinds(fake4):
    shard = torch.randn(8, 32).to(FP8)

    def g(shard, B, sa, sb):
        A = _ag(shard, W4, fake4)
        return torch.mm(A.float(), B.float()), torch._scaled_mm(
            A, B, sa, sb, out_dtype=torch.bfloat16
        )

    gm = _trace(g, shard, torch.randn(16, 32).to(FP8).t(), torch.tensor(1.0), torch.tensor(1.0))
    assert (
        _run_pass(gm) == 1
    )  # A.float() is no reshape: the mm is no consumer; the _scaled_mm fuses


def test_negative_B_depends_on_collective(fake4):
    def f(shard):
        A = _ag(shard, W4, fake4)
        return torch.mm(A, A[:16].t())

    gm = _trace(f, torch.randn(8, 16))
    assert _run_pass(gm) == 0


def test_B_depending_on_collective_only_drops_that_matmul(fake4):
    def f(shard, B):
        A = _ag(shard, W4, fake4)
        return torch.mm(A, A[:16].t()), torch.mm(A, B)

    gm = _trace(f, torch.randn(8, 16), torch.randn(16, 4))
    assert _run_pass(gm) == 1
    (fused,) = _fused(gm, mptp.fused_all_gather_matmul)
    assert len(fused.args[1]) == 1 and fused.kwargs["return_A"] is True


def test_negative_matmul_result_has_other_users(fake4):
    def f(A, B):
        C = torch.mm(A, B)
        return _rs(C, W4, fake4), C.sum()

    gm = _trace(f, torch.randn(8, 16), torch.randn(16, 8))
    assert _run_pass(gm) == 0


def test_negative_group_not_enabled(fake4):
    def f(shard, B):
        return torch.mm(_ag(shard, 1, "not-enabled-group"), B)

    gm = _trace(f, torch.randn(8, 16), torch.randn(16, 4))
    assert _run_pass(gm) == 0


def test_negative_group_size_differs_from_the_graph(group):
    def f(shard, B):
        return torch.mm(_ag(shard, 4, group), B)  # traced for 4 ranks, the group has 1

    gm = _trace(f, torch.randn(8, 16), torch.randn(16, 4))
    with micro_pipeline.recording([]) as decisions:
        assert _run_pass(gm) == 0
    assert not decisions[0].fused and "spans 4 ranks" in decisions[0].detail


def test_reorder_one_matmul_hides_one_collective(fake4):
    """PyTorch's rule: X @ Y hides one collective, the second all-gather stays exposed and is fused."""

    def f(shard, B1, B2, X, Y):
        C1 = torch.mm(_ag(shard, W4, fake4), B1)  # [32, 8]
        C2 = torch.mm(_ag(C1, W4, fake4), B2)  # depends on the first
        return C2, torch.mm(X, Y)

    args = (
        torch.randn(8, 16),
        torch.randn(16, 8),
        torch.randn(8, 4),
        torch.randn(8, 8),
        torch.randn(8, 8),
    )
    gm = _trace(f, *args)
    with torch._inductor.config.patch(reorder_for_compute_comm_overlap=True):
        with micro_pipeline.recording([]) as decisions:
            assert _run_pass(gm) == 1
    assert [d.fused for d in decisions] == [False, True]
    assert "hides" in decisions[0].detail
    gm = _trace(f, *args)
    assert _run_pass(gm) == 2  # without reordering, both


def test_late_B_ancestors_move_above_the_fused_node(fake4):
    def f(shard, W):
        A = _ag(shard, W4, fake4)
        B = (W * 2).t()  # traced after the all-gather
        return torch.mm(A, B)

    gm = _trace(f, torch.randn(8, 16), torch.randn(4, 16))
    assert _run_pass(gm) == 1
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    (fused,) = _fused(gm, mptp.fused_all_gather_matmul)
    for n in gm.graph.nodes:
        if n.target in (aten.mul.Tensor, aten.t.default, aten.permute.default):
            assert order[n] < order[fused]
    gm.graph.lint()


def test_symm_mem_nodes_are_retargeted(group):
    import torch.distributed._symmetric_memory  # noqa: F401

    def f(shard, B):
        return torch.ops.symm_mem.fused_all_gather_matmul(shard, [B], 0, group)[1][0]

    gm = _trace(f, torch.randn(8, 16), torch.randn(16, 4))
    assert _run_pass(gm) == 1
    t = _targets(gm)
    assert mptp.fused_all_gather_matmul.default in t
    assert torch.ops.symm_mem.fused_all_gather_matmul.default not in t


@pytest.mark.parametrize("dim", [0, 1, 2])
def test_numerics_unchanged_world_size_1(group, dim):
    def f(shard, B, A2, B2):
        x = torch.matmul(_ag(shard, 1, group, dim), B)
        y = _rs(torch.matmul(A2, B2), 1, group, dim)
        return x, y

    k = 1024 if dim == 2 else 16  # a last-dim gather is decomposed from K = 1024 (as PyTorch)
    _check_numerics(
        f, (torch.randn(2, 3, k), torch.randn(k, 4), torch.randn(2, 4, 8), torch.randn(8, 5)), 2
    )


@pytest.mark.skipif(not cpu_rowwise_scaled_mm(), reason="this torch's CPU _scaled_mm takes tensor-wise scales only")
def test_scaled_all_gather_3d_row_wise_scale_numerics(group):
    def f(shard, B, sa, sb):
        A = _ag(shard.view(torch.uint8), 1, group).view(FP8)
        return torch._scaled_mm(A.reshape(-1, 32), B, sa, sb, out_dtype=torch.bfloat16).reshape(
            2, 3, 16
        )

    args = (
        torch.randn(2, 3, 32).to(FP8),
        torch.randn(16, 32).to(FP8).t(),
        torch.rand(6, 1) + 0.5,
        torch.rand(1, 16) + 0.5,
    )
    _check_numerics(f, args)


# ---------------------------------------------------------------- collective order
# Ranks pair collectives by the order they issue them, and the pass decides per rank: it must
# never reorder two collectives of a graph (found by a hostile review: with one rank fusing,
# the ranks' collectives paired crosswise, silently).


def _issue_order(gm):
    return [
        n.target
        for n in gm.graph.nodes
        if n.op == "call_function"
        and getattr(n.target, "namespace", None) in ("_c10d_functional", "mptp")
        and n.target is not c10d.wait_tensor.default
    ]


@pytest.mark.parametrize("B_first", [False, True])
def test_a_collective_B_depends_on_never_moves_above_the_gather(fake4, B_first):
    """B gathered after A: fusing would move B's gather above A's, so the pass leaves it; B
    gathered first: nothing moves, and A's gather fuses in place."""

    def f(shard, wsh):
        B = _ag(wsh, W4, fake4) if B_first else None
        A = _ag(shard, W4, fake4)
        return torch.mm(A, B if B_first else _ag(wsh, W4, fake4))

    gm = _trace(f, torch.randn(8, 16), torch.randn(4, 8))
    assert _run_pass(gm) == int(B_first)
    second = mptp.fused_all_gather_matmul.default if B_first else c10d.all_gather_into_tensor.default
    assert _issue_order(gm) == [c10d.all_gather_into_tensor.default, second]


def test_fused_reduce_scatter_is_issued_where_the_reduce_scatter_was(fake4):
    def waited_after_another(x, w, z):
        r1 = c10d.reduce_scatter_tensor(x @ w, "sum", W4, fake4)
        r2 = c10d.wait_tensor(c10d.reduce_scatter_tensor(z, "sum", W4, fake4))
        return c10d.wait_tensor(r1), r2

    gm = _trace(waited_after_another, torch.randn(16, 8), torch.randn(8, 4), torch.randn(16, 4))
    assert _run_pass(gm) == 1
    assert _issue_order(gm) == [mptp.fused_matmul_reduce_scatter.default, c10d.reduce_scatter_tensor.default]


@torch.library.custom_op("mptp_test::maybe_communicates", mutates_args=())
def _maybe_communicates(x: torch.Tensor) -> torch.Tensor:
    """Stands for a custom op that may run a collective (vllm::all_reduce, a user's dist.* op)."""
    return x.clone()


@_maybe_communicates.register_fake
def _(x):
    return torch.empty_like(x)


@pytest.mark.parametrize("before", [False, True])
def test_a_custom_op_B_depends_on_never_moves_above_the_gather(fake4, before):
    """Found by a hostile review: only known collective namespaces were kept in place, so a custom
    op that communicates moved above the gather on the rank that fused (a deadlock with a rank
    that did not). Any op not known to compute locally now stays where it is."""

    def f(shard, w):
        if before:
            B = torch.ops.mptp_test.maybe_communicates(w)
        A = _ag(shard, W4, fake4)
        if not before:
            B = torch.ops.mptp_test.maybe_communicates(w)
        return torch.mm(A, B)

    gm = _trace(f, torch.randn(8, 16), torch.randn(16, 4))
    assert _run_pass(gm) == (1 if before else 0)


def test_cpp_wrapper_leaves_all_gathers_alone(fake4):
    """Found by a hostile review: under cpp_wrapper the graph with a fused all-gather-matmul failed
    to compile (its C++ fallback kernels return tensors only, the op a list). The all-gather stays
    unfused there; the reduce-scatter (one tensor) still fuses."""

    def f(shard, B, x, w):
        return torch.mm(_ag(shard, W4, fake4), B), _rs(x @ w, W4, fake4)

    gm = _trace(f, torch.randn(8, 16), torch.randn(16, 4), torch.randn(16, 8), torch.randn(8, 4))
    with torch._inductor.config.patch(cpp_wrapper=True):
        assert _run_pass(gm) == 1
    assert _fused(gm, mptp.fused_matmul_reduce_scatter) and not _fused(gm, mptp.fused_all_gather_matmul)


def _code_issue_order(code: str) -> list:
    call = code[code.index("def call(") :]
    return [line.strip().split("(")[0].split("= ")[-1] for line in call.splitlines()
            if ("_c10d_functional." in line or "mptp." in line) and "wait_tensor" not in line
            and "assert" not in line and not line.strip().startswith("#")]  # fmt: skip


@pytest.mark.parametrize("case", ["ag_before_all_reduce", "all_reduce_before_rs"])
def test_compiled_code_issues_the_fused_op_where_the_collective_was(pg1, case):
    """Found by a hostile review: Inductor's peak-memory reordering moved the fused op (a plain
    fallback kernel to it) past independent collectives, which Inductor keeps in program order
    among themselves: a fused all-gather sank below a later all_reduce, a fused reduce-scatter
    rose above an earlier one. Ranks fusing differently then deadlocked (test_rank_divergent)."""
    import torch.distributed._functional_collectives as funcol
    from torch._inductor.utils import run_and_get_code

    g = pg1
    mptp_kernels.enable_symm_mem_for_group(g)

    def ag_before_all_reduce(x, B, y):
        h = funcol.all_gather_tensor(x, 0, g) @ B  # large output, used late
        z = funcol.all_reduce(y, "sum", g)
        return h.sum() + z.sum()

    def all_reduce_before_rs(x, B, y):
        z = funcol.all_reduce(y * 3, "sum", g)  # large temporary, live until the all_reduce
        out = funcol.reduce_scatter_tensor(x @ B, "sum", 0, g)
        return z.sum() + out.sum()

    # NOTE: integer values (-1, 0, 1) and exact elementwise ops only: every product is an integer,
    # and a partial sum of n of them in any order is about sqrt(n) * 10 in size (2**24 would be
    # millions of standard deviations away), so fp32 computes both results exactly and they must
    # be equal. With randn, fp32 sums of 1e5-1e6 terms in two orders differed by 0.014 on a total
    # that cancels to about 3 (a CI run failed a fixed 1e-2 bound); an inexact op (sin, then
    # round) may also differ by an ulp between Inductor's code and eager (helper-42).
    def ints(*shape):
        return torch.randint(-1, 2, shape).float()

    if case == "ag_before_all_reduce":
        fn, args = ag_before_all_reduce, (ints(64, 256), ints(256, 4096), ints(64, 256))
        want = ["torch.ops.mptp.fused_all_gather_matmul.default", "torch.ops._c10d_functional.all_reduce_.default"]
    else:
        fn, args = all_reduce_before_rs, (ints(64, 512), ints(512, 64), ints(1 << 18))
        want = ["torch.ops._c10d_functional.all_reduce_.default", "torch.ops.mptp.fused_matmul_reduce_scatter.default"]
    torch._dynamo.reset()
    fast = {"force_disable_caches": True, "compile_threads": 1, "cpp.vec_isa_ok": False}
    with torch._inductor.config.patch(fast), mptp_kernels.enable_micro_pipeline_tp():
        out, code = run_and_get_code(torch.compile(fn, fullgraph=True), *args)
    torch._dynamo.reset()
    assert _code_issue_order(code[0]) == want, _code_issue_order(code[0])
    torch.testing.assert_close(out, fn(*args), rtol=0, atol=0)  # exact: see ints() above
