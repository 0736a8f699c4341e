"""Persistent Triton matmul: plain, chunk-consuming and chunk-producing.

One program per SM walks the output tiles in chunk order. A's (and C's) rows
are split into W chunks of M // W rows; `order[i]` is the i-th chunk to compute.

* plain    (MODE=0): no flags; one chunk.
* consumer (MODE=1): before loading rows of chunk c the program waits (acquire)
  until flags[c] >= epoch. NOTE: flags are written by copy-engine streams or
  stream memory operations, never by another kernel, so spinning here cannot
  deadlock even when this kernel holds every SM. A wait that times out fills
  err (the process's error record) and gives up; after the launch, every output
  is overwritten with NaN if err[0] is set (poison.py: one read of the
  host-mapped record per output, not one per program and chunk), so a call that
  lost a peer never returns normal-looking output.
* producer (MODE=2): after storing a tile of chunk c the program bumps
  counters[c]; the program that stores the chunk's last tile resets the counter
  and publishes flags[c] = epoch with release semantics.

Up to three Bs share one launch (same A, same K); bf16/fp16 with fp32
accumulation, FP8 e4m3 with tensor-wise or row-wise A/B scales, optional bias,
out dtype bf16/fp16/fp32 or FP8 (e4m3fn/e5m2, optional result scale, cast as
torch._scaled_mm casts: see epilogue.py), fast accumulation switch.

NOTE: index arithmetic that can reach 2**31 (row * stride, row * N, column *
K-major stride) is int64: the row (column) index vector is widened once per tile.
"""

import functools
from dataclasses import dataclass
from typing import List, Optional, Sequence

import torch
import triton
import triton.language as tl

from ..symm.triton_sync import signal_release, wait_acquire, wait_nonzero
from . import epilogue
from . import launch as _L
from .epilogue import load_result_scale, to_output
from .launch import launch, launch_static
from .poison import poison_if_error

MAX_B = 3
MODE_PLAIN, MODE_CONSUMER, MODE_PRODUCER = 0, 1, 2
# The signal-pad channel of matmul-reduce-scatter's arrival flags (symm.primitives.CH_ARRIVE), for
# the error record of a wait for them that timed out.
_CH_ARRIVE = tl.constexpr(3)


@dataclass(frozen=True)
class Reduce:
    """persistent_matmul(reduce=...): matmul-reduce-scatter's sum inside the matmul (the TMA
    kernel's PRODUCE 2; see there). `slots` is this rank's buffer as [W, M // W, N] (scatter_to[rank]
    is slots[rank]); `out` [M // W, N] receives scale * the fp32 sum of the W slots, in slot
    order; `counters` int32 [W], zero (each launch leaves them zero); `arrive_to` int64 [W], the
    address of the int32 flag that tells chunk c's owner our partial of it arrived (ignored for
    c == rank); `arrived` int32 [W], this rank's flags (set to 1 by peers; the caller zeroes them
    after the launch); `err` the error record a timed-out wait fills."""

    rank: int
    slots: torch.Tensor
    out: torch.Tensor
    counters: torch.Tensor
    arrive_to: torch.Tensor
    arrived: torch.Tensor
    err: torch.Tensor
    scale: float = 1.0


@triton.jit
def _select(b, x0, x1, x2):
    if b == 0:
        r = x0
    elif b == 1:
        r = x1
    else:
        r = x2
    return r


@triton.jit
def _select8(c, x0, x1, x2, x3, x4, x5, x6, x7):
    if c < 4:
        if c < 2:
            r = x0 if c == 0 else x1
        else:
            r = x2 if c == 2 else x3
    else:
        if c < 6:
            r = x4 if c == 4 else x5
        else:
            r = x6 if c == 6 else x7
    return r


@triton.jit
def _tile_coords(t, pid_m_per_chunk, num_pid_n, GROUP_M: tl.constexpr):
    """(pid_m, pid_n) of tile t of a chunk: grouped swizzle for L2 reuse of A rows and B columns."""
    group_size = GROUP_M * num_pid_n
    first_m = (t // group_size) * GROUP_M
    gm = min(pid_m_per_chunk - first_m, GROUP_M)
    pid_m = first_m + (t % group_size) % gm
    pid_n = (t % group_size) // gm
    return pid_m, pid_n


@triton.jit
def _persistent_matmul_kernel(
    A, B0, B1, B2, C0, C1, C2, BIAS0, BIAS1, BIAS2, BS0, BS1, BS2, A_SCALE, RS,
    D0, D1, D2, D3, D4, D5, D6, D7,
    N0, N1, N2,
    stride_b0k, stride_b0n, stride_b1k, stride_b1n, stride_b2k, stride_b2n,
    M, K, stride_am, stride_ak,
    order_ptr, flags_ptr, counters_ptr, epoch, timeout_ns, err_ptr, tag,
    NUM_CHUNKS: tl.constexpr, NUM_B: tl.constexpr, MODE: tl.constexpr,
    HAS_BIAS: tl.constexpr, A_SCALE_MODE: tl.constexpr, B_SCALE_MODE: tl.constexpr,
    RS_MODE: tl.constexpr, E5M2_INF: tl.constexpr, SOFT_FP8: tl.constexpr,
    FAST_ACCUM: tl.constexpr, INPUT_PRECISION: tl.constexpr, SCATTER: tl.constexpr,
    EVEN_N: tl.constexpr, MASK_B: tl.constexpr, GUARD: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr, NUM_SMS: tl.constexpr,
):  # fmt: skip
    # A_SCALE_MODE / B_SCALE_MODE: 0 none, 1 tensor-wise (one float), 2 row-wise (per row / col).
    # RS_MODE, E5M2_INF, SOFT_FP8: FP8 output conversion (epilogue.py).
    # EVEN_N: every N is a multiple of 16, so no vector of the hinted column loads below crosses N.
    # MASK_B: a vector of B's last row could end past B's storage (_b_needs_mask): mask B's columns.
    # GUARD: store nothing if err_ptr[0] (the device's fail latch) is set when the program starts
    # (fail-stop: the stores may land in a peer's symmetric buffer; symm.primitives.copy_guarded).
    pid = tl.program_id(0)
    if GUARD:
        ok = tl.load(err_ptr, volatile=True) == 0
    chunk_m = M // NUM_CHUNKS
    pid_m_per_chunk = tl.cdiv(chunk_m, BLOCK_M)
    tiles_b0 = pid_m_per_chunk * tl.cdiv(N0, BLOCK_N)
    tiles_b1 = pid_m_per_chunk * tl.cdiv(N1, BLOCK_N)
    tiles_b2 = pid_m_per_chunk * tl.cdiv(N2, BLOCK_N)
    tiles_per_chunk = tiles_b0
    if NUM_B > 1:
        tiles_per_chunk += tiles_b1
    if NUM_B > 2:
        tiles_per_chunk += tiles_b2
    total = tiles_per_chunk * NUM_CHUNKS
    k_tiles = tl.cdiv(K, BLOCK_K)
    offs_k = tl.arange(0, BLOCK_K)
    out_factor = load_result_scale(RS, RS_MODE)
    ready_chunk = -1

    for tile in range(pid, total, NUM_SMS):
        idx = tile // tiles_per_chunk
        t = tile - idx * tiles_per_chunk
        chunk = tl.load(order_ptr + idx)
        if MODE == 1:
            if chunk != ready_chunk:
                wait_acquire(flags_ptr + chunk, epoch, timeout_ns, err_ptr, chunk, tag)
                ready_chunk = chunk
        # Which B does this tile belong to?
        b = 0
        if NUM_B > 1:
            if t >= tiles_b0:
                t -= tiles_b0
                b = 1
                if NUM_B > 2:
                    if t >= tiles_b1:
                        t -= tiles_b1
                        b = 2
        N = _select(b, N0, N1, N2)
        Bp = _select(b, B0, B1, B2)
        Cp = _select(b, C0, C1, C2)
        stride_bk = _select(b, stride_b0k, stride_b1k, stride_b2k)
        stride_bn = _select(b, stride_b0n, stride_b1n, stride_b2n)
        pid_m, pid_n = _tile_coords(t, pid_m_per_chunk, tl.cdiv(N, BLOCK_N), GROUP_M)

        row_start = chunk * chunk_m
        # int64 rows: rows * stride_am and rows * N pass 2**31 on large problems.
        offs_m = (row_start + pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        row_mask = offs_m < row_start + chunk_m
        col_mask = offs_n < N
        offs_am = tl.where(row_mask, offs_m, row_start)
        offs_bn = tl.where(col_mask, offs_n, 0)
        # NOTE: without these hints the clamp above hides that B's columns are
        # contiguous, and a row-major B is loaded element by element (25x slower).
        offs_bn = tl.max_contiguous(tl.multiple_of(offs_bn, BLOCK_N), BLOCK_N)
        a_ptrs = A + offs_am[:, None] * stride_am + offs_k[None, :] * stride_ak
        # int64 columns: a K-major B has stride_bn = K, and N * K may pass 2**31.
        b_ptrs = Bp + offs_k[:, None] * stride_bk + offs_bn.to(tl.int64)[None, :] * stride_bn
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for kk in range(0, k_tiles):
            k_mask = offs_k < K - kk * BLOCK_K
            a = tl.load(a_ptrs, mask=k_mask[None, :], other=0.0)
            if MASK_B:  # NOTE: the hints let a vector start below N and end past it (element loads here)
                bt = tl.load(b_ptrs, mask=k_mask[:, None] & col_mask[None, :], other=0.0)
            else:
                bt = tl.load(b_ptrs, mask=k_mask[:, None], other=0.0)
            if FAST_ACCUM:
                acc = tl.dot(a, bt, acc, input_precision=INPUT_PRECISION)
            else:
                acc += tl.dot(a, bt, input_precision=INPUT_PRECISION)
            a_ptrs += BLOCK_K * stride_ak
            b_ptrs += BLOCK_K * stride_bk

        if A_SCALE_MODE == 1:
            acc = acc * tl.load(A_SCALE)
        elif A_SCALE_MODE == 2:
            acc = acc * tl.load(A_SCALE + offs_am)[:, None]
        if B_SCALE_MODE == 1:
            acc = acc * tl.load(_select(b, BS0, BS1, BS2))
        elif B_SCALE_MODE == 2:
            if EVEN_N:
                acc = acc * tl.load(_select(b, BS0, BS1, BS2) + offs_bn)[None, :]
            else:
                acc = acc * tl.load(_select(b, BS0, BS1, BS2) + offs_bn, mask=col_mask, other=0.0)[None, :]
        if HAS_BIAS:
            if EVEN_N:
                acc = acc + tl.load(_select(b, BIAS0, BIAS1, BIAS2) + offs_bn).to(tl.float32)[None, :]
            else:
                acc = acc + tl.load(_select(b, BIAS0, BIAS1, BIAS2) + offs_bn, mask=col_mask, other=0.0).to(tl.float32)[None, :]
        if RS_MODE != 0:
            acc = acc * out_factor
        if SCATTER:
            # Chunk c's rows go to D_c (e.g. rank c's symmetric buffer), rows renumbered from 0.
            Cp = _select8(chunk, D0, D1, D2, D3, D4, D5, D6, D7)
            c_ptrs = Cp + (offs_m - row_start)[:, None] * N + offs_n[None, :]
        else:
            c_ptrs = Cp + offs_m[:, None] * N + offs_n[None, :]
        out = to_output(acc, Cp.dtype.element_ty, E5M2_INF, SOFT_FP8)
        if GUARD:
            tl.store(c_ptrs, out, mask=row_mask[:, None] & col_mask[None, :] & ok)
        else:
            tl.store(c_ptrs, out, mask=row_mask[:, None] & col_mask[None, :])

        if MODE == 2:
            # Publish the chunk once its last tile is stored (release orders the stores).
            done = tl.atomic_add(counters_ptr + chunk, 1, sem="acq_rel", scope="gpu")
            if done == tiles_per_chunk - 1:
                tl.atomic_xchg(counters_ptr + chunk, 0, sem="relaxed", scope="gpu")
                signal_release(flags_ptr + chunk, epoch)


@triton.jit
def _tma_epilogue(acc, C, A_SCALE, BS, BIAS, out_factor, N, off_m, off_n, row_end, ok,
                  A_SCALE_MODE: tl.constexpr, B_SCALE_MODE: tl.constexpr, HAS_BIAS: tl.constexpr,
                  RS_MODE: tl.constexpr, E5M2_INF: tl.constexpr, SOFT_FP8: tl.constexpr, GUARD: tl.constexpr,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, c_row0=0, c_desc=None,
                  TMA_STORE: tl.constexpr = False):  # fmt: skip
    """Scales, bias, output cast and the masked store of one tile (rows below row_end); C's row
    i holds A's row c_row0 + i (a chunk scattered to its own buffer: c_row0 is its first row).
    TMA_STORE: the tile goes out through c_desc (a descriptor of C) instead, asynchronously (the
    program's next loads need not wait for it); only where no tile's rows cross row_end inside C
    (the descriptor clips at C's edges only) and c_row0 is 0."""
    offs_m = off_m + tl.arange(0, BLOCK_M)
    offs_n = off_n + tl.arange(0, BLOCK_N)
    row_mask = offs_m < row_end
    col_mask = offs_n < N
    if A_SCALE_MODE == 1:
        acc = acc * tl.load(A_SCALE)
    elif A_SCALE_MODE == 2:
        acc = acc * tl.load(A_SCALE + offs_m, mask=row_mask, other=0.0)[:, None]
    if B_SCALE_MODE == 1:
        acc = acc * tl.load(BS)
    elif B_SCALE_MODE == 2:
        acc = acc * tl.load(BS + offs_n, mask=col_mask, other=0.0)[None, :]
    if HAS_BIAS:
        acc = acc + tl.load(BIAS + offs_n, mask=col_mask, other=0.0).to(tl.float32)[None, :]
    if RS_MODE != 0:
        acc = acc * out_factor
    # int64 rows: rows * N passes 2**31 on large outputs.
    out = to_output(acc, C.dtype.element_ty, E5M2_INF, SOFT_FP8)
    if TMA_STORE:
        if GUARD:
            if ok:
                c_desc.store([off_m, off_n], out)
        else:
            c_desc.store([off_m, off_n], out)
    else:
        c_ptrs = C + (offs_m - c_row0).to(tl.int64)[:, None] * N + offs_n[None, :]
        if GUARD:
            tl.store(c_ptrs, out, mask=row_mask[:, None] & col_mask[None, :] & ok)
        else:
            tl.store(c_ptrs, out, mask=row_mask[:, None] & col_mask[None, :])


@triton.jit
def _tma_acc(a_desc, b_desc, off_m, off_n, k_lo, k_hi, FAST_ACCUM: tl.constexpr, B_KMAJOR: tl.constexpr,
             BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):  # fmt: skip
    """The fp32 sum over K blocks k_lo .. k_hi - 1 of one output tile."""
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for kk in range(k_lo, k_hi):
        off_k = kk * BLOCK_K
        a = a_desc.load([off_m, off_k])
        if B_KMAJOR:
            b = b_desc.load([off_n, off_k]).T
        else:
            b = b_desc.load([off_k, off_n])
        if FAST_ACCUM:
            acc = tl.dot(a, b, acc)
        else:
            acc += tl.dot(a, b)
    return acc


@triton.jit
def _sk_start(j, base, sk_iters, NUM_SMS: tl.constexpr):
    """First iteration of stream-K share j (shares split sk_iters as evenly as integers allow)."""
    return base + (j * sk_iters) // NUM_SMS


@triton.jit
def _sk_piece(a_desc, b_desc, g, k_lo, k_hi, order_ptr, flags_ptr, epoch, timeout_ns, err_ptr, tag, tiles_per_chunk,
              chunk_m, pid_m_per_chunk, num_pid_n, MODE: tl.constexpr, FAST_ACCUM: tl.constexpr,
              B_KMAJOR: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
              GROUP_M: tl.constexpr):  # fmt: skip
    """K blocks k_lo .. k_hi - 1 of global tile g (chunk order; a consumer waits for its chunk):
    (fp32 sum, the tile's first row and column, the end of its chunk's rows, the chunk)."""
    idx = g // tiles_per_chunk
    t = g - idx * tiles_per_chunk
    chunk = tl.load(order_ptr + idx)
    if MODE == 1:
        wait_acquire(flags_ptr + chunk, epoch, timeout_ns, err_ptr, chunk, tag)
    row_start = chunk * chunk_m
    pid_m, pid_n = _tile_coords(t, pid_m_per_chunk, num_pid_n, GROUP_M)
    off_m = row_start + pid_m * BLOCK_M
    off_n = pid_n * BLOCK_N
    acc = _tma_acc(a_desc, b_desc, off_m, off_n, k_lo, k_hi, FAST_ACCUM, B_KMAJOR, BLOCK_M, BLOCK_N, BLOCK_K)
    return acc, off_m, off_n, row_start + chunk_m, chunk


@triton.jit
def _sk_slot(SK_WS, slot, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Pointers to piece slot `slot` (fp32, BLOCK_M x BLOCK_N, int64 offsets)."""
    offs = tl.arange(0, BLOCK_M)[:, None] * BLOCK_N + tl.arange(0, BLOCK_N)[None, :]
    return SK_WS + slot.to(tl.int64) * (BLOCK_M * BLOCK_N) + offs


@triton.jit
def _sk_publish(acc, SK_WS, SK_SYNC, slot, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Stores a piece into its slot, then its flag (release, after every thread's stores)."""
    tl.store(_sk_slot(SK_WS, slot, BLOCK_M, BLOCK_N), acc)
    tl.debug_barrier()
    tl.atomic_xchg(SK_SYNC + 2 + slot, 1, sem="release", scope="gpu")


@triton.jit
def _sk_add(acc, good, SK_WS, SK_SYNC, slot, wait_ns, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """acc + the piece in `slot` once its flag is set; good & whether it was set in time.
    NOTE: the piece's holder took its ticket before this program, so it runs; a timeout here
    (wait_ns: twice a consumer wait's, plus 1 s) means a consumer wait of it timed out first."""
    got = wait_nonzero(SK_SYNC + 2 + slot, wait_ns)
    tl.debug_barrier()
    return acc + tl.load(_sk_slot(SK_WS, slot, BLOCK_M, BLOCK_N)), good & got


@triton.jit
def _dest(C, D0, D1, D2, D3, D4, D5, D6, D7, chunk, chunk_m, PRODUCE: tl.constexpr):
    """(pointer, first row) where a tile of `chunk` is stored: C from row 0, or (a scatter) D_chunk
    from the chunk's first row."""
    if PRODUCE != 0:
        Cc = _select8(chunk, D0, D1, D2, D3, D4, D5, D6, D7)
        c_row0 = chunk * chunk_m
    else:
        Cc = C
        c_row0 = 0
    return Cc, c_row0


@triton.jit
def _publish_tile(counters_ptr, arrive_to, chunk, tiles_per_chunk):
    """A tile of `chunk` is stored in its owner's buffer: count it; the program that counts the
    chunk's last tile zeroes the count and flags the chunk's arrival in the owner's pad (release,
    system scope, after every store of every program that counted before it)."""
    tl.debug_barrier()  # every thread's stores of this tile before the count
    done = tl.atomic_add(counters_ptr + chunk, 1, sem="acq_rel", scope="sys")
    if done == tiles_per_chunk - 1:
        tl.atomic_xchg(counters_ptr + chunk, 0, sem="relaxed", scope="gpu")
        signal_release(tl.load(arrive_to + chunk).to(tl.pointer_type(tl.int32)), 1)


@triton.jit
def _wait_partials(arrived, W, rank, timeout_ns, err_ptr, tag, CHANNEL: tl.constexpr):
    """Waits (acquire) until every peer flagged its partial of this rank's chunk as arrived."""
    for p in range(0, W):
        if p != rank:
            wait_acquire(arrived + p, 1, timeout_ns, err_ptr, p, tag, CHANNEL=CHANNEL)
    tl.debug_barrier()  # the acquires above before any thread's loads of the partials


@triton.jit
def _reduce_tile(SLOTS, OUT, red_scale, W: tl.constexpr, chunk_m, N, off_m, off_n, E5M2_INF: tl.constexpr,
                 SOFT_FP8: tl.constexpr, SUB_M: tl.constexpr, BLOCK_M: tl.constexpr,
                 BLOCK_N: tl.constexpr):  # fmt: skip
    """OUT[tile] = red_scale * sum over p = 0 .. W-1 of SLOTS[p][tile] in fp32, in slot order (as
    reduce.reduce_partials sums, bit for bit), SUB_M rows at a time (a whole tile beside the
    accumulator would spill). SLOTS: [W, chunk_m, N]; off_m counts rows of the chunk."""
    tl.debug_barrier()  # this program's own partial, stored by every thread, before the loads
    offs_n = off_n + tl.arange(0, BLOCK_N)
    col_mask = offs_n < N
    step = chunk_m.to(tl.int64) * N
    for r in tl.static_range(0, BLOCK_M, SUB_M):
        rows = off_m + r + tl.arange(0, SUB_M)
        mask = (rows < chunk_m)[:, None] & col_mask[None, :]
        offs = rows.to(tl.int64)[:, None] * N + offs_n[None, :]
        ptrs = SLOTS + offs
        tot = tl.zeros((SUB_M, BLOCK_N), dtype=tl.float32)
        # NOTE: unrolled (W is a constexpr): the W loads are independent and go out together, where
        # a loop waits for each in turn (one program per SM: memory-level parallelism is the speed).
        for _ in tl.static_range(W):
            # .cg: a peer's partial, written over NVLink, is read from L2, never from a stale L1 line.
            tot += tl.load(ptrs, mask=mask, other=0.0, cache_modifier=".cg").to(tl.float32)
            ptrs += step
        tot = tot * red_scale
        tl.store(OUT + offs, to_output(tot, OUT.dtype.element_ty, E5M2_INF, SOFT_FP8), mask=mask)


@triton.jit
def _persistent_matmul_tma_kernel(
    a_desc, b_desc, C, A_SCALE, BS, BIAS, RS, M, N, K,
    order_ptr, flags_ptr, epoch, timeout_ns, err_ptr, tag, sk_tiles, splits, sk_wait_ns, SK_WS, SK_SYNC,
    D0, D1, D2, D3, D4, D5, D6, D7, SLOTS, OUT, counters_ptr, arrive_to, arrived, rank, red_scale, red_err,
    c_desc, NUM_CHUNKS: tl.constexpr, MODE: tl.constexpr, PRODUCE: tl.constexpr, HAS_BIAS: tl.constexpr,
    A_SCALE_MODE: tl.constexpr, B_SCALE_MODE: tl.constexpr, RS_MODE: tl.constexpr,
    E5M2_INF: tl.constexpr, SOFT_FP8: tl.constexpr, FAST_ACCUM: tl.constexpr,
    B_KMAJOR: tl.constexpr, FLATTEN: tl.constexpr, GUARD: tl.constexpr, SK_MODE: tl.constexpr, SUB_M: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, NUM_SMS: tl.constexpr, TMA_STORE: tl.constexpr,
):  # fmt: skip
    """One B (plain or consumer), TMA (tensor-descriptor) loads.

    TMA_STORE: the tiles dealt out whole are stored through c_desc (a descriptor of C, see
    _tma_epilogue; PRODUCE 0, chunks of whole BLOCK_M tiles); split tiles keep the masked store.
    Otherwise c_desc is unused (0).

    Same tile assignment as _persistent_matmul_kernel (global tile i goes to
    program i % NUM_SMS), written as a loop over chunks around a loop over this
    program's tiles of the chunk. The consumer's wait sits between the two, so
    with FLATTEN the compiler may pipeline loads across tiles of one chunk
    (hiding each tile's prologue) but never hoist a load above the wait.

    SK_MODE 2 (split tail): the last sk_tiles tiles (in chunk order) are not dealt out whole:
    each is split into `splits` equal K ranges (units), one unit per program, and the unit of
    K range 0 (the owner) sums its own part with the others' (published as below) in split
    order and stores the tile.
    SK_MODE 1 (stream-K): the last sk_tiles tiles (in chunk order) are not dealt out whole but split by
    K iterations into NUM_SMS equal shares, one per program (stream-K: a last wave that would
    leave SMs idle keeps them all busy). A share starts with the tail of one tile and ends
    with the head of another. The program holding a tile's head (its first K block) sums it
    with the later pieces, published by the programs holding them, in share order (a fixed
    order: the result does not depend on timing), and stores the tile; a program whose share
    starts inside a tile publishes that piece (fp32, SK_WS[share]) and its flag
    (SK_SYNC[2 + share], release) once it has done the tiles dealt out whole.
    NOTE: shares (units) are handed out by ticket (SK_SYNC[0], taken at the program's start),
    share NUM_SMS - 1 - ticket (owners hold their tile's highest tickets): a program only ever
    waits for pieces of programs that took their ticket before it, so they are running already, and nothing waits for a program that never
    got an SM (whatever else holds SMs). The last program to finish (SK_SYNC[1]) zeroes the
    tickets and the flags for the next launch (SK_SYNC is per stream, or per captured launch).

    PRODUCE 1 (scatter): chunk c's rows go to D_c (rows renumbered from 0), e.g. slot r of rank
    c's symmetric buffer. PRODUCE 2 (scatter and reduce, matmul-reduce-scatter): as 1, and each
    stored tile of another rank's chunk is counted (counters_ptr); the chunk's last one flags
    its arrival in the owner's pad (arrive_to[c]: an address). A tile of this rank's own chunk
    (`rank`, last in the order) is stored to its slot (D_rank, SLOTS[rank]) too; then, once every
    peer's partial of the chunk has arrived (arrived[p], waited for after the program's first
    own tile is computed: the peers' last partials land while it is), the program sums the W
    slots of the tile in slot order and stores it to OUT ([chunk_m, N]). A wait that times out
    fills red_err (the process's error record; the caller poisons OUT after the launch).
    NOTE: those waits are for other GPUs' kernels, or for other processes' kernels time-sliced
    with this one on a GPU they share, or (a loopback group) for earlier tiles of this launch;
    each is bounded by timeout_ns.

    NOTE: a tile may load rows past its chunk (another chunk's, maybe not yet
    arrived); they only feed output rows that the masked store drops.
    """
    pid = tl.program_id(0)
    if GUARD:  # as in _persistent_matmul_kernel
        ok = tl.load(err_ptr, volatile=True) == 0
    else:
        ok = True
    if SK_MODE != 0:
        ticket = tl.atomic_add(SK_SYNC, 1, sem="acq_rel", scope="gpu")
    chunk_m = M // NUM_CHUNKS
    pid_m_per_chunk = tl.cdiv(chunk_m, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    tiles_per_chunk = pid_m_per_chunk * num_pid_n
    k_tiles = tl.cdiv(K, BLOCK_K)
    out_factor = load_result_scale(RS, RS_MODE)
    dp_tiles = tiles_per_chunk * NUM_CHUNKS
    if SK_MODE != 0:
        dp_tiles -= sk_tiles
    for idx in range(NUM_CHUNKS):
        chunk = tl.load(order_ptr + idx)
        # First tile of this chunk that is ours: global index idx * tiles_per_chunk + t == pid (mod NUM_SMS).
        first = (pid + NUM_SMS - (idx * tiles_per_chunk) % NUM_SMS) % NUM_SMS
        last = tiles_per_chunk
        if SK_MODE != 0:
            last = min(tiles_per_chunk, dp_tiles - idx * tiles_per_chunk)
        if MODE == 1:
            if first < last:
                wait_acquire(flags_ptr + chunk, epoch, timeout_ns, err_ptr, chunk, tag)
        row_start = chunk * chunk_m
        Cc, c_row0 = _dest(C, D0, D1, D2, D3, D4, D5, D6, D7, chunk, chunk_m, PRODUCE)
        waited = False
        for t in tl.range(first, last, NUM_SMS, flatten=FLATTEN):
            pid_m, pid_n = _tile_coords(t, pid_m_per_chunk, num_pid_n, GROUP_M)
            off_m = row_start + pid_m * BLOCK_M
            off_n = pid_n * BLOCK_N
            acc = _tma_acc(a_desc, b_desc, off_m, off_n, 0, k_tiles, FAST_ACCUM, B_KMAJOR, BLOCK_M, BLOCK_N, BLOCK_K)
            _tma_epilogue(acc, Cc, A_SCALE, BS, BIAS, out_factor, N, off_m, off_n, row_start + chunk_m, ok,
                          A_SCALE_MODE, B_SCALE_MODE, HAS_BIAS, RS_MODE, E5M2_INF, SOFT_FP8, GUARD,
                          BLOCK_M, BLOCK_N, c_row0, c_desc, TMA_STORE)  # fmt: skip
            if PRODUCE == 2:
                if chunk == rank:
                    if not waited:
                        _wait_partials(arrived, NUM_CHUNKS, rank, timeout_ns, red_err, tag, CHANNEL=_CH_ARRIVE)
                        waited = True
                    _reduce_tile(SLOTS, OUT, red_scale, NUM_CHUNKS, chunk_m, N, off_m - row_start, off_n,
                                 E5M2_INF, SOFT_FP8, SUB_M, BLOCK_M, BLOCK_N)  # fmt: skip
                elif ok:  # NOTE: a guarded launch stored nothing: it must not say it did (fail-stop)
                    _publish_tile(counters_ptr, arrive_to, chunk, tiles_per_chunk)
    if SK_MODE == 1:
        share = NUM_SMS - 1 - ticket
        base = dp_tiles * k_tiles
        sk_iters = sk_tiles * k_tiles
        it = _sk_start(share, base, sk_iters, NUM_SMS)
        it_end = _sk_start(share + 1, base, sk_iters, NUM_SMS)
        while it < it_end:
            g = it // k_tiles
            k_lo = it - g * k_tiles
            k_hi = min(k_tiles, k_lo + (it_end - it))
            acc, off_m, off_n, row_end, g_chunk = _sk_piece(
                a_desc, b_desc, g, k_lo, k_hi, order_ptr, flags_ptr, epoch, timeout_ns, err_ptr, tag, tiles_per_chunk,
                chunk_m, pid_m_per_chunk, num_pid_n, MODE, FAST_ACCUM, B_KMAJOR, BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M)  # fmt: skip
            if k_lo != 0:  # not the tile's head: publish the piece for the program that holds the head
                _sk_publish(acc, SK_WS, SK_SYNC, share, BLOCK_M, BLOCK_N)
            else:
                good = share >= 0  # true
                if k_hi < k_tiles:
                    # The head of a split tile: add the later pieces in share order.
                    tile_end = (g + 1) * k_tiles
                    j = share + 1
                    while j < NUM_SMS:
                        s = _sk_start(j, base, sk_iters, NUM_SMS)
                        if s >= tile_end:
                            j = NUM_SMS
                        else:
                            if _sk_start(j + 1, base, sk_iters, NUM_SMS) > s:  # an empty share published nothing
                                acc, good = _sk_add(acc, good, SK_WS, SK_SYNC, j, sk_wait_ns, BLOCK_M, BLOCK_N)
                            j += 1
                    acc = tl.where(good, acc, float("nan"))  # a lost piece: NaN, never a partial sum
                Cs, s_row0 = _dest(C, D0, D1, D2, D3, D4, D5, D6, D7, g_chunk, chunk_m, PRODUCE)
                _tma_epilogue(acc, Cs, A_SCALE, BS, BIAS, out_factor, N, off_m, off_n, row_end, ok,
                              A_SCALE_MODE, B_SCALE_MODE, HAS_BIAS, RS_MODE, E5M2_INF, SOFT_FP8, GUARD,
                              BLOCK_M, BLOCK_N, s_row0)  # fmt: skip
            it = (g + 1) * k_tiles
    if SK_MODE == 2:
        # Unit `ticket` (if any): split `splits - 1 - ticket // sk_tiles` of split tile ticket % sk_tiles.
        # Split 0 (the tile's owner) holds the highest tickets of its tile's units.
        if ticket < sk_tiles * splits:
            split = splits - 1 - ticket // sk_tiles
            g = dp_tiles + (ticket - (ticket // sk_tiles) * sk_tiles)
            k_lo = (split * k_tiles) // splits
            k_hi = ((split + 1) * k_tiles) // splits
            acc, off_m, off_n, row_end, g_chunk = _sk_piece(
                a_desc, b_desc, g, k_lo, k_hi, order_ptr, flags_ptr, epoch, timeout_ns, err_ptr, tag, tiles_per_chunk,
                chunk_m, pid_m_per_chunk, num_pid_n, MODE, FAST_ACCUM, B_KMAJOR, BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M)  # fmt: skip
            if split != 0:
                _sk_publish(acc, SK_WS, SK_SYNC, ticket, BLOCK_M, BLOCK_N)
            else:
                # The owner's own piece goes to its slot too, and the tile is summed and stored
                # SUB_M rows at a time from memory (L2): a whole piece loaded beside the fp32
                # accumulator took every register (255, with spills; ptxas on sm_90).
                tl.store(_sk_slot(SK_WS, ticket, BLOCK_M, BLOCK_N), acc)
                good = ticket >= 0  # true
                for sp in range(1, splits):
                    good = good & wait_nonzero(SK_SYNC + 2 + ticket - sp * sk_tiles, sk_wait_ns)
                tl.debug_barrier()  # this program's stores and the acquires above, before the loads
                offs = tl.arange(0, SUB_M)[:, None] * BLOCK_N + tl.arange(0, BLOCK_N)[None, :]
                for r in tl.static_range(0, BLOCK_M, SUB_M):
                    base = SK_WS + r * BLOCK_N + offs
                    tot = tl.load(base + ticket.to(tl.int64) * (BLOCK_M * BLOCK_N))
                    for sp in range(1, splits):  # fixed order: the owner's, then split 1, 2, ...
                        tot += tl.load(base + (ticket - sp * sk_tiles).to(tl.int64) * (BLOCK_M * BLOCK_N))
                    tot = tl.where(good, tot, float("nan"))  # a lost piece: NaN, never a partial sum
                    Cs, s_row0 = _dest(C, D0, D1, D2, D3, D4, D5, D6, D7, g_chunk, chunk_m, PRODUCE)
                    _tma_epilogue(tot, Cs, A_SCALE, BS, BIAS, out_factor, N, off_m + r, off_n, row_end, ok,
                                  A_SCALE_MODE, B_SCALE_MODE, HAS_BIAS, RS_MODE, E5M2_INF, SOFT_FP8, GUARD,
                                  SUB_M, BLOCK_N, s_row0)  # fmt: skip
    if SK_MODE != 0:
        # The last program out resets the tickets and the flags (stream order: before the next launch).
        done = tl.atomic_add(SK_SYNC + 1, 1, sem="acq_rel", scope="gpu")
        if done == NUM_SMS - 1:
            for j in range(0, NUM_SMS):
                tl.store(SK_SYNC + 2 + j, 0)
            tl.store(SK_SYNC + 1, 0)
            tl.store(SK_SYNC, 0)


# Set by the first TMA launch of the process that did not raise: reduce= (which has no pointer
# kernel to fall back to) is offered only once the TMA kernel is known to launch here.
TMA_PROVEN = False


def reduce_eligible(A: torch.Tensor, B: torch.Tensor) -> bool:
    """Whether persistent_matmul(A, [B], reduce=...) can run here: the TMA kernel on a GPU, once a
    TMA launch has succeeded in this process."""
    return TMA_PROVEN and USE_TMA and A.is_cuda and not _interpreting() and _tma_ok(A, [B], None, MODE_PLAIN)


def _check_scatter(scatter_to, Bs, num_chunks, M, device) -> None:
    """ValueError unless scatter_to is num_chunks (at most 8) contiguous [M // num_chunks, N]
    tensors of one dtype on A's device (the kernels store rows N apart from each one's start)."""
    if len(Bs) != 1 or not 1 <= num_chunks <= 8 or len(scatter_to) != num_chunks:
        raise ValueError(f"persistent_matmul: scatter_to needs one B and num_chunks (1 to 8) destinations, got "
                         f"{len(Bs)} Bs, num_chunks={num_chunks}, {len(scatter_to)} destinations")  # fmt: skip
    shape, dtype = (M // num_chunks, Bs[0].shape[1]), scatter_to[0].dtype
    for i, d in enumerate(scatter_to):
        if tuple(d.shape) != shape or not d.is_contiguous() or d.dtype != dtype or d.device != device:
            raise ValueError(f"persistent_matmul: scatter_to[{i}]: expected a contiguous {list(shape)} {dtype} "
                             f"tensor on {device}, got {list(d.shape)} {d.dtype} on {d.device}"
                             f"{'' if d.is_contiguous() else ', not contiguous'}")  # fmt: skip


def _check_reduce(r, scatter_to, num_chunks, M, N) -> None:
    """ValueError unless the Reduce fits the call (see Reduce)."""
    Mc = M // num_chunks
    why = None
    if not (r.slots.is_contiguous() and r.out.is_contiguous()):
        why = "slots and out must be contiguous"
    elif not r.slots.dtype == r.out.dtype == scatter_to[0].dtype:
        why = f"slots, out and scatter_to must have one dtype, got {r.slots.dtype}, {r.out.dtype}, {scatter_to[0].dtype}"
    elif tuple(r.slots.shape) != (num_chunks, Mc, N) or tuple(r.out.shape) != (Mc, N):
        why = (f"slots must be {[num_chunks, Mc, N]} and out {[Mc, N]}, got {list(r.slots.shape)} and "
               f"{list(r.out.shape)}")  # fmt: skip
    elif r.slots[r.rank].data_ptr() != scatter_to[r.rank].data_ptr():
        why = "scatter_to[rank] must be slots[rank]"
    elif not (r.counters.dtype == r.arrived.dtype == r.err.dtype == torch.int32 and r.arrive_to.dtype == torch.int64):
        why = "counters, arrived and err must be int32, arrive_to int64"
    elif min(r.counters.numel(), r.arrived.numel(), r.arrive_to.numel()) < num_chunks or r.err.numel() < 6:
        why = f"counters, arrived and arrive_to need num_chunks ({num_chunks}) elements, err 6"
    if why is not None:
        raise ValueError(f"persistent_matmul: reduce: {why}")


def _tma_ok(A, Bs, scatter_to, mode) -> bool:
    """The TMA kernel serves one B, 16-byte aligned rows (FP8: K-major B), any scatter_to."""
    if len(Bs) != 1 or mode == MODE_PRODUCER or A.dtype == torch.float32:
        return False
    B = Bs[0]
    es = A.element_size()
    a0, a1 = A.stride()
    b0, b1 = B.stride()
    if es == 1 and b0 != 1:
        return False
    if a1 != 1 or (a0 * es) % 16 or A.data_ptr() % 16:
        return False
    if b1 == 1:
        return (b0 * es) % 16 == 0 and B.data_ptr() % 16 == 0
    return b0 == 1 and (b1 * es) % 16 == 0 and B.data_ptr() % 16 == 0


# Kernel families: "pointer" (any call), "tma" / "tma_flat" (one B, plain or consumer; the
# second flattens the tile and K loops of a chunk so loads run ahead across tiles).
KERNELS = ("auto", "pointer", "tma", "tma_flat")
# What "auto" picks where the TMA kernel is eligible, per dtype class; measured on the H200
# (bench/NOTES.md, providers mptp_pointer / mptp_tma / mptp_tma_flat of persistent_matmul.csv).
# USE_TMA = False turns "auto" into "pointer" everywhere (also done after a TMA failure).
AUTO_KERNEL = {"16bit": "tma", "fp8": "tma"}
USE_TMA = True


@dataclass(frozen=True)
class Config:
    BLOCK_M: int
    BLOCK_N: int
    BLOCK_K: int
    GROUP_M: int
    num_warps: int
    num_stages: int


def persistent_matmul_configs() -> dict:
    """Frozen configs per (dtype class, shape class), tuned on the H200 with flags pre-set.

    NOTE: a kernel that waits on flags is never autotuned live (it would spin on
    flags nobody sets); `python bench/bench_persistent_matmul.py --tune [--kernel K] [--Ns ...]` regenerates this table (sweeps in bench/results/tune_*.txt).
    """
    return _CONFIGS


_CONFIGS = {
    # dtype class -> N class -> config; from bench/results/tune_persistent_matmul_h200.txt
    # (M = 8192, Llama-3 TP-8 shapes, H200, Triton 3.6).
    "16bit": {
        "large": Config(128, 256, 64, 8, 8, 3),
        "small_n": Config(128, 128, 64, 8, 4, 4),
        "tiny_n": Config(128, 128, 64, 8, 4, 4),
    },
    "fp8": {
        "large": Config(128, 256, 128, 8, 8, 3),
        "small_n": Config(128, 128, 128, 8, 8, 4),
        "tiny_n": Config(128, 128, 128, 8, 8, 4),  # TMA sweep, 2026-12-02 (tune_tma_flat_h200.txt)
    },
    "fp32": {k: Config(64, 64, 32, 8, 4, 2) for k in ("large", "small_n", "tiny_n")},
    # Small blocks for CPU interpreter runs and tiny problems.
    "tiny": {"any": Config(32, 32, 32, 4, 4, 2)},
}


def pick_config(dtype: torch.dtype, M: int, Ns: Sequence[int], K: int) -> Config:
    return _pick_config(dtype, M, max(Ns), K)


@functools.lru_cache(maxsize=4096)
def _pick_config(dtype: torch.dtype, M: int, n: int, K: int) -> Config:
    if M * n <= 256 * 256 or _interpreting():
        return _CONFIGS["tiny"]["any"]
    if dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        cls = "fp8"
    elif dtype == torch.float32:
        cls = "fp32"
    else:
        cls = "16bit"
    return _CONFIGS[cls]["tiny_n" if n <= 1024 else ("small_n" if n <= 2048 else "large")]


@functools.lru_cache(maxsize=None)
def _num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def sm_count(device: torch.device) -> int:
    """The SM count of a CUDA device (cached)."""
    return _num_sms(device.index if device.index is not None else torch.cuda.current_device())


_interpreting = epilogue.interpreting


def _flat(t: torch.Tensor) -> torch.Tensor:
    """A scale or bias as the kernels read it: 1-D and contiguous (they index base + i).
    NOTE: a strided one (a column of a table, an expanded scalar) is copied; read in place, its
    stride would be ignored (a wrong result, or reads past the end of an expanded one)."""
    t = t if t.dim() == 1 else t.reshape(-1)
    return t if t.is_contiguous() else t.contiguous()


def _b_needs_mask(B: torch.Tensor) -> bool:
    """Whether a hinted 16-byte vector of B's last row could end past B's storage: only where N
    is not a multiple of 16, rows are contiguous and 16-byte aligned (else no vector loads), and
    the storage ends within 16 elements of the last row's N-th (masking costs vector loads:
    7.5x on an H100 for a 4088-column view, measured by review)."""
    N = B.shape[1]
    if N % 16 == 0 or B.stride(1) != 1 or B.shape[0] == 0:
        return False
    es = B.element_size()
    if (B.stride(0) * es) % 16 or B.data_ptr() % 16:
        return False
    end = B.storage_offset() + (B.shape[0] - 1) * B.stride(0) + _cdiv(N, 16) * 16
    return end * es > B.untyped_storage().nbytes()


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)  # NOTE: triton.cdiv is a constexpr_function in Triton 3.8: microseconds per host call


_DUMMY = {}
_ORDERS = {}
_ERR = {}


def _constant(cache, key, device, make):
    """A small device tensor that launches read (a chunk order, a zeroed error record), made once
    per key and kept. NOTE: it is made on the current stream, which is then synchronized once: a
    launch on another stream must never read it before it is written (a stream behind a long
    kernel would make it late). Under CUDA-graph capture it is made per call and not kept: the
    graph fills it only when replayed, and an eager launch before the first replay would read
    unwritten memory."""
    t = cache.get(key)
    if t is None:
        d = torch.device(device)
        if d.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return make()
        t = make()
        if d.type == "cuda":
            torch.cuda.current_stream(d).synchronize()
        cache[key] = t
    return t


def _identity_order(device, n):
    order = _ORDERS.get((device, n))  # hot path
    if order is None:
        order = _constant(_ORDERS, (device, n), device, lambda: torch.arange(n, device=device, dtype=torch.int32))
    return order


def _dummy(device, dtype=torch.float32):
    """A small zeroed tensor for pointer arguments a launch does not use (never written)."""
    key = (device, dtype)
    d = _DUMMY.get(key)
    if d is None:
        d = _DUMMY[key] = torch.zeros(4, device=device, dtype=dtype)
    return d


def default_error_record(device) -> torch.Tensor:
    """The zeroed int32[6] error record (csrc/symm/symm.h ErrorRecord) used when no `err` is given.

    Once a consumer wait has timed out on it, every later consumer call without `err`
    on that device is poisoned (NaN) until it is zeroed again, as the process's record is.
    """
    err = _ERR.get(device)  # hot path: a tensor's device
    if err is None:
        d = torch.device(device)
        if d.type == "cuda" and d.index is None:
            d = torch.device("cuda", torch.cuda.current_device())
        err = _constant(_ERR, d, d, lambda: torch.zeros(6, device=d, dtype=torch.int32))
    return err


def _poisoned(outs: List[torch.Tensor], mode: int, err: torch.Tensor, poison: bool = True) -> List[torch.Tensor]:
    """Consumer mode: every output becomes NaN if err[0] is set once the launch is done (a wait
    of this launch or an earlier one of the process timed out). poison=False: the caller does it."""
    if mode == MODE_CONSUMER and poison:
        for o in outs:
            poison_if_error(o, err)
    return outs


def persistent_matmul(
    A: torch.Tensor,
    Bs: Sequence[torch.Tensor],
    *,
    outs: Optional[List[torch.Tensor]] = None,
    out_dtype: Optional[torch.dtype] = None,
    A_scale: Optional[torch.Tensor] = None,
    B_scales: Optional[Sequence[torch.Tensor]] = None,
    biases: Optional[Sequence[Optional[torch.Tensor]]] = None,
    fast_accum: bool = True,
    num_chunks: int = 1,
    order: Optional[torch.Tensor] = None,
    flags: Optional[torch.Tensor] = None,
    counters: Optional[torch.Tensor] = None,
    epoch: int = 1,
    mode: int = MODE_PLAIN,
    timeout_s: float = 60.0,
    err: Optional[torch.Tensor] = None,
    config: Optional[Config] = None,
    num_sms: Optional[int] = None,
    scatter_to: Optional[Sequence[torch.Tensor]] = None,
    kernel: str = "auto",
    result_scale: Optional[torch.Tensor] = None,
    tag: int = -1,
    poison: bool = True,
    guard: bool = False,
    stream_k=None,
    reduce: Optional[Reduce] = None,
) -> List[torch.Tensor]:
    """C_i = A @ B_i (scaled, biased) with a persistent grid; returns [C_i].

    Args:
        A: [M, K], row-major (stride(1) == 1 or any strides), bf16/fp16/fp32/fp8.
        Bs: each [K, N_i], same dtype as A, any strides (FP8: column-major).
        outs: optional preallocated [M, N_i] contiguous outputs.
        out_dtype: output dtype (default A's dtype; FP8 inputs default to bf16); bf16, fp16,
            fp32, float8_e4m3fn or float8_e5m2. FP8 outputs are rounded (and saturated or
            overflowed) as torch._scaled_mm does on the same device (epilogue.py).
        A_scale: FP8 only; one element or [M] / [M, 1] float32 (row-wise).
        B_scales: FP8 only; per B one element or [N_i] / [1, N_i] float32.
        biases: per B None or [N_i].
        num_chunks, order, flags, counters, epoch, mode: see the module docstring.
        err: int32 [6] error record (csrc/symm/symm.h ErrorRecord). A consumer wait that times
            out fills it (failed, channel=-1, peer=chunk, expected=epoch, seen, tag); after the
            launch every output is overwritten with NaN if err[0] is nonzero (stream-ordered,
            one read of the record per output). Default: default_error_record(device). Unused
            in the other modes.
        scatter_to: up to 8 tensors, one per chunk; chunk c's [M // num_chunks, N]
            rows are stored to scatter_to[c] (contiguous) instead of outs (one B only).
        kernel: one of KERNELS; "auto" follows AUTO_KERNEL, the others are forced
            (a forced TMA kernel raises where it is not eligible).
        result_scale: one-element float32, torch._scaled_mm's scale_result: applied to FP8
            outputs only (ignored for the others, as torch does), to every B of the call.
        tag: the op's tag (mptp_kernels.symm.register_tag) a timed-out consumer wait records.
        poison: consumer mode: False leaves the NaN overwrite on error to the caller (the fused ops
            do it for every output of a call in one launch, symm.primitives.finish).
        guard: store nothing if err[0] is set when the launch starts (the outputs are another
            rank's symmetric buffers: after a timed-out wait this rank writes none; fail-stop).
            Not in consumer mode (err is its waits' record there); pass the device's fail latch
            (symm.primitives.fail_latch, device memory: a host-mapped record's reads, one per
            warp, queue over PCIe, ~1 ms per launch measured on an H100).
        stream_k: TMA kernels only. None: as STREAM_K says, with the default config or
            SK_CONFIG's, where whole tiles would leave SMs idle in the last wave (an FP8 consumer:
            whole tiles of the default config, unless SK_FP8_CONSUMER); False: never;
            "split" / "stream": as None with that mode (and this call's config where one is given);
            True: with this call's config, STREAM_K's mode (default "split"); an int n > 0:
            stream-K over the last n tiles (0: none); ("split", R, s): the last R tiles in s K
            ranges, R * s at most the programs (tests). The pointer kernel ignores it, and so does
            a call with reduce (whole tiles); a scatter's None follows SK_SCATTER.
        reduce: with scatter_to (order: this rank's chunk last), matmul-reduce-scatter's sum in the
            matmul (Reduce; the TMA kernel's PRODUCE 2). Needs the TMA kernel (reduce_eligible):
            a call it cannot serve raises ValueError. Returns [reduce.out].
    """
    global USE_TMA
    memo = None
    if MEMO is None:
        _memo_setting()
    if (MEMO and kernel != "pointer" and reduce is None and len(Bs) == 1 and (outs is None or len(outs) == 1)
            and (scatter_to is None or (outs is None and 1 <= len(scatter_to) <= 8)) and _memo_device(A)):  # fmt: skip
        # NOTE: a scatter's destinations are part of the key (their addresses are bound in the entry);
        # its first one stands for the output, as in the full path.
        m_outs = outs if scatter_to is None else [scatter_to[0]]
        memo = _memo_key(A, Bs[0], m_outs, out_dtype, A_scale, B_scales, biases, fast_accum, num_chunks, order,
                         flags, epoch, mode, timeout_s, err, config, num_sms, kernel, result_scale, tag, poison,
                         guard, stream_k, scatter_to)  # fmt: skip
        if memo is not None:
            try:
                hit = _MEMO.get(memo)
            except TypeError:  # an unhashable argument: the full path says what is wrong with it
                hit = memo = None
            if hit is not None:
                done = _memo_launch(hit, A, Bs[0], m_outs, err)
                if done is not None:
                    return done
    assert A.dim() == 2 and 1 <= len(Bs)
    M, K = A.shape
    assert M % num_chunks == 0, "M must be a multiple of num_chunks"
    dev = A.device
    fp8 = A.dtype in (torch.float8_e4m3fn, torch.float8_e5m2)
    if out_dtype is None:
        out_dtype = torch.bfloat16 if fp8 else A.dtype
    Ns = [B.shape[1] for B in Bs]
    for B in Bs:
        assert B.dim() == 2 and B.shape[0] == K and B.dtype == A.dtype and B.device == dev
    if scatter_to is not None:
        _check_scatter(scatter_to, Bs, num_chunks, M, A.device)
        outs = [scatter_to[0]]
        if reduce is not None or (stream_k is None and not SK_SCATTER):
            stream_k = False  # the in-matmul sum: whole tiles (each own tile summed by its program)
    if reduce is not None:
        if scatter_to is None or mode != MODE_PLAIN or not 0 <= reduce.rank < num_chunks:
            raise ValueError("persistent_matmul: reduce needs scatter_to, the plain mode and 0 <= rank < num_chunks")
        if not _tma_ok(A, Bs, None, MODE_PLAIN) or kernel not in ("auto", "tma"):
            raise ValueError("persistent_matmul: reduce needs the TMA kernel: one B, 16-byte aligned rows "
                             "(FP8: K-major B), kernel 'auto' or 'tma'")  # fmt: skip
        _check_reduce(reduce, scatter_to, num_chunks, M, Bs[0].shape[1])
        kernel = "tma"
    outs_given = outs is not None
    if outs is None:
        outs = [torch.empty(M, n, device=dev, dtype=out_dtype) for n in Ns]
    out_dtype = outs[0].dtype  # preallocated outputs decide (all of one dtype)
    cfg = config or pick_config(A.dtype, M, Ns, K)
    sms = num_sms or (_num_sms(dev.index or 0) if dev.type == "cuda" else 4)
    order_default, err_default = order is None, err is None
    if order is None:
        order = _identity_order(dev, num_chunks)
    dummy_i, dummy_f = _dummy(dev, torch.int32), _dummy(dev)
    flags = flags if flags is not None else dummy_i
    counters = counters if counters is not None else dummy_i
    assert not (guard and mode == MODE_CONSUMER), "guard: not in consumer mode"
    if err is None:
        err = default_error_record(dev)
    else:
        assert err.dtype == torch.int32 and err.numel() >= 6, "err must be an int32[6] error record"
    if result_scale is not None:
        assert result_scale.numel() == 1 and result_scale.dtype == torch.float32, "result_scale: one float32"
        result_scale = result_scale.reshape(1)
    # NOTE: per call, not cached: epilogue.SCALED_MM_FP8_OUT may be changed between calls.
    fp8_out = epilogue.fp8_out_constexprs(dev, out_dtype, result_scale is not None)
    a_mode = 0 if A_scale is None else (1 if A_scale.numel() == 1 else 2)
    b_mode = 0
    if B_scales is not None:
        b_mode = 1 if all(s.numel() == 1 for s in B_scales) else 2
        assert all((s.numel() == 1) == (b_mode == 1) for s in B_scales), "mixed B scale modes"
    has_bias = biases is not None and any(b is not None for b in biases)
    if has_bias:
        assert all(b is not None for b in biases), "all or none of the Bs have a bias"
    precision = "ieee" if A.dtype == torch.float32 else "tf32"
    if stream_k is not None and not (
        (type(stream_k) in (bool, int) and stream_k >= 0)
        or (type(stream_k) is str and stream_k in ("split", "stream"))
        or (type(stream_k) is tuple and len(stream_k) == 3 and stream_k[0] == "split"
            and type(stream_k[1]) is int and type(stream_k[2]) is int and stream_k[1] >= 0 and stream_k[2] >= 1)
    ):  # fmt: skip
        raise ValueError(f"persistent_matmul: stream_k must be None, a bool, 'split', 'stream', an int >= 0 or "
                         f"('split', R, s), got {stream_k!r}")  # fmt: skip
    if kernel not in KERNELS:
        raise ValueError(f"persistent_matmul: kernel must be one of {KERNELS}, got {kernel!r}")
    auto = kernel == "auto"
    if auto:
        use_tma = USE_TMA and A.is_cuda and not _interpreting() and _tma_ok(A, Bs, scatter_to, mode)
        kernel = AUTO_KERNEL["fp8" if fp8 else "16bit"] if use_tma else "pointer"
    elif kernel != "pointer" and not _tma_ok(A, Bs, scatter_to, mode):
        raise ValueError(f"persistent_matmul: kernel={kernel!r} needs one B, no producer mode, "
                         "16-bit or FP8 (K-major B) inputs with 16-byte aligned rows")  # fmt: skip
    if kernel != "pointer":
        sk_config = None
        if (stream_k is None or type(stream_k) is str) and config is None and not _interpreting():
            sk_config = SK_CONFIG.get("fp8" if fp8 else "16bit")
            if stream_k is None and fp8 and mode == MODE_CONSUMER and not SK_FP8_CONSUMER:
                sk_config = None  # whole tiles of the default config (see SK_FP8_CONSUMER)
        args = (A, Bs[0], outs[0], cfg, sms, num_chunks, order, flags, epoch, mode, timeout_s, err, A_scale,
                B_scales, biases if has_bias else None, a_mode, b_mode, fast_accum, kernel == "tma_flat",
                result_scale if result_scale is not None else dummy_f, tag, fp8_out, guard, stream_k, sk_config)
        if memo is not None:  # what a later call of this key needs besides the key's own tensors
            # NOTE: the defaults made here (order, err, dummies) are held by the entry: the
            # addresses it keeps stay theirs even if a cache of them is ever dropped. The
            # caller's own tensors are not (their addresses are in the key).
            memo = (memo, outs_given, out_dtype, mode == MODE_CONSUMER and poison, err if err_default else None,
                    (order if order_default else None, dummy_i, dummy_f))  # fmt: skip
        if not auto or reduce is not None:  # (the pointer kernel cannot reduce: no fallback)
            return _poisoned(_launch_tma(*args, scatter_to=scatter_to, reduce=reduce, memo=memo), mode, err, poison)
        # NOTE: the poison check stays outside the try: its failure must not disable TMA, nor
        # launch the consumer a second time.
        try:
            launched = _launch_tma(*args, scatter_to=scatter_to, reduce=reduce, memo=memo)
        except Exception as e:  # noqa: BLE001 - e.g. a Triton without tensor descriptors
            USE_TMA = False
            from .. import env

            env.log_once(("tma", type(e).__name__), "persistent_matmul: TMA kernel unavailable (%s); "
                         "using the pointer kernel", e)  # fmt: skip
        else:
            return _poisoned(launched, mode, err, poison)
    results = []
    for g in range(0, len(Bs), MAX_B):
        gB, gC = list(Bs[g : g + MAX_B]), list(outs[g : g + MAX_B])
        gS = list(B_scales[g : g + MAX_B]) if B_scales is not None else []
        gBias = [_flat(b) for b in biases[g : g + MAX_B]] if has_bias else []
        nb = len(gB)
        pad = lambda lst, fill: lst + [fill] * (MAX_B - len(lst))  # noqa: E731
        Bp, Cp = pad(gB, gB[0]), pad(gC, gC[0])
        Np = pad([b.shape[1] for b in gB], 0)
        Sp = pad([_flat(s) for s in gS], dummy_f) if gS else [dummy_f] * MAX_B
        biasp = pad(gBias, gBias[0]) if gBias else [dummy_f] * MAX_B
        tiles = num_chunks * _cdiv(M // num_chunks, cfg.BLOCK_M) * sum(_cdiv(n, cfg.BLOCK_N) for n in Np[:nb])
        grid = (max(1, min(sms, tiles)),)
        args = [
            A, *Bp, *Cp, *biasp, *Sp,
            _flat(A_scale) if A_scale is not None else dummy_f,
            result_scale if result_scale is not None else dummy_f,
            *(list(scatter_to) + [scatter_to[0]] * (8 - len(scatter_to)) if scatter_to is not None
              else [gC[0]] * 8),
            *Np,
            Bp[0].stride(0), Bp[0].stride(1), Bp[1].stride(0), Bp[1].stride(1),
            Bp[2].stride(0), Bp[2].stride(1),
            M, K, A.stride(0), A.stride(1),
            order, flags, counters, epoch, int(timeout_s * 1e9), err, tag,
        ]  # fmt: skip
        constexprs = dict(
            NUM_CHUNKS=num_chunks, NUM_B=nb, MODE=mode, HAS_BIAS=has_bias,
            A_SCALE_MODE=a_mode, B_SCALE_MODE=b_mode, **fp8_out, FAST_ACCUM=fast_accum,
            INPUT_PRECISION=precision, SCATTER=scatter_to is not None, EVEN_N=all(n % 16 == 0 for n in Np[:nb]),
            MASK_B=any(_b_needs_mask(b) for b in gB),
            GUARD=guard,
            BLOCK_M=cfg.BLOCK_M, BLOCK_N=cfg.BLOCK_N, BLOCK_K=cfg.BLOCK_K, GROUP_M=cfg.GROUP_M,
            NUM_SMS=grid[0],
        )  # fmt: skip
        launch(_persistent_matmul_kernel, grid, args, constexprs, num_warps=cfg.num_warps, num_stages=cfg.num_stages)
        results += gC
    return _poisoned(results, mode, err, poison)


TensorDescriptor = None


# Splitting tiles by K (the TMA kernel's SK_MODE), where whole tiles would leave SMs idle in the
# last wave. "split" (SK_MODE 2): the R tiles of the last, partial wave are each split into s
# equal K ranges (s = SMS // R), so the last wave takes 1 / s of a tile's time, with every split
# tile's units at the same K offsets (the A rows and B columns they share are read from L2 at
# about the same time, as whole tiles are). "stream" (SK_MODE 1): stream-K, every program an
# equal share of the last waves' K iterations.
# STREAM_K: what "auto" does (None: whole tiles of the default config, always). The candidates
# are the call's default config and SK_CONFIG (large tiles, faster per SM: SK_TILE_EFF is the
# default small tiles' speed relative to them), each with whole tiles and with the split,
# whichever is estimated fastest (see _sk_plan).
# NOTE: history. The first estimate (no split cost, SK_TILE_EFF 0.87) chose splits that lost
# 2-15% at N = 768 (bench/results/h100_persistent_matmul_split_3e4d5fb.*), so the split was off by
# default; recalibrated on the diagnosis of cf165a0 (SK_SPLIT_COST), it is "split" again.
# "stream" is slower everywhere measured (up to 1.45x).
STREAM_K = "split"
# The TMA store of whole tiles (_launch_tma): configs with BLOCK_N >= this; None (the default):
# never. Off: on the H100 a stand-alone kernel gained 1-7% from it with 128 x 256 tiles (and lost
# with 128 x 128), but this kernel with it on for 128 x 256 tiles measured level with the masked
# store, same run (bench/NOTES.md item 23). Kept, tested, for other GPUs and Tritons to measure.
TMA_STORE_BLOCK_N = None
SK_CONFIG = {"16bit": Config(128, 256, 64, 8, 8, 3), "fp8": Config(128, 256, 128, 8, 8, 3)}
# Calibrated on an H100 (bench/diag_stream_k.py, bf16, M 4096 / 8192, N 768 / 1280, graph timing,
# bench/results/h100_diag_stream_k_cf165a0.txt): a 128 x 128 tile wave takes 0.62 of a 128 x 256
# one (30.7 against 49.6 us at K = 4096): SK_TILE_EFF 0.81; a split last wave took 18-28 us more
# than 1 / s of a wave (0.32-0.38 of one): SK_SPLIT_COST.
SK_TILE_EFF = 0.81
SK_SPLIT_COST = 0.35
SK_MIN_GAIN = 0.03
SK_MAX_SPLIT = 8
# "auto" for an FP8 consumer (MODE_CONSUMER): False takes whole tiles of the default config, no
# plan. Measured on an H100 (W = 8 loopback, M = 8192, from CUDA graphs, both in one run of
# bench/check_cost_model.py --plans, bench/results/h100_cost_model_plans_9134f4e.txt): the plan's large
# whole tiles made the FP8 row-wise consumer 19% slower at N = 1280 and 34% at N = 768 (242 ->
# 288 us, 114 -> 153 us), 4% at N = 4096, and gained nowhere (within 1% on the other three
# shapes); the bf16 consumer gained with it (N = 1280: 448 -> 349 us). NOTE: measured with FP8
# row-wise scales on a GPU its ranks share (8 SMs left to the copies) only; it applies to every
# FP8 consumer (tensor-wise too, and between GPUs), where nothing else was measured.
SK_FP8_CONSUMER = False
# "auto" for a scatter (the reduce-scatter's producer, PRODUCE 1): True weighs the launch plan (large
# tiles, a split last wave) as for a plain call; False takes whole tiles of the default config.
SK_SCATTER = True
# "auto" splits only calls of at least this many FLOPs (~15 us of H200 tensor-core time): below it
# the split's few microseconds of fixed cost (tickets, pieces, the wait) are not worth a wave.
SK_MIN_FLOPS = 1e10
_SK_BUFS = {}


def stream_k_tiles(tiles: int, sms: int, k_tiles: int) -> int:
    """Stream-K: tiles to split (the last wave and one whole wave before it, so no share is a
    sliver), or 0 where whole-tile waves fill at least 90% of the SMs' time."""
    if tiles <= 0 or sms <= 1 or k_tiles < 2:
        return 0
    waves = -(-tiles // sms)
    if tiles >= 0.9 * waves * sms:
        return 0
    return tiles - max(tiles // sms - 1, 0) * sms


def split_tail(tiles: int, sms: int, k_tiles: int):
    """(R, s): the last R tiles split into s K ranges each (R * s <= sms), or (0, 1)."""
    r = tiles % sms
    if r == 0 or sms <= 1:
        return 0, 1
    s = min(sms // r, k_tiles, SK_MAX_SPLIT)
    return (r, s) if s > 1 else (0, 1)


def _waves(tiles: int, sms: int, k_tiles: int, mode: str) -> float:
    """Tile times a launch takes with this mode's split (whole waves, plus the split last one)."""
    if mode == "split":
        r, s = split_tail(tiles, sms, k_tiles)
        if r:
            return tiles // sms + 1.0 / s
    elif mode == "stream" and stream_k_tiles(tiles, sms, k_tiles):
        return tiles / sms
    return float(-(-tiles // sms))


def _sk_plan(M, N, K, num_chunks, sms, cfg, sk_config, stream_k):
    """(config, SK_MODE, sk_tiles, splits) for a TMA launch."""
    def tiles_of(c):
        return num_chunks * _cdiv(M // num_chunks, c.BLOCK_M) * _cdiv(N, c.BLOCK_N)

    if stream_k is None or type(stream_k) is str:
        mode = STREAM_K if stream_k is None else stream_k
        if mode is None or (stream_k is None and (sk_config is None or 2.0 * M * N * K < SK_MIN_FLOPS)):
            return cfg, 0, 0, 1
        # NOTE: the default config and the large-tile one, each with whole tiles and split:
        # whichever is estimated fastest, where it gains at least SK_MIN_GAIN over the default
        # config's whole tiles (in large-tile times: a default tile takes SK_TILE_EFF of its
        # area's share; a split last wave costs SK_SPLIT_COST of a wave on top of its 1 / s).
        def est(c, m):
            t, kt = tiles_of(c), _cdiv(K, c.BLOCK_K)
            w = _waves(t, sms, kt, m) if m else float(-(-t // sms))
            if m and w != -(-t // sms):
                w += SK_SPLIT_COST
            return w * c.BLOCK_M * c.BLOCK_N / (1.0 if c == sk_config else SK_TILE_EFF)

        base = est(cfg, None)
        best = (base, cfg, None)
        for c in (cfg, sk_config) if sk_config is not None and sk_config != cfg else (cfg,):
            for m in (None, mode):
                e = est(c, m)
                if e < best[0]:
                    best = (e, c, m)
        if best[0] > base * (1.0 - SK_MIN_GAIN):
            return cfg, 0, 0, 1
        cfg = best[1]
        if best[2] is None:
            return cfg, 0, 0, 1
    elif stream_k is False or stream_k == 0:
        return cfg, 0, 0, 1
    elif type(stream_k) is tuple:  # ("split", R, s): tests
        _, r, s = stream_k
        r = min(r, tiles_of(cfg))
        if r * s > sms:
            raise ValueError(f"persistent_matmul: stream_k={stream_k!r}: R * s = {r * s} units for {sms} programs")
        return cfg, (2 if r else 0), r, s
    elif stream_k is True:
        mode = STREAM_K or "split"
    else:  # an int: stream-K over the last stream_k tiles (tests)
        n = min(stream_k, tiles_of(cfg))
        if (n * _cdiv(K, cfg.BLOCK_K) + 1) * sms >= 2**31:  # the kernel's share arithmetic is int32
            raise ValueError(f"persistent_matmul: stream_k={stream_k}: too many K iterations to split")
        return cfg, 1, n, 1
    t, kt = tiles_of(cfg), _cdiv(K, cfg.BLOCK_K)
    if mode == "split":
        r, s = split_tail(t, sms, kt)
        return cfg, (2 if r else 0), r, s
    n = stream_k_tiles(t, sms, kt)
    if (n * kt + 1) * sms >= 2**31:
        n = 0
    return cfg, (1 if n else 0), n, 1


def _sk_buffers(dev, sms, cfg):
    """(pieces, sync) for a stream-K launch: fp32 [sms, BLOCK_M * BLOCK_N] pieces and the int32
    [2 + sms] tickets / finish count / flags, zero between launches (the kernel's last program
    resets them). NOTE: one pair per stream (launches on a stream run one after another); a
    launch captured into a CUDA graph gets its own, zeroed by the graph itself, so a replay
    shares nothing with eager launches or other graphs."""
    n = sms * cfg.BLOCK_M * cfg.BLOCK_N
    if dev.type != "cuda" or torch.cuda.is_current_stream_capturing():  # the interpreter, or a capture
        return torch.empty(n, device=dev, dtype=torch.float32), torch.zeros(2 + sms, device=dev, dtype=torch.int32)
    # NOTE: the stream launch() launches on (the current device's); the cache is bounded (a freed
    # pair goes back to the caching allocator on its own stream: stream-ordered, safe).
    key = (dev, torch._C._cuda_getCurrentRawStream(torch.cuda.current_device()))
    bufs = _SK_BUFS.get(key)
    if bufs is None or bufs[0].numel() < n or bufs[1].numel() < 2 + sms:
        if bufs is None and len(_SK_BUFS) >= 16:
            _SK_BUFS.clear()
        bufs = _SK_BUFS[key] = (torch.empty(n, device=dev, dtype=torch.float32),
                                torch.zeros(2 + sms, device=dev, dtype=torch.int32))  # fmt: skip
    return bufs


_DESCS = {}


def _template(t, b0, b1, transposed):
    """The fields of TensorDescriptor.from_tensor(t.t() if transposed else t, [b0, b1]) with no
    base, per shape, strides, dtype and block: its checks (shape, 16-byte strides, block) run
    once, when it is made; the base's 16-byte alignment is _tma_ok's. NOTE: a template holds no
    tensor (a cached A_full would keep its memory from the next call's)."""
    key = (t.shape, t.stride(), t.dtype, b0, b1, transposed)
    tpl = _DESCS.get(key)
    if tpl is None:  # NOTE: returned as made, not looked up again (another thread may clear _DESCS)
        tpl = dict(TensorDescriptor.from_tensor(t.t() if transposed else t, [b0, b1]).__dict__)
        tpl["base"] = None
        if len(_DESCS) >= 256:
            _DESCS.clear()
        _DESCS[key] = tpl
    return tpl


def _clone(tpl, base):
    """A descriptor with a template's fields over base."""
    d = _new(TensorDescriptor)
    d.__dict__.update(tpl)
    d.base = base
    return d


def _descriptor(t, b0, b1, transposed):
    """TensorDescriptor.from_tensor(t.t() if transposed else t, [b0, b1]), from its template."""
    return _clone(_template(t, b0, b1, transposed), t.t() if transposed else t)


_new = object.__new__


def _launch_tma(A, B, C, cfg, sms, num_chunks, order, flags, epoch, mode, timeout_s, err, A_scale, B_scales,
                biases, a_mode, b_mode, fast_accum, flatten, result_scale, tag, fp8_out, guard=False,
                stream_k=None, sk_config=None, scatter_to=None, reduce=None, memo=None):
    """stream_k: see persistent_matmul; sk_config: the large-tile candidate of "auto"; memo: the
    launch memo's key and what its entry keeps (persistent_matmul), or None: not recorded."""
    global TensorDescriptor, TMA_PROVEN
    if TensorDescriptor is None:  # imported at the first TMA launch (a Triton without it raises here)
        from triton.tools.tensor_descriptor import TensorDescriptor
    M, K = A.shape
    N = B.shape[1]
    kmajor = B.stride(1) != 1
    has_bias = biases is not None
    produce = 0 if scatter_to is None else (1 if reduce is None else 2)
    # Whether C can take the TMA store at all: one dense [M, N] output of 1 or 2 bytes per element
    # (a wider one's staging tile takes the shared memory of the loads), 16-byte aligned rows.
    c_ok = (produce == 0 and TMA_STORE_BLOCK_N is not None and C.dim() == 2 and C.element_size() <= 2
            and C.is_contiguous()
            and (N * C.element_size()) % 16 == 0 and C.data_ptr() % 16 == 0)  # fmt: skip
    # The launch plan: everything but the addresses, from the shapes and options only (their
    # complete list: the key). NOTE: the module's STREAM_K, SK_* and TMA_STORE_* values are part of it.
    # NOTE: stream_k by its repr: True (the split) and 1 (stream-K over one tile) are == in Python.
    key = (M, N, K, A.dtype, num_chunks, sms, cfg, sk_config, None if stream_k is None else repr(stream_k), mode,
           produce, a_mode, b_mode, has_bias,
           fast_accum, flatten, kmajor, guard, fp8_out["RS_MODE"], fp8_out["E5M2_INF"], fp8_out["SOFT_FP8"],
           _sk_settings(), c_ok, TMA_STORE_BLOCK_N)  # fmt: skip
    plan = _TMA_PLANS.get(key)
    if plan is None:
        c, sk_mode, sk_tiles, splits = _sk_plan(M, N, K, num_chunks, sms, cfg, sk_config, stream_k)
        if sk_mode:
            grid = (sms,)  # every program takes a share (a unit) of the split tiles
        else:
            tiles = num_chunks * _cdiv(M // num_chunks, c.BLOCK_M) * _cdiv(N, c.BLOCK_N)
            grid = (max(1, min(sms, tiles)),)
        # The TMA store (TMA_STORE_BLOCK_N): every whole tile must lie within its chunk's rows
        # (the descriptor clips at C's edges only: a tile crossing into the next chunk would
        # overwrite that chunk's rows, maybe before they arrived).
        tma_store = (c_ok and c.BLOCK_N >= TMA_STORE_BLOCK_N
                     and (num_chunks == 1 or (M // num_chunks) % c.BLOCK_M == 0))  # fmt: skip
        constexprs = dict(
            NUM_CHUNKS=num_chunks, MODE=mode, PRODUCE=produce, HAS_BIAS=has_bias, A_SCALE_MODE=a_mode,
            B_SCALE_MODE=b_mode, **fp8_out, FAST_ACCUM=fast_accum, B_KMAJOR=kmajor, FLATTEN=flatten, GUARD=guard,
            SK_MODE=sk_mode, SUB_M=min(c.BLOCK_M, 32), BLOCK_M=c.BLOCK_M, BLOCK_N=c.BLOCK_N, BLOCK_K=c.BLOCK_K,
            GROUP_M=c.GROUP_M, NUM_SMS=grid[0], TMA_STORE=tma_store,
        )  # fmt: skip
        options = dict(num_warps=c.num_warps, num_stages=c.num_stages)
        bdesc = (c.BLOCK_N, c.BLOCK_K, True) if kmajor else (c.BLOCK_K, c.BLOCK_N, False)
        cdesc = (c.BLOCK_M, c.BLOCK_N, False) if tma_store else None
        plan = (c, sk_mode, sk_tiles, splits, grid, constexprs, options, (c.BLOCK_M, c.BLOCK_K, False), bdesc, cdesc)
        if len(_TMA_PLANS) >= 1024:
            _TMA_PLANS.clear()
        _TMA_PLANS[key] = plan
    c, sk_mode, sk_tiles, splits, grid, constexprs, options, adesc, bdesc, cdesc = plan
    dev = A.device
    if sk_mode:
        pieces, sync = _sk_buffers(dev, sms, c)
    else:
        pieces = sync = _dummy(dev, torch.int32)
    dummy = None if A_scale is not None and B_scales is not None and has_bias else _dummy(dev)
    args = [
        _descriptor(A, *adesc), _descriptor(B, *bdesc), C,
        _flat(A_scale) if A_scale is not None else dummy,
        _flat(B_scales[0]) if B_scales is not None else dummy,
        _flat(biases[0]) if has_bias else dummy,
        result_scale,
        M, N, K, order, flags, epoch, int(timeout_s * 1e9), err, tag, sk_tiles, splits,
        int(2 * timeout_s * 1e9) + 1_000_000_000, pieces, sync,
    ]  # fmt: skip
    if scatter_to is None:
        args += _unused_tail(dev, 8)
    else:
        args += list(scatter_to) + [scatter_to[0]] * (8 - len(scatter_to))
    if reduce is None:
        args += _unused_tail(dev, 0)
    else:  # (checked by persistent_matmul: _check_reduce)
        r = reduce
        args += [r.slots, r.out, r.counters, r.arrive_to, r.arrived, int(r.rank), float(r.scale), r.err]
    args.append(_descriptor(C, *cdesc) if cdesc is not None else 0)  # c_desc (the last argument)
    done = launch_static(_persistent_matmul_tma_kernel, grid, args, constexprs, options, key)
    TMA_PROVEN = True
    if memo is not None and done is not None:
        try:
            _memo_record(memo, done, adesc, bdesc, cdesc, sk_mode, sms, c, M, N, A, B, C)
        except Exception:  # noqa: BLE001 - the launch is done: a failed record only costs the next call time
            pass
    return [C] if reduce is None else [reduce.out]


_TAILS = {}


def _unused_tail(dev, n):
    """The TMA kernel's trailing arguments a launch does not use, made once per device: n = 8 the
    scatter destinations, 0 the in-matmul sum's (pointers to never-written dummies; rank 0, scale 1)."""
    t = _TAILS.get((dev, n))
    if t is None:
        if n:
            t = [_dummy(dev)] * n
        else:
            d = _dummy(dev, torch.int32)
            t = [_dummy(dev), _dummy(dev), d, _dummy(dev, torch.int64), d, 0, 1.0, d]
        t = _TAILS[(dev, n)] = tuple(t)
    return t


def _memo_record(memo, done, adesc, bdesc, cdesc, sk_mode, sms, c, M, N, A, B, C):
    """Keeps a direct launch's bound arguments for later calls of its key (see _MEMO)."""
    kernel, grid3, call, cvals, device_index = done
    mkey, outs_given, out_dtype, poison, err, held = memo
    if A.is_cuda and torch.cuda.is_current_stream_capturing():
        # NOTE: not kept: a captured launch may take per-call constants (_constant), memory the
        # graph owns and fills only on replay; eager launches of its key take the full path.
        return
    call = list(call)
    if not all(type(call[i]) is int for i in _TENSOR_SLOTS):  # addresses only: the entry holds no tensor
        return
    call[0] = call[1] = None  # the descriptors are made per call (they hold A and B, and C)
    atpl, btpl = _template(A, *adesc), _template(B, *bdesc)
    ctpl = None
    if cdesc is not None:
        call[-1] = None
        ctpl = _template(C, *cdesc)
    if len(_MEMO) >= MEMO_ENTRIES:
        _MEMO.clear()
    _MEMO[mkey] = (kernel, grid3, tuple(call), cvals, device_index, atpl, btpl, bdesc[2], ctpl,
                   (sms, c) if sk_mode else None, None if outs_given else ((M, N), out_dtype, A.device),
                   poison, err, held)  # fmt: skip


_TMA_PLANS = {}


# The launch memo (issue 14, host cost): a TMA launch's bound arguments, kept per call key so
# that a later call with the same key goes straight to Triton's launcher. The key holds every
# argument's value -- each tensor by address, shape, strides and dtype -- and every module value
# the plan reads, so an entry's addresses are exactly those of the call that finds it. The
# tensor descriptors (A, B) and a fresh output are made per call; the entry holds no tensor of
# the caller's. Skipped: a scale or bias that is not contiguous (_flat would copy it per call),
# a launch hook (profilers), Triton's own launch (FAST off).
MEMO = None  # None: MPTP_LAUNCH_MEMO decides at the first launch (default on; a bad value: off, logged)
_MEMO = {}
# Entries hold no tensor (a few hundred bytes each); a model's step cycles through its calls'
# keys, so the cap must exceed a step's distinct calls (cleared when full: a longer cycle
# would get no hits at all).
MEMO_ENTRIES = 8192
_TENSOR_SLOTS = (2, 3, 4, 5, 6, 10, 11, 14, 19, 20)  # C, scales, bias, result scale, order, flags, err, split buffers


def _memo_setting() -> None:
    global MEMO
    from .. import env

    try:
        MEMO = env.launch_memo_enabled()
    except ValueError as e:  # the ops check every MPTP_* value before communicating; here: off (the safe side)
        env.log_once(("launch_memo_env",), "persistent_matmul: %s; the launch memo stays off", e)
        MEMO = False


def _memo_device(A) -> bool:
    return A.is_cuda  # NOTE: tests stand in a CPU tensor here (the launch logic without a GPU)


_PLAIN = (torch.Tensor, torch.nn.Parameter)
_SCALARS = (int, float, bool)
_KEY_TYPES = frozenset((*_SCALARS, type(None)))  # the scalar arguments' types a memo key takes


def _sk_settings() -> tuple:
    """The module settings _sk_plan reads (part of the plan's key and the memo's)."""
    return STREAM_K, SK_MIN_FLOPS, SK_TILE_EFF, SK_MAX_SPLIT, SK_SPLIT_COST, SK_MIN_GAIN, SK_FP8_CONSUMER, SK_SCATTER


def _settings() -> tuple:
    """The module settings a call's launch depends on (the memo key's part of them)."""
    sem = epilogue.SCALED_MM_FP8_OUT["cuda"]
    return (USE_TMA, _sk_settings(), TMA_STORE_BLOCK_N, AUTO_KERNEL.get("16bit"), AUTO_KERNEL.get("fp8"), SK_CONFIG.get("16bit"),
            SK_CONFIG.get("fp8"), sem.get("result_scale"), sem.get("e5m2_overflow"))  # fmt: skip


def _memo_key(A, B, outs, out_dtype, A_scale, B_scales, biases, fast_accum, num_chunks, order, flags, epoch, mode,
              timeout_s, err, config, num_sms, kernel, result_scale, tag, poison, guard, stream_k, scatter_to=None):
    """The memo key of a call, or None (not memoized: the full path checks and launches it)."""
    scatter = None
    if scatter_to is not None:
        scatter = []
        for d in scatter_to:
            if d.__class__ not in _PLAIN or not d.is_contiguous():
                return None
            scatter.append((d.data_ptr(), d.shape, d.dtype, d.get_device()))
        scatter = tuple(scatter)
    if (B_scales is not None and (len(B_scales) != 1 or B_scales[0] is None)) or (
            biases is not None and len(biases) != 1):  # fmt: skip
        return None  # several, or a None scale (the full path refuses it)
    small = []
    for t in (A_scale, B_scales[0] if B_scales is not None else None, biases[0] if biases is not None else None,
              result_scale, order, flags, err):  # fmt: skip
        if t is None:
            small.append(None)
        elif t.__class__ in _PLAIN and t.is_contiguous():
            small.append((t.data_ptr(), t.shape, t.dtype))
        else:  # a strided scale (copied per call), a tensor subclass, not a tensor: not memoized
            return None
    if outs is not None and outs[0] is None:
        return None  # the full path says what is wrong with it
    # NOTE: scalars by type too: 1, 1.0 and True are == but bind differently (Triton specializes
    # on the type), and a value of another type (a tensor, a Decimal) is left to the full path.
    types = tuple(map(type, (epoch, tag, timeout_s, num_chunks, fast_accum, guard, poison, mode, num_sms)))
    try:
        if not _KEY_TYPES.issuperset(types):
            return None
    except TypeError:  # a type that cannot be hashed (a hostile review): the full path checks it
        return None
    o = outs[0] if outs is not None else None
    if A.__class__ not in _PLAIN or B.__class__ not in _PLAIN or (o is not None and o.__class__ not in _PLAIN):
        return None
    # NOTE: stream_k by its repr (True and 1 mean different splits, 1.0 is refused, and all are ==).
    return (A.data_ptr(), A.shape, A.stride(), A.dtype, A.get_device(), B.data_ptr(), B.shape, B.stride(), B.dtype,
            None if o is None else (o.data_ptr(), o.shape, o.stride(), o.dtype), *small, out_dtype, fast_accum,
            num_chunks, epoch, mode, timeout_s, config, num_sms, kernel, tag, poison, guard,
            None if stream_k is None else repr(stream_k), torch.cuda.current_device(), _settings(),
            types, scatter)  # fmt: skip


def _memo_launch(m, A, B, outs, err):
    """The memoized launch, or None where it cannot be taken (the caller takes the full path)."""
    if not _L.FAST or not _L.INT_POINTERS or _L._hooks():
        return None
    kernel, grid, call, cvals, device_index, atpl, btpl, bt, ctpl, sk, fresh, poison, held_err, _ = m
    if fresh is None:
        C = outs[0]
    else:
        C = torch.empty(fresh[0], device=fresh[2], dtype=fresh[1])
        if C.data_ptr() & 15:  # the kernel was specialized for a 16-byte aligned output
            return None
    call = list(call)
    # The descriptors from the templates of the key's layouts (the same shapes and strides).
    call[0], call[1], call[2] = _clone(atpl, A), _clone(btpl, B.t() if bt else B), C.data_ptr()
    if ctpl is not None:  # the TMA store's descriptor of this call's C (same shape, strides, block)
        call[-1] = _clone(ctpl, C)
    if sk is not None:
        pieces, sync = _sk_buffers(A.device, sk[0], sk[1])
        call[19], call[20] = pieces.data_ptr(), sync.data_ptr()
    try:
        stream = torch._C._cuda_getCurrentRawStream(device_index)
        kernel.run(grid[0], grid[1], grid[2], stream, kernel.function, kernel.packed_metadata, None, None, None,
                   *call, *cvals)  # fmt: skip
    except Exception:  # noqa: BLE001 - the full path launches (and reports) instead
        _MEMO.clear()
        return None
    _L.stats["direct"] += 1
    if poison:
        poison_if_error(C, err if err is not None else held_err)
    return [C]
