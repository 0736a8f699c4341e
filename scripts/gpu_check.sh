#!/usr/bin/env bash
# One device call: the GPU test groups (scripts/gpu_tests.sh), then the real ops in loopback
# (default dispatch, M = 8192), the host time per stage of the fused ops (profile_stages.py) and the cost model's check. Everything is packed into
# $OUT/all.tgz (the device tool returns at most 8 files); summaries go to stdout.
# Usage (device): GROUP_A=... GROUP_B=... GROUP_C=... BENCH=1 bash scripts/gpu_check.sh
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
bash scripts/gpu_tests.sh
if [ "${BENCH:-1}" = 1 ]; then
  mkdir -p "$OUT/bench"
  # Host time per fused call and per stage (bench/profile_loopback.py adds a cProfile when needed).
  timeout ${PROFILE_TIMEOUT:-60} python3 bench/profile_stages.py --calls 300 > "$OUT/bench/profile_stages.txt" 2>&1
  cat "$OUT/bench/profile_stages.txt"
  cp bench/results/all_gather_matmul.csv bench/results/matmul_reduce_scatter.csv "$OUT/bench/" 2>/dev/null
  for op in all_gather_matmul matmul_reduce_scatter; do
    echo "== $op loopback-op" | tee -a "$OUT/bench/bench.log"
    MPTP_RESULTS_DIR="$OUT/bench" timeout ${BENCH_TIMEOUT:-150} python3 bench/bench_$op.py --mode loopback-op \
      --Ms 8192 2>&1 | grep -v "^\[rank" | tee -a "$OUT/bench/bench.log"
  done
  # The dispatcher's cost model against both forced paths (eager and graph), per shape.
  MPTP_RESULTS_DIR="$OUT/bench" timeout ${COST_TIMEOUT:-240} python3 bench/check_cost_model.py 2>&1 \
    | grep -v "^\[rank" | tee "$OUT/bench/cost_model.txt" | tail -20
fi
(cd "$OUT" && tar czf /tmp/all.tgz . && find . -type f -delete && mv /tmp/all.tgz all.tgz)
