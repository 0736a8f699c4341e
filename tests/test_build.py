"""The extension was compiled where it can be (torch with CUDA, nvcc, cmake), loads, and never links libcuda;
where it was not, the install says why and the package still imports and runs the reference path.

MPTP_EXPECT_CUDA_BUILD=1 (CI with nvcc) fails the run if the extension was not built;
MPTP_EXPECT_CUDA_BUILD=0 (CI's pure-Python pass) fails it if it was.
"""

import ctypes
import os
import subprocess

import pytest
import torch

import mptp_kernels
from mptp_kernels.symm import _C

BUILT = mptp_kernels.build_info is not None and mptp_kernels.build_info.CUDA_EXTENSION_BUILT


def test_build_info_present():
    info = mptp_kernels.build_info
    assert info is not None, "mptp_kernels/_build_info.py missing: install with pip install -e ."
    expect = os.environ.get("MPTP_EXPECT_CUDA_BUILD")
    if expect == "1":
        assert info.CUDA_EXTENSION_BUILT, f"extension not built: {info.SKIP_REASON}"
    elif expect == "0":
        assert not info.CUDA_EXTENSION_BUILT, (
            "extension built, but this run expects a pure-Python install"
        )
    assert (info.SKIP_REASON is None) == info.CUDA_EXTENSION_BUILT, "a skipped build must say why"


@pytest.mark.skipif(
    not BUILT,
    reason="pure-Python install (MPTP_SKIP_CUDA_BUILD=1, no nvcc/cmake, or CPU-only torch)",
)
def test_extension_loads_without_libcuda():
    lib = _C.lib()
    assert lib is not None, _C.why_unavailable()
    assert lib.mptp_abi_version() == _C.ABI_VERSION
    assert lib.mptp_ipc_handle_bytes() == 64
    # The one struct the two sides share (csrc/symm/symm.h AgBeginArgs): a layout that differs
    # would pass every address to the wrong field.
    assert lib.mptp_ag_begin_args_bytes() == ctypes.sizeof(_C.AgBeginArgs) == 912
    theirs, mine = _C.ag_begin_layout(lib)
    assert theirs == mine and len(mine[1]) == len(_C.AgBeginArgs._fields_), (theirs, mine)
    needed = subprocess.run(["readelf", "-d", lib._name], capture_output=True, text=True).stdout
    assert "libcuda.so" not in needed, needed
    if not torch.cuda.is_available():
        # No driver here: resolving driver entry points must fail cleanly, not crash.
        assert lib.mptp_driver_available() == 0


@pytest.mark.skipif(BUILT, reason="the extension is built")
def test_pure_python_install_says_why():
    # The fused path's fallback message carries the install's reason.
    assert _C.lib() is None
    info = mptp_kernels.build_info
    reason = info.SKIP_REASON if info is not None else "the package was not installed with pip"
    assert reason in _C.why_unavailable()


@pytest.mark.parametrize("abi", [1, None])
def test_a_stale_or_foreign_library_is_refused_with_a_reason(tmp_path, monkeypatch, abi):
    """An extension built from older sources (another C ABI, missing newer symbols) must not be
    called: lib() is None and why_unavailable() says to rebuild, so every op runs its reference path."""
    import shutil

    cc = shutil.which("gcc") or shutil.which("cc")
    if cc is None:
        pytest.skip("no C compiler")
    src = tmp_path / "stub.c"
    src.write_text(f"int mptp_abi_version(void) {{ return {abi}; }}\n" if abi is not None else "int unrelated;\n")
    so = tmp_path / "_C.so"
    subprocess.run([cc, "-shared", "-fPIC", str(src), "-o", str(so)], check=True)
    monkeypatch.setattr(_C, "_lib", None)
    monkeypatch.setattr(_C, "_why", None)
    monkeypatch.setattr(_C, "_find", lambda: str(so))
    assert _C.lib() is None
    why = _C.why_unavailable()
    assert f"C ABI {abi}" in why and "rebuild" in why, why
