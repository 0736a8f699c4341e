"""SymmetricMemory, signal / wait / barrier, and the per-group workspace.

Memory ordering:
  * put_signal adds 1 to slot [channel][self] of each peer's signal pad with
    red.release.sys (one tiny kernel, after all earlier work of the stream),
    so everything the stream wrote before is visible to a peer that sees it.
  * wait_signal launches one tiny block that spins with ld.acquire.sys on the
    local pad until slot [channel][p] reaches expected[channel][p] + 1 for each
    awaited peer p, then advances expected (acquire: work after it on the
    stream sees what the peer wrote before signalling).
  * Slots and expected counters only count up (mod 2^32, compared signed) and
    are never reset on the critical path.

CUDA graphs: both are kernels whose counters live in device memory, so a
captured signal / wait / barrier stays correct on every replay.

Timeouts: the wait kernel gives up after MPTP_TIMEOUT_S, records (channel,
peer, expected, seen, tag) in host-mapped memory and lets the stream go on;
check_errors() (called at the start of every op and by barrier()) raises a
RuntimeError naming op, group, rank and peer. Later waits of the process
return at once, so one missing peer costs one timeout.

Chunk-arrival flags that a persistent matmul spins on are written with
cuStreamWriteValue32 (write_value), never by a kernel: the matmul may hold
every SM, and a memop needs none.

Pseudo-code of a barrier on rank r:
    for p != r: atomic_add(pad[p][ch][r], 1)               # signal kernel
    for p != r: spin until pad[r][ch][p] >= ++expected[ch][p]   # wait kernel
"""

import ctypes
from typing import Dict, List, Optional

import torch
import torch.distributed as dist

from .. import env
from . import _C

NUM_CHANNELS = 16
CH_BARRIER = 0
_TAGS: Dict[int, str] = {0: "barrier"}


def register_tag(name: str) -> int:
    """An integer naming an op in timeout errors."""
    for k, v in _TAGS.items():
        if v == name:
            return k
    k = len(_TAGS)
    _TAGS[k] = name
    return k


class _CudaArray:
    """Exposes a raw device pointer to torch.as_tensor (no copy)."""

    def __init__(self, ptr: int, nbytes: int, owner=None):
        self.__cuda_array_interface__ = {
            "shape": (nbytes,),
            "typestr": "|u1",
            "data": (ptr, False),
            "version": 3,
            "strides": None,
        }
        self._owner = owner


def tensor_at(ptr: int, nbytes: int, device: torch.device, owner=None) -> torch.Tensor:
    """A uint8 tensor over nbytes of device memory at ptr."""
    with torch.cuda.device(device):
        return torch.as_tensor(_CudaArray(ptr, nbytes, owner), device=device)


def _lib():
    lib = _C.lib()
    if lib is None:
        raise RuntimeError(f"mptp_kernels symmetric memory: {_C.why_unavailable()}")
    return lib


class _ErrorRecord:
    _host: Optional[int] = None
    _dev: Optional[int] = None

    @classmethod
    def pointers(cls):
        if cls._host is None:
            h, d = ctypes.c_void_p(), ctypes.c_void_p()
            _C.check(_lib().mptp_error_record(ctypes.byref(h), ctypes.byref(d)), "mptp_error_record")
            cls._host, cls._dev = h.value, d.value
        return cls._host, cls._dev

    @classmethod
    def read(cls):
        if cls._host is None:
            return None
        rec = (ctypes.c_int32 * 6).from_address(cls._host)
        return list(rec) if rec[0] else None


_GROUP_OF_ERRORS: Dict[int, str] = {}


def check_errors(group_name: str = "?", rank: int = -1) -> None:
    """Raises RuntimeError if any wait of this process timed out."""
    rec = _ErrorRecord.read()
    if rec is None:
        return
    _, channel, peer, expected, seen, tag = rec
    what = _TAGS.get(tag, f"tag {tag}")
    if channel == -1:
        detail = f"waiting for chunk {peer} (copied from peer rank {peer}) to arrive"
    else:
        detail = f"waiting for peer rank {peer} on channel {channel}"
    raise RuntimeError(
        f"mptp {what}: timed out after {env.timeout_s():g}s (MPTP_TIMEOUT_S) on group "
        f"{group_name!r}, rank {rank}, {detail} (expected epoch {expected}, saw {seen}). "
        "A peer did not join the call or died; this process's symmetric memory is now "
        "unusable: restart the job."
    )


class SymmetricMemory:
    """One buffer per rank of `group`, mapped by every rank, plus signal pads.

    Attributes:
        buffers: list of W uint8 tensors (rank r's buffer, as seen from here).
        buffer_ptrs: device tensor [W] int64 of those pointers (for kernels).
        pads: list of W int32 tensors [NUM_CHANNELS * W] (rank r's signal pad).
    """

    def __init__(self, group: dist.ProcessGroup, nbytes: int, device: torch.device):
        lib = _lib()
        self.group = group
        self.group_name = group.group_name
        self.rank = dist.get_rank(group)
        self.world_size = W = dist.get_world_size(group)
        self.device = device = torch.device(device)
        self._freed = False
        self._local: List[int] = []
        self._opened: List[int] = []
        with torch.cuda.device(device):
            buf, granted = self._alloc(lib, max(nbytes, 1))
            pad, _ = self._alloc(lib, NUM_CHANNELS * W * 4)
        self.nbytes = granted
        # Phase 1: export the local handles as bytes.
        hb = lib.mptp_ipc_handle_bytes()
        handles = []
        for ptr in (buf, pad):
            h = ctypes.create_string_buffer(hb)
            _C.check(lib.mptp_export_handle(ctypes.c_void_p(ptr), h), "cudaIpcGetMemHandle")
            handles.append(h.raw)
        # Phase 2: exchange over the process group, then open the peers'.
        all_handles: List = [None] * W
        dist.all_gather_object(all_handles, (handles, granted, str(device)), group=group)
        sizes = {g for _, g, _ in all_handles}
        if len(sizes) != 1:
            raise RuntimeError(f"SymmetricMemory: ranks asked for different sizes {sorted(sizes)}")
        buf_ptrs, pad_ptrs = [], []
        for r, (hs, _, _) in enumerate(all_handles):
            if r == self.rank:
                buf_ptrs.append(buf)
                pad_ptrs.append(pad)
                continue
            opened = []
            for h in hs:
                p = ctypes.c_void_p()
                with torch.cuda.device(device):
                    rc = lib.mptp_import_handle(h, ctypes.byref(p))
                if rc != 0:
                    msg = lib.mptp_last_error().decode(errors="replace")
                    raise RuntimeError(
                        f"SymmetricMemory: rank {self.rank} cannot map rank {r}'s memory on group "
                        f"{self.group_name!r} ({msg}). The fused path needs all ranks' GPUs in one "
                        "node with peer access; use the reference path (MPTP_DISABLE_FUSED=1)."
                    )
                opened.append(p.value)
                self._opened.append(p.value)
            buf_ptrs.append(opened[0])
            pad_ptrs.append(opened[1])
        self.buffers = [tensor_at(p, granted, device, self) for p in buf_ptrs]
        self.pads = [tensor_at(p, NUM_CHANNELS * W * 4, device, self).view(torch.int32) for p in pad_ptrs]
        self._buf_ptrs, self._pad_ptrs = buf_ptrs, pad_ptrs
        self.buffer_ptrs = torch.tensor(buf_ptrs, dtype=torch.int64, device=device)
        host, dev = _ErrorRecord.pointers()
        self.err = tensor_at(dev, 24, device).view(torch.int32)
        self._init_signals()
        self._self_check()

    @staticmethod
    def _alloc(lib, nbytes):
        p, g = ctypes.c_void_p(), ctypes.c_size_t()
        _C.check(lib.mptp_alloc(nbytes, ctypes.byref(p), ctypes.byref(g)), "mptp_alloc")
        return p.value, g.value

    def _self_check(self) -> None:
        """Every rank writes a pattern into its buffer; every rank reads all of them."""
        W, r = self.world_size, self.rank
        with torch.cuda.device(self.device):
            mine = self.buffers[r][:64].view(torch.int32)
            mine.copy_(torch.arange(16, dtype=torch.int32, device=self.device) + 1000 * (r + 1))
            torch.cuda.synchronize()
            dist.barrier(group=self.group)
            for p in range(W):
                got = self.buffers[p][:64].view(torch.int32).cpu()
                want = torch.arange(16, dtype=torch.int32) + 1000 * (p + 1)
                if not torch.equal(got, want):
                    raise RuntimeError(
                        f"SymmetricMemory self-check failed on group {self.group_name!r}: rank {r} "
                        f"reads {got[:4].tolist()} from rank {p}'s buffer, expected {want[:4].tolist()}"
                    )
            dist.barrier(group=self.group)

    # -- signals --------------------------------------------------------------------------------

    def _init_signals(self) -> None:
        W, r = self.world_size, self.rank
        slots = [[0 if p == r else self._pad_ptrs[p] + (ch * W + r) * 4 for p in range(W)]
                 for ch in range(NUM_CHANNELS)]  # fmt: skip
        self._slot_table = torch.tensor(slots, dtype=torch.int64, device=self.device)
        self._expected = torch.zeros(NUM_CHANNELS, W, dtype=torch.int32, device=self.device)

    def _stream(self, stream):
        return ctypes.c_void_p((stream or torch.cuda.current_stream(self.device)).cuda_stream)

    def put_signal(self, channel: int, peers=None, stream=None) -> None:
        """Bumps slot [channel][self.rank] in each peer's pad, after earlier stream work."""
        if self.world_size == 1:
            return
        table = self._slot_table[channel]
        if peers is not None:
            keep = torch.zeros(self.world_size, dtype=torch.bool)
            keep[list(peers)] = True
            table = torch.where(keep.to(self.device), table, 0)
        _C.check(_lib().mptp_signal(self._stream(stream), ctypes.c_void_p(table.data_ptr()),
                                    self.world_size), "put_signal")  # fmt: skip

    def wait_signal(self, channel: int, peers=None, tag: int = 0, stream=None) -> None:
        """Blocks the stream until each peer in `peers` (default all) signalled `channel` once more."""
        if self.world_size == 1:
            return
        peers = range(self.world_size) if peers is None else peers
        mask = 0
        for p in peers:
            if p != self.rank:
                mask |= 1 << p
        base = self._pad_ptrs[self.rank] + channel * self.world_size * 4
        exp = self._expected[channel]
        _C.check(_lib().mptp_wait(
            self._stream(stream), ctypes.c_void_p(base), ctypes.c_void_p(exp.data_ptr()),
            self.world_size, mask, int(env.timeout_s() * 1e9), channel, tag), "wait_signal")  # fmt: skip

    def barrier(self, channel: int = CH_BARRIER, tag: int = 0, stream=None) -> None:
        """Stream-ordered barrier across the group (see the module docstring)."""
        self.put_signal(channel, stream=stream)
        self.wait_signal(channel, tag=tag, stream=stream)

    def write_value(self, flag: torch.Tensor, value: int, stream=None) -> None:
        """cuStreamWriteValue32 of `value` into the int32 element `flag` (no SM used)."""
        write_value(flag, value, stream or torch.cuda.current_stream(self.device))

    def check(self) -> None:
        check_errors(self.group_name, self.rank)

    # -- teardown -------------------------------------------------------------------------------

    def free(self) -> None:
        """Releases every mapping and allocation (collective: peers must free too)."""
        if self._freed:
            return
        self._freed = True
        lib = _lib()
        torch.cuda.synchronize(self.device)
        dist.barrier(group=self.group)  # nobody reads our buffer any more
        self.buffers, self.pads = [], []
        self._slot_table = self._expected = self.buffer_ptrs = None
        for p in self._opened:
            _C.check(lib.mptp_close_handle(ctypes.c_void_p(p)), "cudaIpcCloseMemHandle")
        dist.barrier(group=self.group)  # peers closed their mappings of ours
        for p in (self._buf_ptrs[self.rank], self._pad_ptrs[self.rank]):
            _C.check(lib.mptp_free(ctypes.c_void_p(p)), "cudaFree")
        self._opened = []


def write_value(flag: torch.Tensor, value: int, stream=None) -> None:
    """cuStreamWriteValue32 of `value` into the int32 element `flag`, stream-ordered, no SM used."""
    stream = stream or torch.cuda.current_stream(flag.device)
    _C.check(_lib().mptp_write_value(ctypes.c_void_p(stream.cuda_stream), ctypes.c_void_p(flag.data_ptr()),
                                     value & 0xFFFFFFFF), "write_value")  # fmt: skip


def pull_chunks(copies, value: int = 1, stream=None) -> None:
    """Stream-ordered copy-engine copies, each followed by a flag write (cuStreamWriteValue32).

    Args:
        copies: list of (dst, src, flag) with dst/src same-sized contiguous device
            tensors (src may be a peer's mapped buffer) and flag an int32 element or None.
    """
    n = len(copies)
    if n == 0:
        return
    stream = stream or torch.cuda.current_stream()
    P = ctypes.c_void_p * n
    dsts = P(*[d.data_ptr() for d, _, _ in copies])
    srcs = P(*[s.data_ptr() for _, s, _ in copies])
    sizes = (ctypes.c_size_t * n)(*[d.numel() * d.element_size() for d, _, _ in copies])
    flags = P(*[f.data_ptr() if f is not None else None for _, _, f in copies])
    _C.check(_lib().mptp_pull_chunks(ctypes.c_void_p(stream.cuda_stream), dsts, srcs, sizes, flags,
                                     value & 0xFFFFFFFF, n), "pull_chunks")  # fmt: skip


_WORKSPACES: Dict[tuple, SymmetricMemory] = {}


def _group(group_name: str) -> dist.ProcessGroup:
    from torch.distributed.distributed_c10d import _resolve_process_group

    return _resolve_process_group(group_name)


def get_workspace(group_name: str, nbytes: int, device: torch.device) -> SymmetricMemory:
    """The group's workspace with at least nbytes per rank; grown (collectively) if needed.

    NOTE: growth is a collective over the process group and reallocates, so it is
    refused during CUDA-graph capture: call reserve() before capturing.
    """
    key = (group_name, str(device))
    ws = _WORKSPACES.get(key)
    if ws is not None and ws.nbytes >= nbytes:
        return ws
    if torch.cuda.is_current_stream_capturing():
        have = ws.nbytes if ws is not None else 0
        raise RuntimeError(
            f"mptp: the symmetric workspace of group {group_name!r} must grow from {have} to "
            f"{nbytes} bytes during CUDA-graph capture; call "
            f"mptp_kernels.symm.reserve({group_name!r}, {nbytes}) (or run the op once eagerly) "
            "before capturing."
        )
    if ws is not None:
        ws.free()
    ws = SymmetricMemory(_group(group_name), nbytes, device)
    _WORKSPACES[key] = ws
    return ws


def reserve(group_name: str, nbytes: int, device: Optional[torch.device] = None) -> SymmetricMemory:
    """Pre-sizes the group's workspace (collective), e.g. before CUDA-graph capture."""
    return get_workspace(group_name, nbytes, device or torch.device("cuda", torch.cuda.current_device()))


def free_workspaces() -> None:
    """Frees every workspace (collective over each group)."""
    for ws in list(_WORKSPACES.values()):
        ws.free()
    _WORKSPACES.clear()
