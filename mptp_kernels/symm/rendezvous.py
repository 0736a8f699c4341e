"""Per-call host rendezvous of a group whose ranks share a host: who calls what, in shared memory.

Every op call on a group with a workspace starts here: each rank publishes a
small payload (the call's signature and its local decisions) and reads every
peer's payload for the same call number. Ranks then raise the same ValueError
when they disagree, or take the same decision (fused or not, workspace size)
from the same data, before any GPU work of the call is enqueued.

Why on the host and not with the GPU's READY signal: a mismatch must become an
exception on every rank before any data is consumed, and the host only learns
what the GPU saw by synchronizing. Here the GPU never waits for the host; the
host waits only for the peers' hosts to reach the same call (they run in
lockstep in tensor parallelism), a few microseconds.

Layout: one /dev/shm file per workspace, one slot per rank:
    [seq: int64][pid: int64][2 x (seq: int64, len: int32, crc32: uint32, payload: PAYLOAD bytes)]
The payload of call n lives in half n % 2 (a rank can only start call n + 1
once every peer has published call n, so call n - 1's half is no longer read),
and its seq word is written last, with a checksum of (call number, payload): a
reader accepts a payload only when the checksum matches, and reads again
otherwise, so a host that makes the stores visible out of order (Arm) is
covered as well as x86.

Pseudo-code of exchange() on rank r, call n:
    half = slot[r].halves[n % 2]; half.payload = mine; half.seq = n; slot[r].seq = n
    for p != r: spin (bounded, checking that p is alive) until slot[p].seq >= n
    return [slot[p].halves[n % 2].payload for p]
"""

import mmap
import os
import struct
import time
import uuid
import zlib
from typing import List, Optional

from .. import env

PAYLOAD = 512
_HALF = 16 + PAYLOAD
_SLOT = 16 + 2 * _HALF


def _pid_ns() -> int:
    """An id of this process's PID namespace (31 bits), 0 where /proc says nothing."""
    try:
        return os.stat("/proc/self/ns/pid").st_ino & 0x7FFFFFFF
    except OSError:
        return 0


def _crc(n: int, payload: bytes) -> int:
    return zlib.crc32(payload, n & 0xFFFFFFFF)


class PeerTimeout(RuntimeError):
    pass


class HostRendezvous:
    """Shared-memory slots of the W ranks of one group on one host."""

    def __init__(self, path: str, rank: int, world_size: int, create: bool):
        self.rank, self.world_size, self.path = rank, world_size, path
        size = _SLOT * world_size
        if create:
            fd = os.open(path, os.O_CREAT | os.O_RDWR | os.O_EXCL, 0o600)
            os.ftruncate(fd, size)
        else:
            fd = os.open(path, os.O_RDWR)
        try:
            self._mm = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        self.seq = 0
        self.pids: List[int] = [0] * world_size
        struct.pack_into("<qq", self._mm, _SLOT * rank, 0, (_pid_ns() << 32) | os.getpid())

    @staticmethod
    def new_path() -> str:
        return f"/dev/shm/mptp_{os.getpid()}_{uuid.uuid4().hex[:12]}"

    def read_pids(self) -> None:
        """Reads the peers' pids (each slot holds pid | pid-namespace << 32).

        NOTE: a peer in another PID namespace (e.g. another container sharing the GPU and
        /dev/shm) has a pid that means nothing here: its liveness is unknown (pid 0), and
        only the timeout detects that it is gone.
        """
        pids = []
        for p in range(self.world_size):
            word = struct.unpack_from("<q", self._mm, _SLOT * p + 8)[0]
            pids.append(word & 0xFFFFFFFF if (word >> 32) == _pid_ns() else 0)
        self.pids = pids

    def _peer_seq(self, p: int) -> int:
        return struct.unpack_from("<q", self._mm, _SLOT * p)[0]

    def _alive(self, p: int) -> bool:
        pid = self.pids[p]
        if pid <= 0:
            return True
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        # A zombie (exited, not yet reaped) is dead for us.
        try:
            with open(f"/proc/{pid}/stat", "rb") as f:
                return f.read().split(b") ", 1)[1][:1] != b"Z"
        except (OSError, IndexError):
            return True

    def exchange(self, payload: bytes, what: str, timeout_s: Optional[float] = None) -> List[bytes]:
        """Publishes payload for the next call; returns every rank's payload for it (rank order).

        Raises PeerTimeout naming `what`, the rank and the missing peers when a peer
        does not reach the same call within timeout_s (default env.host_timeout_s()), or has exited.
        """
        if len(payload) > PAYLOAD:
            raise ValueError(f"rendezvous payload of {len(payload)} bytes > {PAYLOAD}")
        n = self.seq + 1
        mm, r = self._mm, self.rank
        half = _SLOT * r + 16 + (n % 2) * _HALF
        mm[half + 16 : half + 16 + len(payload)] = payload
        struct.pack_into("<qiI", mm, half, n, len(payload), _crc(n, payload))
        struct.pack_into("<q", mm, _SLOT * r, n)
        self.seq = n
        timeout = env.host_timeout_s_or_default() if timeout_s is None else timeout_s
        waiting = [p for p in range(self.world_size) if p != r]
        start = time.monotonic()
        next_check, spins = start + 0.05, 0
        while waiting:
            waiting = [p for p in waiting if self._peer_seq(p) < n]
            if not waiting:
                break
            spins += 1
            if spins > 200:
                time.sleep(0.0002 if spins < 5000 else 0.002)
            now = time.monotonic()
            if now >= next_check:
                next_check = now + 0.05
                dead = [p for p in waiting if not self._alive(p)]
                if dead or now - start > timeout:
                    peers = dead or waiting
                    who = f"peer rank {peers[0]}" if len(peers) == 1 else f"peer ranks {', '.join(map(str, peers))}"
                    why = "has exited" if dead else f"did not reach it within {timeout:g}s ({env.timeout_source()})"
                    raise PeerTimeout(
                        f"{what}: rank {r} is at call #{n} of this group, and {who} "
                        f"{why} (skipped the call, called another op, or died). This group's "
                        "mptp state is now out of step: restart the job."
                    )
        out = []
        for p in range(self.world_size):
            h = _SLOT * p + 16 + (n % 2) * _HALF
            while True:  # the checksum catches a payload whose stores are not all visible yet
                seq, ln, crc = struct.unpack_from("<qiI", mm, h)
                data = bytes(mm[h + 16 : h + 16 + max(0, min(ln, PAYLOAD))])
                if seq == n and 0 <= ln <= PAYLOAD and crc == _crc(n, data):
                    break
                if time.monotonic() - start > timeout:
                    raise PeerTimeout(f"{what}: rank {r} never read a whole rendezvous payload of rank {p} "
                                      f"for call #{n} (seq {seq})")  # fmt: skip
                time.sleep(0.0001)
            out.append(data)
        return out

    def close(self) -> None:
        try:
            self._mm.close()
        except (BufferError, ValueError):
            pass
