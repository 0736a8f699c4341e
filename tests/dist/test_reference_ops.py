"""Reference ops under gloo with 2 and 3 processes against float64 computations.

Each rank regenerates every rank's inputs from per-rank seeds, so the float64
oracle needs no communication. Seeds are fresh per test run.
"""

import random

import pytest
import torch
import torch.distributed as dist

from utils import assert_matmul_close, randn

SEED = random.randrange(1 << 30)
FP8 = torch.float8_e4m3fn


def _meta_like(ts):
    return [t.to("meta") if isinstance(t, torch.Tensor) else t for t in ts]


def _check_layout_vs_symm_mem(op_name, args, kwargs, outs):
    """Shapes and strides equal PyTorch's torch.ops.symm_mem op (its Meta impl)."""
    import torch.distributed._symmetric_memory  # noqa: F401  (registers symm_mem)

    meta_args = [(_meta_like(a) if isinstance(a, list) else a.to("meta"))
                 if isinstance(a, (torch.Tensor, list)) else a for a in args]  # fmt: skip
    theirs = getattr(torch.ops.symm_mem, op_name)(*meta_args, **kwargs)
    flat = lambda x: [t for t in (x if isinstance(x, (list, tuple)) else [x]) for t in (t if isinstance(t, list) else [t])]  # noqa: E731
    for ours, ref in zip(flat(outs), flat(theirs)):
        if ours is None or ref is None:
            assert ours is None and ref is None
            continue
        assert ours.shape == ref.shape, f"{op_name}: shape {ours.shape} != symm_mem {ref.shape}"
        assert ours.stride() == ref.stride(), f"{op_name}: stride {ours.stride()} != symm_mem {ref.stride()}"
        assert ours.dtype == ref.dtype, f"{op_name}: dtype {ours.dtype} != symm_mem {ref.dtype}"


def _ag_case(seed, shard_shape, gather_dim, ns, return_A, dtype):
    W, r = dist.get_world_size(), dist.get_rank()
    group = dist.group.WORLD.group_name
    # Gathering the last dim concatenates along K: B then has W*K rows.
    K = shard_shape[-1] * (W if gather_dim == len(shard_shape) - 1 else 1)
    shards = [randn(shard_shape, seed + i, scale=1.0) for i in range(W)]
    Bs64 = [randn((K, n), seed + 1000 + j, dtype=torch.float64, scale=K**-0.5) for j, n in enumerate(ns)]
    Bs = [b.to(dtype) for b in Bs64]
    A_full = torch.cat([s.to(dtype) for s in shards], dim=gather_dim)
    args = (shards[r].to(dtype), Bs, gather_dim, group)
    A_out, outs = torch.ops.mptp.fused_all_gather_matmul(*args, return_A=return_A)
    if return_A:
        assert torch.equal(A_out, A_full), "gathered A must equal the concatenated shards bitwise"
    else:
        assert A_out is None
    assert len(outs) == len(Bs)
    for j, (out, B64) in enumerate(zip(outs, Bs64)):
        ref = A_full.double() @ B64
        eager = A_full @ Bs[j]
        assert out.dtype == dtype
        assert_matmul_close(out, ref, eager, what=f"outs[{j}]")
    _check_layout_vs_symm_mem("fused_all_gather_matmul", args, {"return_A": return_A}, (A_out, outs))


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize(
    "shard_shape,gather_dim",
    [((5, 16), 0), ((4, 16), 1), ((3, 5, 16), 0), ((2, 3, 16), 1), ((2, 3, 8), 2)],
)
@pytest.mark.parametrize("ns,return_A", [((24,), True), ((8, 40, 3), False), ((7, 9), True)])
def test_all_gather_matmul(request, world, shard_shape, gather_dim, ns, return_A):
    w = request.getfixturevalue(f"workers{world}")
    w.run(_ag_case, SEED, shard_shape, gather_dim, ns, return_A, torch.float32)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_all_gather_matmul_low_precision(workers2, dtype):
    workers2.run(_ag_case, SEED, (6, 3, 32), 1, (16, 8), True, dtype)


def _rs_case(seed, shape, scatter_dim, N, reduce_op, dtype):
    W, r = dist.get_world_size(), dist.get_rank()
    group = dist.group.WORLD.group_name
    K = shape[-1]
    As = [randn(shape, seed + i) for i in range(W)]
    B64 = randn((K, N), seed + 999, dtype=torch.float64, scale=K**-0.5)
    ref = sum(a.double() @ B64 for a in As)
    eager = sum((a.to(dtype) @ B64.to(dtype)).float() for a in As)
    if reduce_op == "avg":
        ref, eager = ref / W, eager / W
    ref_chunk = ref.chunk(W, dim=scatter_dim)[r]
    eager_chunk = eager.chunk(W, dim=scatter_dim)[r]
    args = (As[r].to(dtype), B64.to(dtype), reduce_op, scatter_dim, group)
    out = torch.ops.mptp.fused_matmul_reduce_scatter(*args)
    assert out.dtype == dtype and out.is_contiguous()
    # k=3: the reduction of W rounded partials adds one rounding per term.
    assert_matmul_close(out, ref_chunk, eager_chunk, k=3.0, atol=1e-5)
    _check_layout_vs_symm_mem("fused_matmul_reduce_scatter", args, {}, out)


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize(
    "shape,scatter_dim,N",
    [((6, 16), 0, 24), ((5, 16), 1, 12), ((6, 2, 16), 0, 8), ((2, 6, 16), 1, 8), ((2, 3, 16), 2, 6)],
)
@pytest.mark.parametrize("reduce_op", ["sum", "avg"])
def test_matmul_reduce_scatter(request, world, shape, scatter_dim, N, reduce_op):
    w = request.getfixturevalue(f"workers{world}")
    w.run(_rs_case, SEED, shape, scatter_dim, N, reduce_op, torch.float32)


def test_matmul_reduce_scatter_bf16(workers2):
    workers2.run(_rs_case, SEED, (8, 3, 32), 0, 16, "sum", torch.bfloat16)


def _fp16_near_overflow(seed, reduce_op, scaled):
    """Partials of 40000 (fp16 max 65504), and -40000 on rank 1 of 3 where "sum": the average,
    and the sum of 3, fit fp16, but a running sum of two partials does not."""
    import torch.distributed._functional_collectives as funcol

    W, r = dist.get_world_size(), dist.get_rank()
    group = dist.group.WORLD.group_name
    sign = -1.0 if (reduce_op == "sum" and r == 1 and W > 2) else 1.0
    if scaled:  # 16 * 448 * 448 * s = 40000
        A = torch.full((2 * W, 16), 448.0 * sign).to(FP8)
        B = torch.full((4, 16), 448.0).to(FP8).t()
        s = torch.tensor(40000.0 / (16 * 448 * 448))
        out = torch.ops.mptp.fused_scaled_matmul_reduce_scatter(
            A, B, s, torch.tensor(1.0), reduce_op, 0, 0, group, [2 * W, 4], None, None, torch.float16, False)
        partial = torch._scaled_mm(A, B, s, torch.tensor(1.0), out_dtype=torch.float16)
    else:
        A = torch.full((2 * W, 1), 200.0 * sign, dtype=torch.float16)
        B = torch.full((1, 4), 200.0, dtype=torch.float16)
        out = torch.ops.mptp.fused_matmul_reduce_scatter(A, B, reduce_op, 0, group)
        partial = A @ B
    assert partial.eq(40000.0 * sign).all(), partial
    unfused = funcol.reduce_scatter_tensor(partial, reduce_op, 0, group).wait()
    assert out.dtype == torch.float16 and torch.equal(out, unfused), (out, unfused)
    if reduce_op == "avg" or W == 2:  # a running fp16 sum of two 40000s: inf, as gloo's
        assert torch.isinf(out).all(), out


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("reduce_op", ["sum", "avg"])
@pytest.mark.parametrize("scaled", [False, True])
def test_fp16_reduce_scatter_is_the_unfused_collective(request, world, reduce_op, scaled):
    """On gloo the op's reduce-scatter is the unfused collective itself, fp16 summed in fp16 (inf
    where a running sum overflows, the average too): a rank whose graph the pass rewrote pairs
    with a peer running the plain collective, so it must send the same bytes and compute the
    same values (tests/compile/test_rank_divergent.py). The fused path and mptp's own transport
    sum in fp32 (tests/dist/test_fused_gpu.py::test_fp16_reduce_scatter_rounds_once_on_both_paths)."""
    request.getfixturevalue(f"workers{world}").run(_fp16_near_overflow, SEED, reduce_op, scaled)


def _fp8(shape, seed):
    x = randn(shape, seed, scale=0.5)
    return x.to(FP8)


def _ag_scaled_case(seed, shard_shape, gather_dim, mode, ns, with_bias, out_dtype, fast):
    W, r = dist.get_world_size(), dist.get_rank()
    group = dist.group.WORLD.group_name
    K = shard_shape[-1]
    shards = [_fp8(shard_shape, seed + i) for i in range(W)]
    full_shape = list(shard_shape)
    full_shape[gather_dim] *= W
    row_scales = [randn([*shard_shape[:-1], 1], seed + 50 + i).abs() + 0.5 for i in range(W)]
    if mode == "tensor":
        A_scale, full_scale = torch.tensor(0.75), torch.tensor(0.75)
    elif mode == "row_sharded":
        A_scale, full_scale = row_scales[r], torch.cat(row_scales, dim=gather_dim)
    else:  # row_replicated
        full_scale = torch.cat(row_scales, dim=gather_dim)
        A_scale = full_scale
    Bs = [_fp8((n, K), seed + 2000 + j).t() for j, n in enumerate(ns)]  # column-major
    # _scaled_mm pairs tensor-wise with tensor-wise and row-wise with row-wise.
    B_scales = [randn((1, n), seed + 3000 + j).abs() + 0.5 for j, n in enumerate(ns)]
    if mode == "tensor":
        B_scales = [torch.tensor(1.25) for _ in ns]
    biases = [randn((n,), seed + 4000 + j, dtype=torch.bfloat16) if with_bias else None for j, n in enumerate(ns)]
    dtypes = [out_dtype] * len(ns)
    A_full = torch.cat(shards, dim=gather_dim)
    args = (shards[r], Bs, A_scale, B_scales, gather_dim, group, biases, [None] * len(ns), dtypes, [fast] * len(ns))
    A_out, outs = torch.ops.mptp.fused_all_gather_scaled_matmul(*args)
    assert torch.equal(A_out.view(torch.uint8), A_full.view(torch.uint8))
    for j, out in enumerate(outs):
        a64 = A_full.double() * full_scale.double()
        ref = a64 @ (Bs[j].double() * B_scales[j].double())
        if biases[j] is not None:
            ref = ref + biases[j].double()
        assert out.dtype == (out_dtype or FP8)
        eager = ref.to(out.dtype)  # the best the output dtype can hold
        # k=4: fp8 products accumulate in fp32 then round once to out_dtype.
        assert_matmul_close(out, ref, eager, k=4.0, atol=1e-3, what=f"outs[{j}]")
    _check_layout_vs_symm_mem("fused_all_gather_scaled_matmul", args, {}, (A_out, outs))


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("mode", ["tensor", "row_sharded", "row_replicated"])
@pytest.mark.parametrize("shard_shape,gather_dim", [((4, 32), 0), ((2, 3, 32), 1)])
def test_all_gather_scaled_matmul(request, world, mode, shard_shape, gather_dim):
    w = request.getfixturevalue(f"workers{world}")
    w.run(_ag_scaled_case, SEED, shard_shape, gather_dim, mode, (16,), False, torch.bfloat16, False)


@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32])
def test_all_gather_scaled_matmul_bias_multi_b(workers2, out_dtype):
    workers2.run(_ag_scaled_case, SEED, (3, 2, 32), 0, "row_sharded", (16, 32), True, out_dtype, True)


def _rs_scaled_case(seed, shape, scatter_dim, N, mode, reduce_op, with_bias, out_dtype):
    W, r = dist.get_world_size(), dist.get_rank()
    group = dist.group.WORLD.group_name
    K = shape[-1]
    As = [_fp8(shape, seed + i) for i in range(W)]
    if mode == "tensor":
        scales = [torch.tensor(0.5 + 0.25 * i) for i in range(W)]
    else:
        scales = [randn([*shape[:-1], 1], seed + 70 + i).abs() + 0.5 for i in range(W)]
    B = _fp8((N, K), seed + 999).t()
    B_scale = randn((1, N), seed + 998).abs() + 0.5 if mode == "row" else torch.tensor(1.25)
    bias = randn((N,), seed + 997, dtype=torch.bfloat16) if with_bias else None
    parts = [(a.double() * s.double()) @ (B.double() * B_scale.double()) for a, s in zip(As, scales)]
    if bias is not None:
        parts = [p + bias.double() for p in parts]
    ref = sum(parts)
    if reduce_op == "avg":
        ref = ref / W
    ref_chunk = ref.chunk(W, dim=scatter_dim)[r]
    out_shape = [*shape[:-1], N]
    args = (As[r], B, scales[r], B_scale, reduce_op, scatter_dim, scatter_dim, group, out_shape, bias, None, out_dtype, False)
    out = torch.ops.mptp.fused_scaled_matmul_reduce_scatter(*args)
    assert out.dtype == out_dtype
    # Elementwise bound. Each rank's partial accumulates K products in fp32 and rounds to
    # out_dtype (u = eps/2 of it); the W partials are then summed in out_dtype (gloo adds
    # bf16 in bf16: W - 1 more roundings, each within u of a running sum no larger than
    # sum |p_i|), and the result rounds once more. Twice that worst case, plus the fp32
    # accumulation (K * 2**-24 of sum |a||b|). Where partials cancel, a norm-relative
    # tolerance against a single-rounding peer does not hold (it failed 3e-4 of seeds).
    u = torch.finfo(out_dtype).eps / 2
    mag = sum(p.abs() for p in parts)
    absprod = sum((a.double() * s.double()).abs() @ (B.double() * B_scale.double()).abs() for a, s in zip(As, scales))
    if reduce_op == "avg":
        mag, absprod = mag / W, absprod / W
    bound = 2 * u * ((W - 1) * mag + ref.abs()) + K * 2.0**-24 * absprod + 1e-12
    err = (out.double() - ref_chunk).abs()
    b_chunk = bound.chunk(W, dim=scatter_dim)[r]
    assert not torch.isnan(out.float()).any()
    worst = (err / b_chunk).max().item()
    assert worst <= 1.0, f"error {worst:.3f} of the bound (rank {r}, seed {seed})"
    _check_layout_vs_symm_mem("fused_scaled_matmul_reduce_scatter", args, {}, out)


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("mode", ["tensor", "row"])
@pytest.mark.parametrize("shape,scatter_dim", [((6, 32), 0), ((2, 6, 32), 1)])
def test_scaled_matmul_reduce_scatter(request, world, mode, shape, scatter_dim):
    w = request.getfixturevalue(f"workers{world}")
    w.run(_rs_scaled_case, SEED, shape, scatter_dim, 16, mode, "sum", False, torch.bfloat16)


def test_scaled_matmul_reduce_scatter_avg_bias_fp32(workers2):
    workers2.run(_rs_scaled_case, SEED, (4, 32), 0, 16, "row", "avg", True, torch.float32)
