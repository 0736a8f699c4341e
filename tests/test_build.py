"""The extension was compiled (where torch has CUDA and nvcc exists), loads, and never links libcuda."""

import os
import subprocess

import pytest
import torch

import mptp_kernels
from mptp_kernels.symm import _C


def test_build_info_present():
    info = mptp_kernels.build_info
    assert info is not None, "mptp_kernels/_build_info.py missing: install with pip install -e ."
    if os.environ.get("MPTP_EXPECT_CUDA_BUILD") == "1":
        assert info.CUDA_EXTENSION_BUILT, f"extension not built: {info.SKIP_REASON}"


@pytest.mark.skipif(
    mptp_kernels.build_info is None or not mptp_kernels.build_info.CUDA_EXTENSION_BUILT,
    reason="pure-Python install (MPTP_SKIP_CUDA_BUILD=1 or torch without CUDA)",
)
def test_extension_loads_without_libcuda():
    lib = _C.lib()
    assert lib is not None, _C.why_unavailable()
    assert lib.mptp_abi_version() == 1
    assert lib.mptp_ipc_handle_bytes() == 64
    needed = subprocess.run(["readelf", "-d", lib._name], capture_output=True, text=True).stdout
    assert "libcuda.so" not in needed, needed
    if not torch.cuda.is_available():
        # No driver here: resolving driver entry points must fail cleanly, not crash.
        assert lib.mptp_driver_available() == 0
