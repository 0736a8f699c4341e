"""Adversarial autograd checks of the ops and the fused TP styles (gloo, 2 processes, float64).

What an adversarial user does that tests/dist/test_autograd_ref.py does not:
double backward (create_graph=True), only B requiring grad with return_A=False,
output gradients with permuted (non-dense-row) strides, 4-D inputs with every
negative gather/scatter dim, the scaled ops with a bias or a scale that requires
grad, and the fused styles with output/input layout variants, use_local_output
and DTensor inputs, against DTensor's ColwiseParallel / RowwiseParallel.
"""

import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

F64 = torch.float64
TOL = dict(rtol=1e-9, atol=1e-10)


def _rnd(shape, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g, dtype=F64)


def _close(got, ref, what):
    assert got is not None, f"{what}: no gradient"
    torch.testing.assert_close(got, ref, **TOL, msg=lambda m: f"{what}: {m}")


def _leaves(ts, grad=True):
    return [t.clone().requires_grad_(grad) for t in ts]


# -- ops ------------------------------------------------------------------------------------------


def _double_backward():
    """Second-order gradients through both ops equal float64 autograd of the unfused math."""
    W, r, g = dist.get_world_size(), dist.get_rank(), dist.group.WORLD.group_name
    shards = [_rnd((3, 4, 8), q) for q in range(W)]
    Bs = [_rnd((8, 5), 100 + q) for q in range(W)]
    for kind, d in (("ag", 1), ("rs", 1), ("ag", -1)):
        last = d % 3 == 2
        B_all = [_rnd((16, 5), 200 + q) for q in range(W)] if kind == "ag" and last else Bs
        A, B = shards[r].clone().requires_grad_(), B_all[r].clone().requires_grad_()
        if kind == "ag":
            _, (C,) = torch.ops.mptp.fused_all_gather_matmul(A, [B], d, g, return_A=False)
        else:
            C = torch.ops.mptp.fused_matmul_reduce_scatter(A, B, "sum", d, g)
        gA, gB = torch.autograd.grad(C.square().sum(), (A, B), create_graph=True)
        (gA.square().sum() + gB.square().sum()).backward()

        ra, rb = _leaves(shards), _leaves(B_all)
        if kind == "ag":
            Af = torch.cat(ra, d)
            L = sum((Af @ b).square().sum() for b in rb)
        else:
            L = sum(c.square().sum() for c in sum(a @ b for a, b in zip(ra, rb)).chunk(W, d))
        grads = torch.autograd.grad(L, ra + rb, create_graph=True)
        sum(x.square().sum() for x in grads).backward()
        _close(A.grad, ra[r].grad, f"{kind} dim {d}: d2 A")
        _close(B.grad, rb[r].grad, f"{kind} dim {d}: d2 B")


def _only_B_requires_grad():
    W, r, g = dist.get_world_size(), dist.get_rank(), dist.group.WORLD.group_name
    shards = [_rnd((3, 4, 8), q) for q in range(W)]
    Bs = [_rnd((8, 5), 100 + q) for q in range(W)]
    B = Bs[r].clone().requires_grad_()
    A_out, (C,) = torch.ops.mptp.fused_all_gather_matmul(shards[r], [B], 1, g, return_A=False)
    assert A_out is None
    C.square().sum().backward()
    rb = _leaves(Bs)
    sum((torch.cat(shards, 1) @ b).square().sum() for b in rb).backward()
    _close(B.grad, rb[r].grad, "dB")


def _permuted_output_grads():
    """dC arrives with permuted strides (an einsum over the output), for both ops."""
    W, r, g = dist.get_world_size(), dist.get_rank(), dist.group.WORLD.group_name
    shards = [_rnd((3, 4, 8), q) for q in range(W)]
    Bs = [_rnd((8, 5), 100 + q) for q in range(W)]
    Y_ag, Y_rs = _rnd((5, 8, 6), 7), _rnd((5, 2, 6), 8)
    A, B = shards[r].clone().requires_grad_(), Bs[r].clone().requires_grad_()
    _, (C,) = torch.ops.mptp.fused_all_gather_matmul(A, [B], 1, g, return_A=False)
    C2 = torch.ops.mptp.fused_matmul_reduce_scatter(A, B, "sum", 1, g)
    (torch.einsum("abn,nbc->ac", C, Y_ag).square().sum()
     + torch.einsum("abn,nbc->ac", C2, Y_rs).square().sum()).backward()  # fmt: skip
    ra, rb = _leaves(shards), _leaves(Bs)
    Af = torch.cat(ra, 1)
    L = sum(torch.einsum("abn,nbc->ac", Af @ b, Y_ag).square().sum() for b in rb)
    P = sum(a @ b for a, b in zip(ra, rb))
    L = L + sum(torch.einsum("abn,nbc->ac", c, Y_rs).square().sum() for c in P.chunk(W, 1))
    L.backward()
    _close(A.grad, ra[r].grad, "dA")
    _close(B.grad, rb[r].grad, "dB")


def _four_d_every_dim():
    W, r, g = dist.get_world_size(), dist.get_rank(), dist.group.WORLD.group_name
    shape = (2, 4, 2, 8)
    for d in (-4, -3, -2, -1):
        last = d == -1
        sh = [_rnd(shape, 300 + q) for q in range(W)]
        bs = [_rnd((8 * (W if last else 1), 5), 400 + q) for q in range(W)]
        A, B = sh[r].clone().requires_grad_(), bs[r].clone().requires_grad_()
        A_full, (C,) = torch.ops.mptp.fused_all_gather_matmul(A, [B], d, g)
        (C.square().sum() + A_full.sin().sum()).backward()
        ra, rb = _leaves(sh), _leaves(bs)
        Af = torch.cat(ra, d)
        sum((Af @ b).square().sum() + Af.sin().sum() for b in rb).backward()
        _close(A.grad, ra[r].grad, f"ag dim {d}: dA")
        _close(B.grad, rb[r].grad, f"ag dim {d}: dB")

        bs = [_rnd((8, 6), 600 + q) for q in range(W)]
        A, B = sh[r].clone().requires_grad_(), bs[r].clone().requires_grad_()
        torch.ops.mptp.fused_matmul_reduce_scatter(A, B, "sum", d, g).sin().sum().backward()
        ra, rb = _leaves(sh), _leaves(bs)
        sum(c.sin().sum() for c in sum(a @ b for a, b in zip(ra, rb)).chunk(W, d)).backward()
        _close(A.grad, ra[r].grad, f"rs dim {d}: dA")
        _close(B.grad, rb[r].grad, f"rs dim {d}: dB")


def _scaled_backward_raises():
    g = dist.group.WORLD.group_name
    FP8 = torch.float8_e4m3fn
    A = torch.ones(4, 16).to(FP8)
    B = torch.ones(16, 16).t().contiguous().to(FP8).t()
    one = torch.tensor(1.0)
    outs = []
    bias = torch.zeros(16, dtype=torch.bfloat16, requires_grad=True)
    _, (y,) = torch.ops.mptp.fused_all_gather_scaled_matmul(
        A, [B], one, [one], 0, g, [bias], [None], [torch.bfloat16], [False]
    )
    outs.append(y)
    outs.append(torch.ops.mptp.fused_scaled_matmul_reduce_scatter(
        A, B, one, one, "sum", 0, 0, g, None, bias, None, torch.bfloat16))  # fmt: skip
    scale = torch.tensor(1.0, requires_grad=True)
    outs.append(torch.ops.mptp.fused_scaled_matmul_reduce_scatter(
        A, B, scale, one, "sum", 0, 0, g, None, None, None, torch.float32))  # fmt: skip
    for y in outs:
        assert y.requires_grad
        with pytest.raises(RuntimeError, match="forward-only"):
            y.float().sum().backward()


@pytest.mark.parametrize(
    "fn",
    [_double_backward, _only_B_requires_grad, _permuted_output_grads, _four_d_every_dim,
     _scaled_backward_raises],  # fmt: skip
    ids=lambda f: f.__name__.strip("_"),
)
def test_op_gradients(workers2, fn):
    workers2.run(fn)


# -- the fused styles against DTensor's ----------------------------------------------------------


def _styles_vs_dtensor(col_kw, row_kw, x_spec, x_shape, bias):
    """One column- and/or row-parallel nn.Linear, fused styles vs DTensor's, float64."""
    from collections import OrderedDict

    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, distribute_tensor
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    from mptp_kernels.tp import FusedColwiseParallel, FusedRowwiseParallel

    W, r = dist.get_world_size(), dist.get_rank()
    mesh = init_device_mesh("cpu", (W,))
    torch.manual_seed(0)
    D = x_shape[-1]
    layers = OrderedDict()
    if col_kw is not None:
        layers["col"] = nn.Linear(D, 4 * D, bias=bias, dtype=F64)
    if row_kw is not None:
        layers["row"] = nn.Linear(4 * D if col_kw is not None else D, D, bias=bias, dtype=F64)
    full = nn.Sequential(layers)
    x = _rnd(x_shape, 1)
    res = {}
    for kind in ("dtensor", "fused"):
        col, row = (ColwiseParallel, RowwiseParallel) if kind == "dtensor" else (FusedColwiseParallel, FusedRowwiseParallel)
        plan = {}
        if col_kw is not None:
            plan["col"] = col(**col_kw)
        if row_kw is not None:
            plan["row"] = row(**row_kw)
        m = parallelize_module(copy.deepcopy(full), mesh, plan, src_data_rank=None)
        assert all(hasattr(getattr(m, k), "_mptp_tp") == (kind == "fused") for k in plan)
        if x_spec[0] == "shard":
            xl = xin = x.chunk(W, x_spec[1])[r].clone().requires_grad_()
        elif x_spec[0] == "full":  # a plain replicated input: every rank passes all of it
            xl = xin = x.clone().requires_grad_()
        else:  # a DTensor input in the given placement
            dt = distribute_tensor(x, mesh, x_spec[1])
            xl = dt.to_local().detach().requires_grad_()
            xin = DTensor.from_local(xl, mesh, dt.placements)
        y = m(xin)
        meta = (isinstance(y, DTensor), getattr(y, "placements", None), tuple(y.shape))
        full_y = y.full_tensor() if isinstance(y, DTensor) else y
        full_y.sin().sum().backward()
        grads = {n: p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
                 for n, p in m.named_parameters()}  # fmt: skip
        res[kind] = (meta, full_y, xl.grad, grads)
    (m0, y0, gx0, g0), (m1, y1, gx1, g1) = res["dtensor"], res["fused"]
    assert m0 == m1, f"output kind/placements/shape: DTensor {m0}, fused {m1}"
    _close(y1, y0, "output")
    _close(gx1, gx0, "d input")
    for n in g0:
        _close(g1[n], g0[n], f"grad of {n}")


def _layouts():
    from torch.distributed.tensor import Replicate, Shard

    S1 = ("shard", 1)
    return {
        "neg_dims": (dict(input_layouts=Shard(-2)), dict(output_layouts=Shard(-2)), S1),
        "col_replicated_out": (dict(input_layouts=Shard(1), output_layouts=Replicate()), None, S1),
        "col_dtensor_out": (dict(input_layouts=Shard(1), use_local_output=False), None, S1),
        "col_shard0_out": (dict(input_layouts=Shard(1), output_layouts=Shard(0), use_local_output=False), None, S1),
        "col_last_dim_in": (dict(input_layouts=Shard(-1)), None, ("shard", 2)),
        "col_replicated_dtensor_in": (dict(input_layouts=Shard(1)), None, ("dt", [Replicate()])),
        "row_last_dim_out": (dict(input_layouts=Shard(1)), dict(output_layouts=Shard(-1)), S1),
        "row_dtensor_out": (dict(input_layouts=Shard(1)), dict(output_layouts=Shard(1), use_local_output=False), S1),
        "row_replicated_in": (None, dict(input_layouts=Replicate(), output_layouts=Shard(0)), ("full",)),
        "col_dtensor_into_row": (dict(input_layouts=Shard(1), use_local_output=False), dict(output_layouts=Shard(0)), S1),
    }  # fmt: skip


_LAYOUTS = [
    "neg_dims", "col_replicated_out", "col_dtensor_out", "col_shard0_out", "col_last_dim_in",
    "col_replicated_dtensor_in", "row_last_dim_out", "row_dtensor_out", "row_replicated_in",
    "col_dtensor_into_row",
]  # fmt: skip


def _styles_case(name):
    col_kw, row_kw, x_spec = _layouts()[name]
    shape = (4, 32) if x_spec == ("full",) else (2, 6, 8)
    for bias in (False, True):
        _styles_vs_dtensor(col_kw, row_kw, x_spec, shape, bias)


@pytest.mark.parametrize("name", _LAYOUTS)
def test_styles_layouts_vs_dtensor(workers2, name):
    workers2.run(_styles_case, name)
