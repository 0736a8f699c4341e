"""CUDA implementations: the fused path when it can serve the call, else the reference.

The fused path is used when the extension is built, the group is enabled for
symmetric memory, the inputs qualify and the size heuristic says fusion wins;
otherwise the reference path runs (NCCL) and the reason is logged once.
"""

from collections import Counter

from .. import env
from . import reference

# (op name, "fused" | "reference") -> number of calls; tests read it.
PATH_COUNTS: Counter = Counter()


def _fused():
    try:
        from . import fused
    except ImportError as e:  # triton missing, or no extension
        return None, f"fused path unavailable: {e}"
    return fused, None


def _run(name: str, ref_fn, *args, **kwargs):
    if env.fused_disabled():
        env.log_once((name, "disabled"), "%s: MPTP_DISABLE_FUSED=1, using the reference path", name)
        PATH_COUNTS[(name, "reference")] += 1
        return ref_fn(*args, **kwargs)
    fused, why = _fused()
    if fused is not None:
        impl, why = fused.plan(name, *args, **kwargs)
        if impl is not None:
            PATH_COUNTS[(name, "fused")] += 1
            env.log_once((name, "fused"), "%s: fused path", name)
            return impl()
    env.log_once((name, why), "%s: reference path (%s)", name, why)
    PATH_COUNTS[(name, "reference")] += 1
    return ref_fn(*args, **kwargs)


def all_gather_matmul(A, Bs, gather_dim, group_name, *, return_A=True):
    return _run(
        "fused_all_gather_matmul", reference.all_gather_matmul, A, Bs, gather_dim, group_name,
        return_A=return_A,
    )  # fmt: skip


def all_gather_scaled_matmul(A, Bs, A_scale, B_scales, gather_dim, group_name, biases,
                             result_scales, out_dtypes, use_fast_accum):  # fmt: skip
    return _run(
        "fused_all_gather_scaled_matmul", reference.all_gather_scaled_matmul, A, Bs, A_scale,
        B_scales, gather_dim, group_name, biases, result_scales, out_dtypes, use_fast_accum,
    )  # fmt: skip


def matmul_reduce_scatter(A, B, reduce_op, scatter_dim, group_name):
    return _run(
        "fused_matmul_reduce_scatter", reference.matmul_reduce_scatter, A, B, reduce_op,
        scatter_dim, group_name,
    )  # fmt: skip


def scaled_matmul_reduce_scatter(A, B, A_scale, B_scale, reduce_op, orig_scatter_dim,
                                 scatter_dim_after_maybe_reshape, group_name, output_shape,
                                 bias=None, result_scale=None, out_dtype=None,
                                 use_fast_accum=False):  # fmt: skip
    return _run(
        "fused_scaled_matmul_reduce_scatter", reference.scaled_matmul_reduce_scatter, A, B,
        A_scale, B_scale, reduce_op, orig_scatter_dim, scatter_dim_after_maybe_reshape,
        group_name, output_shape, bias, result_scale, out_dtype, use_fast_accum,
    )  # fmt: skip
