import os
import sys

import pytest
import torch

# NOTE: Triton picks the interpreter when a kernel module is imported, so this
# must be set before any test module imports mptp_kernels.kernels.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

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
