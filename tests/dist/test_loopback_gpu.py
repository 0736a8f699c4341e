"""The loopback group (W simulated ranks in one process) runs the real ops' code path.

Only this rank's chunk holds meaningful values in loopback (the simulated peers'
buffers are local allocations), so the check is: every op runs the fused path
(or the reference on the loopback transport), returns the right shapes, and the
rows computed from this rank's own shard are right.
"""

import subprocess
import sys

import pytest
import torch

from utils import skip_without_fused

pytestmark = skip_without_fused()  # no GPU, or the CUDA extension was not built

_CODE = r"""
import os, torch
os.environ["MPTP_FORCE_FUSED"] = "1"
import mptp_kernels
from mptp_kernels.symm.loopback import init_loopback_group
W = 4
g = init_loopback_group(W)
A = torch.randn(256, 512, device="cuda", dtype=torch.bfloat16)
B = torch.randn(512, 384, device="cuda", dtype=torch.bfloat16) / 16
A_full, (C,) = torch.ops.mptp.fused_all_gather_matmul(A, [B], 0, g)
assert C.shape == (W * 256, 384) and A_full.shape == (W * 256, 512)
assert torch.equal(A_full[:256], A)
torch.testing.assert_close(C[:256].float(), (A @ B).float(), atol=2e-2, rtol=2e-2)
R = torch.ops.mptp.fused_matmul_reduce_scatter(torch.randn(W * 256, 512, device="cuda", dtype=torch.bfloat16), B, "sum", 0, g)
assert R.shape == (256, 384)
# fp32 takes the reference on the loopback transport
A32 = torch.randn(64, 128, device="cuda")
A_full32, (C32,) = torch.ops.mptp.fused_all_gather_matmul(A32, [torch.randn(128, 32, device="cuda")], 0, g)
assert torch.equal(A_full32[:64], A32)
torch.cuda.synchronize()
mptp_kernels.symm.check_errors()
c = mptp_kernels.path_counts()
assert c[("fused_all_gather_matmul", "fused")] == 1 and c[("fused_matmul_reduce_scatter", "fused")] == 1, c
assert c[("fused_all_gather_matmul", "reference")] == 1, c
print("LOOPBACK OK", c)
"""


def test_loopback_group_runs_the_real_ops():
    out = subprocess.run([sys.executable, "-c", _CODE], capture_output=True, text=True, timeout=300)
    assert "LOOPBACK OK" in out.stdout, out.stdout[-3000:] + out.stderr[-3000:]
