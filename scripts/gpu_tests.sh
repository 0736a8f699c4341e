#!/usr/bin/env bash
# One device call: build, then GPU test groups in parallel (they share the GPU), logs to $OUT.
# Usage: GROUP_A="dist/test_safety_gpu.py -k 'a or b'" GROUP_B="kernels" bash scripts/gpu_tests.sh (each group is
# eval'd: single quotes inside the double ones keep the -k expression one argument; '\"a or b\"' passes
# the double quotes to pytest, which refuses the expression: seen on the H100, 2026-12-05)
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
if ! python3 -c "import pytest" 2>/dev/null && ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
fi
nvidia-smi --query-gpu=name,clocks.sm,memory.used --format=csv,noheader | tee "$OUT/gpu.txt"
# NOTE: the device's copy of the tree may carry a stale .git (seen: 9134f4e's rows labelled 47c8526)
[ -n "${MPTP_BENCH_COMMIT:-}" ] || echo "warning: MPTP_BENCH_COMMIT unset: bench CSV rows take this copy's git HEAD, which may be stale" | tee -a "$OUT/gpu.txt"
# SKIP_BUILD=1: the caller built it (scripts/gpu_host.sh)
[ "${SKIP_BUILD:-0}" = 1 ] || python3 -m pip install -q --no-build-isolation --no-deps -e . 2>&1 | tail -3 | tee "$OUT/build.log"
python3 -c "import torch, triton, mptp_kernels as m; print('torch', torch.__version__, 'triton', triton.__version__, 'built:', m.build_info.CUDA_EXTENSION_BUILT)" | tee -a "$OUT/build.log"
export MPTP_FALLBACK_LOG="$OUT/fallback_paths.txt"
i=0
for group in "${GROUP_A:-}" "${GROUP_B:-}" "${GROUP_C:-}"; do
  [ -z "$group" ] && continue
  i=$((i+1))
  (cd tests && eval "timeout ${TEST_TIMEOUT:-500} python3 -m pytest -q -rfE -p no:cacheprovider --durations=15 $group" > "$OUT/tests_$i.log" 2>&1; echo "exit $?" >> "$OUT/tests_$i.log") &
done
wait
for f in "$OUT"/tests_*.log; do echo "== $f"; tail -25 "$f"; done
