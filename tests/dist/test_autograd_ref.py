"""Gradients of the ops and of the TP layers, gloo on CPU (the reference path), 2 and 3 processes.

Op gradients are checked in float64 against a single-process float64 autograd
computation of the same math (every rank regenerates every rank's inputs from
seeds), so the tolerance is float64 round-off. The TP layers (fused styles and
plain modules) are checked against DTensor's own ColwiseParallel / RowwiseParallel
on the same float64 weights, and a few SGD steps must give the same losses.
"""

import random

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

from utils import randn

SEED = random.randrange(1 << 30)
TOL = dict(rtol=1e-9, atol=1e-10)  # float64 throughout: only summation order differs
F64 = torch.float64


def _close(got, ref, what):
    assert got is not None, f"{what}: no gradient"
    torch.testing.assert_close(got, ref, **TOL, msg=lambda m: f"{what}: {m}")


# -- the ops --------------------------------------------------------------------------------------


def _ag_grads(seed, shard_shape, gather_dim, ns, return_A, use_A_full, grad_A, grad_Bs, inplace=False):
    """inplace: "C" changes the outputs C_i in place before the loss (C.mul_(1.5).add_(1), as a
    bias add or an in-place activation after a column-parallel layer does), "A_out" the returned
    A (A_out.mul_(2): allowed where no gradient needs A_full, i.e. no B requires grad)."""
    W, r = dist.get_world_size(), dist.get_rank()
    g = dist.group.WORLD.group_name
    last = gather_dim % len(shard_shape) == len(shard_shape) - 1
    K = shard_shape[-1] * (W if last else 1)
    shards = [randn(shard_shape, seed + i, dtype=F64) for i in range(W)]
    Bs = [[randn((K, n), seed + 100 * (q + 1) + j, dtype=F64, scale=K**-0.5) for j, n in enumerate(ns)]
          for q in range(W)]  # fmt: skip
    A_full_shape = list(torch.cat(shards, dim=gather_dim).shape)
    G = [[randn(A_full_shape[:-1] + [n], seed + 7000 + 100 * q + j, dtype=F64) for j, n in enumerate(ns)]
         for q in range(W)]  # fmt: skip
    GA = [randn(A_full_shape, seed + 9000 + q, dtype=F64) for q in range(W)]

    # single-process float64 oracle: L = sum_q (sum_j <A_full @ B_qj, G_qj> + <A_full, GA_q>)
    ref_shards = [s.clone().requires_grad_(grad_A) for s in shards]
    ref_Bs = [[b.clone().requires_grad_(grad_Bs) for b in bq] for bq in Bs]
    A_full = torch.cat(ref_shards, dim=gather_dim)
    c_s = 1.5 if inplace == "C" else 1.0
    a_s = 2.0 if inplace == "A_out" else 1.0
    loss = sum(((A_full @ b) * c_s * gq).sum() for q in range(W) for b, gq in zip(ref_Bs[q], G[q]))
    if return_A and use_A_full:
        loss = loss + sum((A_full * a_s * GA[q]).sum() for q in range(W))
    loss.backward()

    A = shards[r].clone().requires_grad_(grad_A)
    my_Bs = [b.clone().requires_grad_(grad_Bs) for b in Bs[r]]
    A_out, outs = torch.ops.mptp.fused_all_gather_matmul(A, my_Bs, gather_dim, g, return_A=return_A)
    assert (A_out is None) == (not return_A)
    if inplace == "C":
        for o in outs:
            o.mul_(1.5).add_(1.0)
    elif inplace == "A_out":
        A_out.mul_(2.0)
    local = sum((o * gq).sum() for o, gq in zip(outs, G[r]))
    if return_A and use_A_full:
        local = local + (A_out * GA[r]).sum()
    local.backward()
    if grad_A:
        _close(A.grad, ref_shards[r].grad, "dA")
    for j, b in enumerate(my_Bs):
        if grad_Bs:
            _close(b.grad, ref_Bs[r][j].grad, f"dBs[{j}]")
        else:
            assert b.grad is None


def _ag_output_flags(seed, a_grad):
    """Only B_0 of two requires grad (and A per a_grad): every output requires grad exactly where
    a gradient flows from it, as all_gather(A) and A_full @ B_i do unfused; dB_0 is right."""
    W, r = dist.get_world_size(), dist.get_rank()
    g = dist.group.WORLD.group_name
    shards = [randn((3, 8), seed + q, dtype=F64) for q in range(W)]
    B0, B1 = randn((8, 5), seed + 100 + r, dtype=F64), randn((8, 4), seed + 200 + r, dtype=F64)
    A = shards[r].clone().requires_grad_(a_grad)
    B0.requires_grad_(True)
    A_out, (C0, C1) = torch.ops.mptp.fused_all_gather_matmul(A, [B0, B1], 0, g, return_A=True)
    assert A_out.requires_grad == a_grad and C0.requires_grad and C1.requires_grad == a_grad
    (C0.sum() + C1.sum() if a_grad else C0.sum()).backward()
    _close(B0.grad, torch.cat(shards).t() @ torch.ones(3 * W, 5, dtype=F64), "dB_0")
    assert B1.grad is None


@pytest.mark.parametrize("a_grad", [False, True])
def test_all_gather_matmul_outputs_require_grad_only_with_a_gradient_path(workers2, a_grad):
    workers2.run(_ag_output_flags, SEED, a_grad)


@pytest.mark.parametrize(
    "shard_shape,gather_dim", [((5, 16), 0), ((4, 6), 1), ((3, 5, 16), 0), ((2, 3, 16), 1), ((2, 3, 8), 2)]
)
@pytest.mark.parametrize("return_A", [True, False])
def test_all_gather_matmul_outputs_take_in_place_changes(workers2, shard_shape, gather_dim, return_A):
    """C += bias or relu_ on an output under grad (and A_out *= 2 where dB does not need it), as
    the unfused all-gather and matmul allow: no view error, and the gradients of the changed
    outputs. (A_out changed while a dB needs it raises autograd's own version error, as unfused.)"""
    workers2.run(_ag_grads, SEED, shard_shape, gather_dim, (24, 8), return_A, True, True, True, "C")
    if return_A:
        workers2.run(_ag_grads, SEED, shard_shape, gather_dim, (24, 8), True, True, True, False, "A_out")


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize(
    "shard_shape,gather_dim",
    [((5, 16), 0), ((4, 6), 1), ((3, 5, 16), 0), ((2, 3, 16), 1), ((2, 3, 8), 2), ((2, 3, 8), -1)],
)
@pytest.mark.parametrize("ns,return_A", [((24,), True), ((8, 40, 3), False), ((7, 9), True)])
def test_all_gather_matmul_grads(request, world, shard_shape, gather_dim, ns, return_A):
    w = request.getfixturevalue(f"workers{world}")
    w.run(_ag_grads, SEED, shard_shape, gather_dim, ns, return_A, True, True, True)


@pytest.mark.parametrize("grad_A,grad_Bs,use_A_full", [(True, False, False), (False, True, False),
                                                       (False, True, True), (True, True, False)])  # fmt: skip
def test_all_gather_matmul_grads_partial(workers2, grad_A, grad_Bs, use_A_full):
    workers2.run(_ag_grads, SEED, (3, 4, 8), 1, (6, 10), True, use_A_full, grad_A, grad_Bs)


def test_all_gather_matmul_unused_output(workers2):
    """Only some outputs reach the loss: their Bs get no gradient, the rest exact ones."""
    workers2.run(_ag_unused_output, SEED)


def _ag_unused_output(seed):
    W, r = dist.get_world_size(), dist.get_rank()
    g = dist.group.WORLD.group_name
    shards = [randn((4, 8), seed + i, dtype=F64) for i in range(W)]
    Bs = [[randn((8, n), seed + 10 * q + n, dtype=F64) for n in (3, 5)] for q in range(W)]
    ref = [s.clone().requires_grad_() for s in shards]
    ref_B = [[b.clone().requires_grad_() for b in bq] for bq in Bs]
    sum((torch.cat(ref) @ ref_B[q][1]).square().sum() for q in range(W)).backward()
    A = shards[r].clone().requires_grad_()
    my = [b.clone().requires_grad_() for b in Bs[r]]
    _, (c0, c1) = torch.ops.mptp.fused_all_gather_matmul(A, my, 0, g, return_A=False)
    c1.square().sum().backward()
    _close(A.grad, ref[r].grad, "dA")
    _close(my[1].grad, ref_B[r][1].grad, "dBs[1]")
    assert my[0].grad is None


def _rs_grads(seed, shape, scatter_dim, N, reduce_op, grad_A, grad_B, inplace=False):
    W, r = dist.get_world_size(), dist.get_rank()
    g = dist.group.WORLD.group_name
    K = shape[-1]
    As = [randn(shape, seed + q, dtype=F64) for q in range(W)]
    Bs = [randn((K, N), seed + 100 + q, dtype=F64, scale=K**-0.5) for q in range(W)]
    out_shape = list(shape[:-1]) + [N]
    out_shape[scatter_dim] //= W
    G = [randn(out_shape, seed + 500 + q, dtype=F64) for q in range(W)]

    ref_A = [a.clone().requires_grad_(grad_A) for a in As]
    ref_B = [b.clone().requires_grad_(grad_B) for b in Bs]
    P = sum(a @ b for a, b in zip(ref_A, ref_B))
    if reduce_op == "avg":
        P = P / W
    if inplace:
        P = P * 1.5
    sum((c * gq).sum() for c, gq in zip(P.chunk(W, dim=scatter_dim), G)).backward()

    A = As[r].clone().requires_grad_(grad_A)
    B = Bs[r].clone().requires_grad_(grad_B)
    out = torch.ops.mptp.fused_matmul_reduce_scatter(A, B, reduce_op, scatter_dim, g)
    if inplace:
        out.mul_(1.5).add_(1.0)
    (out * G[r]).sum().backward()
    if grad_A:
        _close(A.grad, ref_A[r].grad, "dA")
    if grad_B:
        _close(B.grad, ref_B[r].grad, "dB")


@pytest.mark.parametrize("shape,scatter_dim,N", [((6, 16), 0, 8), ((2, 6, 16), 1, 8), ((2, 3, 8), 2, 12)])
def test_matmul_reduce_scatter_output_takes_in_place_changes(workers2, shape, scatter_dim, N):
    workers2.run(_rs_grads, SEED, shape, scatter_dim, N, "sum", True, True, inplace=True)


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize(
    "shape,scatter_dim,N",
    [
        ((6, 16), 0, 8),
        ((4, 16), 1, 12),
        ((6, 5, 16), 0, 8),
        ((2, 6, 16), 1, 8),
        ((2, 3, 8), 2, 12),
        ((2, 3, 8), -1, 6),
    ],
)
@pytest.mark.parametrize("reduce_op", ["sum", "avg"])
def test_matmul_reduce_scatter_grads(request, world, shape, scatter_dim, N, reduce_op):
    w = request.getfixturevalue(f"workers{world}")
    w.run(_rs_grads, SEED, shape, scatter_dim, N, reduce_op, True, True)


@pytest.mark.parametrize("grad_A,grad_B", [(True, False), (False, True)])
def test_matmul_reduce_scatter_grads_partial(workers2, grad_A, grad_B):
    workers2.run(_rs_grads, SEED, (2, 6, 16), 1, 8, "avg", grad_A, grad_B)


def _regather(seed, gather_dim):
    """The backward of the plain register_autograd fallback: A_full is gathered again."""
    from mptp_kernels.ops import autograd as ag

    W, r = dist.get_world_size(), dist.get_rank()
    g = dist.group.WORLD.group_name
    shards = [randn((2, 4, 6), seed + q, dtype=F64) for q in range(W)]
    K = 6 * (W if gather_dim == 2 else 1)
    Bs = [randn((K, 5), seed + 50 + q, dtype=F64) for q in range(W)]
    ref = [s.clone().requires_grad_() for s in shards]
    ref_B = [b.clone().requires_grad_() for b in Bs]
    sum((torch.cat(ref, dim=gather_dim) @ b).square().sum() for b in ref_B).backward()

    class Fallback(torch.autograd.Function):
        @staticmethod
        def forward(ctx, A, B):
            out = torch.ops.mptp.fused_all_gather_matmul(A, [B], gather_dim, g, return_A=False)
            ag._ag_setup_context(ctx, (A, [B], gather_dim, g), {"return_A": False}, out)
            return out[1][0]

        @staticmethod
        def backward(ctx, dC):
            need = ctx.needs_input_grad
            ctx.needs_input_grad = (need[0], [need[1]], False, False)
            dA, (dB,), _, _ = ag._ag_backward(ctx, None, [dC])
            return dA, dB

    A = shards[r].clone().requires_grad_()
    B = Bs[r].clone().requires_grad_()
    Fallback.apply(A, B).square().sum().backward()
    _close(A.grad, ref[r].grad, "dA")
    _close(B.grad, ref_B[r].grad, "dB")


@pytest.mark.parametrize("gather_dim", [0, 1, 2])
def test_regather_fallback(workers2, gather_dim):
    workers2.run(_regather, SEED, gather_dim)


# -- tensor-parallel layers -----------------------------------------------------------------------


class MLP(nn.Module):
    """Llama's feed-forward block: down(silu(gate(x)) * up(x))."""

    def __init__(self, dim, hidden, bias=False):
        super().__init__()
        self.gate = nn.Linear(dim, hidden, bias=bias, dtype=F64)
        self.up = nn.Linear(dim, hidden, bias=bias, dtype=F64)
        self.down = nn.Linear(hidden, dim, bias=bias, dtype=F64)

    def forward(self, x):
        return self.down(nn.functional.silu(self.gate(x)) * self.up(x))


def _plan(kind, seq_dim):
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    from mptp_kernels.tp import FusedColwiseParallel, FusedRowwiseParallel

    col, row = (
        (ColwiseParallel, RowwiseParallel)
        if kind == "dtensor"
        else (FusedColwiseParallel, FusedRowwiseParallel)
    )
    return {
        "gate": col(input_layouts=Shard(seq_dim)),
        "up": col(input_layouts=Shard(seq_dim)),
        "down": row(output_layouts=Shard(seq_dim)),
    }


class PlainMLP(nn.Module):
    def __init__(self, full: MLP, seq_dim):
        from mptp_kernels.tp import ColumnParallelLinear, RowParallelLinear

        super().__init__()
        self.gate = ColumnParallelLinear.from_linear(full.gate, gather_dim=seq_dim)
        self.up = ColumnParallelLinear.from_linear(full.up, gather_dim=seq_dim)
        self.down = RowParallelLinear.from_linear(full.down, scatter_dim=seq_dim)

    def forward(self, x):
        return self.down(nn.functional.silu(self.gate(x)) * self.up(x))


def _model(kind, seed, dim, hidden, seq_dim, bias):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import parallelize_module

    torch.manual_seed(seed)  # the same full weights on every rank
    full = MLP(dim, hidden, bias)
    if kind == "plain":
        return PlainMLP(full, seq_dim)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    model = parallelize_module(full, mesh, _plan(kind, seq_dim), src_data_rank=None)
    assert all(
        hasattr(getattr(model, k), "_mptp_tp") == (kind == "fused") for k in ("gate", "up", "down")
    )
    return model


def _grads(model):
    out = {}
    for name, p in model.named_parameters():
        gr = p.grad
        if gr is None:
            out[name] = None
            continue
        out[name] = gr.full_tensor() if hasattr(gr, "full_tensor") else gr
    return out


def _shard(x, seq_dim):
    W, r = dist.get_world_size(), dist.get_rank()
    return x.chunk(W, dim=seq_dim)[r].clone()


def _layers_vs_dtensor(seed, kind, x_shape, seq_dim, bias, compiled):
    dim, hidden = x_shape[-1], 3 * x_shape[-1]  # divisible by 2 and 3
    ref = _model("dtensor", seed, dim, hidden, seq_dim, bias)
    model = _model(kind, seed, dim, hidden, seq_dim, bias)
    if compiled:
        model = torch.compile(model, backend="aot_eager", fullgraph=False)
    x = randn(x_shape, seed + 1, dtype=F64)
    gy = randn(x_shape, seed + 2, dtype=F64)
    outs, xgrads = [], []
    for m in (ref, model):
        xs = _shard(x, seq_dim).requires_grad_()
        y = m(xs)
        (y * _shard(gy, seq_dim)).sum().backward()
        outs.append(y)
        xgrads.append(xs.grad)
    _close(outs[1], outs[0], "output")
    _close(xgrads[1], xgrads[0], "d input")
    g_ref, g = _grads(ref), _grads(model)
    for name, gr in g_ref.items():
        mine = g[name] if name in g else g["_orig_mod." + name]
        if (
            kind == "plain"
        ):  # local shards: compare with this rank's slice of DTensor's full gradient
            W, r = dist.get_world_size(), dist.get_rank()
            gr = gr.chunk(W, dim=1 if name.startswith("down") else 0)[r]
        _close(mine, gr, f"grad of {name}")


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("x_shape,seq_dim", [((12, 16), 0), ((2, 6, 16), 1), ((6, 2, 8), 0)])
def test_fused_styles_vs_dtensor(request, world, x_shape, seq_dim):
    request.getfixturevalue(f"workers{world}").run(
        _layers_vs_dtensor, SEED, "fused", x_shape, seq_dim, False, False
    )


def test_fused_styles_bias(workers2):
    workers2.run(_layers_vs_dtensor, SEED, "fused", (2, 6, 16), 1, True, False)


def test_plain_modules_vs_dtensor(workers2):
    workers2.run(_layers_vs_dtensor, SEED, "plain", (2, 6, 16), 1, False, False)


def test_fused_styles_compiled(workers2):
    """torch.compile (aot_eager: dynamo + AOTAutograd, no codegen) traces the fused styles' forward and backward."""
    workers2.run(_layers_vs_dtensor, SEED, "fused", (2, 8, 16), 1, False, True, timeout_s=600)


def _train(seed, kind, steps):
    model = _model(kind, seed, 16, 64, 1, False)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    losses = []
    for step in range(steps):
        x = randn((2, 8, 16), seed + 10 + step % 2, dtype=F64)  # two batches, alternating
        target = torch.tanh(x.flip(-1))
        y = model(_shard(x, 1))
        loss = (
            y - _shard(target, 1)
        ).square().sum() / target.numel()  # this rank's part of the mean
        opt.zero_grad()
        loss.backward()
        opt.step()
        total = loss.detach().clone()
        dist.all_reduce(total)
        losses.append(total.item())
    return losses


def test_training_tracks_dtensor(workers2):
    ref = workers2.run(_train, SEED, "dtensor", 6)[0]
    for kind in ("fused", "plain"):
        got = workers2.run(_train, SEED, kind, 6)[0]
        torch.testing.assert_close(got, ref, **TOL)
    assert ref[-2] < ref[0] and ref[-1] < ref[1]


class Block(nn.Module):
    """A pre-norm residual block: x + mlp(norm(x)), the norm sequence-parallel (DTensor input)."""

    def __init__(self, dim, hidden):
        super().__init__()
        self.norm = nn.LayerNorm(dim, dtype=F64)
        self.mlp = MLP(dim, hidden)

    def forward(self, x):
        return x + self.mlp(self.norm(x))


def _block_vs_dtensor(seed, local_output):
    import copy

    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard
    from torch.distributed.tensor.parallel import SequenceParallel, parallelize_module

    torch.manual_seed(seed)
    full = Block(16, 48)
    with torch.no_grad():  # a non-trivial norm affine (identical on every rank)
        full.norm.weight.add_(randn((16,), seed + 3, dtype=F64) * 0.1)
        full.norm.bias.add_(randn((16,), seed + 4, dtype=F64) * 0.1)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    x = randn((2, 6, 16), seed + 1, dtype=F64)
    res = {}
    for kind in ("dtensor", "fused"):
        m = copy.deepcopy(full)
        plan = {"norm": SequenceParallel(), **{f"mlp.{k}": v for k, v in _plan(kind, 1).items()}}
        plan["mlp.down"].use_local_output = local_output
        parallelize_module(m, mesh, plan, src_data_rank=None)
        m = copy.deepcopy(m)  # a parallelized model survives deepcopy
        assert all(
            hasattr(getattr(m.mlp, k), "_mptp_tp") == (kind == "fused")
            for k in ("gate", "up", "down")
        )
        xs = _shard(x, 1).requires_grad_()
        y = m(DTensor.from_local(xs, mesh, (Shard(1),)) if not local_output else xs)
        assert isinstance(y, DTensor) != local_output
        if not local_output:
            assert y.placements == (Shard(1),)
            y = y.to_local()
        y.square().sum().backward()
        res[kind] = (y, xs.grad, _grads(m))
    (y0, gx0, g0), (y1, gx1, g1) = res["dtensor"], res["fused"]
    _close(y1, y0, "output")
    _close(gx1, gx0, "d input")
    for name in g0:
        _close(g1[name], g0[name], f"grad of {name}")


@pytest.mark.parametrize("local_output", [True, False])
def test_fused_styles_with_sequence_parallel_norm(workers2, local_output):
    workers2.run(_block_vs_dtensor, SEED, local_output)


# -- found by a hostile review: complex gradients, zero-width matmuls, autocast ---------------------


def _cplx(shape, seed):
    return torch.complex(randn(shape, seed, dtype=F64), randn(shape, seed + 1, dtype=F64))


def _complex_and_empty_grads(seed):
    """Complex gradients are dC @ B^H and A^H @ dC (conjugates, not transposes); K = 0 or N = 0
    gives zero-size or zero gradients, not a reshape error."""
    W, r = dist.get_world_size(), dist.get_rank()
    g = dist.group.WORLD.group_name
    for (M, K, N), make in [((4, 3, 5), _cplx), ((4, 0, 5), randn), ((4, 3, 0), randn)]:
        dt = torch.complex128 if make is _cplx else F64
        shards = [make((M, K), seed + 10 * q) if make is _cplx else randn((M, K), seed + 10 * q, dtype=dt)
                  for q in range(W)]  # fmt: skip
        Bs = [make((K, N), seed + 100 + 10 * q) if make is _cplx else randn((K, N), seed + 100 + 10 * q, dtype=dt)
              for q in range(W)]  # fmt: skip
        what = f"{dt} M={M} K={K} N={N}"
        # all-gather-matmul: L = sum_q Re <AG(A) @ B_q, AG(A) @ B_q> (|.|^2, so the conjugate matters)
        ref_A = [s.clone().requires_grad_() for s in shards]
        ref_B = [b.clone().requires_grad_() for b in Bs]
        full = torch.cat(ref_A)
        sum((full @ b).abs().pow(2).sum() for b in ref_B).backward()
        A, B = shards[r].clone().requires_grad_(), Bs[r].clone().requires_grad_()
        _, (C,) = torch.ops.mptp.fused_all_gather_matmul(A, [B], 0, g)
        C.abs().pow(2).sum().backward()
        _close(A.grad, ref_A[r].grad, f"all-gather dA, {what}")
        _close(B.grad, ref_B[r].grad, f"all-gather dB, {what}")
        # matmul-reduce-scatter: every rank's A_q @ B_q summed, rows scattered
        ref_A = [s.repeat(W, 1).clone().requires_grad_() for s in shards]
        ref_B = [b.clone().requires_grad_() for b in Bs]
        total = sum(a @ b for a, b in zip(ref_A, ref_B))
        total.abs().pow(2).sum().backward()
        A, B = shards[r].repeat(W, 1).requires_grad_(), Bs[r].clone().requires_grad_()
        torch.ops.mptp.fused_matmul_reduce_scatter(A, B, "sum", 0, g).abs().pow(2).sum().backward()
        _close(A.grad, ref_A[r].grad, f"reduce-scatter dA, {what}")
        _close(B.grad, ref_B[r].grad, f"reduce-scatter dB, {what}")


def test_complex_and_zero_width_gradients(workers2):
    workers2.run(_complex_and_empty_grads, SEED)


def _autocast_keeps_dtypes(seed):
    """Inside autocast the ops keep the schema's dtypes (A's), as their fake impls and PyTorch's
    own ops do, in eager and under torch.compile, and their gradients keep the inputs' dtypes."""
    W, r = dist.get_world_size(), dist.get_rank()
    g = dist.group.WORLD.group_name
    A = randn((4, 8), seed + r).requires_grad_()
    B = randn((8, 6), seed + 50 + r).requires_grad_()

    def f(A, B):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            A_full, (C,) = torch.ops.mptp.fused_all_gather_matmul(A, [B], 0, g)
            R = torch.ops.mptp.fused_matmul_reduce_scatter(A_full, B, "sum", 0, g)
        return A_full, C, R

    A_full, C, R = f(A, B)
    assert [t.dtype for t in (A_full, C, R)] == [torch.float32] * 3, [t.dtype for t in (A_full, C, R)]
    with torch.no_grad():  # the same math in fp32, no autocast
        torch.testing.assert_close(C, A_full @ B, rtol=1e-5, atol=1e-5)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        (C.sum() + R.sum()).backward()
    assert A.grad.dtype == B.grad.dtype == torch.float32
    torch._dynamo.reset()
    compiled = torch.compile(f, fullgraph=True)(A.detach(), B.detach())
    assert [t.dtype for t in compiled] == [torch.float32] * 3


def test_autocast_does_not_change_the_ops_dtypes(workers2):
    workers2.run(_autocast_keeps_dtypes, SEED)
