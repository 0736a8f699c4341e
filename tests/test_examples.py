"""The README's runnable examples work as its commands say, on the CPU (gloo) too."""

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _torchrun(script, *args, timeout=240):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}  # the CPU path, here and in CI
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           os.path.join(ROOT, "examples", script), *args]  # fmt: skip
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    return out.stdout


def test_quickstart_eager_runs_and_matches_the_unfused_math():
    import re

    out = _torchrun("quickstart_eager.py")  # (the two ranks' lines may interleave)
    found = re.findall(r"rank (\d): gathered A equal: (\w+), up rel err ([0-9.e+-]+), y rel err ([0-9.e+-]+), "
                       r"torch.ops up rel err ([0-9.e+-]+)", out)  # fmt: skip
    assert sorted(r for r, *_ in found) == ["0", "1"], out[-2000:]
    for rank, equal, up, y, up_op in found:
        # bf16 outputs: one rounding (2**-8) bounds the relative errors with margin
        assert equal == "True" and float(up) < 1e-2 and float(y) < 1e-2 and float(up_op) < 1e-2, (rank, equal, up, y)
