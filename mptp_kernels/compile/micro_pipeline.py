"""Post-grad FX pass: all-gather -> matmul and matmul -> reduce-scatter become torch.ops.mptp.*.

Rewrites (pattern -> replacement; R* is a chain of logical reshapes: reshape,
view, _unsafe_view, flatten, unflatten, squeeze, unsqueeze, alias, clone):

  all-gather on dim d (any dim, the last one included):
      A = wait(all_gather(shard)) [-> view.dtype] [-> split dim 0 / slices -> cat(d)] [-> view.dtype]
      C_i = mm(R*(A), B_i) | bmm(R*(A), expand(B_i)) | _scaled_mm(R*(A), B_i, ...)
   -> A', [O_i] = fused_all_gather_matmul(shard, [B_i], d)  (or the scaled op)
      C_i := reshape(O_i, C_i.shape); A := A' where A has other users
      (several waits of one all-gather, and their identical reassemblies, are merged first)
  reduce-scatter on dim d (any dim, the last one included):
      C = R*(mm(X, B) | bmm(X, expand(B)) | _scaled_mm(X, B, ...))
      out = wait(reduce_scatter(C [-> split / slices along d -> cat(0)]))
   -> out := fused_matmul_reduce_scatter(reshape(X, [*C.shape[:-1], K]), B, op, d)
      (the scaled op takes X as it is, with output_shape = C.shape)
  torch.ops.symm_mem.fused_* (what PyTorch's own pass emits) => torch.ops.mptp.fused_*

Why R* is safe: a chain of logical reshapes is one reshape (row-major order, whatever
the strides), so R*(A) = A.reshape(M, K) whenever its last dim is A's last dim K, and
then mm(R*(A), B) = (A @ B).reshape(M, N). Likewise a reduce-scatter input
C = R*(X @ B) with last dim N is reshape(X, [*C.shape[:-1], K]) @ B.

NOTE: the invariant. A node is replaced only by a value of exactly its shape and
strides. Each rewrite builds its replacement, evaluates every new node on the
graph's fake tensors (the ops' fake impls are their reference code), restrides with
force_stride_order where only the strides differ, and compares with the replaced
node's meta["val"]. Anything it cannot prove (a shape or dtype mismatch, a failing
fake impl, a symbolic size equal only under a guard) erases what it built and leaves
the graph untouched. Symbolic sizes: compared only with statically_known_true (never a
guard); one the rewrite must pass (a reshape's size, a stride) is a node of the graph
(aten.sym_size.int of a tensor that stays, or Dynamo's symbol input), never a SymInt
argument; a size read (aten.sym_size.int) of a node the rewrite erases is rebuilt from
what stays, so nothing keeps the collective alive.

Not fused (the reason is logged under MPTP_LOG=1 and returned by explain()):
mixed matmul kinds on one all-gather; a matmul whose other arguments depend on the
collective; a matmul result with users besides the reduce-scatter; a matmul output
regrouped across its last dim; transposes/permutes between the collective and the
matmul; addmm/baddbmm (bias in the GEMM); a batched bmm whose B is not one matrix
broadcast over the batch; the scaled all-gather on the last dim (the op rejects it);
a last-dim all-gather whose result has users besides the matmuls (it would be
materialized, PyTorch skips it too); an FP8-output _scaled_mm (torch's CPU divides by
scale_result and overflows to NaN where the ops multiply and saturate); a matmul whose B
comes from a random draw (fallback_random) or a mutation that would have to move above
another one to reach the fused op; symbolic shapes in a scaled reduce-scatter,
symbolic sizes that may be 0 or 1 (x[:n] with a dynamic int n), a symbolic split whose
pieces are not provably W equal ones, and a symbolic scattered size not provably a
multiple of the world size (each would need a guard); groups not enabled for
symmetric memory; with reorder_for_compute_comm_overlap on, collectives that an
independent aten.mm hides (one mm hides one collective; as in PyTorch, addmm, bmm and
_scaled_mm hide nothing).
"""

import contextlib
import itertools
import operator
from dataclasses import dataclass
from typing import List, Optional

import torch
import torch.fx as fx
from torch._inductor import inductor_prims

from .. import env

__all__ = ["Decision", "micro_pipeline_pass", "recording"]

aten = torch.ops.aten
_c10d = torch.ops._c10d_functional


def _overloads(*names):
    out = []
    for name in names:
        packet, _, overload = name.partition(".")
        try:
            out.append(getattr(getattr(aten, packet), overload))
        except (AttributeError, RuntimeError):  # not in this torch version
            pass
    return tuple(out)


# Ops whose output is a row-major reshape of their first argument (same values).
_LOGICAL_RESHAPES = _overloads(
    "reshape.default", "view.default", "_unsafe_view.default", "flatten.using_ints", "unflatten.int",
    "squeeze.default", "squeeze.dim", "squeeze.dims", "unsqueeze.default", "alias.default", "clone.default",
)  # fmt: skip
_SPLITS = _overloads("split.Tensor", "split.sizes", "split_with_sizes.default")
_MM, _BMM, _SCALED_MM = aten.mm.default, aten.bmm.default, aten._scaled_mm.default
_MATMULS = (_MM, _BMM, _SCALED_MM)
_FP8 = tuple(getattr(torch, n) for n in ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz")
             if hasattr(torch, n))  # fmt: skip
# What can hide a collective when reorder_for_compute_comm_overlap is on: PyTorch's pass counts
# aten.mm only, and counting more would leave collectives unfused that PyTorch fuses.
_COMPUTE_INTENSIVE = (_MM,)


class _Reject(Exception):
    """A match the pass cannot prove equivalent; the message says why."""


def _val(n):
    return n.meta.get("val") if isinstance(n, fx.Node) else None


def _tval(n) -> torch.Tensor:
    v = _val(n)
    if not isinstance(v, torch.Tensor):
        raise _Reject(f"{getattr(n, 'name', n)} has no fake tensor in meta['val']")
    return v


def _static(v: torch.Tensor) -> bool:
    return all(isinstance(s, int) for s in (*v.shape, *v.stride()))


def _shapes_ok(*vals) -> bool:
    """Static, or symbolic sizes known to be >= 2 (dynamic=True: [tokens, hidden] gathered on dim
    0, [batch, seq, hidden] on the sequence dim, as PyTorch's pass fuses them). Every rewrite of
    them must prove sizes equal without a guard (_same_shape) and pass a symbolic size as a node
    of the graph (_Builder.size), never as a SymInt argument."""
    return all(_static(v) for v in vals) or all(_not_0_or_1(v) for v in vals)


# A gather of the last (K) dim is rewritten only where the shard's K is at least this (PyTorch's
# pass: smaller ones are too small to decompose).
LAST_DIM_MIN_K = 1024
_SYMBOLIC_WHY = ("a symbolic size that may be 0 or 1 (e.g. x[:n] with a dynamic int n), which "
                 "the rewrite would have to guard on (torch.compile(dynamic=False) fuses it, one "
                 "compile per shape)")
_SYMBOLIC_SPLIT_WHY = (
    "dynamic shapes: the collective's tensor is cut into pieces of symbolic size along one dim and "
    "joined along another (a gather or scatter of a dim > 0), and the pieces are not provably W "
    "equal ones in order without a guard (torch.compile(dynamic=False) fuses it, one compile per shape)"
)


_UNBACKED_SPLIT_WHY = (
    "a data-dependent size (e.g. rows of x[mask]): the collective's tensor is cut into pieces "
    "along one dim and joined along another (a gather or scatter of a dim > 0), and the pieces "
    "are not provably W equal ones in order without a guard, which a data-dependent size cannot "
    "have (dynamic=False does not change it; a dim-0 gather or scatter of it fuses)"
)


def _split_why(src: fx.Node) -> str:
    """Why a symbolic reassembly (_cut_symbolically) is not fused, with advice that applies."""
    from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols

    # NOTE: found by a hostile review: a gather of x[mask] on dim 1 was given the advice
    # dynamic=False, which does not make a data-dependent size static.
    return _UNBACKED_SPLIT_WHY if free_unbacked_symbols(_tval(src).shape) else _SYMBOLIC_SPLIT_WHY


def _cut_symbolically(src: fx.Node, W: int) -> bool:
    """src has symbolic sizes and is cut into W equal pieces along one dim (a split, or W slices)
    that one cat joins again along another dim: funcol's reassembly of a gather or scatter on a
    dim > 0, which _pieces_in_order matches only with static sizes (comparing symbolic ones would
    install a guard). Pieces used otherwise (a user's own split of a gathered tensor) are not."""
    from torch.fx.experimental.symbolic_shapes import statically_known_true

    v, users = _val(src), list(src.users)
    if not isinstance(v, torch.Tensor) or _static(v) or not users:
        return False
    if len(users) == 1 and users[0].target in _SPLITS:
        split = users[0]
        size, d = _val(split.args[1]) if isinstance(split.args[1], fx.Node) else split.args[1], _arg(split, 2, "dim", 0)
        if not (isinstance(size, (int, torch.SymInt)) and statically_known_true(size * W == v.shape[d % v.dim()])):
            return False
        pieces = list(split.users)
    elif len(users) == W and all(u.target is aten.slice.Tensor for u in users):
        pieces, d = users, _arg(users[0], 1, "dim", 0)
        if any(_arg(u, 1, "dim", 0) % v.dim() != d % v.dim() or _arg(u, 4, "step", 1) != 1 for u in users):
            return False
    else:
        return False
    cats = {_single_user(p) for p in pieces}
    if len(pieces) != W or len(cats) != 1:
        return False
    (cat,) = cats
    return (cat is not None and cat.target is aten.cat.default and set(cat.args[0]) == set(pieces)
            and _arg(cat, 1, "dim", 0) % v.dim() != d % v.dim())  # fmt: skip


def _not_0_or_1(v: torch.Tensor) -> bool:
    """Every backed symbol of v's sizes is known to be >= 2 (unbacked ones are never guarded on).

    NOTE: Dynamo's sizes are; a slice by a dynamic int (x[:n]) is not, and the restride and the
    ops' fake impls ask whether such a size is 0 or 1, which would install a guard."""
    from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols

    for s in v.shape:
        if isinstance(s, torch.SymInt):
            unbacked = free_unbacked_symbols(s)
            bound = s.node.shape_env.bound_sympy
            if any(bound(x).lower < 2 for x in s.node.expr.free_symbols if x not in unbacked):
                return False
    return True


def _arg(n: fx.Node, i: int, name: str, default=None):
    return n.args[i] if len(n.args) > i else n.kwargs.get(name, default)


def _ancestors(nodes) -> set:
    seen, stack = set(), [n for n in nodes if isinstance(n, fx.Node)]
    while stack:
        n = stack.pop()
        if n not in seen:
            seen.add(n)
            stack.extend(n.all_input_nodes)
    return seen


def _is_dense(v: torch.Tensor) -> bool:
    """Non-overlapping and dense: some permutation of the dims is contiguous."""
    return _is_dense_strides(v.shape, v.stride())


# Symbolic sizes and strides are looked for among the products of at most this many dims.
_MAX_SIZE_DIMS = 5


def _prod(xs):
    out = 1
    for x in xs:
        out = out * x
    return out


def _is_dense_strides(shape, stride) -> bool:
    """Some order of the dims (outermost first) makes `stride` the contiguous strides of `shape`;
    symbolic ones only where provably so (never a guard)."""
    shape, stride = list(shape), list(stride)
    if all(isinstance(x, int) for x in (*shape, *stride)):
        dims = sorted((st, sz) for sz, st in zip(shape, stride) if sz != 1)
        expected = 1
        for st, sz in dims:
            if st != expected:
                return False
            expected *= sz
        return True
    if len(shape) > _MAX_SIZE_DIMS:
        return False
    for order in itertools.permutations(range(len(shape))):
        want, expected = [None] * len(shape), 1
        for d in reversed(order):
            want[d], expected = expected, expected * shape[d]
        if _same_shape(want, stride):
            return True
    return False


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


def _check_group(group_name: str, graph_W: int) -> None:
    """_Reject unless the group is enabled and has as many ranks as the collective in the graph."""
    if not _group_enabled(group_name):
        raise _Reject(f"group {group_name!r} is not enabled for symmetric memory")
    from torch.distributed.distributed_c10d import _get_group_size_by_name

    try:
        W = _get_group_size_by_name(group_name)
    except Exception as e:  # noqa: BLE001
        raise _Reject(f"group {group_name!r} cannot be resolved: {e}") from None
    if W != graph_W:
        raise _Reject(f"the graph's collective spans {graph_W} ranks, group {group_name!r} has {W}")


# ---------------------------------------------------------------- decisions


@dataclass
class Decision:
    """What the pass did with one collective (or one retargeted symm_mem op)."""

    kind: str  # "all-gather" | "reduce-scatter" | "symm_mem op"
    node: str  # the collective's node name in the post-grad graph
    group_name: Optional[str]
    dim: Optional[int]  # gather_dim / scatter_dim, when matched
    fused: bool
    detail: str  # the op it became, or why it was not fused

    def __str__(self):
        where = f"group {self.group_name}" + (f", dim {self.dim}" if self.dim is not None else "")
        state = f"fused -> {self.detail}" if self.fused else f"not fused: {self.detail}"
        return f"{self.kind} {self.node} ({where}): {state}"


_sinks: List[list] = []


@contextlib.contextmanager
def recording(sink: list):
    """Appends every Decision the pass makes while active to `sink` (explain() uses it)."""
    _sinks.append(sink)
    try:
        yield sink
    finally:
        _sinks.remove(sink)


class _Report:
    def __init__(self):
        self.decisions: List[Decision] = []

    @property
    def fused(self) -> int:
        return sum(d.fused for d in self.decisions)

    def add(self, kind, node, group_name, dim, fused, detail):
        d = Decision(kind, node.name, group_name, dim, fused, detail)
        self.decisions.append(d)
        for sink in _sinks:
            sink.append(d)
        env.log("mptp pass: %s", d)


# ---------------------------------------------------------------- building checked replacements


class _Builder:
    """Inserts nodes before `anchor`, giving each its fake value; rolls all of them back on failure."""

    def __init__(self, graph: fx.Graph, anchor: fx.Node, fake_mode):
        self.graph, self.anchor, self.mode, self.new = graph, anchor, fake_mode, []

    def call(self, target, args, kwargs=None) -> fx.Node:
        kwargs = kwargs or {}
        with self.graph.inserting_before(self.anchor):
            n = self.graph.call_function(target, args, kwargs)
        self.new.append(n)
        fa, fk = torch.utils._pytree.tree_map_only(fx.Node, _val, (args, kwargs))
        try:
            with self.mode:
                n.meta["val"] = target(*fa, **fk)
        except Exception as e:  # noqa: BLE001 - any failure means "cannot prove it"
            raise _Reject(
                f"{getattr(target, '__name__', target)} fails on the fake inputs: {e}"
            ) from None
        return n

    @contextlib.contextmanager
    def before(self, node: fx.Node):
        """Inserts before `node` instead of the anchor while inside."""
        anchor, self.anchor = self.anchor, node
        try:
            yield
        finally:
            self.anchor = anchor

    def size(self, want, sources, factors=(1,)):
        """`want` as an int or as a node of the graph, never as a SymInt argument: a SymInt-valued
        source, or the product of some dims of a tensor source (aten.sym_size.int nodes), times
        one of `factors`, provably equal to it (no guard). Sources must come before the
        insertion point. _Reject when none is."""
        if isinstance(want, int):
            return want
        for src in sources:
            v = _val(src)
            if isinstance(v, torch.SymInt):
                runs = [(None, v)]
            elif isinstance(v, torch.Tensor) and v.dim() <= _MAX_SIZE_DIMS:
                runs = [(dims, _prod(v.shape[d] for d in dims))
                        for r in range(1, v.dim() + 1) for dims in itertools.combinations(range(v.dim()), r)]  # fmt: skip
            else:
                continue
            for dims, got in runs:
                for k in factors:
                    if not isinstance(got * k, int) and _same_shape([got * k], [want]):
                        return self._product(src, dims, k)
        raise _Reject(f"no node of the graph gives the symbolic size {want} without a guard")

    def _product(self, src: fx.Node, dims, k: int) -> fx.Node:
        node, const = (src if dims is None else None), k
        for d in dims or ():
            s = _tval(src).shape[d]
            if isinstance(s, int):
                const *= s
            else:
                part = self.call(aten.sym_size.int, (src, d))
                node = part if node is None else self.call(operator.mul, (node, part))
        return node if const == 1 else self.call(operator.mul, (node, const))

    def reshape(self, n: fx.Node, shape, sources=(), factors=(1,)) -> fx.Node:
        """n reshaped to `shape`; symbolic sizes come from n's own dims or from `sources`."""
        if _same_shape(_tval(n).shape, shape):
            return n
        if all(isinstance(d, int) for d in shape):
            return self.call(aten.reshape.default, (n, list(shape)))
        # NOTE: a symbolic size must be a node of the graph, not a SymInt argument.
        out = self.call(aten.reshape.default, (n, [self.size(d, [n, *sources], factors) for d in shape]))
        if not _same_shape(_tval(out).shape, shape):
            raise _Reject(f"a reshape to {list(shape)} gave {list(_tval(out).shape)}")
        return out

    def restride(self, n: fx.Node, stride, what: str) -> fx.Node:
        """n (dense strides) with exactly the dense strides `stride`: force_stride_order, which
        Inductor keeps (a clone's layout it may choose); symbolic strides as nodes of n's sizes."""
        v = _tval(n)
        if _same_shape(v.stride(), stride):
            return n
        if not _is_dense_strides(v.shape, stride):
            raise _Reject(f"{what}: strides {list(stride)} are not dense, cannot restride to them")
        n = self.call(inductor_prims.force_stride_order, (n, [self.size(s, [n]) for s in stride]))
        if not _same_shape(_tval(n).stride(), stride):
            raise _Reject(f"{what}: restrided to {_tval(n).stride()}, the graph has {stride}")
        return n

    def like(self, n: fx.Node, ref: torch.Tensor, what: str) -> fx.Node:
        """`n` restrided to exactly `ref`'s strides; _Reject unless shape and dtype already match."""
        v = _tval(n)
        if not _same_shape(v.shape, ref.shape) or v.dtype != ref.dtype:
            raise _Reject(
                f"{what}: the replacement is {v.dtype}{list(v.shape)}, the graph has {ref.dtype}{list(ref.shape)}"
            )
        return self.restride(n, ref.stride(), what)

    def rollback(self):
        for n in reversed(self.new):
            self.graph.erase_node(n)
        self.new = []


def _same_shape(a, b) -> bool:
    """Equal sizes, symbolic ones only when provably equal (never installs a guard)."""
    from torch.fx.experimental.symbolic_shapes import statically_known_true

    a, b = list(a), list(b)
    if len(a) != len(b):
        return False
    return all(x == y if isinstance(x, int) and isinstance(y, int) else statically_known_true(x == y)
               for x, y in zip(a, b))  # fmt: skip


def _fake_mode(nodes):
    from torch._subclasses.fake_tensor import FakeTensor

    for n in nodes:
        v = _val(n)
        if isinstance(v, FakeTensor):
            return v.fake_mode
    raise _Reject("the graph carries no fake tensors in meta['val']")


def _erase_dead(graph: fx.Graph, nodes) -> None:
    """Erases the given nodes that have no users left, users before producers."""
    order = {n: i for i, n in enumerate(graph.nodes)}
    for n in sorted(
        {n for n in nodes if n in order and n.op == "call_function"},
        key=order.__getitem__,
        reverse=True,
    ):
        if not n.users:
            graph.erase_node(n)


def _size_sources(graph: fx.Graph, erased: set, before: fx.Node) -> list:
    """The SymInt-valued nodes before `before` that do not depend on `erased` (Dynamo's symbol
    inputs, sym_size nodes of tensors that stay, their products)."""
    tainted, out = set(erased), []
    for n in graph.nodes:
        if n is before:
            break
        if n in tainted or any(a in tainted for a in n.all_input_nodes):
            tainted.add(n)
        elif isinstance(_val(n), torch.SymInt):
            out.append(n)
    return out


def _rewire_sizes(b: "_Builder", erased: set, tensors: list, W: int) -> list:
    """A size for each aten.sym_size.int that reads a node about to be erased (and is not erased
    itself), built before it from `tensors` or the graph's SymInt nodes (times 1 or W);
    returns (old, new) pairs; _Reject where one has none (the rewrite is then rolled back)."""
    pairs, first = [], {x: i for i, x in enumerate(b.graph.nodes)}
    for u in sorted({u for n in erased for u in n.users if u.target is aten.sym_size.int} - erased,
                    key=first.__getitem__):  # fmt: skip
        order = {x: i for i, x in enumerate(b.graph.nodes)}
        srcs = [t for t in tensors if order[t] < order[u]] + _size_sources(b.graph, erased, u)
        with b.before(u):
            pairs.append((u, b.size(_val(u), srcs, factors=(1, W))))
    return pairs


def _apply_rewired(pairs) -> list:
    """Points the users of each old size at its new one (a node, or an int for a static size)."""
    for old, new in pairs:
        if isinstance(new, fx.Node):
            old.replace_all_uses_with(new)
            continue
        for user in list(old.users):
            user.args, user.kwargs = torch.utils._pytree.tree_map_only(
                fx.Node, lambda a: new if a is old else a, (user.args, user.kwargs)
            )
    return [old for old, _ in pairs]


def _order_sensitive(n: fx.Node) -> bool:
    """Whether moving n changes what the graph computes: it draws from the global RNG
    (aten.rand & co. stay in the graph under config.fallback_random) or mutates an input."""
    t = n.target
    if not isinstance(t, torch._ops.OpOverload):
        return False
    return torch.Tag.nondeterministic_seeded in t.tags or t._schema.is_mutable


# Namespaces of ops known to compute locally (no communication); a wait only waits for a
# collective already issued, so moving it pairs nothing.
_LOCAL_NAMESPACES = ("aten", "prims", "inductor", "quantized_decomposed")


def _is_collective(n: fx.Node) -> bool:
    """Whether n may issue a collective: anything but a known local op. NOTE: deliberately wide:
    a custom op (vllm::all_reduce, a user's op calling dist.*) or a higher-order op
    (auto_functionalized around one) may communicate, and nothing in the graph says it does not."""
    t = n.target
    if n.op != "call_function" or t is operator.getitem:
        return False
    if isinstance(t, torch._ops.OpOverload):
        return t.namespace not in _LOCAL_NAMESPACES and t._schema.name.split("::")[-1] != "wait_tensor"
    # Python-level size arithmetic (operator.*, math.*, torch.sym_*) is local.
    return getattr(t, "__module__", "") not in ("_operator", "operator", "math", "builtins", "torch")


def _check_raisable(anchor: fx.Node, nodes: set) -> None:
    """_Reject when moving `nodes` above `anchor` would reorder two order-sensitive nodes:
    one of them that comes after `anchor` must not pass an order-sensitive node that stays.
    A collective never moves above the anchor (itself a collective): ranks pair collectives
    by order, and a rank whose graph was not rewritten (the pass decides per rank) would
    pair it with another."""
    stays = None  # the first order-sensitive node after anchor that does not move
    after = False
    for n in anchor.graph.nodes:
        if n is anchor:
            after = True
        elif after and n in nodes and _is_collective(n):
            raise _Reject(
                f"{n.name} ({n.target}) would have to move above the collective, and it may "
                "communicate itself: collectives must keep their order on every rank"
            )
        elif after and n.op == "call_function" and _order_sensitive(n):
            if n not in nodes:
                stays = stays or n
            elif stays is not None:
                raise _Reject(
                    f"{n.name} ({n.target}) would have to move above the collective and {stays.name}: "
                    "both draw random numbers or mutate, so that could change the graph's values"
                )


def _raise_ancestors(graph: fx.Graph, anchor: fx.Node, nodes: set) -> None:
    """Moves the nodes (a set closed under ancestry) that come after `anchor` above it, in order."""
    order = {n: i for i, n in enumerate(graph.nodes)}
    for n in sorted(nodes, key=order.__getitem__):
        if n.op != "placeholder" and order[n] > order[anchor]:
            anchor.prepend(n)


# ---------------------------------------------------------------- matmuls


@dataclass
class _Matmul:
    """mm / bmm / _scaled_mm whose first operand `A` is a logical reshape of a collective's value."""

    node: fx.Node
    chain: list  # the logical reshapes between the collective's value and A (A last)

    @property
    def A(self) -> fx.Node:
        return self.node.args[0]

    @property
    def scaled(self) -> bool:
        return self.node.target is _SCALED_MM

    def other_args(self) -> list:
        n = self.node
        if not self.scaled:
            return [n.args[1]]
        return [
            n.args[1],
            _arg(n, 2, "scale_a"),
            _arg(n, 3, "scale_b"),
            _arg(n, 4, "bias"),
            _arg(n, 5, "scale_result"),
        ]

    @property
    def expand(self) -> Optional[fx.Node]:
        """bmm's B when it is an expand (dead once the matmul is fused)."""
        B = self.node.args[1] if self.node.target is _BMM else None
        return B if B is not None and B.target is aten.expand.default else None

    def B_2d(self, b: _Builder) -> fx.Node:
        """The 2-D B; for bmm, the one matrix its batched B broadcasts."""
        B = self.node.args[1]
        if self.node.target is not _BMM:
            return B
        K, N = _tval(B).shape[1:]
        if B.target is aten.expand.default and _tval(B.args[0]).numel() == K * N:
            return b.reshape(B.args[0], [K, N])
        return b.call(aten.select.int, (B, 0, 0))

    def why_not(self) -> Optional[str]:
        n = self.node
        if self.scaled and _tval(n).dtype in _FP8:
            # NOTE: torch's own FP8-output _scaled_mm is not one thing (the CPU divides by
            # scale_result and overflows to NaN; CUDA ignores it in torch 2.10-2.11), while the
            # ops multiply and saturate (cuBLASLt): fusing would change the graph's values.
            return f"{n.name}: an FP8 output (torch's _scaled_mm and the ops define it differently)"
        if n.target is _BMM:
            B = _tval(n.args[1])
            # NOTE: without a guard (an unbacked batch size cannot be guarded on at all).
            if not (_same_shape(B.shape[:1], [1]) or _same_shape(B.stride()[:1], [0])):
                return f"{n.name}: bmm with a batched B (not one matrix broadcast over the batch)"
        return None


def _consumer_matmuls(res: fx.Node) -> list:
    """Matmuls whose first operand is res seen through logical reshapes only."""
    found, stack = [], [(res, [])]
    while stack:
        cur, chain = stack.pop()
        for u in cur.users:
            if not u.args or u.args[0] is not cur:
                continue
            if u.target in _LOGICAL_RESHAPES:
                stack.append((u, [*chain, u]))
            elif u.target in _MATMULS and cur not in u.args[1:]:
                found.append(_Matmul(u, chain))
    order = {n: i for i, n in enumerate(res.graph.nodes)}
    return sorted(found, key=lambda m: order[m.node])


def _reached_through_reshapes(res: fx.Node) -> list:
    """The nodes that use res, or a logical reshape of it, other than by such a reshape (what a
    rejection names: e.g. the addmm behind nn.Linear's reshape, not the reshape)."""
    found, stack, seen = [], [res], set()
    while stack:
        cur = stack.pop()
        for u in cur.users:
            if u.target in _LOGICAL_RESHAPES and u.args and u.args[0] is cur:
                if u not in seen:
                    seen.add(u)
                    stack.append(u)
            else:
                found.append(u)
    return found


def _fully_consumed(node: fx.Node, matmuls: set) -> bool:
    """True when every use of node is by one of the matmuls or by a reshape that itself is."""
    for u in _users(node):
        if u in matmuls and u.args[0] is node:
            continue
        if u.target in _LOGICAL_RESHAPES and u.args[0] is node and _fully_consumed(u, matmuls):
            continue
        return False
    return True


# ---------------------------------------------------------------- all-gather


@dataclass
class _AllGather:
    ag: fx.Node
    wait: fx.Node
    res: fx.Node  # A_full as the graph uses it
    shard: fx.Node
    gather_dim: int
    group_name: str
    nodes: list  # everything between ag and res, res last
    view_dtype: Optional[torch.dtype] = None  # type-erased FP8: the dtype A_full is viewed as last


_ALIASES = (aten.alias.default, aten.detach.default)


def _skip_aliases(n: fx.Node, nodes: list) -> fx.Node:
    """Follows single-user aten.alias / aten.detach chains (make_fx leaves them after views;
    torch 2.11's leaves detach after a view.dtype): the same values, no autograd post-grad."""
    while len(n.users) == 1 and next(iter(n.users)).target in _ALIASES:
        n = next(iter(n.users))
        nodes.append(n)
    return n


def _users(n: fx.Node) -> list:
    """n's users other than aten.sym_size.int: a rewrite that erases n gives those a size from
    what stays (_rewire_sizes); make_fx reads sizes so, where Dynamo passes symbols as inputs."""
    return [u for u in n.users if u.target is not aten.sym_size.int]


def _single_user(n: fx.Node) -> Optional[fx.Node]:
    users = _users(n)
    return users[0] if len(users) == 1 else None


def _pieces_in_order(src: fx.Node, dim: int, W: int, piece: int) -> Optional[list]:
    """The W pieces of src along dim, in order, as split+getitem or slice nodes; None otherwise."""
    # NOTE: symbolic sizes (dynamic=True) are matched in one form only, funcol's: a split by one
    # size (a node) provably equal to the piece, W of them making the dim. Comparing SymInts
    # with == or != would install a guard.
    static = isinstance(piece, int) and isinstance(_tval(src).shape[dim], int)
    users = _users(src)
    if len(users) == 1 and users[0].target in _SPLITS:
        split = users[0]
        sizes = split.args[1]
        if _arg(split, 2, "dim", 0) % _tval(src).dim() != dim:
            return None
        if not static:
            size = _val(sizes) if isinstance(sizes, fx.Node) else sizes
            if not (split.target is aten.split.Tensor and isinstance(size, (int, torch.SymInt))
                    and _same_shape([size, size * W], [piece, _tval(src).shape[dim]])):  # fmt: skip
                return None
            sizes = [piece] * W
        elif isinstance(sizes, int):
            sizes = [sizes] * W if sizes * W == _tval(src).shape[dim] else None
        if static and (not isinstance(sizes, (list, tuple)) or list(sizes) != [piece] * W):
            return None
        items = {}
        for g in split.users:
            if g.target is not operator.getitem or g.args[1] in items:
                return None
            items[g.args[1]] = g
        if sorted(items) != list(range(W)):
            return None
        return [split, *(items[i] for i in range(W))]
    slices = [u for u in users if u.target is aten.slice.Tensor]
    if not static or len(slices) != W or len(users) != W:
        return None
    size = _tval(src).shape[dim]
    by_start = {}
    for s in slices:
        d, start, end, step = (
            _arg(s, 1, "dim", 0),
            _arg(s, 2, "start"),
            _arg(s, 3, "end"),
            _arg(s, 4, "step", 1),
        )
        start, end = start or 0, size if end is None else min(end, size)
        if d % _tval(src).dim() != dim or step != 1 or end - start != piece or start % piece:
            return None
        by_start[start // piece] = s
    if sorted(by_start) != list(range(W)):
        return None
    return [by_start[i] for i in range(W)]


# Ops whose result depends on their arguments only and which read no mutable state: two of them
# with the same arguments are one value (merged by _merge_repeated_waits).
_PURE_READS = (*_overloads("split.Tensor", "split.sizes", "split_with_sizes.default", "cat.default", "view.dtype",
                           "slice.Tensor", "reshape.default", "view.default", "_unsafe_view.default",
                           "alias.default", "detach.default", "sym_size.int"),
               operator.getitem, operator.add, operator.sub, operator.mul, operator.floordiv)  # fmt: skip
# Of those, the ones whose result may share its input's storage (with every op whose schema
# says it returns a view of its input: _is_alias).
_VIEWS = (*_overloads("split.Tensor", "split.sizes", "split_with_sizes.default", "view.dtype", "slice.Tensor",
                      "reshape.default", "view.default", "_unsafe_view.default", "alias.default", "detach.default"),
          operator.getitem)  # fmt: skip


def _is_alias(n) -> bool:
    """n's result may share its first argument's storage: a view op by its schema (permute,
    transpose, unsqueeze, expand, select, as_strided, ...: found by a hostile review, a list of
    them missed the transposes of merged reads) or one of _VIEWS (reshape, _unsafe_view)."""
    return (isinstance(n, fx.Node) and n.op == "call_function"
            and (n.target in _VIEWS or getattr(n.target, "is_view", False)))  # fmt: skip


def _storage_base(n):
    """The node whose buffer n may view (itself unless n is a view of a node)."""
    while _is_alias(n) and n.args and isinstance(n.args[0], fx.Node):
        n = n.args[0]
    return n


def _merge_repeated_waits(ag: fx.Node, group_name: str) -> Optional[str]:
    """One all-gather waited on more than once (Inductor's CSE merges the identical gathers of one
    tensor, e.g. q, k and v each ColwiseParallel(input_layouts=Shard(1)), but not their waits
    and reassemblies): the later waits, and then each repeated pure read of them (the same split,
    getitem, cat, reshape of the same nodes), are replaced by the first, so that one gather feeds
    every matmul. The same values: a wait returns the gathered tensor, and a pure op of the same
    arguments computes the same thing; nothing that mutates may use a merged node.
    Returns why the waits were left unmerged (the match then reports it), else None."""
    waits = [u for u in ag.users if u.target is _c10d.wait_tensor.default]
    if len(waits) < 2 or not _group_enabled(group_name):
        return None
    order = {n: i for i, n in enumerate(ag.graph.nodes)}

    def key(n):
        leaves, spec = torch.utils._pytree.tree_flatten((n.args, n.kwargs))
        # NOTE: the type too: 2 == 2.0 == True, and merging a mul by 2 with one by 2.0 would
        # change a dtype (a hostile review, on a hand-built graph).
        return (n.target, repr(spec), *((type(x), x) for x in leaves))

    def mutated(n):
        """A user of n, or of a view of it, mutates (post-grad graphs are functional when the
        pass runs; a hand-built one need not be)."""
        stack, seen = [n], set()
        while stack:
            cur = stack.pop()
            for u in cur.users:
                if _order_sensitive(u):
                    return True
                if _is_alias(u) and u not in seen:
                    seen.add(u)
                    stack.append(u)
        return False

    output = next(n for n in reversed(ag.graph.nodes) if n.op == "output")
    leaves = torch.utils._pytree.tree_leaves(output.args)
    bases_before = [_storage_base(a) for a in leaves]
    # An output a merge could make share a buffer with another gets a clone (_unalias_outputs):
    # a tensor of its own, with its shape and strides and storage offset 0. The same value only
    # where each buffer the waits reach is returned through one output (the same node counts
    # once), dense (symbolic strides where provably so, no guard) and at offset 0. NOTE: found by
    # a hostile review: AOTAutograd rebuilds an output that views another output's buffer from
    # that output's storage offset at run time; a clone of one at offset 0 then returned another
    # slice of the data. Otherwise nothing is merged.
    reached, stack = set(waits), list(waits)
    while stack:
        for u in stack.pop().users:
            if u.target in _PURE_READS and u not in reached:
                reached.add(u)
                stack.append(u)
    returned = {}
    for a, base in zip(leaves, bases_before):
        v = _val(a)
        if base not in reached or isinstance(v, (torch.SymInt, torch.SymFloat, torch.SymBool, int, float, bool)):
            continue  # an output that is no tensor (a size saved for backward) shares no buffer
        name = a.name if isinstance(a, fx.Node) else repr(a)
        why = None
        if not (isinstance(v, torch.Tensor) and _is_dense(v)):
            why = f"{name} is not dense"
        elif not _same_shape([v.storage_offset()], [0]):
            why = f"{name} is a view at an offset into its buffer"
        elif returned.setdefault(base, a) is not a:
            why = f"{returned[base].name} and {name} view one buffer"
        if why is not None:
            return (f"waited on {len(waits)} times (Inductor merged identical gathers); the waits are merged "
                    "only where each buffer they reach is returned through one output, dense (with symbolic "
                    f"sizes: provably, without a guard) and at offset 0, and {why}")  # fmt: skip

    def repeated_reads(n):
        by_key = {}
        for u in sorted(n.users, key=order.__getitem__):
            if u.target in _PURE_READS and u.op == "call_function":
                try:
                    by_key.setdefault(key(u), []).append(u)
                except TypeError:  # an argument that cannot be compared: left as it is
                    continue
        return [g for g in by_key.values() if len(g) > 1]

    # The gather's own size reads (make_fx computes each split's size from one) merge as well.
    todo = [sorted(waits, key=order.__getitem__), *repeated_reads(ag)]
    why = None
    while todo:
        keep, *dups = todo.pop()
        if any(d not in order or mutated(d) for d in [keep, *dups]):
            if keep.target is _c10d.wait_tensor.default:
                why = (f"waited on {len(waits)} times (Inductor merged identical gathers), and a user of one "
                       "of the waits (or of a view of one) mutates it: the waits are not merged")  # fmt: skip
            continue
        for d in dups:
            d.replace_all_uses_with(keep)
            ag.graph.erase_node(d)
            del order[d]
        todo.extend(repeated_reads(keep))
    _unalias_outputs(output, bases_before)
    return why


def _unalias_outputs(output: fx.Node, bases_before: list) -> None:
    """Graph outputs that a merge made share a buffer (the same node returned twice, or views of
    one merged buffer) get a clone each, so that what the caller receives is distinct as before
    (found by a hostile review: a gathered tensor returned twice came back as one object). The
    merge runs only where such an output is the one output of its buffer, dense and at offset 0,
    so the clone is the same tensor as before, in a buffer of its own."""
    leaves, spec = torch.utils._pytree.tree_flatten(output.args)
    # NOTE: one clone per buffer before the merge (found by a hostile review: a node returned
    # twice got two clones, and two outputs that were one buffer came back as two).
    owner, clones = {}, {}
    for i, (a, before) in enumerate(zip(leaves, bases_before)):
        base = _storage_base(a)
        if not isinstance(base, fx.Node) or not isinstance(_val(a), torch.Tensor):
            continue
        first = owner.setdefault(base, i)
        if first != i and bases_before[first] is not before:
            if before not in clones:
                v = _tval(a)
                with output.graph.inserting_before(output):
                    c = output.graph.call_function(aten.clone.default, (a,))
                # NOTE: a clone of a dense tensor keeps its strides (preserve_format); built from
                # them, not by running the clone, whose density test would guard on symbolic strides.
                with v.fake_mode:
                    c.meta["val"] = torch.empty_strided(v.shape, v.stride(), dtype=v.dtype, device=v.device)
                clones[before] = c
            leaves[i] = clones[before]
    if clones:
        output.args = torch.utils._pytree.tree_unflatten(leaves, spec)


def _match_all_gather(ag: fx.Node) -> Optional[_AllGather]:
    shard, W, group_name = ag.args[0], _arg(ag, 1, "group_size"), _arg(ag, 2, "group_name")
    wait = _single_user(ag)
    if wait is None or wait.target is not _c10d.wait_tensor.default or _val(shard) is None:
        return None
    nodes = [ag, wait]
    src = _skip_aliases(wait, nodes)
    pieces = _pieces_in_order(src, 0, W, _tval(shard).shape[0])
    pre_view = _single_user(src) if pieces is None else None
    if pre_view is not None and pre_view.target is aten.view.dtype and _tval(shard).dim() >= 2:
        # The bytes viewed back before the split (funcol's reference form written out by hand
        # for an FP8 that travelled as bytes): a view.dtype keeps dim 0 of a >= 2-D tensor.
        viewed = _skip_aliases(pre_view, [])
        pre_pieces = _pieces_in_order(viewed, 0, W, _tval(shard).shape[0])
        if pre_pieces is not None:
            nodes.append(pre_view)
            src, pieces = _skip_aliases(pre_view, nodes), pre_pieces
    if pieces is None and _cut_symbolically(src, W):
        # NOTE: found by a hostile review: reported as a dim-0 gather refused for its shapes,
        # while the gather was on dim 1 (the split's symbolic sizes are not matched).
        raise _Reject(_split_why(src))
    if pieces is None:
        # gather_dim 0: A is the waited tensor (maybe viewed back from bytes).
        res, view_dtype = src, None
        user = _single_user(src)
        if user is not None and user.target is aten.view.dtype:
            res, view_dtype = user, user.args[1]
            nodes.append(res)
        return _AllGather(
            ag, wait, _skip_aliases(res, nodes), shard, 0, group_name, nodes, view_dtype
        )
    getitems = pieces[1:] if pieces[0].target in _SPLITS else pieces
    nodes.extend(pieces)
    # Optional per-piece view.dtype (type-erased fp8), then one cat in piece order.
    ends, view_dtype = [], (pre_view.args[1] if pre_view is not None and pre_view in nodes else None)
    piece_views = []
    for g in getitems:
        g = _skip_aliases(g, nodes)
        u = _single_user(g)
        if u is not None and u.target is aten.view.dtype:
            piece_views.append(u.args[1])
            nodes.append(u)
            g = _skip_aliases(u, nodes)
        else:
            piece_views.append(None)
        ends.append(g)
    # NOTE: the rewrite views the shard once, for every piece: only where every piece was viewed
    # as the same dtype, or none was. One piece viewed alone makes the cat promote the others
    # (a value conversion, not the same bytes): found by a hostile review (int32 pieces, one
    # viewed as float32, fused as if all were).
    if len(set(piece_views)) != 1:
        return None
    if piece_views[0] is not None:
        view_dtype = piece_views[0]
    cats = {_single_user(g) for g in ends}
    if len(cats) != 1:
        return None
    (cat,) = cats
    if cat is None or cat.target is not aten.cat.default or list(cat.args[0]) != ends:
        return None
    nodes.append(cat)
    res = _skip_aliases(cat, nodes)
    user = _single_user(res)
    # The pieces may be viewed as bytes and the cat viewed back (DTensor + float8): the last view wins.
    if user is not None and user.target is aten.view.dtype:
        res, view_dtype = user, user.args[1]
        nodes.append(res)
        res = _skip_aliases(res, nodes)
    gather_dim = _arg(cat, 1, "dim", 0) % _tval(cat).dim()
    return _AllGather(ag, wait, res, shard, gather_dim, group_name, nodes, view_dtype)


def _cpp_wrapper() -> bool:
    """Whether Inductor will call the graph's ops from its C++ wrapper (cpp_wrapper, AOTInductor)."""
    from torch._inductor import config
    from torch._inductor.virtualized import V

    return bool(getattr(config, "cpp_wrapper", False) or getattr(V, "aot_compilation", False))


def _fuse_all_gather(graph: fx.Graph, m: _AllGather) -> str:
    """Rewrites one matched all-gather; returns the op it became or raises _Reject."""
    if _cpp_wrapper():
        # NOTE: found by a hostile review: the C++ wrapper's fallback kernels return tensors only;
        # an all-gather-matmul returns a list (the graph failed to compile on the fusing rank).
        raise _Reject("Inductor's C++ wrapper (cpp_wrapper, AOTInductor) cannot call an op returning a list")
    shard_val, res_val = _tval(m.shard), _tval(m.res)
    last = m.gather_dim == res_val.dim() - 1
    W = _arg(m.ag, 1, "group_size")
    _check_group(m.group_name, W)
    if shard_val.dim() < 2:
        raise _Reject("the shard is 1-D (the ops take A with >= 2 dims)")
    if not _shapes_ok(shard_val, res_val):
        raise _Reject(_SYMBOLIC_WHY)
    collective = set(m.nodes)
    matmuls, skipped = [], []
    for mm in _consumer_matmuls(m.res):
        why = mm.why_not()
        if why is None and _ancestors(mm.other_args()) & collective:
            why = f"{mm.node.name}'s other arguments depend on the collective"
        if why is None and not _same_shape(_tval(mm.A).shape[-1:], res_val.shape[-1:]):
            why = f"{mm.node.name} multiplies a reshape of A that regroups its last dim"
        if why is None and not _shapes_ok(shard_val, res_val, _tval(mm.node)):
            why = _SYMBOLIC_WHY
        (skipped if why else matmuls).append(why or mm)
    if not matmuls:
        users = sorted({str(u.target) for u in _reached_through_reshapes(m.res)})
        raise _Reject(
            "; ".join(skipped)
            or "no matmul (mm, bmm, _scaled_mm) takes it, through reshapes only, as its first "
            f"operand (it reaches: {users or 'nothing'})"
        )
    if len({mm.scaled for mm in matmuls}) != 1:
        raise _Reject("mixed matmul kinds (mm/bmm and _scaled_mm) consume it")
    scaled = matmuls[0].scaled
    need_A = not _fully_consumed(m.res, {mm.node for mm in matmuls})
    if last and scaled:
        raise _Reject("the scaled op cannot gather the last (K) dim")
    if last and need_A:
        raise _Reject("gathering the last dim: the gathered tensor has users besides the matmuls")
    if last and not (isinstance(shard_val.shape[-1], int) and shard_val.shape[-1] >= LAST_DIM_MIN_K):
        # NOTE: as PyTorch's pass (and its test_fuse_all_gather_matmul, which asserts that a
        # small last-dim gather stays a plain all-gather): a shard's K below this is too small
        # to decompose; the op would run its reference anyway (the fused path gathers rows).
        raise _Reject(f"gathering the last dim of a shard with K = {shard_val.shape[-1]} "
                      f"(< {LAST_DIM_MIN_K}, as PyTorch's pass)")  # fmt: skip

    to_raise = _ancestors([a for mm in matmuls for a in mm.other_args()])
    _check_raisable(m.ag, to_raise)
    b = _Builder(graph, m.ag, _fake_mode([m.shard, m.res]))
    try:
        shard = m.shard
        if not last:  # the last dim is concatenated along K: nothing to move (as PyTorch)
            from ..ops import restride_A_shard_for_fused_all_gather_matmul

            # NOTE: symbolic shards are left as they are: the op copies them into the gather
            # buffer whatever their strides (the restride only makes that copy contiguous), and
            # Inductor would order symbolic strides by evaluating comparisons (guards).
            if _static(shard_val):
                stride = restride_A_shard_for_fused_all_gather_matmul(shard_val, m.gather_dim).stride()
                shard = b.restride(shard, stride, "the shard")
        if m.view_dtype not in (None, shard_val.dtype):
            shard = b.call(aten.view.dtype, (shard, m.view_dtype))  # fp8 travelled as bytes
        Bs = [mm.B_2d(b) for mm in matmuls]
        if not scaled:
            op = torch.ops.mptp.fused_all_gather_matmul.default
            fused = b.call(op, (shard, Bs, m.gather_dim, m.group_name), {"return_A": need_A})
        else:
            a_scales = {_arg(mm.node, 2, "scale_a") for mm in matmuls}
            if len(a_scales) != 1:
                raise _Reject("the matmuls use different A scales")
            a_scale = a_scales.pop()
            # Row-wise [M, 1] -> one row per row of A_full (the op's "replicated" mode).
            if not (isinstance(_tval(a_scale).numel(), int) and _tval(a_scale).numel() == 1):
                a_scale = b.reshape(a_scale, [*res_val.shape[:-1], 1], [m.shard], factors=(1, W))
            else:
                # NOTE: tensor-wise for the gathered A: 0-d, so the op cannot read it as a row-wise
                # sharded scale (its reading of [1, 1] when the shard has one row, as PyTorch's).
                a_scale = b.reshape(a_scale, [])
            nodes = [mm.node for mm in matmuls]
            op = torch.ops.mptp.fused_all_gather_scaled_matmul.default
            fused = b.call(op, (
                shard, Bs, a_scale, [_arg(n, 3, "scale_b") for n in nodes], m.gather_dim, m.group_name,
                [_arg(n, 4, "bias") for n in nodes], [_arg(n, 5, "scale_result") for n in nodes],
                [_arg(n, 6, "out_dtype") for n in nodes], [bool(_arg(n, 7, "use_fast_accum", False)) for n in nodes],
            ))  # fmt: skip
        outs = b.call(operator.getitem, (fused, 1))
        raw = [b.call(operator.getitem, (outs, i)) for i in range(len(matmuls))]
        new_mms = [b.like(b.reshape(out, _tval(mm.node).shape), _tval(mm.node), mm.node.name)
                   for out, mm in zip(raw, matmuls)]  # fmt: skip
        A_out = b.call(operator.getitem, (fused, 0)) if need_A else None
        new_A = b.like(A_out, res_val, m.res.name) if need_A else None
        erased = {*m.nodes, *(n for mm in matmuls for n in mm.chain)} - ({m.res} if need_A else set())
        sizes = _rewire_sizes(b, erased, [*raw, *([A_out] if need_A else []), m.shard], W)
    except _Reject:
        b.rollback()
        raise
    _raise_ancestors(graph, b.new[0], to_raise - set(b.new))
    rewired = _apply_rewired(sizes)
    expands = [mm.expand for mm in matmuls]
    for mm, new in zip(matmuls, new_mms):
        mm.node.replace_all_uses_with(new)
    if new_A is not None:
        m.res.replace_all_uses_with(new_A)
    _erase_dead(
        graph,
        [
            *(mm.node for mm in matmuls),
            *(n for mm in matmuls for n in mm.chain),
            *m.nodes,
            *expands,
            *rewired,
        ],
    )
    return (
        f"mptp.{op._schema.name.split('::')[1]} ({len(matmuls)} matmul{'s' * (len(matmuls) > 1)})"
    )


# ---------------------------------------------------------------- reduce-scatter


@dataclass
class _ReduceScatter:
    rs: fx.Node
    wait: fx.Node
    inp: fx.Node  # C, the tensor reduce-scattered along scatter_dim
    scatter_dim: int
    reduce_op: str
    group_name: str
    nodes: list  # the reassembly (split/slices + cat) and rs, wait


def _match_reduce_scatter(rs: fx.Node) -> Optional[_ReduceScatter]:
    inp, reduce_op, W = rs.args[0], _arg(rs, 1, "reduce_op"), _arg(rs, 2, "group_size")
    group_name = _arg(rs, 3, "group_name")
    waits = [u for u in rs.users if u.target is _c10d.wait_tensor.default]
    if len(waits) != 1 or _val(inp) is None:
        return None
    nodes, dim = [rs, waits[0]], 0
    if inp.target is aten.cat.default and _arg(inp, 1, "dim", 0) == 0 and len(_users(inp)) == 1:
        pieces = list(inp.args[0])
        # NOTE: a piece may be a graph input (no args) or a constant (args not nodes): not a split.
        first = pieces[0] if pieces and isinstance(pieces[0], fx.Node) else None
        src = first.args[0] if first is not None and first.args else None
        if isinstance(src, fx.Node) and src.target in _SPLITS:
            src = src.args[0] if src.args else None
        if isinstance(src, fx.Node) and _val(src) is not None:
            for d in range(_tval(src).dim()):
                size = _tval(src).shape[d]
                if isinstance(size, int):
                    if size % W:
                        continue
                    piece = size // W
                else:  # the first piece's size, provably a W-th of it (no guard)
                    pv = _val(first)
                    if not (isinstance(pv, torch.Tensor) and pv.dim() == _tval(src).dim()
                            and _same_shape([pv.shape[d] * W], [size])):  # fmt: skip
                        continue
                    piece = pv.shape[d]
                found = _pieces_in_order(src, d, W, piece)
                getitems = found[1:] if found and found[0].target in _SPLITS else found
                if found is not None and getitems == pieces:
                    nodes, dim, inp = [*found, inp, *nodes], d, src
                    break
            else:
                if _cut_symbolically(src, W):
                    # NOTE: found by a hostile review: reported as "its input is not a matmul (it
                    # is aten.cat)", while the cause was the pieces' symbolic sizes.
                    raise _Reject(_split_why(src))
    return _ReduceScatter(rs, waits[0], inp, dim, reduce_op, group_name, nodes)


def _producer_matmul(C: fx.Node, collective: set) -> _Matmul:
    """The matmul whose result C is, through logical reshapes used by nothing else; _Reject otherwise."""
    chain, n = [], C
    while n.target in _LOGICAL_RESHAPES:
        chain.append(n)
        n = n.args[0]
    if n.target not in _MATMULS:
        raise _Reject(f"its input is not a matmul seen through reshapes (it is {n.target})")
    for node, users in zip([n, *reversed(chain)], [*({u} for u in reversed(chain)), collective]):
        if set(_users(node)) - users:
            raise _Reject(f"the matmul result has other users ({node.name})")
    return _Matmul(n, chain)


def _fuse_reduce_scatter(graph: fx.Graph, m: _ReduceScatter) -> str:
    _check_group(m.group_name, _arg(m.rs, 2, "group_size"))
    if m.reduce_op not in ("sum", "avg"):
        raise _Reject(f"reduce_op {m.reduce_op!r}")
    mm = _producer_matmul(m.inp, set(m.nodes))
    why = mm.why_not()
    if why:
        raise _Reject(why)
    C, out = _tval(m.inp), _tval(m.wait)
    X = _tval(mm.A)
    if m.reduce_op == "avg" and not (C.dtype.is_floating_point or C.dtype.is_complex):
        # NOTE: found by a hostile review: gloo's "avg" of integers raises, the op's truncates;
        # the rewrite must not turn the graph's error (or a backend's own rounding) into our value.
        raise _Reject(f"reduce_op 'avg' of {C.dtype} (integers: the backends differ)")
    if not _shapes_ok(C, out, X):
        raise _Reject(_SYMBOLIC_WHY)
    if mm.scaled and not _static(C):
        raise _Reject("symbolic shapes: the scaled op's output_shape would carry them")
    K, N = X.shape[-1], _tval(mm.node).shape[-1]
    if not _same_shape(C.shape[-1:], [N]):
        raise _Reject(
            f"the matmul output [.., {N}] is regrouped across its last dim into {list(C.shape)}"
        )
    if C.dim() < 2:
        raise _Reject("the reduce-scattered tensor is 1-D")
    # NOTE: the op checks this; asked of a symbolic size it would install a guard (funcol's
    # reduce_scatter_tensor asserts it while tracing, torch.ops._c10d_functional does not).
    if not _same_shape([C.shape[m.scatter_dim] % _arg(m.rs, 2, "group_size")], [0]):
        raise _Reject(
            f"dim {m.scatter_dim} of {list(C.shape)} is not provably a multiple of the world size"
        )
    last = m.scatter_dim == C.dim() - 1
    # NOTE: the fused op goes where the reduce-scatter was issued, not where it was waited for:
    # a collective issued in between would otherwise run before it on this rank only.
    b = _Builder(graph, m.rs, _fake_mode([m.inp, m.wait]))
    W = _arg(m.rs, 2, "group_size")
    erased = {*m.nodes, mm.node, *mm.chain} - {m.rs, m.wait}  # those two are replaced
    try:
        if not mm.scaled:
            # C's leading sizes from what stays: Dynamo's symbols, sym_size nodes of kept tensors.
            A = b.reshape(mm.A, [*C.shape[:-1], K], _size_sources(graph, erased, m.rs))
            # NOTE: the last (N) dim is scattered by splitting B's columns, so A keeps its layout
            # (PyTorch's helper would move K outermost: a copy into a column-major A for nothing).
            # A symbolic A is left as it is: the op copies it into the chunk order whatever its
            # strides, and Inductor would order symbolic strides by evaluating comparisons.
            if not last and _static(_tval(A)):
                from ..ops import restride_A_for_fused_matmul_reduce_scatter

                stride = restride_A_for_fused_matmul_reduce_scatter(_tval(A), m.scatter_dim).stride()
                A = b.restride(A, stride, "A")
            op = torch.ops.mptp.fused_matmul_reduce_scatter.default
            fused = b.call(op, (A, mm.B_2d(b), m.reduce_op, m.scatter_dim, m.group_name))
        else:
            n = mm.node
            # X is the 2-D A that _scaled_mm saw; output_shape restores C's grouping.
            after = m.scatter_dim if C.dim() == 2 else (1 if last else 0)
            op = torch.ops.mptp.fused_scaled_matmul_reduce_scatter.default
            fused = b.call(op, (
                mm.A, n.args[1], _arg(n, 2, "scale_a"), _arg(n, 3, "scale_b"), m.reduce_op, m.scatter_dim, after,
                m.group_name, list(C.shape), _arg(n, 4, "bias"), _arg(n, 5, "scale_result"), _arg(n, 6, "out_dtype"),
                bool(_arg(n, 7, "use_fast_accum", False)),
            ))  # fmt: skip
        new = b.like(fused, out, m.wait.name)
        sizes = _rewire_sizes(b, erased, [mm.A, new], W)
    except _Reject:
        b.rollback()
        raise
    rewired = _apply_rewired(sizes)
    m.wait.replace_all_uses_with(new)
    m.rs.replace_all_uses_with(new)  # e.g. saved for backward before the wait
    expand = mm.expand
    _erase_dead(graph, [*m.nodes, mm.node, *mm.chain, expand, *rewired])
    return f"mptp.{op._schema.name.split('::')[1]}"


# ---------------------------------------------------------------- the pass


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
                rep.add("symm_mem op", n, None, None, True, f"mptp.{name}")


def _hidden_collectives(graph: fx.Graph, targets) -> set:
    """PyTorch's estimate: each compute-intensive node neither ancestor nor descendant of a
    collective can hide it, and each one hides exactly one collective (graph order, first fit)."""
    nodes = list(graph.nodes)
    bit = {n: 1 << i for i, n in enumerate(nodes)}
    anc = {}
    for n in nodes:
        a = 0
        for i in n.all_input_nodes:
            a |= anc[i] | bit[i]
        anc[n] = a
    colls = [n for n in nodes if n.target in targets]
    mms = [n for n in nodes if n.op == "call_function" and n.target in _COMPUTE_INTENSIVE]
    candidates = {
        c: [x for x in mms if not (anc[x] & bit[c]) and not (anc[c] & bit[x])] for c in colls
    }
    available = {x for xs in candidates.values() for x in xs}
    hidden = set()
    for c in colls:
        for x in candidates[c]:
            if x in available:
                hidden.add(c)
                available.remove(x)
                break
    return hidden


def micro_pipeline_pass(graph: fx.Graph) -> int:
    """Rewrites the graph in place; returns the number of fusions (retargeted symm_mem ops included)."""
    import mptp_kernels  # noqa: F401  (torch.ops.mptp must exist)

    rep = _Report()
    _retarget_symm_mem(graph, rep)
    ag_t, rs_t = _c10d.all_gather_into_tensor.default, _c10d.reduce_scatter_tensor.default
    hidden = set()
    if getattr(torch._inductor.config, "reorder_for_compute_comm_overlap", False):
        hidden = _hidden_collectives(graph, (ag_t, rs_t))
    kinds = [
        ("all-gather", ag_t, _match_all_gather, _fuse_all_gather, "gather_dim", "no wait_tensor follows it"),
        ("reduce-scatter", rs_t, _match_reduce_scatter, _fuse_reduce_scatter, "scatter_dim", "no wait_tensor follows it"),
    ]  # fmt: skip
    total = 0
    # All-gathers first (as PyTorch): their matmuls are not producers of a reduce-scatter any more.
    for what, target, match, fuse, dim_attr, no_match in kinds:
        colls = [n for n in graph.nodes if n.target is target]
        total += len(colls)
        for coll in colls:
            group = _arg(coll, 2 if target is ag_t else 3, "group_name")
            merge_why = None
            if target is ag_t:
                try:
                    merge_why = _merge_repeated_waits(coll, group)
                except Exception as e:  # noqa: BLE001 - each merge is the same value: what is done stands
                    env.logger.info("mptp: repeated waits of %s not merged: %s", coll.name, e)
            try:
                m = match(coll)
            except _Reject as e:
                rep.add(what, coll, group, None, False, str(e))
                continue
            except Exception as e:  # noqa: BLE001 - matching only reads the graph: leave it unfused
                rep.add(what, coll, group, None, False, f"unrecognized form ({type(e).__name__} while matching: {e})")
                continue
            if m is None:
                rep.add(
                    what,
                    coll,
                    group,
                    None,
                    False,
                    no_match if not coll.users else merge_why or "unrecognized form",
                )
                continue
            dim = getattr(m, dim_attr)
            if coll in hidden:
                rep.add(what, coll, group, dim, False,
                        "an independent matmul already hides it (reorder_for_compute_comm_overlap)")  # fmt: skip
                continue
            try:
                rep.add(what, coll, group, dim, True, fuse(graph, m))
            except _Reject as e:
                rep.add(what, coll, group, dim, False, str(e))
    # Coalesced collectives (several tensors in one call, e.g. FSDP's): reported, never fused.
    for what, name, gidx in (("all-gather (coalesced)", "all_gather_into_tensor_coalesced", 2),
                             ("reduce-scatter (coalesced)", "reduce_scatter_tensor_coalesced", 3)):  # fmt: skip
        op = getattr(_c10d, name, None)
        target = getattr(op, "default", None)
        for coll in [n for n in graph.nodes if target is not None and n.target is target]:
            total += 1
            rep.add(what, coll, _arg(coll, gidx, "group_name"), None, False,
                    "a coalesced collective (several tensors in one call) is not fused")  # fmt: skip
    graph.lint()
    if rep.fused == 0 and total:
        # NOTE: logged, not warnings.warn: under -W error (or pytest's filterwarnings = error) a
        # warning raised inside Inductor fails the compile of a valid program (a hostile review).
        env.logger.warning(
            "mptp micro-pipeline pass is enabled but fused none of %d collectives in this graph "
            "(MPTP_LOG=1 or mptp_kernels.explain() says why)", total)  # fmt: skip
    return rep.fused
