#!/usr/bin/env bash
# Installs this repository every way a user can and checks that each install
# works and says truly whether the CUDA extension was built, and why not:
# editable and wheel, with MPTP_SKIP_CUDA_BUILD=1, with nvcc hidden from the
# PATH, with cmake hidden; with --with-nvcc also the default (built) installs.
#
#   scripts/check_install.sh PYTHON [--with-nvcc]
#
# PYTHON is a venv's interpreter that has torch (a CPU-only torch build checks
# that case too). Works on a temporary clone of HEAD; the venv's mptp_kernels
# is uninstalled at the end, so use a venv of its own (CI uses its second one).
set -euo pipefail
PY=$(command -v "$1")
WITH_NVCC=${2:-}
repo=$(cd "$(dirname "$0")/.." && pwd)
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
git clone -q "$repo" "$tmp/src"

# A PATH without the named programs: every other program of the PATH, linked into one folder.
path_without() {
  local dir="$tmp/path-without-$(echo "$@" | tr ' ' '-')"
  mkdir -p "$dir"
  local d f b
  IFS=: read -ra dirs <<<"$PATH"
  for d in "${dirs[@]}"; do
    [ -d "$d" ] || continue
    for f in "$d"/*; do
      b=${f##*/}
      [ -e "$dir/$b" ] && continue
      case " $* " in *" $b "*) continue ;; esac
      ln -s "$f" "$dir/$b"
    done
  done
  echo "$dir"
}
NO_NVCC=$(path_without nvcc)
NO_CMAKE=$(path_without cmake)

# check LABEL BUILT(True|False) REASON_SUBSTRING -- COMMAND...: install with COMMAND, then import from elsewhere.
check() {
  local label=$1 built=$2 reason=$3
  shift 4
  if ! (cd "$tmp/src" && "$@") >"$tmp/log" 2>&1; then
    echo "FAIL  $label: the install failed"
    tail -20 "$tmp/log"
    exit 1
  fi
  (cd "$tmp" && "$PY" - "$label" "$built" "$reason") <<'EOF'
import os
import sys

import mptp_kernels
from mptp_kernels.symm import _C

label, built, reason = sys.argv[1], sys.argv[2] == "True", sys.argv[3]
info = mptp_kernels.build_info
where = os.path.dirname(os.path.dirname(mptp_kernels.__file__))
ok = (
    info is not None
    and info.CUDA_EXTENSION_BUILT == built
    and (_C.lib() is not None) == built
    and (built or reason in info.SKIP_REASON)
)
print(f"{'ok   ' if ok else 'FAIL '} {label:38s} built={info and info.CUDA_EXTENSION_BUILT} "
      f"reason={info and info.SKIP_REASON!r} from {where}")
sys.exit(0 if ok else 1)
EOF
}

PIP=("$PY" -m pip install -q --no-build-isolation)
TORCH_CUDA=$("$PY" -c "import torch; print(torch.version.cuda is not None)")
# Where torch is CPU-only, that is the reason whatever the PATH says.
skip_why() { if [ "$TORCH_CUDA" = True ]; then echo "$1"; else echo "CPU-only build"; fi; }

check "editable, MPTP_SKIP_CUDA_BUILD=1" False "MPTP_SKIP_CUDA_BUILD=1" -- env MPTP_SKIP_CUDA_BUILD=1 "${PIP[@]}" -e .
check "wheel, MPTP_SKIP_CUDA_BUILD=1" False "MPTP_SKIP_CUDA_BUILD=1" -- env MPTP_SKIP_CUDA_BUILD=1 "${PIP[@]}" .
check "editable, nvcc not on the PATH" False "$(skip_why "nvcc not found")" -- env -u CUDA_HOME -u CUDA_PATH PATH="$NO_NVCC" "${PIP[@]}" -e .
check "wheel, nvcc not on the PATH" False "$(skip_why "nvcc not found")" -- env -u CUDA_HOME -u CUDA_PATH PATH="$NO_NVCC" "${PIP[@]}" .
check "editable, cmake not on the PATH" False "$(skip_why "cmake not found")" -- env PATH="$NO_CMAKE" "${PIP[@]}" -e .
if [ "$WITH_NVCC" = --with-nvcc ]; then
  check "editable, nvcc + cmake" True "" -- "${PIP[@]}" -e .
  # Back to pure Python in the same tree: the library built above must not be loaded.
  check "editable, then MPTP_SKIP_CUDA_BUILD=1" False "MPTP_SKIP_CUDA_BUILD=1" -- env MPTP_SKIP_CUDA_BUILD=1 "${PIP[@]}" -e .
  check "wheel, nvcc + cmake" True "" -- "${PIP[@]}" .
fi
"$PY" -m pip uninstall -q -y mptp_kernels
echo "check_install: every install behaved"
