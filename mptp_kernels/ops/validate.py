"""Input validation shared by every implementation.

NOTE: every check here is local (shapes, dtypes, devices, group lookup), so each
rank raises the same error before any communication starts.
"""

import contextlib
import math
from enum import Enum
from typing import Optional, Sequence

import torch
import torch.distributed.distributed_c10d as c10d

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
# What torch._scaled_mm writes (CPU and CUDA); anything else is an error there.
SCALED_OUT_DTYPES = FP8_DTYPES + (torch.bfloat16, torch.float16, torch.float32)
_REDUCE_OPS = ("sum", "avg")

# c10/core/ScalarType.h order (stable since torch 2.1): ScalarType arguments arrive as
# these integers through the dispatcher (checked by tests/ops/test_validate.py).
_SCALAR_TYPES = {
    0: torch.uint8, 1: torch.int8, 2: torch.int16, 3: torch.int32, 4: torch.int64,
    5: torch.float16, 6: torch.float32, 7: torch.float64, 11: torch.bool,
    15: torch.bfloat16, 23: torch.float8_e5m2, 24: torch.float8_e4m3fn,
    25: torch.float8_e5m2fnuz, 26: torch.float8_e4m3fnuz,
}  # fmt: skip


class ScaleMode(Enum):
    TENSOR_WISE = "tensor-wise"
    ROW_WISE_SHARDED = "row-wise-sharded"
    ROW_WISE_REPLICATED = "row-wise-replicated"


def to_dtype(x, arg: str = "out_dtypes") -> Optional[torch.dtype]:
    """Maps a ScalarType integer (or a dtype, or None) to a torch.dtype; ValueError naming arg."""
    if x is None or isinstance(x, torch.dtype):
        return x
    if isinstance(x, int) and x in _SCALAR_TYPES:
        return _SCALAR_TYPES[x]
    raise ValueError(f"{arg}: unrecognized scalar type {x!r}")


def scaled_out_dtype(x, arg: str = "out_dtype") -> Optional[torch.dtype]:
    """to_dtype(x), which must be one that torch._scaled_mm writes (or None: A's dtype)."""
    d = to_dtype(x, arg)
    if d is not None and d not in SCALED_OUT_DTYPES:
        raise ValueError(f"{arg}: torch._scaled_mm writes {[str(t) for t in SCALED_OUT_DTYPES]}, "
                         f"got {d}")  # fmt: skip
    return d


def group_size(group_name: str) -> int:
    """World size of `group_name`; ValueError naming the group if it is unknown."""
    if not isinstance(group_name, str):
        raise ValueError(f"group_name: expected a str, got {type(group_name).__name__}")
    try:
        return c10d._get_group_size_by_name(group_name)
    except Exception as e:  # noqa: BLE001 - c10d raises various types
        raise ValueError(
            f"group_name: no process group named {group_name!r} is registered ({e})"
        ) from None


def resolve_output_shape(output_shape, rows: int, N: int) -> list:
    """The scaled reduce-scatter's output_shape with a -1 resolved as view() would: the last
    entry (always N) may be -1, and one leading entry may be -1 where the rest divide A's rows.
    Anything else is returned as given (symbolic sizes too), for the checks to judge."""
    shape = list(output_shape)
    if shape and type(shape[-1]) is int and shape[-1] == -1:
        shape[-1] = N
    lead = shape[:-1]
    neg = [i for i, d in enumerate(lead) if type(d) is int and d == -1]
    if len(neg) == 1 and all(type(d) is int for d in lead) and type(rows) is int:
        known = -math.prod(lead)  # the -1 times the rest
        if known > 0 and rows % known == 0:
            lead[neg[0]] = rows // known
    return lead + shape[-1:]


def check_output_shape(shape, rows, N) -> None:
    """The scaled reduce-scatter's output_shape (after resolve_output_shape): sizes >= 0, N
    last, A's rows x N elements in all (what view() would need, refused before communicating).

    NOTE: checked only where every size, A's rows and N are ints: a symbolic size (torch.compile
    with dynamic shapes: the fake impl is the reference) is left to view(), which takes a -1
    and would otherwise meet a comparison it cannot guard on (unbacked sizes)."""
    if not shape:
        raise ValueError("output_shape: expected at least one size (N last), got []")
    if not all(type(d) is int for d in (*shape, rows, N)):
        return
    if any(d < 0 for d in shape):
        raise ValueError(f"output_shape: expected sizes >= 0 (one leading -1 at most, resolved "
                         f"from A's rows), got {list(shape)}")  # fmt: skip
    if math.prod(shape) != rows * N or shape[-1] != N:
        raise ValueError(
            f"output_shape: expected {N} last and {rows * N} elements in all "
            f"(A's rows x B's columns), got {list(shape)}"
        )


def scatter_dim_after_reshape(dim, A) -> None:
    """scatter_dim_after_maybe_reshape: a dim of A (torch's CUDA op requires 0 <= d < A.dim();
    a negative one counts from the end here, as the ops' other dims). The output's layout
    comes from orig_scatter_dim and output_shape; this dim is only checked."""
    if type(dim) is not int or not -A.dim() <= dim < A.dim():
        raise ValueError(f"scatter_dim_after_maybe_reshape: expected a dim of A in [{-A.dim()}, "
                         f"{A.dim()}), got {dim!r}")  # fmt: skip


def norm_dim(dim: int, ndim: int, arg: str) -> int:
    if not -ndim <= dim < ndim:
        raise ValueError(f"{arg}: expected a dim in [{-ndim}, {ndim}), got {dim}")
    return dim % ndim


def _check_device(arg: str, t: Optional[torch.Tensor], device: torch.device) -> None:
    if t is not None and t.device != device:
        raise ValueError(f"{arg}: expected a tensor on {device} (A's device), got {t.device}")


def _check_matmul_operands(A, B, arg_b: str, k_expected: int, same_dtype: bool) -> None:
    if not isinstance(B, torch.Tensor) or B.dim() != 2:
        shape = tuple(B.shape) if isinstance(B, torch.Tensor) else type(B).__name__
        raise ValueError(f"{arg_b}: expected a 2-D tensor, got shape {shape}")
    if B.shape[0] != k_expected:
        raise ValueError(
            f"{arg_b}: expected {k_expected} rows to match A's K dim, got shape {tuple(B.shape)}"
        )
    if same_dtype and B.dtype != A.dtype:
        raise ValueError(f"{arg_b}: expected dtype {A.dtype} (A's dtype), got {B.dtype}")
    _check_device(arg_b, B, A.device)


# torch.matmul's dtypes on CUDA (cuBLAS); the CPU's are probed once per dtype (CPU only: a probe
# on CUDA would launch a kernel, maybe inside a capture).
_CUDA_MATMUL = (torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.complex64, torch.complex128)
_CPU_MATMUL: dict = {}


def real_mode():
    """What an eager call runs on: no dispatch mode (fake, proxy, functional), no torch-function mode and no Python
    dispatcher (on while torch.compile and make_fx trace). For probes whose answer is kept for
    every later call: a trace must not fill such a cache with its own answer (found by a hostile
    review: a matmul probed under a FakeTensorMode succeeded for dtypes the CPU refuses, and views
    run under the Python dispatcher gave other size-1 strides than ATen's)."""
    import contextlib

    from torch.utils._python_dispatch import _disable_current_modes

    stack = contextlib.ExitStack()
    stack.enter_context(_disable_current_modes())
    stack.enter_context(torch.autocast("cpu", enabled=False))  # (under autocast a probe runs another dtype)
    no_python_dispatcher = getattr(torch._C, "_DisablePythonDispatcher", None)
    if no_python_dispatcher is not None:
        stack.enter_context(no_python_dispatcher())
    # (nor a torch-function mode: one that upcast torch.matmul made an FP8 probe succeed, a
    # hostile review)
    stack.enter_context(torch._C.DisableTorchFunction())
    return stack


def _cpu_kernel_takes(cache: dict, dtype: torch.dtype, op, dims: int, shape=None, strides=None) -> bool:
    """Whether torch's CPU `op` multiplies two tensors of `dtype`: 1-element ones of `dims` dims,
    or an A of `shape` and `strides` by a [shape[-1], 5] B (remembered per dtype in `cache`;
    probed as an eager call would run it: a probe under a fake mode would say yes to any dtype)."""
    ok = cache.get(dtype)
    if ok is None:
        try:
            with real_mode():
                if shape is None:
                    z = torch.zeros((1,) * dims, dtype=dtype, device="cpu")
                    op(z, z)
                else:
                    z = torch.zeros(64, dtype=dtype, device="cpu")
                    op(z.as_strided(shape, strides), z[: 5 * shape[-1]].view(shape[-1], 5))
            ok = True
        except (RuntimeError, NotImplementedError, TypeError):
            ok = False
        cache[dtype] = ok
    return ok


def matmul_supports(dtype: torch.dtype, device: torch.device) -> bool:
    if device.type == "cuda":
        return dtype in _CUDA_MATMUL
    if device.type != "cpu":
        return True  # meta and others: no kernel to run, no dtype to refuse
    return _cpu_kernel_takes(_CPU_MATMUL, dtype, torch.matmul, 2)


def _check_matmul_dtype(A) -> None:
    """A matmul the reference would run must not fail after the collective, on one rank only."""
    if not matmul_supports(A.dtype, A.device):
        raise ValueError(f"A: torch.matmul does not support dtype {A.dtype} on {A.device.type}")


_CPU_BMM: dict = {}


def _bmm_supports(dtype: torch.dtype) -> bool:
    return _cpu_kernel_takes(_CPU_BMM, dtype, torch.bmm, 3)


def _folds_by(A, skip_ones: bool) -> bool:
    if A.numel() == 0:
        return True
    lead = [(n, st) for n, st in zip(A.shape[:-1], A.stride()[:-1]) if not (skip_ones and n == 1)]
    return all(lead[i][1] == lead[i + 1][1] * lead[i + 1][0] for i in range(len(lead) - 1))


_LENIENT_FOLD: dict = {}  # dtype -> whether this torch's should_fold ignores size-1 dims' strides


def _folds(A) -> bool:
    """torch.matmul(A, B) with A of 3+ dims and B of 2 runs one mm on A's view as a matrix where
    its leading dims are one run of memory (ATen's should_fold), else a bmm. Size-1 dims: torch
    2.14 ignores their strides, 2.13 counts them (found on torch 2.13: an FP8 A [3, 2, 1, 4] with
    strides (8, 4, 8, 1) was handed on as it was, and torch.matmul raised for want of an FP8 bmm);
    where the two rules disagree, this torch's is probed once per dtype (on a dtype without a
    CPU bmm, where the rule decides whether the matmul runs)."""
    lenient = _folds_by(A, skip_ones=True)
    if lenient == _folds_by(A, skip_ones=False):
        return lenient
    return _cpu_kernel_takes(_LENIENT_FOLD, A.dtype, torch.matmul, 4, (3, 2, 1, 4), (8, 4, 8, 1))


def matmul_operand(A):
    """A as the reference hands it to torch.matmul(A, B) (as PyTorch's fallback does): itself,
    except on the CPU where an A of 3+ dims whose leading dims are not one run of memory would take
    bmm, which some dtypes lack where mm has them (FP8: found by a hostile fuzzer, a
    NotImplementedError after the collective): then a contiguous copy, what ATen's own fold does
    (a copy, then one mm: the same bits). Not a refusal: a compile re-runs this on fake tensors
    whose B no longer requires grad, where ATen folds anyway (found by a hostile review)."""
    if (isinstance(A, torch.Tensor) and A.device.type == "cpu" and A.dim() > 2
            and all(type(n) is int for n in A.shape) and all(type(n) is int for n in A.stride())
            and not _bmm_supports(A.dtype) and not _folds(A)):  # fmt: skip
        # NOTE: a copy with every stride canonical: A.contiguous() returns A itself where only a
        # size-1 dim's stride is off, which torch 2.13 still takes to bmm.
        return A.clone(memory_format=torch.contiguous_format)
    return A


def one_element_scale(s, A):
    """A one-element A_scale of more than 2 dims that is not A's row-wise shape, as the 0-d
    tensor-wise scale it is (PyTorch's fallback reads it so; the math would broadcast the
    product to its dims). Anything else as given."""
    if (isinstance(s, torch.Tensor) and isinstance(A, torch.Tensor) and s.numel() == 1 and s.dim() > 2
            and tuple(s.shape) != (*A.shape[:-1], 1)):  # fmt: skip
        return s.reshape(())
    return s


def _check_A(A) -> None:
    if not isinstance(A, torch.Tensor) or A.dim() < 2:
        shape = tuple(A.shape) if isinstance(A, torch.Tensor) else type(A).__name__
        raise ValueError(f"A: expected a tensor with at least 2 dims, got shape {shape}")


def scale_mode(A_shard: torch.Tensor, A_scale: torch.Tensor, gather_dim: int, W: int) -> ScaleMode:
    """The A_scale mode of the scaled all-gather-matmul, from its shape."""
    full = list(A_shard.shape)
    full[gather_dim] *= W
    if tuple(A_scale.shape[:-1]) == tuple(A_shard.shape[:-1]) and A_scale.shape[-1:] == (1,):
        # NOTE: ambiguous with a tensor-wise scale when every leading dim is 1;
        # row-wise is the safe reading (PyTorch does the same).
        return ScaleMode.ROW_WISE_SHARDED
    if A_scale.numel() == 1:
        return ScaleMode.TENSOR_WISE
    if list(A_scale.shape[:-1]) == full[:-1] and A_scale.shape[-1:] == (1,):
        return ScaleMode.ROW_WISE_REPLICATED
    raise ValueError(
        f"A_scale: expected shape {[*A_shard.shape[:-1], 1]} (row-wise sharded), "
        f"{[*full[:-1], 1]} (row-wise replicated) or one element (tensor-wise), "
        f"got {list(A_scale.shape)}"
    )


def check_list(arg: str, lst) -> None:
    if isinstance(lst, torch.Tensor) or not isinstance(lst, (list, tuple)):
        raise ValueError(f"{arg}: expected a list of tensors, got {type(lst).__name__} (wrap a single B in a list)")


def all_gather_matmul(A, Bs: Sequence, gather_dim: int, group_name: str, scaled: bool) -> tuple:
    """Checks the all-gather-matmul inputs; returns (world_size, normalized gather_dim)."""
    check_list("Bs", Bs)
    _check_A(A)
    W = group_size(group_name)
    gather_dim = norm_dim(gather_dim, A.dim(), "gather_dim")
    if scaled and gather_dim == A.dim() - 1:
        raise ValueError(f"gather_dim: the scaled op cannot gather the last (K) dim, got {gather_dim}")
    k = A.shape[-1] * (W if gather_dim == A.dim() - 1 else 1)
    for i, B in enumerate(Bs):
        _check_matmul_operands(A, B, f"Bs[{i}]", k, same_dtype=not scaled)
    if Bs and not scaled:
        _check_matmul_dtype(A)
    if scaled:
        if A.dtype not in FP8_DTYPES:
            raise ValueError(f"A: expected a float8 dtype for the scaled op, got {A.dtype}")
        for i, B in enumerate(Bs):
            if B.dtype not in FP8_DTYPES:
                raise ValueError(f"Bs[{i}]: expected a float8 dtype, got {B.dtype}")
    return W, gather_dim


def all_gather_scaled_lists(
    A, Bs, A_scale, B_scales, biases, result_scales, out_dtypes, use_fast_accum, gather_dim, W
) -> ScaleMode:
    n = len(Bs)
    for arg, lst in (
        ("B_scales", B_scales),
        ("biases", biases),
        ("result_scales", result_scales),
        ("out_dtypes", out_dtypes),
        ("use_fast_accum", use_fast_accum),
    ):
        if len(lst) != n:
            raise ValueError(f"{arg}: expected {n} entries (one per B), got {len(lst)}")
    _check_device("A_scale", A_scale, A.device)
    for i in range(n):
        _check_device(f"B_scales[{i}]", B_scales[i], A.device)
        _check_device(f"biases[{i}]", biases[i], A.device)
        _check_device(f"result_scales[{i}]", result_scales[i], A.device)
    for i in range(n):  # (a K gather_dim was refused by all_gather_matmul)
        _check_epilogue(f"[{i}]", Bs[i].shape[1], B_scales[i], biases[i], result_scales[i], lists=True)
    mode = scale_mode(A, A_scale, gather_dim, W)
    # The A_scale that reaches _scaled_mm: the gathered one when row-wise sharded.
    a_numel = A_scale.numel() * (W if mode == ScaleMode.ROW_WISE_SHARDED else 1)
    for i in range(n):
        _check_scale_pair(f"B_scales[{i}]", a_numel, mode != ScaleMode.TENSOR_WISE, A_scale.dtype,
                          B_scales[i], Bs[i].shape[1])  # fmt: skip
    return mode


def _check_scale_pair(arg: str, a_numel: int, a_rowwise: bool, a_dtype, B_scale, N: int) -> None:
    """torch._scaled_mm pairs a tensor-wise A_scale with a tensor-wise B_scale, a row-wise one with [1, N].

    NOTE: a mixed pair is an error in _scaled_mm on every device; the CPU reference (and a
    CUDA FP8 output) would compute it, so it is rejected here, before any communication.
    """
    if B_scale.dim() > 2:  # (torch._scaled_mm rejects it; the reference would broadcast the product)
        raise ValueError(f"{arg}: expected one element or [1, {N}] with at most 2 dims, got shape "
                         f"{list(B_scale.shape)}")  # fmt: skip
    # NOTE: tensor-wise too: torch._scaled_mm takes float32 scales only (the fused path would
    # convert others, the reference raise after its collectives).
    if a_dtype != torch.float32 or B_scale.dtype != torch.float32:
        raise ValueError(f"A_scale, {arg}: scales must be float32 (as torch._scaled_mm's), "
                         f"got {a_dtype} and {B_scale.dtype}")  # fmt: skip
    if a_numel == 1 and B_scale.numel() == 1:
        return
    if a_rowwise and tuple(B_scale.shape) == (1, N):
        return
    a_mode = "tensor-wise" if a_numel == 1 else "row-wise"
    want = f"shape [1, {N}]" if a_numel != 1 else "one element" + (f" or shape [1, {N}]" if a_rowwise else "")
    raise ValueError(
        f"{arg}: A_scale is {a_mode}, so _scaled_mm expects {want}, got {list(B_scale.shape)}"
    )


def _check_epilogue(idx: str, N: int, B_scale, bias, result_scale, lists: bool = False) -> None:
    """B_scale, bias and result_scale shapes as torch._scaled_mm accepts them.

    NOTE: checked here, before any communication, so a bad one raises on every rank
    (the CPU reference would otherwise broadcast e.g. an [M, 1] B_scale as a row scale,
    or raise after the collectives have started, leaving the peers waiting).
    """
    s = "s" if lists else ""
    if B_scale.numel() != 1 and tuple(B_scale.shape) != (1, N):
        raise ValueError(
            f"B_scale{s}{idx}: expected one element (tensor-wise) or shape [1, {N}] (row-wise), "
            f"got {list(B_scale.shape)}"
        )
    # NOTE: [1, N] too: _scaled_mm checks a bias's numel (CUDA) or broadcasts it (CPU); the
    # dispatcher hands every implementation the [N] view (dispatch._canonical).
    b = f"bias{'es' if lists else ''}{idx}"
    if bias is not None and tuple(bias.shape) not in ((N,), (1, N)):
        raise ValueError(f"{b}: expected shape [{N}] or [1, {N}], got {list(bias.shape)}")
    if bias is not None and bias.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(f"{b}: expected bf16, fp16 or fp32, got {bias.dtype}")
    rs_bad = result_scale is not None and (result_scale.numel() != 1 or result_scale.dtype != torch.float32)
    if rs_bad:
        raise ValueError(
            f"result_scale{s}{idx}: expected one float32 element (as _scaled_mm), got shape "
            f"{list(result_scale.shape)} {result_scale.dtype}"
        )


def matmul_reduce_scatter(A, B, reduce_op: str, scatter_dim: int, group_name: str, scaled: bool):
    """Checks the matmul-reduce-scatter inputs; returns (world_size, normalized scatter_dim)."""
    _check_A(A)
    W = group_size(group_name)
    if reduce_op not in _REDUCE_OPS:
        raise ValueError(f"reduce_op: expected one of {_REDUCE_OPS}, got {reduce_op!r}")
    _check_matmul_operands(A, B, "B", A.shape[-1], same_dtype=not scaled)
    if not scaled:
        _check_matmul_dtype(A)
    if scatter_dim is not None:  # the scaled op checks its output_shape itself
        scatter_dim = norm_dim(scatter_dim, A.dim(), "scatter_dim")
        check_divisible([*A.shape[:-1], B.shape[1]], scatter_dim, W, "scatter_dim")
    if scaled:
        for arg, t in (("A", A), ("B", B)):
            if t.dtype not in FP8_DTYPES:
                raise ValueError(f"{arg}: expected a float8 dtype for the scaled op, got {t.dtype}")
    return W, scatter_dim


def check_divisible(out_shape, dim: int, W: int, arg: str) -> None:
    if out_shape[dim] % W != 0:
        raise ValueError(
            f"{arg}: the output dim {dim} has size {out_shape[dim]}, "
            f"expected a multiple of the world size {W}"
        )


def scaled_rs_extras(A, A_scale, B_scale, bias, result_scale, N: Optional[int] = None) -> None:
    for arg, t in (("A_scale", A_scale), ("B_scale", B_scale), ("bias", bias),
                   ("result_scale", result_scale)):  # fmt: skip
        _check_device(arg, t, A.device)
    if N is not None:
        _check_epilogue("", N, B_scale, bias, result_scale)
    a_rowwise = tuple(A_scale.shape) == (*A.shape[:-1], 1)
    if A_scale.numel() != 1 and not a_rowwise:
        raise ValueError(
            f"A_scale: expected one element (tensor-wise) or shape {[*A.shape[:-1], 1]} "
            f"(row-wise), got {list(A_scale.shape)}"
        )
    if N is not None:
        _check_scale_pair("B_scale", A_scale.numel(), a_rowwise, A_scale.dtype, B_scale, N)


def autocast_dtype(device: torch.device) -> Optional[torch.dtype]:
    """The dtype of the autocast region active for device's type, or None."""
    dt = device.type
    return torch.get_autocast_dtype(dt) if _autocast_on(dt) else None


def _autocast_on(dt: str) -> bool:
    """Whether an autocast region is active for device type dt (the ops know cpu and cuda)."""
    return (dt == "cuda" or dt == "cpu") and torch.is_autocast_enabled(dt)


def no_autocast(t):
    """Autocast off for t's device type (a no-op context where it is off already). NOTE: the ops
    compute in their inputs' dtypes on every path, forward and backward: the schema's (and the fake
    impl's) output dtypes, as PyTorch's symm_mem ops; the fused path never autocasts, so neither may
    the reference (ranks on different paths would otherwise disagree)."""
    if isinstance(t, torch.Tensor) and _autocast_on(t.device.type):
        return torch.autocast(t.device.type, enabled=False)
    return _NULL_CONTEXT


_NULL_CONTEXT = contextlib.nullcontext()  # (reusable and reentrant: one for every call)
