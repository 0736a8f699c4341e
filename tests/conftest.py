import os
import sys

import pytest
import torch

# NOTE: Triton picks the interpreter when a kernel module is imported, so this
# must be set before any test module imports mptp_kernels.kernels.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

# NOTE: no precompiled C++ headers in Inductor's CPU compiles (this process and the workers it
# starts). Tests compile with cpp.vec_isa_ok=False for speed; a header precompiled by such a
# compile was then reused by a later vectorized cpp_wrapper compile in the same process, which
# failed with "'at::vec' has not been declared" (torch 2.14.1; seen in CI on 0bfbfe8, where
# an in-process compile of compile/test_dynamic_pass_attack.py came before
# ops/test_registration.py's). Only build speed depends on it.
os.environ.setdefault("TORCHINDUCTOR_CPP_CACHE_PRECOMPILE_HEADERS", "0")
if hasattr(torch._inductor.config, "cpp_cache_precompile_headers"):
    torch._inductor.config.cpp_cache_precompile_headers = False

from dist.harness import Workers  # noqa: E402


@pytest.fixture(scope="session")
def workers2():
    w = Workers(2)
    yield w
    w.close()


@pytest.fixture(scope="session")
def workers3():
    w = Workers(3)
    yield w
    w.close()


@pytest.fixture(scope="session")
def pg1():
    """A world-size-1 gloo group in this process (validation, opcheck, fakes)."""
    import torch.distributed as dist

    if not dist.is_initialized():
        store = dist.HashStore()
        dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    import mptp_kernels  # noqa: F401

    yield dist.group.WORLD.group_name
