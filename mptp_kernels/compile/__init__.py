"""torch.compile integration: enable_micro_pipeline_tp() installs the mptp FX pass.

    mptp_kernels.enable_micro_pipeline_tp()          # for the rest of the process
    with mptp_kernels.enable_micro_pipeline_tp():     # or for a block
        compiled = torch.compile(model)
    mptp_kernels.disable_micro_pipeline_tp()

The pass is installed as torch._inductor.config.post_grad_custom_post_pass,
chaining any pass already installed there. Its uuid hashes the pass's source,
so the FX graph cache never serves a graph compiled without it (or with an
older version of it). PyTorch's own async-TP pass (config._micro_pipeline_tp)
is switched off while ours is on, so the two never rewrite the same graph;
symm_mem.fused_* nodes that still reach us are retargeted to mptp.
"""

import hashlib
import inspect
from typing import Optional

import torch
from torch._inductor.custom_graph_pass import CustomGraphPass

from . import micro_pipeline
from .micro_pipeline import micro_pipeline_pass

__all__ = ["MicroPipelineTPPass", "disable_micro_pipeline_tp", "enable_micro_pipeline_tp", "micro_pipeline_pass"]

_SOURCE_HASH = hashlib.sha256(inspect.getsource(micro_pipeline).encode()).hexdigest()


class MicroPipelineTPPass(CustomGraphPass):
    """The mptp post-grad pass, chaining a previously installed pass (run first)."""

    def __init__(self, chained: Optional[CustomGraphPass] = None):
        self.chained = chained

    def __call__(self, graph: torch.fx.Graph) -> None:
        if self.chained is not None:
            self.chained(graph)
        micro_pipeline_pass(graph)

    def uuid(self):
        chained = self.chained.uuid() if self.chained is not None and hasattr(self.chained, "uuid") else None
        return hashlib.sha256(f"mptp-micro-pipeline:{_SOURCE_HASH}:{chained}".encode()).hexdigest()


_saved = []


class _Enabled:
    """Returned by enable_micro_pipeline_tp(); usable as a context manager."""

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        disable_micro_pipeline_tp()
        return False


def enable_micro_pipeline_tp() -> _Enabled:
    """Installs the mptp pass into Inductor's post-grad custom pass slot."""
    cfg = torch._inductor.config
    prev = cfg.post_grad_custom_post_pass
    _saved.append((prev, getattr(cfg, "_micro_pipeline_tp", False)))
    chained = prev.chained if isinstance(prev, MicroPipelineTPPass) else prev
    cfg.post_grad_custom_post_pass = MicroPipelineTPPass(chained)
    if hasattr(cfg, "_micro_pipeline_tp"):
        cfg._micro_pipeline_tp = False
    return _Enabled()


def disable_micro_pipeline_tp() -> None:
    """Restores what enable_micro_pipeline_tp() replaced (innermost first)."""
    cfg = torch._inductor.config
    if not _saved:
        if isinstance(cfg.post_grad_custom_post_pass, MicroPipelineTPPass):
            cfg.post_grad_custom_post_pass = cfg.post_grad_custom_post_pass.chained
        return
    prev, torch_flag = _saved.pop()
    cfg.post_grad_custom_post_pass = prev
    if hasattr(cfg, "_micro_pipeline_tp"):
        cfg._micro_pipeline_tp = torch_flag
