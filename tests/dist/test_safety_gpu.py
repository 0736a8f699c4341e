"""Safety of the fused path as a hostile user would test it (issue 12), W processes sharing the GPU.

Each case asserts the exact outcome on every rank: the correct result, or a
clear error within the case's hard timeout; never a wrong value returned. Cases
that poison a process (a timed-out wait) or kill one use their own workers.
"""

import os
import random
import threading
import time

import pytest
import torch
import torch.distributed as dist

from dist.harness import Workers
from utils import assert_matmul_close, randn, skip_without_fused

pytestmark = skip_without_fused()  # no GPU, or the CUDA extension was not built
SEED = random.randrange(1 << 30)
ENV = {"MPTP_FORCE_FUSED": "1", "MPTP_TIMEOUT_S": "5", "MPTP_ASYNC_ERROR_HANDLING": "0"}


def _enable():
    import mptp_kernels

    mptp_kernels.enable_symm_mem_for_group(dist.group.WORLD.group_name)


@pytest.fixture(scope="module", params=[2, 4])
def safe_workers(request):
    w = Workers(request.param, backend="gloo", env=ENV)
    w.run(_enable)
    yield w
    w.close()


def _g():
    return dist.group.WORLD.group_name


def _counts():
    import mptp_kernels

    return mptp_kernels.path_counts()


def _expect(exc, fn, *needles):
    try:
        fn()
        torch.cuda.synchronize()
    except exc as e:
        for n in needles:
            assert n in str(e), f"{n!r} not in {e}"
        return str(e)
    raise AssertionError(f"expected {exc.__name__} on rank {dist.get_rank()}, the call returned")


# -- item 3/4/5: ranks that disagree ---------------------------------------------------------------


def _ag_disagree(seed, what):
    W, r = dist.get_world_size(), dist.get_rank()
    M, K, N, dtype = 128, 256, 256, torch.bfloat16
    last = r == W - 1
    if last and what == "M":
        M = 96
    if last and what == "M_grow":
        M = 4096  # would need a larger workspace on this rank only
    if last and what == "K":
        K = 128
    if last and what == "dtype":
        dtype = torch.float16
    if last and what == "fp32":
        dtype = torch.float32  # this rank's call alone would take the reference path
    A = randn((M, K), seed + r).to("cuda", dtype)
    B = randn((K, N), seed + 9, scale=K**-0.5).to("cuda", dtype)
    msg = _expect(ValueError, lambda: torch.ops.mptp.fused_all_gather_matmul(A, [B], 0, _g()), "disagree")
    # The group is still in step and usable.
    shards = [randn((128, 256), seed + 20 + i) for i in range(W)]
    B2 = randn((256, 256), seed + 10, scale=1 / 16).to("cuda", torch.bfloat16)
    A_out, _ = torch.ops.mptp.fused_all_gather_matmul(shards[r].to("cuda", torch.bfloat16), [B2], 0, _g())
    assert torch.equal(A_out.cpu(), torch.cat(shards).to(torch.bfloat16))
    return msg


@pytest.mark.parametrize("what", ["M", "M_grow", "K", "dtype", "fp32"])
def test_all_gather_matmul_ranks_that_disagree_raise_everywhere(safe_workers, what):
    safe_workers.run(_ag_disagree, SEED, what, timeout_s=120)


def _rs_disagree(seed, what):
    W, r = dist.get_world_size(), dist.get_rank()
    M, K, N = 128 * W, 256, 256
    if r == W - 1 and what == "M":
        M = 64 * W
    if r == W - 1 and what == "N":
        N = 128
    A = randn((M, K), seed + r).to("cuda", torch.bfloat16)
    B = randn((K, N), seed + 9, scale=K**-0.5).to("cuda", torch.bfloat16)
    return _expect(ValueError, lambda: torch.ops.mptp.fused_matmul_reduce_scatter(A, B, "sum", 0, _g()), "disagree")


@pytest.mark.parametrize("what", ["M", "N"])
def test_matmul_reduce_scatter_ranks_that_disagree_raise_everywhere(safe_workers, what):
    safe_workers.run(_rs_disagree, SEED, what, timeout_s=120)


def _mixed_decisions(seed):
    """Per-rank N makes one rank's call big enough to fuse and another's not: all ranks take one path."""
    W, r = dist.get_world_size(), dist.get_rank()
    os.environ["MPTP_FORCE_FUSED"] = "0"
    try:
        shards = [randn((2048, 1024), seed + i) for i in range(W)]
        N = 16384 if r == 0 else 64
        B = randn((1024, N), seed + 50 + r, dtype=torch.float64, scale=1 / 32)
        before = _counts()
        A_out, (out,) = torch.ops.mptp.fused_all_gather_matmul(
            shards[r].to("cuda", torch.bfloat16), [B.to("cuda", torch.bfloat16)], 0, _g())
        torch.cuda.synchronize()
        after = _counts()
    finally:
        os.environ["MPTP_FORCE_FUSED"] = "1"
    full = torch.cat(shards).to(torch.bfloat16)
    assert torch.equal(A_out.cpu(), full)
    assert_matmul_close(out, full.double() @ B, (full.cuda() @ B.to("cuda", torch.bfloat16)).cpu(), k=2.0, atol=1e-4)
    key = ("fused_all_gather_matmul", "reference")
    return after.get(key, 0) - before.get(key, 0)


def test_ranks_take_the_same_path_by_construction(safe_workers):
    took_reference = safe_workers.run(_mixed_decisions, SEED, timeout_s=180)
    assert took_reference == [1] * len(took_reference), took_reference


# -- item 1: int64 indexing ------------------------------------------------------------------------


def _huge(seed):
    """Output of M * N = 2**32 elements per rank (W = 2): sampled rows against float64."""
    W, r = dist.get_world_size(), dist.get_rank()
    M, K, N = 32768, 128, 65536
    shards = [randn((M, K), seed + i, scale=1.0) for i in range(W)]
    B = randn((K, N), seed + 99, dtype=torch.float64, scale=K**-0.5)
    _, (out,) = torch.ops.mptp.fused_all_gather_matmul(
        shards[r].to("cuda", torch.bfloat16), [B.to("cuda", torch.bfloat16)], 0, _g(), return_A=False)
    torch.cuda.synchronize()
    assert out.shape == (W * M, N)
    full = torch.cat(shards).to(torch.bfloat16).double()
    rows = [0, 1, M - 1, M, 2**31 // N - 1, 2**31 // N, 2**31 // N + 1, W * M - 1]
    got = out[rows].cpu()
    ref = full[rows] @ B.to(torch.bfloat16).double()
    assert_matmul_close(got, ref, ref.to(torch.bfloat16), k=2.0, atol=1e-2)
    del out
    torch.cuda.empty_cache()
    return True


def test_int64_indexing_output_of_2_pow_32_elements():
    w = Workers(2, backend="gloo", env=ENV)
    try:
        w.run(_enable)
        w.run(_huge, SEED, timeout_s=400)
    finally:
        w.close()


# -- item 2: dead peers, poisoned outputs, the watchdog ----------------------------------------------


def _dead_peer(seed):
    W, r = dist.get_world_size(), dist.get_rank()
    A = randn((256, 256), seed + r).to("cuda", torch.bfloat16)
    B = randn((256, 256), seed + 9, scale=1 / 16).to("cuda", torch.bfloat16)
    for _ in range(3):
        torch.ops.mptp.fused_all_gather_matmul(A, [B], 0, _g())
    torch.cuda.synchronize()
    if r == W - 1:
        threading.Timer(1.0, os._exit, (0,)).start()  # dies after answering the harness
        return None
    time.sleep(3.0)
    t0 = time.time()
    msg = _expect(RuntimeError, lambda: torch.ops.mptp.fused_all_gather_matmul(A, [B], 0, _g()),
                  f"peer rank {W - 1}", "exited", "fused_all_gather_matmul", _g())
    assert time.time() - t0 < 5.0
    return msg


def test_dead_peer_makes_the_next_call_raise_not_return_garbage():
    w = Workers(2, backend="gloo", env=ENV)
    try:
        w.run(_enable)
        msgs = w.run(_dead_peer, SEED, timeout_s=120)
    finally:
        w.close()
    assert msgs[0] is not None


def _stalled_peer(seed, op):
    """The last rank's GPU stalls past the timeout inside a call: the others' outputs are NaN and they raise."""
    W, r = dist.get_world_size(), dist.get_rank()
    A = randn((256, 256), seed + r).to("cuda", torch.bfloat16)
    Ar = randn((256 * W, 256), seed + 50 + r).to("cuda", torch.bfloat16)
    B = randn((256, 256), seed + 9, scale=1 / 16).to("cuda", torch.bfloat16)
    # All-gather: the gathered A and every one of many outputs must be NaN.
    Bs = [B] * 9
    call = (lambda: torch.cat([t.reshape(-1) for t in (lambda r: [r[0], *r[1]])(
        torch.ops.mptp.fused_all_gather_matmul(A, Bs, 0, _g()))])) if op == "ag" else (
        lambda: torch.ops.mptp.fused_matmul_reduce_scatter(Ar, B, "sum", 0, _g()))  # fmt: skip
    call()
    torch.cuda.synchronize()
    dist.barrier()
    if r == W - 1:
        torch.cuda._sleep(int(12e9))  # ~6-12 s of GPU cycles before this rank's part of the call
    out = call()
    torch.cuda.synchronize()
    if r == W - 1:
        return None
    assert torch.isnan(out.float()).all(), "a call whose wait timed out returned non-NaN values"
    return _expect(RuntimeError, call, "timed out", "MPTP_TIMEOUT_S", f"rank {r}")


@pytest.mark.parametrize("op", ["ag", "rs", "rs-in-matmul"])
def test_timed_out_call_returns_nan_and_the_next_call_raises(op):
    """rs-in-matmul: the reduce-scatter summed inside the matmul (MPTP_RS_REDUCE=kernel), whose
    programs wait for the stalled peer's partials: the wait times out there."""
    extra = {"MPTP_RS_REDUCE": "kernel"} if op == "rs-in-matmul" else {}
    w = Workers(2, backend="gloo", env={**ENV, "MPTP_TIMEOUT_S": "2", **extra})
    try:
        w.run(_enable)
        msgs = w.run(_stalled_peer, SEED, op.split("-")[0], timeout_s=120)
    finally:
        w.close()
    assert msgs[0] is not None
    if op == "rs-in-matmul":
        assert "peer rank 1's partial sums of this rank's chunk" in msgs[0], msgs[0]


def _slow_not_dead_peer(seed, op, path):
    """Rank 1's GPU stalls past the timeout between its READY wait and its reads of the call's
    data (contention, not death), while rank 0's next call times out waiting for it. Rank 0 must
    then write nothing into symmetric memory (fail-stop): rank 1 still reads rank 0's buffer, or
    reduces what rank 0 writes into its own, for the older call. Every output of every rank is
    either right for its own call or NaN, never another call's data; then both ranks raise."""
    from mptp_kernels.symm import primitives as P

    if path == "reference":
        os.environ["MPTP_DISABLE_FUSED"] = "1"
        os.environ.pop("MPTP_FORCE_FUSED", None)
    W, r = dist.get_world_size(), dist.get_rank()
    B_host = randn((256, 256), seed + 9, scale=1 / 16).to(torch.bfloat16)
    B = B_host.cuda()

    def inputs(call, rank):
        return randn((256, 256), seed + 1000 * call + rank).to(torch.bfloat16)

    # NOTE: on the GPU before the stall: a copy from pageable host memory waits for the stream, so
    # rank 1's host would stall with its GPU and miss call 2's host rendezvous (a PeerTimeout,
    # seen on the H100), where the GPU-side waits are what this test is about.
    A_of = [inputs(call, r).cuda() for call in range(4)]

    def run(call):
        A = A_of[call]
        if op == "ag":
            return torch.ops.mptp.fused_all_gather_matmul(A, [B], 0, _g())[1][0]
        return torch.ops.mptp.fused_matmul_reduce_scatter(A, B, "sum", 0, _g())

    def want(call):
        As = [inputs(call, p).double() for p in range(W)]  # CPU only: no wait for the GPU
        if op == "ag":
            return torch.cat(As) @ B_host.double()
        return sum(a @ B_host.double() for a in As).chunk(W)[r]

    run(0)  # creates the workspace
    torch.cuda.synchronize()
    dist.barrier()
    if r == 1:
        orig_wait, orig_barrier = P.SymmetricMemory.wait_signal, P.SymmetricMemory.barrier

        def stall(channel):
            if channel == P.CH_READY:
                P.SymmetricMemory.wait_signal, P.SymmetricMemory.barrier = orig_wait, orig_barrier
                torch.cuda._sleep(int(8e9))  # ~4-5 s of GPU cycles, after READY, before the reads

        def slow_wait(self, channel, peers=None, tag=0, stream=None):
            orig_wait(self, channel, peers, tag, stream)
            stall(channel)

        def slow_barrier(self, channel=P.CH_BARRIER, tag=0, stream=None):
            orig_barrier(self, channel, tag, stream)
            stall(channel)

        P.SymmetricMemory.wait_signal, P.SymmetricMemory.barrier = slow_wait, slow_barrier
        if op == "ag" and path == "fused":
            P.ag_begin = _ag_begin_stalled_after_ready(P.ag_begin)
    outs = [run(1), run(2)]
    torch.cuda.synchronize()
    nan = []
    for call, out in zip((1, 2), outs):
        out = out.float().cpu()
        if torch.isnan(out).all():
            nan.append(call)
            continue
        assert not torch.isnan(out).any(), f"rank {r} call {call}: partly NaN"
        ref = want(call)
        # k=4 over the bf16 rounding of the exact result: bf16 inputs are exact, the output is
        # rounded once (all-gather) or its partials once each before the fp32 sum (reduce-scatter).
        assert_matmul_close(out, ref, ref.to(torch.bfloat16), k=4.0, atol=1e-4, what=f"rank {r} call {call}")
    assert 2 in nan, f"rank {r}: the call that timed out returned values"
    _expect(RuntimeError, lambda: run(3), "timed out")
    return nan


def _ag_begin_stalled_after_ready(orig):
    """P.ag_begin for one call, step by step as csrc ag_begin takes them, with the stall of
    _slow_not_dead_peer between READY and the pulls (the fused all-gather makes its waits and
    transfers in that one C call, where no Python can come between them); then the original."""
    from mptp_kernels.symm import _C
    from mptp_kernels.symm import primitives as P

    def once(a):
        P.ag_begin = orig
        lib, W = _C.lib(), a.world_size
        assert a.nscale == 0  # the test's calls are bf16
        _C.check(lib.mptp_wait(a.main, a.done_slots, a.done_expected, W, a.mask, a.timeout_ns,
                               a.done_channel, a.tag), "wait")  # fmt: skip
        _C.check(lib.mptp_copy_guarded(a.main, a.copy_dst, a.copy_src, a.copy_bytes, a.ncopy), "copy")
        _C.check(lib.mptp_write_value(a.main, a.own_flag, 1), "flag")
        _C.check(lib.mptp_signal_wait(a.main, a.ready_sig, a.ready_slots, a.ready_expected, W, a.mask,
                                      a.timeout_ns, a.ready_channel, a.tag), "ready")  # fmt: skip
        assert (a.main or 0) == torch.cuda.current_stream().cuda_stream  # ctypes reads NULL as None
        torch.cuda._sleep(int(8e9))  # ~4-5 s of GPU cycles, after READY, before the reads
        fork = torch.cuda.Event()
        fork.record()
        side = torch.cuda.ExternalStream(a.side)
        side.wait_event(fork)
        n = a.npull
        dsts = [a.full_base + a.peers[i] * a.chunk_bytes for i in range(n)]
        P.pull_at(a.side, dsts, list(a.pull_src[:n]), [a.chunk_bytes] * n, list(a.pull_flag[:n]))
        _C.check(lib.mptp_signal(a.side, a.done_sig, W), "done")

    return once


@pytest.mark.parametrize("op,path", [("ag", "fused"), ("rs", "fused"), ("ag", "reference"), ("rs", "reference")])
def test_a_slow_peer_never_reads_the_next_call_data(op, path):
    w = Workers(2, backend="gloo", env={**ENV, "MPTP_TIMEOUT_S": "2"})
    try:
        w.run(_enable)
        nan = w.run(_slow_not_dead_peer, SEED, op, path, timeout_s=150)
    finally:
        w.close()
    assert nan[0] == [2], nan  # rank 0: its first call ran before the stall


def _watchdog_abort(seed):
    W, r = dist.get_world_size(), dist.get_rank()
    A = randn((256, 256), seed + r).to("cuda", torch.bfloat16)
    B = randn((256, 256), seed + 9, scale=1 / 16).to("cuda", torch.bfloat16)
    torch.ops.mptp.fused_all_gather_matmul(A, [B], 0, _g())
    torch.cuda.synchronize()
    dist.barrier()
    if r == 1:
        torch.cuda._sleep(int(12e9))
    torch.ops.mptp.fused_all_gather_matmul(A, [B], 0, _g())
    if r == 0:
        time.sleep(20)  # never surfaces the error itself: the watchdog must end the process
        return "still alive"
    torch.cuda.synchronize()
    return "rank 1 done"


def test_watchdog_aborts_a_process_that_never_sees_its_error():
    w = Workers(2, backend="gloo", env={**ENV, "MPTP_TIMEOUT_S": "2", "MPTP_ASYNC_ERROR_HANDLING": "2"})
    try:
        w.run(_enable)
        with pytest.raises(AssertionError, match=r"dead ranks: \[0\]"):
            w.run(_watchdog_abort, SEED, timeout_s=30)
    finally:
        w.close()


# -- item 6: CUDA graphs ------------------------------------------------------------------------------


def _graph_first_call_in_capture(seed, n):
    """The group's first fused call happens inside capture (after reserve); replays are correct,
    and stay correct after a later eager call grows the workspace."""
    import mptp_kernels.symm as symm

    W, r = dist.get_world_size(), dist.get_rank()
    dt = torch.bfloat16
    symm.reserve(_g(), 4 << 20)
    A = torch.empty(128, 256, device="cuda", dtype=dt)
    Ar = torch.empty(128 * W, 256, device="cuda", dtype=dt)
    B = randn((256, 256), seed + 99, scale=1 / 16).to("cuda", dt)
    torch.cuda.synchronize()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(s), torch.cuda.graph(graph, stream=s):
        _, (C,) = torch.ops.mptp.fused_all_gather_matmul(A, [B], 0, _g())
        R = torch.ops.mptp.fused_matmul_reduce_scatter(Ar, B, "sum", 0, _g())
    torch.cuda.synchronize()

    def check(i):
        shards = [randn((128, 256), seed + 1000 * i + p) for p in range(W)]
        rs_in = [randn((128 * W, 256), seed + 1000 * i + 500 + p) for p in range(W)]
        A.copy_(shards[r].to(dt))
        Ar.copy_(rs_in[r].to(dt))
        graph.replay()
        torch.cuda.synchronize()
        full = torch.cat(shards).to(dt).double()
        Bd = B.double().cpu()
        assert_matmul_close(C, full @ Bd, (full.to(dt).cuda() @ B).cpu(), k=2.0, atol=1e-4, what=f"replay {i} AG")
        ref = sum(x.to(dt).double() @ Bd for x in rs_in).chunk(W)[r]
        assert_matmul_close(R, ref, ref.to(dt), k=3.0, atol=1e-3, what=f"replay {i} RS")

    for i in range(n):
        check(i)
    # Grow the workspace with a bigger eager call: the captured graph keeps its buffers.
    big = randn((4096, 1024), seed + r).to("cuda", dt)
    torch.ops.mptp.fused_all_gather_matmul(big, [randn((1024, 256), seed).to("cuda", dt)], 0, _g())
    torch.cuda.synchronize()
    for i in range(n, 2 * n):
        check(i)
    symm.check_errors()


def test_first_call_inside_cuda_graph_capture_and_growth_after_capture():
    w = Workers(2, backend="gloo", env=ENV)
    try:
        w.run(_enable)
        w.run(_graph_first_call_in_capture, SEED, 5, timeout_s=300)
    finally:
        w.close()


# -- item 7: group lifecycle --------------------------------------------------------------------------


def _lifecycle(seed):
    import mptp_kernels

    W, r = dist.get_world_size(), dist.get_rank()
    names = []
    for round_ in range(3):
        g = dist.new_group(list(range(W)), backend="gloo")
        names.append(g.group_name)
        mptp_kernels.enable_symm_mem_for_group(g)
        shards = [randn((128, 256), seed + 10 * round_ + p) for p in range(W)]
        B = randn((256, 128), seed + 99, scale=1 / 16).to("cuda", torch.bfloat16)
        A_out, _ = torch.ops.mptp.fused_all_gather_matmul(shards[r].to("cuda", torch.bfloat16), [B], 0, g.group_name)
        torch.cuda.synchronize()
        assert torch.equal(A_out.cpu(), torch.cat(shards).to(torch.bfloat16)), f"round {round_}"
        dist.destroy_process_group(g)
    mptp_kernels.shutdown()
    _enable()
    return names


def test_recreated_groups_never_reuse_a_dead_groups_workspace():
    w = Workers(2, backend="gloo", env=ENV)
    try:
        w.run(_enable)
        w.run(_lifecycle, SEED, timeout_s=180)
    finally:
        w.close()


# -- item 8: FP8 out_dtypes -----------------------------------------------------------------------------


def _fp8_out(seed, fp8_out):
    W, r = dist.get_world_size(), dist.get_rank()
    FP8 = torch.float8_e4m3fn
    shards = [randn((64, 128), seed + i, scale=0.5).to(FP8) for i in range(W)]
    B = (randn((128, 128), seed + 9) * 2).to(FP8).t().contiguous().t()
    a_s, b_s, rs = torch.tensor(0.5), torch.tensor(0.25), torch.tensor(2.0)
    A_out, (out,) = torch.ops.mptp.fused_all_gather_scaled_matmul(
        shards[r].cuda(), [B.cuda()], a_s.cuda(), [b_s.cuda()], 0, _g(), [None], [rs.cuda()], [fp8_out], [False])
    torch.cuda.synchronize()
    from mptp_kernels.ops.reference import scaled_mm

    full = torch.cat(shards).cuda()
    # The ops' definition: the result scale multiplies (torch 2.11's CUDA _scaled_mm ignores it).
    eager = scaled_mm(full, B.cuda(), a_s.cuda(), b_s.cuda(), None, rs.cuda(), fp8_out)
    assert out.dtype == fp8_out
    assert torch.equal(A_out.view(torch.uint8), full.view(torch.uint8))
    # Against float64, not bitwise against cuBLAS: Hopper's FP8 MMA accumulates a BLOCK_K slab
    # with about 14 bits kept (DeepSeek-V3, sec. 3.3.2), promoted to fp32 per slab when
    # use_fast_accum=False, and cuBLAS promotes on its own schedule: where terms cancel, the two
    # round to FP8 values 2 ulps apart (seen on the H200, e5m2: -2**-12 vs -1.5 * 2**-13). Bound:
    # an FP8 ulp of the exact value (rounding, from a value that may sit across a binade) + 2**-12
    # of the sum of |terms| (accumulation), for ours and for cuBLAS alike; a scale off by 2x fails.
    exact = (full.double().cpu() @ B.double()) * (0.5 * 0.25 * 2.0)
    fmax = torch.finfo(fp8_out).max
    terms = (full.double().cpu().abs() @ B.double().abs()) * (0.5 * 0.25 * 2.0)
    ulp = torch.exp2(torch.floor(torch.log2(exact.abs().clamp_min(torch.finfo(fp8_out).smallest_normal)))
                     - (2 if fp8_out == torch.float8_e5m2 else 3))  # fmt: skip
    bound = ulp + 2.0**-12 * terms + 1e-30
    for name, got in (("ours", out), ("cuBLAS", eager)):
        err = (got.double().cpu() - exact.clamp(-fmax, fmax)).abs()
        bad = (err > bound).nonzero()
        assert bad.numel() == 0, (f"{name}: {bad.shape[0]} of {out.numel()} elements off float64 by more than "
                                  f"an FP8 ulp + 2**-12 of |terms|; first at {bad[0].tolist()}: "
                                  f"{got.float()[tuple(bad[0])].item()} vs {exact[tuple(bad[0])].item()}")  # fmt: skip


@pytest.mark.parametrize("fp8_out", [torch.float8_e4m3fn, torch.float8_e5m2], ids=str)
def test_fp8_out_dtypes_are_accepted(safe_workers, fp8_out):
    safe_workers.run(_fp8_out, SEED, fp8_out, timeout_s=120)
