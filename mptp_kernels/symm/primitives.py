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
check_errors() (called at the start of every op and by SymmetricMemory.check()) raises a
RuntimeError naming op, group, rank and peer. Later waits of the process
return at once, so one missing peer costs one timeout; after the kernels that
follow a wait, each output is overwritten with NaN if the record is set (one
read per output: it is host memory), instead of returning what did not arrive. A watchdog thread (MPTP_ASYNC_ERROR_HANDLING) ends a process that never
looks at its error.

Chunk-arrival flags that a persistent matmul spins on are written with
cuStreamWriteValue32 (write_value), never by a kernel that may run beside it: the
matmul may hold every SM, and a memop needs none. (The all-gather's own chunk flag is
set by its READY kernel, which ends before the matmul is launched on that stream.)

Pseudo-code of a barrier on rank r:
    for p != r: atomic_add(pad[p][ch][r], 1)               # signal kernel
    for p != r: spin until pad[r][ch][p] >= ++expected[ch][p]   # wait kernel
"""

import ctypes
import os
import socket
import sys
import threading
import time
from typing import Dict, List, Optional

import torch
import torch.distributed as dist

from .. import env
from . import _C
from .rendezvous import HostRendezvous, PeerTimeout  # noqa: F401 (PeerTimeout: the dispatcher catches it)

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
    """A uint8 tensor over nbytes of device memory at ptr (never a copy).

    NOTE: for host-mapped memory (the error record) CUDA names the device that was current when
    it was allocated; asked for another device, as_tensor would copy it, and a copy of the record
    never shows a later timeout. Such memory is then taken as it is (mapped, portable: readable
    from every device)."""
    with torch.cuda.device(device):
        t = torch.as_tensor(_CudaArray(ptr, nbytes, owner), device=device)
        if t.data_ptr() != ptr:
            t = torch.as_tensor(_CudaArray(ptr, nbytes, owner))
    if t.data_ptr() != ptr:
        raise RuntimeError(f"tensor_at: torch copied the memory at {ptr:#x} instead of viewing it")
    return t


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

    _rec = None  # the record as a ctypes array over its host mapping (made once: every op call reads it)

    @classmethod
    def read(cls):
        rec = cls._rec
        if rec is None:
            if cls._host is None:
                return None
            rec = cls._rec = (ctypes.c_int32 * 6).from_address(cls._host)
        return list(rec) if rec[0] else None


def _error_message(rec, group_name: str = "?", rank: int = -1) -> str:
    _, channel, peer, expected, seen, tag = rec
    what = _TAGS.get(tag, f"tag {tag}")
    if channel == -1:
        detail = f"waiting for chunk {peer} (copied from peer rank {peer}) to arrive"
    elif channel == CH_ARRIVE:
        detail = f"waiting for peer rank {peer}'s partial sums of this rank's chunk to arrive"
    else:
        detail = f"waiting for peer rank {peer} on channel {channel}"
    return (
        f"mptp {what}: timed out after {env.timeout_s():g}s (MPTP_TIMEOUT_S) on group "
        f"{group_name!r}, rank {rank}, {detail} (expected count {expected}, saw {seen}). "
        "A peer did not join the call or died; the outputs of that call were poisoned with "
        "NaN, and this process's symmetric memory is now unusable: restart the job."
    )


def check_errors(group_name: str = "?", rank: int = -1) -> None:
    """Raises RuntimeError if any wait of this process timed out (every later call raises too)."""
    rec = _ErrorRecord.read()
    if rec is None:
        return
    _Watchdog.surfaced = True
    raise RuntimeError(_error_message(rec, group_name, rank))


class _Watchdog:
    """A host thread that polls the error record, in the spirit of NCCL's async error handling.

    MPTP_ASYNC_ERROR_HANDLING: 0 = only the next op call raises; 1 = print the error
    and abort the process as soon as it is seen; 2 (default) = the next op call
    raises, and if none has within MPTP_TIMEOUT_S of the error, print it and abort,
    so a job never goes on computing on poisoned data without being told.
    """

    surfaced = False
    _thread: Optional[threading.Thread] = None

    @classmethod
    def start(cls) -> None:
        if cls._thread is not None or env.async_error_handling() == 0:
            return
        cls._thread = threading.Thread(target=cls._loop, name="mptp-watchdog", daemon=True)
        cls._thread.start()

    @classmethod
    def _loop(cls) -> None:
        seen_at = None
        while True:
            time.sleep(0.1)
            rec = _ErrorRecord.read()
            if rec is None:
                continue
            mode = env.async_error_handling()
            now = time.monotonic()
            seen_at = seen_at if seen_at is not None else now
            if mode == 0:
                return
            if mode == 1 or (not cls.surfaced and now - seen_at > env.timeout_s()):
                rank = dist.get_rank() if dist.is_initialized() else -1
                sys.stderr.write(
                    f"[mptp watchdog] aborting process (MPTP_ASYNC_ERROR_HANDLING={mode}): "
                    f"{_error_message(rec, rank=rank)}\n"
                )
                sys.stderr.flush()
                os.abort()
            if cls.surfaced:
                return


CH_READY, CH_DONE = 1, 2  # used by the ops: data published / finished with peers' buffers
# Matmul-reduce-scatter's arrival flags (0 / 1, reset by the owner after each call, not counts):
# slot [CH_ARRIVE][p] of rank c's pad = peer p's partial of chunk c is in c's buffer.
CH_ARRIVE = 3


def _device_id(device: torch.device) -> str:
    """The GPU's UUID: the same GPU has one UUID in every process, whatever index
    CUDA_VISIBLE_DEVICES gives it there. Without one, a unique string (so the GPU counts as
    shared, the safe side: SMs are left to the copies)."""
    try:
        return str(torch.cuda.get_device_properties(device).uuid)
    except (RuntimeError, AttributeError):
        return "unknown"


class SymmetricMemory:
    """One buffer per rank of `group`, mapped by every rank, plus signal pads.

    Creation is collective and agrees by construction: every rank allocates the
    largest size any rank asked for, and a failure on any rank (a peer it cannot
    map) raises the same RuntimeError on every rank.

    Attributes:
        buffers: list of W uint8 tensors (rank r's buffer, as seen from here).
        buffer_ptrs: device tensor [W] int64 of those pointers (for kernels).
        pads: list of W int32 tensors [NUM_CHANNELS * W] (rank r's signal pad).
        rendezvous: the per-call host rendezvous of the group (ranks share a host).
        side, flags, ag_order, rs_order: the ops' side stream, chunk flags and
            chunk orders, created here so that a first op inside CUDA-graph
            capture needs no allocation.
        shares_device: another rank of the group uses this GPU (W processes on one GPU, or a
            loopback group): chunk copies between its buffers may then run on SMs.
        captured: set by an op that ran under CUDA-graph capture; such a
            workspace is never freed before shutdown() (a graph may replay it).
    """

    def __init__(self, group: dist.ProcessGroup, nbytes: int, device: torch.device):
        lib = _lib()
        self.group = group
        self.group_name = group.group_name
        self.rank = dist.get_rank(group)
        self.world_size = W = dist.get_world_size(group)
        self.device = device = torch.device(device)
        self._freed = False
        self.captured = False
        self.broken: Optional[str] = None  # set when a call raised part-way: every later call raises
        self._local: List[int] = []
        self._opened: List[int] = []
        self.rendezvous = None
        # Every rank allocates the same (largest) size.
        sizes: List = [None] * W
        dist.all_gather_object(sizes, int(nbytes), group=group)
        nbytes = max(sizes)
        # NOTE: an allocation or export that fails on one rank must not leave its peers in the
        # collectives below (a hang until the process group's timeout) nor split the group
        # between paths: it is carried into the agreed `problems`, so every rank raises.
        buf = pad = None
        granted, handles, local_problem = 0, None, None
        for attempt in (0, 1):
            try:
                with torch.cuda.device(device):
                    buf, granted = self._alloc(lib, max(nbytes, 1))
                    pad, _ = self._alloc(lib, NUM_CHANNELS * W * 4)
                break
            except RuntimeError as e:
                for p in (buf, pad):
                    if p:
                        lib.mptp_free(ctypes.c_void_p(p))
                buf = pad = None
                if attempt == 0:  # the caching allocator may hold what cudaMalloc needs
                    try:
                        torch.cuda.synchronize(device)
                        torch.cuda.empty_cache()
                    except RuntimeError:
                        pass
                else:
                    local_problem = f"rank {self.rank}: cannot allocate {max(nbytes, 1)} bytes ({e})"
        self.nbytes = granted
        # Phase 1: export the local handles as bytes (rank 0 also creates the rendezvous file).
        if local_problem is None:
            try:
                hb = lib.mptp_ipc_handle_bytes()
                handles = []
                for ptr in (buf, pad):
                    h = ctypes.create_string_buffer(hb)
                    _C.check(lib.mptp_export_handle(ctypes.c_void_p(ptr), h), "cudaIpcGetMemHandle")
                    handles.append(h.raw)
            except RuntimeError as e:
                handles, local_problem = None, f"rank {self.rank}: {e}"
        shm_path = None
        if self.rank == 0 and W > 1:
            shm_path = HostRendezvous.new_path()
            self.rendezvous = HostRendezvous(shm_path, 0, W, create=True)
        # Phase 2: exchange over the process group, then open the peers'.
        # NOTE: the device's UUID tells W processes sharing one GPU apart from one GPU each.
        info = (handles, granted, _device_id(device), socket.gethostname(), shm_path)
        all_info: List = [None] * W
        dist.all_gather_object(all_info, info, group=group)
        buf_ptrs, pad_ptrs, problem = [], [], None
        try:
            if local_problem is not None:
                raise RuntimeError(local_problem.split(": ", 1)[1])
            if any(hs is None for hs, _, _, _, _ in all_info):  # that rank reports its own problem
                raise RuntimeError("a peer rank has no buffer to map")
            hosts = {h for _, _, _, h, _ in all_info}
            if len(hosts) != 1:
                raise RuntimeError(f"the group spans hosts {sorted(hosts)}")
            if self.rank != 0 and W > 1:
                self.rendezvous = HostRendezvous(all_info[0][4], self.rank, W, create=False)
            for r, (hs, _, _, _, _) in enumerate(all_info):
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
                        raise RuntimeError(f"cannot map rank {r}'s memory ({msg})")
                    opened.append(p.value)
                    self._opened.append(p.value)
                buf_ptrs.append(opened[0])
                pad_ptrs.append(opened[1])
        except (RuntimeError, OSError) as e:
            problem = f"rank {self.rank}: {e}"
        # Agree: every rank raises if any rank failed.
        problems: List = [None] * W
        dist.all_gather_object(problems, problem, group=group)
        if shm_path is not None:
            try:
                os.unlink(shm_path)  # every rank has it mapped (or failed): keep no file behind
            except OSError:
                pass
        bad = [p for p in problems if p is not None]
        if bad:
            for p in self._opened:
                lib.mptp_close_handle(ctypes.c_void_p(p))
            for p in (buf, pad):
                if p:
                    lib.mptp_free(ctypes.c_void_p(p))
            self._opened, self._freed = [], True
            if self.rendezvous is not None:
                self.rendezvous.close()
            raise RuntimeError(
                f"SymmetricMemory: group {self.group_name!r} cannot be served by mptp symmetric "
                f"memory ({'; '.join(bad)}). The fused path needs all ranks' GPUs in one host "
                "with peer access; the ops fall back to torch.distributed collectives."
            )
        mine = all_info[self.rank][2]
        self.shares_device = W > 1 and (mine == "unknown" or sum(i[2] == mine for i in all_info) > 1)
        if self.rendezvous is not None:
            self.rendezvous.read_pids()
        self.buffers = [tensor_at(p, granted, device, self) for p in buf_ptrs]
        self.pads = [tensor_at(p, NUM_CHANNELS * W * 4, device, self).view(torch.int32) for p in pad_ptrs]
        self._buf_ptrs, self._pad_ptrs = buf_ptrs, pad_ptrs
        self.buffer_ptrs = torch.tensor(buf_ptrs, dtype=torch.int64, device=device)
        host, dev = _ErrorRecord.pointers()
        self.err = tensor_at(dev, 24, device).view(torch.int32)
        self._init_signals()
        self._init_op_state()
        self._self_check()
        _Watchdog.start()

    @property
    def latch(self) -> torch.Tensor:
        """This device's fail latch (fail_latch): guarded writes of a call read it."""
        return fail_latch(self.device)

    def _init_op_state(self) -> None:
        W, r, dev = self.world_size, self.rank, self.device
        self.side = torch.cuda.Stream(device=dev)
        self.flags = torch.zeros(W, dtype=torch.int32, device=dev)
        # All-gather consumes its own chunk first; reduce-scatter produces the next rank's first.
        self.ag_order = torch.tensor([(r + i) % W for i in range(W)], dtype=torch.int32, device=dev)
        self.rs_order = torch.tensor([(r + 1 + i) % W for i in range(W)], dtype=torch.int32, device=dev)
        # Matmul-reduce-scatter summed in the matmul (MPTP_RS_REDUCE=kernel): finished tiles per chunk (the
        # kernel's last program of a chunk zeroes its count), where to flag each chunk's arrival
        # (slot [CH_ARRIVE][this rank] of the chunk owner's pad), and this rank's arrival flags.
        self.rs_counters = torch.zeros(W, dtype=torch.int32, device=dev)
        self.arrive_to = self._slot_table[CH_ARRIVE]
        self.arrived = self.pads[r][CH_ARRIVE * W : (CH_ARRIVE + 1) * W]
        # NOTE: one DONE credit per peer up front, so every op (the first one too,
        # also inside a CUDA graph) waits for DONE before touching a peer's buffer.
        self.put_signal(CH_DONE)

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

    def _stream(self, stream) -> int:
        """The raw handle of `stream`, or of the device's current stream (no Stream object made)."""
        if stream is not None:
            return stream.cuda_stream
        return raw_stream(self.device)

    def _signal_ptrs(self, channel: int):
        """(slot table, expected counters) device addresses: per-call signals touch no tensor.
        Checks what indexing the tables used to: the channel's range, and a live workspace (the
        addresses of a freed one would be signalled through)."""
        if not 0 <= channel < NUM_CHANNELS:
            raise ValueError(f"channel: expected 0 <= channel < {NUM_CHANNELS}, got {channel}")
        if self._freed:
            raise RuntimeError(f"SymmetricMemory of group {self.group_name!r} was freed: it cannot signal")
        ptrs = self.__dict__.get("_sig_ptrs")
        if ptrs is None:
            ptrs = self._sig_ptrs = (self._slot_table.data_ptr(), self._expected.data_ptr())
        return ptrs

    def put_signal(self, channel: int, peers=None, stream=None) -> None:
        """Bumps slot [channel][self.rank] in each peer's pad, after earlier stream work."""
        W = self.world_size
        if W == 1:
            return
        base = self._signal_ptrs(channel)[0]
        if peers is not None:
            table = self._slot_table[channel]
            keep = torch.zeros(W, dtype=torch.bool)
            keep[list(peers)] = True
            ptr = torch.where(keep.to(self.device), table, 0)
            rc = _lib().mptp_signal(self._stream(stream), ptr.data_ptr(), W)
        else:  # row `channel` of the [NUM_CHANNELS, W] int64 table
            rc = _lib().mptp_signal(self._stream(stream), base + channel * W * 8, W)
        _C.check(rc, "put_signal")

    def wait_signal(self, channel: int, peers=None, tag: int = 0, stream=None) -> None:
        """Blocks the stream until each peer in `peers` (default all) signalled `channel` once more."""
        W = self.world_size
        if W == 1:
            return
        if peers is None:
            mask = ((1 << W) - 1) & ~(1 << self.rank)
        else:
            mask = 0
            for p in peers:
                if p != self.rank:
                    mask |= 1 << p
        exp = self._signal_ptrs(channel)[1] + channel * W * 4  # row `channel` of the [NUM_CHANNELS, W] int32 counters
        base = self._pad_ptrs[self.rank] + channel * W * 4
        _C.check(_lib().mptp_wait(self._stream(stream), base, exp, W, mask, int(env.timeout_s() * 1e9),
                                  channel, tag), "wait_signal")  # fmt: skip

    def barrier(self, channel: int = CH_BARRIER, tag: int = 0, stream=None) -> None:
        """Stream-ordered barrier across the group (see the module docstring): put_signal then
        wait_signal on `channel`, every peer, in one launch."""
        W = self.world_size
        if W == 1:
            return
        table, exp = self._signal_ptrs(channel)
        _C.check(_lib().mptp_signal_wait(
            self._stream(stream), table + channel * W * 8, self._pad_ptrs[self.rank] + channel * W * 4,
            exp + channel * W * 4, W, ((1 << W) - 1) & ~(1 << self.rank), int(env.timeout_s() * 1e9),
            channel, tag), "barrier")  # fmt: skip

    def write_value(self, flag: torch.Tensor, value: int, stream=None) -> None:
        """cuStreamWriteValue32 of `value` into the int32 element `flag` (no SM used)."""
        write_value(flag, value, stream or torch.cuda.current_stream(self.device))

    def check(self) -> None:
        check_errors(self.group_name, self.rank)

    def raw_events(self):
        """Four CUDA events (raw handles, timing off) for the ops' stream forks and joins: made on
        first use, destroyed by free(). NOTE: reused from call to call: a wait takes the event's
        latest record when it is enqueued, and the dispatcher runs one call of a group at a time."""
        evs = self.__dict__.get("_raw_events")
        if evs is None:
            made = []
            with torch.cuda.device(self.device):
                for _ in range(4):
                    p = ctypes.c_void_p()
                    _C.check(_lib().mptp_event_create(ctypes.byref(p)), "cudaEventCreate")
                    made.append(p.value)
            evs = self._raw_events = tuple(made)
        return evs

    def _destroy_events(self) -> None:
        """Destroys raw_events() (cudaEventDestroy is safe with work still pending on them: the
        driver releases them once it completes)."""
        for e in self.__dict__.pop("_raw_events", ()):
            _lib().mptp_event_destroy(e)

    # -- teardown -------------------------------------------------------------------------------

    def free(self) -> None:
        """Releases every mapping and allocation (collective: peers must free too)."""
        if self._freed:
            return
        self._freed = True
        lib = _lib()
        torch.cuda.synchronize(self.device)
        self._destroy_events()
        self.__dict__.pop("_ag_args", None)
        self.last_call = None
        dist.barrier(group=self.group)  # nobody reads our buffer any more
        self.buffers, self.pads = [], []
        self._slot_table = self._expected = self.buffer_ptrs = self.arrive_to = self.arrived = None
        self.__dict__.pop("_sig_ptrs", None)
        self.__dict__.pop("_views", None)
        for p in self._opened:
            _C.check(lib.mptp_close_handle(ctypes.c_void_p(p)), "cudaIpcCloseMemHandle")
        dist.barrier(group=self.group)  # peers closed their mappings of ours
        for p in (self._buf_ptrs[self.rank], self._pad_ptrs[self.rank]):
            _C.check(lib.mptp_free(ctypes.c_void_p(p)), "cudaFree")
        self._opened = []
        if self.rendezvous is not None:
            self.rendezvous.close()

    def abandon(self) -> None:
        """Forgets the workspace of a destroyed group without any collective (its memory is leaked)."""
        self._freed = True
        self.buffers, self.pads = [], []
        self.__dict__.pop("_sig_ptrs", None)
        self.__dict__.pop("_views", None)
        self.__dict__.pop("_ag_args", None)
        self.last_call = None
        self._destroy_events()
        if self.rendezvous is not None:
            self.rendezvous.close()


def raw_stream(device: torch.device) -> int:
    """The raw handle of the current stream of `device` (of the current device where it has no
    index), without making a Stream object."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    return torch._C._cuda_getCurrentRawStream(index)


def write_value(flag: torch.Tensor, value: int, stream=None) -> None:
    """cuStreamWriteValue32 of `value` into the int32 element `flag`, stream-ordered, no SM used."""
    write_value_at(flag.data_ptr(), value, stream.cuda_stream if stream is not None else raw_stream(flag.device))


def write_value_at(addr: int, value: int, stream: int) -> None:
    """write_value into the int32 at device address `addr`, on the raw stream handle `stream`."""
    _C.check(_lib().mptp_write_value(stream, addr, value & 0xFFFFFFFF), "write_value")


def pull_at(stream: int, dsts, srcs, sizes, flags, value: int = 1) -> None:
    """pull_chunks on raw addresses: lists of ints (flags: int or None each), raw stream handle."""
    n = len(dsts)
    if n == 0:
        return
    P = ctypes.c_void_p * n
    use_ce = 1 if env.ce_copies_enabled() else 0
    _C.check(_lib().mptp_pull_chunks(stream, P(*dsts), P(*srcs), (ctypes.c_size_t * n)(*sizes), P(*flags),
                                     value & 0xFFFFFFFF, n, use_ce), "pull_chunks")  # fmt: skip


def copy_guarded_at(stream: int, dsts, srcs, sizes) -> None:
    """copy_guarded on raw addresses (lists of ints) and a raw stream handle."""
    n = len(dsts)
    if n == 0:
        return
    assert n <= MAX_GUARDED_COPIES
    P = ctypes.c_void_p * n
    _C.check(_lib().mptp_copy_guarded(stream, P(*dsts), P(*srcs), (ctypes.c_size_t * n)(*sizes), n),
             "copy_guarded")  # fmt: skip


def pull_chunks(copies, value: int = 1, stream=None) -> None:
    """Stream-ordered device copies, each followed by a flag write (cuStreamWriteValue32).

    Args:
        copies: list of (dst, src, flag) with dst/src same-sized contiguous device
            tensors (src may be a peer's mapped buffer) and flag an int32 element or None.

    The copies ask for a copy engine where ce_copies(stream) (cuMemcpyBatchAsync with the
    prefer-overlap-with-compute hint, which the driver may ignore). NOTE: a plain copy between two
    buffers of one device may run as a kernel, which a consumer holding every SM would starve:
    see ops/fused.py _consumer_sms.
    """
    if not copies:
        return
    stream = stream or torch.cuda.current_stream()
    pull_at(stream.cuda_stream, [d.data_ptr() for d, _, _ in copies], [s.data_ptr() for _, s, _ in copies],
            [d.numel() * d.element_size() for d, _, _ in copies],
            [f.data_ptr() if f is not None else None for _, _, f in copies], value)  # fmt: skip


_LATCHES: dict = {}


def fail_latch(device: torch.device) -> torch.Tensor:
    """The device's fail latch, int32[64] in device memory (element 0; csrc/symm/symm.h):
    nonzero once a wait of this process has failed (set by the failed wait, or by the end of a
    call that finds the error record set). Guarded writes read it (`guard` of the matmul)."""
    t = _LATCHES.get(device)
    if t is None:
        p = ctypes.c_void_p()
        with torch.cuda.device(device):
            _C.check(_lib().mptp_fail_latch(ctypes.byref(p)), "mptp_fail_latch")
        t = _LATCHES[device] = tensor_at(p.value, 256, device).view(torch.int32)
    return t


MAX_GUARDED_COPIES = 32  # csrc/symm/symm.h kMaxGuardedCopies


def copy_guarded(copies, stream=None) -> None:
    """Stream-ordered device copies (one small kernel) that write nothing once a wait of this
    process has failed (the device's fail latch is set): every write of a call into symmetric
    memory goes through it.

    NOTE: fail-stop. After a timed-out wait a peer may be slow, not dead: it may still read this
    rank's buffer, or reduce what this rank wrote into its own, for the call it is still in.
    A failed rank so writes nothing more into symmetric memory and signals nobody (csrc
    signal_kernel): its peers time out (NaN, then an error) instead of taking its next call's
    data for their current one.

    Args:
        copies: list of (dst, src), same-sized contiguous device tensors (either may be a
            peer's mapped buffer).
    """
    if not copies:
        return
    assert all(d.is_contiguous() and s.is_contiguous() for d, s in copies)
    assert all(d.numel() * d.element_size() == s.numel() * s.element_size() for d, s in copies)
    stream = stream or torch.cuda.current_stream()
    copy_guarded_at(stream.cuda_stream, [d.data_ptr() for d, _ in copies], [s.data_ptr() for _, s in copies],
                    [d.numel() * d.element_size() for d, _ in copies])  # fmt: skip


MAX_FINISH = 8  # csrc/symm/symm.h kMaxFinish
_PTRS, _SIZES = ctypes.c_void_p * MAX_FINISH, ctypes.c_size_t * MAX_FINISH


def finish(tensors, err: torch.Tensor, flags: Optional[torch.Tensor] = None, stream=None, signal=None,
           join=None) -> None:
    """The end of a fused call, one small kernel: every tensor (contiguous, at most 8) becomes
    all-ones bytes (NaN in every float dtype) if err[0] (an error record) is set, then `flags`
    (int32, at most 32) is zeroed. Stream-ordered; the record is read once.

    signal: (workspace, channel): the same kernel then signals `channel` to every peer (fail-stop,
    as put_signal), one launch instead of two. join: (side stream handle, event handle): the
    stream first waits for the side stream's work so far (event recorded there), in the same
    call. Not both."""
    ts = [t for t in tensors if t is not None and t.numel() > 0]
    assert len(ts) <= MAX_FINISH and all(t.is_contiguous() for t in ts)
    assert signal is None or join is None
    n = len(ts)
    ptrs = _PTRS(*[t.data_ptr() for t in ts])
    sizes = _SIZES(*[t.numel() * t.element_size() for t in ts])
    nflags = 0 if flags is None else flags.numel()
    assert flags is None or (flags.dtype == torch.int32 and flags.is_contiguous() and nflags <= 32)
    # stream: a raw handle, a Stream, or None (the current stream of err's device)
    if stream is None:
        stream = raw_stream(err.device)
    elif not isinstance(stream, int):
        stream = stream.cuda_stream
    fl = flags.data_ptr() if nflags else None
    if signal is not None:
        ws, channel = signal
        W = ws.world_size
        sig = ws._signal_ptrs(channel)[0] + channel * W * 8 if W > 1 else None
        rc = _lib().mptp_finish_signal(stream, ptrs, sizes, n, fl, nflags, err.data_ptr(), sig, W if sig else 0)
    elif join is not None:
        rc = _lib().mptp_ag_end(stream, join[0], join[1], ptrs, sizes, n, fl, nflags, err.data_ptr())
    else:
        rc = _lib().mptp_finish(stream, ptrs, sizes, n, fl, nflags, err.data_ptr())
    _C.check(rc, "finish")


def event_record(event: int, stream: int) -> None:
    """cudaEventRecord on raw handles."""
    _C.check(_lib().mptp_event_record(event, stream), "cudaEventRecord")


def stream_wait_event(stream: int, event: int) -> None:
    """cudaStreamWaitEvent on raw handles."""
    _C.check(_lib().mptp_stream_wait_event(stream, event), "cudaStreamWaitEvent")


def ag_begin(args) -> None:
    """mptp_ag_begin (csrc/symm/symm.h AgBeginArgs): an all-gather-matmul's transfers and signals
    on its main and side streams, in one call."""
    _C.check(_lib().mptp_ag_begin(ctypes.byref(args)), "ag_begin")


def ce_copies(stream=None) -> bool:
    """Whether pull_chunks on `stream` asks for copy-engine copies (a hint the driver may ignore): the driver
    has cuMemcpyBatchAsync and has not refused it in this process (it refuses sources mapped from
    another process), MPTP_CE_COPIES is not 0, the stream is not the legacy default stream and is
    not capturing a CUDA graph."""
    if not env.ce_copies_enabled():
        return False
    stream = stream or torch.cuda.current_stream()
    rc = _lib().mptp_ce_copies(ctypes.c_void_p(stream.cuda_stream))
    if rc < 0:
        _C.check(rc, "ce_copies")
    return rc == 1


# (id(process group), device) -> workspace. Keyed by the group object, not its name:
# names are reused after destroy_process_group. ws.group keeps the object (and its id) alive.
_WORKSPACES: Dict[tuple, SymmetricMemory] = {}
# Workspaces replaced by a larger one while a captured CUDA graph may still replay them.
_RETIRED: List[SymmetricMemory] = []


def _group(group_name: str) -> dist.ProcessGroup:
    try:
        return dist.distributed_c10d._resolve_process_group(group_name)
    except Exception as e:  # noqa: BLE001 - c10d raises various types
        raise ValueError(f"group_name: no process group named {group_name!r} is registered ({e})") from None


def _alive(pg: dist.ProcessGroup) -> bool:
    return pg in dist.distributed_c10d._world.pg_names


def _prune() -> None:
    """Drops workspaces of destroyed groups (no collective is possible on them: their memory is leaked)."""
    for key, ws in list(_WORKSPACES.items()):
        if not _alive(ws.group):
            del _WORKSPACES[key]
            ws.abandon()


def lookup(group_name: str, device: torch.device) -> Optional[SymmetricMemory]:
    """The workspace of the group now named group_name on device, if it has one."""
    _prune()
    pg = _group(group_name)
    ws = _WORKSPACES.get((id(pg), str(torch.device(device))))
    return ws if ws is not None and ws.group is pg else None


def get_workspace(group_name: str, nbytes: int, device: torch.device) -> SymmetricMemory:
    """The group's workspace with at least nbytes per rank; created or grown (collectively) if needed.

    NOTE: creation and growth are collectives over the process group: every rank
    must call this with the same decision (the ops decide from the per-call
    rendezvous, so they do). Refused during CUDA-graph capture: call reserve()
    before capturing. A workspace that a captured graph used is kept alive
    (never freed before shutdown()) when a larger one replaces it.
    """
    device = torch.device(device)
    ws = lookup(group_name, device)
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
    pg = _group(group_name)
    if ws is not None:
        del _WORKSPACES[(id(pg), str(device))]
        if ws.captured:
            _RETIRED.append(ws)
        else:
            ws.free()
    from .loopback import LoopbackSymmetricMemory, is_loopback

    cls = LoopbackSymmetricMemory if is_loopback(pg) else SymmetricMemory
    ws = cls(pg, nbytes, device)
    _WORKSPACES[(id(pg), str(device))] = ws
    return ws


def reserve(group_name: str, nbytes: int, device: Optional[torch.device] = None) -> SymmetricMemory:
    """Pre-sizes the group's workspace (collective), e.g. before CUDA-graph capture."""
    return get_workspace(group_name, nbytes, device or torch.device("cuda", torch.cuda.current_device()))


def free_workspaces() -> None:
    """Frees every workspace, retired ones included (collective over each live group)."""
    for ws in list(_WORKSPACES.values()) + _RETIRED:
        if _alive(ws.group):
            ws.free()
        else:
            ws.abandon()
    _WORKSPACES.clear()
    _RETIRED.clear()
