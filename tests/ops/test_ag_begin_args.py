"""What the fused all-gather-matmul hands its one C call (fused._ag_run -> symm.primitives.ag_begin,
csrc/symm/symm.cu ag_begin): every address, size and count, checked on the CPU against the
protocol's own definition (ops/fused.py's docstring) on a stand-in workspace, with the C call,
the matmul and the end of the call replaced by recorders. The GPU tests run the real call."""

import types

import pytest
import torch

pytest.importorskip("triton", reason="ops.fused needs Triton (a CPU-only torch build comes without it)")

from mptp_kernels import env  # noqa: E402
from mptp_kernels.ops import fused, validate  # noqa: E402
from mptp_kernels.symm import _C
from mptp_kernels.symm import primitives as P

W, RANK = 4, 1
MAIN, SIDE = 0x7770, 0x1234


class _Workspace:
    """The fields of a SymmetricMemory that _ag_run reads, at made-up addresses."""

    def __init__(self, base):
        self.world_size, self.rank, self.device = W, RANK, torch.device("cpu")
        self._buf_ptrs = [base + 0x100000 * (p + 1) for p in range(W)]
        self._pad_ptrs = [base + 0x10000 * (p + 1) for p in range(W)]
        self.flags = torch.zeros(W, dtype=torch.int32)
        self.ag_order = torch.tensor([(RANK + i) % W for i in range(W)], dtype=torch.int32)
        self.err = torch.zeros(6, dtype=torch.int32)
        self.side = types.SimpleNamespace(cuda_stream=SIDE)
        self.nbytes, self._freed, self.captured, self.shares_device = 1 << 30, False, False, False
        self.table, self.exp = base + 0x900, base + 0xA00
        self.events = tuple(base + 0xE0 + i for i in range(4))

    def check(self):
        pass

    def _signal_ptrs(self, channel):
        if self._freed:
            raise RuntimeError("freed")
        return self.table, self.exp

    def raw_events(self):
        return self.events


@pytest.fixture
def recorded(monkeypatch):
    calls = {"begin": [], "finish": []}

    def begin(a):  # a copy: the workspace's struct is reused by the next call
        calls["begin"].append(type(a).from_buffer_copy(a))

    def matmul(A, Bs, **kw):
        calls.setdefault("matmul", []).append((A, kw))
        return [torch.empty(A.shape[0], B.shape[1], dtype=A.dtype) for B in Bs]

    def finish(ws, tensors, flags, signal=None, join=None, stream=None):
        calls["finish"].append((tensors, flags, join, stream))

    monkeypatch.setattr(P, "ag_begin", begin)
    monkeypatch.setattr(P, "raw_stream", lambda device: MAIN)
    monkeypatch.setattr(fused.pm, "persistent_matmul", matmul)
    monkeypatch.setattr(fused, "_finish", finish)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    monkeypatch.setattr(torch.Tensor, "record_stream", lambda self, s: None)
    return calls


def _check_common(a, ws, A_full_rows, a_bytes):
    flag0 = ws.flags.data_ptr()
    peers = [(RANK + i) % W for i in range(1, W)]
    assert (a.main, a.side, a.fork, a.scales_in) == (MAIN, SIDE, ws.events[0], ws.events[1])
    pad = ws._pad_ptrs[RANK]
    assert (a.done_slots, a.done_expected, a.done_sig) == (
        pad + P.CH_DONE * W * 4, ws.exp + P.CH_DONE * W * 4, ws.table + P.CH_DONE * W * 8)
    assert (a.ready_slots, a.ready_expected, a.ready_sig) == (
        pad + P.CH_READY * W * 4, ws.exp + P.CH_READY * W * 4, ws.table + P.CH_READY * W * 8)
    assert (a.done_channel, a.ready_channel, a.tag) == (P.CH_DONE, P.CH_READY, fused._TAG_AG)
    assert a.own_flag == flag0 + 4 * RANK
    assert (a.world_size, a.mask) == (W, 0b1101)
    assert a.timeout_ns == int(env.timeout_s() * 1e9)
    assert a.npull == W - 1 and list(a.peers[: W - 1]) == peers
    assert list(a.pull_src[: W - 1]) == [ws._buf_ptrs[p] for p in peers]
    assert list(a.pull_flag[: W - 1]) == [flag0 + 4 * p for p in peers]
    assert a.chunk_bytes == a_bytes
    assert a.copy_dst[0] == ws._buf_ptrs[RANK] and a.copy_bytes[0] == a_bytes


def test_one_call_gets_every_address_of_the_protocol(recorded):
    ws = _Workspace(0x10_0000_0000)
    A, B = torch.randn(8, 16).to(torch.float16), torch.randn(16, 24).to(torch.float16)
    A_ret, outs = fused._ag_run(ws, A, [B], 0, "g", True, W)
    (a,) = recorded["begin"]
    a_bytes = 8 * 16 * 2
    _check_common(a, ws, 8 * W, a_bytes)
    assert a.full_base == A_ret.data_ptr() and tuple(A_ret.shape) == (8 * W, 16)
    assert a.ncopy == 2 and a.nscale == 0
    assert (a.copy_src[0], a.copy_src[1]) == (A.data_ptr(), A.data_ptr())
    assert a.copy_dst[1] == a.full_base + RANK * a_bytes and a.copy_bytes[1] == a_bytes
    ((tensors, flags, join, stream),) = recorded["finish"]
    assert join == (SIDE, ws.events[2]) and stream == MAIN and flags is ws.flags
    assert tensors[0] is A_ret and tensors[1] is outs[0]


def test_a_misaligned_shard_is_copied_plainly_and_not_by_the_call(recorded):
    ws = _Workspace(0x20_0000_0000)
    A = torch.randn(8 * 16 + 1).to(torch.float16)[1:].view(8, 16)  # 2 bytes past a 16-byte boundary
    B = torch.randn(16, 8).to(torch.float16)
    A_ret, _ = fused._ag_run(ws, A, [B], 0, "g", True, W)
    (a,) = recorded["begin"]
    assert a.ncopy == 1 and a.copy_src[0] == A.data_ptr()
    assert torch.equal(A_ret[RANK * 8 : (RANK + 1) * 8], A)  # the plain copy, made before the call


def test_row_scales_then_none_leave_nothing_stale(recorded):
    ws = _Workspace(0x30_0000_0000)
    A = torch.randn(8, 32).to(torch.float8_e4m3fn)
    B = torch.randn(32, 16).to(torch.float8_e4m3fn)
    A_scale = torch.rand(8, 1) + 0.5
    scaled = (A_scale, validate.ScaleMode.ROW_WISE_SHARDED, [torch.ones(1, 16)], [None], [torch.bfloat16],
              [False], [None])  # fmt: skip
    fused._ag_run(ws, A, [B], 0, "g", True, W, scaled)
    fused._ag_run(ws, A, [B], 0, "g", True, W)
    a1, a2 = recorded["begin"]
    a_bytes = 8 * 32
    off = -(-a_bytes // 256) * 256
    for a in (a1, a2):
        _check_common(a, ws, 8 * W, a_bytes)
    assert a1.nscale == 1 and a1.ncopy == 4
    scale_full = recorded["matmul"][0][1]["A_scale"]
    assert a1.scale_base == scale_full.data_ptr() and a1.scale_bytes == 8 * 4 and a1.scale_src_off == off
    assert (a1.copy_dst[2], a1.copy_dst[3]) == (ws._buf_ptrs[RANK] + off, a1.scale_base + RANK * 8 * 4)
    assert a1.copy_src[2] == a1.copy_src[3] and a1.copy_bytes[2] == a1.copy_bytes[3] == 8 * 4
    assert a2.nscale == 0 and a2.ncopy == 2


@pytest.mark.parametrize("shares", [True, False])
def test_only_a_row_wise_call_on_a_shared_gpu_asks_for_no_copy_engine(recorded, monkeypatch, shares):
    """On a GPU its ranks share, a call that gathers row-wise scales asks for no copy engine
    (measured slower with one in eager, fused._ag_run) and its consumer leaves the full SM reserve
    to the plain copies; the unscaled and tensor-wise calls ask for one and leave at most 2 SMs.
    Between GPUs nothing changes (the consumer takes every SM)."""
    monkeypatch.setenv("MPTP_RESERVE_SMS", "8")
    monkeypatch.delenv("MPTP_CE_COPIES", raising=False)
    monkeypatch.setattr(P, "ce_copies", lambda stream=None: True)
    monkeypatch.setattr(fused.pm, "sm_count", lambda dev: 132)
    ws = _Workspace(0x60_0000_0000)
    ws.shares_device = shares
    A = torch.randn(8, 32).to(torch.float8_e4m3fn)
    B = torch.randn(32, 16).to(torch.float8_e4m3fn)

    def scaled(A_scale, mode):
        return (A_scale, mode, [torch.ones(1, 16) if mode != validate.ScaleMode.TENSOR_WISE else torch.ones(())],
                [None], [torch.bfloat16], [False], [None])  # fmt: skip

    fused._ag_run(ws, A, [B], 0, "g", True, W, scaled(torch.rand(8, 1) + 0.5, validate.ScaleMode.ROW_WISE_SHARDED))
    fused._ag_run(ws, A, [B], 0, "g", True, W, scaled(torch.ones(()), validate.ScaleMode.TENSOR_WISE))
    fused._ag_run(ws, A.to(torch.float16), [B.to(torch.float16)], 0, "g", True, W)
    row, tensor, plain = recorded["begin"]
    sms = [kw["num_sms"] for _, kw in recorded["matmul"]]
    if shares:
        assert (row.use_ce, tensor.use_ce, plain.use_ce) == (0, 1, 1)
        assert sms == [124, 130, 130]
    else:
        assert (row.use_ce, tensor.use_ce, plain.use_ce) == (1, 1, 1)
        assert sms == [None, None, None]


def test_workspaces_keep_their_own_arguments_and_a_freed_one_raises(recorded):
    ws1, ws2 = _Workspace(0x40_0000_0000), _Workspace(0x50_0000_0000)
    A, B = torch.randn(4, 16).to(torch.float16), torch.randn(16, 8).to(torch.float16)
    fused._ag_run(ws1, A, [B], 0, "g", True, W)
    fused._ag_run(ws2, A, [B], 0, "g", True, W)
    fused._ag_run(ws1, A, [B], 0, "g", True, W)
    a1, a2, a3 = recorded["begin"]
    assert a1.pull_src[0] == a3.pull_src[0] == ws1._buf_ptrs[2] and a2.pull_src[0] == ws2._buf_ptrs[2]
    assert isinstance(ws1._ag_args, _C.AgBeginArgs) and ws1._ag_args is not ws2._ag_args
    ws1._freed = True
    with pytest.raises(RuntimeError, match="freed"):
        fused._ag_run(ws1, A, [B], 0, "g", True, W)
    assert len(recorded["begin"]) == 3
