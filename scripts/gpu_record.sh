#!/usr/bin/env bash
# One device call for the benchmarks of record: build, then the real ops in loopback (W = 8
# simulated ranks, M = 8192, by default and with MPTP_FORCE_FUSED=1), one TP MLP training step
# (W = 2 processes sharing the GPU) and the host-cost profile. Everything lands in $OUT:
#   run.log, profile_host.txt, *.csv (default dispatch), forced/*.csv (MPTP_FORCE_FUSED=1).
# Usage (device): MPTP_BENCH_COMMIT=<sha> bash scripts/gpu_record.sh ; EXTRA="..." runs first;
# FORCED_RUNS="0" skips the forced-dispatch runs, PROFILE=0 the host-cost profile.
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT/forced"
export PYTHONUNBUFFERED=1
LOG="$OUT/run.log"
step() { echo "== $(date +%T) $*" | tee -a "$LOG"; }
step build
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,memory.used --format=csv,noheader >> "$LOG"
python3 -m pip install -q --no-build-isolation --no-deps -e . >> "$LOG" 2>&1
python3 scripts/build_status.py >> "$LOG" 2>&1
if [ -n "${EXTRA:-}" ]; then step "extra: $EXTRA"; eval "$EXTRA" >> "$LOG" 2>&1; fi
for f in all_gather_matmul matmul_reduce_scatter tp_step; do
  [ -f "bench/results/$f.csv" ] && cp "bench/results/$f.csv" "$OUT/"
done
Ms=${MS:-8192}
for forced in ${FORCED_RUNS:-0 1}; do
  dir="$OUT"; [ "$forced" = 1 ] && dir="$OUT/forced"
  step "all-gather-matmul loopback-op M=$Ms MPTP_FORCE_FUSED=$forced"
  MPTP_FORCE_FUSED=$forced MPTP_RESULTS_DIR="$dir" timeout 200 python3 bench/bench_all_gather_matmul.py \
    --mode loopback-op --Ms "$Ms" >> "$LOG" 2>&1 || echo "exit $?" >> "$LOG"
  step "matmul-reduce-scatter loopback-op M=$Ms MPTP_FORCE_FUSED=$forced"
  MPTP_FORCE_FUSED=$forced MPTP_RESULTS_DIR="$dir" timeout 120 python3 bench/bench_matmul_reduce_scatter.py \
    --mode loopback-op --Ms "$Ms" >> "$LOG" 2>&1 || echo "exit $?" >> "$LOG"
done
step "TP MLP training step, W=2 sharing the GPU"
MPTP_RESULTS_DIR="$OUT" timeout 150 python3 -m torch.distributed.run --nproc-per-node 2 bench/bench_tp_step.py \
  >> "$LOG" 2>&1 || echo "exit $?" >> "$LOG"
if [ "${PROFILE:-1}" = 1 ]; then
  step "host cost"
  timeout 90 python3 bench/profile_host.py --calls 200 > "$OUT/profile_host.txt" 2>&1 || echo "exit $?" >> "$LOG"
fi
step done
