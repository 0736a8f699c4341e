"""Inductor keeps the mptp ops in program order with the collectives of a graph.

Inductor chains the collectives of a graph in their program order before it schedules
(comms.decide_global_ordering_of_comms adds an ordering-only dependency from each collective
to the previous one), so its reordering passes (peak memory, by default) never issue them in
another order. A torch.ops.mptp.* call is a plain fallback kernel to it: without more, it may be
moved past a collective (seen: a fused all-gather-matmul sunk below a later all_reduce, a fused
matmul-reduce-scatter hoisted above an earlier one). Ranks whose graphs differ (one fused,
one not) then issue their collectives in different orders and deadlock.

install() wraps that function so the mptp ops count as collectives while it chains them: torch's
own code adds the dependencies, in whatever form the installed torch uses. Graphs without an
mptp op are scheduled exactly as before. Installed when mptp_kernels is imported (the ops may be
called from compiled code without the pass); idempotent; a torch without the function is left
alone.
"""

import functools

_MPTP_OPS = None


def _ops():
    global _MPTP_OPS
    if _MPTP_OPS is None:
        import torch

        from ..ops.agreement import OPS  # (importing mptp_kernels registered the ops)

        _MPTP_OPS = {getattr(torch.ops.mptp, n).default for n in OPS}
    return _MPTP_OPS


def is_mptp_node(snode) -> bool:
    """Whether a scheduler node runs a torch.ops.mptp op (also inside a grouped node)."""
    inner = getattr(snode, "snodes", None)
    if inner is not None:
        return any(is_mptp_node(s) for s in inner)
    return getattr(getattr(snode, "node", None), "op_overload", None) in _ops()


def install() -> bool:
    """Returns whether the ordering is in place (False: this torch has no such step)."""
    try:
        from torch._inductor import comms
    except Exception:  # noqa: BLE001 - no Inductor (or a broken one): nothing to order
        return False
    orig = getattr(comms, "decide_global_ordering_of_comms", None)
    if orig is None or not hasattr(comms, "contains_collective"):
        return False
    if getattr(orig, "_mptp", False):
        return True

    @functools.wraps(orig)
    def decide_global_ordering_of_comms(*args, **kwargs):
        plain = comms.contains_collective

        def contains_collective(snode, *a, **k):
            return plain(snode, *a, **k) or (not a and not k and is_mptp_node(snode))

        comms.contains_collective = contains_collective
        try:
            return orig(*args, **kwargs)
        finally:
            comms.contains_collective = plain

    decide_global_ordering_of_comms._mptp = True
    comms.decide_global_ordering_of_comms = decide_global_ordering_of_comms
    return True
