"""The dispatcher's call memo (ops/dispatch.py, issue 14): a call with the signature of an earlier
valid one reuses its validation, signature and plan, and nothing else. Checked on the CPU path
(the memo is the same for every device; the fused path's bind runs in the GPU tests)."""

import gc
import weakref

import pytest
import torch

from mptp_kernels.ops import dispatch


def _ag(A, Bs, group, **kw):
    return torch.ops.mptp.fused_all_gather_matmul(A, Bs, 0, group, **kw)


def _stats():
    return dict(dispatch.MEMO_STATS)


def _delta(before):
    now = dispatch.MEMO_STATS
    return {k: now[k] - before.get(k, 0) for k in ("hit", "miss", "none")}


def test_repeated_calls_hit_and_compute_each_calls_values(pg1):
    dispatch._MEMO.clear()
    before = _stats()
    for _ in range(3):
        A, B = torch.randn(5, 7, dtype=torch.float64), torch.randn(7, 3, dtype=torch.float64)
        A_g, (out,) = _ag(A, [B], pg1)
        assert torch.equal(A_g, A) and torch.allclose(out, A @ B, rtol=0, atol=1e-12)
    assert _delta(before) == {"hit": 2, "miss": 1, "none": 0}


@pytest.mark.parametrize("change", ["shape", "stride", "dtype", "requires_grad", "grad_mode", "kwarg", "group"])
def test_each_part_of_the_signature_misses(pg1, change):
    dispatch._MEMO.clear()
    A, B = torch.randn(4, 8), torch.randn(8, 6)
    _ag(A, [B], pg1)
    before = _stats()
    grad = torch.enable_grad() if change != "grad_mode" else torch.no_grad()
    kw = {}
    if change == "shape":
        A = torch.randn(6, 8)
    elif change == "stride":
        B = torch.randn(6, 8).t()
    elif change == "dtype":
        A, B = A.double(), B.double()
    elif change == "requires_grad":
        A = A.clone().requires_grad_()
    elif change == "kwarg":
        kw = {"return_A": False}
    elif change == "group":
        import torch.distributed as dist

        pg1 = dist.new_group([0]).group_name
    with grad:
        _ag(A, [B], pg1, **kw)
    assert _delta(before) == {"hit": 0, "miss": 1, "none": 0}


@pytest.mark.parametrize("var,value", [("MPTP_RESERVE_SMS", "0"), ("MPTP_TIMEOUT_S", "soon"),
                                       ("MPTP_RS_REDUCE", "on"), ("MPTP_CE_COPIES", "perhaps")])
def test_a_setting_made_bad_after_a_valid_call_is_still_raised(pg1, monkeypatch, var, value):
    A, B = torch.randn(4, 8), torch.randn(8, 6)
    _ag(A, [B], pg1)
    _ag(A, [B], pg1)  # a hit
    monkeypatch.setenv(var, value)
    with pytest.raises(ValueError, match=var):
        _ag(A, [B], pg1)


def test_a_bad_call_is_never_memoized(pg1):
    dispatch._MEMO.clear()
    A, B = torch.randn(4, 8), torch.randn(9, 6)
    for _ in range(2):
        with pytest.raises(ValueError, match=r"Bs\[0\]"):
            _ag(A, [B], pg1)
    assert not dispatch._MEMO


def test_a_memo_entry_holds_no_tensor(pg1):
    dispatch._MEMO.clear()
    A, B = torch.randn(4, 8), torch.randn(8, 6)
    refs = [weakref.ref(A), weakref.ref(B)]
    out = _ag(A, [B], pg1)
    del A, B, out
    gc.collect()
    assert dispatch._MEMO and all(r() is None for r in refs)


def test_what_is_not_memoized(pg1):
    class Sub(torch.Tensor):
        pass

    A, B = torch.randn(4, 8), torch.randn(8, 6)
    assert dispatch._memo_key("fused_all_gather_matmul", (A, [B], 0, pg1), {}, 1) is not None
    assert dispatch._memo_key("fused_all_gather_matmul", (A.as_subclass(Sub), [B], 0, pg1), {}, 1) is None
    assert dispatch._memo_key("x", (A, float("nan")), {}, 1) is None
    assert dispatch._memo_key("x", (A, object()), {}, 1) is None
    # 1, 1.0 and True are equal but are different arguments
    keys = {dispatch._memo_key("x", (A, v), {}, 1) for v in (1, 1.0, True)}
    assert len(keys) == 3


def test_the_memo_is_bounded(pg1, monkeypatch):
    monkeypatch.setattr(dispatch, "_MEMO_MAX", 3)
    dispatch._MEMO.clear()
    for m in range(1, 6):
        _ag(torch.randn(m, 8), [torch.randn(8, 6)], pg1)
        assert len(dispatch._MEMO) <= 3


def test_scaled_reduce_scatter_hits_with_new_scales(pg1):
    dispatch._MEMO.clear()
    FP8 = torch.float8_e4m3fn
    before = _stats()
    for _ in range(2):
        A = (torch.randn(4, 16) * 4).to(FP8)
        B = (torch.randn(8, 16) * 4).to(FP8).t()
        sa, sb = torch.rand(()) + 0.5, torch.rand(()) + 0.5
        out = torch.ops.mptp.fused_scaled_matmul_reduce_scatter(A, B, sa, sb, "sum", 0, 0, pg1, None, None, None,
                                                               torch.float32, False)  # fmt: skip
        want = (A.double() @ B.double()) * sa.double() * sb.double()
        # NOTE: a bound from the magnitudes, not a fixed 1e-5: the fp32 result (scales applied in
        # torch's CPU kernel, products summed in its order) is off by up to a few eps of
        # sum |a||b| * sa * sb, and where the 16 products cancel that exceeded 1e-5 (0.2% of
        # draws). K + 2 roundings, times 2; a stale scale is ~10% off, far outside it.
        mag = (A.double().abs() @ B.double().abs()) * sa.double() * sb.double()
        bound = 2 * (16 + 2) * torch.finfo(torch.float32).eps * mag + 1e-30
        err = (out.double() - want).abs()
        assert (err <= bound).all(), f"max err / bound {(err / bound).max().item():.3g}"
    assert _delta(before)["hit"] == 1


def test_a_rebound_os_environ_is_read(pg1, monkeypatch):
    """mock.patch("os.environ", {...}) replaces the mapping: reads and the memo key follow it."""
    import os

    from mptp_kernels import env

    A, B = torch.randn(4, 8), torch.randn(8, 6)
    _ag(A, [B], pg1)
    monkeypatch.setattr(os, "environ", {**os.environ, "MPTP_TIMEOUT_S": "5"})
    assert env.timeout_s() == 5.0
    monkeypatch.setattr(os, "environ", {**os.environ, "MPTP_RESERVE_SMS": "0"})
    with pytest.raises(ValueError, match="MPTP_RESERVE_SMS"):
        _ag(A, [B], pg1)


def test_a_list_that_holds_itself_is_named(pg1):
    Bs = []
    Bs.append(Bs)
    with pytest.raises(ValueError, match=r"Bs\[0\]"):
        dispatch.all_gather_matmul(torch.randn(4, 8), Bs, 0, pg1)
