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
from utils import assert_matmul_close, randn

CUDA = torch.cuda.is_available()
if not CUDA:
    os.environ["TRITON_INTERPRET"] = "1"

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from mptp_kernels.kernels import persistent_matmul as pm  # noqa: E402
from mptp_kernels.symm.triton_sync import signal_release, wait_acquire  # noqa: E402

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
def test_tma_kernels_fp8_scales_bias(kernel, a_mode, with_bias):
    M, K, N = 96, 64, 48
    A, (B,) = _inputs(M, K, (N,), FP8, SEED, col_major_b=True)
    if a_mode == "tensor":
        A_scale, B_scale = torch.tensor(0.7, device=DEV), torch.tensor(1.3, device=DEV)
    else:
        A_scale = (randn((M, 1), SEED + 7).abs() + 0.5).to(DEV)
        B_scale = (randn((1, N), SEED + 8).abs() + 0.5).to(DEV)
    bias = randn((N,), SEED + 20).to(DEV, torch.float16) if with_bias else None
    (C,) = pm.persistent_matmul(A, [B], outs=_poisoned(M, (N,), torch.float16), A_scale=A_scale,
                                B_scales=[B_scale], biases=[bias] if with_bias else None, kernel=kernel)  # fmt: skip
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


def test_forced_tma_kernel_refuses_what_it_cannot_serve():
    A, Bs = _inputs(64, 32, (16, 16), torch.float16, SEED)
    with pytest.raises(ValueError, match="kernel='tma' needs one B"):
        pm.persistent_matmul(A, Bs, kernel="tma")
    with pytest.raises(ValueError, match="kernel must be one of"):
        pm.persistent_matmul(A, Bs[:1], kernel="cutlass")


@pytest.mark.skipif(not CUDA, reason="needs a GPU: the interpreter cannot overlap a late writer")
@pytest.mark.parametrize("kernel,dtype", [("pointer", torch.bfloat16), ("tma", torch.bfloat16),
                                          ("tma_flat", torch.bfloat16), ("pointer", FP8), ("tma_flat", FP8)])
def test_consumer_waits_for_late_flags(kernel, dtype):
    """Flags are set by another stream after a delay: tiles must not read rows before it."""
    W, M, K, N = 4, 4096, 1024, 1024
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
    wait_acquire(flags + 1, 3, 1_000_000_000, err, 1)
    tl.store(out, tl.load(flags + 0))


def test_triton_sync_helpers_signal_then_wait():
    """signal_release publishes, wait_acquire passes (flags pre-set for the interpreter)."""
    flags = torch.tensor([0, 3], dtype=torch.int32, device=DEV)
    err = torch.zeros(6, dtype=torch.int32, device=DEV)
    out = torch.zeros(1, dtype=torch.int32, device=DEV)
    _sync_kernel[(1,)](flags, err, out)
    assert flags.tolist() == [7, 3] and out.item() == 7 and err[0].item() == 0
