#!/usr/bin/env bash
# One device call within a time budget (BUDGET_S, default 570): build; the GPU test groups in
# parallel (GROUP_A/B/C, as scripts/gpu_tests.sh); then, one after another while time is left,
# the host time per stage (profile_stages.py; a py-spy profile too where .whl/py-spy is carried; the driver-call floor, profile_floor.py), the cost model's check (check_cost_model.py) and
# the real ops in loopback (bench_*.py --mode loopback-op). Each step gets at most its own limit
# and what is left of the budget; BENCH=0 runs the tests only. Everything is packed into
# $OUT/all.tgz (the device tool returns at most 8 files). Host cost per launch and op: profile_host.py;
# STAGES=0 skips the stage profiles, py-spy and the floors (STAGE_PROFILES=0: the stage profiles only); HOST=0 the host profile; PM=1 adds the persistent matmul against cuBLAS (PM_MS, default 4096,8192); LOOPBACK=0 stops before
# the cost-model check (COST_ARGS: its extra arguments) and the loopback ops.
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT/bench"
export PYTHONUNBUFFERED=1
deadline=$(( $(date +%s) + ${BUDGET_S:-570} ))
left() { local l=$(( deadline - $(date +%s) - 5 )); [ "$l" -lt "$1" ] && echo "$l" || echo "$1"; }
pack() { (cd "$OUT" && tar czf /tmp/all.tgz . && find . -type f -delete && mv /tmp/all.tgz all.tgz); }
bash scripts/gpu_tests.sh
[ "${BENCH:-1}" = 1 ] || { pack; exit 0; }
step() {  # step NAME MAX_S LOG CMD...
  local name=$1 max=$2 log=$3; shift 3
  local t; t=$(left "$max")
  if [ "$t" -lt 20 ]; then echo "== $name: skipped, no time left" | tee -a "$OUT/bench/steps.txt"; return; fi
  echo "== $name (limit ${t}s)" | tee -a "$OUT/bench/steps.txt"
  MPTP_RESULTS_DIR="$OUT/bench" timeout "$t" "$@" > "$OUT/bench/$log" 2>&1
  echo "== $name: exit $?" | tee -a "$OUT/bench/steps.txt"
}
if [ "${HOST:-1}" = 1 ]; then  # HOST=0 skips the host-cost profile
  step host 60 profile_host.txt python3 bench/profile_host.py --calls 300
  head -24 "$OUT/bench/profile_host.txt"
fi
if [ "${STAGES:-1}" = 1 ]; then  # STAGES=0 skips the stage profiles, py-spy and the floors
  if [ "${STAGE_PROFILES:-1}" = 1 ]; then  # STAGE_PROFILES=0: py-spy and the floors only
    step stages 60 profile_stages.txt python3 bench/profile_stages.py --calls 300
    grep -v "^\[rank" "$OUT/bench/profile_stages.txt" | head -150
  fi
  if [ -x .whl/py-spy ]; then  # where the host time goes, line by line (bench/spy_loop.py); .whl is carried
    for c in ${SPY:-"ag:fused"}; do set -- ${c/:/ }
      step "spy_$1_$2" 50 "spy_$1_$2.log" .whl/py-spy record --nonblocking -r 200 -f raw -o "$OUT/bench/spy_$1_$2.txt" -- \
        python3 bench/spy_loop.py --op "$1" --path "$2" --seconds 8
      tail -2 "$OUT/bench/spy_$1_$2.log"
    done
  fi
  [ "${STAGE_PROFILES:-1}" = 1 ] && step stages_w2 45 profile_stages_w2.txt python3 bench/profile_stages.py --W 2 --calls 200
  # The floor: each op's recorded driver calls replayed alone, beside the op (W = 2 and 8).
  for w in 2 8; do
    MPTP_TIMEOUT_S=10 step "floor_w$w" ${FLOOR_S:-60} "profile_floor_w$w.txt" python3 bench/profile_floor.py --W "$w" --calls 200
    grep -v "^\[rank" "$OUT/bench/profile_floor_w$w.txt" | tail -4
  done
  [ -f "$OUT/bench/profile_stages_w2.txt" ] && grep -v "^\[rank" "$OUT/bench/profile_stages_w2.txt" | grep "path:"
fi
if [ "${PM:-0}" = 1 ]; then  # the persistent matmul against cuBLAS, eager and from CUDA graphs
  [ "${DIAG:-1}" = 1 ] && step diag 90 diag_stream_k.txt python3 bench/diag_stream_k.py; cat "$OUT/bench/diag_stream_k.txt" | tail -6
  step persistent ${PM_S:-200} persistent.txt python3 bench/bench_persistent_matmul.py --Ms "${PM_MS:-4096,8192}" ${PM_NS:+--Ns "$PM_NS"} ${PM_ARGS:-} --out "$OUT/bench"
  grep -v "^\[rank" "$OUT/bench/persistent.txt" | tail -8
fi
[ "${LOOPBACK:-1}" = 1 ] || { pack; exit 0; }
step cost_model 220 cost_model.txt python3 bench/check_cost_model.py ${COST_ARGS:-}
grep -v "^\[rank" "$OUT/bench/cost_model.txt" | tail -22
cp bench/results/all_gather_matmul.csv bench/results/matmul_reduce_scatter.csv "$OUT/bench/" 2>/dev/null
step ag_loopback 140 ag_loopback.txt python3 bench/bench_all_gather_matmul.py --mode loopback-op --Ms 8192
step rs_loopback 100 rs_loopback.txt python3 bench/bench_matmul_reduce_scatter.py --mode loopback-op --Ms 8192
grep -hv "^\[rank" "$OUT/bench/ag_loopback.txt" "$OUT/bench/rs_loopback.txt" | tail -30
pack
