"""Compiles every kernel variant for sm_90 without a GPU; prints one JSON line per launch.

Run by test_compile_sm90.py in a subprocess with TRITON_INTERPRET=0: the launches of
persistent_matmul / reduce_partials / poison_if_error are captured with CPU tensors (instead of running) and
compiled with triton.compile(target=cuda sm_90), so the GPU-only paths (hardware FP8 casts,
globaltimer, tensor descriptors) are type-checked on machines without a GPU.
"""

import json
import os
import re
import sys

assert os.environ.get("TRITON_INTERPRET", "0") != "1"

import torch  # noqa: E402
import triton  # noqa: E402

try:
    from triton.backends.compiler import GPUTarget
    from triton.runtime.jit import JITFunction, create_function_from_signature  # noqa: F401

    assert hasattr(JITFunction, "_pack_args")
except (ImportError, AssertionError) as e:  # another Triton's internals: nothing to check here
    print("SKIP", e)
    sys.exit(0)

from mptp_kernels.kernels import persistent_matmul as pm  # noqa: E402
from mptp_kernels.kernels import poison as pz  # noqa: E402
from mptp_kernels.kernels import reduce as rd  # noqa: E402

TARGET = GPUTarget("cuda", 90, 32)
captured = []


class _Capture:
    def __init__(self, fn):
        self.fn = fn

    def __getitem__(self, grid):
        return lambda *args, **kwargs: captured.append((self.fn, args, kwargs))


def _compile(fn, args, kwargs):
    """As JITFunction.run compiles (same binder, specialization and attributes), for sm_90."""
    from triton.compiler.compiler import make_backend
    from triton.runtime.jit import create_function_from_signature

    backend = make_backend(TARGET)
    binder = create_function_from_signature(fn.signature, fn.params, backend)
    bound, specialization, options = binder(*args, **kwargs)
    options, signature, constexprs, attrs = fn._pack_args(backend, kwargs, bound, specialization, options)
    src = triton.compiler.ASTSource(fn, signature, constexprs, attrs)
    return triton.compile(src, target=TARGET, options=options.__dict__).asm["ptx"]


def main():
    pm._persistent_matmul_kernel = _Capture(pm._persistent_matmul_kernel)
    pm._persistent_matmul_tma_kernel = _Capture(pm._persistent_matmul_tma_kernel)
    rd._reduce_partials_kernel = _Capture(rd._reduce_partials_kernel)
    pz._poison_kernel = _Capture(pz._poison_kernel)
    fp8 = torch.float8_e4m3fn
    cfg = pm.Config(32, 32, 32, 4, 4, 2)
    M, K, N = 256, 128, 192
    A16, B16 = torch.randn(M, K).half(), torch.randn(K, N).half()
    A8, B8 = torch.randn(M, K).to(fp8), torch.randn(N, K).to(fp8).t()
    one, flags = torch.tensor(1.0), torch.ones(4, dtype=torch.int32)
    consumer = dict(num_chunks=4, flags=flags, mode=pm.MODE_CONSUMER)
    for kernel in ("pointer", "tma"):
        pm.persistent_matmul(A16, [B16], config=cfg, kernel=kernel)
        pm.persistent_matmul(A16, [B16], config=cfg, kernel=kernel, **consumer)
        pm.persistent_matmul(A8, [B8], config=cfg, kernel=kernel, A_scale=one, B_scales=[one],
                             biases=[torch.randn(N).bfloat16()], out_dtype=torch.float8_e5m2,
                             result_scale=one, **consumer)  # fmt: skip
        pm.persistent_matmul(A8, [B8], config=cfg, kernel=kernel, A_scale=torch.ones(M), B_scales=[torch.ones(N)],
                             out_dtype=fp8, result_scale=one)  # fmt: skip
    # The last wave split by K: stream-K shares, and the split tail (consumer, FP8 with scales).
    pm.persistent_matmul(A16, [B16], config=cfg, kernel="tma", num_sms=5, stream_k=7)
    pm.persistent_matmul(A8, [B8], config=cfg, kernel="tma", num_sms=5, stream_k=("split", 2, 2),
                         A_scale=torch.ones(M), B_scales=[torch.ones(N)], **consumer)  # fmt: skip
    pm.persistent_matmul(A16, [B16], config=cfg, num_chunks=2, scatter_to=[torch.empty(M // 2, N).half()] * 2)
    pm.persistent_matmul(A16, [B16], config=cfg, num_chunks=2, flags=torch.zeros(2, dtype=torch.int32),
                         counters=torch.zeros(2, dtype=torch.int32), mode=pm.MODE_PRODUCER)  # fmt: skip
    # Production tiles, 16-byte aligned rows: the loads must stay 16-byte vectorized.
    big = pm.Config(128, 256, 64, 8, 8, 3)
    pm.persistent_matmul(torch.randn(1024, 512).half(), [torch.randn(512, 1024).half()], config=big, kernel="pointer")
    err = torch.zeros(6, dtype=torch.int32)
    rd.reduce_partials(torch.randn(3, 1000).half(), torch.empty(1000, dtype=torch.float8_e5m2), err=err)
    rd.reduce_partials(torch.randn(3, 1000).half(), torch.empty(1000).half())
    for fn, args, kwargs in captured:
        ptx = _compile(fn, args, kwargs)
        row = {
            "kernel": fn.__name__,
            "mode": kwargs.get("MODE"),
            "sk_mode": kwargs.get("SK_MODE", 0),
            "block_n": kwargs.get("BLOCK_N"),
            "cp_async_16": len(re.findall(r"cp\.async\.cg\.shared\.global \[[^]]*\], \[[^]]*\], (?:16|0x10)\b", ptx)),
            "st_v4": "st.global.v4" in ptx,
            "narrow_loads": len(re.findall(r"ld\.global(?:\.\w+)*\.[bu](?:8|16)\b", ptx)),
            "volatile_loads": len(re.findall(r"ld\.volatile", ptx)),
            "globaltimer": "globaltimer" in ptx,
            "fp8_casts": sorted(set(re.findall(r"cvt\.rn\.satfinite\.(\w+)\.f32", ptx))),
        }
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
