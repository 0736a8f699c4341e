#!/usr/bin/env bash
# One device call: host cost of this tree against a base tree (scripts/gpu_host.sh's floors, W = 2
# then 8, ROUNDS rounds), then GPU test groups; each part packed as it ends ($OUT/floors.tgz,
# $OUT/tests.tgz: the device tool returns at most 8 files, and a call cut by its limit keeps what
# was packed). A base of another C ABI carries its own build (BASE_OWN_SO=1, .base/mptp_kernels/_C.so).
#   MPTP_BENCH_COMMIT=<rev> BASE_COMMIT=<rev> BASE_OWN_SO=1 GROUP_A=... bash scripts/gpu_compare.sh
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
t0=$(date +%s)
nvidia-smi --query-gpu=name,clocks.sm --format=csv,noheader | tee "$OUT/gpu.txt"
lscpu | grep "Model name" | tee -a "$OUT/gpu.txt"
python3 -m pip install -q --no-build-isolation --no-deps -e . > "$OUT/build.log" 2>&1; tail -2 "$OUT/build.log"
[ -d .base ] && [ "${BASE_OWN_SO:-0}" != 1 ] && cp mptp_kernels/_C*.so .base/mptp_kernels/
echo "built at $(( $(date +%s) - t0 )) s" | tee -a "$OUT/gpu.txt"
mkdir -p "$OUT/floors"
floor() {  # floor TREE LABEL COMMIT W ROUND
  local f="$OUT/floors/$2_w$4_r$5.txt"
  PYTHONPATH="$1" MPTP_BENCH_COMMIT="$3" MPTP_TIMEOUT_S=10 MPTP_RESULTS_DIR="$OUT/floors/$2" timeout "${FLOOR_LIMIT:-120}" \
    python3 "$1/bench/profile_floor.py" --W "$4" --calls "${CALLS:-200}" > "$f" 2>&1
  echo "== round $5 W=$4 $2 ($(( $(date +%s) - t0 )) s)"; grep " op " "$f" | grep -v "^\[rank" | cut -c1-120
}
for r in $(seq 1 "${ROUNDS:-1}"); do
  for w in ${WS:-2 8}; do
    [ -d .base ] && floor .base base "${BASE_COMMIT:-base}" "$w" "$r"
    floor . new "${MPTP_BENCH_COMMIT:-new}" "$w" "$r"
  done
done 2>&1 | tee "$OUT/floors/summary.txt"
(cd "$OUT" && tar czf floors.tgz floors && rm -rf floors)
if [ -n "${GROUP_A:-}" ]; then
  mkdir -p "$OUT/tests"
  SKIP_BUILD=1 OUT="$OUT/tests" TEST_TIMEOUT=${TEST_TIMEOUT:-300} bash scripts/gpu_tests.sh > "$OUT/tests/run.txt" 2>&1
  # SERIAL: tests that must have the GPU to themselves (test_symm_gpu's memory test reads the
  # device's free memory, which other groups' processes move by up to a GiB)
  if [ -n "${SERIAL:-}" ]; then
    (cd tests && eval "timeout ${SERIAL_TIMEOUT:-200} python3 -m pytest -q -rfE -p no:cacheprovider $SERIAL" > "$OUT/tests/tests_serial.log" 2>&1; echo "exit $?" >> "$OUT/tests/tests_serial.log")
  fi
  for f in "$OUT"/tests/tests_*.log; do echo "== $f"; grep -E "^(FAILED|ERROR)" "$f" | head; tail -2 "$f"; done
  (cd "$OUT" && tar czf tests.tgz tests && rm -rf tests)
fi
echo "done at $(( $(date +%s) - t0 )) s"
