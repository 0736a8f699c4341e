"""Adversarial calls of the ops on the CPU (gloo, MPTP_CHECK_AGREEMENT=1): each case is a
regression test of a defect found by trying the ops as a hostile user would.

Every case asserts the exact outcome on every rank: the correct result (against a
float64 or fp32 oracle computed without communication), or the same ValueError on
every rank, within the case's hard timeout. Before the fixes they aborted a process
(gloo size mismatch), hung in a collective, raised a misleading error, or returned a
silently different result.
"""

import multiprocessing as mp
import os
import random
import time

import pytest
import torch
import torch.distributed as dist

from dist.harness import Workers
from utils import randn

SEED = random.randrange(1 << 30)
ENV = {"MPTP_CHECK_AGREEMENT": "1", "MPTP_TIMEOUT_S": "5"}
FP8 = torch.float8_e4m3fn


@pytest.fixture(scope="module")
def adv2():
    w = Workers(2, env=ENV)
    yield w
    w.close()


def _g():
    return dist.group.WORLD.group_name


def _value_error(fn, *needles):
    try:
        fn()
    except ValueError as e:
        for n in needles:
            assert n in str(e), f"{n!r} not in: {e}"
        return str(e)
    raise AssertionError("expected a ValueError on this rank, the call returned")


def _fp8(shape, seed):
    return randn(shape, seed, scale=0.5).to(FP8)


# -- agreement payload and dtype codes (no processes) --------------------------------------------


def test_agreement_payload_fits_with_many_Bs():
    """A call with 200 Bs overflowed the 512-byte payload (a RuntimeError, or a peer left waiting)."""
    from mptp_kernels.ops import agreement
    from mptp_kernels.ops.agreement import Call

    must = [("A.dtype", 1), ("gather_dim", 0)] + agreement.shape_fields("A", [2, 3, 4, 5, 6, 7, 8, 9, 10])
    call = Call("fused_all_gather_matmul", must, [("num_Bs", 200)] + [(f"Bs[{i}].N", 8) for i in range(200)],
                fusable=True, need=1 << 40, error="x" * 1000)  # fmt: skip
    b = call.encode()
    assert len(b) <= agreement.PAYLOAD_BYTES
    d = agreement.decode(b)
    assert d.must_vals == tuple(v for _, v in must) and d.need == 1 << 40 and d.fusable


@pytest.mark.parametrize("opts,fusable", [((1, 1, 1), (True, True, True)), ((1, 0, 1), (True, True, True)),
                                          ((0, 0, 0), (True, True, True)), ((1, 1), (True, False))])
def test_fused_path_options_are_taken_only_where_every_rank_can(opts, fusable):
    """Call.options (the reduce-scatter's in-matmul sum) travels with the signature, apart from
    `fusable`: every rank resolves the AND of them, and a rank that cannot fuse stays unfused."""
    from mptp_kernels.ops import agreement
    from mptp_kernels.ops.agreement import Call

    must = [("out.dtype", 1), ("scatter_dim", 0)]
    calls = [Call("fused_matmul_reduce_scatter", must, [("K", 8)], fusable=f, need=64, options=o)
             for o, f in zip(opts, fusable)]  # fmt: skip
    payloads = [c.encode() for c in calls]
    for c, b in zip(calls, payloads):
        d = agreement.decode(b)
        assert (d.fusable, d.options) == (c.fusable, c.options)
    want = (all(fusable), 64, int(all(opts)) * agreement.OPT_KERNEL_REDUCE)
    for rank in range(len(calls)):
        assert agreement.resolve(calls[rank], payloads, rank, "g") == want


def test_every_dtype_has_its_own_agreement_code():
    """Unknown dtypes shared one code: complex64 vs complex128 passed the check and gloo aborted."""
    from mptp_kernels.ops.agreement import dtype_code

    dtypes = {d for d in vars(torch).values() if isinstance(d, torch.dtype)}
    codes = {dtype_code(d) for d in dtypes}
    assert len(codes) == len(dtypes)


# -- ranks that disagree where the check could not see it ---------------------------------------


def _complex_mismatch():
    dt = torch.complex64 if dist.get_rank() == 0 else torch.complex128
    A, B = torch.randn(4, 16, dtype=dt), torch.randn(16, 8, dtype=dt)
    return _value_error(lambda: torch.ops.mptp.fused_all_gather_matmul(A, [B], 0, _g()), "disagree", "complex128")


def _A_scale_dtype_mismatch(seed):
    r = dist.get_rank()
    A, B = _fp8((4, 32), seed + r), _fp8((16, 32), seed + 9).t()
    A_scale = torch.rand(4, 1, dtype=torch.float32 if r == 0 else torch.float64) + 0.5
    return _value_error(
        lambda: torch.ops.mptp.fused_all_gather_scaled_matmul(
            A, [B], A_scale, [torch.ones(1, 16)], 0, _g(), [None], [None], [torch.float32], [False]),
        "A_scale", "float32")  # fmt: skip  (a float64 row-wise scale is rejected, as by _scaled_mm)


def test_dtype_mismatches_raise_on_every_rank(adv2):
    adv2.run(_complex_mismatch, timeout_s=60)
    adv2.run(_A_scale_dtype_mismatch, SEED, timeout_s=60)


def _bad_epilogue_on_one_rank(seed, what):
    """Rank 1's B_scale / bias is malformed: raised after agreement, before the reduce-scatter."""
    r = dist.get_rank()
    A, B, one = _fp8((4, 32), seed + r), _fp8((16, 32), seed + 9).t(), torch.ones(())
    B_scale, bias = one, None
    if r == 1 and what == "B_scale":
        B_scale = torch.ones(1, 5)
    if r == 1 and what == "bias":
        bias = torch.zeros(3)
    msg = _value_error(lambda: torch.ops.mptp.fused_scaled_matmul_reduce_scatter(
        A, B, one, B_scale, "sum", 0, 0, _g(), [4, 16], bias, None, torch.float32, False), what)  # fmt: skip
    if r == 0:
        assert "peer rank 1 rejected" in msg, msg


@pytest.mark.parametrize("what", ["B_scale", "bias"])
def test_bad_scaled_epilogue_on_one_rank_raises_on_every_rank(adv2, what):
    # Was: rank 1 raised inside _scaled_mm, rank 0 waited in the reduce-scatter (gloo: 30 min).
    adv2.run(_bad_epilogue_on_one_rank, SEED, what, timeout_s=60)


def _row_shaped_B_scale(seed):
    A, B, one = _fp8((4, 32), seed), _fp8((4, 32), seed + 1).t(), torch.ones(())
    W = dist.get_world_size()
    bad = torch.arange(1.0, 4 * W + 1).view(4 * W, 1)  # A_full's rows: _scaled_mm rejects it
    _value_error(lambda: torch.ops.mptp.fused_all_gather_scaled_matmul(
        A, [B], one, [bad], 0, _g(), [None], [None], [torch.float32], [False]), "B_scales[0]")  # fmt: skip
    _value_error(lambda: torch.ops.mptp.fused_all_gather_scaled_matmul(
        A, [B], one, [one], 0, _g(), [torch.ones(4 * W, 4)], [None], [torch.float32], [False]), "biases[0]")  # fmt: skip


def test_B_scale_of_the_wrong_shape_is_rejected_not_broadcast(adv2):
    # Was: silently applied as a per-row scale on the CPU.
    adv2.run(_row_shaped_B_scale, SEED, timeout_s=60)


# -- inputs the reference could not carry over gloo ---------------------------------------------


def _fp8_output_reduce_scatter(seed, reduce_op):
    from mptp_kernels.ops.reference import scaled_mm

    W, r = dist.get_world_size(), dist.get_rank()
    As = [_fp8((4 * W, 32), seed + i) for i in range(W)]
    B, one = _fp8((16, 32), seed + 99).t(), torch.tensor(0.5)
    out = torch.ops.mptp.fused_scaled_matmul_reduce_scatter(
        As[r], B, one, one, reduce_op, 0, 0, _g(), [4 * W, 16], None, None, None, False)
    assert out.dtype == FP8 and out.shape == (4, 16)
    # The FP8 partials, summed (and averaged) in fp32, rounded once, saturating.
    ref = sum(scaled_mm(a, B, one, one).float() for a in As).chunk(W)[r]
    if reduce_op == "avg":
        ref = ref / W
    ref = ref.clamp(-448, 448).to(FP8)
    assert torch.equal(out.view(torch.uint8), ref.view(torch.uint8))


@pytest.mark.parametrize("reduce_op", ["sum", "avg"])
def test_fp8_output_reduce_scatter(adv2, reduce_op):
    # Was: "Invalid scalar type" (gloo cannot reduce FP8); "avg": FP8 has no division.
    adv2.run(_fp8_output_reduce_scatter, SEED, reduce_op, timeout_s=60)


def _int16(seed):
    W, r = dist.get_world_size(), dist.get_rank()
    g = torch.Generator().manual_seed(seed)
    As = [torch.randint(-50, 50, (2 * W, 8), generator=g, dtype=torch.int16) for _ in range(W)]
    B = torch.randint(-3, 4, (8, 6), generator=g, dtype=torch.int16)
    A_full, (out,) = torch.ops.mptp.fused_all_gather_matmul(As[r], [B], 0, _g())
    assert torch.equal(A_full, torch.cat(As)) and torch.equal(out, torch.cat(As) @ B)
    out = torch.ops.mptp.fused_matmul_reduce_scatter(As[r], B, "avg", 0, _g())
    ref = torch.div(sum(a.long() @ B.long() for a in As), W, rounding_mode="trunc").chunk(W)[r]
    assert out.dtype == torch.int16 and torch.equal(out.long(), ref)


def test_int16_is_carried(adv2):
    # Was: "Invalid scalar type" from gloo.
    adv2.run(_int16, SEED, timeout_s=60)


def _scaled_rs_empty_K():
    A, B, one = torch.zeros(4, 0).to(FP8), torch.zeros(16, 0).to(FP8).t(), torch.ones(())
    out = torch.ops.mptp.fused_scaled_matmul_reduce_scatter(
        A, B, one, one, "sum", 0, 0, _g(), [4, 16], None, None, torch.float32, False)
    assert out.shape == (4 // dist.get_world_size(), 16) and not out.any()


def test_scaled_reduce_scatter_with_empty_K(adv2):
    # Was: "output_shape: expected ... 0 elements" (A.numel() // K with K = 0).
    adv2.run(_scaled_rs_empty_K, timeout_s=60)


# -- allowed differences and edge cases that must keep working ----------------------------------


def _allowed_and_edges(seed):
    import torch.distributed._symmetric_memory  # noqa: F401  (registers symm_mem's Meta impls)

    W, r = dist.get_world_size(), dist.get_rank()
    shards = [randn((2, 3, 16), seed + i, dtype=torch.float64) for i in range(W)]
    full = torch.cat(shards, 1)
    Bs = [randn((16, 4 + i), seed + 50 + i, dtype=torch.float64) for i in range(1 + r)]  # per-rank count
    # gather_dim 1 and -2 normalize equal; return_A differs per rank.
    A_out, outs = torch.ops.mptp.fused_all_gather_matmul(shards[r], Bs, 1 if r == 0 else -2, _g(), return_A=r == 0)
    assert (A_out is None) == (r != 0) and len(outs) == 1 + r
    for o, B in zip(outs, Bs):
        # Not bitwise: the op multiplies the gather-major [3W, 2, 16] A, whose rows MKL may block
        # otherwise than full's (float64 rounding, 1e-16 relative).
        torch.testing.assert_close(o, full @ B, rtol=1e-12, atol=1e-12)
    # 70 Bs: the agreement payload used to overflow.
    _, outs = torch.ops.mptp.fused_all_gather_matmul(shards[r], [Bs[0]] * 70, 0, _g())
    assert len(outs) == 70
    # M = 0 on every rank: empty outputs of symm_mem's shapes and strides.
    B = torch.randn(16, 8)
    for A, gd in ((torch.randn(0, 16), 0), (torch.randn(3, 0, 16), 1)):
        ours = torch.ops.mptp.fused_all_gather_matmul(A, [B], gd, _g())
        theirs = torch.ops.symm_mem.fused_all_gather_matmul(A.to("meta"), [B.to("meta")], gd, _g())
        for o, t in zip([ours[0], *ours[1]], [theirs[0], *theirs[1]]):
            assert o.shape == t.shape and o.stride() == t.stride(), (o.shape, t.shape, o.stride(), t.stride())
    out = torch.ops.mptp.fused_matmul_reduce_scatter(torch.randn(4, 0), torch.randn(0, 8), "avg", 0, _g())
    assert out.shape == (4 // W, 8) and not out.any()
    # Repeated mismatches, then a correct call: the group is still in step.
    for i in range(3):
        _value_error(lambda: torch.ops.mptp.fused_all_gather_matmul(torch.randn(4 + r * (i + 1), 16), [B], 0, _g()),
                     "disagree")  # fmt: skip
    A_out, _ = torch.ops.mptp.fused_all_gather_matmul(torch.full((2, 16), float(r)), [B], 0, _g())
    assert A_out[:, 0].tolist() == [float(p) for p in range(W) for _ in range(2)]


def test_allowed_differences_and_empty_inputs(adv2):
    adv2.run(_allowed_and_edges, SEED, timeout_s=60)


def _non_member_group():
    import mptp_kernels.ops as ops

    sub = dist.new_group([0])  # collective over the world; rank 1 gets NON_GROUP_MEMBER
    A, B = torch.randn(2, 4), torch.randn(4, 3)
    if dist.get_rank() == 0:
        _, (o,) = ops.fused_all_gather_matmul(A, [B], 0, sub)
        assert torch.equal(o, A @ B)
    else:
        _value_error(lambda: ops.fused_all_gather_matmul(A, [B], 0, sub), "not a member")


def test_wrapper_on_a_group_this_rank_is_not_in(adv2):
    # Was: "expected a ProcessGroup, its group_name, or None, got int".
    adv2.run(_non_member_group, timeout_s=60)


# -- the host rendezvous itself ------------------------------------------------------------------


def _rendezvous_peer(path, rank, W, calls, die_at, q):
    from mptp_kernels.symm.rendezvous import PAYLOAD, HostRendezvous, PeerTimeout

    def payload(p, i):
        return bytes([(p * 7 + i) % 256]) * ((i * 37 + p) % (PAYLOAD + 1))

    try:
        h = HostRendezvous(path, rank, W, create=False)
        q.put(("up", rank))
        deadline = time.monotonic() + 30
        while True:  # every peer has written its pid (a dead one is told by it)
            h.read_pids()
            if all(h.pids) or time.monotonic() > deadline:
                break
            time.sleep(0.01)
        for i in range(calls):
            if rank == die_at:
                # NOTE: the queue's feeder thread writes "up" under a lock shared by every
                # process: exiting before it has flushed would leave that lock held and
                # silence the survivors' answers (seen once in CI). Flush, then die.
                q.close()
                q.join_thread()
                os._exit(0)
            out = h.exchange(payload(rank, i), "test", timeout_s=20)
            assert out == [payload(p, i) for p in range(W)], (rank, i)
        q.put(("done", rank, h.seq))
    except PeerTimeout as e:
        q.put(("timeout", rank, str(e)))
    except BaseException as e:  # noqa: BLE001
        q.put(("error", rank, f"{type(e).__name__}: {e}"))


def _rendezvous_run(W, calls, die_at=-1):
    from mptp_kernels.symm.rendezvous import HostRendezvous

    path = HostRendezvous.new_path()
    HostRendezvous(path, 0, W, create=True).close()
    ctx = mp.get_context("fork")  # the peers only touch the shared file: no torch state needed
    q = ctx.Queue()
    procs = [ctx.Process(target=_rendezvous_peer, args=(path, r, W, calls, die_at, q), daemon=True)
             for r in range(W)]  # fmt: skip
    try:
        for p in procs:
            p.start()
        want = W - (die_at >= 0)
        res = []
        deadline = time.monotonic() + 60
        while len(res) < want:
            m = q.get(timeout=max(deadline - time.monotonic(), 0.1))
            if m[0] != "up":
                res.append(m)
        return sorted(res, key=lambda m: m[1])
    finally:
        for p in procs:
            p.join(5)
            if p.is_alive():
                p.kill()
        os.unlink(path)


def test_host_rendezvous_payload_sizes_and_a_dead_peer():
    from mptp_kernels.symm.rendezvous import PAYLOAD, HostRendezvous

    # Payloads of 0..PAYLOAD bytes over 300 calls (both halves reused many times).
    assert _rendezvous_run(3, 300) == [("done", r, 300) for r in range(3)]
    # A peer that exits: the others raise within the poll interval, naming it.
    t0 = time.monotonic()
    res = _rendezvous_run(3, 50, die_at=2)
    assert time.monotonic() - t0 < 30
    assert [m[0] for m in res] == ["timeout", "timeout"], res
    assert all("peer rank 2 has exited" in m[2] for m in res), res
    # Too large a payload is refused before anything is published.
    h = HostRendezvous(HostRendezvous.new_path(), 0, 1, create=True)
    try:
        os.unlink(h.path)
        assert h.exchange(b"x" * PAYLOAD, "w1") == [b"x" * PAYLOAD]
        with pytest.raises(ValueError, match="payload"):
            h.exchange(b"x" * (PAYLOAD + 1), "w1")
        assert h.seq == 1
    finally:
        h.close()
