"""enable/disable, chaining other post-grad passes, the FX-graph-cache uuid, explain()."""

import pytest
import torch
from torch._dynamo.utils import counters
from torch._inductor import custom_graph_pass
from torch._inductor.custom_graph_pass import CustomGraphPass

import mptp_kernels
from mptp_kernels import compile as mc
from mptp_kernels.compile import MicroPipelineTPPass

cfg = torch._inductor.config
fcfg = torch._functorch.config
c10d = torch.ops._c10d_functional
InferenceAware = getattr(custom_graph_pass, "CustomInferenceAwareGraphPass", None)


@pytest.fixture(autouse=True)
def clean_slot():
    assert mc._state["depth"] == 0, "a previous test left the pass enabled"
    old = cfg.post_grad_custom_post_pass, getattr(cfg, "_micro_pipeline_tp", None)
    old_bw = fcfg.force_non_lazy_backward_lowering
    cfg.post_grad_custom_post_pass = None
    yield
    cfg.post_grad_custom_post_pass = old[0]
    if old[1] is not None:
        cfg._micro_pipeline_tp = old[1]
    fcfg.force_non_lazy_backward_lowering = old_bw
    mc._state.update(depth=0, torch_flag=None)


class Tagged(CustomGraphPass):
    def __init__(self, tag, seen=None):
        self.tag, self.seen = tag, seen if seen is not None else []

    def __call__(self, graph):
        self.seen.append(self.tag)

    def uuid(self):
        return self.tag


def _empty_graph():
    g = torch.fx.Graph()
    g.output(None)
    return g


def _compile_run(fn, *args, cache=False):
    """Compiles and runs fn; without `cache`, no cache can skip the passes."""
    torch._dynamo.reset()
    with cfg.patch(force_disable_caches=not cache):
        return torch.compile(fn)(*args)


def _f(x):
    return torch.relu(x) * 2 + 1


def test_chains_the_installed_pass_and_restores_it():
    seen = []
    other = Tagged("other", seen)
    cfg.post_grad_custom_post_pass = other
    if hasattr(cfg, "_micro_pipeline_tp"):
        cfg._micro_pipeline_tp = True
    with mptp_kernels.enable_micro_pipeline_tp():
        p = cfg.post_grad_custom_post_pass
        assert isinstance(p, MicroPipelineTPPass) and p.chained is other
        p(_empty_graph())
        assert seen == ["other"]
        assert getattr(cfg, "_micro_pipeline_tp", False) is False
        assert p.uuid() is not None and "other" in p.uuid()[-1]
    assert cfg.post_grad_custom_post_pass is other
    if hasattr(cfg, "_micro_pipeline_tp"):
        assert cfg._micro_pipeline_tp is True


class NoUuid(CustomGraphPass):
    def __call__(self, graph):
        pass

    def uuid(self):
        return None


@pytest.mark.parametrize(
    "chained,cacheable",
    [(None, True), (Tagged("a"), True), ([Tagged("a"), Tagged("b")], True), (lambda g: None, False),
     (NoUuid(), False), ([Tagged("a"), lambda g: None], False), ((Tagged("a"), NoUuid()), False)],
    ids=["none", "uuid", "list", "plain_fn", "uuid_none", "list_with_fn", "tuple_with_uuid_none"],
)  # fmt: skip
def test_uuid_covers_every_chained_pass(chained, cacheable):
    u = MicroPipelineTPPass(chained).uuid()
    assert (u is not None) == cacheable
    if cacheable:
        assert u == MicroPipelineTPPass(chained).uuid(), "not stable"
        assert u != MicroPipelineTPPass([Tagged("other")]).uuid()


def test_uuid_changes_with_the_enabled_groups():
    before = MicroPipelineTPPass().uuid()
    mptp_kernels.enable_symm_mem_for_group("mptp-test-uuid-group")
    assert MicroPipelineTPPass().uuid() != before


def test_list_valued_user_pass_runs_under_compile():
    seen = []
    cfg.post_grad_custom_post_pass = [lambda g: seen.append("fn"), Tagged("tagged", seen)]
    with mptp_kernels.enable_micro_pipeline_tp():
        x = torch.randn(8)
        torch.testing.assert_close(_compile_run(_f, x), _f(x))
    assert seen == ["fn", "tagged"]
    assert (
        isinstance(cfg.post_grad_custom_post_pass, list)
        and len(cfg.post_grad_custom_post_pass) == 2
    )


@pytest.mark.skipif(
    InferenceAware is None, reason="this torch has no CustomInferenceAwareGraphPass"
)
def test_inference_aware_user_pass_gets_is_inference():
    seen = []

    class IA(InferenceAware):
        def __call__(self, graph, is_inference):
            seen.append(is_inference)

        def uuid(self):
            return "ia"

    cfg.post_grad_custom_post_pass = IA()
    with mptp_kernels.enable_micro_pipeline_tp(), torch.no_grad():
        _compile_run(_f, torch.randn(8))
    assert seen == [True]


@pytest.mark.parametrize("how", ["replace", "wrap_in_list"])
def test_disable_keeps_a_pass_installed_after_enable(how):
    mine = Tagged("mine")
    mptp_kernels.enable_micro_pipeline_tp()
    if how == "replace":
        cfg.post_grad_custom_post_pass = mine
    else:
        cfg.post_grad_custom_post_pass = [cfg.post_grad_custom_post_pass, mine]
    mptp_kernels.disable_micro_pipeline_tp()
    assert cfg.post_grad_custom_post_pass == (mine if how == "replace" else [mine])


def test_enable_twice_does_not_chain_itself_and_nests():
    with mptp_kernels.enable_micro_pipeline_tp():
        with mptp_kernels.enable_micro_pipeline_tp():
            p = cfg.post_grad_custom_post_pass
            assert isinstance(p, MicroPipelineTPPass) and p.chained is None
        assert isinstance(cfg.post_grad_custom_post_pass, MicroPipelineTPPass), (
            "inner exit disabled the outer block"
        )
    assert cfg.post_grad_custom_post_pass is None


def _cache_counters():
    c = counters["inductor"]
    return c["fxgraph_cache_hit"], c["fxgraph_cache_miss"], c["fxgraph_cache_bypass"]


def test_fx_graph_cache_key_changes_with_the_pass(pg1, monkeypatch, tmp_path):
    """A graph compiled without the pass is never served to a compile with it (and back)."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))

    def compile_once(fn):
        counters.clear()
        _compile_run(fn, torch.randn(8, 8), cache=True)
        return _cache_counters()[:2]

    def f(x):
        return torch.relu(x @ x) + 1

    with cfg.patch(fx_graph_cache=True, fx_graph_remote_cache=False):
        assert compile_once(f) == (0, 1)  # cold
        assert compile_once(f) == (1, 0)  # warm, no pass
        with mptp_kernels.enable_micro_pipeline_tp():
            assert compile_once(f) == (0, 1), "a graph compiled without the pass was reused"
            assert compile_once(f) == (1, 0)
        assert compile_once(f) == (1, 0)  # the pass-less entry is still there


def test_plain_function_user_pass_bypasses_the_cache(pg1, monkeypatch, tmp_path):
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    cfg.post_grad_custom_post_pass = lambda g: None
    with mptp_kernels.enable_micro_pipeline_tp(), cfg.patch(fx_graph_cache=True):
        counters.clear()
        _compile_run(_f, torch.randn(8), cache=True)
        hit, miss, bypass = _cache_counters()
    assert bypass >= 1 and hit == 0


def test_explain_reports_each_collective(fake4):
    W = 4

    def fn(x, w1, w2):
        A = c10d.wait_tensor(c10d.all_gather_into_tensor(x, W, fake4))
        h = A @ w1  # fused
        C = h @ w2
        out = c10d.wait_tensor(c10d.reduce_scatter_tensor(C, "sum", W, fake4))
        return out, C.sum()  # the matmul result has another user: not fused

    decisions = mptp_kernels.explain(
        fn, torch.randn(4, 16), torch.randn(16, 16), torch.randn(16, 8)
    )
    assert [(d.kind, d.fused) for d in decisions] == [
        ("all-gather", True),
        ("reduce-scatter", False),
    ]
    assert "fused_all_gather_matmul" in decisions[0].detail
    assert "other users" in decisions[1].detail
    assert cfg.post_grad_custom_post_pass is None, "explain left the pass installed"


# -- from a hostile review ------------------------------------------------------------------------


@pytest.mark.skipif(
    not hasattr(custom_graph_pass, "get_custom_graph_passes"),
    reason="this torch (before 2.13) takes one pass in the slot, not a list",
)
def test_nested_enable_keeps_the_order_of_passes_after_ours(fake4):
    """explain() (a nested enable) re-wrapped [ours, after] as ours(chained=[after]): `after`
    then ran before the rewrite and saw no mptp op."""
    seen = []

    def after(graph):
        seen.append(sum("mptp" in str(n.target) for n in graph.nodes))

    def fn(x, w):
        return c10d.wait_tensor(c10d.all_gather_into_tensor(x, 4, fake4)) @ w

    with mptp_kernels.enable_micro_pipeline_tp():
        slot = [cfg.post_grad_custom_post_pass, after]
        cfg.post_grad_custom_post_pass = slot
        mptp_kernels.explain(fn, torch.randn(4, 16), torch.randn(16, 8), verbose=False)
        assert cfg.post_grad_custom_post_pass is slot
    assert seen and all(n == 1 for n in seen), seen
    assert cfg.post_grad_custom_post_pass == [after]


def test_a_pass_the_user_built_survives_enable_disable_and_explain(fake4):
    mine = MicroPipelineTPPass(Tagged("user"))
    cfg.post_grad_custom_post_pass = mine
    with mptp_kernels.enable_micro_pipeline_tp():
        assert cfg.post_grad_custom_post_pass is mine, "the pass already runs: the slot is left as it is"
    mptp_kernels.explain(_f, torch.randn(8), verbose=False)
    assert cfg.post_grad_custom_post_pass is mine


def test_cache_uuid_covers_every_source_of_the_package(tmp_path):
    """The fake impls the pass proves rewrites with reach ops/transport.py (not hashed before)."""
    import os
    import shutil

    pkg = os.path.dirname(os.path.abspath(mptp_kernels.__file__))
    copy = tmp_path / "mptp_kernels"
    shutil.copytree(pkg, copy, ignore=shutil.ignore_patterns("*.so", "__pycache__"))
    assert mc._source_hash(str(copy)) == mc._SOURCE_HASH
    for rel in ("ops/transport.py", "kernels/poison.py", "symm/primitives.py"):
        with open(copy / rel, "a") as f:
            f.write("\n# edited\n")
        assert mc._source_hash(str(copy)) != mc._SOURCE_HASH, rel
        shutil.copy(os.path.join(pkg, rel), copy / rel)


def test_cat_of_an_input_or_a_constant_before_a_reduce_scatter_compiles(pg1):
    """The matcher read pieces[0].args[0] of a cat: an input (no args) or torch.zeros crashed compile."""
    g = pg1

    def f_input(x, y):
        return c10d.wait_tensor(c10d.reduce_scatter_tensor(torch.cat([x, y]), "sum", 1, g))

    def f_zeros(x, y):
        return c10d.wait_tensor(c10d.reduce_scatter_tensor(torch.cat([torch.zeros(2, 4), y]), "sum", 1, g))

    x, y = torch.randn(2, 4), torch.randn(2, 4)
    for f in (f_input, f_zeros):
        want = _compile_run(f, x, y)
        with mptp_kernels.enable_micro_pipeline_tp():
            got = _compile_run(f, x, y)
        assert torch.equal(got, want), f.__name__
        decisions = mptp_kernels.explain(f, x, y, verbose=False)
        assert [d.fused for d in decisions] == [False], decisions


def test_explain_reports_coalesced_collectives(pg1):
    g = pg1

    def fn(x, y, w):
        a, b = c10d.all_gather_into_tensor_coalesced([x, y], 1, g)
        a, b = c10d.wait_tensor(a), c10d.wait_tensor(b)
        c, d = c10d.reduce_scatter_tensor_coalesced([a @ w, b @ w], "sum", 1, g)
        return c10d.wait_tensor(c), c10d.wait_tensor(d)

    decisions = mptp_kernels.explain(fn, torch.randn(4, 8), torch.randn(4, 8), torch.randn(8, 8), verbose=False)
    assert [(d.kind, d.fused) for d in decisions] == [("all-gather (coalesced)", False),
                                                      ("reduce-scatter (coalesced)", False)], decisions  # fmt: skip
    assert all("coalesced" in d.detail for d in decisions)


def test_a_backward_run_after_the_block_is_compiled_with_the_pass(pg1):
    """Found by a hostile review: `with enable(): loss = compiled(x)` then `loss.backward()` after
    the block: AOTAutograd compiled the backward lazily, at the first backward, without the pass
    (unfused), and its cache stored it under the forward's key. While the pass is on, the
    backward is compiled with the forward."""
    from mptp_kernels.compile.micro_pipeline import recording

    mptp_kernels.enable_symm_mem_for_group(pg1)

    def f(x, w):
        return c10d.wait_tensor(c10d.all_gather_into_tensor(x, 1, pg1)) @ w

    x, w = torch.randn(4, 8, requires_grad=True), torch.randn(8, 3, requires_grad=True)
    torch._dynamo.reset()
    decisions = []
    with recording(decisions), cfg.patch(force_disable_caches=True):
        with mptp_kernels.enable_micro_pipeline_tp():
            loss = torch.compile(f, fullgraph=True)(x, w).sum()
        assert fcfg.force_non_lazy_backward_lowering is False  # restored
        loss.backward()
    torch._dynamo.reset()
    # the forward's all-gather, and the backward's reduce-scatter of dA
    assert [(d.kind, d.fused) for d in decisions] == [("all-gather", True), ("reduce-scatter", True)], decisions
    torch.testing.assert_close(x.grad, torch.ones(4, 3) @ w.detach().t())


def test_disable_restores_flags_unless_the_user_set_them_meanwhile():
    """Found by a hostile review: disable put back the _micro_pipeline_tp value saved at enable,
    over the one the user set while the pass was on. The eager backward lowering is the
    with-block's only, nests, and survives an exception in the block."""
    assert fcfg.force_non_lazy_backward_lowering is False
    mptp_kernels.enable_micro_pipeline_tp()  # without a block: the backward stays lazy
    assert fcfg.force_non_lazy_backward_lowering is False
    mptp_kernels.disable_micro_pipeline_tp()
    with mptp_kernels.enable_micro_pipeline_tp():
        assert fcfg.force_non_lazy_backward_lowering is True
        with mptp_kernels.enable_micro_pipeline_tp():
            assert fcfg.force_non_lazy_backward_lowering is True
        assert fcfg.force_non_lazy_backward_lowering is True and mc._state["depth"] == 1
        if hasattr(cfg, "_micro_pipeline_tp"):
            assert cfg._micro_pipeline_tp is False
    assert fcfg.force_non_lazy_backward_lowering is False and mc._state["depth"] == 0
    with pytest.raises(KeyError):
        with mptp_kernels.enable_micro_pipeline_tp():
            raise KeyError("in the block")
    assert fcfg.force_non_lazy_backward_lowering is False and mc._state["depth"] == 0
    assert not mc._has_mptp(cfg.post_grad_custom_post_pass)
    if hasattr(cfg, "_micro_pipeline_tp"):
        cfg._micro_pipeline_tp = False
        with mptp_kernels.enable_micro_pipeline_tp():
            cfg._micro_pipeline_tp = True  # the user's, while ours is on
            fcfg.force_non_lazy_backward_lowering = False
        assert cfg._micro_pipeline_tp is True and fcfg.force_non_lazy_backward_lowering is False
        cfg._micro_pipeline_tp = False
