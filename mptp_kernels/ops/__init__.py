"""Public Python wrappers of the torch.ops.mptp ops, and PyTorch-named helpers."""

import weakref
from typing import List, Optional, Sequence, Tuple, Union

import torch
import torch.distributed as dist


def _name(group: Union[str, "dist.ProcessGroup", None]) -> str:
    if isinstance(group, str):
        return group
    if group is None:
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError(
                "mptp: no default process group: call torch.distributed.init_process_group() "
                "first, or pass group="
            )
        group = dist.group.WORLD
    if isinstance(group, int) and group == dist.GroupMember.NON_GROUP_MEMBER:  # new_group() on a non-member
        raise ValueError("group: this rank is not a member of that process group (GroupMember.NON_GROUP_MEMBER)")
    if not hasattr(group, "group_name"):
        raise ValueError(f"group: expected a ProcessGroup, its group_name, or None, got {type(group).__name__}")
    return group.group_name


def _blist(arg: str, Bs) -> list:
    from .validate import check_list

    check_list(arg, Bs)
    return list(Bs)


def fused_all_gather_matmul(
    A: torch.Tensor,
    Bs: Sequence[torch.Tensor],
    gather_dim: int,
    group: Union[str, "dist.ProcessGroup", None] = None,
    *,
    return_A: bool = True,
) -> Tuple[Optional[torch.Tensor], List[torch.Tensor]]:
    """All-gather A along gather_dim, then multiply by each B, overlapped.

    Args:
        A: [*S, K] local shard (bf16/fp16/fp32), at least 2-D.
        Bs: list of [K, N_i] weights, same dtype and device as A.
        gather_dim: the dim of A to gather (S[gather_dim] grows by the world size).
        group: process group or its group_name (default: the world).
        return_A: also return the gathered A.

    Returns:
        (A_full or None, [A_full @ B_i]), A_full: [*S with S[gather_dim] * W, K].
    """
    return torch.ops.mptp.fused_all_gather_matmul(
        A, _blist("Bs", Bs), gather_dim, _name(group), return_A=return_A
    )


def fused_all_gather_scaled_matmul(
    A: torch.Tensor,
    Bs: Sequence[torch.Tensor],
    A_scale: torch.Tensor,
    B_scales: Sequence[torch.Tensor],
    gather_dim: int,
    group: Union[str, "dist.ProcessGroup", None] = None,
    biases: Optional[Sequence[Optional[torch.Tensor]]] = None,
    result_scales: Optional[Sequence[Optional[torch.Tensor]]] = None,
    out_dtypes: Optional[Sequence[Optional[torch.dtype]]] = None,
    use_fast_accum: Optional[Sequence[bool]] = None,
) -> Tuple[torch.Tensor, List[torch.Tensor]]:
    """FP8 all-gather-matmul: `_scaled_mm(all_gather(A), B_i, A_scale, B_scales[i], ...)`.

    Forward-only: backpropagating through it raises (no FP8 backward is defined).
    FP8 outputs (out_dtypes e4m3fn / e5m2, or None: A's dtype) are
    `(A_scale * B_scale * A @ B + bias) * result_scale`, saturated to the FP8 range,
    on every device (see mptp_kernels.ops.reference.scaled_mm).

    Args:
        A: [*S, K] float8_e4m3fn shard. A_scale: float32, one element
            (tensor-wise), [*S[:-1], 1] (row-wise, sharded with A) or
            [*A_full.shape[:-1], 1] (row-wise, replicated).
        Bs: [K, N_i] float8_e4m3fn, column-major. B_scales: one element or [1, N_i].
        biases, result_scales, out_dtypes, use_fast_accum: per-B lists (default
            None / None / None / False).

    Returns:
        (A_full, [out_i]), out_i: [*A_full.shape[:-1], N_i] in out_dtypes[i].
    """
    n = len(Bs)
    return torch.ops.mptp.fused_all_gather_scaled_matmul(
        A, _blist("Bs", Bs), A_scale, _blist("B_scales", B_scales), gather_dim, _name(group),
        list(biases) if biases is not None else [None] * n,
        list(result_scales) if result_scales is not None else [None] * n,
        list(out_dtypes) if out_dtypes is not None else [None] * n,
        list(use_fast_accum) if use_fast_accum is not None else [False] * n,
    )  # fmt: skip


def fused_matmul_reduce_scatter(
    A: torch.Tensor,
    B: torch.Tensor,
    reduce_op: str,
    scatter_dim: int,
    group: Union[str, "dist.ProcessGroup", None] = None,
) -> torch.Tensor:
    """reduce_scatter(A @ B) along scatter_dim, overlapped.

    Args:
        A: [*S, K] (bf16/fp16/fp32). B: [K, N], same dtype.
        reduce_op: "sum" or "avg". scatter_dim: dim of the [*S, N] product to scatter.

    Returns:
        [*S, N] with dim scatter_dim divided by the world size, contiguous.
    """
    return torch.ops.mptp.fused_matmul_reduce_scatter(A, B, reduce_op, scatter_dim, _name(group))


def fused_scaled_matmul_reduce_scatter(
    A: torch.Tensor,
    B: torch.Tensor,
    A_scale: torch.Tensor,
    B_scale: torch.Tensor,
    reduce_op: str,
    scatter_dim: int,
    group: Union[str, "dist.ProcessGroup", None] = None,
    bias: Optional[torch.Tensor] = None,
    result_scale: Optional[torch.Tensor] = None,
    out_dtype: Optional[torch.dtype] = None,
    use_fast_accum: bool = False,
) -> torch.Tensor:
    """FP8 matmul-reduce-scatter: reduce_scatter(_scaled_mm(A, B, A_scale, B_scale, ...)).

    Forward-only: backpropagating through it raises (no FP8 backward is defined).

    Args:
        A: [*S, K] float8_e4m3fn; A_scale: one element or [*S, 1] float32.
        B: [K, N] float8_e4m3fn column-major; B_scale: one element or [1, N].

    Returns:
        [*S, N] with dim scatter_dim divided by the world size, in out_dtype.
    """
    out_shape = [*A.shape[:-1], B.shape[1]]
    return torch.ops.mptp.fused_scaled_matmul_reduce_scatter(
        A, B, A_scale, B_scale, reduce_op, scatter_dim, scatter_dim, _name(group), out_shape,
        bias, result_scale, out_dtype, use_fast_accum,
    )  # fmt: skip


def _contiguous_for_perm(t: torch.Tensor, perm: List[int]) -> torch.Tensor:
    """Restrides t so that t.permute(perm) is contiguous (same values)."""
    inv = [0] * len(perm)
    for i, p in enumerate(perm):
        inv[p] = i
    return t.permute(perm).contiguous().permute(inv)


def restride_A_shard_for_fused_all_gather_matmul(t: torch.Tensor, gather_dim: int) -> torch.Tensor:
    """Restrides A so that gather_dim is outermost in memory (what the fused path copies)."""
    perm = list(range(t.dim()))
    perm.insert(0, perm.pop(gather_dim))
    return _contiguous_for_perm(t, perm)


def restride_A_for_fused_matmul_reduce_scatter(t: torch.Tensor, scatter_dim: int) -> torch.Tensor:
    """Restrides A so that scatter_dim is outermost in memory (chunks are row blocks)."""
    perm = list(range(t.dim()))
    perm.insert(0, perm.pop(scatter_dim))
    return _contiguous_for_perm(t, perm)


# group_name -> a weak reference to the process group object enabled under that name (None: a
# name enabled before any group had it). Names are reused after destroy_process_group: a name
# enables only the very object it was enabled for. Weak: an enabled group that is destroyed is
# freed, its sockets and threads with it (found by a README audit).
_ENABLED_GROUPS: dict = {}


def _ref(pg):
    if pg is None:
        return None
    try:
        return weakref.ref(pg)
    except TypeError:  # an object that takes no weak reference: held
        return lambda: pg


def _resolve(name: str):
    from torch.distributed.distributed_c10d import _resolve_process_group

    try:
        return _resolve_process_group(name)
    except Exception:  # noqa: BLE001 - unknown name
        return None


def enable_symm_mem_for_group(group_name: Union[str, "dist.ProcessGroup"]) -> None:
    """Lets the fused path (and the FX pass) use mptp symmetric memory on this group.

    Not collective: the group's workspace is created by the first op call on it
    (on every rank), or by mptp_kernels.symm.reserve().
    """
    name = _name(group_name)
    # A name not (yet) registered binds to the first group that resolves it.
    _ENABLED_GROUPS[name] = _ref(group_name if not isinstance(group_name, str) else _resolve(name))


def is_symm_mem_enabled_for_group(group_name: Union[str, "dist.ProcessGroup"]) -> bool:
    name = _name(group_name)
    if name not in _ENABLED_GROUPS:
        return False
    ref, now = _ENABLED_GROUPS[name], _resolve(name)
    if ref is None:
        if now is not None:
            _ENABLED_GROUPS[name] = _ref(now)
        return True
    pg = ref()
    if pg is None:  # the enabled group is gone: its name does not enable a later group
        return now is None
    return now is None or now is pg


def shutdown() -> None:
    """Frees every mptp workspace (collective over each group: call it on every rank) and forgets enabled groups."""
    from ..symm import _C

    if _C.lib() is not None:
        from ..symm import primitives

        primitives.free_workspaces()
    _ENABLED_GROUPS.clear()
