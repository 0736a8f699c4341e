#!/usr/bin/env bash
# One device call: build, test on the GPU, benchmark. Logs go to $OUT.
# Usage (on the GPU machine): bash scripts/gpu_session.sh [tests...] ; BENCH="..." selects benches, e.g.
#   BENCH="python3 bench/bench_all_gather_matmul.py --mode loopback-op --Ms 8192" (the op itself, W=8 loopback)
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
if ! python3 -c "import pytest" 2>/dev/null && ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
fi
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,memory.used --format=csv | tee "$OUT/gpu.txt"
python3 -m pip install -q --no-build-isolation --no-deps -e . 2>&1 | tail -3 | tee "$OUT/build.log"
python3 scripts/build_status.py | tee -a "$OUT/build.log"
TESTS=${TESTS:-"."}
(cd tests && timeout ${TEST_TIMEOUT:-400} python3 -m pytest -q ${PYTEST_ARGS:--x} -p no:cacheprovider $TESTS 2>&1 | tee "$OUT/tests.log" | tail -40)
if [ -n "${BENCH:-}" ]; then
  # Rows land straight in $OUT (seeded with the committed CSVs), so a run cut off by the limit keeps them.
  cp bench/results/*.csv "$OUT/" 2>/dev/null || true
  export MPTP_RESULTS_DIR="$OUT"
  eval "$BENCH" 2>&1 | tee "$OUT/bench.log"
fi
