import pytest
import torch

import mptp_kernels

_KEEP = []  # c10d holds registered groups weakly


def _register_fake_group(name: str, world_size: int) -> None:
    """Registers a FakeProcessGroup (no communication) of `world_size` under `name`."""
    import torch.distributed.distributed_c10d as c10d
    from torch._C._distributed_c10d import FakeProcessGroup, ProcessGroup, _register_process_group

    try:
        c10d._resolve_process_group(name)
        return
    except Exception:  # noqa: BLE001 - not registered yet
        pass
    from torch.testing._internal.distributed.fake_pg import FakeStore

    create = getattr(FakeProcessGroup, "_create_internal", FakeProcessGroup)
    backend = create(0, world_size)
    pg = ProcessGroup(FakeStore(), 0, world_size)
    pg._register_backend(torch.device("cpu"), ProcessGroup.BackendType.CUSTOM, backend)
    pg._set_default_backend(ProcessGroup.BackendType.CUSTOM)
    _register_process_group(name, pg)
    _KEEP.append(pg)


@pytest.fixture(scope="session")
def fake4(pg1):
    """A fake (non-communicating) group of 4 ranks named "mptp_fake4", enabled for symmetric memory.

    The pass reads group sizes from the group, so structure tests trace with W = 4
    on it; graphs built on it are never run for numerics.
    """
    try:
        _register_fake_group("mptp_fake4", 4)
    except Exception as e:  # noqa: BLE001 - the private API moved
        pytest.skip(f"cannot register a fake process group in this torch: {e}")
    mptp_kernels.enable_symm_mem_for_group("mptp_fake4")
    return "mptp_fake4"
