#!/usr/bin/env bash
# Named by earlier logs: scripts/gpu_once.sh does this call (tests, then benches) within a time budget.
# Usage (device): GROUP_A=... GROUP_B=... GROUP_C=... [BENCH=0] bash scripts/gpu_check.sh
exec bash "$(dirname "$0")/gpu_once.sh" "$@"
