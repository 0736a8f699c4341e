"""Symmetric memory on the GPU: W processes (sharing one GPU where there is only one).

Skips cleanly without a GPU or without the compiled extension.
"""

import os
import time

import pytest
import torch
import torch.distributed as dist

from dist.harness import Workers
from utils import skip_without_fused

pytestmark = skip_without_fused()  # no GPU, or the CUDA extension was not built


@pytest.fixture(scope="module", params=[2, 4])
def gpu_workers(request):
    w = Workers(request.param, backend="gloo")
    yield w
    w.close()


def _ws(nbytes=1 << 20):
    from mptp_kernels.symm import primitives as P

    g = dist.group.WORLD
    return P.SymmetricMemory(g, nbytes, torch.device("cuda", torch.cuda.current_device()))


def _all_pairs_read_write():
    sm = _ws()
    W, r = sm.world_size, sm.rank
    n = sm.nbytes // 4
    mine = sm.buffers[r].view(torch.int32)
    mine.copy_(torch.arange(n, dtype=torch.int32, device=mine.device) * 7 + r)
    sm.barrier()  # stream-ordered: our writes are visible to peers after this
    for p in range(W):
        got = sm.buffers[p].view(torch.int32)[-1024:].clone()
        want = torch.arange(n - 1024, n, dtype=torch.int32, device=got.device) * 7 + p
        assert torch.equal(got, want), f"rank {r} reads wrong data from rank {p}"
    sm.barrier()
    torch.cuda.synchronize()
    sm.check()
    sm.free()


def test_all_pairs_read_write(gpu_workers):
    gpu_workers.run(_all_pairs_read_write)


def _signal_pairs():
    """Each ordered pair (i, j): i writes a value into j's buffer, then signals j only."""
    sm = _ws()
    W, r = sm.world_size, sm.rank
    for i in range(W):
        for j in range(W):
            if i == j:
                continue
            if r == i:
                sm.buffers[j][:4].view(torch.int32).fill_(100 * i + j)
                sm.put_signal(channel=3, peers=[j])
            if r == j:
                sm.wait_signal(channel=3, peers=[i])
                v = sm.buffers[j][:4].view(torch.int32).item()
                assert v == 100 * i + j, f"pair ({i},{j}): read {v}"
            sm.barrier()
    torch.cuda.synchronize()
    sm.check()
    sm.free()


def test_signal_wait_all_pairs(gpu_workers):
    gpu_workers.run(_signal_pairs)


def _barrier_rounds(n):
    sm = _ws()
    W, r = sm.world_size, sm.rank
    counter = torch.zeros(1, dtype=torch.int32, device="cuda")
    for i in range(n):
        sm.barrier()
    torch.cuda.synchronize()
    sm.check()
    slots = sm.pads[r][: W].cpu()  # channel 0, one slot per peer
    assert all(slots[p].item() == n for p in range(W) if p != r), slots.tolist()
    del counter
    sm.free()


def test_1000_barrier_rounds(gpu_workers):
    gpu_workers.run(_barrier_rounds, 1000)


def _graph_replays(n):
    sm = _ws()
    W, r = sm.world_size, sm.rank
    buf = sm.buffers[r][:4].view(torch.int32)
    nxt = sm.buffers[(r + 1) % W][:4].view(torch.int32)
    seen = torch.zeros(n, dtype=torch.int32, device="cuda")
    step = torch.zeros(1, dtype=torch.int64, device="cuda")
    buf.zero_()
    sm.barrier()
    torch.cuda.synchronize()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    g = torch.cuda.CUDAGraph()
    with torch.cuda.stream(s):
        with torch.cuda.graph(g, stream=s):
            nxt.add_(1)  # bump the next rank's counter
            sm.barrier()  # everyone's bump for this round is done
            seen.index_copy_(0, step, buf.clone())
            step.add_(1)
            sm.barrier()  # nobody bumps again before all read
    for _ in range(n):
        g.replay()
    torch.cuda.synchronize()
    sm.check()
    # Round i: every rank's counter was bumped exactly i + 1 times.
    assert seen.tolist() == list(range(1, n + 1)), seen.tolist()[:10]
    del g
    sm.free()


def test_cuda_graph_signal_wait_barrier_100_replays(gpu_workers):
    gpu_workers.run(_graph_replays, 100)


def _misuse_is_refused():
    """A channel out of range, or a freed workspace, is refused on the host: the signals use
    cached device addresses, which would otherwise be read past the table or after the free."""
    from mptp_kernels.symm import primitives as P

    sm = _ws()
    for call in (lambda: sm.put_signal(P.NUM_CHANNELS), lambda: sm.wait_signal(-1), lambda: sm.barrier(99)):
        with pytest.raises(ValueError, match="channel"):
            call()
    sm.barrier()  # the refused calls left the counters alone: the group still pairs
    torch.cuda.synchronize()
    sm.check()
    sm.free()
    for call in (lambda: sm.put_signal(P.CH_READY), lambda: sm.wait_signal(P.CH_READY), lambda: sm.barrier()):
        with pytest.raises(RuntimeError, match="freed"):
            call()


def test_channel_out_of_range_and_freed_workspace_are_refused(gpu_workers):
    gpu_workers.run(_misuse_is_refused)


def _alloc_free_cycles(n):
    from mptp_kernels.symm import primitives as P

    # Warm-up: the first cycle creates the context's IPC state and the host-mapped error record.
    for _ in range(5):
        P.SymmetricMemory(dist.group.WORLD, 4 << 20, torch.device("cuda", torch.cuda.current_device())).free()
    torch.cuda.synchronize()
    free0, _ = torch.cuda.mem_get_info()
    for _ in range(n):
        P.SymmetricMemory(dist.group.WORLD, 4 << 20, torch.device("cuda", torch.cuda.current_device())).free()
    torch.cuda.synchronize()
    free1, _ = torch.cuda.mem_get_info()
    return free0, free1


def test_1000_alloc_free_cycles_leave_memory_flat():
    w = Workers(2, backend="gloo")
    try:
        res = w.run(_alloc_free_cycles, 1000, timeout_s=600)
    finally:
        w.close()
    # Two processes share the GPU: compare each rank's view, allowing 64 MiB of noise
    # from the other process's allocator.
    for free0, free1 in res:
        assert free0 - free1 < 64 << 20, f"device memory fell by {(free0 - free1) >> 20} MiB"


def _missing_peer(timeout_s):
    sm = _ws()
    r = sm.rank
    torch.cuda.synchronize()
    dist.barrier()
    if r == 1:
        return None  # never signals
    t0 = time.time()
    sm.barrier()
    torch.cuda.synchronize()
    elapsed = time.time() - t0
    with pytest.raises(RuntimeError) as info:
        sm.check()
    msg = str(info.value)
    assert "rank 0" in msg and "peer rank 1" in msg and "barrier" in msg and "group" in msg, msg
    assert elapsed < timeout_s + 10, elapsed
    return msg


def test_missing_peer_times_out_with_a_clear_error():
    # Own workers: a timeout poisons the process's symmetric memory on purpose.
    w = Workers(2, backend="gloo", env={"MPTP_TIMEOUT_S": "3"})
    try:
        msgs = w.run(_missing_peer, 3.0, timeout_s=120)
    finally:
        w.close()
    assert msgs[0] is not None
