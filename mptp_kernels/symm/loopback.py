"""Loopback: W simulated ranks in one process, for benchmarks of the real ops on one GPU.

init_loopback_group(W) makes a process group of the "fake" backend (rank 0 of
W, no communication). The group's workspace is a LoopbackSymmetricMemory: the
same object the ops use on a real group, whose W buffers are local
allocations, whose signals to a peer land in this rank's own pad (as if every
peer answered at once), and whose host rendezvous hands back this rank's own
payload for every peer. So a call of torch.ops.mptp.* runs exactly the code of
a real group (validation, dispatch, rendezvous, copies into and out of the
buffers with the copy engine, READY / DONE, the kernels) while the peers'
traffic is the copy engine moving data between local buffers. Values are not
meaningful (the peers' buffers hold zeros, or a copy of this rank's buffer after
mirror_loopback_buffers(), which benchmarks call so that the matmul runs on real
data); times are.
"""

from typing import List

import torch
import torch.distributed as dist

from . import primitives as P


class _LoopbackRendezvous:
    seq = 0

    def __init__(self, world_size: int):
        self.world_size = world_size

    def exchange(self, payload: bytes, what: str, timeout_s=None) -> List[bytes]:
        self.seq += 1
        return [payload] * self.world_size

    def close(self) -> None:
        pass


class LoopbackSymmetricMemory(P.SymmetricMemory):
    """A workspace of W local buffers; a signal to any peer is a signal from every peer to me."""

    def __init__(self, group: dist.ProcessGroup, nbytes: int, device: torch.device):
        self.group = group
        self.group_name = group.group_name
        self.rank = dist.get_rank(group)
        self.world_size = W = dist.get_world_size(group)
        self.device = device = torch.device(device)
        self._freed, self.captured, self.broken = False, False, None
        self.shares_device = W > 1
        self._opened, self._local = [], []
        self.nbytes = max(int(nbytes), 1)
        self.rendezvous = _LoopbackRendezvous(W)
        self.buffers = [torch.zeros(self.nbytes, dtype=torch.uint8, device=device) for _ in range(W)]
        self.pads = [torch.zeros(P.NUM_CHANNELS * W, dtype=torch.int32, device=device) for _ in range(W)]
        self._buf_ptrs = [b.data_ptr() for b in self.buffers]
        self._pad_ptrs = [p.data_ptr() for p in self.pads]
        self.buffer_ptrs = torch.tensor(self._buf_ptrs, dtype=torch.int64, device=device)
        _, dev = P._ErrorRecord.pointers()
        self.err = P.tensor_at(dev, 24, device).view(torch.int32)
        self._init_signals()
        self._init_op_state()

    def _init_signals(self) -> None:
        W, r = self.world_size, self.rank
        own = self._pad_ptrs[r]
        # Slot [ch][p] of MY pad stands for peer p's signal to me.
        slots = [[0 if p == r else own + (ch * W + p) * 4 for p in range(W)] for ch in range(P.NUM_CHANNELS)]
        self._slot_table = torch.tensor(slots, dtype=torch.int64, device=self.device)
        self._expected = torch.zeros(P.NUM_CHANNELS, W, dtype=torch.int32, device=self.device)

    def mirror_local(self) -> None:
        """Copies this rank's buffer into every peer's, so that the chunks an all-gather pulls hold
        data like this rank's (a matmul over zeros runs faster than over real data: times would
        flatter the op). Benchmarks call it after one call of the op."""
        for p, b in enumerate(self.buffers):
            if p != self.rank:
                b.copy_(self.buffers[self.rank])
        torch.cuda.synchronize(self.device)

    def free(self) -> None:
        self._freed = True
        torch.cuda.synchronize(self.device)
        self._destroy_events()
        self.__dict__.pop("_ag_args", None)
        self.last_call = None
        self.buffers, self.pads = [], []

    def abandon(self) -> None:
        self.free()


def mirror_loopback_buffers(group_name: str) -> None:
    """mirror_local() on every loopback workspace of `group_name` (see there)."""
    for ws in list(P._WORKSPACES.values()) + P._RETIRED:
        if isinstance(ws, LoopbackSymmetricMemory) and ws.group_name == group_name and not ws._freed:
            ws.mirror_local()


def is_loopback(group: dist.ProcessGroup) -> bool:
    return str(dist.get_backend(group)).lower() == "fake"


def init_loopback_group(world_size: int) -> str:
    """Initializes the default process group as a loopback of world_size ranks (this process is rank 0).

    Returns its group_name, enabled for mptp symmetric memory.
    """
    from torch.testing._internal.distributed.fake_pg import FakeStore

    import mptp_kernels

    if not dist.is_initialized():
        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world_size)
    g = dist.group.WORLD
    if not is_loopback(g) or dist.get_world_size(g) != world_size:
        raise RuntimeError("init_loopback_group: a non-loopback default process group already exists")
    mptp_kernels.enable_symm_mem_for_group(g.group_name)
    return g.group_name
