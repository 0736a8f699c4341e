"""Every kernel variant compiles for sm_90 on a machine without a GPU (see _compile_sm90.py).

The interpreter never runs the GPU-only code (hardware FP8 casts, the globaltimer timeout,
tensor descriptors), so this is the CPU check that it still compiles (as JITFunction.run
would, with the same specialization), that only the poison check loads the error record,
and that production tiles keep 16-byte vectorized loads and stores.
"""

import json
import os
import subprocess
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.skipif(torch.cuda.is_available(), reason="the GPU tests compile and run the kernels")
def test_kernels_compile_for_sm90():
    env = dict(os.environ, TRITON_INTERPRET="0", CUDA_VISIBLE_DEVICES="")
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_compile_sm90.py")
    proc = subprocess.run([sys.executable, script], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    if proc.stdout.startswith("SKIP"):
        pytest.skip(proc.stdout.strip())
    rows = [json.loads(line) for line in proc.stdout.splitlines()]
    # 15 launches, plus a poison check after each of the 5 consumer launches and the reduction.
    assert len(rows) == 21, [r["kernel"] for r in rows]
    assert sorted(r["sk_mode"] for r in rows if r["kernel"] == "_persistent_matmul_tma_kernel") == [0, 0, 0, 0, 1, 2]
    (big,) = [r for r in rows if r["block_n"] == 256]
    # NOTE: element-wise (8/16-bit) loads mean a lost contiguity hint: B loaded 25x slower.
    assert big["cp_async_16"] > 0 and big["narrow_loads"] == 0 and big["st_v4"], f"not vectorized: {big}"
    # The host-mapped error record is read by the poison check alone (one read per output), never
    # per program of a matmul or a reduction: each read crosses PCIe.
    assert sum(r["kernel"] == "_poison_kernel" for r in rows) == 6
    for r in rows:
        if r["kernel"] == "_poison_kernel":
            assert r["volatile_loads"] >= 1, r
            continue
        assert r["volatile_loads"] == 0, r
        if r["kernel"] == "_reduce_partials_kernel":
            continue
        # consumer: the timed wait (its record and clock checks are atomics, once per 2048 polls);
        # a split last wave: the timed wait for the other units' pieces
        assert r["globaltimer"] == (r["mode"] == 1 or r["sk_mode"] != 0), r
    casts = sorted({c for r in rows for c in r["fp8_casts"]})
    assert casts == ["e4m3x2", "e5m2x2"], casts
