"""PyTorch's tensor-parallel tests, ported to mptp's fused styles (gloo, 2 and 4 processes, float64).

From test/distributed/tensor/parallel/test_tp_examples.py (the sequence-parallel transformer
plan and its training loop), test_parallelize_api.py (plans on attention and MLP blocks) and
test_tp_style.py (input/output layouts, use_local_output): FusedColwiseParallel /
FusedRowwiseParallel replace ColwiseParallel / RowwiseParallel in the plan, and the model must
give the outputs, the gradients of every parameter and of the input, and after every optimizer
step the parameters of the DTensor-styled model, and of a single-process float64 model.
Then what a user gets wrong: inconsistent plans, a sequence not divisible by the world size,
a wrong input layout: a ValueError on every rank, never a wrong result or a hang.

Every multi-process run is bounded by the harness' timeout.
"""

import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

F64 = torch.float64
TOL = dict(rtol=1e-9, atol=1e-10)


def _rnd(shape, seed):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=F64)


def _close(got, ref, what):
    assert got is not None, f"{what}: no gradient"
    torch.testing.assert_close(got, ref, **TOL, msg=lambda m: f"{what}: {m}")


def _full(t):
    return t.full_tensor() if hasattr(t, "full_tensor") else t


# -- models (as PyTorch's common_dtensor ModelArgs Transformer, float64) -------------------------


class Attention(nn.Module):
    """Causal multi-head attention on [*B, S, D]; heads are split across ranks by the plan."""

    def __init__(self, dim, n_heads, bias):
        super().__init__()
        self.head_dim = dim // n_heads
        self.wq, self.wk, self.wv, self.wo = (
            nn.Linear(dim, dim, bias=bias, dtype=F64) for _ in range(4)
        )

    def forward(self, x):
        # -1 heads: the local head count under tensor parallelism
        q, k, v = (
            w(x).unflatten(-1, (-1, self.head_dim)).transpose(-3, -2)
            for w in (self.wq, self.wk, self.wv)
        )
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(o.transpose(-3, -2).flatten(-2))


class FeedForward(nn.Module):
    def __init__(self, dim, hidden, bias):
        super().__init__()
        self.gate = nn.Linear(dim, hidden, bias=bias, dtype=F64)
        self.up = nn.Linear(dim, hidden, bias=bias, dtype=F64)
        self.down = nn.Linear(hidden, dim, bias=bias, dtype=F64)

    def forward(self, x):
        return self.down(F.silu(self.gate(x)) * self.up(x))


class Block(nn.Module):
    def __init__(self, dim=16, n_heads=4, hidden=32, bias=False):
        super().__init__()
        self.attention_norm = nn.LayerNorm(dim, dtype=F64)
        self.attention = Attention(dim, n_heads, bias)
        self.ffn_norm = nn.LayerNorm(dim, dtype=F64)
        self.feed_forward = FeedForward(dim, hidden, bias)

    def forward(self, x):
        h = x + self.attention(self.attention_norm(x))
        return h + self.feed_forward(self.ffn_norm(h))


class Transformer(nn.Module):
    def __init__(self, vocab=24, dim=16, n_heads=4, n_layers=2, bias=False):
        super().__init__()
        self.tok_embeddings = nn.Embedding(vocab, dim, dtype=F64)
        self.layers = nn.ModuleList(Block(dim, n_heads, 2 * dim, bias) for _ in range(n_layers))
        self.norm = nn.LayerNorm(dim, dtype=F64)
        self.output = nn.Linear(dim, vocab, bias=False, dtype=F64)

    def forward(self, tokens):
        h = self.tok_embeddings(tokens)
        for layer in self.layers:
            h = layer(h)
        return self.output(self.norm(h))


def _perturb(model, seed):
    """Non-trivial norm affines and biases (identical on every rank)."""
    with torch.no_grad():
        for i, (name, p) in enumerate(model.named_parameters()):
            if "norm" in name or "bias" in name:
                p.add_(_rnd(p.shape, seed + i) * 0.1)


# -- plans ---------------------------------------------------------------------------------------


def _block_plan(kind, sd, prefix="", local_output=True):
    """PyTorch's sequence-parallel block plan (test_tp_examples), or the same with mptp's styles.

    DTensor: the block inputs are gathered by PrepareModuleInput, the linears are the default
    ColwiseParallel. Fused: the gather moves into the linears (input_layouts=Shard(sd)).
    """
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
    )

    from mptp_kernels.tp import FusedColwiseParallel, FusedRowwiseParallel

    p = prefix
    plan = {
        f"{p}attention_norm": SequenceParallel(sequence_dim=sd),
        f"{p}ffn_norm": SequenceParallel(sequence_dim=sd),
    }
    for mod, cols, row in (
        ("attention", ("wq", "wk", "wv"), "wo"),
        ("feed_forward", ("gate", "up"), "down"),
    ):
        if kind == "dtensor":
            plan[f"{p}{mod}"] = PrepareModuleInput(
                input_layouts=(Shard(sd),), desired_input_layouts=(Replicate(),)
            )
            plan.update({f"{p}{mod}.{c}": ColwiseParallel() for c in cols})
            plan[f"{p}{mod}.{row}"] = RowwiseParallel(
                output_layouts=Shard(sd), use_local_output=local_output
            )
        else:
            plan.update(
                {f"{p}{mod}.{c}": FusedColwiseParallel(input_layouts=Shard(sd)) for c in cols}
            )
            plan[f"{p}{mod}.{row}"] = FusedRowwiseParallel(
                output_layouts=Shard(sd), use_local_output=local_output
            )
    return plan


def _transformer_plan(kind, n_layers):
    """test_tp_examples' plan for the whole transformer (embedding row-wise, output col-wise)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel

    from mptp_kernels.tp import FusedColwiseParallel, FusedRowwiseParallel

    col, row = (
        (ColwiseParallel, RowwiseParallel)
        if kind == "dtensor"
        else (FusedColwiseParallel, FusedRowwiseParallel)
    )
    plan = {
        # nn.Embedding: the fused style is RowwiseParallel itself (nothing to fuse)
        "tok_embeddings": row(input_layouts=Replicate(), output_layouts=Shard(1)),
        "norm": SequenceParallel(),
        "output": col(input_layouts=Shard(1), output_layouts=Replicate()),
    }
    for i in range(n_layers):
        plan.update(_block_plan(kind, 1, prefix=f"layers.{i}."))
    return plan


def _from_local_in_inference_mode_ok(mesh) -> bool:
    """Whether this torch's DTensor.from_local takes a tensor that requires grad under inference_mode."""
    from torch.distributed.tensor import DTensor, Shard

    try:
        with torch.inference_mode():
            DTensor.from_local(torch.zeros(2, 2, dtype=F64, requires_grad=True), mesh, (Shard(0),))
        return True
    except NotImplementedError:
        return False


def _parallelize(full, plan):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import parallelize_module

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    return parallelize_module(copy.deepcopy(full), mesh, plan, src_data_rank=None), mesh


def _fused_modules(model):
    return sorted(n for n, m in model.named_modules() if hasattr(m, "_mptp_tp"))


# -- 1. a block: outputs and gradients vs DTensor and float64 ------------------------------------


def _block_case(seed, ndim, bias, noncontig, local_output, compiled):
    from torch.distributed.tensor import DTensor, Shard

    W, r = dist.get_world_size(), dist.get_rank()
    sd = ndim - 2  # [S, D] -> seq dim 0; [B, S, D] -> seq dim 1
    torch.manual_seed(seed)
    full = Block(bias=bias)
    _perturb(full, seed)
    x = _rnd((2, 4 * W, 16)[3 - ndim :], seed + 1)
    gy = _rnd(x.shape, seed + 2)

    xf = x.clone().requires_grad_()
    yf = full(xf)
    (yf * gy).sum().backward()

    res = {}
    for kind in ("dtensor", "fused"):
        m, mesh = _parallelize(full, _block_plan(kind, sd, local_output=local_output))
        assert len(_fused_modules(m)) == (7 if kind == "fused" else 0)
        if compiled:
            torch._dynamo.reset()
            m = torch.compile(m, backend="aot_eager", fullgraph=True)
        xl = x.chunk(W, sd)[r]
        if noncontig:  # the same values, seq-major storage (a transposed activation)
            xl = xl.movedim(sd, -1).contiguous().movedim(-1, sd)
            assert not xl.is_contiguous()
        xl = xl.detach().requires_grad_()
        inp = lambda xl=xl: xl if local_output else DTensor.from_local(xl, mesh, (Shard(sd),))  # noqa: E731
        for ctx in (torch.no_grad, torch.inference_mode):  # inference: the same values, no graph
            # NOTE: before torch 2.13 (seen on 2.12.1) DTensor.from_local of a tensor that
            # requires grad raises under inference_mode (aten.detach_ has no sharding strategy),
            # in PyTorch's own PrepareModuleInput too: there the input is detached first.
            src = xl if ctx is torch.no_grad or _from_local_in_inference_mode_ok(mesh) else xl.detach()
            with ctx():
                y = m(inp(src))
            assert not y.requires_grad
            res[(kind, ctx.__name__)] = y if local_output else y.to_local()
        y = m(inp())
        assert isinstance(y, DTensor) != local_output
        if not local_output:
            assert y.placements == (Shard(sd),)
            y = y.to_local()
        (y * gy.chunk(W, sd)[r]).sum().backward()
        grads = {n.removeprefix("_orig_mod."): _full(p.grad) for n, p in m.named_parameters()}
        # The gradients' own layout (what clip_grad_value_, optimizer state and checkpoints see)
        places = {n.removeprefix("_orig_mod."): (p.grad.placements, p.grad.to_local())
                  for n, p in m.named_parameters() if isinstance(p.grad, DTensor)}  # fmt: skip
        res[kind] = (y, xl.grad, grads, places)
    (y0, gx0, g0, p0), (y1, gx1, g1, p1) = res["dtensor"], res["fused"]
    # NOTE: found by a hostile review: the row-wise bias's gradient was Partial(sum) (Shard(0)
    # for an output sharded on its last dim) where DTensor's is Replicate(): full_tensor() was
    # right, each rank's local gradient a partial sum.
    assert sorted(p1) == sorted(p0)
    for n in p1:
        assert p1[n][0] == p0[n][0], f"grad of {n}: placements {p1[n][0]}, DTensor's {p0[n][0]}"
        _close(p1[n][1], p0[n][1], f"local grad of {n} vs DTensor")
    _close(y1, y0, "output vs DTensor")
    _close(y1, yf.detach().chunk(W, sd)[r], "output vs float64")
    for ctx in ("no_grad", "inference_mode"):
        _close(res[("fused", ctx)], y0.detach(), f"output under {ctx}")
    _close(gx1, gx0, "d input vs DTensor")
    _close(gx1, xf.grad.chunk(W, sd)[r], "d input vs float64")
    ref = dict(full.named_parameters())
    assert sorted(g1) == sorted(ref)
    for n in g1:
        _close(g1[n], g0[n], f"grad of {n} vs DTensor")
        _close(g1[n], ref[n].grad, f"grad of {n} vs float64")


_BLOCK_CASES = {
    "3d_bias": (3, True, False, True, False),
    "3d_noncontig": (3, False, True, True, False),
    "2d_bias_noncontig": (2, True, True, True, False),
    "3d_dtensor_output": (3, True, False, False, False),
    "2d_dtensor_output": (2, False, False, False, False),
    "3d_bias_compiled_fullgraph": (3, True, True, True, True),
}


@pytest.mark.parametrize("case", list(_BLOCK_CASES))
def test_block_vs_dtensor_and_float64(workers2, case):
    workers2.run(_block_case, 0, *_BLOCK_CASES[case])


# -- 2. training: the transformer of test_tp_examples, SGD / AdamW -------------------------------


def _train(seed, opt_name, steps, bias):
    W = dist.get_world_size()
    n_layers = 2
    torch.manual_seed(seed)
    full = Transformer(n_layers=n_layers, bias=bias)
    _perturb(full, seed)
    models = {"full": full}
    for kind in ("dtensor", "fused"):
        models[kind], _ = _parallelize(full, _transformer_plan(kind, n_layers))
    assert (
        len(_fused_modules(models["fused"])) == 1 + 7 * n_layers
    )  # the output and the blocks' linears
    make = {
        "sgd": lambda ps: torch.optim.SGD(ps, lr=0.25, momentum=0.9),
        "adamw": lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1, foreach=False),
    }[opt_name]
    opts = {k: make(m.parameters()) for k, m in models.items()}
    losses = {k: [] for k in models}
    for step in range(steps):
        g = torch.Generator().manual_seed(seed + 100 + step)
        tokens = torch.randint(0, 24, (2, 4 * W), generator=g)  # replicated on every rank
        target = torch.randint(0, 24, (2, 4 * W), generator=g)
        for k, m in models.items():
            logits = m(tokens)
            assert not hasattr(logits, "placements") and logits.shape == (2, 4 * W, 24)
            loss = F.cross_entropy(logits.flatten(0, 1), target.flatten())
            opts[k].zero_grad()
            loss.backward()
            opts[k].step()
            losses[k].append(loss.item())
        ref = dict(full.named_parameters())
        dt = dict(models["dtensor"].named_parameters())
        for n, p in models["fused"].named_parameters():
            _close(_full(p.grad), _full(dt[n].grad), f"step {step}: grad of {n} vs DTensor")
            _close(_full(p.grad), ref[n].grad, f"step {step}: grad of {n} vs float64")
            _close(_full(p.detach()), _full(dt[n].detach()), f"step {step}: {n} vs DTensor")
            _close(_full(p.detach()), ref[n].detach(), f"step {step}: {n} vs float64")
    torch.testing.assert_close(losses["fused"], losses["dtensor"], **TOL)
    torch.testing.assert_close(losses["fused"], losses["full"], **TOL)
    return losses["fused"]


@pytest.mark.parametrize("opt_name,bias", [("sgd", True), ("adamw", False)])
def test_transformer_training_vs_dtensor_and_float64(workers2, opt_name, bias):
    losses = workers2.run(_train, 0, opt_name, 3, bias)
    assert losses[0] == losses[1]


@pytest.fixture(scope="module")
def workers4():
    from dist.harness import Workers

    w = Workers(4, timeout_s=240)
    yield w
    w.close()


def test_transformer_training_4_ranks(workers4):
    workers4.run(_train, 1, "adamw", 2, True)


# -- 3. what users get wrong: a ValueError on every rank -----------------------------------------


def _raises(exc, match, fn):
    with pytest.raises(exc, match=match):
        fn()


def _user_errors():
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
    from torch.distributed.tensor.parallel import parallelize_module

    from mptp_kernels.tp import FusedColwiseParallel, FusedRowwiseParallel

    W, r = dist.get_world_size(), dist.get_rank()
    mesh = init_device_mesh("cpu", (W,))
    torch.manual_seed(0)

    def par(module, plan):
        return parallelize_module(module, mesh, plan, src_data_rank=None)

    col = par(nn.Linear(16, 32, dtype=F64), FusedColwiseParallel(input_layouts=Shard(1)))
    row = par(nn.Linear(32, 16, dtype=F64), FusedRowwiseParallel(output_layouts=Shard(1)))

    # A sequence not divisible by the world size, as a DTensor (DTensor shards it unevenly):
    # the fused all-gather of unequal shards aborted gloo on one rank and hung the others.
    for placement in (Shard(1), Replicate()):
        x7 = distribute_tensor(_rnd((2, 7, 16), 1), mesh, [placement])
        _raises(
            ValueError, "dim 1 has size 7, not a multiple of the mesh size", lambda x7=x7: col(x7)
        )
    # ... as the row-wise layer's output (reduce-scattered along the sequence)
    _raises(
        ValueError,
        "scatter_dim: the output dim 1 has size 7",
        lambda: row(_rnd((2, 7, 32 // W), 2)),
    )

    # Wrong input layout: a replicated (full-width) activation given to the row-wise layer
    # whose input_layouts says Shard(-1).
    _raises(
        ValueError, r"B: expected \d+ rows to match A's K dim", lambda: row(_rnd((2, 4, 32), 3))
    )
    # A 1-D input (no sequence dim to gather)
    col0 = par(nn.Linear(16, 32, dtype=F64), FusedColwiseParallel(input_layouts=Shard(0)))
    _raises(ValueError, "A: expected a tensor with at least 2 dims", lambda: col0(_rnd((8,), 4)))
    # Activations in another dtype than the weights
    _raises(ValueError, "expected dtype torch.float32", lambda: col(_rnd((2, 4, 16), 5).float()))

    # Inconsistent plans: column-wise twice in a row; a row-wise layer declared Replicate()
    # after a column-wise one (which hands it its Shard(-1) shard).
    seq = par(nn.Sequential(nn.Linear(16, 32, dtype=F64), nn.Linear(32, 16, dtype=F64)),
              {"0": FusedColwiseParallel(input_layouts=Shard(1)), "1": FusedColwiseParallel(input_layouts=Shard(1))})  # fmt: skip
    _raises(
        ValueError,
        r"Bs\[0\]: expected 16 rows to match A.s K dim, got shape \(32, ",
        lambda: seq(_rnd((2, 4, 16), 6)),
    )
    seq = par(nn.Sequential(nn.Linear(16, 32, dtype=F64), nn.Linear(32, 16, dtype=F64)),
              {"0": FusedColwiseParallel(input_layouts=Shard(1)),
               "1": FusedRowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1))})  # fmt: skip
    _raises(ValueError, "B: expected .* rows", lambda: seq(_rnd((2, 4, 16), 7)))
    # A 2-D mesh (the TP dim not sliced)
    mesh2 = init_device_mesh("cpu", (1, W), mesh_dim_names=("dp", "tp"))
    for style in (
        FusedColwiseParallel(input_layouts=Shard(1)),
        FusedRowwiseParallel(output_layouts=Shard(1)),
    ):
        _raises(ValueError, "expected a 1-D DeviceMesh",
                lambda style=style: parallelize_module(nn.Linear(16, 16, dtype=F64), mesh2, style))  # fmt: skip
    # ... which works once sliced
    sliced = parallelize_module(
        nn.Linear(16, 32, dtype=F64), mesh2["tp"], FusedColwiseParallel(input_layouts=Shard(1))
    )
    assert sliced(_rnd((2, 4, 16), 8)).shape == (2, 4 * W, 32 // W)
    # A DTensor input on another mesh than the module's (found by a hostile review: its local
    # shard was gathered over the module's group, wrong values on every rank; DTensor raises).
    sliced_row = parallelize_module(
        nn.Linear(32, 16, dtype=F64), mesh2["tp"], FusedRowwiseParallel(output_layouts=Shard(1))
    )
    for m, x in ((sliced, _rnd((2, 4, 16), 9)), (sliced_row, _rnd((2, 4, 32 // W), 10))):
        other = DTensor.from_local(x, mesh2["dp"], (Shard(1),), run_check=False)
        _raises(ValueError, "the input is a DTensor on .*the module's mesh is", lambda m=m, o=other: m(o))
    # Layout dims out of range for the tensor: a ValueError, never wrapped round to another dim
    # (found by a hostile review: Shard(3) of a 3-D output became Shard(0)).
    for out_l in (Shard(3), Shard(-4)):
        bad = par(nn.Linear(16, 32, dtype=F64), FusedColwiseParallel(input_layouts=Shard(1), output_layouts=out_l))
        _raises(ValueError, rf"output_layouts: Shard\({out_l.dim}\) is out of range for a 3-D",
                lambda bad=bad: bad(_rnd((2, 4, 16), 11)))  # fmt: skip
    bad = par(nn.Linear(32, 16, dtype=F64), FusedRowwiseParallel(input_layouts=Shard(5), output_layouts=Shard(1)))
    _raises(ValueError, r"input_layouts: Shard\(5\) is out of range for a 3-D",
            lambda: bad(_rnd((2, 4, 32 // W), 12)))  # fmt: skip
    # A module parallelized twice: DTensor's styles refuse at once; the fused ones failed at the
    # first forward with an AttributeError.
    for style in (FusedColwiseParallel(input_layouts=Shard(1)), FusedRowwiseParallel(output_layouts=Shard(1))):
        once = par(nn.Linear(32, 32, dtype=F64), style)
        _raises(RuntimeError, "already (parallelized|been called)", lambda once=once, style=style: par(once, style))

    # Nothing is left in flight: the group still agrees on a collective.
    t = torch.ones(1, dtype=F64) * (r + 1)
    dist.all_reduce(t)
    assert t.item() == W * (W + 1) / 2


def test_user_errors_raise_on_every_rank(workers2):
    workers2.run(_user_errors)


def _plain_init():
    """Built directly, with the same seed on every rank (as replicated layers need), the plain
    modules hold this rank's slice of the nn.Linear that seed gives, and leave the RNG where that
    nn.Linear leaves it. Found by a hostile review: each rank drew only its own shard, so every
    rank held the same block, and training never told them apart."""
    from mptp_kernels import ColumnParallelLinear, RowParallelLinear

    W, r = dist.get_world_size(), dist.get_rank()
    for bias in (True, False):
        torch.manual_seed(5)
        ref, after = nn.Linear(8, 4 * W, bias=bias, dtype=F64), torch.rand(3)
        torch.manual_seed(5)
        col = ColumnParallelLinear(8, 4 * W, bias=bias, dtype=F64)
        assert torch.equal(torch.rand(3), after)
        assert torch.equal(col.weight, ref.weight[4 * r : 4 * (r + 1)])
        if bias:
            assert torch.equal(col.bias, ref.bias[4 * r : 4 * (r + 1)])
    torch.manual_seed(6)
    ref, after = nn.Linear(4 * W, 8, bias=False, dtype=F64), torch.rand(3)
    torch.manual_seed(6)
    row = RowParallelLinear(4 * W, 8, dtype=F64)
    assert torch.equal(torch.rand(3), after)
    assert torch.equal(row.weight, ref.weight[:, 4 * r : 4 * (r + 1)])
    shards = [torch.empty_like(row.weight) for _ in range(W)]
    dist.all_gather(shards, row.weight.detach().contiguous())
    assert not torch.equal(shards[0], shards[1])
    meta = ColumnParallelLinear(8, 4 * W, bias=True, device="meta")  # no memory, no error
    assert meta.weight.is_meta and meta.weight.shape == (4, 8)


def test_plain_modules_built_alike_on_every_rank_hold_distinct_shards(workers2):
    workers2.run(_plain_init)


def _uneven_plain_shards():
    """A plain [B, S/W, D] shard whose size differs across ranks (S = 7 on 2 ranks)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import parallelize_module

    from mptp_kernels.tp import FusedColwiseParallel

    W, r = dist.get_world_size(), dist.get_rank()
    mesh = init_device_mesh("cpu", (W,))
    col = parallelize_module(nn.Linear(16, 32, dtype=F64), mesh, FusedColwiseParallel(input_layouts=Shard(1)),
                             src_data_rank=None)  # fmt: skip
    x = _rnd((2, 7, 16), 1).tensor_split(W, 1)[r]
    _raises(ValueError, "the ranks disagree on the call", lambda: col(x))


def _own_workers(env, fn, timeout_s):
    from dist.harness import Workers

    w = Workers(2, env=env, timeout_s=timeout_s)
    try:
        w.run(fn)
    finally:
        for p in w._procs:  # a rank stuck in a collective cannot read close()'s sentinel
            if p.is_alive():
                p.kill()
        w.close()


def test_uneven_plain_shards_check_agreement():
    """With MPTP_CHECK_AGREEMENT=1 every rank raises the same error."""
    _own_workers({"MPTP_CHECK_AGREEMENT": "1"}, _uneven_plain_shards, 120)


# -- found by a hostile review: what a user of DTensor's styles does next -------------------------


class _ScaledLinear(nn.Linear):
    def forward(self, x):
        return super().forward(x) * 2.0


def _drop_in_cases():
    """Non-reentrant checkpointing, an uneven out_features, an nn.Linear subclass with its own
    forward, autocast and frozen weights: the fused styles and plain modules give what DTensor's
    styles (and nn.Linear) give."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module
    from torch.utils.checkpoint import checkpoint

    from mptp_kernels import ColumnParallelLinear, FusedColwiseParallel, FusedRowwiseParallel, RowParallelLinear

    W, r = dist.get_world_size(), dist.get_rank()
    mesh = init_device_mesh("cpu", (W,))
    X = _rnd((2, 4, 8), 1)
    x = X.chunk(W, 1)[r]

    # 1. checkpoint(use_reentrant=False) around the plain modules: the same gradients.
    up, down = nn.Linear(8, 12, bias=False, dtype=F64), nn.Linear(12, 8, bias=False, dtype=F64)
    col = ColumnParallelLinear.from_linear(up, gather_dim=1)
    row = RowParallelLinear.from_linear(down, scatter_dim=1)
    grads = []
    for ckpt in (False, True):
        xi = x.clone().requires_grad_()
        f = lambda t: row(col(t))  # noqa: E731
        y = checkpoint(f, xi, use_reentrant=False) if ckpt else f(xi)
        y.pow(2).sum().backward()
        grads.append([xi.grad, col.weight.grad.clone(), row.weight.grad.clone()])
        col.weight.grad = row.weight.grad = None
    for a, b, what in zip(grads[0], grads[1], ("dx", "d col.weight", "d row.weight")):
        _close(b, a, f"non-reentrant checkpoint: {what}")

    # 2. An out_features that does not divide by W: the output DTensor has the layer's shape.
    for layout, local in ((Replicate(), True), (Shard(-1), False)):
        outs = []
        for Style in (ColwiseParallel, FusedColwiseParallel):
            torch.manual_seed(0)
            m = nn.Linear(8, 13, dtype=F64)
            parallelize_module(m, mesh, Style(input_layouts=Shard(1), output_layouts=layout, use_local_output=local))
            outs.append(_full(m(x)))
        assert outs[1].shape == (2, 4, 13), outs[1].shape
        _close(outs[1], outs[0], f"uneven out_features, output {layout}")

    # 3. An nn.Linear subclass keeps its own forward, and so does an nn.Linear whose forward a
    # library set on the instance (3b).
    def instance_forward():
        m = nn.Linear(8, 6, dtype=F64)
        m.forward = (lambda mod: lambda t: nn.Linear.forward(mod, t) * 3.0)(m)
        return m

    for make, what in ((lambda: _ScaledLinear(8, 6, dtype=F64), "nn.Linear subclass"),
                       (instance_forward, "an instance-level forward")):  # fmt: skip
        outs = []
        for Style in (ColwiseParallel, FusedColwiseParallel):
            torch.manual_seed(0)
            m = make()
            parallelize_module(m, mesh, Style(input_layouts=Shard(1)))
            outs.append(m(x))
        _close(outs[1], outs[0], what)

    # 3c. A DTensor output (even out_features, batch 2, sequence gathered) reshapes like DTensor's.
    outs = []
    for Style in (ColwiseParallel, FusedColwiseParallel):
        torch.manual_seed(0)
        m = nn.Linear(8, 12, dtype=F64)
        parallelize_module(m, mesh, Style(input_layouts=Shard(1), use_local_output=False))
        y = m(x)
        outs.append((_full(y.reshape(-1, 12)), _full(y.flatten(0, 1)), _full(y.contiguous())))
    for a, b, what in zip(outs[0], outs[1], ("reshape", "flatten", "contiguous")):
        _close(b, a, f"DTensor output {what}")

    # 4. Autocast: the styles return what DTensor's (F.linear under autocast) return.
    xf = X.float().chunk(W, 1)[r]
    for pdt in (torch.float32, torch.bfloat16):
        got = {}
        for name, col_style, row_style in (("dtensor", ColwiseParallel, None), ("fused", FusedColwiseParallel, FusedRowwiseParallel)):
            torch.manual_seed(0)
            m = nn.Sequential(nn.Linear(8, 12), nn.ReLU(), nn.Linear(12, 8)).to(pdt)
            plan = {"0": col_style(input_layouts=Shard(1))}
            if row_style is not None:
                plan["2"] = row_style(output_layouts=Shard(1))
            else:
                from torch.distributed.tensor.parallel import RowwiseParallel

                plan["2"] = RowwiseParallel(output_layouts=Shard(1))
            parallelize_module(m, mesh, plan)
            with torch.autocast("cpu", dtype=torch.bfloat16):
                got[name] = m(xf)
        assert got["fused"].dtype == got["dtensor"].dtype == torch.bfloat16, (got["fused"].dtype, got["dtensor"].dtype)
        torch.testing.assert_close(got["fused"].float(), got["dtensor"].float(), rtol=2e-2, atol=2e-2)

    # 4b. The plain modules under autocast take and return what nn.Linear would.
    lin = nn.Linear(8, 12, bias=True)
    c = ColumnParallelLinear.from_linear(lin, gather_dim=1)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        for inp in (xf, xf.bfloat16()):
            out = c(inp)
            assert out.dtype == torch.bfloat16 == lin(inp).dtype, out.dtype
            ref = lin(X.float())[..., r * 6 : (r + 1) * 6]
            torch.testing.assert_close(out.float(), ref.float(), rtol=2e-2, atol=2e-2)

    # 5. Frozen weights stay frozen; a bad group is a ValueError naming it.
    frozen = nn.Linear(8, 12, bias=True, dtype=F64).requires_grad_(False)
    assert not ColumnParallelLinear.from_linear(frozen).weight.requires_grad
    assert not ColumnParallelLinear.from_linear(frozen).bias.requires_grad
    assert not RowParallelLinear.from_linear(nn.Linear(12, 8, bias=False).requires_grad_(False)).weight.requires_grad
    for bad in (3, "no-such-group"):
        try:
            ColumnParallelLinear(8, 12, group=bad)
        except ValueError as e:
            assert "group" in str(e), e
        else:
            raise AssertionError(f"group={bad!r} accepted")


def test_styles_and_modules_are_drop_ins(workers2):
    workers2.run(_drop_in_cases)


def _save_load_whole_module():
    """torch.save of a whole module styled by the fused styles, then torch.load: the loaded
    module is fused like the saved one and computes the same output and gradients. (Its
    forward was a bound method of a function nn.Linear lacks: it pickled and did not unpickle,
    so the file written could not be read back.)"""
    import io

    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import parallelize_module

    from mptp_kernels.tp import FusedColwiseParallel, FusedRowwiseParallel

    W, r = dist.get_world_size(), dist.get_rank()
    mesh = init_device_mesh("cpu", (W,))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 12, dtype=F64), nn.Linear(12, 8, dtype=F64))
    parallelize_module(model, mesh, {"0": FusedColwiseParallel(input_layouts=Shard(1)),
                                     "1": FusedRowwiseParallel(output_layouts=Shard(1))})  # fmt: skip
    buf = io.BytesIO()
    torch.save(model, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=False)
    x = _rnd((2, 4 * W, 8), 5).chunk(W, dim=1)[r]
    outs, grads = [], []
    for m in (model, loaded):
        assert m[0]._mptp_tp is not None and m[1]._mptp_tp is not None  # still the fused styles
        xi = x.clone().requires_grad_()
        y = m(xi)
        (y * y).sum().backward()
        outs.append(y)
        grads.append((xi.grad, m[0].weight.grad.to_local(), m[1].weight.grad.to_local()))
    torch.testing.assert_close(outs[1], outs[0], rtol=0, atol=0)
    for g1, g0 in zip(grads[1], grads[0]):
        torch.testing.assert_close(g1, g0, rtol=0, atol=0)


def test_a_whole_module_with_fused_styles_saves_and_loads(workers2):
    workers2.run(_save_load_whole_module)
