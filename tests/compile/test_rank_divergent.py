"""The pass decides per rank, from that rank's graph: ranks may differ in what they fuse.

Found by a hostile review (CPU, gloo): rank 0 logs a statistic of an intermediate (a common
training-loop habit; Dynamo specializes dist.get_rank(), so only rank 0's graph has the extra
output), which makes the pass leave rank 0's collective alone and fuse rank 1's. The fused op
then sent an agreement all-gather the plain collective never sends: the ranks' collectives
paired up wrongly (gloo abort, a hang, or, with a shard the size of the agreement message,
silently wrong values on rank 0). Without the opt-in check (MPTP_CHECK_AGREEMENT=1) the
reference path sends exactly the collectives of the unfused ops, so the ranks interoperate.

Also here: with MPTP_TIMEOUT_S unset, host-side waits for peers use the process group's own
timeout, as its collectives would (a rank late by more than a fixed 60 s, e.g. saving a
checkpoint, ended the job with the pass enabled, and waited without it).
"""

import datetime

import pytest
import torch
import torch.distributed as dist
from dist.harness import Workers

TIMEOUT_S = 300  # hard bound on every multi-process run


@pytest.fixture(scope="module")
def plain2():
    """Two gloo ranks with default MPTP_* settings (agreement off, no MPTP_TIMEOUT_S)."""
    w = Workers(2, env={"MPTP_CHECK_AGREEMENT": "", "MPTP_TIMEOUT_S": ""})
    yield w
    w.close()


def _ints(shape, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(-3, 4, shape, generator=g).float()  # exact sums in fp32


def _divergent(kind, dtype="float32", reduce_op="sum"):
    import torch.distributed._functional_collectives as funcol

    import mptp_kernels
    from mptp_kernels.compile.micro_pipeline import recording

    W, r = dist.get_world_size(), dist.get_rank()
    g = dist.group.WORLD.group_name
    mptp_kernels.enable_symm_mem_for_group(g)

    def row_parallel(x, w):
        partial = x @ w
        out = funcol.reduce_scatter_tensor(partial, reduce_op, 0, g)
        return (out, partial.float().norm()) if dist.get_rank() == 0 else (out, None)

    def col_parallel_last(x, w):
        # The hidden (last) dim, written as funcol's reference form (torch < 2.13's Dynamo cannot
        # trace funcol's gather on dim != 0); a shard's K of 1024 or more (as PyTorch's pass).
        full = funcol.all_gather_tensor(x, 0, g)
        A = torch.cat(torch.chunk(full, W, 0), 1)
        y = A @ w
        return (y, A.float().abs().mean()) if dist.get_rank() == 0 else (y, None)

    def col_parallel_transposed(x, w):
        # Rank 0 writes the same product as a transposed one (not fused: A is not the left operand).
        A = funcol.all_gather_tensor(x, 0, g)
        y = (w.t() @ A.t()).t() if dist.get_rank() == 0 else A @ w
        return (y, None)

    def b_gathered_after(x, wsh):
        # B is gathered after A: fusing would move B's gather above A's on this rank only.
        A = torch.cat(torch.chunk(funcol.all_gather_tensor(x, 0, g), W, 0), 1)
        B = funcol.all_gather_tensor(wsh, 0, g)
        y = A @ B
        return (y, A.abs().mean()) if dist.get_rank() == 0 else (y, None)

    def gather_then_all_reduce(x, w, y):
        # A large fused output used late and an independent all_reduce after it: Inductor's
        # peak-memory reordering sank the fused op (a plain fallback kernel to it) below the
        # all_reduce on rank 1 only; the ranks' collectives paired crosswise (gloo timeout).
        A = torch.cat(torch.chunk(funcol.all_gather_tensor(x, 0, g), W, 0), 1)
        h = A @ w
        z = funcol.all_reduce(y, "sum", g)
        out = h.sum() + z.sum()
        return (out, A.abs().mean()) if dist.get_rank() == 0 else (out, None)

    dt = getattr(torch, dtype)
    if kind == "rs" and reduce_op == "avg" and dt == torch.float16:
        # Partials of 60000 (fp16 max 65504): the backends' fp16 "avg" overflows to inf, so must
        # the fused rank's (which pairs with the plain collective, so runs it, in fp16).
        fn, args = row_parallel, (torch.full((4 * W, 8), 75.0, dtype=dt), torch.full((8, 6), 100.0, dtype=dt))
    elif kind == "rs":
        fn, args = row_parallel, (_ints((4 * W, 8), r).to(dt), _ints((8, 6), 9).to(dt))
    elif kind == "ag_then_all_reduce":
        fn, args = gather_then_all_reduce, (_ints((16, 1024), r), _ints((1024 * W, 4096), 9), _ints((64, 256), 100 + r))
    elif kind == "ag_B_gathered_after":
        fn, args = b_gathered_after, (_ints((4, 1024), r), 10 * _ints((1024, 8), 50 + r))
    elif kind == "ag_last":
        fn, args = col_parallel_last, (_ints((3, 1024), r).to(dt), _ints((1024 * W, 6), 9).to(dt))
    else:  # a [13, 10] fp32 shard: 520 bytes, the size of an agreement message
        fn, args = col_parallel_transposed, (_ints((13, 10), r), _ints((10, 6), 9))
    eager = fn(*args)[0]
    if kind == "rs" and reduce_op == "avg" and dt == torch.float16:
        assert torch.isinf(eager).all(), eager
    torch._dynamo.reset()
    decisions = []
    fast = {"force_disable_caches": True, "compile_threads": 1, "cpp.vec_isa_ok": False}
    with torch._inductor.config.patch(fast), mptp_kernels.enable_micro_pipeline_tp(), recording(decisions):
        out = torch.compile(fn, fullgraph=True)(*args)[0]
    assert out.shape == eager.shape and torch.equal(out, eager), f"rank {r}: compiled != eager"
    return sum(d.fused for d in decisions)


@pytest.mark.parametrize("kind", ["rs", "ag_last", "ag_520_bytes"])
def test_ranks_that_fuse_differently_compute_the_same_values(plain2, kind):
    fused = plain2.run(_divergent, kind, timeout_s=TIMEOUT_S)
    # The case is what it says: rank 0 left its collective alone, rank 1 fused it.
    assert fused == [0, 1], fused


@pytest.mark.parametrize(
    "kind,dtype,reduce_op",
    [("rs", "float16", "sum"), ("rs", "float16", "avg"), ("rs", "bfloat16", "avg"), ("rs", "int8", "sum"),
     ("rs", "float32", "avg"), ("ag_last", "int8", None), ("ag_last", "float16", None)],
)  # fmt: skip
def test_ranks_that_fuse_differently_send_the_same_bytes(plain2, kind, dtype, reduce_op):
    """Found by a hostile review: the fused rank's reduce-scatter sent fp16 as fp32 and int8 as
    int64 (gloo aborted: 48 vs 24 bytes; NCCL would hang or mix sums), and "avg" as a "sum" then a
    division (NCCL: the ranks' ring steps apply different ops). The reference path now runs the
    unfused collective itself: the same dtype and reduce op, so both ranks get the unfused values
    bit for bit (fp16 "avg" of 60000s: inf on both, as the backends' fp16 sum gives)."""
    fused = plain2.run(_divergent, kind, dtype, reduce_op or "sum", timeout_s=TIMEOUT_S)
    assert fused == [0, 1], fused


def test_inductor_keeps_the_fused_op_in_order_with_other_collectives(plain2):
    """Found by a hostile review: Inductor chains collectives in program order before it
    reorders, but a torch.ops.mptp call was not one to it (mptp_kernels/compile/ordering.py)."""
    fused = plain2.run(_divergent, "ag_then_all_reduce", timeout_s=TIMEOUT_S)
    assert fused == [0, 1], fused


def test_a_collective_never_moves_above_the_gather(plain2):
    """Found by a hostile review: fusing moved what B depends on above A's gather, B's own
    all-gather included; with one rank fusing, the ranks' gathers paired crosswise (silently
    wrong values). The pass now leaves such a gather alone on every rank."""
    fused = plain2.run(_divergent, "ag_B_gathered_after", timeout_s=TIMEOUT_S)
    assert fused == [0, 0], fused


def _group_timeout():
    import time

    from mptp_kernels import env

    r = dist.get_rank()
    pg = dist.new_group([0, 1], timeout=datetime.timedelta(seconds=2))
    assert env.host_timeout_s(pg) == 2.0
    A, B = torch.ones(4, 8), torch.ones(8, 4)
    if r == 1:  # skips the call
        time.sleep(8)
        return "skipped"
    start = time.monotonic()
    try:
        torch.ops.mptp.fused_all_gather_matmul(A, [B], 0, pg.group_name)
    except RuntimeError as e:
        took = time.monotonic() - start
        msg = str(e)
        assert "process group's timeout" in msg and "rank 0" in msg, msg
        # The op, the group and the peer that did not arrive (a review: the default path named
        # only "mptp all-gather", and no peer).
        assert "fused_all_gather_matmul" in msg and pg.group_name in msg and "[1]" in msg, msg
        assert took < 6, took
        return "raised"
    raise AssertionError("rank 0 got a result although rank 1 skipped the call")


def test_host_waits_default_to_the_group_timeout(plain2):
    assert plain2.run(_group_timeout, timeout_s=TIMEOUT_S) == ["raised", "skipped"]


def test_mptp_timeout_s_overrides_the_group_timeout(monkeypatch, pg1):
    from mptp_kernels import env

    pg = dist.group.WORLD
    monkeypatch.delenv("MPTP_TIMEOUT_S", raising=False)
    assert env.host_timeout_s(pg) == env.group_timeout_s(pg) > 0
    assert "process group" in env.timeout_source()
    monkeypatch.setenv("MPTP_TIMEOUT_S", "7")
    assert env.host_timeout_s(pg) == 7.0 and env.timeout_source() == "MPTP_TIMEOUT_S"
    assert env.host_timeout_s(None) == 7.0
    monkeypatch.setenv("MPTP_TIMEOUT_S", "-1")
    with pytest.raises(ValueError, match="MPTP_TIMEOUT_S"):
        env.host_timeout_s(pg)
    assert env.host_timeout_s_or_default(pg) == env.group_timeout_s(pg)


def test_the_group_timeout_is_looked_up_once_per_group(pg1):
    """env.group_timeout_s is on every fused call's path: cached per group and device, and a
    new group with another timeout gets its own (a destroyed group's entry goes with it)."""
    from mptp_kernels import env

    pg = dist.new_group([0], timeout=datetime.timedelta(seconds=3))
    assert env.group_timeout_s(pg) == 3.0
    lookups = []
    cls = type(pg)
    # NOTE: restored as the class held it: `cls._get_backend` read off the class is pybind's bare
    # function, which set back on the class no longer binds self, and every later
    # pg._get_backend(device) in the process failed (torch 2.13's FX cache calls it on a hit).
    saved = cls.__dict__.get("_get_backend")
    real = cls._get_backend

    def counting(self, dev):
        lookups.append(dev)
        return real(self, dev)

    try:
        cls._get_backend = counting
        assert env.group_timeout_s(pg) == 3.0 and env.group_timeout_s(pg, "cuda") is not None
        n = len(lookups)
        assert env.group_timeout_s(pg) == 3.0 and env.group_timeout_s(pg, "cuda") == 3.0
        assert len(lookups) == n  # cached
        other = dist.new_group([0], timeout=datetime.timedelta(seconds=5))
        assert env.group_timeout_s(other) == 5.0
    finally:
        if saved is not None:
            cls._get_backend = saved
        else:
            del cls._get_backend
    assert pg._get_backend(torch.device("cpu")) is not None  # binds again
    dist.destroy_process_group(other)
    dist.destroy_process_group(pg)
