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


# The fused all-gather-matmul at a Llama-70B shape in loopback, where the chunk copies are
# device-local: a copy that needs an SM must never wait behind the consumer holding every SM
# (seen on the H200: FP8 row-wise timed out waiting for chunk 2). Every peer's buffer holds its
# own random shard (and row scales), written only after the warm-up call, so a chunk read before
# its copy landed shows up as a wrong chunk; checked eager and from a CUDA graph.
_PROD = r"""
import math, os, sys, torch
import mptp_kernels
from mptp_kernels.symm import primitives as P
from mptp_kernels.symm.loopback import init_loopback_group
kind = sys.argv[1]
W, M, K, N = 8, 8192, 8192, 7168
rows = M // W
g = init_loopback_group(W)
FP8 = torch.float8_e4m3fn
torch.manual_seed(0)
def shard_data():
    A = torch.randn(rows, K, device="cuda")
    if kind == "bf16":
        return A.bfloat16(), None
    return A.to(FP8), (torch.rand(rows, 1, device="cuda") + 0.5 if kind == "fp8_row" else None)
if kind == "bf16":
    B = (torch.randn(K, N, device="cuda") * K ** -0.5).bfloat16()
    sb = None
else:
    B = (torch.randn(N, K, device="cuda") * K ** -0.5).to(FP8).t()
    sb = torch.rand(1, N, device="cuda") + 0.5 if kind == "fp8_row" else torch.tensor(0.5, device="cuda")
A0, sa0 = shard_data()
sa_t = torch.tensor(2.0, device="cuda")
def call():
    if kind == "bf16":
        return torch.ops.mptp.fused_all_gather_matmul(A0, [B], 0, g)[1][0]
    sa = sa0 if sa0 is not None else sa_t
    return torch.ops.mptp.fused_all_gather_scaled_matmul(
        A0, [B], sa, [sb], 0, g, [None], [None], [torch.bfloat16], [True])[1][0]
call(); torch.cuda.synchronize()  # warm-up: peers' buffers still hold zeros
ws = P.lookup(g, torch.device("cuda", 0))
shards, scales = [A0], [sa0]
nA = rows * K * A0.element_size()
off = math.ceil(nA / 256) * 256
for p in range(1, W):
    a, s = shard_data()
    shards.append(a); scales.append(s)
    ws.buffers[p][:nA].copy_(a.view(torch.uint8).view(-1) if a.element_size() == 1 else a.view(-1).view(torch.uint8))
    if s is not None:
        ws.buffers[p][off : off + rows * 4].copy_(s.view(-1).view(torch.uint8))
A_cat = torch.cat(shards)
if kind == "bf16":
    ref = A_cat.float() @ B.float()
else:
    sa_cat = torch.cat(scales) if sa0 is not None else sa_t
    ref = torch._scaled_mm(A_cat, B, sa_cat, sb, out_dtype=torch.bfloat16, use_fast_accum=True).float()
def check(C, what):
    torch.cuda.synchronize()
    mptp_kernels.symm.check_errors()
    for c in range(W):
        r = slice(c * rows, (c + 1) * rows)
        err = ((C[r].float() - ref[r]).norm() / ref[r].norm()).item()
        assert err < 1e-2, f"{what}: chunk {c} rel err {err:.3e}"
check(call(), "eager")
# the eager call asked for copy-engine copies unless MPTP_CE_COPIES=0 (the driver accepts them for
# local buffers: seen on the H200); a capture never does
assert P.ce_copies(ws.side) == (os.environ["MPTP_CE_COPIES"] == "1"), "copy-engine copies not as configured"
graph = torch.cuda.CUDAGraph()
with torch.cuda.graph(graph):
    Cg = call()
Cg.fill_(float("nan"))
graph.replay()
check(Cg, "graph replay")
c = mptp_kernels.path_counts()
assert c.get((("fused_all_gather_matmul" if kind == "bf16" else "fused_all_gather_scaled_matmul"), "fused"), 0) == 3, c
print("PROD OK", kind, "MPTP_CE_COPIES", os.environ["MPTP_CE_COPIES"])
"""


@pytest.mark.parametrize("ce", ["1", "0"])
@pytest.mark.parametrize("kind", ["bf16", "fp8_tensor", "fp8_row"])
def test_fused_all_gather_at_production_size_never_starves_its_copies(kind, ce):
    env = dict(__import__("os").environ, MPTP_FORCE_FUSED="1", MPTP_TIMEOUT_S="20", MPTP_CE_COPIES=ce)
    out = subprocess.run([sys.executable, "-c", _PROD, kind], capture_output=True, text=True, timeout=240, env=env)
    assert "PROD OK" in out.stdout, out.stdout[-3000:] + out.stderr[-3000:]
