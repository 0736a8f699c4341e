#!/usr/bin/env bash
# One device call as a list of steps within a time budget (BUDGET_S, default 570): build and the GPU
# test groups (scripts/gpu_tests.sh, GROUP_A/B/C; none: build only), then each step of STEPS in turn,
# each "NAME:MAX_S:CMD" (separated by ';'), with at most its limit and what is left of the budget.
# Logs to $OUT/bench/NAME.txt, everything packed into $OUT/all.tgz (the device tool returns at most
# 8 files). Example:
#   MPTP_BENCH_COMMIT=abc1234 GROUP_A="dist/test_fused_gpu.py" \
#   STEPS="host:60:python3 bench/profile_host.py;capture:40:python3 bench/diag_capture_copies.py" \
#   bash scripts/gpu_steps.sh
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT/bench"
export PYTHONUNBUFFERED=1
deadline=$(( $(date +%s) + ${BUDGET_S:-570} ))
bash scripts/gpu_tests.sh
IFS=';' read -ra steps <<< "${STEPS:-}"
for s in "${steps[@]}"; do
  name=${s%%:*}; rest=${s#*:}; max=${rest%%:*}; cmd=${rest#*:}
  t=$(( deadline - $(date +%s) - 5 )); [ "$t" -gt "$max" ] && t=$max
  if [ "$t" -lt 15 ]; then echo "== $name: skipped, no time left" | tee -a "$OUT/bench/steps.txt"; continue; fi
  echo "== $name (limit ${t}s): $cmd" | tee -a "$OUT/bench/steps.txt"
  MPTP_RESULTS_DIR="$OUT/bench" timeout -k 10 "$t" bash -c "$cmd" > "$OUT/bench/$name.txt" 2>&1
  echo "== $name: exit $?" | tee -a "$OUT/bench/steps.txt"
  grep -v "^\[rank" "$OUT/bench/$name.txt" | tail -${TAIL:-12}
done
(cd "$OUT" && tar czf /tmp/all.tgz . && find . -type f -delete && mv /tmp/all.tgz all.tgz)
