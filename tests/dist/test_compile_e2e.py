"""torch.compile end to end on 2 gloo processes (CPU) with the mptp pass enabled.

A tensor-parallel MLP built with DTensor's parallelize_module (column-parallel
up, row-parallel down, sequence-parallel activations), in inference and in a
training step (the backward graph's all-gather fuses too), and an FP8 _scaled_mm
MLP written with functional collectives: the compiled result (and gradients)
equal eager, and the generated code calls torch.ops.mptp.
"""

import pytest
import torch
import torch.distributed as dist
from utils import randn

FP8 = torch.float8_e4m3fn


def _compile_and_code(fn, *args):
    from torch._inductor.utils import run_and_get_code

    import mptp_kernels

    torch._dynamo.reset()
    # NOTE: no cache hit may skip the pass (or the code the test reads).
    with (
        mptp_kernels.enable_micro_pipeline_tp(),
        torch._inductor.config.patch(force_disable_caches=True),
    ):
        compiled = torch.compile(fn, fullgraph=True)
        out, codes = run_and_get_code(compiled, *args)
    return out, "\n".join(codes)


class MLP(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.up = torch.nn.Linear(32, 64, bias=False)
        self.down = torch.nn.Linear(64, 32, bias=False)

    def forward(self, x):
        return self.down(torch.relu(self.up(x)))


def _parallel_mlp(seed, seq_dim):
    """The same MLP (seeded) on every call, column-/row-parallel over the world, sequence-sharded."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    import mptp_kernels

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    mptp_kernels.enable_symm_mem_for_group(mesh.get_group().group_name)
    torch.manual_seed(seed)
    model = MLP()
    parallelize_module(model, mesh, {
        "up": ColwiseParallel(input_layouts=Shard(seq_dim)),
        "down": RowwiseParallel(output_layouts=Shard(seq_dim)),
    })  # fmt: skip
    return model


def _sharded_input(seed, seq_dim):
    W, r = dist.get_world_size(), dist.get_rank()
    full = randn((2, 8 * W, 32), seed + 1) if seq_dim == 1 else randn((8 * W, 32), seed + 1)
    return full.chunk(W, dim=seq_dim)[r].contiguous()


def _tp_mlp_train(seed, seq_dim):
    import mptp_kernels
    from mptp_kernels.compile.micro_pipeline import recording

    eager_model, model = _parallel_mlp(seed, seq_dim), _parallel_mlp(seed, seq_dim)
    x = _sharded_input(seed, seq_dim)
    eager = eager_model(x)
    eager.square().sum().backward()
    torch._dynamo.reset()
    decisions = []
    cfg = torch._inductor.config
    with (
        mptp_kernels.enable_micro_pipeline_tp(),
        cfg.patch(force_disable_caches=True),
        recording(decisions),
    ):
        out = torch.compile(model)(x)
        out.square().sum().backward()  # the backward graph compiles here, with the pass
    torch.testing.assert_close(out, eager, rtol=1e-4, atol=1e-5)
    for (name, p), (_, q) in zip(model.named_parameters(), eager_model.named_parameters()):
        torch.testing.assert_close(
            p.grad.to_local(), q.grad.to_local(), rtol=1e-4, atol=1e-5, msg=name
        )
    # forward: the all-gather and the reduce-scatter; backward: the all-gather of down's output grad
    kinds = [(d.kind, d.fused) for d in decisions]
    assert kinds == [("all-gather", True), ("reduce-scatter", True), ("all-gather", True)], kinds


@pytest.mark.parametrize("seq_dim", [0, 1])
def test_tp_mlp_training_step_compiled_with_pass(workers2, seq_dim):
    workers2.run(_tp_mlp_train, 4321, seq_dim, timeout_s=900, crash_retries=1)


def _tp_mlp(seed, seq_dim):
    model = _parallel_mlp(seed, seq_dim)
    x = _sharded_input(seed, seq_dim)
    with torch.no_grad():
        eager = model(x)
        out, code = _compile_and_code(model, x)
    eager = eager.to_local() if hasattr(eager, "to_local") else eager
    out = out.to_local() if hasattr(out, "to_local") else out
    torch.testing.assert_close(out, eager, rtol=1e-4, atol=1e-5)
    assert "mptp.fused_all_gather_matmul" in code, "the all-gather was not fused"
    assert "mptp.fused_matmul_reduce_scatter" in code, "the reduce-scatter was not fused"


@pytest.mark.parametrize("seq_dim", [0, 1])
def test_tp_mlp_compiled_with_pass(workers2, seq_dim):
    workers2.run(_tp_mlp, 1234, seq_dim, timeout_s=900, crash_retries=1)


def _fp8_mlp(seed):
    import mptp_kernels

    W, r = dist.get_world_size(), dist.get_rank()
    g = dist.group.WORLD.group_name
    mptp_kernels.enable_symm_mem_for_group(g)
    c10d = torch.ops._c10d_functional
    x = randn((8, 32), seed + r, scale=0.5).to(FP8)
    w_up = randn((64, 32), seed + 10).to(FP8)  # [N, K]: w_up.t() is column-major
    w_down = randn((32, 64), seed + 11).to(FP8)
    one = torch.tensor(1.0)

    def mlp(x, w_up, w_down, s):
        A = c10d.wait_tensor(c10d.all_gather_into_tensor(x.view(torch.uint8), W, g)).view(FP8)
        h = torch._scaled_mm(A, w_up.t(), s, s, out_dtype=torch.bfloat16)
        h8 = torch.relu(h).to(FP8)
        y = torch._scaled_mm(h8, w_down.t(), s, s, out_dtype=torch.bfloat16)
        return c10d.wait_tensor(c10d.reduce_scatter_tensor(y, "sum", W, g))

    eager = mlp(x, w_up, w_down, one)
    out, code = _compile_and_code(mlp, x, w_up, w_down, one)
    torch.testing.assert_close(out.float(), eager.float(), rtol=2e-2, atol=2e-2)
    assert "mptp.fused_all_gather_scaled_matmul" in code
    assert "mptp.fused_scaled_matmul_reduce_scatter" in code


def test_fp8_mlp_compiled_with_pass(workers2):
    workers2.run(_fp8_mlp, 99, timeout_s=900, crash_retries=1)


def _fp16_reduce_scatter(reduce_op):
    """mm -> reduce_scatter in fp16, compiled with the pass, on gloo: the op's reference path runs
    the unfused collective itself, so the graph computes what it computed unfused, bit for bit.
    Rank 0's partial is 2048 and every other's 1 (W = 3, sum: a sum whose fp16 rounding depends on
    the backend's order), or every partial 60000 (W = 2, avg: gloo's fp16 sum overflows to inf on
    the way, where the average fits). (On a GPU with an mptp workspace the fused path sums in fp32
    instead: tests/dist/test_fused_gpu.py::test_fp16_reduce_scatter_rounds_once_on_both_paths.)"""
    import torch.distributed._functional_collectives as fc

    import mptp_kernels
    from mptp_kernels.compile.micro_pipeline import recording

    W, r = dist.get_world_size(), dist.get_rank()
    g = dist.group.WORLD
    mptp_kernels.enable_symm_mem_for_group(g.group_name)

    def f(x, w):
        return fc.reduce_scatter_tensor(x @ w, reduce_op, 0, g)

    x = torch.zeros(2 * W, 8, dtype=torch.float16)
    if reduce_op == "sum":
        x[:, 0] = 2048.0 if r == 0 else 1.0
    else:
        x[:, 0] = 60000.0
    w = torch.ones(8, 4, dtype=torch.float16)
    decisions = []
    with recording(decisions):
        out, code = _compile_and_code(f, x, w)
    assert "mptp.fused_matmul_reduce_scatter" in code, decisions
    unfused = f(x, w)
    assert out.dtype == torch.float16 and out.shape == (2, 4)
    if reduce_op == "avg":
        assert torch.isinf(unfused).all(), unfused
    assert torch.equal(out, unfused), (out, unfused)


@pytest.mark.parametrize("world,reduce_op", [(3, "sum"), (2, "avg")])
def test_fp16_reduce_scatter_under_the_pass_rounds_as_unfused_on_gloo(request, world, reduce_op):
    request.getfixturevalue(f"workers{world}").run(_fp16_reduce_scatter, reduce_op, timeout_s=900, crash_retries=1)
