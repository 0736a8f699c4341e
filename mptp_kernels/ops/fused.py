"""The fused CUDA path: symmetric memory + the persistent Triton matmul.

All-gather-matmul on rank r of W (streams: main = the caller's, side = copies):
    main: wait DONE(prev op) -> local shard into my symm buffer and into A_full
          -> chunk flag[r] = 1, signal READY, wait READY (tiny kernels; all of it and the side
          stream's part below are one C call, symm.primitives.ag_begin)
    side: for p = r+1, r+2, ...: copy peer p's shard into A_full (copy engine),
          flag[p] = 1 (memop) ; then signal DONE (I no longer read your buffers)
    main: consumer matmul over chunks r, r+1, ... (waits on flag[c] per chunk)
          -> flags = 0 -> join side
Matmul-reduce-scatter on rank r (chunks in the order r+1, r+2, ..., r: its own last):
    main: wait DONE(prev op) -> producer matmul storing chunk c's rows straight
          into slot r of rank c's symm buffer (over NVLink while computing)
    then, where every rank can sum inside the matmul (agreement.OPT_KERNEL_REDUCE, with
    MPTP_RS_REDUCE=kernel; off by default: measured slower): each chunk's last stored tile flags its arrival in the
          owner's pad; each tile of r's own chunk, once every peer's partial of it has arrived,
          is summed (slots 0..W-1, fp32) into out by the program that computed it
          -> out NaN if a wait timed out, arrival flags zeroed -> signal DONE
    else: signal READY, wait READY -> out = sum_p slot p of my buffer (fp32,
          rank order) -> signal DONE
NOTE: the all-gather's matmul spins only on flags written by copy-engine memops of
its own process (or, its own chunk's, by a kernel that ends before it is launched), and every other cross-rank wait is a tiny kernel launched before
the matmul holds the SMs, or after it; so W ranks sharing one GPU cannot deadlock.
The reduce-scatter's in-matmul sum (opt-in) breaks that rule: its programs hold their SMs
while they wait for the peers' matmuls (on a shared GPU, or a loopback group's earlier tiles,
it relies on time-slicing or residency), so a kernel beside it that needs SMs and waits on
a peer can stall both until the timeout; every wait is bounded (NaN and an error).
Flags are reset to 0 after each call and the consumer waits for >= 1, so a
captured CUDA graph stays correct on replay. Every op waits for DONE first; the
workspace hands out one DONE credit per peer when it is created, so the first
op (also one captured in a CUDA graph) waits like every later one.
A timed-out wait poisons: once the consumer or the reduction is done, each output of the
call is overwritten with NaN if the process's error record is set (one read of it per
call: symm.primitives.finish, one launch that also resets the chunk flags), and the next call raises.
"""

import functools
import math
from collections import Counter
from typing import Optional

import torch

from .. import env
from ..kernels import persistent_matmul as pm
from ..kernels.reduce import reduce_partials
from ..symm import _C
from ..symm import primitives as P
from . import agreement, cost, reference, validate

CH_READY, CH_DONE = P.CH_READY, P.CH_DONE
_FUSABLE = (torch.bfloat16, torch.float16, torch.float8_e4m3fn)
# NOTE: whether a call that can be fused is worth fusing is the dispatcher's decision, from the
# cost model (ops/cost.py) and the size of the work each runner carries (runner.work).
MAX_SCATTER_W = 8
# Output dtypes the fused epilogue writes (FP8 outputs with result_scale, as _scaled_mm).
_OUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float8_e4m3fn, torch.float8_e5m2)

# Where fused matmul-reduce-scatter calls (CUDA, W > 1, not of the last dim) summed their chunk:
# "kernel" (inside the matmul) or "pass" (after it and a barrier); tests read it.
RS_SUMS: Counter = Counter()

_TAG_AG = P.register_tag("fused_all_gather_matmul")
_TAG_RS = P.register_tag("fused_matmul_reduce_scatter")


def _common_reason(A: torch.Tensor) -> Optional[str]:
    if not A.is_cuda:
        return "A is not a CUDA tensor"
    if _C.lib() is None:
        return _C.why_unavailable()
    if A.dtype not in _FUSABLE:
        return f"dtype {A.dtype} is not fused (bf16, fp16, float8_e4m3fn are; fp32 runs the reference)"
    if A.numel() == 0:
        return "A is empty"
    return None


def _no_options(ws) -> int:
    return 0


def _runner(bind, args, work: cost.Work):
    """The plan of one call: bind(args) -> (fn, options) with fn(ws, opts) the call on the group's
    workspace, with the fused-path options every rank can take (agreement.OPT_*), and options(ws)
    those this rank's call can take. NOTE: bind holds only what the call's signature decides
    (never a tensor): the dispatcher's memo (dispatch._MEMO) reuses it for every later call of
    the same signature, with that call's arguments."""

    def rebind(new_args):
        fn, options = bind(new_args)
        fn.work, fn.options, fn.bind = work, options, rebind
        return fn

    return rebind(args), None


def _begin(ws: P.SymmetricMemory, tag: int) -> None:
    ws.check()
    if torch.cuda.is_current_stream_capturing():
        ws.captured = True
    # Every peer finished touching symmetric buffers in the previous op (or the creation credit).
    ws.wait_signal(CH_DONE, tag=tag)


# -- all-gather-matmul ----------------------------------------------------------------------------


def _scaled_launches(A_full, Bs, a_s, scaled, **kw):
    """One launch per B for the scaled op (each B may differ in bias / dtype / accumulation)."""
    _, _, B_scales, biases, out_dtypes, fast, result_scales = scaled
    outs = []
    for i, B in enumerate(Bs):
        rs = result_scales[i].float() if result_scales[i] is not None else None
        outs += pm.persistent_matmul(
            A_full, [B], A_scale=a_s, B_scales=[B_scales[i].float()],
            biases=[biases[i]] if biases[i] is not None else None,
            out_dtype=out_dtypes[i], fast_accum=fast[i], result_scale=rs, **kw,
        )  # fmt: skip
    return outs


def _consumer_sms(ws, dev, ce: bool = True) -> Optional[int]:
    """The consumer's grid bound. NOTE: where a peer shares this GPU the chunk copies are
    device-local, and such a copy may run as a kernel: a consumer on every SM would spin on a
    flag that copy can never set. The copies ask for a copy engine (P.ce_copies), but that is a
    hint the driver may ignore, so the consumer always leaves SMs free on a shared GPU:
    MPTP_RESERVE_SMS where the copies surely run as plain copies (ce False: the call does not
    ask for a copy engine), and min(2, that) as insurance where they asked for a copy engine."""
    if not getattr(ws, "shares_device", False):
        return None
    reserve = env.reserve_sms()
    if ce and P.ce_copies(ws.side):
        reserve = min(2, reserve)
    return max(1, pm.sm_count(dev) - reserve)


def _ag_run(ws, A, Bs, gather_dim, group_name, return_A, W, scaled=None):
    """scaled: None, or (A_scale, mode, B_scales, biases, out_dtypes, fast_accum)."""
    if W == 1:  # no communication: the matmul alone
        K = A.shape[-1]
        A2 = A.movedim(gather_dim, 0).contiguous().view(-1, K)
        lead = list(A.movedim(gather_dim, 0).shape[:-1])
        if scaled is None:
            outs2 = pm.persistent_matmul(A2, Bs)
        else:
            a_s = scaled[0].float() if scaled[0].numel() == 1 else scaled[0].movedim(gather_dim, 0).contiguous().view(-1).float()
            outs2 = _scaled_launches(A2, Bs, a_s, scaled)
        outs = [o.view(*lead, o.shape[-1]).movedim(0, gather_dim) for o in outs2]
        A_ret = A2.clone().view(*lead, K).movedim(0, gather_dim) if return_A else None
        return A_ret, outs
    rank = ws.rank
    K = A.shape[-1]
    # NOTE: the host cost of a call is mostly the number of torch calls made from Python (each
    # several microseconds): the common case takes no view, and the transfers below are issued
    # on raw addresses and stream handles.
    plain = gather_dim == 0 and A.dim() == 2 and A.is_contiguous()
    if plain:
        A2 = A
        full_lead = [A.shape[0] * W]
    else:
        Am = A.movedim(gather_dim, 0)
        A2 = Am.contiguous().view(-1, K)
        full_lead = list(Am.shape[:-1])
        full_lead[0] *= W
    rows = A2.shape[0]
    dev = A.device
    scale_rows = None
    a_bytes = rows * K * A2.element_size()
    nbytes = a_bytes
    off_scale = math.ceil(a_bytes / 256) * 256
    if scaled is not None and scaled[1] == validate.ScaleMode.ROW_WISE_SHARDED:
        scale_rows = scaled[0].movedim(gather_dim, 0).contiguous().view(-1).float()
        nbytes = off_scale + rows * 4
    assert nbytes <= ws.nbytes, (nbytes, ws.nbytes)
    main_h = P.raw_stream(dev)
    A_full = torch.empty(W * rows, K, device=dev, dtype=A.dtype)
    af = A_full.data_ptr()
    scale_full = torch.empty(W * rows, device=dev, dtype=torch.float32) if scale_rows is not None else None
    bufs = ws._buf_ptrs  # rank p's buffer as mapped here; this rank's shard at its start
    # NOTE: recorded before anything can raise: a call that fails below must not hand A_full
    # back to the allocator while the side stream's copies still land in it.
    A_full.record_stream(ws.side)
    if scale_full is not None:
        scale_full.record_stream(ws.side)
    ws.check()
    if torch.cuda.is_current_stream_capturing():
        ws.captured = True
    a = _ag_args(ws)
    a.main = main_h
    timeout_s = env.timeout_s()
    a.timeout_ns = int(timeout_s * 1e9)
    # NOTE (issue 14): a call that gathers row-wise scales on a GPU its ranks share asks for no
    # copy engine (its consumer then leaves the full SM reserve, _consumer_sms). Measured in eager
    # (bench/diag_eager_copies.py, H100, W = 8 loopback, M = 8192, two runs): with copy-engine
    # copies the FP8 row-wise all-gather took 1.27-1.29x and 1.13-1.16x its plain-copy time on the
    # two largest shapes (1072 against 844 us, 530 against 457) and 1.00-1.05x on the others; the
    # tensor-wise one (the same copies, no scales) took 0.95-1.03x in one run and 0.96-1.09x in the
    # other (1.08-1.09x on two host-bound shapes of a noisy host). Why is not known (plain copies
    # for the scales alone did not change it). Between GPUs it is not measured: left as it was.
    ce = env.ce_copies_enabled() and not (scale_rows is not None and getattr(ws, "shares_device", False))
    a.use_ce = 1 if ce else 0
    # This rank's shard into its symmetric buffer and into its chunk of A_full (and the row
    # scales likewise), one launch that writes nothing once a wait has timed out (fail-stop;
    # the outputs and A_full are NaN then).
    src = A2.data_ptr()
    a.copy_dst[0], a.copy_src[0], a.copy_bytes[0] = bufs[rank], src, a_bytes
    n = 1
    if (af + rank * a_bytes - src) % 16 == 0:  # 16-byte words in the guarded copy kernel
        a.copy_dst[1], a.copy_src[1], a.copy_bytes[1] = af + rank * a_bytes, src, a_bytes
        n = 2
    else:  # NOTE: a misaligned chunk would be copied in smaller words: a plain copy instead (of a
        # local tensor: it needs no DONE)
        A_full[rank * rows : (rank + 1) * rows].copy_(A2)
    a.nscale = 0
    if scale_rows is not None:
        sr, sf = scale_rows.data_ptr(), scale_full.data_ptr()
        for d in (bufs[rank] + off_scale, sf + rank * rows * 4):
            a.copy_dst[n], a.copy_src[n], a.copy_bytes[n] = d, sr, rows * 4
            n += 1
        a.nscale, a.scale_base, a.scale_bytes, a.scale_src_off = 1, sf, rows * 4, off_scale
    a.ncopy = n
    a.full_base, a.chunk_bytes = af, a_bytes
    # main: wait DONE, the copies, this chunk's flag, READY; side: the peers' scales (then main
    # waits for them: the consumer holds every SM and spins on chunk flags only, so nothing it
    # waits for may queue behind it), their chunks each with its flag, DONE. One call.
    P.ag_begin(a)
    kw = dict(num_chunks=W, order=ws.ag_order, flags=ws.flags, epoch=1, mode=pm.MODE_CONSUMER,
              timeout_s=timeout_s, err=ws.err, tag=_TAG_AG, num_sms=_consumer_sms(ws, dev, ce),
              poison=False)  # fmt: skip
    if scaled is None:
        outs2 = pm.persistent_matmul(A_full, Bs, **kw)
    else:
        A_scale, mode = scaled[0], scaled[1]
        if mode == validate.ScaleMode.ROW_WISE_SHARDED:
            a_s = scale_full
        elif mode == validate.ScaleMode.ROW_WISE_REPLICATED:
            a_s = A_scale.movedim(gather_dim, 0).contiguous().view(-1).float()
        else:
            a_s = A_scale.float()
        outs2 = _scaled_launches(A_full, Bs, a_s, scaled, **kw)
    # Join first: every flag write of the side stream has landed before the reset (a consumer
    # that timed out, or had no tile to compute, did not wait for all of them). Then one launch:
    # the outputs (and the gathered A: one whose READY wait timed out holds stale bytes) become
    # NaN if a wait timed out; then the flags are reset.
    _finish(ws, [A_full if return_A else None, *outs2], ws.flags, join=(ws.side.cuda_stream, ws.raw_events()[2]),
            stream=main_h)  # fmt: skip
    if plain:
        return (A_full if return_A else None), outs2
    outs = [o.view(*full_lead, o.shape[-1]).movedim(0, gather_dim) for o in outs2]
    A_ret = A_full.view(*full_lead, K).movedim(0, gather_dim) if return_A else None
    return A_ret, outs


def _ag_args(ws):
    """The workspace's AgBeginArgs (csrc/symm/symm.h), its per-workspace fields filled in once: a
    call sets only its own (streams, addresses, sizes). NOTE: reused from call to call (the C
    side reads it during the call only; the dispatcher runs one call of a group at a time)."""
    a = ws.__dict__.get("_ag_args")
    if a is None or ws._freed:
        ws._signal_ptrs(CH_DONE)  # raises for a freed workspace (the struct holds its addresses)
        W, r = ws.world_size, ws.rank
        a = _C.AgBeginArgs()
        a.side = ws.side.cuda_stream
        a.fork, a.scales_in = ws.raw_events()[:2]
        table, exp = ws._signal_ptrs(CH_DONE)
        pad = ws._pad_ptrs[r]
        a.done_slots, a.done_expected, a.done_sig = pad + CH_DONE * W * 4, exp + CH_DONE * W * 4, table + CH_DONE * W * 8
        a.ready_slots, a.ready_expected, a.ready_sig = pad + CH_READY * W * 4, exp + CH_READY * W * 4, table + CH_READY * W * 8
        flag0 = ws.flags.data_ptr()  # int32 chunk flags
        a.own_flag = flag0 + 4 * r
        a.world_size, a.mask, a.tag = W, ((1 << W) - 1) & ~(1 << r), _TAG_AG
        a.done_channel, a.ready_channel = CH_DONE, CH_READY
        peers = [(r + i) % W for i in range(1, W)]
        a.npull = len(peers)
        for i, p in enumerate(peers):
            a.peers[i], a.pull_src[i], a.pull_flag[i] = p, ws._buf_ptrs[p], flag0 + 4 * p
        ws._ag_args = a
    return a


def _views(ws, key, make):
    """Views of the workspace's buffers, cached per workspace (the buffers live as long as it)."""
    cache = ws.__dict__.get("_views")
    if cache is None:
        cache = ws._views = {}
    v = cache.get(key)
    if v is None:
        if len(cache) >= 64:
            cache.clear()
        v = cache[key] = make()
    return v


def _finish(ws, tensors, flags, signal=None, join=None, stream=None) -> None:
    """P.finish over any number of tensors (at most P.MAX_FINISH per launch), on the raw stream
    handle `stream` (default: the current stream of the workspace's device, the op's); flags reset,
    and the signal sent, by the last launch; the join waited for by the first."""
    ts = [t for t in tensors if t is not None]
    step = P.MAX_FINISH
    if stream is None:
        stream = P.raw_stream(ws.device)
    for i in range(0, max(len(ts), 1), step):
        last = i + step >= len(ts)
        P.finish(ts[i : i + step], ws.err, flags if last else None, stream=stream, signal=signal if last else None,
                 join=join if i == 0 else None)  # fmt: skip


def _plan_ag(A, Bs, gather_dim, group_name, return_A=True, scaled=None, ref_fn=None, args=None, row_scales=False):
    """scaled: None, or fn(args) -> the scaled launch arguments of _ag_run; ref_fn: the layout's
    reference (on (A, Bs, gd, group_name)); args: the op's arguments (what bind takes);
    row_scales: the call gathers row-wise scales (its copies ask for no copy engine on a shared GPU)."""
    why = _common_reason(A)
    if why:
        return None, why
    W, gd = validate.all_gather_matmul(A, Bs, gather_dim, group_name, scaled=scaled is not None)
    if gd == A.dim() - 1:
        return None, "gathering the last (K) dim is not fused"
    if W > 32:
        return None, f"world size {W} > 32"
    if any(B.dtype != A.dtype for B in Bs):
        return None, "Bs dtypes differ from A's"
    K = A.shape[-1]
    work = cost.Work("ag", A.numel() // K * W, K, sum(B.shape[1] for B in Bs), A.element_size(), A.element_size(),
                     A.element_size() == 1, ce_copies=not row_scales)  # fmt: skip
    if ref_fn is None:
        ref_fn = functools.partial(reference.all_gather_matmul, return_A=return_A)
    layout = []  # the reference's layout, once known (a function of the signature)

    def bind(a):
        A, Bs, group_name = a[0], a[1], a[5 if scaled is not None else 3]
        sc = scaled(a) if scaled is not None else None
        return (lambda ws, opts=0: _ag_with_layout(ws, A, Bs, gd, group_name, return_A, W, sc, ref_fn,
                                                   (A, list(Bs), gd, group_name), layout)), _no_options  # fmt: skip

    return _runner(bind, args, work)


# -- matmul-reduce-scatter ------------------------------------------------------------------------


def _rs_options(ws, A, B, scatter_dim, out_shape) -> int:
    """OPT_KERNEL_REDUCE where this rank can sum its chunk inside the matmul: MPTP_RS_REDUCE=kernel
    here, the scatter is not of the last dim, and the TMA kernel serves the call's A (as _rs_run
    lays it out) and B."""
    W = ws.world_size if ws is not None else 1
    if env.rs_reduce() != "kernel" or W == 1 or scatter_dim == len(out_shape) - 1 or W > MAX_SCATTER_W:
        return 0
    K = A.shape[-1]
    A2 = A  # as _rs_run lays it out: A itself, a view of it, or a fresh copy
    if A.dim() > 2 or scatter_dim:
        Am = A.movedim(scatter_dim, 0)
        if Am.is_contiguous():
            A2 = Am.view(-1, K)
        else:  # a fresh copy: contiguous and 16-byte aligned; as small a stand-in (no allocation of A's size)
            A2 = torch.empty_strided((1, K), (K, 1), dtype=A.dtype, device=A.device)
    return agreement.OPT_KERNEL_REDUCE if pm.reduce_eligible(A2, B) else 0


def _rs_run(ws, A, B, reduce_op, scatter_dim, group_name, W, out_shape, scaled=None, opts=0):
    """scaled: None or (A_scale, B_scale, bias, out_dtype, fast_accum); opts: the agreed options
    (agreement.OPT_KERNEL_REDUCE: the chunk is summed inside the matmul, every rank does)."""
    if W == 1:  # no communication: the matmul alone ("avg" over one rank is the identity)
        A2 = A.reshape(-1, A.shape[-1])
        if scaled is None:
            (out,) = pm.persistent_matmul(A2, [B])
        else:
            A_scale, B_scale, bias, out_dtype, fast = scaled
            a_s = A_scale.float() if A_scale.numel() == 1 else A_scale.reshape(-1).float()
            (out,) = pm.persistent_matmul(A2, [B], A_scale=a_s, B_scales=[B_scale.float()],
                                          biases=[bias] if bias is not None else None,
                                          out_dtype=out_dtype, fast_accum=fast)  # fmt: skip
        return out.view(*out_shape)
    if scatter_dim == len(out_shape) - 1:
        return _rs_last_dim(ws, A, B, reduce_op, W, out_shape, scaled)
    rank = ws.rank
    K, N = A.shape[-1], B.shape[1]
    lead = list(out_shape[:-1])
    A2 = A.movedim(scatter_dim, 0).contiguous().view(-1, K) if A.dim() > 2 or scatter_dim else A
    M = A2.shape[0]
    Mc = M // W
    out_dtype = A.dtype if scaled is None else scaled[3]
    elem = out_dtype.itemsize
    assert W * Mc * N * elem <= ws.nbytes, (W * Mc * N * elem, ws.nbytes)
    _begin(ws, _TAG_RS)
    # Slot r of rank c's buffer receives our partial product of chunk c; mine holds every slot
    # of this rank's buffer (cached views: the buffers live as long as the workspace).
    dests, mine = _views(ws, ("rs", Mc, N, out_dtype), lambda: (
        [ws.buffers[c][: W * Mc * N * elem].view(out_dtype).view(W, Mc, N)[rank] for c in range(W)],
        ws.buffers[rank][: W * Mc * N * elem].view(out_dtype).view(W, Mc, N)))  # fmt: skip
    # guard: the stores into peers' buffers are skipped once a wait has timed out (fail-stop).
    kw = dict(num_chunks=W, order=ws.rs_order, scatter_to=dests, err=ws.latch, guard=True, tag=_TAG_RS,
              timeout_s=env.timeout_s())  # fmt: skip
    out = torch.empty(Mc, N, device=A.device, dtype=out_dtype)
    scale = 1.0 / W if reduce_op == "avg" else 1.0
    in_kernel = bool(opts & agreement.OPT_KERNEL_REDUCE)
    RS_SUMS["kernel" if in_kernel else "pass"] += 1
    if in_kernel:
        # Each tile of this rank's chunk (computed last) is summed with the peers' partials of it
        # once they have arrived (flags in this rank's pad, set by the peers' matmuls), in slot order:
        # no barrier, no pass after the matmul.
        kw["reduce"] = pm.Reduce(rank=rank, slots=mine, out=out, counters=ws.rs_counters, arrive_to=ws.arrive_to,
                                 arrived=ws.arrived, err=ws.err, scale=scale)  # fmt: skip
    if scaled is None:
        pm.persistent_matmul(A2, [B], **kw)
    else:
        A_scale, B_scale, bias, _, fast = scaled
        a_s = A_scale.float() if A_scale.numel() == 1 else A_scale.movedim(scatter_dim, 0).contiguous().view(-1).float()
        pm.persistent_matmul(A2, [B], A_scale=a_s, B_scales=[B_scale.float()],
                             biases=[bias] if bias is not None else None, out_dtype=out_dtype,
                             fast_accum=fast, **kw)  # fmt: skip
    if in_kernel:
        # NaN if a wait timed out; the arrival flags zeroed (before DONE: a peer flags our next
        # call's chunk only after it has seen DONE from every rank); DONE, from the same launch.
        _finish(ws, [out], ws.arrived, signal=(ws, CH_DONE))
    else:
        ws.barrier(CH_READY, tag=_TAG_RS)
        reduce_partials(mine, out, scale=scale)
        # NaN if a wait timed out (the partials may be stale); DONE, from the same launch.
        _finish(ws, [out], None, signal=(ws, CH_DONE))
    if len(lead) == 1:  # a 2-D A scattered along its rows: out is the result
        return out
    sc_lead = list(lead)
    sc_lead.insert(0, sc_lead.pop(scatter_dim))
    sc_lead[0] //= W
    out = out.view(*sc_lead, N).movedim(0, scatter_dim)
    return out.contiguous() if scatter_dim else out


def _rs_last_dim(ws, A, B, reduce_op, W, out_shape, scaled):
    """Scatter of the last (N) dim: rank c owns columns c * N / W ...; one matmul per owner,
    each storing straight into slot r of the owner's buffer, in the order r + 1, r + 2, ..."""
    rank, K, N = ws.rank, A.shape[-1], B.shape[1]
    A2 = A.reshape(-1, K)
    M, Nc = A2.shape[0], N // W
    out_dtype = A.dtype if scaled is None else scaled[3]
    elem = out_dtype.itemsize
    assert W * M * Nc * elem <= ws.nbytes, (W * M * Nc * elem, ws.nbytes)
    _begin(ws, _TAG_RS)
    for i in range(W):
        c = (rank + 1 + i) % W
        cols = slice(c * Nc, (c + 1) * Nc)
        dest = ws.buffers[c][: W * M * Nc * elem].view(out_dtype).view(W, M, Nc)[rank]
        if scaled is None:
            pm.persistent_matmul(A2, [B[:, cols]], outs=[dest], err=ws.latch, guard=True)
        else:
            A_scale, B_scale, bias, _, fast = scaled
            a_s = A_scale.float() if A_scale.numel() == 1 else A_scale.reshape(-1).float()
            b_s = B_scale.float() if B_scale.numel() == 1 else B_scale.reshape(-1)[cols].float()
            pm.persistent_matmul(A2, [B[:, cols]], outs=[dest], err=ws.latch, guard=True, A_scale=a_s, B_scales=[b_s],
                                 biases=[bias[cols]] if bias is not None else None, out_dtype=out_dtype,
                                 fast_accum=fast)  # fmt: skip
    ws.barrier(CH_READY, tag=_TAG_RS)
    mine = ws.buffers[rank][: W * M * Nc * elem].view(out_dtype).view(W, M, Nc)
    out = torch.empty(M, Nc, device=A.device, dtype=out_dtype)
    reduce_partials(mine, out, scale=1.0 / W if reduce_op == "avg" else 1.0)
    _finish(ws, [out], None, signal=(ws, CH_DONE))  # NaN if a wait timed out; DONE
    return out.view(*out_shape[:-1], Nc)


def _plan_rs(A, B, reduce_op, scatter_dim, group_name, scaled=None, out_shape=None, args=None):
    """scaled: None, or fn(args) -> the scaled arguments of _rs_run; args: the op's arguments."""
    why = _common_reason(A)
    if why:
        return None, why
    W, sd = validate.matmul_reduce_scatter(A, B, reduce_op, scatter_dim, group_name, scaled is not None)
    if out_shape is None:
        out_shape = [*A.shape[:-1], B.shape[1]]
    if W > MAX_SCATTER_W and sd != len(out_shape) - 1:
        return None, f"world size {W} > {MAX_SCATTER_W}"
    if B.dtype != A.dtype:
        return None, "B's dtype differs from A's"
    K = A.shape[-1]
    out_dtype = scaled(args)[3] if scaled is not None else A.dtype
    work = cost.Work("rs", A.numel() // K, K, B.shape[1], A.element_size(), out_dtype.itemsize,
                     A.element_size() == 1)  # fmt: skip

    def bind(a):
        A, B = a[0], a[1]
        sc = scaled(a) if scaled is not None else None
        return (lambda ws, opts=0: _rs_run(ws, A, B, reduce_op, sd, group_name, W, out_shape, sc, opts),
                lambda ws: _rs_options(ws, A, B, sd, out_shape))  # fmt: skip

    return _runner(bind, args, work)


# -- layout ---------------------------------------------------------------------------------------

_LAYOUTS = {}


def _reference_layout(ref_fn, key, args):
    """Shapes/strides the reference produces for these inputs (run on meta tensors, cached)."""
    if key not in _LAYOUTS:
        from torch._subclasses.fake_tensor import FakeTensorMode

        with FakeTensorMode() as mode:
            fake = lambda t: mode.from_tensor(t) if isinstance(t, torch.Tensor) else t  # noqa: E731
            out = ref_fn(*[[fake(t) for t in a] if isinstance(a, list) else fake(a) for a in args])
        flat = out if isinstance(out, tuple) else (out,)
        if len(_LAYOUTS) >= 256:  # (a bound: shapes that change every call would grow it for good)
            _LAYOUTS.clear()
        _LAYOUTS[key] = [[(t.shape, t.stride()) if t is not None else None
                          for t in (x if isinstance(x, list) else [x])] for x in flat]  # fmt: skip
    return _LAYOUTS[key]


def _scaled_layout_proxy(A, Bs, gd, group_name):
    """The scaled op's output layout via the unscaled reference on same-shaped 16-bit fakes."""
    A16 = torch.empty_strided(A.shape, A.stride(), dtype=torch.bfloat16, device=A.device)
    Bs16 = [torch.empty_strided(B.shape, B.stride(), dtype=torch.bfloat16, device=B.device) for B in Bs]
    return reference.all_gather_matmul(A16, Bs16, gd, group_name, return_A=True)


def _restride(t, layout):
    """Returns t with the reference's strides (a copy only where they differ)."""
    if t is None or (t.stride() == layout[1] and t.shape == layout[0]):  # (the common case, cheaply)
        return t
    same = reference.size1_restrided(t, *layout)  # t itself, or only size-1 dims' strides differ
    if same is not None:
        return same
    out = torch.empty_strided(layout[0], layout[1], dtype=t.dtype, device=t.device)
    return out.copy_(t)


def _key(*args):  # noqa: D103
    return tuple((tuple(a.shape), a.stride(), a.dtype) if isinstance(a, torch.Tensor)
                 else tuple(_key(x) for x in a) if isinstance(a, list) else a for a in args)  # fmt: skip


def _ag_with_layout(ws, A, Bs, gd, group_name, return_A, W, scaled, ref_fn, ref_args, layout):
    """layout: [] or [the layout], the plan's (a function of the call's signature)."""
    A_ret, outs = _ag_run(ws, A, Bs, gd, group_name, return_A, W, scaled)
    if not layout:
        name = getattr(getattr(ref_fn, "func", ref_fn), "__name__", "")
        # NOTE: W is part of the key: a group name may be reused for a group of another size.
        key = (name, repr(getattr(ref_fn, "keywords", None)), W, _key(*ref_args))
        layout.append(_reference_layout(ref_fn, key, ref_args))
    (la,), lo = layout[0]
    return _restride(A_ret, la) if A_ret is not None else None, [_restride(o, lay) for o, lay in zip(outs, lo)]


# -- entry point ----------------------------------------------------------------------------------


def plan(name, W, *args, **kwargs):
    """Returns (runner, None) when the fused path can serve this rank's call, else (None, reason).

    runner(ws, opts) runs the call on the group's workspace (None when W == 1); runner.bind(args)
    is the runner of another call with the same signature (args: the op's arguments, as here).
    The inputs were validated by the dispatcher; the decision is combined over ranks there.
    """
    if name == "fused_all_gather_matmul":
        A, Bs, gather_dim, group_name = args
        return _plan_ag(A, Bs, gather_dim, group_name, kwargs.get("return_A", True), args=args)
    if name == "fused_all_gather_scaled_matmul":
        A, Bs, A_scale, B_scales, gather_dim, group_name, biases, result_scales, out_dtypes, fast = args
        if A.is_cuda and A.dtype not in (torch.float8_e4m3fn,):
            return None, f"dtype {A.dtype} is not fused"
        W, gd = validate.all_gather_matmul(A, Bs, gather_dim, group_name, scaled=True)
        mode = validate.all_gather_scaled_lists(A, Bs, A_scale, B_scales, biases, result_scales,
                                                out_dtypes, fast, gd, W)  # fmt: skip
        # None: _scaled_mm's default, A's dtype (an FP8 output).
        dts = [validate.to_dtype(d) or A.dtype for d in out_dtypes]
        if any(d not in _OUT_DTYPES for d in dts):
            return None, f"out dtypes {dts} not all in {_OUT_DTYPES}"
        if any(rs is not None and rs.numel() != 1 for rs in result_scales):
            return None, "result_scales must have one element each"
        if any(bs.numel() != 1 and tuple(bs.shape) != (1, B.shape[1]) for bs, B in zip(B_scales, Bs)):
            return None, "B_scales must be one element or [1, N]"
        if mode == validate.ScaleMode.TENSOR_WISE and any(bs.numel() != 1 for bs in B_scales):
            return None, "tensor-wise A_scale needs tensor-wise B_scales (as _scaled_mm)"
        # Layouts do not depend on dtypes or scales: take them from the unscaled
        # reference (the meta _scaled_mm would reject N not divisible by 16).
        return _plan_ag(A, Bs, gd, group_name, True,
                        lambda a: (a[2], mode, list(a[3]), list(a[6]), dts, list(a[9]), list(a[7])),
                        _scaled_layout_proxy, args, row_scales=mode == validate.ScaleMode.ROW_WISE_SHARDED)  # fmt: skip
    if name == "fused_matmul_reduce_scatter":
        A, B, reduce_op, scatter_dim, group_name = args
        return _plan_rs(A, B, reduce_op, scatter_dim, group_name, args=args)
    if name == "fused_scaled_matmul_reduce_scatter":
        (A, B, A_scale, B_scale, reduce_op, orig_sd, sd_after, group_name, output_shape,
         bias, result_scale, out_dtype, fast) = args  # fmt: skip
        if A.is_cuda and A.dtype != torch.float8_e4m3fn:
            return None, f"dtype {A.dtype} is not fused"
        out_dtype = validate.to_dtype(out_dtype)
        if result_scale is not None or out_dtype not in (torch.bfloat16, torch.float16, torch.float32):
            return None, "result_scale, or an fp8 output (out_dtype None), is not fused"
        if output_shape is not None and list(output_shape[:-1]) != list(A.shape[:-1]):
            return None, "A was reshaped (output_shape differs from A's leading dims)"
        if B_scale.numel() != 1 and tuple(B_scale.shape) != (1, B.shape[1]):
            return None, "B_scale must be one element or [1, N]"
        if (A_scale.numel() == 1) != (B_scale.numel() == 1):
            return None, "A and B scales must both be tensor-wise or both row-wise"
        validate.scaled_rs_extras(A, A_scale, B_scale, bias, result_scale)
        return _plan_rs(A, B, reduce_op, orig_sd, group_name,
                        lambda a: (a[2], a[3], a[9], out_dtype, a[12]), output_shape, args)  # fmt: skip
    return None, f"unknown op {name}"
