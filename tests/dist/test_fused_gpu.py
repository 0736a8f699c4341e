"""The fused CUDA ops against float64 references, W = 1, 2, 4 processes sharing the GPU.

The process group is gloo (NCCL refuses two ranks on one GPU); the fused path
only uses it to exchange IPC handles. Inputs are fresh per run; outputs come
from an allocator poisoned with NaN; the gathered A is compared bitwise.
"""

import random
import time

import pytest
import torch
import torch.distributed as dist

from dist.harness import Workers
from utils import assert_matmul_close, randn, skip_without_fused

pytestmark = skip_without_fused()  # no GPU, or the CUDA extension was not built
SEED = random.randrange(1 << 30)
FP8 = torch.float8_e4m3fn
ENV = {"MPTP_FORCE_FUSED": "1", "MPTP_LOG": "1"}


@pytest.fixture(scope="module", params=[1, 2, 4])
def fused_workers(request):
    w = Workers(request.param, backend="gloo", env=ENV)
    w.run(_enable)
    yield w
    w.close()


def _enable():
    import mptp_kernels

    mptp_kernels.enable_symm_mem_for_group(dist.group.WORLD.group_name)


def _poison_allocator():
    x = torch.full((64 << 20,), float("nan"), device="cuda", dtype=torch.float32)
    del x


def _fused_count(name):
    from mptp_kernels.ops.dispatch import PATH_COUNTS

    return PATH_COUNTS[(name, "fused")]


def _ag(seed, shard_shape, gather_dim, ns, return_A, dtype):
    W, r = dist.get_world_size(), dist.get_rank()
    g = dist.group.WORLD.group_name
    K = shard_shape[-1]
    shards = [randn(shard_shape, seed + i) for i in range(W)]
    Bs64 = [randn((K, n), seed + 100 + j, dtype=torch.float64, scale=K**-0.5) for j, n in enumerate(ns)]
    A_full = torch.cat([s.to(dtype) for s in shards], dim=gather_dim)
    before = _fused_count("fused_all_gather_matmul")
    _poison_allocator()
    A_out, outs = torch.ops.mptp.fused_all_gather_matmul(
        shards[r].to("cuda", dtype), [b.to("cuda", dtype) for b in Bs64], gather_dim, g, return_A=return_A)
    torch.cuda.synchronize()
    assert _fused_count("fused_all_gather_matmul") == before + 1, "the fused path did not run"
    if return_A:
        assert torch.equal(A_out.cpu(), A_full)
    else:
        assert A_out is None
    for j, (out, B64) in enumerate(zip(outs, Bs64)):
        ref = A_full.double() @ B64
        eager = (A_full.cuda() @ B64.to("cuda", dtype)).cpu()
        assert_matmul_close(out, ref, eager, k=2.0, atol=1e-4, what=f"outs[{j}]")
    _check_strides_vs_reference(A_out, outs, shards[r].to(dtype), [b.to(dtype) for b in Bs64], gather_dim, return_A)


def _check_strides_vs_reference(A_out, outs, shard, Bs, gather_dim, return_A):
    from torch._subclasses.fake_tensor import FakeTensorMode

    g = dist.group.WORLD.group_name
    shard, Bs = shard.cuda(), [b.cuda() for b in Bs]
    with FakeTensorMode() as m:
        fa, fouts = torch.ops.mptp.fused_all_gather_matmul(
            m.from_tensor(shard), [m.from_tensor(b) for b in Bs], gather_dim, g, return_A=return_A)
    for o, f in zip(outs, fouts):
        assert o.shape == f.shape and o.stride() == f.stride(), (o.stride(), f.stride())
    if return_A:
        assert A_out.stride() == fa.stride()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize(
    "shard_shape,gather_dim,ns,return_A",
    [((256, 512), 0, (384,), True), ((100, 256), 0, (200, 72, 136, 64), False), ((2, 96, 256), 1, (384, 128), True),
     ((3, 40, 128), 0, (136,), True),
     # 9 Bs: more outputs than one launch of the consumer takes (pointer kernel, groups of Bs)
     ((64, 128), 0, (64, 80, 96, 64, 72, 64, 88, 64, 104), True)],
)  # fmt: skip
def test_fused_all_gather_matmul(fused_workers, dtype, shard_shape, gather_dim, ns, return_A):
    fused_workers.run(_ag, SEED, shard_shape, gather_dim, ns, return_A, dtype)


def _strided(t):
    """t's values in a view with strides (every other element of a wider tensor), on the GPU."""
    if t is None or t.numel() == 1:
        return t.cuda() if t is not None else None
    return torch.stack([t, torch.full_like(t, 7.0)], dim=-1).cuda()[..., 0]


def _ag_scaled(seed, shard_shape, gather_dim, mode, ns, with_bias, out_dtype, strided=False):
    W, r = dist.get_world_size(), dist.get_rank()
    g = dist.group.WORLD.group_name
    K = shard_shape[-1]
    shards = [randn(shard_shape, seed + i, scale=0.5).to(FP8) for i in range(W)]
    row_scales = [randn([*shard_shape[:-1], 1], seed + 50 + i).abs() + 0.5 for i in range(W)]
    if mode == "tensor":
        A_scale = full_scale = torch.tensor(0.75)
    elif mode == "row_sharded":
        A_scale, full_scale = row_scales[r], torch.cat(row_scales, dim=gather_dim)
    else:
        A_scale = full_scale = torch.cat(row_scales, dim=gather_dim)
    Bs = [(randn((n, K), seed + 200 + j) * 4).to(FP8).t() for j, n in enumerate(ns)]
    if mode == "tensor":
        B_scales = [torch.tensor(0.25) for _ in ns]
    else:
        B_scales = [randn((1, n), seed + 300 + j).abs() / 4 + 0.1 for j, n in enumerate(ns)]
    biases = [randn((n,), seed + 400 + j).to(out_dtype) if with_bias else None for j, n in enumerate(ns)]
    before = _fused_count("fused_all_gather_scaled_matmul")
    _poison_allocator()
    cu = _strided if strided else (lambda t: t.cuda() if t is not None else None)  # noqa: E731
    A_out, outs = torch.ops.mptp.fused_all_gather_scaled_matmul(
        shards[r].cuda(), [b.cuda() for b in Bs], cu(A_scale), [cu(s) for s in B_scales], gather_dim, g,
        [cu(b) for b in biases], [None] * len(ns), [out_dtype] * len(ns), [True] * len(ns))
    torch.cuda.synchronize()
    assert _fused_count("fused_all_gather_scaled_matmul") == before + 1, "the fused path did not run"
    A_full = torch.cat(shards, dim=gather_dim)
    assert torch.equal(A_out.cpu().view(torch.uint8), A_full.view(torch.uint8))
    for j, out in enumerate(outs):
        ref = (A_full.double() * full_scale.double()) @ (Bs[j].double() * B_scales[j].double())
        if with_bias:
            ref = ref + biases[j].double()
        assert out.dtype == out_dtype
        assert_matmul_close(out, ref, ref.to(out_dtype), k=4.0, atol=2e-3, what=f"outs[{j}]")


@pytest.mark.parametrize("mode", ["tensor", "row_sharded", "row_replicated"])
@pytest.mark.parametrize("shard_shape,gather_dim,with_bias,out_dtype",
                         [((128, 256), 0, False, torch.bfloat16), ((2, 72, 128), 1, True, torch.float32)])  # fmt: skip
def test_fused_all_gather_scaled_matmul(fused_workers, mode, shard_shape, gather_dim, with_bias, out_dtype):
    fused_workers.run(_ag_scaled, SEED, shard_shape, gather_dim, mode, (256, 136), with_bias, out_dtype)


@pytest.mark.parametrize("mode", ["row_sharded", "row_replicated"])
def test_fused_all_gather_scaled_matmul_strided_scales_and_biases(fused_workers, mode):
    """Scales and biases that are strided views (read as if contiguous before the fix: wrong values)."""
    fused_workers.run(_ag_scaled, SEED, (2, 72, 128), 1, mode, (256, 136), True, torch.float32, True)


def _rs(seed, shape, scatter_dim, N, reduce_op, dtype):
    W, r = dist.get_world_size(), dist.get_rank()
    g = dist.group.WORLD.group_name
    shape = list(shape)
    shape[scatter_dim] *= W
    K = shape[-1]
    As = [randn(shape, seed + i) for i in range(W)]
    B64 = randn((K, N), seed + 999, dtype=torch.float64, scale=K**-0.5)
    ref = sum(a.double() @ B64 for a in As) / (W if reduce_op == "avg" else 1)
    eager = sum((a.to(dtype).cuda() @ B64.to("cuda", dtype)).float().cpu() for a in As) / (W if reduce_op == "avg" else 1)
    before = _fused_count("fused_matmul_reduce_scatter")
    _poison_allocator()
    out = torch.ops.mptp.fused_matmul_reduce_scatter(As[r].to("cuda", dtype), B64.to("cuda", dtype), reduce_op, scatter_dim, g)
    torch.cuda.synchronize()
    assert _fused_count("fused_matmul_reduce_scatter") == before + 1, "the fused path did not run"
    assert out.is_contiguous() and out.dtype == dtype
    # k=3: partials are rounded to the output dtype before the fp32 reduction.
    assert_matmul_close(out, ref.chunk(W, dim=scatter_dim)[r], eager.chunk(W, dim=scatter_dim)[r], k=3.0, atol=1e-4)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("shape,scatter_dim,N,reduce_op",
                         [((128, 512), 0, 384, "sum"), ((100, 256), 0, 136, "avg"), ((2, 64, 256), 1, 200, "sum")])  # fmt: skip
def test_fused_matmul_reduce_scatter(fused_workers, dtype, shape, scatter_dim, N, reduce_op):
    fused_workers.run(_rs, SEED, shape, scatter_dim, N, reduce_op, dtype)


def _rs_fp16_near_overflow(reduce_op, path):
    """Partials of +-40000 (fp16 max 65504; signs + + - - by rank): the average and the sum of
    four fit fp16, a sum of two does not. Both paths sum in fp32 and round once."""
    import os

    from mptp_kernels.ops.dispatch import PATH_COUNTS

    W, r = dist.get_world_size(), dist.get_rank()
    g = dist.group.WORLD.group_name
    signs = [1.0, 1.0, -1.0, -1.0][:W]
    A = torch.full((2 * W, 1), 200.0 * signs[r], dtype=torch.float16, device="cuda")
    B = torch.full((1, 4), 200.0, dtype=torch.float16, device="cuda")
    want = 40000.0 * sum(signs) / (W if reduce_op == "avg" else 1)
    want = torch.full((2, 4), want, dtype=torch.float64).to(torch.float16)
    env = {"MPTP_FORCE_FUSED": "1" if path == "fused" else "0", "MPTP_DISABLE_FUSED": "1" if path == "reference" else "0"}
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        before = PATH_COUNTS[("fused_matmul_reduce_scatter", path)]
        out = torch.ops.mptp.fused_matmul_reduce_scatter(A, B, reduce_op, 0, g)
        torch.cuda.synchronize()
        assert PATH_COUNTS[("fused_matmul_reduce_scatter", path)] == before + 1, f"the {path} path did not run"
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    torch.testing.assert_close(out.cpu(), want, rtol=2**-10, atol=0)


@pytest.mark.parametrize("path", ["fused", "reference"])
@pytest.mark.parametrize("reduce_op", ["sum", "avg"])
def test_fp16_reduce_scatter_rounds_once_on_both_paths(fused_workers, reduce_op, path):
    """Found by a hostile review: the reference path summed fp16 partials in fp16 and divided
    for "avg" after the rounding (inf where the average fits; the fused path gave the average)."""
    fused_workers.run(_rs_fp16_near_overflow, reduce_op, path)


def _rs_scaled(seed, shape, N, mode, with_bias, out_dtype, strided=False):
    W, r = dist.get_world_size(), dist.get_rank()
    g = dist.group.WORLD.group_name
    shape = list(shape)
    shape[0] *= W
    K = shape[-1]
    As = [randn(shape, seed + i, scale=0.5).to(FP8) for i in range(W)]
    if mode == "tensor":
        scales = [torch.tensor(0.5 + 0.25 * i) for i in range(W)]
        B_scale = torch.tensor(0.25)
    else:
        scales = [randn([*shape[:-1], 1], seed + 70 + i).abs() + 0.5 for i in range(W)]
        B_scale = randn((1, N), seed + 998).abs() / 4 + 0.1
    B = (randn((N, K), seed + 999) * 4).to(FP8).t()
    bias = randn((N,), seed + 997).to(out_dtype) if with_bias else None
    parts = [(a.double() * s.double()) @ (B.double() * B_scale.double()) for a, s in zip(As, scales)]
    if with_bias:
        parts = [p + bias.double() for p in parts]
    ref = sum(parts).chunk(W)[r]
    eager = sum(p.to(out_dtype).double() for p in parts).chunk(W)[r]
    before = _fused_count("fused_scaled_matmul_reduce_scatter")
    cu = _strided if strided else (lambda t: t.cuda() if t is not None else None)  # noqa: E731
    _poison_allocator()
    out = torch.ops.mptp.fused_scaled_matmul_reduce_scatter(
        As[r].cuda(), B.cuda(), cu(scales[r]), cu(B_scale), "sum", 0, 0, g, [*shape[:-1], N],
        cu(bias), None, out_dtype, True)
    torch.cuda.synchronize()
    assert _fused_count("fused_scaled_matmul_reduce_scatter") == before + 1, "the fused path did not run"
    assert_matmul_close(out, ref, eager, k=4.0, atol=2e-3)


@pytest.mark.parametrize("mode", ["tensor", "row"])
@pytest.mark.parametrize("with_bias,out_dtype", [(False, torch.bfloat16), (True, torch.float32)])
def test_fused_scaled_matmul_reduce_scatter(fused_workers, mode, with_bias, out_dtype):
    fused_workers.run(_rs_scaled, SEED, (96, 256), 136, mode, with_bias, out_dtype)


def test_fused_scaled_matmul_reduce_scatter_strided_scales_and_biases(fused_workers):
    fused_workers.run(_rs_scaled, SEED, (96, 256), 136, "row", True, torch.float32, True)


def _alternating_streams(seed, calls):
    """Calls on two streams in turn, no synchronization between them, the first stream delayed
    on the GPU now and then: the dispatcher orders each call after the previous one of its group
    (an event, ops/dispatch.py _guard), which share the workspace's buffers, flags and signal
    counters. Every call must compute its own values."""
    W, r = dist.get_world_size(), dist.get_rank()
    g = dist.group.WORLD.group_name
    M, K, N = 256, 512, 384
    B64 = randn((K, N), seed + 1, dtype=torch.float64, scale=K**-0.5)
    B = B64.to("cuda", torch.bfloat16)
    shards = [[randn((M, K), seed + 1000 * i + p) for p in range(W)] for i in range(calls)]
    # NOTE: on the GPU before the loop: a copy from pageable memory would wait for the delayed stream
    mine = [sh[r].to("cuda", torch.bfloat16) for sh in shards]
    streams = [torch.cuda.Stream(), torch.cuda.Stream()]
    for s in streams:
        s.wait_stream(torch.cuda.current_stream())
    before = _fused_count("fused_all_gather_matmul"), _fused_count("fused_matmul_reduce_scatter")
    _poison_allocator()
    outs = []
    for i in range(calls):
        s = streams[i % 2]
        with torch.cuda.stream(s):
            if i % 4 == 0:
                torch.cuda._sleep(20_000_000)  # this stream's call starts late on the GPU
            A = mine[i]
            ag = torch.ops.mptp.fused_all_gather_matmul(A, [B], 0, g)[1][0]
            A_rs = torch.cat([A] * W) if W > 1 else A  # [W * M, K]: this rank's rows of every chunk
            rs = torch.ops.mptp.fused_matmul_reduce_scatter(A_rs, B, "sum", 0, g)
            outs.append((ag, rs))
    torch.cuda.synchronize()
    after = _fused_count("fused_all_gather_matmul"), _fused_count("fused_matmul_reduce_scatter")
    assert after == (before[0] + calls, before[1] + calls), "the fused path did not run"
    for i, (ag, rs) in enumerate(outs):
        A_full = torch.cat([a.to(torch.bfloat16) for a in shards[i]])
        ref = A_full.double() @ B64
        eager = (A_full.cuda() @ B).float().cpu()
        assert_matmul_close(ag, ref, eager, k=2.0, atol=1e-4, what=f"call {i}: all-gather")
        # chunk r of sum_p cat([A_p] * W) @ B is sum_p A_p @ B
        ref_rs = sum(a.to(torch.bfloat16).double() @ B64 for a in shards[i])
        eager_rs = sum((a.to("cuda", torch.bfloat16) @ B).float().cpu() for a in shards[i])
        assert_matmul_close(rs, ref_rs, eager_rs, k=3.0, atol=1e-4, what=f"call {i}: reduce-scatter")


def test_calls_on_alternating_streams_compute_their_own_values(fused_workers):
    fused_workers.run(_alternating_streams, SEED, 12)


def _same_signature_new_values(seed):
    """Calls of one signature with new values each time: the later ones take the dispatcher's memo
    (the plan rebound to their arguments, ops/dispatch.py) and still compute their own values."""
    from mptp_kernels.ops import dispatch

    hits = dispatch.MEMO_STATS["hit"]
    for i in range(3):
        s = seed + 7919 * (i + 1)
        _ag(s, (2, 40, 128), 1, (96, 80), True, torch.bfloat16)
        _ag_scaled(s, (64, 128), 0, "row_sharded", (256, 136), True, torch.float32)
        _rs(s, (128, 256), 0, 136, "avg", torch.float16)
        _rs_scaled(s, (96, 256), 136, "row", True, torch.float32)
    assert dispatch.MEMO_STATS["hit"] - hits >= 8, "the later calls did not take the memo"


def test_calls_of_one_signature_with_new_values(fused_workers):
    fused_workers.run(_same_signature_new_values, SEED)


def _other_current_device(seed):
    """The op runs on A's device while the caller's current device is another GPU."""
    W, r = dist.get_world_size(), dist.get_rank()
    g = dist.group.WORLD.group_name
    dev = torch.device("cuda", torch.cuda.current_device())
    other = (dev.index + 1) % torch.cuda.device_count()
    shards = [randn((64, 128), seed + i) for i in range(W)]
    B = randn((128, 96), seed + 99, scale=128**-0.5)
    with torch.cuda.device(other):
        for _ in range(2):  # the first call creates the workspace, the second reuses it
            A_out, (out,) = torch.ops.mptp.fused_all_gather_matmul(shards[r].to(dev, torch.bfloat16),
                                                                  [B.to(dev, torch.bfloat16)], 0, g)  # fmt: skip
            rs = torch.ops.mptp.fused_matmul_reduce_scatter(shards[r].to(dev, torch.bfloat16),
                                                           B.to(dev, torch.bfloat16), "sum", 0, g)  # fmt: skip
        assert torch.cuda.current_device() == other
    torch.cuda.synchronize(dev)
    A_full = torch.cat(shards).double()
    assert out.device == dev and rs.device == dev
    assert_matmul_close(out, A_full @ B.double(), (A_full.to(torch.bfloat16).float() @ B.to(torch.bfloat16).float()),
                        k=2.0, atol=1e-4)  # fmt: skip
    ref_rs = sum(s.double() @ B.double() for s in shards).chunk(W)[r]
    assert_matmul_close(rs, ref_rs, ref_rs.float(), k=3.0, atol=1e-3)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs (ranks on different GPUs)")
def test_calls_run_on_A_device_whatever_the_current_device(fused_workers):
    fused_workers.run(_other_current_device, SEED)


def _stress(seed, n):
    """Back-to-back calls alternating ops, dtypes and shapes: results stay bitwise stable."""
    W, r = dist.get_world_size(), dist.get_rank()
    g = dist.group.WORLD.group_name
    cases = []
    for i, (dtype, rows, K, N) in enumerate([(torch.bfloat16, 128, 256, 384), (torch.float16, 96, 512, 136),
                                             (torch.bfloat16, 64, 128, 256)]):  # fmt: skip
        A = randn((rows, K), seed + 10 * i + r).to("cuda", dtype)
        Ar = randn((rows * W, K), seed + 10 * i + 5 + r).to("cuda", dtype)
        B = randn((K, N), seed + 10 * i + 9, scale=K**-0.5).to("cuda", dtype)
        cases.append((A, Ar, B))
    calls = [lambda A=A, B=B: torch.ops.mptp.fused_all_gather_matmul(A, [B], 0, g)[1][0] for A, _, B in cases]
    calls += [lambda Ar=Ar, B=B: torch.ops.mptp.fused_matmul_reduce_scatter(Ar, B, "sum", 0, g) for _, Ar, B in cases]
    expected = [c().clone() for c in calls]
    torch.cuda.synchronize()
    mem0 = torch.cuda.memory_allocated()
    order = random.Random(seed).choices(range(len(calls)), k=n)
    bad = 0
    for k, i in enumerate(order):
        out = calls[i]()
        if k % 50 == 0 or k == n - 1:
            torch.cuda.synchronize()
        bad += int(not torch.equal(out, expected[i]))
    torch.cuda.synchronize()
    from mptp_kernels.symm import check_errors

    check_errors()
    assert bad == 0, f"{bad} of {n} calls differ from the first result"
    mem1 = torch.cuda.memory_allocated()
    assert mem1 - mem0 < 16 << 20, f"memory grew by {(mem1 - mem0) >> 20} MiB"


def test_1000_back_to_back_calls(fused_workers):
    if fused_workers.world_size == 1:
        pytest.skip("W=1 has no communication to stress")
    fused_workers.run(_stress, SEED, 1000, timeout_s=600)


def _graph(seed, n):
    W, r = dist.get_world_size(), dist.get_rank()
    g = dist.group.WORLD.group_name
    dtype = torch.bfloat16
    A = randn((128, 256), seed + r).to("cuda", dtype)
    Ar = randn((128 * W, 256), seed + 50 + r).to("cuda", dtype)
    B = randn((256, 384), seed + 99, scale=1 / 16).to("cuda", dtype)
    B2 = randn((384, 256), seed + 98, scale=1 / 16).to("cuda", dtype)

    def step():
        _, (C,) = torch.ops.mptp.fused_all_gather_matmul(A, [B], 0, g)
        return C, torch.ops.mptp.fused_matmul_reduce_scatter(Ar @ B, B2, "sum", 0, g)

    for _ in range(2):
        step()  # warm-up: workspaces sized, kernels compiled
    torch.cuda.synchronize()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(s):
        with torch.cuda.graph(graph, stream=s):
            C_g, R_g = step()
    torch.cuda.synchronize()
    for i in range(n):
        A.copy_(randn((128, 256), seed + 1000 * (i + 1) + r).to(dtype))
        Ar.copy_(randn((128 * W, 256), seed + 1000 * (i + 1) + 50 + r).to(dtype))
        graph.replay()
        if i % 10 == 9 or i == n - 1:
            torch.cuda.synchronize()
            C_e, R_e = step()
            torch.cuda.synchronize()
            assert torch.equal(C_g, C_e), f"replay {i}: all-gather-matmul differs from eager"
            assert torch.equal(R_g, R_e), f"replay {i}: matmul-reduce-scatter differs from eager"
    from mptp_kernels.symm import check_errors

    check_errors()


def test_cuda_graph_100_replays_equal_eager(fused_workers):
    fused_workers.run(_graph, SEED, 100, timeout_s=600)


def _never_joins(timeout_s):
    import mptp_kernels.symm as symm

    g = dist.group.WORLD.group_name
    _enable()
    symm.reserve(g, 8 << 20)
    torch.cuda.synchronize()
    dist.barrier()
    if dist.get_rank() == 1:
        return None
    A = torch.randn(128, 256, device="cuda", dtype=torch.bfloat16)
    B = torch.randn(256, 256, device="cuda", dtype=torch.bfloat16)
    t0 = time.time()
    # The call's host rendezvous sees that rank 1 never arrives: it raises before any GPU work.
    with pytest.raises(RuntimeError) as info:
        torch.ops.mptp.fused_all_gather_matmul(A, [B], 0, g)
    elapsed = time.time() - t0
    msg = str(info.value)
    assert "fused_all_gather_matmul" in msg and "rank 0" in msg and "peer rank 1" in msg and g in msg, msg
    assert elapsed < timeout_s + 15, elapsed
    return msg


def test_rank_that_never_joins_makes_others_raise():
    w = Workers(2, backend="gloo", env={**ENV, "MPTP_TIMEOUT_S": "3"})
    try:
        msgs = w.run(_never_joins, 3.0, timeout_s=180)
    finally:
        w.close()
    assert msgs[0] is not None


# -- the reduce-scatter's sum inside the matmul (MPTP_RS_REDUCE) --------------------------------------
# By default the sum runs after the matmul and a barrier (pass); "kernel" sums inside the matmul,
# here across processes on the one GPU these tests have (its waits are then for a time-sliced
# peer's kernel: slow, but every result must be right).


@pytest.fixture(scope="module", params=[2, 4])
def kernel_reduce_workers(request):
    w = Workers(request.param, backend="gloo", env={**ENV, "MPTP_RS_REDUCE": "kernel"})
    w.run(_enable)
    w.run(_prove_tma)
    yield w
    w.close()


def _prove_tma():
    """A first TMA launch: the in-matmul sum is offered only once one has run in the process."""
    from mptp_kernels.kernels import persistent_matmul as pm

    x = torch.ones(128, 128, device="cuda", dtype=torch.bfloat16)
    pm.persistent_matmul(x, [x])
    torch.cuda.synchronize()
    assert pm.TMA_PROVEN


def _summed(where, fn, *args):
    """fn(*args) on this rank; every fused reduce-scatter call of it summed `where`."""
    from mptp_kernels.ops.fused import RS_SUMS

    before = dict(RS_SUMS)
    out = fn(*args)
    grew = {k: RS_SUMS[k] - before.get(k, 0) for k in ("kernel", "pass")}
    other = "pass" if where == "kernel" else "kernel"
    assert grew[where] >= 1 and grew[other] == 0, f"sums taken: {grew}, expected all {where!r}"
    return out


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("shape,scatter_dim,N,reduce_op",
                         [((128, 512), 0, 384, "sum"), ((100, 256), 0, 136, "avg"), ((2, 64, 256), 1, 200, "sum"),
                          ((512, 256), 0, 1024, "avg")])  # fmt: skip
def test_reduce_scatter_summed_in_the_matmul(kernel_reduce_workers, dtype, shape, scatter_dim, N, reduce_op):
    kernel_reduce_workers.run(_summed, "kernel", _rs, SEED, shape, scatter_dim, N, reduce_op, dtype)


@pytest.mark.parametrize("mode", ["tensor", "row"])
@pytest.mark.parametrize("with_bias,out_dtype", [(False, torch.bfloat16), (True, torch.float32)])
def test_scaled_reduce_scatter_summed_in_the_matmul(kernel_reduce_workers, mode, with_bias, out_dtype):
    kernel_reduce_workers.run(_summed, "kernel", _rs_scaled, SEED, (96, 256), 136, mode, with_bias, out_dtype)


def test_in_matmul_sum_in_cuda_graph_replays_equals_eager(kernel_reduce_workers):
    """The arrival flags are zeroed inside the captured call: every replay waits anew."""
    kernel_reduce_workers.run(_summed, "kernel", _graph, SEED, 30, timeout_s=600)


def test_in_matmul_sum_back_to_back_calls(kernel_reduce_workers):
    kernel_reduce_workers.run(_summed, "kernel", _stress, SEED, 300, timeout_s=600)


def _rs_env_per_rank(seed, values):
    import os

    os.environ["MPTP_RS_REDUCE"] = values[dist.get_rank()]
    try:
        return _summed("pass", _rs, seed, (128, 512), 0, 384, "sum", torch.bfloat16)
    finally:
        os.environ["MPTP_RS_REDUCE"] = "kernel"


def test_ranks_that_cannot_all_sum_in_the_matmul_all_sum_after_it(kernel_reduce_workers):
    """One rank may not sum in the matmul (here MPTP_RS_REDUCE=pass on the last rank; elsewhere a
    misaligned A, or a GPU shared with a peer): the protocols differ (arrival flags against a
    barrier), so the ranks agree on the pass, and the results are right."""
    W = kernel_reduce_workers.world_size
    kernel_reduce_workers.run(_rs_env_per_rank, SEED, ["kernel"] * (W - 1) + ["pass"])


def test_the_reduce_scatter_sums_after_the_matmul_by_default(fused_workers):
    if fused_workers.world_size == 1:
        pytest.skip("W=1 does not reduce")
    fused_workers.run(_summed, "pass", _rs, SEED, (128, 512), 0, 384, "sum", torch.bfloat16)
