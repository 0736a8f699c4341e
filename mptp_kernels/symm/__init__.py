"""Symmetric memory for a process group: buffers every rank maps, signal pads,
stream-ordered signal / wait, barriers that time out.

Layering: csrc/ allocates, exports and opens CUDA IPC handles and runs the
signal/wait primitives; this module exchanges the handles over the process
group (two phases: export bytes -> all_gather_object -> import), self-checks
the mapping, keeps counting signals (expected counters, never reset), and caches one workspace per group.

Peers may share a device: W processes on one GPU form a valid group (CUDA IPC
between processes on one device works; only a rank's own buffer is used
directly, never re-opened).
"""

from .primitives import SymmetricMemory, check_errors, free_workspaces, get_workspace, reserve

__all__ = ["SymmetricMemory", "check_errors", "free_workspaces", "get_workspace", "reserve"]
