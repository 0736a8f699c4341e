"""Post-grad FX pass: all-gather -> matmul and matmul -> reduce-scatter become torch.ops.mptp.*.

Patterns (each collective is matched once, starting from the collective, so a
longer pattern always wins over its suffix):

  all-gather, gather_dim 0:
      wait_tensor(all_gather_into_tensor(shard)) [-> view.dtype]          -> A
  all-gather, gather_dim d > 0:
      cat([getitem(split(wait_tensor(all_gather(shard)), dim=0), i) [-> view.dtype] ...], d)
      [-> view.dtype]                                                     -> A
  consumers of A: mm(A, B) | _scaled_mm(A, B, ...) | reshape(A) -> mm -> reshape
      => fused_all_gather_matmul(shard, [B...], d, group) (or the scaled op)
  reduce-scatter, scatter_dim 0:
      wait_tensor(reduce_scatter_tensor(C))                               -> out
  reduce-scatter, scatter_dim d > 0:
      wait_tensor(reduce_scatter_tensor(cat(getitem(split(C, dim=d)), 0)))   -> out
  producer of C: mm(A, B) | _scaled_mm(A, B, ...) | reshape(A) -> mm -> reshape
      => fused_matmul_reduce_scatter(A, B, op, d, group) (or the scaled op)
  torch.ops.symm_mem.fused_* (what PyTorch's own pass emits) => torch.ops.mptp.fused_*

Not fused (logged with the reason under MPTP_LOG=1): mixed matmul kinds on one
all-gather; a matmul whose other arguments depend on the collective; a
matmul result with users besides the reduce-scatter; groups not enabled for
symmetric memory; with reorder_for_compute_comm_overlap on, collectives that an
independent matmul already hides.
"""

import operator
import warnings
from dataclasses import dataclass, field
from typing import List, Optional

import torch
import torch.fx as fx
from torch._inductor import inductor_prims

from .. import env

aten = torch.ops.aten
_c10d = torch.ops._c10d_functional
_RESHAPES = (aten.reshape.default, aten.view.default, aten._unsafe_view.default)
_SPLITS = (aten.split.Tensor, aten.split_with_sizes.default)
_MMS = (aten.mm.default, aten._scaled_mm.default)


def _val(n):
    return n.meta.get("val") if isinstance(n, fx.Node) else None


def _ancestors(nodes) -> set:
    seen, stack = set(), [n for n in nodes if isinstance(n, fx.Node)]
    while stack:
        n = stack.pop()
        if n in seen:
            continue
        seen.add(n)
        stack.extend(a for a in n.all_input_nodes)
    return seen


def _descendants(node) -> set:
    seen, stack = set(), [node]
    while stack:
        n = stack.pop()
        for u in n.users:
            if u not in seen:
                seen.add(u)
                stack.append(u)
    return seen


def _group_enabled(group_name: str) -> bool:
    from ..ops import is_symm_mem_enabled_for_group

    if is_symm_mem_enabled_for_group(group_name):
        return True
    try:
        from torch.distributed._symmetric_memory import (
            is_symm_mem_enabled_for_group as torch_enabled,
        )

        return bool(torch_enabled(group_name))
    except Exception:  # noqa: BLE001
        return False


@dataclass
class _Matmul:
    """mm / _scaled_mm, optionally wrapped as reshape -> mm -> reshape (N-D)."""

    mm: fx.Node
    pre: Optional[fx.Node] = None
    post: Optional[fx.Node] = None
    scaled: bool = field(init=False)

    def __post_init__(self):
        self.scaled = self.mm.target is aten._scaled_mm.default

    @property
    def out(self) -> fx.Node:
        return self.post if self.post is not None else self.mm

    def arg(self, i, name, default=None):
        a = self.mm.args
        return a[i] if len(a) > i else self.mm.kwargs.get(name, default)

    @property
    def B(self):
        return self.mm.args[1]

    def other_args(self) -> list:
        """Every argument besides A (B, scales, bias, result scale)."""
        if not self.scaled:
            return [self.B]
        return [self.B, self.arg(2, "scale_a"), self.arg(3, "scale_b"), self.arg(4, "bias"),
                self.arg(5, "scale_result")]  # fmt: skip

    def erase(self, graph):
        for n in (self.post, self.mm, self.pre):
            if n is not None and not n.users:
                graph.erase_node(n)


def _consumer_matmuls(A: fx.Node) -> List[_Matmul]:
    out = []
    for u in A.users:
        if u.target in _MMS and u.args[0] is A:
            out.append(_Matmul(u))
        elif u.target in _RESHAPES and u.args[0] is A:
            for mm in u.users:
                if mm.target in _MMS and mm.args[0] is u and len(mm.users) == 1:
                    (post,) = mm.users
                    if post.target in _RESHAPES:
                        out.append(_Matmul(mm, pre=u, post=post))
    return out


def _producer_matmul(C: fx.Node) -> Optional[_Matmul]:
    if C.target in _MMS:
        return _Matmul(C)
    if C.target in _RESHAPES:
        mm = C.args[0]
        if isinstance(mm, fx.Node) and mm.target in _MMS and len(mm.users) == 1:
            pre = mm.args[0]
            if isinstance(pre, fx.Node) and pre.target in _RESHAPES:
                return _Matmul(mm, pre=pre, post=C)
    return None


def _skip_aliases(n: fx.Node, nodes: list) -> fx.Node:
    """Follows single-user aten.alias chains (make_fx leaves them after views)."""
    while len(n.users) == 1 and next(iter(n.users)).target is aten.alias.default:
        n = next(iter(n.users))
        nodes.append(n)
    return n


@dataclass
class _AllGather:
    ag: fx.Node
    wait: fx.Node
    res: fx.Node  # A_full as the graph uses it
    shard: fx.Node
    gather_dim: int
    group_name: str
    nodes: list  # everything between ag and res, res last
    view_dtype: Optional[torch.dtype] = None  # type-erased FP8: the dtype the bytes are viewed as


def _match_all_gather(ag: fx.Node) -> Optional[_AllGather]:
    shard, group_name = ag.args[0], ag.args[2] if len(ag.args) > 2 else ag.kwargs.get("group_name")
    if len(ag.users) != 1:
        return None
    (wait,) = ag.users
    if wait.target is not _c10d.wait_tensor.default:
        return None
    users = list(wait.users)
    splits = [u for u in users if u.target in _SPLITS]
    if splits and len(splits) == len(users) == 1:
        split = splits[0]
        if (split.args[2] if len(split.args) > 2 else split.kwargs.get("dim", 0)) != 0:
            return None
        getitems = sorted(split.users, key=lambda g: g.args[1])
        if not all(g.target is operator.getitem for g in getitems):
            return None
        nodes = [ag, wait, split, *getitems]
        # Optional per-piece view.dtype (type-erased fp8), then one cat.
        pieces = []
        for g in getitems:
            g = _skip_aliases(g, nodes)
            if len(g.users) != 1:
                return None
            (p,) = g.users
            if p.target is aten.view.dtype:
                nodes.append(p)
                p = _skip_aliases(p, nodes)
                if len(p.users) != 1:
                    return None
                (p2,) = p.users
                pieces.append((p, p2))
            else:
                pieces.append((g, p))
        cats = {p2 for _, p2 in pieces}
        if len(cats) != 1:
            return None
        (cat,) = cats
        if cat.target is not aten.cat.default or list(cat.args[0]) != [p for p, _ in pieces]:
            return None
        dim = cat.args[1] if len(cat.args) > 1 else cat.kwargs.get("dim", 0)
        nodes.append(cat)
        res = _skip_aliases(cat, nodes)
        view_dtype = pieces[0][0].args[1] if pieces[0][0].target is aten.view.dtype else None
        if len(res.users) == 1 and next(iter(res.users)).target is aten.view.dtype:
            res = next(iter(res.users))
            view_dtype = res.args[1]
            nodes.append(res)
        res = _skip_aliases(res, nodes)
        ndim = _val(res).dim() if _val(res) is not None else None
        if ndim is not None:
            dim %= ndim
        return _AllGather(ag, wait, res, shard, dim, group_name, nodes, view_dtype)
    res = wait
    nodes = [ag, wait]
    view_dtype = None
    if len(users) == 1 and users[0].target is aten.view.dtype:
        res = users[0]
        view_dtype = res.args[1]
        nodes.append(res)
    res = _skip_aliases(res, nodes)
    return _AllGather(ag, wait, res, shard, 0, group_name, nodes, view_dtype)


@dataclass
class _ReduceScatter:
    rs: fx.Node
    wait: fx.Node
    inp: fx.Node  # C as produced by the matmul
    scatter_dim: int
    reduce_op: str
    group_name: str
    nodes: list


def _match_reduce_scatter(rs: fx.Node) -> Optional[_ReduceScatter]:
    inp, reduce_op = rs.args[0], rs.args[1]
    group_name = rs.args[3] if len(rs.args) > 3 else rs.kwargs.get("group_name")
    waits = [u for u in rs.users if u.target is _c10d.wait_tensor.default]
    if len(waits) != 1:
        return None
    wait = waits[0]
    nodes = [rs, wait]
    dim = 0
    if inp.target is aten.cat.default and (inp.args[1] if len(inp.args) > 1 else 0) == 0:
        pieces = inp.args[0]
        if all(isinstance(p, fx.Node) and p.target is operator.getitem for p in pieces):
            splits = {p.args[0] for p in pieces}
            if len(splits) == 1:
                (split,) = splits
                if split.target in _SPLITS and len(inp.users) == 1 and len(split.users) == len(pieces):
                    dim = split.args[2] if len(split.args) > 2 else split.kwargs.get("dim", 0)
                    nodes = [split, *pieces, inp, rs, wait]
                    inp = split.args[0]
    if _val(inp) is not None:
        dim %= _val(inp).dim()
    return _ReduceScatter(rs, wait, inp, dim, reduce_op, group_name, nodes)


def _hidden_by_independent_matmul(coll: fx.Node, graph: fx.Graph) -> bool:
    """True when some matmul is neither ancestor nor descendant of the collective."""
    anc, desc = _ancestors([coll]), _descendants(coll)
    return any(n.target in _MMS and n not in anc and n not in desc for n in graph.nodes)


def _raise_ancestors(graph: fx.Graph, anchor: fx.Node, nodes: set) -> None:
    """Moves the nodes (ancestors of the fused op's arguments) that come after `anchor` above it."""
    order = {n: i for i, n in enumerate(graph.nodes)}
    for n in sorted(nodes, key=order.__getitem__):
        if n.op != "placeholder" and order[n] > order[anchor]:
            anchor.prepend(n)


class _Report:
    def __init__(self):
        self.fused, self.rejected = 0, 0

    def reject(self, what, node, why):
        self.rejected += 1
        env.log("mptp pass: not fusing %s %s: %s", what, node.name, why)

    def fuse(self, what, node, op):
        self.fused += 1
        env.log("mptp pass: fused %s %s -> %s", what, node.name, op)


def _fuse_all_gather(graph: fx.Graph, m: _AllGather, rep: _Report) -> None:
    if not _group_enabled(m.group_name):
        return rep.reject("all-gather", m.ag, f"group {m.group_name!r} is not enabled for symmetric memory")
    matmuls = _consumer_matmuls(m.res)
    if not matmuls:
        return rep.reject("all-gather", m.ag, "no matmul consumes the gathered tensor")
    if len({mm.scaled for mm in matmuls}) != 1:
        return rep.reject("all-gather", m.ag, "mixed matmul kinds (mm and _scaled_mm) consume it")
    collective = set(m.nodes)
    for mm in matmuls:
        if _ancestors(mm.other_args()) & collective:
            return rep.reject("all-gather", m.ag, f"{mm.mm.name}'s other arguments depend on the collective")
    shard_val = _val(m.shard)
    if shard_val is not None and m.gather_dim == shard_val.dim() - 1:
        return rep.reject("all-gather", m.ag, "gathering the last dim is not fused")
    scaled = matmuls[0].scaled
    if scaled:
        a_scales = {mm.arg(2, "scale_a") for mm in matmuls}
        if len(a_scales) != 1:
            return rep.reject("all-gather", m.ag, "matmuls use different A scales")
    # Insert where the all-gather starts; arguments' ancestors move above it.
    anchor = m.ag
    with graph.inserting_before(anchor):
        shard = m.shard
        if shard_val is not None and m.gather_dim != 0:
            from ..ops import restride_A_shard_for_fused_all_gather_matmul

            stride = restride_A_shard_for_fused_all_gather_matmul(shard_val, m.gather_dim).stride()
            shard = graph.call_function(inductor_prims.force_stride_order, (shard, stride))
        if m.view_dtype is not None:
            # Type-erased FP8: the shard travels as bytes; view it back first.
            shard = graph.call_function(aten.view.dtype, (shard, m.view_dtype))
        Bs = [mm.B for mm in matmuls]
        if not scaled:
            fused = graph.call_function(torch.ops.mptp.fused_all_gather_matmul.default,
                                        (shard, Bs, m.gather_dim, m.group_name), {"return_A": True})  # fmt: skip
            op = "mptp.fused_all_gather_matmul"
        else:
            a_scale = matmuls[0].arg(2, "scale_a")
            res_val = _val(m.res)
            if res_val is not None and res_val.dim() > 2 and _val(a_scale) is not None and _val(a_scale).numel() > 1:
                a_scale = graph.call_function(aten.reshape.default, (a_scale, [*res_val.shape[:-1], 1]))
            fused = graph.call_function(torch.ops.mptp.fused_all_gather_scaled_matmul.default, (
                shard, Bs, a_scale, [mm.arg(3, "scale_b") for mm in matmuls], m.gather_dim, m.group_name,
                [mm.arg(4, "bias") for mm in matmuls], [mm.arg(5, "scale_result") for mm in matmuls],
                [mm.arg(6, "out_dtype") for mm in matmuls], [bool(mm.arg(7, "use_fast_accum", False)) for mm in matmuls],
            ))  # fmt: skip
            op = "mptp.fused_all_gather_scaled_matmul"
        new_A = graph.call_function(operator.getitem, (fused, 0))
        outs = graph.call_function(operator.getitem, (fused, 1))
        new_outs = [graph.call_function(operator.getitem, (outs, i)) for i in range(len(matmuls))]
    # NOTE: computed before the matmuls are erased (erasing clears their args).
    args_anc = _ancestors([a for mm in matmuls for a in mm.other_args()])
    for mm, new in zip(matmuls, new_outs):
        mm.out.replace_all_uses_with(new)
        mm.erase(graph)
    m.res.replace_all_uses_with(new_A)
    for n in reversed(m.nodes):
        if not n.users:
            graph.erase_node(n)
    if not new_A.users:
        graph.erase_node(new_A)
        if not scaled:
            fused.kwargs = {"return_A": False}
    _raise_ancestors(graph, fused, args_anc - {fused})
    rep.fuse("all-gather", m.ag, op)


def _fuse_reduce_scatter(graph: fx.Graph, m: _ReduceScatter, rep: _Report) -> None:
    if not _group_enabled(m.group_name):
        return rep.reject("reduce-scatter", m.rs, f"group {m.group_name!r} is not enabled for symmetric memory")
    mm = _producer_matmul(m.inp)
    if mm is None:
        return rep.reject("reduce-scatter", m.rs, "its input is not produced by a matmul")
    first = m.nodes[0]
    if len(mm.out.users) != 1 or next(iter(mm.out.users)) is not first:
        return rep.reject("reduce-scatter", m.rs, "the matmul result has other users")
    if m.reduce_op not in ("sum", "avg"):
        return rep.reject("reduce-scatter", m.rs, f"reduce_op {m.reduce_op!r}")
    out_val = _val(mm.out)
    if out_val is not None and m.scatter_dim == out_val.dim() - 1:
        return rep.reject("reduce-scatter", m.rs, "scattering the last dim is not fused")
    A = mm.pre.args[0] if mm.pre is not None else mm.mm.args[0]
    with graph.inserting_before(m.wait):
        if not mm.scaled:
            if _val(A) is not None and m.scatter_dim != 0:
                from ..ops import restride_A_for_fused_matmul_reduce_scatter

                stride = restride_A_for_fused_matmul_reduce_scatter(_val(A), m.scatter_dim).stride()
                A = graph.call_function(inductor_prims.force_stride_order, (A, stride))
            fused = graph.call_function(torch.ops.mptp.fused_matmul_reduce_scatter.default,
                                        (A, mm.B, m.reduce_op, m.scatter_dim, m.group_name))  # fmt: skip
            op = "mptp.fused_matmul_reduce_scatter"
        else:
            A2 = mm.mm.args[0]  # the 2-D A that _scaled_mm saw; output_shape restores N-D
            out_shape = list(out_val.shape) if out_val is not None else None
            fused = graph.call_function(torch.ops.mptp.fused_scaled_matmul_reduce_scatter.default, (
                A2, mm.B, mm.arg(2, "scale_a"), mm.arg(3, "scale_b"), m.reduce_op, m.scatter_dim,
                m.scatter_dim if mm.post is None else 0, m.group_name, out_shape, mm.arg(4, "bias"),
                mm.arg(5, "scale_result"), mm.arg(6, "out_dtype"), bool(mm.arg(7, "use_fast_accum", False)),
            ))  # fmt: skip
            op = "mptp.fused_scaled_matmul_reduce_scatter"
    m.wait.replace_all_uses_with(fused)
    m.rs.replace_all_uses_with(fused)  # e.g. saved for backward before the wait
    for n in reversed(m.nodes):
        if n in graph.nodes and not n.users:
            graph.erase_node(n)
    mm.erase(graph)
    rep.fuse("reduce-scatter", m.rs, op)


def _retarget_symm_mem(graph: fx.Graph, rep: _Report) -> None:
    symm = getattr(torch.ops, "symm_mem", None)
    names = ("fused_all_gather_matmul", "fused_all_gather_scaled_matmul", "fused_matmul_reduce_scatter",
             "fused_scaled_matmul_reduce_scatter")  # fmt: skip
    for n in graph.nodes:
        for name in names:
            try:
                theirs = getattr(symm, name).default
            except (AttributeError, RuntimeError):
                continue
            if n.target is theirs:
                n.target = getattr(torch.ops.mptp, name).default
                rep.fuse("symm_mem op", n, f"mptp.{name}")


def micro_pipeline_pass(graph: fx.Graph) -> int:
    """Rewrites the graph in place; returns the number of fusions."""
    import mptp_kernels  # noqa: F401  (torch.ops.mptp must exist)

    rep = _Report()
    _retarget_symm_mem(graph, rep)
    reorder = bool(getattr(torch._inductor.config, "reorder_for_compute_comm_overlap", False))
    kinds = [
        ("all-gather", _c10d.all_gather_into_tensor.default, _match_all_gather, _fuse_all_gather,
         "its users do not form a known all-gather pattern"),
        ("reduce-scatter", _c10d.reduce_scatter_tensor.default, _match_reduce_scatter, _fuse_reduce_scatter,
         "no wait_tensor follows it"),
    ]  # fmt: skip
    total = 0
    for what, target, match, fuse, no_match in kinds:
        colls = [n for n in graph.nodes if n.target is target]
        total += len(colls)
        for coll in colls:
            m = match(coll)
            if m is None:
                rep.reject(what, coll, no_match)
            elif reorder and _hidden_by_independent_matmul(coll, graph):
                rep.reject(what, coll, "already hidden by an independent matmul (reorder_for_compute_comm_overlap)")
            else:
                fuse(graph, m, rep)
    graph.lint()
    if rep.fused == 0 and total:
        warnings.warn(
            f"mptp micro-pipeline pass is enabled but fused none of {total} collectives "
            "in this graph (MPTP_LOG=1 says why)",
            stacklevel=2,
        )
    return rep.fused
