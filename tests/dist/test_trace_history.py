"""An eager call gives what it gives in a fresh process whatever was traced before it (2 gloo
ranks): the size-1 strides of the gathered A after a torch.compile of the same call equal PyTorch's
fallback's, and an unsupported dtype is refused before any communication on every rank after a
fake-tensor trace of it, also where only one rank traced (found by a hostile review, session 20)."""

import warnings

import pytest
import torch
import torch.distributed as dist

from dist.harness import Workers

TIMEOUT_S = 120


@pytest.fixture(scope="module")
def fresh2():
    # Own workers: the caches under test are per process, and must start empty.
    w = Workers(2, env={"MPTP_TIMEOUT_S": "10"})
    yield w
    w.close()


def _strides_after_compile():
    import torch.distributed._symmetric_memory as sm

    g = dist.group.WORLD.group_name
    torch.manual_seed(dist.get_rank())
    A, B = torch.randn(1, 3, 16), torch.randn(16, 8)
    torch._dynamo.reset()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        f = torch.compile(lambda A, B: torch.ops.mptp.fused_all_gather_matmul(A, [B], 1, g), fullgraph=True,
                          backend="aot_eager")  # fmt: skip
        f(A, B)
    ours = torch.ops.mptp.fused_all_gather_matmul(A, [B], 1, g)
    theirs = sm._fused_all_gather_matmul_fallback(A, [B], 1, g)
    return (ours[0].stride(), theirs[0].stride(), ours[1][0].stride(), theirs[1][0].stride(),
            torch.equal(ours[0], theirs[0]))  # fmt: skip


def test_strides_after_a_compile_are_the_fallbacks(fresh2):
    for ours_a, theirs_a, ours_c, theirs_c, same in fresh2.run(_strides_after_compile, timeout_s=TIMEOUT_S):
        assert ours_a == theirs_a and ours_c == theirs_c and same, (ours_a, theirs_a, ours_c, theirs_c)


def _unsupported_after_a_trace(trace_ranks, dtype):
    from torch._subclasses.fake_tensor import FakeTensorMode

    g = dist.group.WORLD.group_name
    A, B = torch.zeros(2, 4, dtype=dtype), torch.zeros(4, 3, dtype=dtype)
    out = []
    if dist.get_rank() in trace_ranks:
        mode = FakeTensorMode()
        with mode:
            try:
                torch.ops.mptp.fused_all_gather_matmul(mode.from_tensor(A), [mode.from_tensor(B)], 0, g)
                out.append("fake: returned")
            except ValueError as e:
                out.append(f"fake: ValueError {e}")
    for fn in (lambda: torch.ops.mptp.fused_all_gather_matmul(A, [B], 0, g),
               lambda: torch.ops.mptp.fused_matmul_reduce_scatter(A, B, "sum", 0, g)):  # fmt: skip
        try:
            fn()
            out.append("returned")
        except Exception as e:  # noqa: BLE001
            out.append(f"{type(e).__name__}: {e}")
    return out


# (a dtype per case: each starts with nothing cached in these processes)
@pytest.mark.parametrize("trace_ranks,dtype", [((0, 1), torch.uint16), ((0,), torch.uint32)])
def test_an_unsupported_dtype_is_refused_before_communicating_after_a_trace(fresh2, trace_ranks, dtype):
    for rank, out in enumerate(fresh2.run(_unsupported_after_a_trace, trace_ranks, dtype, timeout_s=TIMEOUT_S)):
        eager = out[-2:]
        assert all(o.startswith("ValueError") and f"dtype {dtype}" in o for o in eager), (rank, out)
        if rank in trace_ranks:  # the trace is refused alike: what compiles, runs
            assert out[0].startswith("fake: ValueError"), (rank, out)
