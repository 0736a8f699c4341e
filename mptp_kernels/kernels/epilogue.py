"""Output conversion shared by the kernels: FP8 outputs as torch._scaled_mm makes them, NaN poison.

torch._scaled_mm's FP8 output is not the same on every device (measured on torch 2.14 CPU,
`_scaled_mm_out_cpu_emulated`, i.e. with `torch.backends.mkldnn` off; oneDNN on AMX CPUs rounds
through a 16-bit type and writes NaN on overflow instead):

    cpu:  y = ((A * sa) @ (B * sb) + bias) * (1 / scale_result), then y.to(fp8):
          round to nearest even; e4m3fn saturates to +-448, e5m2 overflows to +-inf.
    cuda: cuBLASLt's D scale, y = scale_result * (sa * sb * A @ B + bias); the cast saturates
          (cvt.rn.satfinite). NOTE: not measured here; tests/kernels/test_persistent_matmul.py
          ::test_fp8_out_matches_the_reference_cuda checks it on the GPU.

scale_result only applies to FP8 outputs (the CPU path ignores it for the others; so do we).
SCALED_MM_FP8_OUT holds the table; the kernels take it as constexprs (RS_MODE, E5M2_INF).

NOTE: the Triton interpreter's float -> FP8 cast is wrong (no rounding carry into the exponent,
ties rounded up, no saturation, NaN -> 384), so under TRITON_INTERPRET the kernels convert with
integer arithmetic instead (SOFT_FP8); the GPU always uses the hardware conversion.
"""

import os

import torch
import triton
import triton.language as tl

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
# result_scale: "reciprocal" multiplies by 1 / scale_result (computed in fp32), "multiply" by it.
# e5m2_overflow: "inf" or "saturate" (e4m3fn has no inf and saturates on both devices).
SCALED_MM_FP8_OUT = {
    # NOTE: one convention on every device, the ops' (mptp_kernels.ops.reference.scaled_mm):
    # cuBLASLt's D scale, saturating. CPU torch._scaled_mm divides and overflows e5m2 to inf.
    "cpu": {"result_scale": "multiply", "e5m2_overflow": "saturate"},
    "cuda": {"result_scale": "multiply", "e5m2_overflow": "saturate"},
}
RS_NONE, RS_RECIPROCAL, RS_MULTIPLY = 0, 1, 2


# NOTE: read once, as Triton reads it once (when @triton.jit wraps the kernels at import).
_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"


def interpreting() -> bool:
    return _INTERPRET


def fp8_out_constexprs(device: torch.device, out_dtype: torch.dtype, has_result_scale: bool) -> dict:
    """RS_MODE, E5M2_INF and SOFT_FP8 for a kernel writing out_dtype on device."""
    sem = SCALED_MM_FP8_OUT["cuda" if device.type == "cuda" else "cpu"]
    fp8 = out_dtype in FP8_DTYPES
    rs_mode = RS_NONE
    if has_result_scale and fp8:
        rs_mode = RS_RECIPROCAL if sem["result_scale"] == "reciprocal" else RS_MULTIPLY
    return dict(RS_MODE=rs_mode, E5M2_INF=fp8 and sem["e5m2_overflow"] == "inf", SOFT_FP8=fp8 and interpreting())


@triton.jit
def load_result_scale(RS, RS_MODE: tl.constexpr):
    """The factor applied to the fp32 result before an FP8 cast (1.0 when RS_MODE == 0)."""
    if RS_MODE == 1:
        f = tl.math.div_rn(1.0, tl.load(RS))  # exact, as the CPU's 1 / output_scale
    elif RS_MODE == 2:
        f = tl.load(RS)
    else:
        f = 1.0
    return f


@triton.jit
def _fp8_bits(y, MANT: tl.constexpr, BIAS: tl.constexpr, INF: tl.constexpr):
    """Round-to-nearest-even fp32 -> FP8 bits with integer ops (as c10's conversion).

    y must be NaN or already saturated unless INF (then >= the rounding limit gives inf)."""
    bits = y.to(tl.int32, bitcast=True)
    sign = (bits >> 24) & 0x80
    nonsign = bits & 0x7FFFFFFF
    # Normal: rebias the exponent, add half an ulp minus one plus the kept mantissa's low bit.
    odd = (nonsign >> (23 - MANT)) & 1
    normal = (nonsign + (((BIAS - 127) << 23) + (1 << (22 - MANT)) - 1) + odd) >> (23 - MANT)
    # Subnormal: an fp32 add rounds to the FP8 subnormal grid (RNE), then subtract the magic back.
    magic = tl.full([], ((127 - BIAS) + (23 - MANT) + 1) << 23, tl.int32)
    sub = (nonsign.to(tl.float32, bitcast=True) + magic.to(tl.float32, bitcast=True)).to(tl.int32, bitcast=True) - magic
    res = tl.where(nonsign < ((128 - BIAS) << 23), sub, normal)
    if INF:
        res = tl.where(nonsign >= ((BIAS + 1 + 127) << 23), 0x7C, res)  # 2**(max exp + 1) and inf -> inf
    res = tl.where(nonsign > 0x7F800000, 0x7F, res)
    return (res | sign).to(tl.uint8)


@triton.jit
def _to_fp8(y, dtype: tl.constexpr, MANT: tl.constexpr, BIAS: tl.constexpr, MAX: tl.constexpr,
            LIMIT: tl.constexpr, INF: tl.constexpr, SOFT_FP8: tl.constexpr):  # fmt: skip
    if not INF:
        # NaN-preserving saturation (comparisons with NaN are false).
        y = tl.where(y > MAX, MAX, tl.where(y < -MAX, -MAX, y))
    if SOFT_FP8:
        out = _fp8_bits(y, MANT, BIAS, INF).to(dtype, bitcast=True)
    else:
        out = y.to(dtype)
        if INF:
            # The hardware cast saturates: put the infinities back (LIMIT rounds up past MAX).
            bits = out.to(tl.uint8, bitcast=True)
            inf = (y.to(tl.int32, bitcast=True) >> 24) & 0x80 | 0x7C
            bits = tl.where((y >= LIMIT) | (y <= -LIMIT), inf.to(tl.uint8), bits)
            out = bits.to(dtype, bitcast=True)
    return out


@triton.jit
def to_output(y, dtype: tl.constexpr, E5M2_INF: tl.constexpr, SOFT_FP8: tl.constexpr):
    """fp32 y -> dtype; FP8 as torch._scaled_mm casts (see the module docstring), NaN kept."""
    if dtype == tl.float8e4nv:
        out = _to_fp8(y, dtype, 3, 7, 448.0, 464.0, False, SOFT_FP8)
    elif dtype == tl.float8e5:
        out = _to_fp8(y, dtype, 2, 15, 57344.0, 61440.0, E5M2_INF, SOFT_FP8)
    else:
        out = y.to(dtype)
    return out
