"""Bad input gets a ValueError naming the argument, on every rank, before any
communication (checked with 2 processes: a collective would hang or mismatch)."""

import pytest
import torch
import torch.distributed as dist

FP8 = torch.float8_e4m3fn


def _g():
    return dist.group.WORLD.group_name


def _ag(A, Bs, gather_dim=0, group=None):
    return torch.ops.mptp.fused_all_gather_matmul(A, Bs, gather_dim, group or _g())


def _rs(A, B, reduce_op="sum", scatter_dim=0, group=None):
    return torch.ops.mptp.fused_matmul_reduce_scatter(A, B, reduce_op, scatter_dim, group or _g())


def _ags(A_scale_shape=(1,), n_lists=1, gather_dim=0, B_scales_device="cpu"):
    A = torch.zeros(4, 16).to(FP8)
    B = torch.zeros(8, 16).to(FP8).t()
    bs = torch.ones((), device=B_scales_device)
    n = n_lists
    return torch.ops.mptp.fused_all_gather_scaled_matmul(
        A, [B], torch.ones(A_scale_shape), [bs] * n, gather_dim, _g(), [None] * n, [None] * n,
        [None] * n, [False] * n,
    )  # fmt: skip


def _srs(output_shape=None, sd_after=0):
    A = torch.zeros(4, 16).to(FP8)
    B = torch.zeros(8, 16).to(FP8).t()
    one = torch.ones(())
    return torch.ops.mptp.fused_scaled_matmul_reduce_scatter(A, B, one, one, "sum", 0, sd_after, _g(), output_shape,
                                                             out_dtype=torch.float32)  # fmt: skip


CASES = {
    "A_1d": (lambda: _ag(torch.zeros(8), [torch.zeros(8, 4)]), "A:"),
    "B_not_2d": (lambda: _ag(torch.zeros(4, 8), [torch.zeros(8, 4, 1)]), "Bs[0]:"),
    "K_mismatch": (lambda: _ag(torch.zeros(4, 8), [torch.zeros(8, 4), torch.zeros(9, 4)]), "Bs[1]:"),
    "dtype_mismatch": (lambda: _ag(torch.zeros(4, 8), [torch.zeros(8, 4, dtype=torch.float16)]), "Bs[0]:"),
    "gather_dim_range": (lambda: _ag(torch.zeros(4, 8), [torch.zeros(8, 4)], gather_dim=2), "gather_dim:"),
    "unknown_group": (lambda: _ag(torch.zeros(4, 8), [torch.zeros(8, 4)], group="no-such-group"), "group_name:"),
    "scaled_list_lengths": (lambda: _ags(n_lists=2), "B_scales:"),
    "scaled_A_scale_shape": (lambda: _ags(A_scale_shape=(3, 1)), "A_scale:"),
    "device_mismatch": (lambda: _ags(B_scales_device="meta"), "B_scales[0]:"),
    "rs_reduce_op": (lambda: _rs(torch.zeros(4, 8), torch.zeros(8, 4), reduce_op="max"), "reduce_op:"),
    "rs_scatter_dim_range": (lambda: _rs(torch.zeros(4, 8), torch.zeros(8, 4), scatter_dim=-3), "scatter_dim:"),
    "rs_not_divisible": (lambda: _rs(torch.zeros(5, 8), torch.zeros(8, 4)), "scatter_dim:"),
    "rs_K_mismatch": (lambda: _rs(torch.zeros(4, 8), torch.zeros(7, 4)), "B:"),
    "scaled_gather_K": (lambda: _ags(gather_dim=-1), "gather_dim:"),
    "srs_output_shape_negative": (lambda: _srs([-2, -2, 8]), "output_shape:"),
    "srs_output_shape_two_minus_ones": (lambda: _srs([-1, -1, 8]), "output_shape:"),
    "srs_output_shape_elements": (lambda: _srs([3, 8]), "output_shape:"),
    "srs_scatter_dim_after_range": (lambda: _srs(sd_after=7), "scatter_dim_after_maybe_reshape:"),
    "srs_scatter_dim_after_negative": (lambda: _srs(sd_after=-3), "scatter_dim_after_maybe_reshape:"),
    "rs_A_1d": (lambda: _rs(torch.zeros(8), torch.zeros(8, 4)), "A:"),
}  # fmt: skip


def _expect_error(case):
    fn, prefix = CASES[case]
    with pytest.raises(ValueError) as info:
        fn()
    msg = str(info.value)
    assert msg.startswith(prefix), f"{case}: message {msg!r} does not name {prefix!r}"
    # The group still works afterwards: nothing was half-communicated.
    t = torch.ones(2)
    dist.all_reduce(t)
    assert t[0].item() == dist.get_world_size()
    return msg


@pytest.mark.parametrize("case", sorted(CASES))
def test_bad_input_raises_on_every_rank(workers2, case):
    msgs = workers2.run(_expect_error, case)
    assert msgs[0] == msgs[1]


def test_scalar_type_ints_are_accepted(pg1):
    from mptp_kernels.ops.validate import to_dtype

    assert to_dtype(15) is torch.bfloat16 and to_dtype(6) is torch.float32
    assert to_dtype(torch.float16) is torch.float16 and to_dtype(None) is None
    with pytest.raises(ValueError, match="out_dtypes"):
        to_dtype(99)


# -- issue 12 item 8: small defects ----------------------------------------------------------------


@pytest.mark.parametrize("fp8_out", [torch.float8_e4m3fn, torch.float8_e5m2], ids=str)
def test_fp8_out_dtypes_travel_through_the_dispatcher(pg1, fp8_out):
    """ScalarType arguments arrive as c10 integers (23 e5m2, 24 e4m3fn): both are accepted."""
    A = (torch.randn(16, 32) / 4).to(FP8)
    B = (torch.randn(32, 32) / 4).to(FP8).t()
    one = torch.tensor(1.0)
    A_out, (out,) = torch.ops.mptp.fused_all_gather_scaled_matmul(
        A, [B], one, [one], 0, pg1, [None], [torch.tensor(2.0)], [fp8_out], [False])
    assert out.dtype == fp8_out
    # The result scale multiplies (cuBLASLt's convention; CPU torch._scaled_mm divides).
    fmax = torch.finfo(fp8_out).max
    want = ((A.float() @ B.float()) * 2.0).clamp(-fmax, fmax).to(fp8_out)
    assert torch.equal(out.view(torch.uint8), want.view(torch.uint8))


@pytest.mark.parametrize("which", ["A_scale", "B_scale"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float64])
@pytest.mark.parametrize("op", ["ag", "rs"])
def test_scales_must_be_float32_in_every_mode(pg1, op, which, dtype):
    """Found by a hostile review: tensor-wise scales of another dtype were accepted (the fused
    path converts them), where torch._scaled_mm, and so the reference path, refuses them."""
    A = (torch.randn(16, 32) / 4).to(FP8)
    B = (torch.randn(32, 32) / 4).to(FP8).t()
    sa = torch.tensor(1.0, dtype=dtype if which == "A_scale" else torch.float32)
    sb = torch.tensor(1.0, dtype=dtype if which == "B_scale" else torch.float32)
    with pytest.raises(ValueError, match="scales must be float32"):
        if op == "ag":
            torch.ops.mptp.fused_all_gather_scaled_matmul(A, [B], sa, [sb], 0, pg1, [None], [None],
                                                          [torch.bfloat16], [False])  # fmt: skip
        else:
            torch.ops.mptp.fused_scaled_matmul_reduce_scatter(A, B, sa, sb, "sum", 0, 0, pg1, None, None, None,
                                                              torch.bfloat16, False)  # fmt: skip


def test_every_scalar_type_code_maps_to_its_dtype():
    from mptp_kernels.ops import validate

    lib = torch.library.Library("mptp_test_scalar", "DEF")
    lib.define("echo(ScalarType?[] d) -> int[]")
    lib.impl("echo", lambda d: [int(x) if isinstance(x, int) else -1 for x in d], "CompositeExplicitAutograd")
    dtypes = [torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64, torch.float16, torch.float32,
              torch.float64, torch.bool, torch.bfloat16, torch.float8_e5m2, torch.float8_e4m3fn,
              torch.float8_e5m2fnuz, torch.float8_e4m3fnuz]  # fmt: skip
    codes = torch.ops.mptp_test_scalar.echo(dtypes)
    for code, dt in zip(codes, dtypes):
        assert validate.to_dtype(code if code >= 0 else dt) == dt, (code, dt)


def test_an_unknown_scalar_type_names_its_argument():
    from mptp_kernels.ops import validate

    with pytest.raises(ValueError, match="^out_dtype: unrecognized scalar type 999"):
        validate.scaled_out_dtype(999)
    with pytest.raises(ValueError, match=r"^out_dtypes\[1\]: unrecognized scalar type 999"):
        validate.scaled_out_dtype(999, "out_dtypes[1]")


def test_a_single_tensor_as_Bs_is_rejected(pg1):
    import mptp_kernels

    A, B = torch.randn(4, 8), torch.randn(8, 8)
    with pytest.raises(ValueError, match="Bs: expected a list"):
        mptp_kernels.fused_all_gather_matmul(A, B, 0, pg1)


def test_wrapper_before_init_process_group_says_so():
    import subprocess
    import sys

    code = (
        "import torch, mptp_kernels\n"
        "try:\n"
        "    mptp_kernels.fused_all_gather_matmul(torch.randn(4, 8), [torch.randn(8, 8)], 0)\n"
        "except RuntimeError as e:\n"
        "    print('OK', e)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert "OK" in out.stdout and "init_process_group" in out.stdout, out.stdout + out.stderr


def test_integer_avg_reduce_scatter_keeps_the_dtype(pg1):
    A = torch.randint(-5, 5, (4, 8), dtype=torch.int64)
    B = torch.randint(-5, 5, (8, 6), dtype=torch.int64)
    out = torch.ops.mptp.fused_matmul_reduce_scatter(A, B, "avg", 0, pg1)
    assert out.dtype == torch.int64 and torch.equal(out, A @ B)


@pytest.mark.parametrize("var,value", [("MPTP_TIMEOUT_S", "soon"), ("MPTP_TIMEOUT_S", "0"),
                                       ("MPTP_ASYNC_ERROR_HANDLING", "3"), ("MPTP_ASYNC_ERROR_HANDLING", "x"),
                                       ("MPTP_RESERVE_SMS", "0"), ("MPTP_RESERVE_SMS", "65"),
                                       ("MPTP_RESERVE_SMS", "some"), ("MPTP_CE_COPIES", "maybe"),
                                       ("MPTP_C_BINDER", "later"), ("MPTP_LAUNCH_MEMO", "sometimes"),
                                       ("MPTP_RS_REDUCE", "1"), ("MPTP_RS_REDUCE", "auto")])  # fmt: skip
def test_bad_environment_values_name_the_variable(monkeypatch, var, value):
    from mptp_kernels import env

    monkeypatch.setenv(var, value)
    fn = {"MPTP_TIMEOUT_S": env.timeout_s, "MPTP_ASYNC_ERROR_HANDLING": env.async_error_handling,
          "MPTP_RESERVE_SMS": env.reserve_sms, "MPTP_CE_COPIES": env.ce_copies_enabled,
          "MPTP_C_BINDER": env.c_binder_enabled, "MPTP_LAUNCH_MEMO": env.launch_memo_enabled,
          "MPTP_RS_REDUCE": env.rs_reduce}[var]  # fmt: skip
    with pytest.raises(ValueError, match=var):
        fn()


@pytest.mark.parametrize("var,value", [("MPTP_RESERVE_SMS", "200"), ("MPTP_CE_COPIES", "perhaps"),
                                       ("MPTP_C_BINDER", "2"), ("MPTP_LAUNCH_MEMO", "2"), ("MPTP_RS_REDUCE", "on")])
def test_a_bad_environment_value_is_raised_before_any_communication(pg1, monkeypatch, var, value):
    monkeypatch.setenv(var, value)
    A, B = torch.randn(4, 8), torch.randn(8, 6)
    with pytest.raises(ValueError, match=var):
        torch.ops.mptp.fused_all_gather_matmul(A, [B], 0, pg1)


@pytest.mark.parametrize("shares,ce,reserve,want", [(False, False, "8", None), (False, True, "8", None),
                                                    (True, True, "8", 130), (True, True, "1", 131),
                                                    (True, False, "8", 124), (True, False, "1", 131),
                                                    (True, False, "64", 68)])  # fmt: skip
def test_the_consumer_leaves_sms_to_copies_that_may_need_them(monkeypatch, shares, ce, reserve, want):
    # Only where a peer shares this GPU could a chunk copy run as a kernel and wait behind a consumer
    # holding every SM: plain copies (CUDA-graph capture, a driver that refuses the batch API) get
    # MPTP_RESERVE_SMS, copies that asked for a copy engine (a hint) at most 2 as insurance.
    from types import SimpleNamespace

    pytest.importorskip("triton", reason="the kernels need Triton (a CPU-only torch build comes without it)")
    from mptp_kernels.kernels import persistent_matmul as pm
    from mptp_kernels.ops import fused
    from mptp_kernels.symm import primitives as P

    monkeypatch.setenv("MPTP_RESERVE_SMS", reserve)
    monkeypatch.setattr(P, "ce_copies", lambda stream=None: ce)
    monkeypatch.setattr(pm, "sm_count", lambda dev: 132)
    ws = SimpleNamespace(shares_device=shares, side=None)
    assert fused._consumer_sms(ws, torch.device("cuda", 0)) == want
    # A call that asks for no copy engine (the row-wise scaled all-gather) gets the full reserve,
    # whatever the driver would grant.
    plain = None if not shares else 132 - int(reserve)
    assert fused._consumer_sms(ws, torch.device("cuda", 0), ce=False) == plain


@pytest.mark.parametrize("value,gloo,nccl", [(None, False, False), ("auto", False, False), ("1", True, True),
                                             ("0", False, False), ("maybe", None, None)])  # fmt: skip
def test_check_agreement_is_opt_in(monkeypatch, value, gloo, nccl):
    # Off by default: the check is one collective more than the unfused ops make, and the pass
    # may fuse on one rank only (tests/compile/test_rank_divergent.py). Turning it on per call
    # from each rank's own circumstances (eager or compiled code) was tried and dropped: ranks
    # can differ there (rank 0 alone under FlopCounterMode runs a compiled frame eagerly).
    from mptp_kernels import env

    if value is None:
        monkeypatch.delenv("MPTP_CHECK_AGREEMENT", raising=False)
    else:
        monkeypatch.setenv("MPTP_CHECK_AGREEMENT", value)
    if gloo is None:
        with pytest.raises(ValueError, match="MPTP_CHECK_AGREEMENT"):
            env.check_agreement(nccl=False)
        return
    assert env.check_agreement(nccl=False) is gloo and env.check_agreement(nccl=True) is nccl


@pytest.mark.parametrize("shape", [[-1, 8], [2, -1, 8], [2, 2, -1], [-1, 2, 8]])
def test_scaled_reduce_scatter_output_shape_takes_a_minus_one_as_view_does(pg1, shape):
    """PyTorch's fallback views C as output_shape (C.view(*output_shape[:-1], N)), so a -1
    there is inferred; ours refused it. Real call and fake impl against a float64 reference."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    E4 = torch.float8_e4m3fn
    A = torch.randn(4, 16).to(E4)
    B = torch.randn(8, 16).to(E4).t()
    sa, sb = torch.tensor(0.5), torch.tensor(2.0)
    want = [2, 2, 8] if len(shape) == 3 else [4, 8]
    out = torch.ops.mptp.fused_scaled_matmul_reduce_scatter(A, B, sa, sb, "sum", 0, 0, pg1, shape,
                                                            out_dtype=torch.float32)  # fmt: skip
    ref = (A.double() @ B.double()) * 0.5 * 2.0
    assert list(out.shape) == want
    torch.testing.assert_close(out.double().reshape(4, 8), ref, rtol=1e-6, atol=1e-6)  # fp32 sums of 16 products
    with FakeTensorMode() as m:
        fo = torch.ops.mptp.fused_scaled_matmul_reduce_scatter(
            m.from_tensor(A), m.from_tensor(B), m.from_tensor(sa), m.from_tensor(sb), "sum", 0, 0, pg1, shape,
            out_dtype=torch.float32)  # fmt: skip
    assert list(fo.shape) == want and fo.stride() == out.stride()


def test_scaled_reduce_scatter_output_shape_with_two_minus_ones_is_refused(pg1):
    E4 = torch.float8_e4m3fn
    A, B = torch.randn(4, 16).to(E4), torch.randn(8, 16).to(E4).t()
    with pytest.raises(ValueError, match="output_shape"):
        torch.ops.mptp.fused_scaled_matmul_reduce_scatter(A, B, torch.tensor(1.0), torch.tensor(1.0), "sum", 0, 0,
                                                          pg1, [-1, -1, 8], out_dtype=torch.float32)  # fmt: skip


@pytest.mark.parametrize("rs_shape", [(), (1,), (1, 1), (1, 1, 1)], ids=str)
@pytest.mark.parametrize("lead", [(8,), (2, 4)], ids=str)
def test_a_one_element_result_scale_of_any_shape_scales_the_fp8_output(pg1, rs_shape, lead):
    """torch._scaled_mm takes a one-element scale_result of any shape; the reference applied a
    [1, 1, 1] one as a broadcast ([M, N] -> [1, M, N]) and failed after the all-gather (and on
    that rank only, where the peers passed a 0-d one). Integer inputs and power-of-two scales:
    every product, sum and scaling is exact, so the FP8 outputs equal the float64 reference's."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    A = torch.randint(-2, 3, (*lead, 16)).to(FP8)
    B = torch.randint(-2, 3, (8, 16)).to(FP8).t()
    sa, sb, rs = torch.tensor(0.5), torch.tensor(2.0), torch.full(rs_shape, 0.25)
    want = ((A.double() @ B.double()) * 0.5 * 2.0 * 0.25).to(FP8).double()
    for out_dtype in (FP8, None):
        _, (ag,) = torch.ops.mptp.fused_all_gather_scaled_matmul(
            A, [B], sa, [sb], 0, pg1, [None], [rs], [out_dtype], [False])  # fmt: skip
        srs = torch.ops.mptp.fused_scaled_matmul_reduce_scatter(
            A, B, sa, sb, "sum", 0, 0, pg1, [*lead, 8], result_scale=rs, out_dtype=out_dtype)  # fmt: skip
        for out in (ag, srs):
            assert out.dtype == FP8 and out.shape == want.shape
            assert torch.equal(out.double(), want)
    with FakeTensorMode() as m:
        f = m.from_tensor
        _, (fo,) = torch.ops.mptp.fused_all_gather_scaled_matmul(
            f(A), [f(B)], f(sa), [f(sb)], 0, pg1, [None], [f(rs)], [FP8], [False])  # fmt: skip
    assert fo.shape == want.shape and fo.dtype == FP8


def test_scaled_reduce_scatter_output_shape_checks_leave_symbolic_sizes_to_view(pg1):
    """The fake impl is the reference, so torch.compile(dynamic=True) runs its output_shape
    checks on symbolic sizes: a -1 beside symbolic ones, and unbacked rows (.item()), must
    compile as view() takes them (a review found both refused once the checks compared sizes)."""
    op = torch.ops.mptp.fused_scaled_matmul_reduce_scatter
    B = torch.randint(-2, 3, (8, 16)).to(FP8).t()
    one = torch.ones(())

    def minus_one(x):  # [b, s, K] viewed 2-D, output_shape [-1, s, N]
        A = x.reshape(-1, x.shape[-1])
        return op(A, B, one, one, "sum", 0, 0, pg1, [-1, x.shape[1], 8], out_dtype=torch.float32)

    def unbacked(x, n):
        k = n.item()
        torch._check(k >= 0)
        return op(x[:k], B, one, one, "sum", 0, 0, pg1, [k, 8], out_dtype=torch.float32)

    def ref(A):  # integer FP8 inputs, unit scales: exact in fp32 and float64
        return (A.double().reshape(-1, 16) @ B.double()).float()

    xs = [torch.randint(-2, 3, s).to(FP8) for s in ((2, 4, 16), (3, 4, 16), (4, 6, 16))]
    torch._dynamo.reset()
    with torch._dynamo.config.patch(capture_scalar_outputs=True):
        f = torch.compile(minus_one, fullgraph=True, dynamic=True, backend="aot_eager")
        for x in xs:
            out = f(x)
            assert out.shape == (*x.shape[:2], 8) and torch.equal(out.reshape(-1, 8), ref(x))
        g = torch.compile(unbacked, fullgraph=True, dynamic=True, backend="aot_eager")
        x = xs[2].reshape(-1, 16)
        for n in (4, 6, 0):
            out = g(x, torch.tensor(n))
            assert out.shape == (n, 8) and torch.equal(out, ref(x[:n]))
    torch._dynamo.reset()


def test_the_matmul_operand_is_a_copy_exactly_where_torch_matmul_would_take_a_missing_bmm():
    """validate.matmul_operand against torch.matmul itself, on FP8 and float32 As of 3 and 4 dims
    in many layouts (permuted, sliced, expanded, zero-size): it copies A exactly where
    torch.matmul raises (FP8 on the CPU: mm but no bmm), and the product with its operand then
    runs, bit-equal to torch.matmul's wherever that runs; B requiring grad (ATen folds) too."""
    import itertools

    from mptp_kernels.ops import validate

    g = torch.Generator().manual_seed(0)
    seen = {True: 0, False: 0}
    for dtype in (torch.float8_e4m3fn, torch.float8_e5m2, torch.float32):
        for shape in ((2, 3, 4), (3, 1, 2, 4), (1, 2, 4), (2, 0, 4), (4, 2, 3, 4)):
            base = torch.randn(*shape, generator=g).to(dtype)
            B = torch.randn(4, 5, generator=g).to(dtype)
            views = [base]
            for perm in itertools.permutations(range(base.dim() - 1)):
                views.append(base.permute(*perm, base.dim() - 1))
            views.append(torch.randn(shape[0] * 2, *shape[1:], generator=g).to(dtype)[::2])
            views.append(torch.randn(shape[0], shape[1] * 2, *shape[2:], generator=g).to(dtype)[:, ::2])
            views.append(torch.randn(*shape[:-1], 2 * shape[-1], generator=g).to(dtype)[..., : shape[-1]])
            views.append(torch.randn(*shape[:-2], shape[-2] + 1, shape[-1], generator=g).to(dtype)[..., 1:, :])
            views.append(base[..., :1, :].expand(*shape[:-2], 3, shape[-1]) if shape[-2] else base)
            for A in views:
                try:
                    torch.matmul(A, B)
                    torch_ok = True
                except (RuntimeError, NotImplementedError):
                    torch_ok = False
                op = validate.matmul_operand(A)
                assert (op is A) == torch_ok, (dtype, tuple(A.shape), A.stride(), torch_ok)
                got = torch.matmul(op, B)
                if torch_ok:
                    assert torch.equal(got.float(), torch.matmul(A, B).float())
                else:
                    dense = A.clone(memory_format=torch.contiguous_format)  # every stride canonical
                    assert torch.equal(got.float(), torch.matmul(dense, B).float())
                Bg = B.float().requires_grad_() if dtype == torch.float32 else None
                if Bg is not None:  # (B requiring grad: ATen folds, nothing to copy)
                    assert torch.equal(torch.matmul(validate.matmul_operand(A), Bg), torch.matmul(A, Bg))
                seen[torch_ok] += 1
    assert seen[False] > 0 and seen[True] > 0, seen


def test_kernel_probes_ignore_a_torch_function_mode():
    """The per-dtype probes (CPU bmm, the fold rule) answer for eager calls even when first asked
    under a TorchFunctionMode that changes the op (found by a hostile review: a mode upcasting
    matmul made FP8 look supported, and later eager calls raised)."""
    from torch.overrides import TorchFunctionMode

    from mptp_kernels.ops import validate

    class Upcast(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            if func in (torch.bmm, torch.matmul, torch.Tensor.matmul):
                args = tuple(a.float() if isinstance(a, torch.Tensor) else a for a in args)
            return func(*args, **(kwargs or {}))

    fp8 = torch.float8_e4m3fn
    eager = validate._bmm_supports(fp8)
    saved = dict(validate._CPU_BMM), dict(validate._LENIENT_FOLD)
    try:
        validate._CPU_BMM.clear()
        validate._LENIENT_FOLD.clear()
        A = torch.randn(3, 1, 2, 4).to(fp8).permute(0, 2, 1, 3)  # strides (8, 4, 8, 1)
        with Upcast():
            validate._bmm_supports(fp8)
            validate._folds(A)
        assert validate._CPU_BMM[fp8] == eager
        op = validate.matmul_operand(A)
        torch.matmul(op, torch.randn(4, 5).to(fp8))  # runs eagerly, whatever the probes saw
    finally:
        validate._CPU_BMM.clear()
        validate._CPU_BMM.update(saved[0])
        validate._LENIENT_FOLD.clear()
        validate._LENIENT_FOLD.update(saved[1])
