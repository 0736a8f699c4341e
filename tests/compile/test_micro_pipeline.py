"""The FX pass on graphs traced with make_fx (fake tensors: no communication).

Structure tests trace with world size 4; the numeric checks trace with the
real (world size 1, gloo) group and run the graph before and after the pass.
"""


import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

import mptp_kernels
from mptp_kernels.compile.micro_pipeline import micro_pipeline_pass

c10d = torch.ops._c10d_functional
aten = torch.ops.aten
FP8 = torch.float8_e4m3fn


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


def _run_pass(gm):
    n = micro_pipeline_pass(gm.graph)
    gm.recompile()
    return n


def _check_numerics(fn, args):
    gm = _trace(fn, *args)
    ref = gm(*args)
    _run_pass(gm)
    out = gm(*args)
    for r, o in zip(ref if isinstance(ref, (list, tuple)) else [ref], out if isinstance(out, (list, tuple)) else [out]):
        torch.testing.assert_close(o.float(), r.float(), rtol=1e-5, atol=1e-5)


def test_all_gather_dim0_two_mms_one_fused_call(group):
    def f(shard, B1, B2):
        A = _ag(shard, 4, group)
        return torch.mm(A, B1), torch.mm(A, B2)

    gm = _trace(f, torch.randn(8, 16), torch.randn(16, 4), torch.randn(16, 6))
    assert _run_pass(gm) == 1
    t = _targets(gm)
    assert t.count(torch.ops.mptp.fused_all_gather_matmul.default) == 1
    assert c10d.all_gather_into_tensor.default not in t and aten.mm.default not in t
    fused = next(n for n in gm.graph.nodes if n.target is torch.ops.mptp.fused_all_gather_matmul.default)
    assert fused.kwargs["return_A"] is False, "nothing else uses A_full"
    assert len(fused.args[1]) == 2


def test_all_gather_result_used_elsewhere_keeps_return_A(group):
    def f(shard, B):
        A = _ag(shard, 4, group)
        return torch.mm(A, B), A.sum()

    gm = _trace(f, torch.randn(8, 16), torch.randn(16, 4))
    assert _run_pass(gm) == 1
    fused = next(n for n in gm.graph.nodes if n.target is torch.ops.mptp.fused_all_gather_matmul.default)
    assert fused.kwargs["return_A"] is True


@pytest.mark.parametrize("gather_dim", [0, 1])
def test_all_gather_3d_reshape_mm_reshape(group, gather_dim):
    def f(shard, B):
        A = _ag(shard, 4, group, gather_dim)
        return torch.matmul(A, B)

    gm = _trace(f, torch.randn(2, 3, 16), torch.randn(16, 4))
    assert _run_pass(gm) == 1
    t = _targets(gm)
    assert torch.ops.mptp.fused_all_gather_matmul.default in t and aten.mm.default not in t
    assert aten.cat.default not in t and aten.split.Tensor not in t
    fused = next(n for n in gm.graph.nodes if n.target is torch.ops.mptp.fused_all_gather_matmul.default)
    assert fused.args[2] == gather_dim
    if gather_dim:
        assert fused.args[0].target is __import__("torch._inductor.inductor_prims", fromlist=["x"]).force_stride_order


def test_all_gather_type_erased_fp8_scaled(group):
    def f(shard, B, sa, sb):
        A = _ag(shard.view(torch.uint8), 4, group).view(FP8)  # fp8 travels as bytes
        return torch._scaled_mm(A, B, sa, sb, out_dtype=torch.bfloat16)

    shard, B = torch.randn(8, 32).to(FP8), torch.randn(16, 32).to(FP8).t()
    gm = _trace(f, shard, B, torch.tensor(1.0), torch.tensor(1.0))
    assert _run_pass(gm) == 1
    t = _targets(gm)
    assert torch.ops.mptp.fused_all_gather_scaled_matmul.default in t and aten._scaled_mm.default not in t


def test_all_gather_type_erased_fp8_dim1_3d(group):
    def f(shard, B, sa, sb):
        raw = shard.view(torch.uint8)
        out = c10d.wait_tensor(c10d.all_gather_into_tensor(raw.contiguous(), 4, group))
        A = torch.cat([p.view(FP8) for p in torch.split(out, raw.shape[0], 0)], dim=1)
        return torch._scaled_mm(A.reshape(-1, 32), B, sa, sb, out_dtype=torch.bfloat16).reshape(2, 12, 16)

    gm = _trace(f, torch.randn(2, 3, 32).to(FP8), torch.randn(16, 32).to(FP8).t(), torch.tensor(1.0), torch.tensor(1.0))
    assert _run_pass(gm) == 1
    fused = next(n for n in gm.graph.nodes if n.target is torch.ops.mptp.fused_all_gather_scaled_matmul.default)
    assert fused.args[4] == 1


@pytest.mark.parametrize("scatter_dim", [0, 1])
def test_reduce_scatter_3d(group, scatter_dim):
    def f(A, B):
        return _rs(torch.matmul(A, B), 4, group, scatter_dim)

    gm = _trace(f, torch.randn(4, 8, 16), torch.randn(16, 6))
    assert _run_pass(gm) == 1
    t = _targets(gm)
    assert torch.ops.mptp.fused_matmul_reduce_scatter.default in t
    assert c10d.reduce_scatter_tensor.default not in t and aten.mm.default not in t
    fused = next(n for n in gm.graph.nodes if n.target is torch.ops.mptp.fused_matmul_reduce_scatter.default)
    assert fused.args[3] == scatter_dim


def test_reduce_scatter_2d_and_result_saved_for_output(group):
    def f(A, B):
        out = _rs(torch.mm(A, B), 4, group)
        return out, out * 2  # the result feeds the output too (e.g. saved for backward)

    gm = _trace(f, torch.randn(8, 16), torch.randn(16, 6))
    assert _run_pass(gm) == 1


def test_scaled_reduce_scatter(group):
    def f(A, B, sa, sb):
        return _rs(torch._scaled_mm(A, B, sa, sb, out_dtype=torch.bfloat16), 4, group)

    gm = _trace(f, torch.randn(8, 32).to(FP8), torch.randn(16, 32).to(FP8).t(), torch.tensor(1.0), torch.tensor(1.0))
    assert _run_pass(gm) == 1
    assert torch.ops.mptp.fused_scaled_matmul_reduce_scatter.default in _targets(gm)


def test_negative_mixed_matmul_kinds(group):
    shard = torch.randn(8, 32).to(FP8)

    def g(shard, B, sa, sb):
        A = _ag(shard, 4, group)
        return torch.mm(A, B.to(A.dtype)), torch._scaled_mm(A, B, sa, sb, out_dtype=torch.bfloat16)

    gm = _trace(g, shard, torch.randn(16, 32).to(FP8).t(), torch.tensor(1.0), torch.tensor(1.0))
    assert _run_pass(gm) == 0
    assert c10d.all_gather_into_tensor.default in _targets(gm)


def test_negative_B_depends_on_collective(group):
    def f(shard):
        A = _ag(shard, 4, group)
        return torch.mm(A, A[:16].t())

    gm = _trace(f, torch.randn(8, 16))
    assert _run_pass(gm) == 0


def test_negative_matmul_result_has_other_users(group):
    def f(A, B):
        C = torch.mm(A, B)
        return _rs(C, 4, group), C.sum()

    gm = _trace(f, torch.randn(8, 16), torch.randn(16, 6))
    assert _run_pass(gm) == 0


def test_negative_group_not_enabled(pg1):
    def f(shard, B):
        return torch.mm(_ag(shard, 4, "not-enabled-group"), B)

    gm = _trace(f, torch.randn(8, 16), torch.randn(16, 4))
    assert _run_pass(gm) == 0


def test_negative_already_hidden_with_reorder(group):
    def f(shard, B, X, Y):
        A = _ag(shard, 4, group)
        return torch.mm(A, B), torch.mm(X, Y)  # X @ Y is independent: it hides the all-gather

    gm = _trace(f, torch.randn(8, 16), torch.randn(16, 4), torch.randn(8, 8), torch.randn(8, 8))
    with torch._inductor.config.patch(reorder_for_compute_comm_overlap=True):
        assert _run_pass(gm) == 0


def test_late_B_ancestors_move_above_the_fused_node(group):
    def f(shard, W):
        A = _ag(shard, 4, group)
        B = (W * 2).t()  # traced after the all-gather
        return torch.mm(A, B)

    gm = _trace(f, torch.randn(8, 16), torch.randn(4, 16))
    # make_fx placed W * 2 and its transpose after the all-gather, where the fused node cannot see them.
    assert _run_pass(gm) == 1
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    fused = next(n for n in gm.graph.nodes if n.target is torch.ops.mptp.fused_all_gather_matmul.default)
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
    assert torch.ops.mptp.fused_all_gather_matmul.default in t
    assert torch.ops.symm_mem.fused_all_gather_matmul.default not in t


@pytest.mark.parametrize("dim", [0, 1])
def test_numerics_unchanged_world_size_1(group, dim):
    def f(shard, B, A2, B2):
        x = torch.matmul(_ag(shard, 1, group, dim), B)
        y = _rs(torch.matmul(A2, B2), 1, group, dim)
        return x, y

    _check_numerics(f, (torch.randn(2, 3, 16), torch.randn(16, 4), torch.randn(2, 4, 8), torch.randn(8, 5)))


def test_enable_disable_changes_cache_key_and_chains(pg1):
    from torch._inductor.custom_graph_pass import CustomGraphPass

    cfg = torch._inductor.config
    seen = []

    class Other(CustomGraphPass):
        def __call__(self, graph):
            seen.append(graph)

        def uuid(self):
            return "other"

    old = cfg.post_grad_custom_post_pass
    cfg.post_grad_custom_post_pass = Other()
    try:
        with mptp_kernels.enable_micro_pipeline_tp():
            p = cfg.post_grad_custom_post_pass
            assert isinstance(p, mptp_kernels.compile.MicroPipelineTPPass) and isinstance(p.chained, Other)
            uuid_on = p.uuid()
            g = torch.fx.Graph()
            g.output(None)
            p(g)
            assert seen, "the chained pass did not run"
            assert getattr(cfg, "_micro_pipeline_tp", False) is False
        assert isinstance(cfg.post_grad_custom_post_pass, Other)
        assert uuid_on != cfg.post_grad_custom_post_pass.uuid()
    finally:
        cfg.post_grad_custom_post_pass = old


@pytest.mark.parametrize("scatter_dim", [0, 1])
def test_scaled_reduce_scatter_3d_reshape(group, scatter_dim):
    def f(A, B, sa, sb, W):
        C = torch._scaled_mm(A.reshape(-1, 32), B, sa, sb, out_dtype=torch.bfloat16).reshape(4, 8, 16)
        return _rs(C, W, group, scatter_dim)

    args = (torch.randn(4, 8, 32).to(FP8), torch.randn(16, 32).to(FP8).t(), torch.tensor(1.0), torch.tensor(1.0))
    gm = _trace(lambda *a: f(*a, 4), *args)
    assert _run_pass(gm) == 1
    fused = next(n for n in gm.graph.nodes if n.target is torch.ops.mptp.fused_scaled_matmul_reduce_scatter.default)
    assert fused.args[5] == scatter_dim and list(fused.args[8]) == [4, 8, 16]
    _check_numerics(lambda *a: f(*a, 1), args)


def test_scaled_all_gather_3d_row_wise_scale_numerics(group):
    def f(shard, B, sa, sb):
        A = _ag(shard.view(torch.uint8), 1, group).view(FP8)
        return torch._scaled_mm(A.reshape(-1, 32), B, sa, sb, out_dtype=torch.bfloat16).reshape(2, 3, 16)

    args = (torch.randn(2, 3, 32).to(FP8), torch.randn(16, 32).to(FP8).t(), torch.rand(6, 1) + 0.5, torch.rand(1, 16) + 0.5)
    gm = _trace(f, *args)
    ref = gm(*args)
    assert _run_pass(gm) == 1
    gm.recompile()
    torch.testing.assert_close(gm(*args).float(), ref.float())


def test_fx_graph_cache_key_changes_with_the_pass(pg1, monkeypatch, tmp_path):
    """A graph compiled without the pass is never served to a compile with it (and back)."""
    from torch._dynamo.utils import counters

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(torch._inductor.config, "fx_graph_cache", True)
    monkeypatch.setattr(torch._inductor.config, "fx_graph_remote_cache", False)

    def f(x):
        return torch.relu(x @ x) + 1

    def compile_once():
        torch._dynamo.reset()
        counters.clear()
        torch.compile(f)(torch.randn(8, 8))
        return counters["inductor"]["fxgraph_cache_hit"], counters["inductor"]["fxgraph_cache_miss"]

    assert compile_once() == (0, 1)  # cold
    assert compile_once() == (1, 0)  # warm, no pass
    with mptp_kernels.enable_micro_pipeline_tp():
        assert compile_once() == (0, 1), "a graph compiled without the pass was reused"
        assert compile_once() == (1, 0)
    assert compile_once() == (1, 0)  # the pass-less entry is still there
