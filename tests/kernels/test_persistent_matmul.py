"""The persistent matmul kernel against float64 references.

On the CPU it runs under TRITON_INTERPRET=1 (fp16, fp32, fp8: bf16 tl.dot is
unsupported there) with consumer flags pre-set, since interpreted programs run
one after another and a spin on an unset flag would never end. On a GPU it
also runs bf16 and a consumer whose flags another stream sets late.
"""

import os
import random

import pytest
import torch
from utils import assert_matmul_close, randn, rel_err

CUDA = torch.cuda.is_available()
if not CUDA:
    os.environ["TRITON_INTERPRET"] = "1"

pytest.importorskip("triton", reason="the kernels need Triton (a CPU-only torch build comes without it)")
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from mptp_kernels.kernels import persistent_matmul as pm  # noqa: E402
from mptp_kernels.symm.triton_sync import signal_release, wait_acquire  # noqa: E402


@triton.jit
def _probe_kernel(x_ptr, n):
    for i in range(tl.program_id(0), n, 1):
        tl.store(x_ptr + i, i)


def _interpreter_problem():
    """Why Triton's interpreter cannot run the kernels here, or None. NOTE: Triton 3.6's
    interpreter converts a loop bound with int() of a one-element array, which numpy 2.4 refuses
    (TypeError); Triton 3.8's does not. Such a machine is told so instead of failing every test."""
    if CUDA:
        return None
    try:
        _probe_kernel[(1,)](torch.zeros(2, dtype=torch.int32), 2)
    except Exception as e:  # noqa: BLE001 - whatever the interpreter raises
        import numpy

        if "only 0-dimensional arrays can be converted" not in str(e):
            return None  # another failure: the tests say what it is
        return (f"Triton {triton.__version__}'s interpreter fails with numpy {numpy.__version__} ({e!r}); "
                "install numpy<2.4 or a newer Triton to run these tests on the CPU")  # fmt: skip
    return None


@pytest.fixture(autouse=True, scope="module")
def _interpreter_runs():
    """Probed once, when the module's first test runs (not at collection)."""
    why = _interpreter_problem()
    if why is not None:
        pytest.skip(why)


DEV = "cuda" if CUDA else "cpu"
FP8 = torch.float8_e4m3fn
SEED = random.randrange(1 << 30)
DTYPES = [torch.float16, torch.float32, FP8] + ([torch.bfloat16] if CUDA else [])


def _inputs(M, K, Ns, dtype, seed, col_major_b=False):
    A = randn((M, K), seed, scale=1.0)
    Bs = [randn((n, K) if col_major_b else (K, n), seed + 1 + i, scale=K**-0.5) for i, n in enumerate(Ns)]
    if col_major_b:
        Bs = [b.t() for b in Bs]
    if dtype == FP8:
        A, Bs = A.to(FP8), [(b * 8).to(FP8) for b in Bs]
        return A.to(DEV), [b.to(DEV) for b in Bs]
    return A.to(DEV, dtype), [b.to(DEV, dtype) for b in Bs]


def _poisoned(M, Ns, dtype):
    return [torch.full((M, n), float("nan"), device=DEV, dtype=dtype) for n in Ns]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("M,K,Ns", [(64, 32, (48,)), (100, 40, (33, 7)), (96, 64, (16, 40, 24)), (72, 48, (8, 8, 8, 8))])
def test_plain(dtype, M, K, Ns):
    A, Bs = _inputs(M, K, Ns, dtype, SEED, col_major_b=dtype == FP8)
    out_dtype = torch.bfloat16 if dtype == FP8 and CUDA else (torch.float32 if dtype == FP8 else dtype)
    outs = pm.persistent_matmul(A, Bs, outs=_poisoned(M, Ns, out_dtype))
    for B, C in zip(Bs, outs):
        ref = A.double().cpu() @ B.double().cpu()
        eager = (A.float() @ B.float()).to(out_dtype)
        assert_matmul_close(C, ref, eager, k=2.0, atol=1e-5)


@pytest.mark.parametrize("a_mode", ["tensor", "row"])
@pytest.mark.parametrize("with_bias,out_dtype", [(False, torch.float32), (True, torch.float16)])
@pytest.mark.parametrize("fast", [True, False])
def test_fp8_scales_bias(a_mode, with_bias, out_dtype, fast):
    M, K, Ns = 64, 64, (32, 24)
    A, Bs = _inputs(M, K, Ns, FP8, SEED, col_major_b=True)
    if a_mode == "tensor":
        A_scale = torch.tensor(0.7, device=DEV)
        B_scales = [torch.tensor(1.3, device=DEV), torch.tensor(0.4, device=DEV)]
    else:
        A_scale = (randn((M, 1), SEED + 7).abs() + 0.5).to(DEV)
        B_scales = [(randn((1, n), SEED + 8 + i).abs() + 0.5).to(DEV) for i, n in enumerate(Ns)]
    biases = [randn((n,), SEED + 20 + i).to(DEV, out_dtype) for i, n in enumerate(Ns)] if with_bias else None
    outs = pm.persistent_matmul(A, Bs, outs=_poisoned(M, Ns, out_dtype), A_scale=A_scale,
                                B_scales=B_scales, biases=biases, fast_accum=fast)  # fmt: skip
    for i, (B, C) in enumerate(zip(Bs, outs)):
        ref = (A.double().cpu() * A_scale.double().cpu()) @ (B.double().cpu() * B_scales[i].double().cpu())
        if with_bias:
            ref = ref + biases[i].double().cpu()
        assert_matmul_close(C, ref, ref.to(out_dtype), k=3.0, atol=1e-4)


def _strided_scales_bias(M, Ns, case):
    """Scales and biases that are views with strides (what users slice from tables), or expanded."""
    if case == "columns":  # column 1 of [M, 3]; column 2 of [n, 4]; a bias as column 0 of [n, 2]
        A_scale = (randn((M, 3), SEED + 7).abs() + 0.5).to(DEV)[:, 1:2]
        B_scales = [(randn((n, 4), SEED + 8 + i).abs() + 0.5).to(DEV)[:, 2].reshape(1, n) for i, n in enumerate(Ns)]
        biases = [randn((n, 2), SEED + 20 + i).to(DEV, torch.float16)[:, 0] for i, n in enumerate(Ns)]
    else:  # "expanded": one value per row / column, stride 0
        A_scale = torch.full((1, 1), 0.75, device=DEV).expand(M, 1)
        B_scales = [torch.full((1, 1), 1.25 + i, device=DEV).expand(1, n) for i, n in enumerate(Ns)]
        biases = [torch.full((1,), 0.5 - i, device=DEV, dtype=torch.float16).expand(n) for i, n in enumerate(Ns)]
    assert not A_scale.is_contiguous() and not any(b.is_contiguous() for b in B_scales + biases)
    return A_scale, B_scales, biases


@pytest.mark.parametrize("kernel,Ns", [("pointer", (40, 24)), ("pointer", (48, 37)), ("tma", (48,)), ("tma_flat", (40,))])
@pytest.mark.parametrize("case", ["columns", "expanded"])
def test_fp8_strided_scales_and_biases(kernel, Ns, case):
    """Row-wise scales and biases with strides are read by their strides, not as if contiguous
    (found by review: a bias sliced from a table gave errors of 2.0; an expanded scale read past
    its one element)."""
    M, K = 96, 64
    A, Bs = _inputs(M, K, Ns, FP8, SEED, col_major_b=True)
    A_scale, B_scales, biases = _strided_scales_bias(M, Ns, case)
    outs = pm.persistent_matmul(A, Bs, outs=_poisoned(M, Ns, torch.float32), A_scale=A_scale,
                                B_scales=B_scales, biases=biases, kernel=kernel)  # fmt: skip
    for i, (B, C) in enumerate(zip(Bs, outs)):
        ref = (A.double().cpu() * A_scale.double().cpu()) @ (B.double().cpu() * B_scales[i].double().cpu())
        ref = ref + biases[i].double().cpu()
        assert_matmul_close(C, ref, ref.float(), k=3.0, atol=1e-4)


def test_b_columns_masked_only_where_a_vector_could_leave_b_storage():
    """Column masking of B costs its vector loads: only where the last row's vector can end past
    the storage (N not a multiple of 16, 16-byte aligned rows, no room after the last row)."""
    K = 8
    wide = torch.zeros(K, 4112, dtype=torch.float16, device=DEV)
    assert not pm._b_needs_mask(wide[:, :4096])  # N % 16 == 0
    assert not pm._b_needs_mask(wide[:, :4088])  # room after the last row's 4088th column
    assert pm._b_needs_mask(wide[:, 8:])  # N = 4104: the last vector ends 8 past the storage
    assert not pm._b_needs_mask(torch.zeros(K, 4088, dtype=torch.float16, device=DEV)[:, 1:])  # rows unaligned
    assert not pm._b_needs_mask(torch.zeros(4088, K, dtype=torch.float16, device=DEV).t())  # K-major


@pytest.mark.parametrize("cols", [slice(8, None), slice(0, 4088)], ids=["masked", "room"])
def test_b_views_at_the_end_of_their_storage(cols):
    M, K = 64, 32
    A, _ = _inputs(M, K, (16,), torch.float16, SEED)
    B = randn((K, 4112), SEED + 3, scale=K**-0.5).to(DEV, torch.float16)[:, cols]
    (C,) = pm.persistent_matmul(A, [B], outs=_poisoned(M, (B.shape[1],), torch.float16), kernel="pointer")
    ref = A.double().cpu() @ B.double().cpu()
    assert_matmul_close(C, ref, (A.float() @ B.float()).half(), k=2.0, atol=1e-5)


@pytest.mark.parametrize("kernel,scatter", [("pointer", True), ("pointer", False), ("tma", False), ("tma_flat", False)])
@pytest.mark.parametrize("failed", [0, 1])
def test_guarded_stores_skip_everything_once_the_error_record_is_set(kernel, scatter, failed):
    """guard=True: a launch that starts with the error record set stores nothing (its outputs may
    be peers' symmetric buffers that a slow peer still reads: fail-stop); with it clear, all."""
    W, M, K, N = 3, 96, 32, 40
    A, (B,) = _inputs(M, K, (N,), torch.float16, SEED)
    err = torch.tensor([failed, 0, 0, 0, 0, 0], dtype=torch.int32, device=DEV)
    sentinel = 7.0
    if scatter:
        dests = [torch.full((M // W, N), sentinel, device=DEV, dtype=torch.float16) for _ in range(W)]
        order = torch.tensor([1, 2, 0], dtype=torch.int32, device=DEV)
        pm.persistent_matmul(A, [B], num_chunks=W, order=order, scatter_to=dests, err=err, guard=True)
        C = torch.cat(dests)
    else:
        (C,) = pm.persistent_matmul(A, [B], outs=[torch.full((M, N), sentinel, device=DEV, dtype=torch.float16)],
                                    err=err, guard=True, kernel=kernel)  # fmt: skip
    if failed:
        assert torch.all(C == sentinel), "a guarded launch stored with the error record set"
    else:
        ref = A.double().cpu() @ B.double().cpu()
        assert_matmul_close(C, ref, (A.float() @ B.float()).half(), k=2.0, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float16, FP8], ids=str)
@pytest.mark.parametrize("W,M", [(2, 64), (4, 96), (3, 90)])
def test_consumer_chunk_orders(dtype, W, M):
    K, Ns = 32, (40, 16)
    A, Bs = _inputs(M, K, Ns, dtype, SEED, col_major_b=dtype == FP8)
    out_dtype = torch.float32 if dtype == FP8 else dtype
    for rank in range(W):
        order = torch.tensor([(rank + i) % W for i in range(W)], dtype=torch.int32, device=DEV)
        flags = torch.full((W,), 5, dtype=torch.int32, device=DEV)  # pre-set for epoch 5
        outs = pm.persistent_matmul(A, Bs, outs=_poisoned(M, Ns, out_dtype), num_chunks=W,
                                    order=order, flags=flags, epoch=5, mode=pm.MODE_CONSUMER)  # fmt: skip
        for B, C in zip(Bs, outs):
            ref = A.double().cpu() @ B.double().cpu()
            assert_matmul_close(C, ref, (A.float() @ B.float()).to(out_dtype), k=2.0, atol=1e-5)


@pytest.mark.parametrize("W,M", [(2, 64), (4, 128), (3, 90)])
def test_producer_publishes_every_chunk(W, M):
    K, N = 32, 48
    A, (B,) = _inputs(M, K, (N,), torch.float16, SEED)
    flags = torch.zeros(W, dtype=torch.int32, device=DEV)
    counters = torch.zeros(W, dtype=torch.int32, device=DEV)
    for epoch in (1, 2):  # counters must be reset for the next call
        order = torch.tensor([(1 + i) % W for i in range(W)], dtype=torch.int32, device=DEV)
        (C,) = pm.persistent_matmul(A, [B], outs=_poisoned(M, (N,), torch.float16), num_chunks=W,
                                    order=order, flags=flags, counters=counters, epoch=epoch,
                                    mode=pm.MODE_PRODUCER)  # fmt: skip
        assert flags.tolist() == [epoch] * W
        assert counters.tolist() == [0] * W
        assert_matmul_close(C, A.double().cpu() @ B.double().cpu(), (A.float() @ B.float()).half(), k=2.0, atol=1e-5)


TMA_KERNELS = ["tma", "tma_flat"]
TMA_DTYPES = [torch.float16, FP8] + ([torch.bfloat16] if CUDA else [])


def _scaled_inputs(M, K, N, dtype, seed):
    """A, B and (for FP8) row-wise scales and a bias, as matmul-reduce-scatter's ranks pass them."""
    A, (B,) = _inputs(M, K, (N,), dtype, seed, col_major_b=dtype == FP8)
    if dtype != FP8:
        return A, B, {}, A.double().cpu() @ B.double().cpu()
    A_scale = (randn((M, 1), seed + 7).abs() + 0.5).to(DEV)
    B_scale = (randn((1, N), seed + 8).abs() + 0.5).to(DEV)
    bias = randn((N,), seed + 9).to(DEV, torch.float16)
    ref = (A.double().cpu() * A_scale.double().cpu()) @ (B.double().cpu() * B_scale.double().cpu())
    return A, B, dict(A_scale=A_scale, B_scales=[B_scale], biases=[bias]), ref + bias.double().cpu()


@pytest.mark.parametrize("kernel", TMA_KERNELS)
@pytest.mark.parametrize("dtype", TMA_DTYPES, ids=str)
@pytest.mark.parametrize("W,M,K,N,skew", [(3, 96, 64, 56, 0), (4, 160, 48, 40, 0), (3, 96, 64, 56, 1), (2, 64, 32, 8, 3)])
def test_tma_scatter_stores_each_chunk_to_its_buffer(kernel, dtype, W, M, K, N, skew):
    """scatter_to on the TMA kernel: chunk c's rows land in buffer c, renumbered from 0, while the
    row-wise A scale is still read at the chunk's rows of A; no other buffer row is touched.
    skew: the buffers start that many elements past a 16-byte boundary (slots of a symmetric
    buffer whose chunk size is not a multiple of 16 bytes)."""
    A, B, kw, ref = _scaled_inputs(M, K, N, dtype, SEED)
    out_dtype = torch.float16 if dtype == FP8 else dtype
    Mc = M // W
    flat = [torch.full((skew + (Mc + 1) * N,), 7.0, device=DEV, dtype=out_dtype) for _ in range(W)]
    dests = [f[skew:].view(Mc + 1, N) for f in flat]  # one guard row after the chunk's
    order = torch.tensor([(1 + i) % W for i in range(W)], dtype=torch.int32, device=DEV)
    for d in dests:
        d[:Mc] = float("nan")
    pm.persistent_matmul(A, [B], num_chunks=W, order=order, scatter_to=[d[:Mc] for d in dests], kernel=kernel,
                         out_dtype=out_dtype, **kw)  # fmt: skip
    for c in range(W):
        assert torch.all(dests[c][Mc] == 7.0) and torch.all(flat[c][:skew] == 7.0), "a store outside the chunk's rows"
        rows = slice(c * Mc, (c + 1) * Mc)
        assert_matmul_close(dests[c][:Mc], ref[rows], ref[rows].to(out_dtype), k=3.0, atol=1e-4)


@pytest.mark.parametrize("split", [("split", 2, 2), ("split", 3, 1), 7], ids=["split", "split1", "stream"])
@pytest.mark.parametrize("dtype", [torch.float16, FP8], ids=str)
def test_tma_scatter_with_a_split_last_wave(dtype, split, sk_buffers):
    """A scatter whose last tiles are split by K (the launch plan): each split tile is summed and
    stored to its own chunk's buffer, rows renumbered (the split tiles span chunks)."""
    W, M, K, N = 3, 96, 64, 48
    A, B, kw, ref = _scaled_inputs(M, K, N, dtype, SEED)
    out_dtype = torch.float16
    Mc = M // W
    dests = [torch.full((Mc, N), float("nan"), device=DEV, dtype=out_dtype) for _ in range(W)]
    order = torch.tensor([2, 0, 1], dtype=torch.int32, device=DEV)
    pm.persistent_matmul(A, [B], num_chunks=W, order=order, scatter_to=dests, kernel="tma", out_dtype=out_dtype,
                         config=pm.Config(16, 16, 32, 2, 4, 2), num_sms=6, stream_k=split, **kw)  # fmt: skip
    assert sk_buffers, "no tile was split"
    for c in range(W):
        rows = slice(c * Mc, (c + 1) * Mc)
        assert_matmul_close(dests[c], ref[rows], ref[rows].to(out_dtype), k=3.0, atol=1e-4)


def test_a_scatter_takes_the_launch_plan_unless_it_sums(monkeypatch):
    """stream_k=None: a scatter weighs the large-tile plan (SK_SCATTER) as a plain call does; with
    reduce= (the in-matmul sum, each own tile summed by its program) it takes whole tiles."""
    got = []

    def spy(*args, **kw):
        got.append((args[23], args[24]))  # stream_k, sk_config
        return [args[2]] if kw.get("reduce") is None else [kw["reduce"].out]

    monkeypatch.setattr(pm, "_launch_tma", spy)
    monkeypatch.setattr(pm, "_interpreting", lambda: False)
    W, M, K, N = 2, 512, 256, 384
    A, (B,) = _inputs(M, K, (N,), torch.float16, SEED)
    red, _ = _reduce_case(W, 0, M, N, torch.float16, 1.0, SEED)
    dests = [red.slots[0], torch.empty(M // W, N, device=DEV, dtype=torch.float16)]
    order = torch.tensor([1, 0], dtype=torch.int32, device=DEV)
    pm.persistent_matmul(A, [B], num_chunks=W, order=order, scatter_to=dests, kernel="tma")
    pm.persistent_matmul(A, [B], num_chunks=W, order=order, scatter_to=dests, reduce=red)
    monkeypatch.setattr(pm, "SK_SCATTER", False)
    pm.persistent_matmul(A, [B], num_chunks=W, order=order, scatter_to=dests, kernel="tma")
    large = pm.SK_CONFIG["16bit"]
    assert got == [(None, large), (False, None), (False, None)], got


def _reduce_case(W, rank, M, N, out_dtype, scale, seed, peer_fill=None):
    """This rank's buffer [W, M // W, N] with the peers' partials in (the own slot NaN), the
    arrival flags pre-set (the interpreter runs programs one by one: nothing may wait), and the
    flags the launch must set in the owners' pads (`peer_flags`, one per chunk). peer_fill(slot),
    where given, fills a peer's slot in place (on the device) instead of seeded CPU values."""
    Mc = M // W
    slots = torch.full((W, Mc, N), float("nan"), device=DEV, dtype=out_dtype)
    for p in range(W):
        if p != rank:
            if peer_fill is not None:
                peer_fill(slots[p])
            else:
                slots[p] = randn((Mc, N), seed + 100 + p, scale=4.0).to(DEV, out_dtype)
    peer_flags = torch.zeros(W, dtype=torch.int32, device=DEV)
    arrive_to = torch.tensor([peer_flags.data_ptr() + 4 * c for c in range(W)], dtype=torch.int64, device=DEV)
    arrived = torch.tensor([0 if p == rank else 1 for p in range(W)], dtype=torch.int32, device=DEV)
    out = torch.full((Mc, N), float("nan"), device=DEV, dtype=out_dtype)
    red = pm.Reduce(rank=rank, slots=slots, out=out, counters=torch.zeros(W, dtype=torch.int32, device=DEV),
                    arrive_to=arrive_to, arrived=arrived, err=torch.zeros(6, dtype=torch.int32, device=DEV),
                    scale=scale)  # fmt: skip
    return red, peer_flags


@pytest.mark.parametrize("dtype", TMA_DTYPES, ids=str)
@pytest.mark.parametrize("W,M,K,N", [(2, 64, 32, 48), (3, 96, 64, 40), (4, 160, 48, 72)])
@pytest.mark.parametrize("scale", [1.0, "avg"])
def test_tma_reduce_sums_the_chunk_in_the_matmul(dtype, W, M, K, N, scale):
    """reduce=: every rank's order ends with its own chunk; that chunk's partial goes to its slot,
    and out = scale * the fp32 sum of the W slots in slot order (bit for bit what
    reduce_partials computes from the same slots); every other chunk goes to its owner and its
    arrival is flagged once; the tile counters are left zero for the next launch."""
    A, B, kw, ref = _scaled_inputs(M, K, N, dtype, SEED)
    out_dtype = torch.float16 if dtype == FP8 else dtype
    s = 1.0 / W if scale == "avg" else 1.0
    Mc = M // W
    for rank in range(W):
        red, peer_flags = _reduce_case(W, rank, M, N, out_dtype, s, SEED + rank)
        peers_before = red.slots.clone()
        dests = [torch.full((Mc, N), float("nan"), device=DEV, dtype=out_dtype) for _ in range(W)]
        dests[rank] = red.slots[rank]
        order = torch.tensor([(rank + 1 + i) % W for i in range(W)], dtype=torch.int32, device=DEV)
        (out,) = pm.persistent_matmul(A, [B], num_chunks=W, order=order, scatter_to=dests, reduce=red,
                                      kernel="tma", out_dtype=out_dtype, **kw)  # fmt: skip
        assert out is red.out
        for c in range(W):
            rows = slice(c * Mc, (c + 1) * Mc)
            got = red.slots[rank] if c == rank else dests[c]
            assert_matmul_close(got, ref[rows], ref[rows].to(out_dtype), k=3.0, atol=1e-4)
        for p in range(W):  # the peers' slots are read, never written
            if p != rank:
                assert torch.equal(red.slots[p], peers_before[p])
        want = torch.zeros(Mc, N, dtype=torch.float32)
        for p in range(W):
            want += red.slots[p].cpu().float()
        want = (want * s).to(out_dtype)
        assert torch.equal(out.cpu(), want), f"rank {rank}: not the slot-order fp32 sum"
        assert peer_flags.tolist() == [0 if c == rank else 1 for c in range(W)]
        assert red.counters.tolist() == [0] * W and red.err.tolist() == [0] * 6


@pytest.mark.parametrize("failed", [0, 1])
def test_guarded_reduce_neither_stores_nor_flags_once_the_latch_is_set(failed):
    """guard=True with reduce: a launch that starts with the latch set stores no partial into a
    peer's buffer and flags no chunk as arrived (a peer would sum what was never sent); with
    it clear, every peer's chunk is stored and flagged."""
    W, M, K, N, rank = 3, 96, 32, 40, 2
    A, (B,) = _inputs(M, K, (N,), torch.float16, SEED)
    red, peer_flags = _reduce_case(W, rank, M, N, torch.float16, 1.0, SEED)
    dests = [torch.full((M // W, N), 7.0, device=DEV, dtype=torch.float16) for _ in range(W)]
    dests[rank] = red.slots[rank]
    order = torch.tensor([(rank + 1 + i) % W for i in range(W)], dtype=torch.int32, device=DEV)
    latch = torch.tensor([failed, 0, 0, 0, 0, 0], dtype=torch.int32, device=DEV)
    pm.persistent_matmul(A, [B], num_chunks=W, order=order, scatter_to=dests, reduce=red, err=latch, guard=True,
                         kernel="tma")  # fmt: skip
    peers = [c for c in range(W) if c != rank]
    if failed:
        assert peer_flags.tolist() == [0] * W
        assert all(torch.all(dests[c] == 7.0) for c in peers)
    else:
        assert peer_flags.tolist() == [int(c != rank) for c in range(W)]
        assert not any(torch.any(dests[c] == 7.0) for c in peers)
    assert red.counters.tolist() == [0] * W


def test_scatter_destinations_are_checked():
    """A destination the kernels would write wrongly (strided: rows are stored N apart), past its
    end (too small), or in another dtype than the others is a ValueError naming it, on both
    kernels (found by review: silently wrong values, or stores past the end)."""
    W, M, K, N = 2, 64, 32, 48
    A, (B,) = _inputs(M, K, (N,), torch.float16, SEED)
    order = torch.tensor([1, 0], dtype=torch.int32, device=DEV)
    good = torch.empty(M // W, N, device=DEV, dtype=torch.float16)
    bad = {
        "strided": torch.empty(M // W, 2 * N, device=DEV, dtype=torch.float16)[:, :N],
        "too small": torch.empty(M // W // 2, N, device=DEV, dtype=torch.float16),
        "another dtype": torch.empty(M // W, N, device=DEV, dtype=torch.float32),
    }
    for kernel in ("pointer", "tma"):
        for what, d in bad.items():
            with pytest.raises(ValueError, match=r"scatter_to\[1\]"):
                pm.persistent_matmul(A, [B], num_chunks=W, order=order, scatter_to=[good, d], kernel=kernel)
                pytest.fail(f"{kernel}: a destination {what} was accepted")
        with pytest.raises(ValueError, match="num_chunks"):
            pm.persistent_matmul(A, [B], num_chunks=W, order=order, scatter_to=[good], kernel=kernel)


def test_reduce_arguments_are_checked():
    """A Reduce that does not fit the call is a ValueError (not an assert, gone under python -O)."""
    W, M, K, N = 2, 64, 32, 48
    A, (B,) = _inputs(M, K, (N,), torch.float16, SEED)
    order = torch.tensor([1, 0], dtype=torch.int32, device=DEV)
    import dataclasses

    for change, needle in [(lambda r: dict(out=r.out[:-1]), "out"),
                           (lambda r: dict(slots=r.slots.float()), "one dtype"),
                           (lambda r: dict(counters=r.counters[:1]), "num_chunks"),
                           (lambda r: dict(arrive_to=r.arrive_to.int()), "int64"),
                           (lambda r: dict(err=r.err[:2]), "err")]:  # fmt: skip
        red, _ = _reduce_case(W, 0, M, N, torch.float16, 1.0, SEED)
        dests = [red.slots[0], torch.empty(M // W, N, device=DEV, dtype=torch.float16)]
        with pytest.raises(ValueError, match=needle):
            pm.persistent_matmul(A, [B], num_chunks=W, order=order, scatter_to=dests, kernel="tma",
                                 reduce=dataclasses.replace(red, **change(red)))  # fmt: skip
    red, _ = _reduce_case(W, 0, M, N, torch.float16, 1.0, SEED)
    with pytest.raises(ValueError, match="scatter_to.rank. must be slots.rank."):
        pm.persistent_matmul(A, [B], num_chunks=W, order=order, kernel="tma", reduce=red,
                             scatter_to=[torch.empty(M // W, N, device=DEV, dtype=torch.float16) for _ in range(W)])  # fmt: skip


def test_reduce_is_offered_only_once_a_tma_launch_ran(monkeypatch):
    """reduce_eligible: no in-matmul sum (it has no pointer kernel to fall back to) before a TMA
    launch has succeeded in the process (found by review: a Triton whose TMA launch fails would
    take it on every rank, and every rank would raise)."""
    A, (B,) = _inputs(64, 32, (48,), torch.float16, SEED)
    monkeypatch.setattr(pm, "_interpreting", lambda: False)
    monkeypatch.setattr(pm, "TMA_PROVEN", False)
    fake = type("T", (), {"is_cuda": True, "stride": A.stride, "data_ptr": A.data_ptr, "element_size": A.element_size,
                          "dtype": A.dtype})()  # fmt: skip
    assert not pm.reduce_eligible(fake, B)
    monkeypatch.setattr(pm, "TMA_PROVEN", True)
    assert pm.reduce_eligible(fake, B)
    monkeypatch.setattr(pm, "USE_TMA", False)
    assert not pm.reduce_eligible(fake, B)


def test_reduce_refuses_what_it_cannot_serve():
    W, M, K, N = 2, 64, 32, 48
    A, (B,) = _inputs(M, K, (N,), torch.float16, SEED)
    red, _ = _reduce_case(W, 0, M, N, torch.float16, 1.0, SEED)
    dests = [red.slots[0], torch.empty(M // W, N, device=DEV, dtype=torch.float16)]
    order = torch.tensor([1, 0], dtype=torch.int32, device=DEV)
    with pytest.raises(ValueError, match="reduce needs scatter_to"):
        pm.persistent_matmul(A, [B], num_chunks=W, order=order, reduce=red)
    with pytest.raises(ValueError, match="reduce needs the TMA kernel"):
        pm.persistent_matmul(A, [B], num_chunks=W, order=order, scatter_to=dests, reduce=red, kernel="pointer")
    with pytest.raises(ValueError, match="reduce needs the TMA kernel"):  # rows not 16-byte aligned
        A_odd = torch.empty(M, K + 1, device=DEV, dtype=torch.float16)[:, :K].copy_(A)
        pm.persistent_matmul(A_odd, [B], num_chunks=W, order=order, scatter_to=dests, reduce=red)
    assert not pm.reduce_eligible(A_odd, B)


@pytest.mark.skipif(not CUDA, reason="needs a GPU: a flag that is never set, and globaltimer")
def test_reduce_timeout_fills_the_error_record_and_gives_up():
    """One peer's partial never arrives: after timeout_s the record names the arrival channel, the
    peer and the tag, and the launch ends (the caller poisons out from the record)."""
    import time

    W, M, K, N, tag = 4, 4096, 256, 4096, 13
    A, (B,) = _inputs(M, K, (N,), torch.bfloat16, SEED)
    rank = 1
    red, peer_flags = _reduce_case(W, rank, M, N, torch.bfloat16, 1.0, SEED)
    red.arrived[3] = 0
    dests = [torch.empty(M // W, N, device=DEV, dtype=torch.bfloat16) for _ in range(W)]
    dests[rank] = red.slots[rank]
    order = torch.tensor([(rank + 1 + i) % W for i in range(W)], dtype=torch.int32, device=DEV)
    torch.cuda.synchronize()
    t0 = time.monotonic()
    pm.persistent_matmul(A, [B], num_chunks=W, order=order, scatter_to=dests, reduce=red, timeout_s=0.5, tag=tag)
    torch.cuda.synchronize()
    assert time.monotonic() - t0 < 10.0
    assert red.err.tolist() == [1, 3, 3, 1, 0, tag]
    assert red.counters.tolist() == [0] * W and peer_flags.tolist() == [1, 0, 1, 1]


@pytest.mark.parametrize("kernel", TMA_KERNELS)
@pytest.mark.parametrize("dtype", TMA_DTYPES, ids=str)
@pytest.mark.parametrize("W,M,K,N", [(1, 72, 48, 40), (3, 96, 64, 56), (4, 160, 80, 24)])
def test_tma_kernels_plain_and_consumer(kernel, dtype, W, M, K, N):
    """The tensor-descriptor kernels: odd (16-byte aligned) shapes, every chunk order, FP8 K-major B."""
    A, (B,) = _inputs(M, K, (N,), dtype, SEED, col_major_b=dtype == FP8)
    out_dtype = torch.float32 if dtype == FP8 else dtype
    ref = A.double().cpu() @ B.double().cpu()
    eager = (A.float() @ B.float()).to(out_dtype)
    for rank in range(W):
        order = torch.tensor([(rank + i) % W for i in range(W)], dtype=torch.int32, device=DEV)
        flags = torch.full((W,), 3, dtype=torch.int32, device=DEV)
        mode = pm.MODE_CONSUMER if W > 1 else pm.MODE_PLAIN
        (C,) = pm.persistent_matmul(A, [B], outs=_poisoned(M, (N,), out_dtype), num_chunks=W, order=order,
                                    flags=flags, epoch=3, mode=mode, kernel=kernel)  # fmt: skip
        assert_matmul_close(C, ref, eager, k=2.0, atol=1e-5)


@pytest.mark.parametrize("kernel", TMA_KERNELS)
@pytest.mark.parametrize("a_mode,with_bias", [("tensor", True), ("row", False), ("row", True)])
@pytest.mark.parametrize("split", [None, 7, ("split", 2, 2)], ids=["whole", "stream", "split"])
def test_tma_kernels_fp8_scales_bias(kernel, a_mode, with_bias, split, sk_buffers):
    """Scales and bias applied once per tile (with a split last wave: after the pieces are summed)."""
    M, K, N = 96, 64, 48
    A, (B,) = _inputs(M, K, (N,), FP8, SEED, col_major_b=True)
    if a_mode == "tensor":
        A_scale, B_scale = torch.tensor(0.7, device=DEV), torch.tensor(1.3, device=DEV)
    else:
        A_scale = (randn((M, 1), SEED + 7).abs() + 0.5).to(DEV)
        B_scale = (randn((1, N), SEED + 8).abs() + 0.5).to(DEV)
    bias = randn((N,), SEED + 20).to(DEV, torch.float16) if with_bias else None
    kw = {} if split is None else dict(config=pm.Config(16, 16, 32, 2, 4, 2), num_sms=5, stream_k=split)
    (C,) = pm.persistent_matmul(A, [B], outs=_poisoned(M, (N,), torch.float16), A_scale=A_scale,
                                B_scales=[B_scale], biases=[bias] if with_bias else None, kernel=kernel, **kw)  # fmt: skip
    assert bool(sk_buffers) == (split is not None)
    ref = (A.double().cpu() * A_scale.double().cpu()) @ (B.double().cpu() * B_scale.double().cpu())
    if with_bias:
        ref = ref + bias.double().cpu()
    assert_matmul_close(C, ref, ref.half(), k=3.0, atol=1e-4)


@pytest.mark.parametrize("kernel", ["pointer", *TMA_KERNELS])
@pytest.mark.parametrize("dtype", TMA_DTYPES, ids=str)
def test_big_tiles_on_small_odd_shapes(kernel, dtype):
    """Production-size tiles larger than the operands (K < BLOCK_K, M and N not multiples)."""
    M, K, N, W = 300, 48, 520, 3
    A, (B,) = _inputs(M, K, (N,), dtype, SEED, col_major_b=dtype == FP8)
    out_dtype = torch.float32 if dtype == FP8 else dtype
    cfg = pm.Config(128, 128, 128, 8, 8, 3) if dtype == FP8 else pm.Config(128, 256, 64, 8, 8, 3)
    flags = torch.ones(W, dtype=torch.int32, device=DEV)
    order = torch.tensor([2, 0, 1], dtype=torch.int32, device=DEV)
    (C,) = pm.persistent_matmul(A, [B], outs=_poisoned(M, (N,), out_dtype), num_chunks=W, order=order, flags=flags,
                                mode=pm.MODE_CONSUMER, config=cfg, kernel=kernel)  # fmt: skip
    # FP8 products are exact in fp32, so the eager fp32 result has no error here, while the FP8
    # tensor-core accumulation keeps fewer bits (measured 6.5e-5 relative on the H200 at K = 48).
    atol = 3e-4 if dtype == FP8 else 1e-5
    assert_matmul_close(C, A.double().cpu() @ B.double().cpu(), (A.float() @ B.float()).to(out_dtype), k=2.0, atol=atol)


def _tma_store_used() -> list:
    """The TMA_STORE constexpr of every launch plan made since pm._TMA_PLANS was cleared."""
    return [plan[5]["TMA_STORE"] for plan in pm._TMA_PLANS.values()]


@pytest.mark.skipif(CUDA, reason="interpreter: small tiles stand in for the production ones")
@pytest.mark.parametrize("kernel", TMA_KERNELS)
@pytest.mark.parametrize(
    "case, W, M, N, out_dtype, store",
    [
        ("plain", 1, 72, 40, None, True),  # ragged M and N: the descriptor clips at C's edges
        ("consumer", 3, 96, 56, None, True),  # chunks of 32 rows: whole 16-row tiles
        ("ragged_chunks", 3, 72, 40, None, False),  # chunks of 24 rows: a tile would cross into the next
        ("fp8_out", 1, 64, 48, FP8, True),  # one byte per element, saturated first
        ("fp32_out", 1, 64, 48, torch.float32, False),  # its staging tile would take the loads' memory
        ("unaligned_out", 1, 64, 48, "offset", False),  # C starts 2 bytes past a 16-byte boundary
        ("odd_n", 1, 64, 44, torch.float16, False),  # FP8 in, rows of 88 bytes out: not 16-byte aligned
    ],
)
def test_tma_store_serves_what_it_can_and_leaves_the_rest_to_the_masked_store(monkeypatch, kernel, case, W, M, N,
                                                                              out_dtype, store):
    """Whole tiles go out through a descriptor of C where every tile lies within its chunk and C
    is a dense, 16-byte aligned 1- or 2-byte output; elsewhere the masked store. Both against
    float64, poisoned outputs, every chunk order."""
    monkeypatch.setattr(pm, "TMA_STORE_BLOCK_N", 16)  # the interpreter's 16 x 16 tiles qualify
    K = 64
    fp8_in = out_dtype in (FP8, torch.float16)
    A, (B,) = _inputs(M, K, (N,), FP8 if fp8_in else torch.float16, SEED, col_major_b=fp8_in)
    kw = dict(kernel=kernel, config=pm.Config(16, 16, 32, 2, 4, 2), num_sms=5)
    ref = A.double().cpu() @ B.double().cpu()
    if out_dtype is FP8:  # saturated FP8 output through a result scale (as _scaled_mm)
        kw.update(A_scale=torch.tensor(1.0, device=DEV), B_scales=[torch.tensor(1.0, device=DEV)],
                  result_scale=torch.tensor(0.5, device=DEV), out_dtype=FP8)  # fmt: skip
        ref = ref * 0.5
    elif fp8_in:
        kw.update(A_scale=torch.tensor(1.0, device=DEV), B_scales=[torch.tensor(1.0, device=DEV)],
                  out_dtype=torch.float16)  # fmt: skip
    odt = torch.float16 if out_dtype in (None, "offset") else out_dtype
    for rank in range(W):
        pm._TMA_PLANS.clear()
        if out_dtype == "offset":
            out = torch.full((M * N + 1,), float("nan"), device=DEV, dtype=odt)[1:].view(M, N)
        else:
            out = torch.full((M, N), float("nan"), device=DEV, dtype=torch.float32).to(odt)
        order = torch.tensor([(rank + i) % W for i in range(W)], dtype=torch.int32, device=DEV)
        flags = torch.ones(W, dtype=torch.int32, device=DEV)
        mode = pm.MODE_CONSUMER if W > 1 else pm.MODE_PLAIN
        (C,) = pm.persistent_matmul(A, [B], outs=[out], num_chunks=W, order=order, flags=flags, epoch=1, mode=mode,
                                    **kw)  # fmt: skip
        assert _tma_store_used() == [store], case
        if out_dtype is FP8:
            want = ref.clamp(-448, 448).to(FP8).double()
            assert (C.double().cpu() - want).abs().max().item() <= want.abs().max().item() * 2**-3, case
        else:
            assert_matmul_close(C, ref, (A.float() @ B.float()).to(odt), k=2.0, atol=1e-5)


@pytest.mark.skipif(CUDA, reason="interpreter: small tiles stand in for the production ones")
@pytest.mark.parametrize("split", [7, ("split", 2, 2)], ids=["stream", "split"])
def test_tma_store_of_whole_tiles_beside_a_split_last_wave(monkeypatch, split, sk_buffers):
    """The tiles dealt out whole take the TMA store, the split tiles the masked store: every
    element written once, right."""
    monkeypatch.setattr(pm, "TMA_STORE_BLOCK_N", 16)
    pm._TMA_PLANS.clear()
    M, K, N = 96, 64, 48
    A, (B,) = _inputs(M, K, (N,), torch.float16, SEED)
    (C,) = pm.persistent_matmul(A, [B], outs=_poisoned(M, (N,), torch.float16), kernel="tma",
                                config=pm.Config(16, 16, 32, 2, 4, 2), num_sms=5, stream_k=split)  # fmt: skip
    assert sk_buffers and _tma_store_used() == [True]
    assert_matmul_close(C, A.double().cpu() @ B.double().cpu(), (A.float() @ B.float()).half(), k=2.0, atol=1e-5)


@pytest.mark.skipif(CUDA, reason="interpreter: small tiles stand in for the production ones")
def test_guarded_tma_store_writes_nothing_once_a_wait_failed(monkeypatch):
    """guard=True with the error record set: the TMA store is skipped like the masked one."""
    monkeypatch.setattr(pm, "TMA_STORE_BLOCK_N", 16)
    pm._TMA_PLANS.clear()
    M, K, N = 64, 32, 48
    A, (B,) = _inputs(M, K, (N,), torch.float16, SEED)
    err = torch.zeros(6, dtype=torch.int32, device=DEV)
    err[0] = 1
    (C,) = pm.persistent_matmul(A, [B], outs=_poisoned(M, (N,), torch.float16), kernel="tma", err=err, guard=True,
                                poison=False, config=pm.Config(16, 16, 32, 2, 4, 2), num_sms=5)  # fmt: skip
    assert _tma_store_used() == [True]
    assert torch.isnan(C.float()).all()
    err[0] = 0
    (C,) = pm.persistent_matmul(A, [B], outs=_poisoned(M, (N,), torch.float16), kernel="tma", err=err, guard=True,
                                poison=False, config=pm.Config(16, 16, 32, 2, 4, 2), num_sms=5)  # fmt: skip
    assert_matmul_close(C, A.double().cpu() @ B.double().cpu(), (A.float() @ B.float()).half(), k=2.0, atol=1e-5)


@pytest.mark.skipif(not CUDA, reason="needs a GPU: production tiles")
@pytest.mark.parametrize("dtype", [torch.bfloat16, FP8], ids=str)
@pytest.mark.parametrize("N, store", [(3584, True), (768, False)])
def test_tma_store_at_production_size(monkeypatch, dtype, N, store):
    """With TMA_STORE_BLOCK_N = 256 (off by default), the default plan takes the TMA store with
    128 x 256 tiles (plain and consumer, W = 8) and not with 128 x 128 ones; the results match
    cuBLAS either way."""
    monkeypatch.setattr(pm, "TMA_STORE_BLOCK_N", 256)
    M, K, W = 4096, 1792, 8
    A, (B,) = _inputs(M, K, (N,), dtype, SEED, col_major_b=dtype == FP8)
    kw = {}
    if dtype == FP8:
        kw = dict(A_scale=torch.rand(M, 1, device=DEV) + 0.5, B_scales=[torch.rand(1, N, device=DEV) + 0.5],
                  out_dtype=torch.bfloat16)  # fmt: skip
        peer = torch._scaled_mm(A, B, kw["A_scale"], kw["B_scales"][0], out_dtype=torch.bfloat16, use_fast_accum=True)
        exact = (A.double() @ B.double()) * kw["A_scale"].double() * kw["B_scales"][0].double()
    else:
        peer, exact = A @ B, A.double() @ B.double()
    for extra in ({}, dict(num_chunks=W, flags=torch.ones(W, dtype=torch.int32, device=DEV), epoch=1,
                           mode=pm.MODE_CONSUMER)):  # fmt: skip
        pm._TMA_PLANS.clear()
        (C,) = pm.persistent_matmul(A, [B], outs=_poisoned(M, (N,), torch.bfloat16), stream_k=False, **extra, **kw)
        torch.cuda.synchronize()
        assert _tma_store_used() == [store]
        assert_matmul_close(C, exact, peer, k=2.0, atol=1e-3)


@pytest.mark.skipif(not CUDA, reason="needs a GPU: production tiles and CUDA graphs")
def test_tma_store_in_a_cuda_graph_and_eager_between_replays(monkeypatch):
    """With the TMA store on, a captured launch replays into its own output (the descriptor of C
    is baked into the graph), and eager launches of the same shape between replays -- launch
    memo hits, each with a fresh C and so a fresh descriptor -- write theirs, not the graph's."""
    monkeypatch.setattr(pm, "TMA_STORE_BLOCK_N", 256)
    M, N, K = 4096, 3584, 1792
    A, (B,) = _inputs(M, K, (N,), torch.bfloat16, SEED)
    static_A = A.clone()
    pm._TMA_PLANS.clear()
    pm.persistent_matmul(static_A, [B], stream_k=False)  # compile outside the capture
    pm.persistent_matmul(static_A, [B], stream_k=False)  # and record the memo entry
    assert _tma_store_used() == [True]
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        (C,) = pm.persistent_matmul(static_A, [B], stream_k=False)
    for i in range(3):
        Ai = _inputs(M, K, (N,), torch.bfloat16, SEED + 100 + i)[0]
        static_A.copy_(Ai)
        C.fill_(float("nan"))
        g.replay()
        Es = [pm.persistent_matmul(static_A, [B], stream_k=False)[0] for _ in range(2)]  # eager, same stream
        torch.cuda.synchronize()
        ref = Ai.double() @ B.double()
        peer = (Ai.float() @ B.float()).bfloat16()
        assert_matmul_close(C, ref, peer, k=2.0, atol=1e-5, what="replay")
        for E in Es:
            assert E.data_ptr() != C.data_ptr()
            assert_matmul_close(E, ref, peer, k=2.0, atol=1e-5, what="eager between replays")
    assert _tma_store_used() == [True]


def test_forced_tma_kernel_refuses_what_it_cannot_serve():
    A, Bs = _inputs(64, 32, (16, 16), torch.float16, SEED)
    with pytest.raises(ValueError, match="kernel='tma' needs one B"):
        pm.persistent_matmul(A, Bs, kernel="tma")
    with pytest.raises(ValueError, match="kernel must be one of"):
        pm.persistent_matmul(A, Bs[:1], kernel="cutlass")


@pytest.mark.skipif(not CUDA, reason="needs a GPU: the interpreter cannot overlap a late writer")
@pytest.mark.parametrize("kernel,dtype", [("pointer", torch.bfloat16), ("tma", torch.bfloat16),
                                          ("tma_flat", torch.bfloat16), ("pointer", FP8), ("tma_flat", FP8)])
@pytest.mark.parametrize("N", [1024, 768])  # 768: the TMA kernels split the last tiles (sk_mode)
def test_consumer_waits_for_late_flags(kernel, dtype, N, sk_mode):
    """Flags are set by another stream after a delay: tiles must not read rows before it."""
    W, M, K = 4, 4096, 1024 if N != 768 else 4096  # 768: above SK_MIN_FLOPS
    A, (B,) = _inputs(M, K, (N,), dtype, SEED, col_major_b=dtype == FP8)
    A_late = torch.zeros_like(A)  # rows arrive chunk by chunk from a copy stream
    flags = torch.zeros(W, dtype=torch.int32, device=DEV)
    one = torch.ones(1, dtype=torch.int32).pin_memory()
    side = torch.cuda.Stream()
    main = torch.cuda.current_stream()
    side.wait_stream(main)
    with torch.cuda.stream(side):
        torch.cuda._sleep(50_000_000)  # the kernel starts first and must wait
        for c in range(W):
            rows = slice(c * M // W, (c + 1) * M // W)
            A_late[rows].copy_(A[rows])
            # A copy-engine write, never a kernel (which might not get an SM).
            flags[c : c + 1].copy_(one, non_blocking=True)
    (C,) = pm.persistent_matmul(A_late, [B], num_chunks=W, flags=flags, epoch=1, mode=pm.MODE_CONSUMER,
                                kernel=kernel)  # fmt: skip
    torch.cuda.synchronize()
    ref = A.double() @ B.double()
    assert_matmul_close(C, ref, (A.float() @ B.float()).to(C.dtype), k=2.0, atol=1e-5)


@pytest.mark.skipif(not CUDA, reason="needs a GPU: copies and a consumer holding every SM")
@pytest.mark.parametrize("dtype,row_scales", [(torch.bfloat16, False), (FP8, False), (FP8, True)], ids=str)
def test_consumer_at_production_size_with_copies_of_the_op(dtype, row_scales):
    """The fused all-gather-matmul's own conditions at a Llama-70B shape (W = 8, M = 8192, K = 3584,
    N = 8192, the default kernel and config): the chunks arrive through pull_chunks (same-device
    cudaMemcpyAsync + flag memops) on another stream while the consumer holds every SM. If such
    a copy needed an SM it could not get, the consumer would time out (as the op did for FP8
    row-wise in loopback on the H200 at 8b087d0); here it must finish, correct, in seconds."""
    import time

    from mptp_kernels.symm.primitives import pull_chunks

    W, M, K, N = 8, 8192, 3584, 8192
    A, (B,) = _inputs(M, K, (N,), dtype, SEED, col_major_b=dtype == FP8)
    kw = {}
    if dtype == FP8:
        sa = (torch.rand(M, device=DEV) + 0.5) if row_scales else torch.tensor(0.5, device=DEV)
        sb = (torch.rand(1, N, device=DEV) + 0.5) if row_scales else torch.tensor(2.0, device=DEV)
        kw = dict(A_scale=sa, B_scales=[sb], out_dtype=torch.bfloat16)
    rows = M // W
    A_late = torch.zeros_like(A)
    A_late[:rows].copy_(A[:rows])
    flags = torch.zeros(W, dtype=torch.int32, device=DEV)
    flags[0] = 1
    err = torch.zeros(6, dtype=torch.int32, device=DEV)
    side, main = torch.cuda.Stream(), torch.cuda.current_stream()
    torch.cuda.synchronize()
    side.wait_stream(main)
    with torch.cuda.stream(side):
        torch.cuda._sleep(20_000_000)  # the consumer is resident first
        pull_chunks([(A_late[c * rows : (c + 1) * rows], A[c * rows : (c + 1) * rows], flags[c]) for c in range(1, W)],
                    1, side)  # fmt: skip
    t0 = time.monotonic()
    (C,) = pm.persistent_matmul(A_late, [B], num_chunks=W, flags=flags, epoch=1, mode=pm.MODE_CONSUMER,
                                timeout_s=20.0, err=err, tag=5, **kw)  # fmt: skip
    torch.cuda.synchronize()
    elapsed = time.monotonic() - t0
    assert err.tolist() == [0] * 6, f"the consumer timed out waiting for a copy: record {err.tolist()}"
    assert elapsed < 5.0, f"{elapsed:.1f} s"
    if dtype == FP8:
        # The kernel's default is fast accumulation (Hopper's FP8 wgmma accumulates in reduced
        # precision), so cuBLAS's fast-accum result is the peer: both are bounded against float64.
        sa64 = kw["A_scale"].double().view(-1, 1) if row_scales else kw["A_scale"].double()
        exact = (A.double() @ B.double()) * sa64 * kw["B_scales"][0].double()
        peer = torch._scaled_mm(A, B, kw["A_scale"].view(-1, 1) if row_scales else kw["A_scale"], kw["B_scales"][0],
                                out_dtype=torch.bfloat16, use_fast_accum=True)  # fmt: skip
        assert_matmul_close(C, exact, peer, k=2.0, atol=1e-3)
    else:
        ref = A.float() @ B.float()
        assert_matmul_close(C, ref.double(), ref.to(C.dtype), k=2.0, atol=1e-4)


@pytest.mark.parametrize("W,M", [(2, 64), (4, 96)])
def test_producer_scatters_chunks_to_their_owners(W, M):
    K, N = 32, 40
    A, (B,) = _inputs(M, K, (N,), torch.float16, SEED)
    dests = [torch.full((M // W, N), float("nan"), device=DEV, dtype=torch.float16) for _ in range(W)]
    order = torch.tensor([(1 + i) % W for i in range(W)], dtype=torch.int32, device=DEV)
    pm.persistent_matmul(A, [B], num_chunks=W, order=order, scatter_to=dests)
    ref = A.double().cpu() @ B.double().cpu()
    eager = (A.float() @ B.float()).half()
    for c in range(W):
        rows = slice(c * M // W, (c + 1) * M // W)
        assert_matmul_close(dests[c], ref[rows], eager[rows], k=2.0, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=str)
def test_reduce_partials_fixed_order(dtype):
    from mptp_kernels.kernels.reduce import reduce_partials

    P = randn((3, 37, 29), SEED).to(DEV, dtype)
    out = torch.full((37, 29), float("nan"), device=DEV, dtype=dtype)
    reduce_partials(P, out, scale=0.5)
    ref = P.double().cpu().sum(0) * 0.5
    assert_matmul_close(out, ref, ref.to(dtype), k=2.0, atol=1e-6)



@triton.jit
def _sync_kernel(flags, err, out):
    signal_release(flags + 0, 7)
    wait_acquire(flags + 1, 3, 1_000_000_000, err, 1, 5)
    tl.store(out, tl.load(flags + 0))


def test_triton_sync_helpers_signal_then_wait():
    """signal_release publishes, wait_acquire passes (flags pre-set for the interpreter)."""
    flags = torch.tensor([0, 3], dtype=torch.int32, device=DEV)
    err = torch.zeros(6, dtype=torch.int32, device=DEV)
    out = torch.zeros(1, dtype=torch.int32, device=DEV)
    _sync_kernel[(1,)](flags, err, out)
    assert flags.tolist() == [7, 3] and out.item() == 7 and err.tolist() == [0] * 6


# -- poison after a failed wait (issue 12) ----------------------------------------------------------

FP8_OUTS = [torch.float8_e4m3fn, torch.float8_e5m2]
KERNELS_ALL = ["pointer", *TMA_KERNELS]


def _err(failed):
    err = torch.zeros(6, dtype=torch.int32, device=DEV)
    err[0] = failed
    return err


def _assert_fp8_close(C, ref64, what="output"):
    """An FP8 output against float64: at most half an FP8 ulp of rounding (plus the subnormal step)."""
    assert not torch.isnan(C.float()).any(), f"{what}: NaN"
    rtol = torch.finfo(C.dtype).eps * 0.51
    torch.testing.assert_close(C.float().cpu(), ref64.float(), rtol=rtol, atol=torch.finfo(C.dtype).smallest_normal)


def test_default_error_record_is_a_zeroed_int32_6():
    err = pm.default_error_record(DEV)
    assert err.dtype == torch.int32 and tuple(err.shape) == (6,) and err.tolist() == [0] * 6


@pytest.mark.parametrize("kernel", KERNELS_ALL)
@pytest.mark.parametrize("dtype,out_dtype", [(torch.float16, torch.float16), (FP8, torch.float32),
                                             (FP8, torch.float8_e4m3fn), (FP8, torch.float8_e5m2)], ids=str)
@pytest.mark.parametrize("failed", [0, 1])
def test_consumer_poisons_after_a_failed_wait(kernel, dtype, out_dtype, failed):
    """err[0] != 0 once the launch is done: every output element is NaN (FP8: its NaN); 0: the product."""
    W, M, K, N = 3, 96, 64, 48
    A, (B,) = _inputs(M, K, (N,), dtype, SEED, col_major_b=dtype == FP8)
    order = torch.tensor([1, 2, 0], dtype=torch.int32, device=DEV)
    flags = torch.full((W,), 2, dtype=torch.int32, device=DEV)  # pre-set: the waits pass at once
    fill = 0.0 if failed else float("nan")  # the kernel must write every element either way
    C0 = torch.full((M, N), fill, device=DEV).to(out_dtype)
    (C,) = pm.persistent_matmul(A, [B], outs=[C0], num_chunks=W, order=order, flags=flags, epoch=2,
                                mode=pm.MODE_CONSUMER, err=_err(failed), tag=3, kernel=kernel)  # fmt: skip
    if failed:
        assert torch.isnan(C.float()).all(), f"{(~torch.isnan(C.float())).sum()} elements not poisoned"
        return
    ref = A.double().cpu() @ B.double().cpu()
    if out_dtype in FP8_OUTS:
        _assert_fp8_close(C, ref)
    else:
        assert_matmul_close(C, ref, (A.float() @ B.float()).to(out_dtype), k=2.0, atol=1e-5)


@pytest.mark.parametrize("kernel", KERNELS_ALL)
def test_plain_mode_ignores_the_error_record(kernel):
    """The plain matmul never reads err: a failed record does not touch it."""
    A, (B,) = _inputs(64, 32, (48,), torch.float16, SEED)
    (C,) = pm.persistent_matmul(A, [B], outs=_poisoned(64, (48,), torch.float16), err=_err(1), kernel=kernel)
    assert_matmul_close(C, A.double().cpu() @ B.double().cpu(), (A.float() @ B.float()).half(), k=2.0, atol=1e-5)


@pytest.mark.parametrize("failed", [None, 0, 1])
def test_reduce_partials_poisons_after_a_failed_wait(failed):
    from mptp_kernels.kernels.reduce import reduce_partials

    P = randn((3, 37, 29), SEED).to(DEV, torch.float16)
    out = torch.full((37, 29), 0.0 if failed else float("nan"), device=DEV, dtype=torch.float16)
    reduce_partials(P, out, scale=0.5, err=None if failed is None else _err(failed))
    if failed:
        assert torch.isnan(out).all()
    else:
        ref = P.double().cpu().sum(0) * 0.5
        assert_matmul_close(out, ref, ref.half(), k=2.0, atol=1e-6)


@pytest.mark.skipif(CUDA, reason="torch's CPU FP8 cast; on the GPU the kernel casts as CUDA _scaled_mm does")
@pytest.mark.parametrize("out_dtype", FP8_OUTS, ids=str)
def test_reduce_partials_fp8_out_rounds_as_torch(out_dtype):
    from mptp_kernels.kernels.reduce import reduce_partials

    g = torch.Generator().manual_seed(SEED)
    P = (torch.randint(-4096, 4097, (3, 64, 33), generator=g).float() / 8).half()  # sums exact in fp32
    out = torch.empty(64, 33, dtype=out_dtype)
    reduce_partials(P, out, scale=0.5)
    y = P.float().sum(0) * 0.5
    # NOTE: the kernel saturates e4m3fn to +-448 as _scaled_mm does; torch's own CPU cast
    # does too from 2.13, but 2.12 (seen on 2.12.1) casts an overflow to NaN: saturate first.
    if out_dtype == torch.float8_e4m3fn:
        y = y.clamp(-448, 448)
    ref = y.to(out_dtype)  # e5m2: |y| <= 768 never overflows it
    assert torch.equal(out.view(torch.uint8), ref.view(torch.uint8))


# -- FP8 outputs with a result scale (issue 17) -----------------------------------------------------


def _grid_fp8(shape, seed):
    """FP8 values k / 4 with |k| <= 16: exact in e4m3, and every product and every sum of up to
    65536 of them is exact in fp32, so the accumulation order cannot change a bit."""
    g = torch.Generator().manual_seed(seed)
    return (torch.randint(-16, 17, shape, generator=g).float() / 4).to(FP8)


def _scaled_mm_ref(A, B, sa, sb, bias, rs, out_dtype):
    """The ops' definition of _scaled_mm (mptp_kernels.ops.reference.scaled_mm): FP8 outputs are
    (sa * sb * A @ B + bias) * result_scale in fp32, saturated, rounded to nearest, on every device
    (torch's own CPU path divides by the result scale; CUDA torch 2.10-2.11 ignores it)."""
    from mptp_kernels.ops.reference import scaled_mm

    return scaled_mm(A.cpu(), B.cpu(), sa.cpu(), sb.cpu(), None if bias is None else bias.cpu(),
                     None if rs is None else rs.cpu(), out_dtype)  # fmt: skip


def _fp8_case(kernel, out_dtype, rs_case, M=96, K=64, Ns=(48, 24), bias_dtype=torch.float16):
    """Inputs and the result scale: "none", "0.37" (in range) or "overflow" (many outputs past the max)."""
    Ns = Ns[:1] if kernel != "pointer" else Ns
    A = _grid_fp8((M, K), SEED).to(DEV)
    Bs = [_grid_fp8((n, K), SEED + 1 + i).to(DEV).t() for i, n in enumerate(Ns)]  # K-major
    sa, sb = torch.tensor(0.5, device=DEV), torch.tensor(2.0, device=DEV)  # powers of 2: exact
    rs = {"none": None, "0.37": 0.37, "overflow": 16.0 if out_dtype == torch.float8_e4m3fn else 2.0**11}[rs_case]
    rs = None if rs is None else torch.tensor(rs, device=DEV)
    biases = [randn((n,), SEED + 20 + i, scale=4.0).to(DEV, bias_dtype) for i, n in enumerate(Ns)]
    return A, Bs, sa, sb, rs, biases


def _fp8_ordered(x):
    """FP8 bit patterns as integers ordered like the values (adjacent values differ by 1)."""
    b = x.view(torch.uint8).to(torch.int32).cpu()
    return torch.where(b >= 0x80, -(b & 0x7F), b & 0x7F)


@pytest.mark.parametrize("kernel", KERNELS_ALL)
@pytest.mark.parametrize("out_dtype", FP8_OUTS, ids=str)
@pytest.mark.parametrize("rs_case,with_bias", [("none", False), ("0.37", True), ("overflow", True)])
def test_fp8_out_matches_the_reference(kernel, out_dtype, rs_case, with_bias):
    """Bitwise equal to the ops' _scaled_mm (reference.scaled_mm, fp32 on the CPU): products and
    sums are exact (grid inputs, power-of-2 scales), and the epilogue does the same fp32 operations
    in the same order."""
    A, Bs, sa, sb, rs, biases = _fp8_case(kernel, out_dtype, rs_case)
    outs = pm.persistent_matmul(A, Bs, out_dtype=out_dtype, A_scale=sa, B_scales=[sb] * len(Bs),
                                biases=biases if with_bias else None, result_scale=rs, kernel=kernel)  # fmt: skip
    for i, (B, C) in enumerate(zip(Bs, outs)):
        ref = _scaled_mm_ref(A, B, sa, sb, biases[i] if with_bias else None, rs, out_dtype)
        assert C.dtype == out_dtype
        if rs_case == "overflow":  # the case must exercise saturation / infinities
            assert (ref.float().abs() >= torch.finfo(out_dtype).max).float().mean() > 0.05
        diff = (C.view(torch.uint8).cpu() != ref.view(torch.uint8)).sum().item()
        assert diff == 0, f"B{i}: {diff} of {C.numel()} elements differ from the reference"


@pytest.mark.parametrize("kernel", KERNELS_ALL)
@pytest.mark.parametrize("out_dtype", FP8_OUTS, ids=str)
def test_fp8_out_rowwise_within_one_ulp(kernel, out_dtype):
    """Row-wise scales (no CPU _scaled_mm to compare with): within 1 FP8 ulp of the float64 result,
    since the kernel rounds acc * a_scale * b_scale + bias in fp32 (each step can move a value
    that sits within an fp32 ulp of an FP8 rounding midpoint to the other side)."""
    A, Bs, _, _, rs, biases = _fp8_case(kernel, out_dtype, "0.37", bias_dtype=torch.float32)
    M = A.shape[0]
    sa = (randn((M, 1), SEED + 7).abs() + 0.5).to(DEV)
    sbs = [(randn((1, B.shape[1]), SEED + 8 + i).abs() + 0.5).to(DEV) for i, B in enumerate(Bs)]
    outs = pm.persistent_matmul(A, Bs, out_dtype=out_dtype, A_scale=sa, B_scales=sbs, biases=biases,
                                result_scale=rs, kernel=kernel)  # fmt: skip
    factor = 0.37
    for i, (B, C) in enumerate(zip(Bs, outs)):
        ref64 = ((A.double() * sa.double()) @ (B.double() * sbs[i].double()) + biases[i].double()) * factor
        ref = ref64.float().cpu().to(out_dtype)  # the values stay in range: no overflow rule involved
        ulps = (_fp8_ordered(C) - _fp8_ordered(ref)).abs()
        assert ulps.max().item() <= 1, f"B{i}: {ulps.max().item()} FP8 ulps from the float64 result"


# -- GPU only: int64 indexing at M * N = 2**32, timeouts, CUDA _scaled_mm semantics ------------------

BIG = 2**31


def _rows_ref(A, B, rows):
    return A[rows].double() @ B.double()


def _assert_rows(C, A, B, rows, what):
    """Sampled rows of a bf16 product against float64 (K = 64: bf16 output rounding dominates)."""
    got = C[rows].double()
    ref = _rows_ref(A, B, rows)
    assert not torch.isnan(got).any(), f"{what}: NaN in rows {rows}"
    e = rel_err(got, ref)
    assert e < 1e-2, f"{what}: rel err {e:.3e} on rows {rows}"


@pytest.mark.skipif(not CUDA, reason="needs a GPU (16 GB)")
@pytest.mark.parametrize("kernel", KERNELS_ALL)
@pytest.mark.parametrize("mode", ["plain", "consumer"])
def test_int64_output_of_2_pow_32_elements(kernel, mode):
    """M * N = 2**32 bf16 outputs (8 GiB): row * N passes 2**31 at row 32768."""
    M = N = 65536
    K, W = 64, 4
    A = randn((M, K), SEED, device=DEV).bfloat16()
    B = randn((K, N), SEED + 1, scale=K**-0.5, device=DEV).bfloat16()
    C = torch.full((M, N), float("nan"), device=DEV, dtype=torch.bfloat16)
    kw = {}
    if mode == "consumer":
        kw = dict(num_chunks=W, order=torch.tensor([1, 2, 3, 0], dtype=torch.int32, device=DEV),
                  flags=torch.ones(W, dtype=torch.int32, device=DEV), epoch=1, mode=pm.MODE_CONSUMER)  # fmt: skip
    pm.persistent_matmul(A, [B], outs=[C], kernel=kernel, **kw)
    torch.cuda.synchronize()
    boundary = BIG // N
    _assert_rows(C, A, B, [0, 1, boundary - 1, boundary, boundary + 1, M // W * 3, M - 2, M - 1], f"{kernel} {mode}")
    assert not torch.isnan(C[:, -1]).any() and not torch.isnan(C[-1]).any()


@pytest.mark.skipif(not CUDA, reason="needs a GPU (10 GB)")
def test_int64_scatter_to_destinations_past_2_pow_31():
    """Each scatter destination holds 36864 x 65536 > 2**31 elements."""
    W, Mc, N, K = 2, 36864, 65536, 64
    A = randn((W * Mc, K), SEED, device=DEV).bfloat16()
    B = randn((K, N), SEED + 1, scale=K**-0.5, device=DEV).bfloat16()
    buf = torch.full((W, Mc, N), float("nan"), device=DEV, dtype=torch.bfloat16)
    order = torch.tensor([1, 0], dtype=torch.int32, device=DEV)
    pm.persistent_matmul(A, [B], num_chunks=W, order=order, scatter_to=[buf[0], buf[1]])
    torch.cuda.synchronize()
    boundary = BIG // N
    for c in range(W):
        rows = [0, boundary - 1, boundary, Mc - 1]
        got = buf[c][rows].double()
        ref = _rows_ref(A, B, [c * Mc + r for r in rows])
        assert not torch.isnan(got).any() and rel_err(got, ref) < 1e-2, f"destination {c}"


@pytest.mark.skipif(not CUDA, reason="needs a GPU (5 GB)")
@pytest.mark.parametrize("kernel", ["pointer", "tma"])
def test_int64_a_rows_past_2_pow_31_elements(kernel):
    """A has M * K > 2**31 elements: row * stride_am passes 2**31 at row 2**21."""
    M, K, N = 2**21 + 96, 1024, 128
    A = torch.randn(M, K, device=DEV, dtype=torch.bfloat16)
    B = randn((K, N), SEED + 1, scale=K**-0.5, device=DEV).bfloat16()
    (C,) = pm.persistent_matmul(A, [B], kernel=kernel)
    torch.cuda.synchronize()
    _assert_rows(C, A, B, [0, 2**21 - 1, 2**21, 2**21 + 1, M - 1], kernel)


@pytest.mark.skipif(not CUDA, reason="needs a GPU (3 GB)")
@pytest.mark.parametrize("kernel", ["pointer", "tma"])
def test_int64_k_major_fp8_b_past_2_pow_31_elements(kernel):
    """A K-major FP8 B with N * K > 2**31: column * K passes 2**31 at column 65536."""
    M, K, N = 128, 32768, 65536 + 256
    A = torch.randn(M, K, device=DEV, dtype=torch.bfloat16).mul_(0.5).to(FP8)
    B = torch.randn(N, K, device=DEV, dtype=torch.bfloat16).mul_(0.5).to(FP8).t()  # 4 GB bf16 on the way
    one = torch.tensor(1.0, device=DEV)
    (C,) = pm.persistent_matmul(A, [B], A_scale=one, B_scales=[one], kernel=kernel)
    torch.cuda.synchronize()
    cols = [0, 65535, 65536, 65537, N - 1]
    ref = A.double() @ B[:, cols].double()
    got = C[:, cols].double()
    assert not torch.isnan(got).any() and rel_err(got, ref) < 1e-2


@pytest.mark.skipif(not CUDA, reason="needs a GPU (9 GB)")
def test_int64_reduce_partials_past_2_pow_31():
    """W * numel > 2**31: p * numel passes 2**31 for p = 2."""
    from mptp_kernels.kernels.reduce import reduce_partials

    W, numel = 3, 2**30 + 4096
    P = torch.randn(W, numel, device=DEV, dtype=torch.bfloat16)
    out = torch.full((numel,), float("nan"), device=DEV, dtype=torch.bfloat16)
    reduce_partials(P, out)
    torch.cuda.synchronize()
    idx = torch.tensor([0, 1, 2**29, 2**30 - 1, 2**30, numel - 2, numel - 1], device=DEV)
    ref = P[:, idx].double().sum(0)
    torch.testing.assert_close(out[idx].double(), ref.bfloat16().double(), rtol=2**-7, atol=1e-6)


@pytest.mark.skipif(not CUDA, reason="needs a GPU (20 GB)")
def test_int64_in_matmul_sum_past_2_pow_31():
    """reduce= (the in-matmul sum) with chunks of Mc x N > 2**31 elements: the slot step (p * Mc *
    N) and the row offsets (row * N past row 32768) pass 2**31. Rank 0 of 2, the peer's partial
    pre-set in slot 1 and its arrival flagged."""
    W, Mc, N, K, rank = 2, 36864, 65536, 64, 0
    A = randn((W * Mc, K), SEED, device=DEV).bfloat16()
    B = randn((K, N), SEED + 1, scale=K**-0.5, device=DEV).bfloat16()
    red, peer_flags = _reduce_case(W, rank, W * Mc, N, torch.bfloat16, 1.0, SEED, peer_fill=lambda s: s.normal_())
    slots = red.slots
    sent = torch.full((Mc, N), float("nan"), device=DEV, dtype=torch.bfloat16)  # chunk 1, to its owner
    order = torch.tensor([1, 0], dtype=torch.int32, device=DEV)
    (out,) = pm.persistent_matmul(A, [B], num_chunks=W, order=order, scatter_to=[slots[0], sent], reduce=red,
                                  kernel="tma")  # fmt: skip
    torch.cuda.synchronize()
    assert red.err.tolist() == [0] * 6 and peer_flags.tolist() == [0, 1]
    boundary = BIG // N
    rows = [0, boundary - 1, boundary, boundary + 1, Mc - 1]
    got = out[rows].double()
    ref = _rows_ref(A, B, rows) + slots[1][rows].double()
    assert not torch.isnan(got).any() and rel_err(got, ref) < 1e-2, "the sum"
    got_own = slots[0][rows].double()
    assert not torch.isnan(got_own).any() and rel_err(got_own, _rows_ref(A, B, rows)) < 1e-2, "own partial"
    got_sent = sent[rows].double()
    ref_sent = _rows_ref(A, B, [Mc + r for r in rows])
    assert not torch.isnan(got_sent).any() and rel_err(got_sent, ref_sent) < 1e-2, "chunk sent to its owner"


@pytest.mark.skipif(not CUDA, reason="needs a GPU: a flag that is never set, and globaltimer")
@pytest.mark.parametrize("kernel", KERNELS_ALL)
def test_consumer_timeout_fills_the_error_record_and_poisons(kernel):
    """Chunk 2's flag is never set: after timeout_s the record reads (failed, channel -1, peer 2,
    expected epoch, seen 0, tag) and the whole output is NaN, never a partly plausible product."""
    import time

    W, M, K, N, epoch, tag = 4, 4096, 256, 8192, 3, 11
    A, (B,) = _inputs(M, K, (N,), torch.bfloat16, SEED)
    flags = torch.full((W,), epoch, dtype=torch.int32, device=DEV)
    err = torch.zeros(6, dtype=torch.int32, device=DEV)
    order = torch.arange(W, dtype=torch.int32, device=DEV)
    # Warm-up with every flag set (compiles; the elapsed times below must not include it).
    (C,) = pm.persistent_matmul(A, [B], num_chunks=W, order=order, flags=flags, epoch=epoch, mode=pm.MODE_CONSUMER,
                                timeout_s=0.5, err=err, tag=tag, kernel=kernel)  # fmt: skip
    torch.cuda.synchronize()
    assert err.tolist() == [0] * 6 and not torch.isnan(C.float()).any()
    flags[2] = 0
    torch.cuda.synchronize()
    t0 = time.monotonic()
    (C,) = pm.persistent_matmul(A, [B], num_chunks=W, order=order, flags=flags, epoch=epoch, mode=pm.MODE_CONSUMER,
                                timeout_s=0.5, err=err, tag=tag, kernel=kernel)  # fmt: skip
    torch.cuda.synchronize()
    elapsed = time.monotonic() - t0
    assert err.tolist() == [1, -1, 2, epoch, 0, tag]
    assert elapsed < 5.0, f"{elapsed:.1f} s: waits should give up once the record has failed"
    # The whole output is poisoned once the launch is done (one read of the record per output).
    assert torch.isnan(C.float()).all()
    # A record that has already failed: the next call's waits give up at once, all poisoned.
    t0 = time.monotonic()
    (C,) = pm.persistent_matmul(A, [B], num_chunks=W, order=order, flags=flags, epoch=epoch, mode=pm.MODE_CONSUMER,
                                timeout_s=30.0, err=err, tag=tag, kernel=kernel)  # fmt: skip
    torch.cuda.synchronize()
    assert time.monotonic() - t0 < 5.0 and torch.isnan(C.float()).all()
    assert err.tolist() == [1, -1, 2, epoch, 0, tag]  # the first failure's record is kept


@pytest.mark.skipif(not CUDA, reason="CUDA semantics of torch._scaled_mm (cuBLASLt)")
@pytest.mark.parametrize("kernel", ["pointer", "tma"])
@pytest.mark.parametrize("out_dtype", FP8_OUTS, ids=str)
@pytest.mark.parametrize("rs_case", ["none", "0.37", "overflow"])
def test_fp8_out_matches_the_reference_cuda(kernel, out_dtype, rs_case):
    """Against the ops' _scaled_mm on CUDA (torch._scaled_mm to fp32, then bias, result scale and a
    saturating cast): up to 1 FP8 ulp where the fp32 epilogue order differs."""
    A, Bs, sa, sb, rs, biases = _fp8_case(kernel, out_dtype, rs_case, M=256, K=128, Ns=(192,),
                                          bias_dtype=torch.bfloat16)  # fmt: skip
    B, bias = Bs[0], biases[0]
    (C,) = pm.persistent_matmul(A, [B], out_dtype=out_dtype, A_scale=sa, B_scales=[sb], biases=[bias],
                                result_scale=rs, kernel=kernel)  # fmt: skip
    ref = _scaled_mm_ref(A, B, sa, sb, bias, rs, out_dtype).cuda()
    fmax = torch.finfo(out_dtype).max
    r, c = ref.float(), C.float()
    assert torch.equal(r.isinf(), c.isinf()) and torch.equal(r.isnan(), c.isnan()), (
        f"overflow differs: torch has {r.isinf().sum()} inf / {r.isnan().sum()} NaN, we have "
        f"{c.isinf().sum()} / {c.isnan().sum()} (epilogue.SCALED_MM_FP8_OUT['cuda']['e5m2_overflow'])")
    assert torch.equal(r.abs() == fmax, c.abs() == fmax), "saturation differs"
    finite = r.isfinite()
    ulps = (_fp8_ordered(C) - _fp8_ordered(ref)).abs()[finite.cpu()]
    assert ulps.max().item() <= 1, f"{ulps.max().item()} FP8 ulps from torch._scaled_mm"


# -- stream-K -------------------------------------------------------------------------------------


@pytest.fixture
def sk_buffers(monkeypatch):
    """The stream-K launch's pieces (NaN: a piece read before it was written shows) and sync words,
    kept to look at after the launch."""
    seen = []
    real = pm._sk_buffers

    def spy(dev, sms, cfg):
        pieces, sync = real(dev, sms, cfg)
        pieces.fill_(float("nan"))
        seen.append((pieces, sync))
        return pieces, sync

    monkeypatch.setattr(pm, "_sk_buffers", spy)
    return seen


@pytest.mark.parametrize("kernel", TMA_KERNELS)
@pytest.mark.parametrize("dtype", TMA_DTYPES, ids=str)
@pytest.mark.parametrize(
    "W,M,K,N,sms,split",
    [
        (1, 64, 96, 48, 4, 5),  # 12 tiles, the last 5 split over 4 shares: pieces cross tiles
        (3, 96, 160, 64, 7, True),  # the policy's split (10 of 24 tiles) over chunks in rotated order
        (2, 64, 64, 32, 7, 100),  # every tile split, shares shorter than a tile
        (1, 32, 32, 32, 9, 1),  # one tile of two K blocks over 9 shares: empty shares
        (1, 64, 96, 48, 5, ("split", 2, 2)),  # split tail: the last 2 of 12 tiles in 2 K ranges
        (3, 96, 160, 64, 7, ("split", 3, 2)),  # over chunks in rotated order (and a consumer)
        (1, 64, 160, 48, 9, ("split", 3, 3)),  # 3 K ranges, one of them shorter (5 K blocks)
        (1, 48, 96, 64, 8, True),  # the policy's split tail: 12 tiles on 8 SMs -> 4 tiles x 2
        (1, 32, 32, 32, 9, ("split", 1, 4)),  # more K ranges than K blocks: empty units
    ],
)
def test_stream_k_matches_the_reference(kernel, dtype, W, M, K, N, sms, split, sk_buffers):
    """The split tiles: every piece summed once, in every chunk order; the sync words zero again."""
    bk = 16 if K <= 32 else 32
    if CUDA and dtype == FP8 and bk == 16:  # an FP8 tl.dot takes K >= 32 on a GPU: the same K blocks, twice as deep
        K, bk = 2 * K, 32
    A, (B,) = _inputs(M, K, (N,), dtype, SEED, col_major_b=dtype == FP8)
    out_dtype = torch.float32 if dtype == FP8 else dtype
    cfg = pm.Config(16, 16, bk, 2, 4, 2)
    ref = A.double().cpu() @ B.double().cpu()
    eager = (A.float() @ B.float()).to(out_dtype)
    for rank in range(W):
        order = torch.tensor([(rank + i) % W for i in range(W)], dtype=torch.int32, device=DEV)
        flags = torch.ones(W, dtype=torch.int32, device=DEV)
        mode = pm.MODE_CONSUMER if W > 1 else pm.MODE_PLAIN
        (C,) = pm.persistent_matmul(A, [B], outs=_poisoned(M, (N,), out_dtype), num_chunks=W, order=order,
                                    flags=flags, mode=mode, kernel=kernel, config=cfg, num_sms=sms,
                                    stream_k=split)  # fmt: skip
        assert_matmul_close(C, ref, eager, k=2.0, atol=1e-5)
    assert len(sk_buffers) == W, "stream-K did not run"
    for pieces, sync in sk_buffers:
        assert not torch.isnan(pieces).all(), "no piece was published"
        assert (sync == 0).all(), f"sync words not reset: {sync.tolist()}"


def test_stream_k_is_deterministic():
    """The pieces of a tile are summed in share order: two runs agree bit for bit."""
    A, (B,) = _inputs(64, 256, (32,), torch.float16, SEED)
    kw = dict(kernel="tma", config=pm.Config(16, 16, 32, 2, 4, 2), num_sms=6, stream_k=8)
    (C1,) = pm.persistent_matmul(A, [B], **kw)
    (C2,) = pm.persistent_matmul(A, [B], **kw)
    assert torch.equal(C1, C2)


def test_split_tail_policy():
    """The partial last wave's R tiles in SMs // R K ranges (at most SK_MAX_SPLIT, K blocks)."""
    assert pm.split_tail(192, 132, 64) == (60, 2)  # 1.45 waves -> 1.5 tile times
    assert pm.split_tail(160, 132, 128) == (28, 4)
    assert pm.split_tail(384, 132, 64) == (0, 1)  # 120 of 132: nothing to gain
    assert pm.split_tail(264, 132, 64) == (0, 1)  # whole waves
    assert pm.split_tail(133, 132, 64) == (1, pm.SK_MAX_SPLIT)
    assert pm.split_tail(133, 132, 3) == (1, 3)
    assert pm._waves(192, 132, 64, "split") == 1.5 and pm._waves(192, 132, 64, "stream") == 192 / 132
    assert pm._waves(384, 132, 64, "split") == 3.0 and pm._waves(384, 132, 64, "stream") == 3.0


@pytest.mark.parametrize("mode", ["split", "stream"])
def test_split_plan_picks_the_faster_tiles(mode, monkeypatch):
    """The default path weighs its default tiles against SK_CONFIG's (Llama shapes, 132 SMs)."""
    monkeypatch.setattr(pm, "STREAM_K", mode)
    small, big = pm.Config(128, 128, 64, 8, 4, 4), pm.SK_CONFIG["16bit"]
    # 8192 x 1280: 640 small tiles fill 5 waves (no split); 320 large ones split -> the large ones.
    cfg, sk_mode, n, s = pm._sk_plan(8192, 1280, 8192, 1, 132, small, big, None)
    assert cfg == big and sk_mode == (2 if mode == "split" else 1) and n > 0
    # 8192 x 3584 with the large tiles already: 896 tiles, the last wave 104 of 132: no split.
    assert pm._sk_plan(8192, 3584, 4096, 1, 132, big, big, None) == (big, 0, 0, 1)
    # 16384 x 7168: 27 waves and 20 tiles; split in 6 K ranges they would save 0.48 of 28 waves,
    # less than SK_MIN_GAIN: whole tiles.
    assert pm._sk_plan(16384, 7168, 8192, 1, 132, big, big, None) == (big, 0, 0, 1)
    # 4096 x 768: 96 large tiles in one wave beat 192 small ones in two (measured 50.7 against 62.3 us
    # on an H100), with or without the split (the large tiles leave nothing to split).
    assert pm._sk_plan(4096, 768, 4096, 1, 132, small, big, None) == (big, 0, 0, 1)
    # 8192 x 768: 384 small tiles (2.9 waves) against 192 large ones split (1.5 waves + the split's
    # cost): a tie within SK_MIN_GAIN keeps the default (measured 90.6 against 91.8 us).
    assert pm._sk_plan(8192, 768, 4096, 1, 132, small, big, None) == (small, 0, 0, 1)
    # STREAM_K None, or an explicit config (sk_config None): whole tiles, as before.
    monkeypatch.setattr(pm, "STREAM_K", None)
    assert pm._sk_plan(8192, 1280, 8192, 1, 132, small, big, None) == (small, 0, 0, 1)
    assert pm._sk_plan(8192, 768, 4096, 1, 132, small, None, None)[1] == 0
    # Small calls keep whole tiles (the split's fixed cost is not worth it below SK_MIN_FLOPS).
    monkeypatch.setattr(pm, "STREAM_K", mode)
    assert pm._sk_plan(1024, 768, 1024, 1, 132, small, big, None)[1] == 0
    # A string asks for that mode with the given config.
    assert pm._sk_plan(8192, 768, 4096, 1, 132, big, None, "split") == (big, 2, 60, 2)


def test_stream_k_tiles_policy():
    """Split only where whole tiles leave SMs idle; then the last wave and one before it."""
    assert pm.stream_k_tiles(384, 132, 64) == 0  # 2.9 waves: 97% full
    assert pm.stream_k_tiles(192, 132, 64) == 192  # 1.45 waves: all of it
    assert pm.stream_k_tiles(320, 132, 128) == 320 - 132  # 2.4 waves: the last 1.4
    assert pm.stream_k_tiles(96, 132, 64) == 96  # fewer tiles than SMs
    assert pm.stream_k_tiles(96, 132, 1) == 0  # nothing to split by K
    assert pm.stream_k_tiles(0, 132, 64) == 0


def test_stream_k_argument_checked():
    A, (B,) = _inputs(32, 32, (16,), torch.float16, SEED)
    with pytest.raises(ValueError, match="stream_k"):
        pm.persistent_matmul(A, [B], kernel="tma", stream_k=-1)
    with pytest.raises(ValueError, match="stream_k"):
        pm.persistent_matmul(A, [B], kernel="tma", stream_k="yes")
    with pytest.raises(ValueError, match="stream_k"):
        pm.persistent_matmul(A, [B], kernel="tma", stream_k=1.5)
    for bad in [("split", 1, 0), ("split", 1.5, 2), ("split", True, 2), ("split", "a", 2), ("stream", 1, 2)]:
        with pytest.raises(ValueError, match="stream_k"):
            pm.persistent_matmul(A, [B], kernel="tma", stream_k=bad)
    # more units than programs would leave tiles unwritten: refused
    A, (B,) = _inputs(64, 32, (16,), torch.float16, SEED)  # 4 tiles of 16 x 16
    with pytest.raises(ValueError, match="units for 4 programs"):
        pm.persistent_matmul(A, [B], kernel="tma", config=pm.Config(16, 16, 16, 2, 4, 2), num_sms=4, stream_k=("split", 3, 2))


@pytest.fixture(params=["split", "stream"])
def sk_mode(request, monkeypatch):
    """The default path with each way of splitting the last wave."""
    monkeypatch.setattr(pm, "STREAM_K", request.param)
    return request.param


GPU_SK_SHAPES = [(torch.bfloat16, 4096, 768, 4096), (torch.bfloat16, 8192, 1280, 8192), (FP8, 4096, 1280, 8192)]


@pytest.mark.skipif(not CUDA, reason="needs a GPU: production tile sizes")
@pytest.mark.parametrize("dtype,M,N,K", GPU_SK_SHAPES, ids=str)
def test_stream_k_at_production_size(dtype, M, N, K, sk_buffers, sk_mode):
    """Small-N Llama shapes with their last wave split match the reference: the default plan's
    pick, and stream_k=True (the call's own tiles split; whether the default plan splits a
    shape is its choice, tested on the CPU). At least one of the two splits."""
    A, (B,) = _inputs(M, K, (N,), dtype, SEED, col_major_b=dtype == FP8)
    out_dtype = torch.bfloat16
    kw = dict(A_scale=torch.tensor(0.5, device=DEV), B_scales=[torch.tensor(2.0, device=DEV)]) if dtype == FP8 else {}
    ref = A.double() @ B.double()
    for sk in (None, True):
        (C,) = pm.persistent_matmul(A, [B], outs=_poisoned(M, (N,), out_dtype), stream_k=sk, **kw)
        assert_matmul_close(C, ref, (A.float() @ B.float()).to(out_dtype), k=2.0, atol=1e-5)
    assert sk_buffers, "neither the default plan nor stream_k=True split this shape"
    assert all((sync == 0).all() for _, sync in sk_buffers)


@pytest.mark.skipif(not CUDA, reason="needs a GPU")
def test_stream_k_while_another_kernel_holds_the_sms(sk_mode):
    """Programs start late, a few at a time, behind a matmul on another stream: the split tiles
    still complete (a program waits only for programs that started before it), every time."""
    A, (B,) = _inputs(4096, 4096, (768,), torch.bfloat16, SEED)
    big = torch.randn(8192, 8192, device=DEV, dtype=torch.bfloat16)
    ref = A.double() @ B.double()
    eager = (A.float() @ B.float()).bfloat16()
    side = torch.cuda.Stream()
    for _ in range(3):
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(4):
                big = (big @ big) * (1 / 8192**0.5)
        (C,) = pm.persistent_matmul(A, [B], outs=_poisoned(4096, (768,), torch.bfloat16), stream_k=None)
        torch.cuda.synchronize()
        assert_matmul_close(C, ref, eager, k=2.0, atol=1e-5)


@pytest.mark.skipif(not CUDA, reason="needs a GPU: CUDA graphs")
def test_stream_k_in_a_cuda_graph_and_eager_between_replays(sk_mode):
    """A captured stream-K launch replays right (its sync words are the graph's own, zeroed by the
    graph) with eager stream-K launches in between."""
    M, N, K = 4096, 768, 4096
    A, (B,) = _inputs(M, K, (N,), torch.bfloat16, SEED)
    static_A = A.clone()
    pm.persistent_matmul(static_A, [B])  # compile outside the capture
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        (C,) = pm.persistent_matmul(static_A, [B])
    for i in range(3):
        Ai = _inputs(M, K, (N,), torch.bfloat16, SEED + 100 + i)[0]
        static_A.copy_(Ai)
        C.fill_(float("nan"))
        g.replay()
        (E,) = pm.persistent_matmul(Ai * 2, [B])  # eager, same stream, between replays
        torch.cuda.synchronize()
        ref = Ai.double() @ B.double()
        assert_matmul_close(C, ref, (Ai.float() @ B.float()).bfloat16(), k=2.0, atol=1e-5)
        assert_matmul_close(E, 2 * ref, (2 * Ai.float() @ B.float()).bfloat16(), k=2.0, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float16, FP8], ids=str)
def test_split_tail_owner_sums_in_row_slabs(dtype, sk_buffers):
    """The owner sums and stores a 64-row tile in 32-row slabs (row-wise scales follow the slab)."""
    M, K, N = 160, 96, 48  # 3 x 3 tiles of 64 x 16, the last rows partial
    A, (B,) = _inputs(M, K, (N,), dtype, SEED, col_major_b=dtype == FP8)
    kw = {}
    ref = A.double().cpu() @ B.double().cpu()
    if dtype == FP8:
        A_scale = (randn((M, 1), SEED + 7).abs() + 0.5).to(DEV)
        B_scale = (randn((1, N), SEED + 8).abs() + 0.5).to(DEV)
        bias = randn((N,), SEED + 20).to(DEV, torch.float16)
        kw = dict(A_scale=A_scale, B_scales=[B_scale], biases=[bias])
        ref = ref * A_scale.double().cpu() * B_scale.double().cpu() + bias.double().cpu()
    (C,) = pm.persistent_matmul(A, [B], outs=_poisoned(M, (N,), torch.float16), kernel="tma",
                                config=pm.Config(64, 16, 32, 2, 4, 2), num_sms=6, stream_k=("split", 2, 3), **kw)  # fmt: skip
    assert sk_buffers and (sk_buffers[0][1] == 0).all()
    assert_matmul_close(C, ref, ref.half(), k=3.0, atol=1e-4)


# -- host-side caches of the TMA launch (issue 14: host cost) -----------------------------------


def _rnd(*shape, dtype=torch.float32):
    return randn(shape, random.randrange(2**31), dtype=dtype)


def _tma_launches(monkeypatch):
    """Records what each TMA launch is given (grid, arguments by kind, constexprs, options)."""
    seen = []
    real = pm.launch_static

    def spy(fn, grid, args, constexprs, options, static=None):
        def show(a):
            if hasattr(a, "block_shape"):  # a tensor descriptor: every field, its base by address
                return ("desc", a.base.data_ptr(), a.base.dtype, tuple(a.shape), tuple(a.strides),
                        tuple(a.block_shape), a.padding)  # fmt: skip
            if isinstance(a, torch.Tensor):
                return ("tensor", a.data_ptr(), a.dtype, tuple(a.shape))
            return a

        seen.append((tuple(grid), [show(a) for a in args], dict(constexprs), dict(options)))
        return real(fn, grid, args, constexprs, options, static)

    monkeypatch.setattr(pm, "launch_static", spy)
    return seen


def _variants():
    """Calls that differ in one input of the launch plan each (shape, layout, dtype, options)."""
    cfg = pm.Config(16, 16, 32, 2, 4, 2)
    A = _rnd(48, 64, dtype=torch.float16)
    B = _rnd(64, 32, dtype=torch.float16)
    A8, B8 = _rnd(48, 64).to(FP8), _rnd(32, 64).to(FP8).t()
    s1, srow, scol = torch.ones(1), torch.rand(48) + 0.5, torch.rand(32) + 0.5
    base = dict(kernel="tma", config=cfg, num_sms=5)
    return [
        (A, [B], base),
        (A, [B], dict(base, num_sms=3)),
        (A[:32], [B], base),
        (_rnd(48, 80, dtype=torch.float16)[:, :64], [B], base),  # rows 80 apart: A's shape, other strides
        (A, [B[:, :16]], base),
        (A, [B.t().contiguous().t()], base),  # K-major B
        (A, [B], dict(base, config=pm.Config(16, 32, 32, 2, 4, 2))),
        (A, [B], dict(base, out_dtype=torch.float32)),
        (A, [B], dict(base, num_chunks=3)),
        (A, [B], dict(base, stream_k=("split", 2, 2))),
        (A, [B], dict(base, stream_k=4)),
        (A8, [B8], dict(base, A_scale=s1, B_scales=[s1])),
        (A8, [B8], dict(base, A_scale=srow, B_scales=[scol])),
        (A8, [B8], dict(base, A_scale=srow, B_scales=[scol], biases=[torch.rand(32)])),
        (A8, [B8], dict(base, A_scale=s1, B_scales=[s1], fast_accum=False)),
        (A8, [B8], dict(base, A_scale=s1, B_scales=[s1], out_dtype=FP8, result_scale=torch.full((1,), 0.5))),
        (A8, [B8], dict(base, A_scale=s1, B_scales=[s1], out_dtype=FP8)),
        (A, [B], dict(base, kernel="tma_flat")),
        (A, [B], dict(base, guard=True)),
    ]


@pytest.mark.skipif(CUDA, reason="CPU check of the host caches (the GPU tests run the same launches)")
def test_cached_launch_plans_give_every_launch_what_a_fresh_plan_gives(monkeypatch, sk_buffers):
    """The plan cache's key covers every input of the plan: after launches of all the variants
    (in two orders, so each one finds the cache full of the others' plans), each launch gets
    the grid, arguments, constexprs and options that an empty cache gives it, and its result
    is the same."""
    seen = _tma_launches(monkeypatch)
    vs = _variants()
    fresh = []
    for A, Bs, kw in vs:
        pm._TMA_PLANS.clear()
        pm._DESCS.clear()
        fresh.append((seen.__len__(), pm.persistent_matmul(A, Bs, **kw)[0].clone()))
    cold = list(seen)
    seen.clear()
    order = list(range(len(vs))) + list(reversed(range(len(vs))))
    for i in order:
        A, Bs, kw = vs[i]
        (C,) = pm.persistent_matmul(A, Bs, **kw)
        got, want = seen[-1], cold[i]
        assert got[0] == want[0] and got[2] == want[2] and got[3] == want[3], (i, got, want)
        # Addresses of the outputs and the split buffers are per call; all else is the same.
        for g, w in zip(got[1], want[1]):
            if isinstance(w, tuple) and w[0] == "tensor" and w[1] != g[1]:
                assert g[0] == "tensor" and g[2:] == w[2:], (i, g, w)
            else:
                assert g == w, (i, g, w)
        assert torch.equal(C.float().nan_to_num(), fresh[i][1].float().nan_to_num()), i


@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("mode", ["plain", "consumer"])
@pytest.mark.parametrize("fp8_consumer", [False, True])
def test_an_fp8_consumer_takes_whole_default_tiles_unless_asked(monkeypatch, fp8, mode, fp8_consumer):
    """The default plan ("auto", no config) weighs the large-tile candidate (the sk_config that
    _launch_tma is handed; no launch here) for every call but an FP8 consumer's while
    SK_FP8_CONSUMER is False (measured slower there); stream_k="split" weighs it for every call."""
    got = []

    def spy(*args, **kw):
        got.append(args[-1])  # sk_config
        return [args[2]]

    monkeypatch.setattr(pm, "_launch_tma", spy)
    monkeypatch.setattr(pm, "_interpreting", lambda: False)
    monkeypatch.setattr(pm, "SK_FP8_CONSUMER", fp8_consumer)
    W, M, K, N = 2, 512, 256, 384
    if fp8:
        A, B = _rnd(M, K).to(FP8), _rnd(N, K).to(FP8).t()
        kw = dict(A_scale=torch.ones(1), B_scales=[torch.ones(1)], out_dtype=torch.bfloat16)
    else:
        A, B, kw = _rnd(M, K, dtype=torch.float16), _rnd(K, N, dtype=torch.float16), {}
    if mode == "consumer":
        # poison=False: no poison check is launched after the (skipped) launch
        kw.update(num_chunks=W, flags=torch.ones(W, dtype=torch.int32), epoch=1, mode=pm.MODE_CONSUMER, poison=False)
    for stream_k in (None, "split"):
        pm.persistent_matmul(A, [B], kernel="tma", stream_k=stream_k, **kw)
    large = pm.SK_CONFIG["fp8" if fp8 else "16bit"]
    whole = fp8 and mode == "consumer" and not fp8_consumer
    assert got == [None if whole else large, large], got


@pytest.mark.skipif(CUDA, reason="CPU check of the host caches")
def test_the_plan_follows_stream_k_set_between_launches(monkeypatch, sk_buffers):
    """STREAM_K (the module's default mode) changed between two launches of one shape changes
    the plan: the cache does not keep the first one's."""
    seen = _tma_launches(monkeypatch)
    A, B = _rnd(48, 64, dtype=torch.float16), _rnd(64, 32, dtype=torch.float16)
    kw = dict(kernel="tma", config=pm.Config(16, 16, 32, 2, 4, 2), num_sms=5, stream_k=True)
    modes = []
    for mode in ("split", "stream", None, "split"):
        monkeypatch.setattr(pm, "STREAM_K", mode)
        pm.persistent_matmul(A, [B], **kw)
        modes.append(seen[-1][2]["SK_MODE"])
    assert modes == [2, 1, 2, 2], modes  # True with STREAM_K None: "split"


@pytest.mark.parametrize("transposed", [False, True])
def test_descriptors_from_templates_equal_fresh_ones_and_hold_no_tensor(transposed):
    import gc
    import weakref

    from triton.tools.tensor_descriptor import TensorDescriptor

    pm.TensorDescriptor = TensorDescriptor
    pm._DESCS.clear()
    t = _rnd(32, 64, dtype=torch.float16)
    t = t.t() if transposed else t
    first = pm._descriptor(t, 16, 32, transposed)
    u = _rnd(*t.shape, dtype=torch.float16)
    u = u.t().contiguous().t() if transposed else u
    from_template = pm._descriptor(u, 16, 32, transposed)
    want = TensorDescriptor.from_tensor(u.t() if transposed else u, [16, 32])
    assert from_template.__dict__.keys() == want.__dict__.keys()
    for k, v in want.__dict__.items():
        got = from_template.__dict__[k]
        if isinstance(v, torch.Tensor):
            assert got.data_ptr() == v.data_ptr() and got.shape == v.shape and got.stride() == v.stride()
        else:
            assert got == v, k
    assert first.base.data_ptr() == t.data_ptr()
    # The cache keeps no tensor alive (a cached A_full would keep its memory from the next call).
    ref = weakref.ref(u)
    del u, from_template, want
    gc.collect()
    assert ref() is None


@pytest.fixture
def fake_launcher(monkeypatch):
    """The launch logic without a GPU: every launch is direct, to a recording stand-in kernel, and
    the launch memo takes CPU tensors (which reach the launcher as tensors, not addresses)."""
    from kernels.test_launch import _FakeCompiled
    from mptp_kernels.kernels import launch as L

    k = _FakeCompiled()  # every launch's record; a kernel per key (its specialization) stands in below

    class PerKey(_FakeCompiled):
        def __init__(self, n):
            self.run = lambda *a: k.calls.append(a[:4] + (("kernel", n),) + a[5:])

    class Always(dict):
        def get(self, key, default=None):
            if key not in self:
                self[key] = PerKey(len(self))
            return self[key]

    monkeypatch.setattr(L, "interpreting", lambda: False)
    monkeypatch.setattr(L, "FAST", True)
    monkeypatch.setattr(L, "_KERNELS", Always())
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda i: 1234, raising=False)
    monkeypatch.setattr(pm, "_memo_device", lambda A: True)
    monkeypatch.setattr(pm, "_TENSOR_SLOTS", ())
    monkeypatch.setattr(pm, "MEMO", True)
    # The kernel as a JITFunction (the interpreter's stands in otherwise: launched plainly).
    class Jit(triton.runtime.jit.JITFunction):
        def __getitem__(self, grid):  # Triton's own launch (first call of a key, hooks): recorded
            return lambda *a, **kw: k.calls.append(("plain", grid, a, kw)) or k

    fn = pm._persistent_matmul_tma_kernel
    monkeypatch.setattr(pm, "_persistent_matmul_tma_kernel", Jit(getattr(fn, "fn", fn)))
    monkeypatch.setattr(pm, "_MEMO", {})
    hits = []
    real = pm._memo_launch

    def spy(*a):
        r = real(*a)
        hits.append(r is not None)
        return r

    monkeypatch.setattr(pm, "_memo_launch", spy)
    return k, hits


_ARGS0 = 9  # the launcher's leading arguments: grid (3), stream, function, metadata, launch metadata, hooks (2)


def _shown(call, fresh_slots):
    """A launcher call, comparable across calls: descriptors by fields, tensors by address (a
    CPU tensor reaches it as a tensor where a CUDA one reaches it as its address: the same here),
    and what is made per call (a fresh output, split buffers) as "fresh"."""
    out = []
    for i, a in enumerate(call):
        if i - _ARGS0 in fresh_slots:
            out.append("fresh")
        elif hasattr(a, "block_shape"):
            out.append(("desc", a.base.data_ptr(), a.base.dtype, tuple(a.shape), tuple(a.strides),
                        tuple(a.block_shape), a.padding, a.round_f32_to_tf32))  # fmt: skip
        elif isinstance(a, torch.Tensor):
            out.append(a.data_ptr())
        else:
            out.append(a)
    return out


@pytest.mark.skipif(CUDA, reason="CPU check of the launch memo (the GPU tests run through it)")
def test_the_launch_memo_gives_the_launcher_what_the_full_path_gives(fake_launcher):
    """Each variant's second call is served by the memo and hands the launcher exactly what the
    full path handed it (over all the variants' entries at once, in two orders); a copy of the
    inputs at other addresses is not served an entry of the originals."""
    k, hits = fake_launcher
    vs = _variants() + [(A, Bs, dict(kw, outs=[torch.empty(A.shape[0], Bs[0].shape[1])])) for A, Bs, kw in _variants()[:3]]
    vs += [(A, Bs, dict(kw, num_chunks=2, mode=pm.MODE_CONSUMER, flags=torch.ones(2, dtype=torch.int32),
                        order=torch.tensor([1, 0], dtype=torch.int32), tag=7)) for A, Bs, kw in _variants()[:2]]  # fmt: skip
    A, Bs, kw = vs[-1]
    vs += [(A, Bs, dict(kw, epoch=2)), (A, Bs, dict(kw, timeout_s=5.0)), (A, Bs, dict(kw, poison=False)),
           (A, Bs, dict(kw, err=torch.zeros(6, dtype=torch.int32)))]
    vs += [(A, Bs, dict(kw, tag=9)), (A, Bs, dict(kw, mode=pm.MODE_PLAIN))]
    A, Bs, kw = vs[0]
    vs += [(A.view(torch.bfloat16), [Bs[0].view(torch.bfloat16)], kw)]  # the same addresses and layouts, another dtype
    # Pairs at the same addresses with the same shapes, told apart by strides or dtype only.
    buf = _rnd(48 * 80, dtype=torch.float16)
    sq = _rnd(64, 64, dtype=torch.float16)
    o32 = torch.empty(48, 32)
    # ... and by alignment only (a base 2 bytes off 16: A and B refused by the TMA kernel, an output
    # another specialization).
    for bad in ("A", "B"):
        a = buf[1 : 1 + 48 * 64].view(48, 64) if bad == "A" else A
        b = buf[1 : 1 + 64 * 32].view(64, 32) if bad == "B" else Bs[0]
        pm.persistent_matmul(buf[: 48 * 64].view(48, 64), [buf[: 64 * 32].view(64, 32)], **kw)
        pm.persistent_matmul(buf[: 48 * 64].view(48, 64), [buf[: 64 * 32].view(64, 32)], **kw)
        with pytest.raises(ValueError, match="16-byte aligned"):
            pm.persistent_matmul(a if bad == "A" else buf[: 48 * 64].view(48, 64),
                                 [b if bad == "B" else buf[: 64 * 32].view(64, 32)], **kw)  # fmt: skip
    o16 = torch.empty(48 * 32 + 1, dtype=torch.float16)
    vs += [(A, Bs, dict(kw, outs=[o16[:-1].view(48, 32)])), (A, Bs, dict(kw, outs=[o16[1:].view(48, 32)]))]
    # Scatters (the reduce-scatter's producer): the destinations are part of the key; the same
    # ones in another order, or one of them elsewhere, is another entry.
    dst = torch.empty(4, 16, 32, dtype=torch.float16)
    order3 = torch.tensor([1, 2, 0], dtype=torch.int32)
    sc = dict(kw, num_chunks=3, order=order3)
    sc.pop("outs", None)
    vs += [(A, Bs, dict(sc, scatter_to=[dst[0], dst[1], dst[2]])), (A, Bs, dict(sc, scatter_to=[dst[1], dst[0], dst[2]])),
           (A, Bs, dict(sc, scatter_to=[dst[0], dst[1], dst[3]])),
           (A, Bs, dict(sc, scatter_to=[dst[0], dst[1], dst[2]], guard=True, err=torch.zeros(6, dtype=torch.int32)))]
    vs += [(buf[: 48 * 64].view(48, 64), Bs, kw), (buf.view(48, 80)[:, :64], Bs, kw),
           (A, [sq], kw), (A, [sq.t()], kw),
           (A, Bs, dict(kw, outs=[o32])), (A, Bs, dict(kw, outs=[o32.view(-1).view(torch.float16)[: 48 * 32].view(48, 32)]))]
    hits.clear()
    full = []
    for A, Bs, kw in vs:
        n = len(k.calls)
        pm.persistent_matmul(A, Bs, **kw)
        # the launcher calls of this variant: the matmul, and a consumer's NaN check
        fresh = {2, 19, 20} if "outs" not in kw and "scatter_to" not in kw else {19, 20}
        full.append((len(k.calls) - n, [_shown(c, fresh) for c in k.calls[n:]], fresh))
    assert not any(hits)
    for i in list(range(len(vs))) + list(reversed(range(len(vs)))):
        A, Bs, kw = vs[i]
        n, want, fresh = full[i]
        before = len(k.calls)
        pm.persistent_matmul(A, Bs, **kw)
        assert hits[-1], f"variant {i}: not served by the memo"
        got = [_shown(c, fresh) for c in k.calls[before:]]
        assert got == want, f"variant {i}"
    # Copies at other addresses (same shapes, layouts and options), of A, B or both: their own addresses.
    for A, Bs, kw in vs[:5]:
        A2 = A.clone()
        B2 = Bs[0].t().contiguous().t() if Bs[0].stride(0) == 1 else Bs[0].clone()
        for a, b in ((A2, Bs[0]), (A, B2), (A2, B2)):
            n = len(k.calls)
            pm.persistent_matmul(a, [b], **kw)
            call = k.calls[n][_ARGS0:]
            assert call[0].base.data_ptr() == a.data_ptr() and call[1].base.data_ptr() == b.data_ptr()


@pytest.mark.skipif(CUDA, reason="CPU check of the launch memo")
def test_the_launch_memo_steps_aside_for_hooks_strided_scales_and_module_settings(fake_launcher, monkeypatch):
    """Not served by the memo: a launch with a launch hook installed, a strided scale (copied per
    call), and a call after the module's split settings changed."""
    from mptp_kernels.kernels import launch as L

    k, hits = fake_launcher
    A, (B,) = _rnd(48, 64, dtype=torch.float16), [_rnd(64, 32, dtype=torch.float16)]
    kw = dict(kernel="tma", config=pm.Config(16, 16, 32, 2, 4, 2), num_sms=5)
    pm.persistent_matmul(A, [B], **kw)
    pm.persistent_matmul(A, [B], **kw)
    assert hits == [True]
    monkeypatch.setattr(L, "_hooks", lambda: True)
    pm.persistent_matmul(A, [B], **kw)
    assert hits == [True, False]
    monkeypatch.setattr(L, "_hooks", lambda: False)
    monkeypatch.setattr(pm, "STREAM_K", "stream")
    pm.persistent_matmul(A, [B], **kw)
    assert hits == [True, False], "another STREAM_K is another key"
    A8, B8 = _rnd(48, 64).to(FP8), _rnd(32, 64).to(FP8).t()
    scale = (torch.rand(48, 2) + 0.5)[:, 0]  # a column: strided
    for _ in range(2):
        pm.persistent_matmul(A8, [B8], A_scale=scale, B_scales=[torch.ones(1)], **kw)
    assert hits == [True, False], "a strided scale is not memoized"


@pytest.mark.skipif(CUDA, reason="CPU check of the launch memo")
def test_the_launch_memo_keeps_every_check_of_the_full_path(fake_launcher):
    """Values equal in Python but not to persistent_matmul are other keys: stream_k True (the
    split tail) and 1 (stream-K over one tile) launch their own modes, and arguments the full path
    refuses (1.0, ('split', True, 2), a None B scale) are refused after an equal valid call too;
    an unhashable argument gets the full path's answer, not the memo's TypeError."""
    import numpy as np

    k, hits = fake_launcher
    A, B = _rnd(48, 64, dtype=torch.float16), _rnd(64, 32, dtype=torch.float16)
    kw = dict(kernel="tma", config=pm.Config(16, 16, 32, 2, 4, 2), num_sms=5)
    sk_at = len(pm._persistent_matmul_tma_kernel.arg_names) - 1 - pm._persistent_matmul_tma_kernel.arg_names[::-1].index("SK_MODE")
    for sk, mode in ((True, 2), (True, 2), (1, 1), (1, 1), (("split", 1, 2), 2), (("split", 1, 2), 2)):
        pm.persistent_matmul(A, [B], stream_k=sk, **kw)
        assert k.calls[-1][_ARGS0 + sk_at] == mode, (sk, k.calls[-1][_ARGS0 + sk_at])
    assert hits == [True, True, True]
    for bad in (1.0, ("split", True, 2)):
        with pytest.raises(ValueError, match="stream_k"):
            pm.persistent_matmul(A, [B], stream_k=bad, **kw)
    A8, B8, one = _rnd(48, 64).to(FP8), _rnd(32, 64).to(FP8).t(), torch.ones(1)
    for _ in range(2):
        pm.persistent_matmul(A8, [B8], A_scale=one, B_scales=None, **kw)
    assert hits == [True] * 4
    with pytest.raises(AttributeError):  # the full path's answer to a None scale
        pm.persistent_matmul(A8, [B8], A_scale=one, B_scales=[None], **kw)
    outcome = []
    for memo in (True, False):
        pm.MEMO = memo  # (the fixture restores it)
        try:
            pm.persistent_matmul(A, [B], timeout_s=np.array(5.0), **kw)
            outcome.append("ok")
        except Exception as e:  # noqa: BLE001 - compared below
            outcome.append(type(e).__name__)
    assert outcome[0] == outcome[1], outcome


@pytest.mark.skipif(CUDA, reason="CPU check of the launch memo")
def test_the_launch_memo_tells_scalar_types_apart_and_leaves_odd_values_to_the_full_path(fake_launcher, monkeypatch):
    """1, 1.0 and True are == but bind differently (Triton specializes on the type): each type
    is its own key, and what the launcher gets is what the full path gives it. A timeout given
    as a tensor (mutable: an entry would go stale), a Decimal or an int whose type cannot be
    hashed, and outs=[None], are never
    served by the memo; an FP8 output table without some entries does not break plain calls;
    the memo is cleared only at MEMO_ENTRIES."""
    import decimal

    k, hits = fake_launcher
    A, B = _rnd(48, 64, dtype=torch.float16), _rnd(64, 32, dtype=torch.float16)
    kw = dict(kernel="tma", config=pm.Config(16, 16, 32, 2, 4, 2), num_sms=5)
    seen = {}
    for name, values in (("epoch", (1, 1.0, True)), ("tag", (7, 7.0)), ("timeout_s", (5, 5.0))):
        for v in values:
            for _ in range(2):
                n = len(hits)
                pm.persistent_matmul(A, [B], **{name: v}, **kw)
            assert hits[n:] == [True], (name, v)  # the repeat of each type, and only it, was served
            seen[(name, v.__class__)] = k.calls[-1]
            # the full path's launch for this value: the memo hands the launcher the same
            pm.MEMO = False
            pm.persistent_matmul(A, [B], **{name: v}, **kw)
            pm.MEMO = True
            typed = [[(x.__class__, x) for x in _shown(c, {2, 19, 20})] for c in (k.calls[-1], seen[(name, v.__class__)])]
            assert typed[0] == typed[1], (name, v)
    class _Meta(type):  # an int whose type cannot be hashed (a hostile review: the key raised)
        def __eq__(cls, other):
            return cls is other

    class _UnhashableTypeInt(int, metaclass=_Meta):
        pass

    for odd in (torch.tensor(5.0), decimal.Decimal(5), _UnhashableTypeInt(5)):
        n = len(hits)
        outcome = []
        for memo in (True, True, False):
            pm.MEMO = memo
            try:
                pm.persistent_matmul(A, [B], timeout_s=odd, **kw)
                outcome.append("ok")
            except Exception as e:  # noqa: BLE001 - compared below
                outcome.append(type(e).__name__)
        pm.MEMO = True
        assert len(set(outcome)) == 1 and hits[n:] == [], (odd, outcome, hits[n:])
    pm.persistent_matmul(A, [B], **kw)
    with pytest.raises(AttributeError):  # the full path's answer to outs=[None]
        pm.persistent_matmul(A, [B], outs=[None], **kw)
    from mptp_kernels.kernels import epilogue

    monkeypatch.setitem(epilogue.SCALED_MM_FP8_OUT, "cuda", {"result_scale": "multiply"})
    for _ in range(2):
        pm.persistent_matmul(A, [B], **kw)  # no FP8 output: the table's missing entry is not read
    monkeypatch.setattr(pm, "MEMO_ENTRIES", 3)
    pm._MEMO.clear()
    for i in range(3):
        pm.persistent_matmul(A, [B], tag=100 + i, **kw)
    assert len(pm._MEMO) == 3
    pm.persistent_matmul(A, [B], tag=200, **kw)
    assert len(pm._MEMO) == 1, "cleared when full, then the new entry"


@pytest.mark.skipif(CUDA, reason="CPU check of the launch memo")
def test_the_launch_memo_holds_only_its_own_defaults_and_serves_parameters(fake_launcher):
    """An entry holds the defaults it made (order, error record, dummies), never the caller's
    order or error record; an nn.Parameter weight is served like a plain tensor."""
    k, hits = fake_launcher
    A, B = _rnd(48, 64, dtype=torch.float16), torch.nn.Parameter(_rnd(64, 32, dtype=torch.float16))
    kw = dict(kernel="tma", config=pm.Config(16, 16, 32, 2, 4, 2), num_sms=5)
    with torch.no_grad():
        pm.persistent_matmul(A, [B], **kw)
        (entry,) = pm._MEMO.values()
        assert entry[-2] is not None and entry[-1][0] is not None  # its own defaults, held
        pm.persistent_matmul(A, [B], **kw)
        assert hits == [True]
        pm._MEMO.clear()
        order, err = torch.zeros(2, dtype=torch.int32), torch.zeros(6, dtype=torch.int32)
        pm.persistent_matmul(A, [B], num_chunks=2, order=order, err=err, **kw)
        (entry,) = pm._MEMO.values()
        assert entry[-2] is None and entry[-1][0] is None, "the caller's err / order held by the memo"


@pytest.mark.skipif(CUDA, reason="CPU check of the launch memo")
@pytest.mark.parametrize("given_out", [False, True])
def test_the_launch_memo_gives_the_tma_store_this_calls_output(fake_launcher, monkeypatch, given_out):
    """A served launch's descriptor of C is over this call's output (a fresh one, or the one
    given), with the full path's fields; nothing of an earlier call's output."""
    k, hits = fake_launcher
    monkeypatch.setattr(pm, "TMA_STORE_BLOCK_N", 16)
    A, B = _rnd(48, 64, dtype=torch.float16), _rnd(64, 32, dtype=torch.float16)
    out = torch.empty(48, 32, dtype=torch.float16)
    kw = dict(kernel="tma", config=pm.Config(16, 16, 32, 2, 4, 2), num_sms=5, outs=[out] if given_out else None)
    descs = []
    for _ in range(3):
        (C,) = pm.persistent_matmul(A, [B], **kw)
        call = k.calls[-1]
        got = [a for a in (call[2] if call[0] == "plain" else call) if hasattr(a, "block_shape")]
        assert len(got) == 3, "A, B and C descriptors"
        descs.append((got[-1], C))
    assert hits == [True, True]  # (the fake launcher launches directly from the first call)
    for d, C in descs:
        assert d.base is C and tuple(d.block_shape) == (16, 16)
        assert {k: v for k, v in d.__dict__.items() if k != "base"} == {
            k: v for k, v in descs[0][0].__dict__.items() if k != "base"}
    if not given_out:
        assert len({C.data_ptr() for _, C in descs}) == 3


def test_the_launch_memo_key_follows_the_module_settings(monkeypatch):
    """Every module setting a plan reads is part of the memo key."""
    from mptp_kernels.kernels import epilogue

    base = pm._settings()
    changes = [(pm, "STREAM_K", "stream"), (pm, "USE_TMA", False), (pm, "SK_SPLIT_COST", 0.5),
               (pm, "SK_MIN_GAIN", 0.1), (pm, "SK_TILE_EFF", 0.9), (pm, "SK_MIN_FLOPS", 1.0), (pm, "SK_MAX_SPLIT", 4),
               (pm, "SK_FP8_CONSUMER", True), (pm, "TMA_STORE_BLOCK_N", 256), (pm, "TMA_STORE_BLOCK_N", 128),
               (pm, "AUTO_KERNEL", {"16bit": "tma_flat", "fp8": "tma"}),
               (pm, "SK_CONFIG", {"16bit": pm.Config(128, 128, 64, 8, 4, 4), "fp8": pm.SK_CONFIG["fp8"]}),
               (epilogue, "SCALED_MM_FP8_OUT", {**epilogue.SCALED_MM_FP8_OUT,
                                                 "cuda": {"result_scale": "reciprocal", "e5m2_overflow": "saturate"}})]  # fmt: skip
    for mod, name, value in changes:
        with monkeypatch.context() as m:
            m.setattr(mod, name, value)
            assert pm._settings() != base, name
    assert pm._settings() == base


@pytest.mark.skipif(CUDA, reason="CPU check of the launch memo")
@pytest.mark.parametrize("value, on", [("0", False), ("off", False), ("1", True), ("bogus", False), (None, True)])
def test_mptp_launch_memo_switches_the_memo_once(fake_launcher, monkeypatch, value, on):
    k, hits = fake_launcher
    if value is None:  # the default
        monkeypatch.delenv("MPTP_LAUNCH_MEMO", raising=False)
    else:
        monkeypatch.setenv("MPTP_LAUNCH_MEMO", value)
    monkeypatch.setattr(pm, "MEMO", None)
    A, B = _rnd(48, 64, dtype=torch.float16), _rnd(64, 32, dtype=torch.float16)
    kw = dict(kernel="tma", config=pm.Config(16, 16, 32, 2, 4, 2), num_sms=5)
    for _ in range(2):
        pm.persistent_matmul(A, [B], **kw)
    assert hits == ([True] if on else [])
    monkeypatch.setenv("MPTP_LAUNCH_MEMO", "0" if on else "1")
    pm.persistent_matmul(A, [B], **kw)
    assert len(hits) == (2 if on else 0), "read once per process"


@pytest.mark.skipif(not CUDA, reason="needs a GPU: the launch memo's direct launches")
@pytest.mark.parametrize("kind", ["bf16_split", "bf16_small_n", "fp8_row", "consumer", "given_out", "scatter"])
def test_the_launch_memo_on_a_gpu(monkeypatch, kind):
    """Repeated launches of the same tensors, refilled in place between calls (the memo's hits:
    same addresses, new contents), and a copy at other addresses between them: every result
    against cuBLAS, poisoned outputs, and the memo really served the repeats."""
    monkeypatch.setattr(pm, "MEMO", True)
    hits = []
    real = pm._memo_launch
    monkeypatch.setattr(pm, "_memo_launch", lambda *a: hits.append(real(*a)) or hits[-1])
    M, N, K = {"bf16_split": (4096, 1280, 8192), "bf16_small_n": (8192, 768, 4096), "fp8_row": (4096, 1280, 8192),
               "consumer": (4096, 1280, 4096), "given_out": (2048, 3584, 4096), "scatter": (4096, 1792, 4096)}[kind]  # fmt: skip
    fp8 = kind == "fp8_row"
    A = torch.empty(M, K, device=DEV, dtype=torch.bfloat16)
    B = torch.empty(N, K, device=DEV, dtype=torch.bfloat16).t()
    sa, sb = torch.empty(M, 1, device=DEV), torch.empty(1, N, device=DEV)
    W = 8
    flags = torch.ones(W, dtype=torch.int32, device=DEV)
    order = torch.tensor([(3 + i) % W for i in range(W)], dtype=torch.int32, device=DEV)
    out = torch.empty(M, N, device=DEV, dtype=torch.bfloat16)

    A8 = torch.empty(M, K, device=DEV, dtype=FP8)
    B8 = torch.empty(N, K, device=DEV, dtype=FP8).t()  # K-major, as _scaled_mm takes it

    def call(A, B):
        kw = {}
        if fp8:  # refilled in place too (the same addresses)
            kw = dict(A_scale=sa, B_scales=[sb], out_dtype=torch.bfloat16)
            a8, b8 = (A8, B8) if A.data_ptr() == A0 else (torch.empty_like(A8), torch.empty_like(B8.t()).t())
            a8.copy_(A)
            b8.copy_(B)
            A, B = a8, b8
        if kind == "consumer":
            kw.update(num_chunks=W, order=order, flags=flags, mode=pm.MODE_CONSUMER)
        if kind == "given_out":
            out.fill_(float("nan"))
            kw["outs"] = [out]
        if kind == "scatter":  # chunk c to rows (c + 2) % W of out (the reduce-scatter's producer)
            out.fill_(float("nan"))
            dests = list(out.view(W, M // W, N))
            kw.update(num_chunks=W, order=order, scatter_to=[dests[(c + 2) % W] for c in range(W)])
            pm.persistent_matmul(A, [B], **kw)
            return torch.cat([out.view(W, M // W, N)[(c + 2) % W] for c in range(W)])
        (C,) = pm.persistent_matmul(A, [B], **kw)
        return C

    A0 = A.data_ptr()
    # Call 0 compiles (Triton's own launch: nothing recorded), 1 records, 2 is the copy (recorded
    # under its own key), 3 and 4 are served by the memo.
    for it in range(5):
        A.normal_()
        B.normal_().mul_(K**-0.5)
        sa.uniform_(0.5, 1.5)
        sb.uniform_(0.5, 1.5)
        if fp8:
            ref = (A.to(FP8).float() @ B.to(FP8).float()) * sa * sb
        else:
            ref = A.float() @ B.float()
        C = call(A, B) if it != 2 else call(A.clone(), B.t().contiguous().t())  # a copy at other addresses
        err = ((C.float() - ref).norm() / ref.norm()).item()
        assert err < 1e-2, (kind, it, err)
    assert sum(h is not None for h in hits) >= 2, f"the memo served {hits}"


def test_launch_constants_are_kept_only_once_written(monkeypatch):
    """The chunk order and the default error record that launches read (pm._constant): kept after
    a synchronize of the stream that made them (another stream must not read them unwritten);
    under CUDA-graph capture made per call and not kept, and no launch memo entry is recorded
    there (its addresses would be the graph's). CPU stand-ins for the CUDA calls."""
    synced, capturing = [], [False]

    class _Stream:
        def synchronize(self):
            synced.append(1)

    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: capturing[0])
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: _Stream())
    cache = {}
    made = []

    def make():
        made.append(torch.zeros(6, dtype=torch.int32))
        return made[-1]

    capturing[0] = True
    a, b = pm._constant(cache, "k", "cuda:0", make), pm._constant(cache, "k", "cuda:0", make)
    assert a is not b and not cache and not synced
    capturing[0] = False
    c = pm._constant(cache, "k", "cuda:0", make)
    assert cache == {"k": c} and synced == [1]
    assert pm._constant(cache, "k", "cuda:0", make) is c and len(made) == 3 and synced == [1]
    assert pm._constant(cache, "cpu", "cpu", make) is cache["cpu"] and synced == [1]  # no stream on the CPU
    # The launch memo: nothing recorded under capture.
    monkeypatch.setattr(pm, "_MEMO", {})
    capturing[0] = True
    A = type("A", (), {"is_cuda": True})()
    pm._memo_record(("key", False, None, False, None, None), (None, None, (), (), 0), None, None, None, None, 0, 0,
                    1, 1, A, None, None)  # fmt: skip
    assert pm._MEMO == {}


@pytest.mark.skipif(not CUDA, reason="needs a GPU: CUDA graphs")
def test_first_launch_inside_a_capture_then_eager_before_any_replay(monkeypatch):
    """The first launch of a process inside a CUDA-graph capture, then eager launches before the
    graph ever replays: the constants the capture made (chunk order, error record) are filled
    only by a replay, so eager launches must not take them (nor a memo entry made in capture)."""
    monkeypatch.setattr(pm, "_ORDERS", {})
    monkeypatch.setattr(pm, "_ERR", {})
    monkeypatch.setattr(pm, "_MEMO", {})
    M, N, K = 512, 384, 256
    A, (B,) = _inputs(M, K, (N,), torch.float16, SEED)
    pm.persistent_matmul(torch.zeros(64, K, device=DEV, dtype=torch.float16), [B])  # compile, not the constants' key
    monkeypatch.setattr(pm, "_ORDERS", {})
    monkeypatch.setattr(pm, "_ERR", {})
    monkeypatch.setattr(pm, "_MEMO", {})
    junk = torch.full((1 << 20,), -1, device=DEV, dtype=torch.int32)  # reused memory holds nonzero words
    del junk
    static_A = A.clone()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    g = torch.cuda.CUDAGraph()
    with torch.cuda.stream(s), torch.cuda.graph(g, stream=s):
        (C,) = pm.persistent_matmul(static_A, [B])
    torch.cuda.current_stream().wait_stream(s)
    ref = A.double() @ B.double()
    peer = (A.float() @ B.float()).half()
    for _ in range(2):
        (E,) = pm.persistent_matmul(A, [B])  # eager, before any replay
        torch.cuda.synchronize()
        assert_matmul_close(E, ref, peer, k=2.0, atol=1e-5, what="eager before the first replay")
    C.fill_(float("nan"))
    g.replay()
    torch.cuda.synchronize()
    assert_matmul_close(C, ref, peer, k=2.0, atol=1e-5, what="replay")
