"""torch.compile integration: enable_micro_pipeline_tp() installs the mptp FX pass.

    mptp_kernels.enable_micro_pipeline_tp()          # for the rest of the process
    with mptp_kernels.enable_micro_pipeline_tp():     # or for a block: torch.compile compiles
        loss = torch.compile(model)(x).sum()          # at the first call, so make it inside
    loss.backward()                                   # (the backward was compiled with it)
    mptp_kernels.disable_micro_pipeline_tp()
    mptp_kernels.explain(model, x)                    # per collective: fused or not, and why

The pass is installed as torch._inductor.config.post_grad_custom_post_pass,
running whatever was installed there first (one pass, a list of passes, plain
functions or CustomInferenceAwareGraphPass). PyTorch's own async-TP pass
(config._micro_pipeline_tp) is switched off while ours is on, so the two never
rewrite the same graph; symm_mem.fused_* nodes that still reach us are
retargeted to mptp.

Inside a with-block, AOTAutograd compiles a graph's backward together with its forward
(torch._functorch.config.force_non_lazy_backward_lowering), not lazily at the first backward:
a backward run after the block had exited was compiled without the pass, and the AOTAutograd
cache stored it under the forward's key, which says the pass ran (found by a hostile review).

FX graph cache: the uuid covers every pass that runs (the chained ones' uuids,
the source of this package's pass and of the ops' fake impls it evaluates, and
the groups enabled for symmetric memory, which decide what it fuses). When a
chained pass has no stable uuid (a plain function, or a CustomGraphPass whose
uuid() is falsy) our uuid is None, and Inductor bypasses the cache exactly as it
would for that pass alone.
"""

import hashlib
import logging
import os
from collections import OrderedDict
from typing import Optional, Tuple

import torch
import torch._functorch.config
from torch._inductor import custom_graph_pass
from torch._inductor.custom_graph_pass import CustomGraphPass

from .micro_pipeline import Decision, micro_pipeline_pass, recording

_log = logging.getLogger("mptp_kernels")

__all__ = [
    "Decision",
    "MicroPipelineTPPass",
    "disable_micro_pipeline_tp",
    "enable_micro_pipeline_tp",
    "explain",
    "micro_pipeline_pass",
]

# Inductor calls these with is_inference (pytorch#171049, merged 2026-02); older torch has no
# such class. Lists in the slot are Inductor's only since pytorch#184108 (2026-05): the wrapper
# runs them itself, so they work on every torch this package supports.
_InferenceAware = getattr(custom_graph_pass, "CustomInferenceAwareGraphPass", None)


def _source_hash(pkg: Optional[str] = None) -> str:
    """Every Python source of the package: the pass proves rewrites with the ops' fake impls,
    which reach the reference, validation and transport code, so any change must miss the cache."""
    pkg = pkg or os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    h = hashlib.sha256()
    for root, dirs, names in sorted(os.walk(pkg)):
        dirs.sort()
        for name in sorted(n for n in names if n.endswith(".py")):
            path = os.path.join(root, name)
            h.update(os.path.relpath(path, pkg).encode() + b"\0")
            with open(path, "rb") as fh:
                h.update(fh.read())
    return h.hexdigest()


_SOURCE_HASH = _source_hash()


def _as_list(p) -> list:
    if p is None:
        return []
    return list(p) if isinstance(p, (list, tuple)) else [p]


def _without_mptp(p):
    """`p` (None, a pass, or a list/tuple of passes) with every MicroPipelineTPPass that
    enable_micro_pipeline_tp() installed replaced by what it chains (one the user built stays)."""
    if isinstance(p, MicroPipelineTPPass) and p._owned:
        return _without_mptp(p.chained)
    if not isinstance(p, (list, tuple)):
        return p
    out = []
    for q in p:
        out.extend(_as_list(_without_mptp(q)))
    return type(p)(out) if out else None


def _has_mptp(p) -> bool:
    """Whether the mptp pass already runs in `p` (alone, in a list, or chained in a wrapper)."""
    if isinstance(p, MicroPipelineTPPass):
        return True
    if isinstance(p, (list, tuple)):
        return any(_has_mptp(q) for q in p)
    return False


def _enabled_groups() -> tuple:
    from .. import ops

    groups = set(getattr(ops, "_ENABLED_GROUPS", ()))
    try:
        import torch.distributed._symmetric_memory as symm

        groups |= set(getattr(symm, "_group_name_to_store", {}))
    except Exception:  # noqa: BLE001 - no distributed build
        pass
    return tuple(sorted(groups))


# AOTAutograd graphs (aot_id) whose forward or inference graph was compiled with the pass installed.
_WITH_PASS: "OrderedDict[str, None]" = OrderedDict()


def _aot_graph() -> Optional[Tuple[str, str]]:
    """(aot_id, "forward" | "backward" | "inference") of the graph AOTAutograd compiles now, or None
    where this torch does not say (its TracingContext's aot_graph_name, "<aot_id>_<kind>")."""
    try:
        ctx = torch._guards.TracingContext.try_get()
        names = getattr(ctx, "aot_graph_name", None) if ctx is not None else None
    except Exception:  # noqa: BLE001 - no tracing context on this torch
        return None
    if not names:
        return None
    aot_id, _, kind = str(names[0] if isinstance(names, (list, tuple)) else names).rpartition("_")
    return (aot_id, kind) if aot_id else None


def _backward_of_unseen_forward() -> bool:
    """Whether the graph being compiled is a backward whose forward the pass did not see compile
    (the pass and its uuid(), which the FX graph cache asks first, record every forward they see).

    NOTE: AOTAutograd computes its cache key when the forward compiles and stores the entry once
    the backward has compiled, lazily at the first backward by default. A backward fused by a
    pass enabled between the two was stored under a key that says the pass did not run:
    processes that never enable it (or never import this package) then loaded a backward calling
    torch.ops.mptp (found by a hostile review). Whether the pass was installed while such a
    forward compiled cannot be told (a forward with no call in it reaches neither the pass nor
    uuid(); the config is per thread; the slot may be patched), so such a backward is fused but
    never cached: its uuid() is None, which makes Inductor bypass the FX graph cache for it, and
    AOTAutograd stores no entry whose backward has no FX cache key. Where AOTAutograd bundles
    its entries anyway (bundled_autograd_cache, caching_precompile), it stays unfused instead."""
    g = _aot_graph()
    if g is None:
        return False
    aot_id, kind = g
    if kind != "backward":
        _WITH_PASS[aot_id] = None
        if len(_WITH_PASS) > 4096:
            _WITH_PASS.popitem(last=False)
        return False
    return aot_id not in _WITH_PASS


def _bundled_autograd_cache() -> bool:
    """Whether AOTAutograd stores entries whose graphs have no FX cache key (unknown: True)."""
    try:
        from torch._functorch._aot_autograd.autograd_cache import should_bundle_autograd_cache

        return bool(should_bundle_autograd_cache())
    except Exception:  # noqa: BLE001 - not on this torch: assume it may
        return True


class MicroPipelineTPPass(_InferenceAware or CustomGraphPass):
    """The mptp post-grad pass, running the previously installed pass(es) first.

    Args:
        chained: what post_grad_custom_post_pass held before: None, a pass, or a
            list/tuple of passes (CustomGraphPass, CustomInferenceAwareGraphPass or
            plain callables taking the graph).
    """

    def __init__(self, chained=None):
        self.chained = chained
        self._owned = False  # True when enable_micro_pipeline_tp() installed it

    def __call__(self, graph: torch.fx.Graph, is_inference: bool = False) -> None:
        for p in _as_list(self.chained):
            if _InferenceAware is not None and isinstance(p, _InferenceAware):
                p(graph, is_inference=is_inference)
            else:
                p(graph)
        if _backward_of_unseen_forward() and _bundled_autograd_cache():
            _log.info("mptp: a backward whose forward the pass did not see stays unfused (bundled autograd cache)")
            return
        micro_pipeline_pass(graph)

    def uuid(self) -> Optional[tuple]:
        if _backward_of_unseen_forward():
            return None  # never cached (see _backward_of_unseen_forward)
        chained = []
        for p in _as_list(self.chained):
            # NOTE: Inductor's own rule (codecache._check_custom_passes): a pass that is
            # not a CustomGraphPass or whose uuid() is falsy makes the graph uncacheable.
            u = p.uuid() if isinstance(p, CustomGraphPass) else None
            if not u:
                return None
            chained.append(u)
        return ("mptp-micro-pipeline", _SOURCE_HASH, _enabled_groups(), tuple(chained))


_state = {"depth": 0, "torch_flag": None}


class _Enabled:
    """Returned by enable_micro_pipeline_tp(); usable as a context manager.

    Inside the block AOTAutograd compiles a graph's backward with its forward
    (torch._functorch.config.force_non_lazy_backward_lowering): lazily, a backward first run
    after the block compiled without the pass, and the AOTAutograd cache stored it under the
    forward's key, which says the pass ran (found by a hostile review). Enabled without a block,
    the pass stays on for the backward, compiled lazily as usual."""

    _prev = None

    def __enter__(self):
        fcfg = torch._functorch.config
        if hasattr(fcfg, "force_non_lazy_backward_lowering"):
            self._prev = fcfg.force_non_lazy_backward_lowering
            fcfg.force_non_lazy_backward_lowering = True
        return self

    def __exit__(self, *exc):
        fcfg = torch._functorch.config
        # back to what it was, unless the user set it inside the block (their value stays)
        if self._prev is not None and getattr(fcfg, "force_non_lazy_backward_lowering", None) is True:
            fcfg.force_non_lazy_backward_lowering = self._prev
        disable_micro_pipeline_tp()
        return False


def enable_micro_pipeline_tp() -> _Enabled:
    """Installs the mptp pass into Inductor's post-grad custom pass slot, after what is there
    (unless it already runs there).

    Calls nest: the pass stays installed until every enable has been matched by a
    disable (or its with-block has exited). Inside a with-block, backwards compile with their
    forwards (see _Enabled).
    """
    cfg = torch._inductor.config
    if _state["depth"] == 0:
        _state["torch_flag"] = getattr(cfg, "_micro_pipeline_tp", None)
    _state["depth"] += 1
    # NOTE: where the pass already runs (an outer enable, or one the user installed), the slot is
    # left as it is: re-wrapping would move passes the user put after ours in front of it.
    if not _has_mptp(cfg.post_grad_custom_post_pass):
        p = MicroPipelineTPPass(cfg.post_grad_custom_post_pass)
        p._owned = True
        cfg.post_grad_custom_post_pass = p
    if hasattr(cfg, "_micro_pipeline_tp"):
        cfg._micro_pipeline_tp = False
    return _Enabled()


def disable_micro_pipeline_tp() -> None:
    """Removes the mptp pass from whatever is installed now, keeping every other pass.

    A pass the user installed after enable_micro_pipeline_tp() (alone, or in a list
    with ours) survives. Restores PyTorch's _micro_pipeline_tp flag, unless the user set it
    while the pass was on.
    """
    cfg = torch._inductor.config
    _state["depth"] = max(_state["depth"] - 1, 0)
    if _state["depth"] > 0:
        return
    cfg.post_grad_custom_post_pass = _without_mptp(cfg.post_grad_custom_post_pass)
    # Back to what it was, unless the user set it meanwhile (their value stays).
    if _state["torch_flag"] is not None and getattr(cfg, "_micro_pipeline_tp", None) is False:
        cfg._micro_pipeline_tp = _state["torch_flag"]
    _state["torch_flag"] = None


def explain(fn, *example_args, verbose: bool = True, **example_kwargs) -> list:
    """Compiles and runs fn once with the pass on; returns (and prints) what it did per collective.

    Every rank of the groups involved must call it (it runs fn). Dynamo's caches are
    reset before and after, and Inductor's caches are bypassed, so the pass runs on
    every graph fn compiles to (forward graphs; a backward compiles when it runs).

    Args:
        fn: a function or nn.Module.
        example_args, example_kwargs: its inputs.
        verbose: print one line per collective.

    Returns:
        [Decision(kind, node, group_name, dim, fused, detail)], in the order the pass
        met them, graph after graph.
    """
    cfg = torch._inductor.config
    patch = {
        k: v
        for k, v in (("fx_graph_cache", False), ("force_disable_caches", True))
        if hasattr(cfg, k)
    }
    decisions: list = []
    torch._dynamo.reset()
    try:
        with enable_micro_pipeline_tp(), cfg.patch(patch), recording(decisions):
            torch.compile(fn)(*example_args, **example_kwargs)
    finally:
        torch._dynamo.reset()
    if verbose:
        prefix = ""
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            prefix = f"[rank {torch.distributed.get_rank()}] "
        fused = sum(d.fused for d in decisions)
        print(f"{prefix}mptp explain: {fused} of {len(decisions)} collectives fused")
        for d in decisions:
            print(f"{prefix}  {d}")
    return decisions
