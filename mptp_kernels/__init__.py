"""mptp_kernels: communication-overlapping matmuls for tensor-parallel PyTorch.

Importing registers torch.ops.mptp.* (fused_all_gather_matmul,
fused_all_gather_scaled_matmul, fused_matmul_reduce_scatter,
fused_scaled_matmul_reduce_scatter).
"""

from . import _library  # noqa: F401  (registers torch.ops.mptp)
from .compile import disable_micro_pipeline_tp, enable_micro_pipeline_tp, explain
from .compile.cache_key import install as _install_cache_key
from .compile.ordering import install as _install_ordering
from .ops import (
    enable_symm_mem_for_group,
    fused_all_gather_matmul,
    fused_all_gather_scaled_matmul,
    fused_matmul_reduce_scatter,
    fused_scaled_matmul_reduce_scatter,
    is_symm_mem_enabled_for_group,
    restride_A_for_fused_matmul_reduce_scatter,
    restride_A_shard_for_fused_all_gather_matmul,
    shutdown,
)

_install_ordering()  # compiled graphs keep torch.ops.mptp calls in order with their collectives
_install_cache_key()  # compile caches tell graphs apart by the sizes of the groups the ops name


def path_counts() -> dict:
    """{(op name, "fused" | "reference"): calls} of the CUDA ops in this process (CPU calls run the reference)."""
    from .ops.dispatch import PATH_COUNTS

    return dict(PATH_COUNTS)


_TP = ("ColumnParallelLinear", "FusedColwiseParallel", "FusedRowwiseParallel", "RowParallelLinear")


def __getattr__(name):
    # The tensor-parallel layers (mptp_kernels.tp) load DTensor: imported on first use.
    if name in _TP:
        from . import tp

        return getattr(tp, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


try:
    from . import _build_info as build_info
except ImportError:  # running from a source tree that was never installed
    build_info = None

__version__ = "0.1.0"

__all__ = [
    "ColumnParallelLinear",
    "FusedColwiseParallel",
    "FusedRowwiseParallel",
    "RowParallelLinear",
    "build_info",
    "disable_micro_pipeline_tp",
    "enable_micro_pipeline_tp",
    "enable_symm_mem_for_group",
    "explain",
    "fused_all_gather_matmul",
    "fused_all_gather_scaled_matmul",
    "fused_matmul_reduce_scatter",
    "fused_scaled_matmul_reduce_scatter",
    "is_symm_mem_enabled_for_group",
    "path_counts",
    "restride_A_for_fused_matmul_reduce_scatter",
    "restride_A_shard_for_fused_all_gather_matmul",
    "shutdown",
]
