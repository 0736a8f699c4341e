"""Compile caches keyed on the sizes of the groups a graph's torch.ops.mptp calls name.

A torch.ops.mptp call carries its group by name only, and its output shapes depend on the
group's size (an all-gather-matmul of a [4, 8] shard is [4 W, N]). Inductor's FX graph cache
and AOTAutograd's cache hash a graph's code and its inputs, so a job run with another world
size, whose local shapes and group names ("0" for the world) are the same, loaded the graph
compiled for the first size: found by a hostile review (W = 2 then W = 3 on one cache dir
failed Inductor's size assert, "expected size 12==8").

install() wraps the cache key's details (torch._inductor.codecache.FxGraphHashDetails, which
AOTAutograd's own details extend) so that a graph calling an mptp op also hashes
[(group name, group size)] of those calls. Graphs without an mptp op hash exactly as before.
Installed when mptp_kernels is imported; idempotent; a torch without that class is left alone.
"""

import functools

import torch


def _group_name(node):
    # "mptp.<op>.default" (an overload) or "mptp.<op>" (a packet, as Dynamo's graphs call it)
    from ..ops.dispatch import _GROUP_ARG  # (the op -> index of its group_name argument)

    parts = str(node.target).split(".")
    i = _GROUP_ARG.get(parts[1]) if len(parts) > 1 and parts[0] == "mptp" else None
    if i is None:
        return None
    if len(node.args) > i:
        return node.args[i]
    return node.kwargs.get("group_name")


def _size(name) -> int:
    from ..ops import validate

    try:
        return validate.group_size(name)
    except Exception:  # noqa: BLE001 - an unknown group: the call raises at run time anyway
        return -1


def group_sizes(gm) -> list:
    """Sorted [(group name, size)] of the mptp calls in gm and its submodules."""
    seen = set()
    for module in gm.modules() if isinstance(gm, torch.nn.Module) else ():
        graph = getattr(module, "graph", None)
        if not isinstance(graph, torch.fx.Graph):
            continue
        for node in graph.nodes:
            name = _group_name(node) if node.op == "call_function" else None
            if isinstance(name, str):
                seen.add(name)
    return sorted((name, _size(name)) for name in seen)


def install() -> bool:
    """Returns whether the cache key includes the group sizes (False: no such class here)."""
    try:
        from torch._inductor import codecache
    except Exception:  # noqa: BLE001 - no Inductor (or a broken one): no cache to key
        return False
    cls = getattr(codecache, "FxGraphHashDetails", None)
    if cls is None:
        return False
    orig = cls.__init__
    if getattr(orig, "_mptp", False):
        return True

    @functools.wraps(orig)
    def __init__(self, gm, *args, **kwargs):
        orig(self, gm, *args, **kwargs)
        sizes = group_sizes(gm)
        if sizes:
            self.mptp_group_sizes = sizes

    __init__._mptp = True
    cls.__init__ = __init__
    return True
