"""Prints one line: is the fused CUDA path of this mptp_kernels install built, usable here, and if not why.

    python scripts/build_status.py

`make install`, `make test` and `examples/demo.py` print it.
"""

import torch

import mptp_kernels


def status() -> str:
    info = mptp_kernels.build_info
    where = mptp_kernels.__file__.rsplit("/", 1)[0]
    if info is None:
        return f"mptp_kernels ({where}): not installed with pip, no build info; the ops run their reference path"
    if not info.CUDA_EXTENSION_BUILT:
        return (
            f"mptp_kernels ({where}): fused CUDA path NOT built ({info.SKIP_REASON}); "
            "every op runs its reference path (collectives + matmul)"
        )
    if not torch.cuda.is_available():
        return (
            f"mptp_kernels ({where}): fused CUDA path built ({info.NVCC_VERSION}), but no GPU is "
            "visible here; CPU tensors run the reference path"
        )
    return (
        f"mptp_kernels ({where}): fused CUDA path built; {torch.cuda.device_count()} GPU(s) visible"
    )


if __name__ == "__main__":
    print(status())
