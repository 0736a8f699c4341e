"""Tensor-parallel layers on the fused ops: DTensor ParallelStyles and plain nn.Modules.

With DTensor, a sequence-parallel plan switches to the fused path by swapping the
style names (the parameters are the same DTensors, so optimizers and checkpoints
do not change):

    plan = {                                              # fused:
        "w1": ColwiseParallel(input_layouts=Shard(1)),    # FusedColwiseParallel(input_layouts=Shard(1))
        "w3": ColwiseParallel(input_layouts=Shard(1)),    # FusedColwiseParallel(input_layouts=Shard(1))
        "w2": RowwiseParallel(output_layouts=Shard(1)),   # FusedRowwiseParallel(output_layouts=Shard(1))
    }
    parallelize_module(mlp, tp_mesh, plan)

DTensor's styles all-gather the sequence-sharded input and then multiply
(column-wise), or multiply and then reduce-scatter (row-wise); the fused styles
run torch.ops.mptp.fused_all_gather_matmul / fused_matmul_reduce_scatter instead,
forward and backward (ops/autograd.py). A plan that gathers the input in a
PrepareModuleInput of the parent (input already replicated) leaves nothing to
fuse: give the linears input_layouts=Shard(seq_dim) instead.

Without DTensor, ColumnParallelLinear and RowParallelLinear take and return
plain local tensors.
"""

import functools
import math
from dataclasses import dataclass
from typing import Optional, Tuple, Union

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DeviceMesh, DTensor, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel
from torch.distributed.tensor.placement_types import Placement

from .ops.validate import autocast_dtype

__all__ = [
    "ColumnParallelLinear",
    "FusedColwiseParallel",
    "FusedRowwiseParallel",
    "RowParallelLinear",
]


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def _norm(p: Placement, ndim: int, what: str = "layout") -> Placement:
    """p with a non-negative dim; a dim out of range for an ndim-D tensor is a ValueError (as
    DTensor raises), never wrapped round to another dim."""
    if not isinstance(p, Shard):
        return p
    if not -ndim <= p.dim < ndim:
        raise ValueError(f"{what}: Shard({p.dim}) is out of range for a {ndim}-D tensor")
    return Shard(p.dim % ndim)


def _local_input(x, mesh: DeviceMesh, given: Placement, wanted: Placement, style: str = "",
                 even: bool = False) -> torch.Tensor:  # fmt: skip
    """The local shard of x in layout `wanted`; a plain tensor is read as layout `given`.

    even: the shards along `wanted` must have one size (the fused all-gather's input).
    """
    if isinstance(x, DTensor) and x.device_mesh != mesh:
        # NOTE: found by a hostile review: its local shard was taken and gathered over this
        # module's group (wrong values on every rank); DTensor's own styles raise here.
        raise ValueError(
            f"{style}: the input is a DTensor on {x.device_mesh}, the module's mesh is {mesh}: "
            "redistribute it onto the module's mesh (or pass its local tensor)"
        )
    if not isinstance(x, DTensor):
        if _norm(given, x.dim(), f"{style}: input_layouts") == _norm(wanted, x.dim(), style):
            return x
        x = DTensor.from_local(x, mesh, (given,), run_check=False)
    want = _norm(wanted, x.dim(), style)
    # NOTE: DTensor shards an uneven dim unevenly; the fused all-gather of unequal shards
    # would abort gloo (or hang NCCL) on some ranks: raise on every rank instead.
    if even and x.shape[want.dim] % mesh.size():
        raise ValueError(
            f"{style}: the input's dim {want.dim} has size {x.shape[want.dim]}, not a multiple of "
            f"the mesh size {mesh.size()}: the fused all-gather needs equal shards (pad it, or "
            "use ColwiseParallel)"
        )
    if x.placements != (want,):
        x = x.redistribute(placements=(wanted,))
    return x.to_local()


def _output(y: torch.Tensor, mesh: DeviceMesh, layout: Placement, bias, cfg, last: Optional[int] = None):
    """y is the local shard in `layout`; adds a DTensor bias and applies the output layout.

    last: the global size of y's last dim where `layout` shards it (the layer's out_features),
    which may not divide by the mesh size: DTensor must not assume even shards.
    """
    want = _norm(cfg.output_layout, y.dim(), f"{cfg.style}: output_layouts")
    if bias is None and cfg.use_local_output and want == _norm(layout, y.dim()):
        return y  # the common case: no DTensor round trip
    if last is None or last % mesh.size() == 0:  # even shards: DTensor infers shape and strides
        out = DTensor.from_local(y, mesh, (layout,), run_check=False)
    else:
        shape = (*y.shape[:-1], last)
        out = DTensor.from_local(y, mesh, (layout,), run_check=False, shape=torch.Size(shape),
                                 stride=_strides_like(y, shape))  # fmt: skip
    if bias is not None:
        if isinstance(bias, DTensor):
            # NOTE: found by a hostile review: DTensor leaves the gradient of a replicated bias
            # broadcast over a sharded output Partial (or Shard), so bias.grad's local tensors
            # were per-rank partial sums (clip_grad_value_, a momentum buffer's checkpoint
            # failed). from_local's backward redistributes it to the bias's own placements, as
            # RowwiseParallel's bias gradient is.
            bias = DTensor.from_local(bias.to_local(), bias.device_mesh, bias.placements, run_check=False)
        out = out + bias
    if out.placements != (want,):
        out = out.redistribute(placements=(want,))
    return out.to_local() if cfg.use_local_output else out


def _strides_like(t: torch.Tensor, shape) -> Tuple[int, ...]:
    """Dense strides for `shape` with t's dim order (the fused op's outputs are gather-dim-major:
    a row-major global stride would claim a layout the local shard does not have)."""
    order = sorted(range(t.dim()), key=lambda d: (t.stride(d), -d))  # innermost first
    stride, step = [0] * len(shape), 1
    for d in order:
        stride[d] = step
        step *= shape[d]
    return tuple(stride)


@dataclass
class _Config:
    style: str  # the style's class name, for errors
    mesh: DeviceMesh
    group_name: str
    input_layout: Placement
    output_layout: Placement
    use_local_output: bool
    dim: int  # gather dim (column-wise) or scatter dim (row-wise)


def _autocast(t):
    """t as F.linear sees it inside an autocast region (the region's dtype for floating tensors
    other than float64), so that the fused styles compute and return what nn.Linear would; the
    ops themselves never autocast."""
    if t is None or not t.is_floating_point() or t.dtype == torch.float64:
        return t
    want = autocast_dtype(t.device)
    return t.to(want) if want is not None and t.dtype != want else t


def _colwise_forward(self: nn.Linear, x):
    cfg: _Config = self._mptp_tp
    x = _local_input(x, cfg.mesh, cfg.input_layout, cfg.input_layout, cfg.style, even=True)
    x, w = _autocast(x), _autocast(_local(self.weight))  # w: [out_features / W, in_features]
    _, (y,) = torch.ops.mptp.fused_all_gather_matmul(
        x, [w.t()], cfg.dim, cfg.group_name, return_A=False
    )
    if self.bias is not None:  # sharded like the output columns: a local add
        y = y + _autocast(_local(self.bias))
    return _output(y, cfg.mesh, Shard(-1), None, cfg, last=self.out_features)


def _rowwise_forward(self: nn.Linear, x):
    cfg: _Config = self._mptp_tp
    x = _autocast(_local_input(x, cfg.mesh, cfg.input_layout, Shard(-1), cfg.style))
    w = _autocast(_local(self.weight))  # [out_features, in_features / W]
    y = torch.ops.mptp.fused_matmul_reduce_scatter(x, w.t(), "sum", cfg.dim, cfg.group_name)
    # A replicated bias joins after the reduce-scatter, as a DTensor, so that DTensor
    # reduces its gradient over the ranks' rows exactly as RowwiseParallel does.
    bias = self.bias
    if bias is not None and bias.dtype != torch.float64 and autocast_dtype(y.device) is not None:
        bias = bias.to(y.dtype)  # as F.linear under autocast (a DTensor keeps its placement)
    return _output(y, cfg.mesh, Shard(cfg.dim), bias, cfg)


def _plain_linear(module: nn.Module) -> bool:
    """An nn.Linear whose forward is nn.Linear's own (a subclass that overrides it, e.g. a scaled
    or LoRA linear, keeps DTensor's style: replacing its forward would drop what it adds)."""
    return (isinstance(module, nn.Linear) and type(module).forward is nn.Linear.forward
            and "forward" not in vars(module))  # (nor one set on the instance by a library)


def _check_mesh(style: str, mesh: DeviceMesh, module: nn.Module) -> str:
    if getattr(module, "_distribute_module_applied", False) or hasattr(module, "_mptp_tp"):
        # (distribute_module marks it so; a second style would shard the shards)
        raise RuntimeError(f"{style}: the module is already parallelized: a plan applies one style to a module once")
    if mesh.ndim != 1:
        raise ValueError(
            f"{style}: expected a 1-D DeviceMesh (slice the TP dim), got {mesh.ndim}-D"
        )
    return mesh.get_group().group_name


class FusedColwiseParallel(ColwiseParallel):
    """ColwiseParallel whose all-gather of a sharded input is fused with the matmul.

    Drop-in for ``ColwiseParallel(input_layouts=Shard(d))`` on an ``nn.Linear``: the
    weight (and bias) are sharded the same way (``Shard(0)``), the input is the
    sequence-sharded activation, and ``fused_all_gather_matmul`` gathers it along d
    while multiplying by the local weight rows; the backward is a fused
    matmul-reduce-scatter for the input gradient and reuses the gathered input for
    the weight gradient. The output is ``Shard(-1)`` (full sequence, this rank's
    columns) unless ``output_layouts`` says otherwise. The sharded dim must divide by
    the mesh size: a DTensor input that DTensor shards unevenly is a ValueError.

    Where the input is replicated (``input_layouts`` None or ``Replicate()``) there is
    nothing to gather, and on modules other than ``nn.Linear`` there is no fused op:
    both behave exactly like ``ColwiseParallel``.

    Keyword Args:
        input_layouts: the layout of the module input, e.g. ``Shard(1)`` for
            [batch, seq / W, hidden] activations (a plain tensor input is read as this).
        output_layouts: the output layout (default ``Shard(-1)``).
        use_local_output: return a local tensor (default) or a DTensor.
    """

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        in_layout = self.input_layouts[0]
        if not _plain_linear(module) or not isinstance(in_layout, Shard):
            return super()._apply(module, device_mesh)
        style = type(self).__name__
        group_name = _check_mesh(style, device_mesh, module)
        self._partition_linear_fn("", module, device_mesh)
        module._mptp_tp = _Config(style, device_mesh, group_name, in_layout, self.output_layouts[0],
                                  self.use_local_output, in_layout.dim)  # fmt: skip
        module._distribute_module_applied = True
        module.forward = functools.partial(_colwise_forward, module)  # (a bound method of a function nn.Linear lacks does not unpickle)
        return module


class FusedRowwiseParallel(RowwiseParallel):
    """RowwiseParallel whose reduce-scatter of the output is fused with the matmul.

    Drop-in for ``RowwiseParallel(output_layouts=Shard(d))`` on an ``nn.Linear``: the
    weight is ``Shard(1)`` and a bias ``Replicate()``, the input is sharded on its last
    dim (the column-parallel layer's output), and ``fused_matmul_reduce_scatter``
    produces the sequence-sharded output. The backward is a fused all-gather-matmul
    of the output gradient, which also gives the weight gradient its gathered rows.

    With a replicated output (``output_layouts`` None or ``Replicate()``: an
    all-reduce, nothing to scatter) or on modules other than ``nn.Linear``, it behaves
    exactly like ``RowwiseParallel``.

    The output's sharded dim must divide by the mesh size: otherwise a ValueError on every
    rank, before any communication (``RowwiseParallel`` would shard it unevenly).

    Keyword Args:
        input_layouts: layout of a plain-tensor input (default ``Shard(-1)``).
        output_layouts: e.g. ``Shard(1)`` for [batch, seq / W, hidden] outputs.
        use_local_output: return a local tensor (default) or a DTensor.
    """

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        out_layout = self.output_layouts[0]
        if not _plain_linear(module) or not isinstance(out_layout, Shard):
            return super()._apply(module, device_mesh)
        style = type(self).__name__
        group_name = _check_mesh(style, device_mesh, module)
        self._partition_linear_fn("", module, device_mesh)
        module._mptp_tp = _Config(style, device_mesh, group_name, self.input_layouts[0], out_layout,
                                  self.use_local_output, out_layout.dim)  # fmt: skip
        module._distribute_module_applied = True
        module.forward = functools.partial(_rowwise_forward, module)  # (a bound method of a function nn.Linear lacks does not unpickle)
        return module


# -- plain modules (no DTensor) ----------------------------------------------------------------------


def _group(group: Union[str, dist.ProcessGroup, None]) -> Tuple[str, int, int]:
    """(group_name, world_size, rank) of a process group, its name, or the world (None)."""
    from .ops import _name

    name = _name(group)  # a clear error for a non-member, a wrong type, or no process group
    import torch.distributed.distributed_c10d as c10d

    try:
        group = c10d._resolve_process_group(name)
    except Exception as e:  # noqa: BLE001 - c10d raises various types
        raise ValueError(f"group: no process group named {name!r} is registered ({e})") from None
    return group.group_name, dist.get_world_size(group), dist.get_rank(group)


def _check_divisible(cls: str, arg: str, n: int, W: int) -> None:
    if n % W:
        raise ValueError(f"{cls}: {arg}={n} is not a multiple of the world size {W}")


class ColumnParallelLinear(nn.Module):
    """Column-parallel linear on a sharded input: ``y = all_gather(x, gather_dim) @ W_r^T + b_r``.

    Each rank holds ``out_features / W`` rows of the weight (and of the bias). The
    input is this rank's shard along ``gather_dim`` (e.g. the sequence); the output
    covers the full gathered dim and this rank's output features. Forward and
    backward run the fused ops (see FusedColwiseParallel).

    Args:
        in_features, out_features: the full layer's sizes; out_features % W == 0.
        group: process group, its name, or None for the world.
        gather_dim: the input dim that is sharded (default 0).
        bias: add a (sharded) bias.

    Shapes:
        x: [*S, in_features] with S[gather_dim] = full / W -> [*S_full, out_features / W].
        Every rank's shard must have the same shape (split the full input evenly, as the
        unfused all_gather_into_tensor needs too). That takes a collective to check: on a
        group without an mptp workspace (CPU, NCCL) set MPTP_CHECK_AGREEMENT=1 to get a
        ValueError on every rank; without it, unequal shards fail as in the collective itself
        (gloo may return garbage rows on one rank and abort on another). Groups with a
        workspace always check.
    """

    def __init__(self, in_features: int, out_features: int, *, group=None, gather_dim: int = 0,
                 bias: bool = False, device=None, dtype=None):  # fmt: skip
        super().__init__()
        self.group_name, self.world_size, self.rank = _group(group)
        _check_divisible(type(self).__name__, "out_features", out_features, self.world_size)
        self.in_features, self.out_features, self.gather_dim = in_features, out_features, gather_dim
        n = out_features // self.world_size
        self.weight = nn.Parameter(torch.empty(n, in_features, device=device, dtype=dtype))
        self.bias = nn.Parameter(torch.empty(n, device=device, dtype=dtype)) if bias else None
        self.reset_parameters()

    def reset_parameters(self) -> None:
        # This rank's rows of the full layer nn.Linear would initialize from the same RNG state:
        # every rank draws the whole weight (so replicated layers built after it stay seeded
        # alike) and keeps its shard. NOTE: found by a hostile review: each rank drew only its
        # shard, so ranks seeded alike (as replicated layers need) held W copies of one block,
        # and training never told them apart. The draw briefly holds the full weight on the
        # module's device (on "meta" it costs nothing: build large layers there and load).
        r, n = self.rank, self.weight.shape[0]
        w = self.weight
        with torch.no_grad():
            full = torch.empty(self.out_features, self.in_features, device=w.device, dtype=w.dtype)
            nn.init.kaiming_uniform_(full, a=5**0.5)  # nn.Linear's
            w.copy_(full[r * n : (r + 1) * n])
            del full
            if self.bias is not None:
                bound = 1 / math.sqrt(self.in_features) if self.in_features > 0 else 0  # nn.Linear's
                full_b = torch.empty(self.out_features, device=w.device, dtype=w.dtype)
                nn.init.uniform_(full_b, -bound, bound)
                self.bias.copy_(full_b[r * n : (r + 1) * n])

    @classmethod
    def from_linear(
        cls, linear: nn.Linear, *, group=None, gather_dim: int = 0
    ) -> "ColumnParallelLinear":
        """This rank's shard of a full nn.Linear (identical on every rank)."""
        m = cls(linear.in_features, linear.out_features, group=group, gather_dim=gather_dim,
                bias=linear.bias is not None, device="meta", dtype=linear.weight.dtype)  # fmt: skip
        n, r = m.weight.shape[0], m.rank
        m.weight = nn.Parameter(linear.weight.detach()[r * n : (r + 1) * n].clone(),
                                requires_grad=linear.weight.requires_grad)
        if linear.bias is not None:
            m.bias = nn.Parameter(linear.bias.detach()[r * n : (r + 1) * n].clone(),
                                  requires_grad=linear.bias.requires_grad)
        return m

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x, w = _autocast(x), _autocast(self.weight)  # as nn.Linear under autocast
        _, (y,) = torch.ops.mptp.fused_all_gather_matmul(x, [w.t()], self.gather_dim, self.group_name,
                                                        return_A=False)  # fmt: skip
        return y + _autocast(self.bias) if self.bias is not None else y

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features} "
                f"(local {self.weight.shape[0]}), gather_dim={self.gather_dim}, bias={self.bias is not None}")  # fmt: skip


class RowParallelLinear(nn.Module):
    """Row-parallel linear with a sharded output: ``y = reduce_scatter(x @ W_r^T, scatter_dim)``.

    Each rank holds ``in_features / W`` columns of the weight; the input is sharded
    on its last dim (a ColumnParallelLinear's output); the output is this rank's
    shard along ``scatter_dim`` (e.g. the sequence). Forward and backward run the
    fused ops (see FusedRowwiseParallel).

    A replicated bias is not offered: its gradient would need an all-reduce over
    the group (use FusedRowwiseParallel, where DTensor does it, or add the bias
    yourself and all-reduce its gradient).

    Args:
        in_features, out_features: the full layer's sizes; in_features % W == 0.
        group: process group, its name, or None for the world.
        scatter_dim: the output dim to shard (default 0); its size must divide by W.

    Shapes:
        x: [*S, in_features / W] -> [*S with S[scatter_dim] / W, out_features].
        Every rank's x must have the same shape (see ColumnParallelLinear on checking it).
    """

    def __init__(self, in_features: int, out_features: int, *, group=None, scatter_dim: int = 0,
                 bias: bool = False, device=None, dtype=None):  # fmt: skip
        super().__init__()
        if bias:
            raise ValueError(
                "RowParallelLinear: bias=True is not supported (a replicated bias needs its "
                "gradient all-reduced); use FusedRowwiseParallel with DTensor"
            )
        self.group_name, self.world_size, self.rank = _group(group)
        _check_divisible(type(self).__name__, "in_features", in_features, self.world_size)
        self.in_features, self.out_features, self.scatter_dim = (
            in_features,
            out_features,
            scatter_dim,
        )
        k = in_features // self.world_size
        self.weight = nn.Parameter(torch.empty(out_features, k, device=device, dtype=dtype))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        # This rank's columns of the full layer nn.Linear would initialize from the same RNG state
        # (see ColumnParallelLinear.reset_parameters).
        r, k = self.rank, self.weight.shape[1]
        w = self.weight
        with torch.no_grad():
            full = torch.empty(self.out_features, self.in_features, device=w.device, dtype=w.dtype)
            nn.init.kaiming_uniform_(full, a=5**0.5)  # nn.Linear's
            w.copy_(full[:, r * k : (r + 1) * k])

    @classmethod
    def from_linear(
        cls, linear: nn.Linear, *, group=None, scatter_dim: int = 0
    ) -> "RowParallelLinear":
        """This rank's shard of a full, bias-free nn.Linear (identical on every rank)."""
        m = cls(linear.in_features, linear.out_features, group=group, scatter_dim=scatter_dim,
                bias=linear.bias is not None, device="meta", dtype=linear.weight.dtype)  # fmt: skip
        k, r = m.weight.shape[1], m.rank
        m.weight = nn.Parameter(linear.weight.detach()[:, r * k : (r + 1) * k].clone(),
                                requires_grad=linear.weight.requires_grad)
        return m

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x, w = _autocast(x), _autocast(self.weight)  # as nn.Linear under autocast
        return torch.ops.mptp.fused_matmul_reduce_scatter(x, w.t(), "sum", self.scatter_dim, self.group_name)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features} (local {self.weight.shape[1]}), "
                f"out_features={self.out_features}, scatter_dim={self.scatter_dim}")  # fmt: skip
