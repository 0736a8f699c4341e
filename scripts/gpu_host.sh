#!/usr/bin/env bash
# Host cost per fused call (issue 14), this tree against a base tree, in one device call, then the
# GPU tests (GROUP_A/B/C, as scripts/gpu_tests.sh, after the timings: they would disturb them).
#   git archive <base rev> mptp_kernels bench | tar -x -C .base   (.base: git-ignored, carried)
#   MPTP_BENCH_COMMIT=<this rev> BASE_COMMIT=<base rev> bash scripts/gpu_host.sh
# The base runs on this tree's build of the extension (copied in: the C ABI must be the same).
# bench/profile_floor.py times each op and its driver calls alone, base and this tree in turn
# (W = 2, then 8); py-spy (.whl/py-spy, carried) profiles this tree's ops (bench/spy_summary.py).
# The base tree must be carried and have the built extension copied in (the script does, but a
# later call that carries .base again replaces it: copy again).
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
BASE=${BASE:-.base}
nvidia-smi --query-gpu=name,clocks.sm --format=csv,noheader | tee "$OUT/gpu.txt"
lscpu | grep "Model name" | tee -a "$OUT/gpu.txt"
python3 -m pip install -q --no-build-isolation --no-deps -e . > "$OUT/build.log" 2>&1; tail -2 "$OUT/build.log"
# A base of another C ABI carries its own build (BASE_OWN_SO=1); else this tree's is copied in.
[ -d "$BASE" ] && [ "${BASE_OWN_SO:-0}" != 1 ] && cp mptp_kernels/_C*.so "$BASE/mptp_kernels/"
floor() {  # floor TREE LABEL W
  local d="$OUT/$2"; mkdir -p "$d"
  PYTHONPATH="$1" MPTP_BENCH_COMMIT="$3" MPTP_TIMEOUT_S=10 MPTP_RESULTS_DIR="$d" timeout 150 \
    python3 "$1/bench/profile_floor.py" --W "$4" --calls "${CALLS:-200}" > "$d/floor_w$4.txt" 2>&1
  echo "== $2 W=$4"; grep -v "^\[rank" "$d/floor_w$4.txt" | grep " op " | cut -c1-120
}
for w in ${WS:-2 8}; do
  [ -d "$BASE" ] && floor "$BASE" base "${BASE_COMMIT:-base}" "$w"
  floor . new "${MPTP_BENCH_COMMIT:-new}" "$w"
done
if [ -x .whl/py-spy ]; then
  for op in ${SPY:-ag rs}; do
    timeout 60 .whl/py-spy record --nonblocking -r 500 -f raw -o "$OUT/spy_$op.txt" -- \
      python3 bench/spy_loop.py --op "$op" --path fused --W 2 --seconds 6 > "$OUT/spy_$op.log" 2>&1
    python3 bench/spy_summary.py "$OUT/spy_$op.txt" --top 30 > "$OUT/spy_${op}_summary.txt" 2>&1
    tail -1 "$OUT/spy_$op.log"; head -45 "$OUT/spy_${op}_summary.txt" | tail -12
  done
fi
[ -n "${GROUP_A:-}" ] && SKIP_BUILD=1 TEST_TIMEOUT=${TEST_TIMEOUT:-300} bash scripts/gpu_tests.sh
# Everything into $OUT/all.tgz (the device tool returns at most 8 files).
(cd "$OUT" && tar czf /tmp/all.tgz . && find . -type f -delete && mv /tmp/all.tgz all.tgz)
