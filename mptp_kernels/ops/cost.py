"""Fused or not: a small cost model of one call, the same on every rank (issue 14).

A call's time is estimated for both paths as max(host time, GPU time): in eager the host
launches ahead of the GPU, so whichever is longer sets the pace of a run of calls. Under
CUDA-graph capture the host time is not replayed: only GPU time counts.

    GPU, fused all-gather:      max(matmul / (eff * free SMs), comm + last chunk's matmul)
                                (eff: FUSED_EFF times the small-N factor, _small_n)
                                (a GPU shared by the ranks: matmul / (eff * free SMs) + comm)
    GPU, unfused all-gather:    comm + matmul
    GPU, fused reduce-scatter:  matmul / (eff * small-N factor) + exposed comm + reduction
                                (every SM: the producer waits for no copy; exposed: what outlasts
                                the matmul between GPUs, none on a shared GPU: there the matmul's
                                own stores are the transfer)
    GPU, unfused reduce-scatter: matmul + comm + reduction
    matmul = 2 M N K / (SMs * per-SM rate);  comm = bytes moved per rank / link bandwidth

The constants are measurements. Matmul rates (bench/results/h200_record_74ef7b1.log, H200,
torch 2.11): cuBLAS ran 688-737 TFLOP/s in bf16 and 1257-1358 in FP8 over the six Llama-3 TP-8
shapes (per SM: 5.4e12 and 10.1e12 FLOP/s); the device-local chunk copies moved 1.5-1.6 TB/s.
Host times, fixed costs and the shared-GPU behaviour: bench/results/h100_cost_model_47c8526.csv
and h100_cost_model_plans_9134f4e.csv (H100, W = 8 loopback, M = 8192, both paths forced and
timed in one run, twice), the per-stage host profiles of 7f43c97 (W = 2 and 8) and, for the
fused path's host time, h100_profile_floor_90b1cc3.txt.
tests/ops/test_cost.py holds the model's picks to at most 10% (CUDA graphs) and 30% (eager)
slower than the faster path: from CUDA graphs on those runs and earlier ones; in eager on the
run of the current code's host time (h100_cost_model_b936c3c.csv: the older runs' eager rows
timed a fused path whose host time has since fallen by a third).
Other GPUs scale the per-SM rate by their compute capability (RATE_SCALE). Nothing here is
measured between GPUs (no machine with several GPUs was lent): the NVLink terms (BW_PEER and
the overlap of transfers with the matmul) are the design's expectation, not a measurement.

Every input is what all ranks of a group see alike (shapes, dtypes, W, the GPU model, the
group's link), and the dispatcher fuses only where every rank's call qualifies, so the
decision is identical on every rank by construction. MPTP_FORCE_FUSED=1 skips the model.
"""

from dataclasses import dataclass
from typing import Optional, Tuple

# Per-SM matmul rate on sm_90 (H200, cuBLAS), FLOP/s.
RATE_16BIT = 5.4e12
RATE_FP8 = 10.1e12
# Per-SM rate of other architectures relative to sm_90 (dense tensor-core peak per SM per clock
# times a typical clock); unknown ones count as 0.4.
RATE_SCALE = {
    (8, 0): 0.39,
    (8, 6): 0.2,
    (8, 9): 0.36,
    (9, 0): 1.0,
    (10, 0): 2.0,
    (10, 3): 2.0,
    (12, 0): 0.5,
}
# The persistent consumer / producer against cuBLAS on the same shape (fitted on the H100 loopback
# runs below: 1.035-1.09 x the matmul with 8 of 132 SMs left free, i.e. 0.97-1.03 per SM).
FUSED_EFF = 0.97
# ... times a small-N factor: SMALL_N_EFF at N <= SMALL_N[0], rising linearly to 1 at SMALL_N[1]
# (the persistent kernel ran 0.83-0.87x cuBLAS at N = 768 and 0.93-0.95x at N = 1280 from CUDA
# graphs, results/h200_persistent_matmul_5333caf.csv, M = 8192, bf16 and FP8). Linear and this
# shallow, N / factor still grows with N: more work is never estimated faster.
SMALL_N, SMALL_N_EFF = (768, 2048), 0.87
# Bytes per second a rank receives: a device-local copy (peers sharing the GPU), a peer GPU.
BW_SAME_DEVICE = 1.5e12
BW_PEER = 350e9
# Bytes per second of a memory-bound pass (the reduction reads W partials, writes one).
BW_MEMORY = 3.0e12
# Host microseconds per call, eager: base + per_peer * (W - 1), times the FP8 factor for FP8 calls
# (the scaled ops' extra launches, and on the reference path the row-wise scales' own gather).
# Fused: refitted (session 20) to the current code (one C call for the all-gather's transfers,
# the call memo): the medians of results/h100_profile_floor_90b1cc3.txt (H100 host, bursts from
# an idle GPU; all-gather 218 / 237 us at W = 2 / 8, FP8 row-wise 283 / 322; reduce-scatter
# 195 / 200, FP8 row-wise 243 / 249). Reference: the host-bound eager rows (N = 768 and 4096) of
# results/h100_cost_model_47c8526.csv at W = 8, split into base and per-peer parts with the
# W = 2 / W = 8 ratio of results/h100_profile_stages*_7f43c97.txt. The host is the CPU of the GPU
# machine: other hosts differ (the same calls ran 1.4-2x slower on some), but both paths scale
# alike and the pick follows their ratio. Checked on a run with both paths timed on one host
# (results/h100_cost_model_b936c3c.csv, not fitted to): host-bound eager rows at W = 8, fused /
# reference 223 / 244 us in bf16 (model 237 / 265), ~330 / 432 in FP8 row-wise (model 315 / 469),
# reduce-scatter 184 / 230 (model 200 / 255). NOTE: the reference's host time has fallen too since
# 47c8526 (the call memo covers both paths): the model puts it 7-11% high, which leans eager picks
# towards the fused path by about 20 us at W = 8. Refitted on those rows (80 + 23.4 (W - 1), 127 +
# 12.7 (W - 1)) the picks got better on one run (34195eb) and worse on the other (b936c3c: one eager
# pick 30% off), so it was left as it is. The per-peer parts were not re-measured on this code: the
# W at which a tiny call starts to fuse (bf16 all-gather W >= 7, FP8 all-gather and reduce-scatter
# W >= 4) rests on them.
HOST_FUSED = {"ag": (215.0, 3.2), "rs": (194.0, 0.8)}
HOST_REFERENCE_SYMM = {"ag": (101.0, 23.4), "rs": (166.0, 12.7)}
HOST_REFERENCE_COLLECTIVE = {"ag": (60.0, 2.0), "rs": (60.0, 2.0)}
HOST_FP8 = {"ag": {"fused": 1.33, "reference": 1.77},
            # NOTE: the reference's not measured; its A is local (no scales' gather): the fused
            # path's factor, so that it does not bias the pick.
            "rs": {"fused": 1.25, "reference": 1.25}}
# Fixed GPU time of a call beyond its matmul and transfers, us, per op and FP8 or not: fused
# (signals, flag reset, the chunk copies' own launches, the poison checks); reference (signals,
# the layout copies; FP8: the scales' gather and casts). Fitted from CUDA graphs on the two H100
# loopback runs (W = 8, M = 8192, six shapes each: results/h100_cost_model_47c8526.csv and
# h100_cost_model_plans_9134f4e.csv, the median of each op's residuals). The FP8 reduce-scatter
# was not measured: its A is local (no scale gather), so it takes the bf16 values. The fused
# reduce-scatter's fitted median was below zero (-3 us): it keeps the 8 us of its signals, flag
# reset and barrier measured before (7f43c97), so that tiny calls are not estimated free.
FUSED_FIXED_US = {"ag": {False: 25.0, True: 44.0}, "rs": {False: 8.0, True: 8.0}}
REFERENCE_FIXED_US = {"ag": {False: 32.0, True: 59.0}, "rs": {False: 16.0, True: 16.0}}


@dataclass(frozen=True)
class Work:
    """One call's size: op "ag" (all-gather-matmul) or "rs" (matmul-reduce-scatter); M the rows
    of the whole product (gathered A's rows; the reduce-scatter's rows before the scatter), K,
    N the columns of all Bs together, element sizes of A and of the output (the reduce-scatter's
    partials; unused for the all-gather)."""

    op: str
    M: int
    K: int
    N: int
    a_bytes: int
    out_bytes: int
    fp8: bool
    # The all-gather's chunk copies may ask for a copy engine in eager (False: a call that gathers
    # row-wise scales on a GPU its ranks share, fused._ag_run; its consumer then leaves the full
    # SM reserve, dispatch._link).
    ce_copies: bool = True


@dataclass(frozen=True)
class Link:
    """What the model needs of the group and its GPU."""

    W: int
    sms: int
    capability: Tuple[int, int]
    shares_device: bool
    reserve_sms: int = 0  # SMs the fused consumer leaves free (fused._consumer_sms)
    symm_reference: bool = True  # the reference path runs on the package's own transport


def _rate(work: Work, link: Link) -> float:
    per_sm = (RATE_FP8 if work.fp8 else RATE_16BIT) * RATE_SCALE.get(tuple(link.capability), 0.4)
    return per_sm * max(link.sms, 1)


def _small_n(N: int) -> float:
    lo, hi = SMALL_N
    return SMALL_N_EFF + (1.0 - SMALL_N_EFF) * min(max((N - lo) / (hi - lo), 0.0), 1.0)


def _host(table, work: Work, link: Link, path: str) -> float:
    base, per_peer = table[work.op]
    return (base + per_peer * (link.W - 1)) * (HOST_FP8[work.op][path] if work.fp8 else 1.0)


def estimate(work: Work, link: Link, capturing: bool = False) -> Tuple[float, float]:
    """(fused, reference) estimated microseconds per call."""
    W = link.W
    matmul = 2.0 * work.M * work.N * work.K / _rate(work, link) * 1e6
    # NOTE: only the all-gather's consumer leaves SMs to copies (reserve_sms); the reduce-scatter's
    # producer runs on every SM.
    free = max(link.sms - link.reserve_sms, 1) / max(link.sms, 1) if work.op == "ag" else 1.0
    fused_mm = matmul / (FUSED_EFF * _small_n(work.N) * free)
    bw = BW_SAME_DEVICE if link.shares_device else BW_PEER
    # NOTE: one rank: the reference is a plain matmul (no collective, no layout copies).
    ref_fixed = REFERENCE_FIXED_US[work.op][work.fp8] if W > 1 else 0.0
    # NOTE: on a GPU shared by the group's ranks the "transfers" are device-local copies through
    # the same memory and SMs the matmul uses: measured, they do not overlap with it at all (H100,
    # W = 8 loopback, results/h100_cost_model_7f43c97.csv: fused ~ matmul / eff + comm).
    if work.op == "ag":
        comm = (W - 1) / W * work.M * work.K * work.a_bytes / bw * 1e6
        if link.shares_device:
            gpu_fused = fused_mm + comm + FUSED_FIXED_US["ag"][work.fp8]
        else:
            gpu_fused = max(fused_mm, comm + fused_mm / W) + FUSED_FIXED_US["ag"][work.fp8]
        gpu_ref = comm + matmul + ref_fixed
    else:
        partial = work.M * work.N * work.out_bytes  # this rank's whole product
        comm = (W - 1) / W * partial / bw * 1e6
        reduce = (partial + partial / W) / BW_MEMORY * 1e6
        # NOTE: the producer stores each chunk into its owner's buffer while it computes: only
        # the part of the traffic that outlasts the matmul is exposed (between GPUs); on a GPU
        # the ranks share, those stores are local and the matmul's own (no copy follows it).
        # Fitted on results/h200_cost_model_rs_00c978a.csv (TMA producer, both paths forced, CUDA
        # graphs): FUSED_EFF with nothing exposed left residuals of -15 to +28 us on 102-1437 us.
        exposed = 0.0 if link.shares_device else max(comm - fused_mm, 0.0)
        gpu_fused = fused_mm + exposed + reduce + FUSED_FIXED_US["rs"][work.fp8]
        gpu_ref = matmul + comm + reduce + ref_fixed
    if capturing:
        return gpu_fused, gpu_ref
    ref_table = HOST_REFERENCE_SYMM if link.symm_reference else HOST_REFERENCE_COLLECTIVE
    return (max(_host(HOST_FUSED, work, link, "fused"), gpu_fused),
            max(_host(ref_table, work, link, "reference"), gpu_ref))  # fmt: skip


def prefer_fused(work: Work, link: Link, capturing: bool = False) -> Tuple[bool, Optional[str]]:
    """(True, None) where the fused path is estimated faster, else (False, why)."""
    fused, ref = estimate(work, link, capturing)
    if fused < ref:
        return True, None
    mode = "CUDA-graph capture" if capturing else "eager"
    return False, (f"cost model ({mode}): fused ~{fused:.0f} us vs unfused ~{ref:.0f} us per call "
                   "(MPTP_FORCE_FUSED=1 overrides)")  # fmt: skip
