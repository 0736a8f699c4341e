"""The one registry of torch.ops.mptp.* schemas.

Schemas are identical to PyTorch's newest torch.ops.symm_mem ones, so a call site
or graph written for torch.ops.symm_mem.X works with torch.ops.mptp.X. Defined
from Python so the namespace, the fakes and the FX pass exist without the
compiled extension. Implementations:
  * fake (register_fake): the reference code itself; under FakeTensorMode the
    functional collectives it calls only compute shapes and strides, so the
    fake's strides equal the reference's by construction (size-1 dims too, where views of
    fake and real tensors differ: reference._gather_dim_major_strides; test_fake_strides.py);
  * CPU and CUDA: ops.dispatch validates, checks that the ranks agree and runs
    the fused path (CUDA) or the reference on the group's transport.
"""

import torch

from .ops import dispatch, reference

_TAGS = (torch._C.Tag.needs_fixed_stride_order,)

SCHEMAS = {
    "fused_all_gather_matmul": (
        "fused_all_gather_matmul(Tensor A, Tensor[] Bs, int gather_dim, str group_name, "
        "*, bool return_A=True) -> (Tensor?, Tensor[])"
    ),
    "fused_all_gather_scaled_matmul": (
        "fused_all_gather_scaled_matmul(Tensor A, Tensor[] Bs, Tensor A_scale, "
        "Tensor[] B_scales, int gather_dim, str group_name, Tensor?[] biases, "
        "Tensor?[] result_scales, ScalarType?[] out_dtypes, bool[] use_fast_accum) "
        "-> (Tensor, Tensor[])"
    ),
    "fused_matmul_reduce_scatter": (
        "fused_matmul_reduce_scatter(Tensor A, Tensor B, str reduce_op, int scatter_dim, "
        "str group_name) -> Tensor"
    ),
    "fused_scaled_matmul_reduce_scatter": (
        "fused_scaled_matmul_reduce_scatter(Tensor A, Tensor B, Tensor A_scale, Tensor B_scale, "
        "str reduce_op, int orig_scatter_dim, int scatter_dim_after_maybe_reshape, "
        "str group_name, SymInt[]? output_shape, Tensor? bias=None, Tensor? result_scale=None, "
        "ScalarType? out_dtype=None, bool use_fast_accum=False) -> Tensor"
    ),
}

_REFERENCE = {
    "fused_all_gather_matmul": reference.all_gather_matmul,
    "fused_all_gather_scaled_matmul": reference.all_gather_scaled_matmul,
    "fused_matmul_reduce_scatter": reference.matmul_reduce_scatter,
    "fused_scaled_matmul_reduce_scatter": reference.scaled_matmul_reduce_scatter,
}

_CUDA = {
    "fused_all_gather_matmul": dispatch.all_gather_matmul,
    "fused_all_gather_scaled_matmul": dispatch.all_gather_scaled_matmul,
    "fused_matmul_reduce_scatter": dispatch.matmul_reduce_scatter,
    "fused_scaled_matmul_reduce_scatter": dispatch.scaled_matmul_reduce_scatter,
}


def _unview(t):
    """t itself, or where t is a view (of a tensor the op made inside: a layout's movedim, a
    chunk), a tensor over the same storage, offset, sizes and strides that is not one. An output
    that is a view makes autograd refuse any in-place change of it ("output of a function that
    returns multiple views"), where the unfused all-gather and matmul allow it (C += bias,
    relu_)."""
    if t is None or not t._is_view():
        return t
    return t.new_empty(0).set_(t.untyped_storage(), t.storage_offset(), t.size(), t.stride())


def _fresh_outputs(fn):
    def impl(*args, **kwargs):
        out = fn(*args, **kwargs)
        if isinstance(out, tuple):  # (A_out, [C_i])
            return _unview(out[0]), [_unview(c) for c in out[1]]
        return _unview(out)

    return impl


lib = torch.library.Library("mptp", "DEF")
for _name, _schema in SCHEMAS.items():
    lib.define(_schema, tags=_TAGS)
    _impl = _fresh_outputs(_CUDA[_name])
    lib.impl(_name, _impl, "CPU")  # the dispatcher runs the reference on CPU (and checks agreement)
    lib.impl(_name, _impl, "CUDA")
    torch.library.register_fake(f"mptp::{_name}", _REFERENCE[_name], lib=lib)

# Autograd (fused backwards; the scaled ops are forward-only): ops/autograd.py.
from .ops import autograd as _autograd  # noqa: E402

_autograd.register(lib)
