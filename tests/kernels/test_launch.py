"""kernels.launch: the direct launch of a cached compiled kernel (issue 14's host cost).

On the CPU the launch logic runs against a stand-in compiled kernel (the interpreter has no
launcher): first call of a key goes through fn[grid], later ones straight to kernel.run with
every parameter in order; any change of specialization (alignment, dtype, int class,
constexpr) is a new key. On a GPU the direct launch must give bitwise the plain launch's
results and be the path taken.
"""

import pytest
import torch

pytest.importorskip("triton", reason="the kernels need Triton (a CPU-only torch build comes without it)")
import triton  # noqa: E402
from utils import randn

from mptp_kernels.kernels import launch as L
from mptp_kernels.kernels import persistent_matmul as pm

CUDA = torch.cuda.is_available()


def _py_kernel(X, Y, n, scale, BLOCK, FLAG):  # a JITFunction needs a source; never compiled here
    pass


class _FakeCompiled:
    packed_metadata = "meta"
    function = "fn-handle"

    def __init__(self):
        self.calls = []
        self.run = lambda *a: self.calls.append(a)


class _FakeJIT(triton.runtime.jit.JITFunction):
    def __init__(self):
        super().__init__(_py_kernel)
        self.plain = []
        self.compiled = {}

    def __getitem__(self, grid):
        def run(*args, **kw):
            self.plain.append((grid, args, kw))
            return self.compiled.setdefault(tuple(sorted(kw.items())), _FakeCompiled())

        return run


@pytest.fixture
def fake_device(monkeypatch):
    monkeypatch.setattr(L, "interpreting", lambda: False)
    monkeypatch.setattr(L, "FAST", True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda i: 1234, raising=False)
    L._KERNELS.clear()
    L._NAMES.clear()
    L._STATIC.clear()
    yield
    L._KERNELS.clear()
    L._NAMES.clear()
    L._STATIC.clear()


def test_direct_launch_after_the_first_call_of_a_key(fake_device):
    fn = _FakeJIT()
    x = torch.zeros(64)
    y = torch.zeros(64, dtype=torch.float16)
    L.launch(fn, (3,), [x, y, 64, 0.5], dict(FLAG=True, BLOCK=32), num_warps=4)
    assert len(fn.plain) == 1
    L.launch(fn, (3,), [x, y, 64, 0.5], dict(FLAG=True, BLOCK=32), num_warps=4)
    assert len(fn.plain) == 1
    (k,) = fn.compiled.values()
    (call,) = k.calls
    # grid, stream, function, packed metadata, no launch metadata or hooks, args, constexprs in order
    assert call == (3, 1, 1, 1234, "fn-handle", "meta", None, None, None, x, y, 64, 0.5, 32, True)


def test_a_static_key_finds_the_kernel_of_the_same_launch_without_one(fake_device):
    """launch_static's key (a launch plan's) stands for the constexprs and options: the kernel key
    it makes is the plain one, so both forms find one compiled kernel, and the launcher gets the
    constexpr values of the plan's first launch."""
    fn = _FakeJIT()
    x, y = torch.zeros(64), torch.zeros(64, dtype=torch.float16)
    L.launch_static(fn, (2,), [x, y, 64, 0.5], dict(FLAG=True, BLOCK=32), dict(num_warps=4), ("plan", 1))
    L.launch_static(fn, (2,), [x, y, 64, 0.5], dict(FLAG=True, BLOCK=32), dict(num_warps=4), ("plan", 1))
    L.launch(fn, (2,), [x, y, 64, 0.5], dict(FLAG=True, BLOCK=32), num_warps=4)
    assert len(fn.plain) == 1
    (k,) = fn.compiled.values()
    assert [c[-2:] for c in k.calls] == [(32, True), (32, True)]
    # Another plan (other constexprs) is another kernel, whichever form launches it.
    L.launch_static(fn, (2,), [x, y, 64, 0.5], dict(FLAG=False, BLOCK=32), dict(num_warps=4), ("plan", 2))
    L.launch(fn, (2,), [x, y, 64, 0.5], dict(FLAG=False, BLOCK=32), num_warps=4)
    assert len(fn.plain) == 2 and len(fn.compiled) == 2


class _OnDevice(torch.Tensor):
    """A CPU tensor that says it is on a CUDA device (what _prepare looks at)."""

    @property
    def is_cuda(self):
        return True


def test_cuda_tensors_reach_the_launcher_as_addresses_and_the_rest_unchanged(fake_device, monkeypatch):
    fn = _FakeJIT()
    dev = torch.zeros(64).as_subclass(_OnDevice)
    host = torch.zeros(64, dtype=torch.float16)
    args = [dev, host, 64, 0.5]
    for _ in range(2):
        L.launch(fn, (1,), args, dict(FLAG=True, BLOCK=32))
    (k,) = fn.compiled.values()
    (call,) = k.calls
    assert call[9:] == (dev.data_ptr(), host, 64, 0.5, 32, True)
    assert type(call[9]) is int and call[10] is host
    monkeypatch.setattr(L, "INT_POINTERS", False)  # the switch profile_host.py compares
    L.launch(fn, (1,), args, dict(FLAG=True, BLOCK=32))
    assert k.calls[-1][9] is dev
    assert len(fn.plain) == 1, "the switch does not change the key"


@pytest.mark.parametrize("change", ["misaligned", "dtype", "int_is_one", "int_div16", "int64", "constexpr",
                                    "options"])  # fmt: skip
def test_any_change_of_specialization_is_a_new_key(fake_device, change):
    fn = _FakeJIT()
    buf = torch.zeros(80)
    base = dict(args=[buf[:64], torch.zeros(64, dtype=torch.float16), 64, 0.5], cx=dict(BLOCK=32, FLAG=True),
                opts=dict(num_warps=4))  # fmt: skip
    L.launch(fn, (1,), base["args"], base["cx"], **base["opts"])
    L.launch(fn, (1,), base["args"], base["cx"], **base["opts"])
    assert len(fn.plain) == 1
    args, cx, opts = list(base["args"]), dict(base["cx"]), dict(base["opts"])
    if change == "misaligned":
        args[0] = buf[1:65]  # 4 bytes off a 16-byte boundary
    elif change == "dtype":
        args[1] = torch.zeros(64, dtype=torch.bfloat16)
    elif change == "int_is_one":
        args[2] = 1
    elif change == "int_div16":
        args[2] = 63
    elif change == "int64":
        args[2] = 2**33
    elif change == "constexpr":
        cx["FLAG"] = False
    else:
        opts["num_warps"] = 8
    L.launch(fn, (1,), args, cx, **opts)
    assert len(fn.plain) == 2, "a new specialization must go through the plain launch"
    # Values of the same class reuse the key (e.g. another 16-multiple, another aligned tensor).
    L.launch(fn, (1,), [buf[4:68], base["args"][1], 48, 2.0], base["cx"], **base["opts"])
    assert len(fn.plain) == 2


def _hook(*args):
    pass


def test_hooks_and_failures_take_the_plain_launch(fake_device, monkeypatch):
    fn = _FakeJIT()
    args, cx = [torch.zeros(8), torch.zeros(8), 8, 1.0], dict(BLOCK=8, FLAG=False)
    L.launch(fn, (1,), args, cx)
    knobs = getattr(triton, "knobs", None)
    if knobs is not None and hasattr(knobs, "runtime"):
        hook = knobs.runtime.launch_enter_hook
        if hasattr(hook, "add"):  # Triton 3.8: a HookChain, active once a hook is added
            hook.add(_hook)
            try:
                L.launch(fn, (1,), args, cx)
            finally:
                hook.remove(_hook)
        else:
            monkeypatch.setattr(knobs.runtime, "launch_enter_hook", _hook)
            L.launch(fn, (1,), args, cx)
            monkeypatch.setattr(knobs.runtime, "launch_enter_hook", hook)
        assert len(fn.plain) == 2, "a profiler's launch hook must see every launch"
        L.launch(fn, (1,), args, cx)
        assert len(fn.plain) == 2

    def boom(*a):
        raise TypeError("launcher takes other arguments")

    (k,) = fn.compiled.values()
    k.run = boom
    n = len(fn.plain)
    L.launch(fn, (1,), args, cx)  # the direct launch fails: relaunched plainly, fast path off
    assert len(fn.plain) == n + 1 and L.FAST is False


def test_a_call_that_the_plain_launch_rejects_too_keeps_the_direct_path(fake_device, monkeypatch):
    """Bad arguments (the direct launch and the plain one both raise): the caller gets the plain
    launch's error, and later calls still launch directly."""
    fn = _FakeJIT()
    args, cx = [torch.zeros(8), torch.zeros(8), 8, 1.0], dict(BLOCK=8, FLAG=False)
    L.launch(fn, (1,), args, cx)  # compiles (plain)
    (k,) = fn.compiled.values()
    good = k.run

    def bad_args(*a):
        raise ValueError("Pointer argument (at 0) cannot be accessed from Triton (cpu tensor?)")

    def plain_rejects(grid):
        def run(*a, **kw):
            raise ValueError("plain launch: cpu tensor")

        return run

    k.run = bad_args
    with monkeypatch.context() as m:
        m.setattr(_FakeJIT, "__getitem__", lambda self, grid: plain_rejects(grid))
        with pytest.raises(ValueError, match="plain launch"):
            L.launch(fn, (1,), args, cx)
    assert L.FAST is True
    k.run = good
    n, calls = len(fn.plain), len(k.calls)
    L.launch(fn, (1,), args, cx)
    assert len(fn.plain) == n and len(k.calls) == calls + 1, "the next call launched directly"


@pytest.mark.skipif(not CUDA, reason="needs a GPU")
def test_direct_launch_matches_the_plain_launch():
    from mptp_kernels.kernels.reduce import reduce_partials

    dev = "cuda"
    M, K, N, W = 512, 256, 384, 4
    A = randn((M, K), 1, device=dev).bfloat16()
    B = randn((K, N), 2, scale=K**-0.5, device=dev).bfloat16()
    A8 = randn((M, K), 3, device=dev).to(torch.float8_e4m3fn)
    B8 = randn((N, K), 4, scale=K**-0.5, device=dev).to(torch.float8_e4m3fn).t()
    sa, sb = torch.rand(M, device=dev) + 0.5, torch.rand(N, device=dev) + 0.5
    flags = torch.ones(W, dtype=torch.int32, device=dev)
    order = torch.tensor([2, 3, 0, 1], dtype=torch.int32, device=dev)
    P = randn((W, 64, 33), 5, device=dev)
    A_mis = torch.empty(M * K + 8, device=dev, dtype=torch.bfloat16)[1 : 1 + M * K].view(M, K)  # 2 bytes off
    A_mis.copy_(A)

    def scatter():
        dests = [torch.empty(M // W, N, device=dev, dtype=torch.bfloat16) for _ in range(W)]
        pm.persistent_matmul(A, [B], num_chunks=W, order=order, scatter_to=dests)
        return dests

    cases = {
        "bf16 auto": lambda: pm.persistent_matmul(A, [B]),
        "bf16 pointer, 2 Bs": lambda: pm.persistent_matmul(A, [B, B[:, :128]], kernel="pointer"),
        "bf16 misaligned A": lambda: pm.persistent_matmul(A_mis, [B], kernel="pointer"),
        "bf16 consumer tma": lambda: pm.persistent_matmul(A, [B], num_chunks=W, order=order, flags=flags,
                                                          mode=pm.MODE_CONSUMER, kernel="tma"),
        "fp8 row, fp8 out": lambda: pm.persistent_matmul(A8, [B8], A_scale=sa, B_scales=[sb],
                                                         out_dtype=torch.float8_e4m3fn,
                                                         result_scale=torch.tensor(2.0, device=dev)),
        "scatter": scatter,
        "reduce": lambda: [reduce_partials(P, torch.empty(64, 33, device=dev), scale=0.5)],
    }  # fmt: skip
    old = L.FAST
    try:
        for name, fn in cases.items():
            L.FAST = False
            plain = [t.clone() for t in fn()]
            L.FAST = True
            fn()  # the first call of a key goes through the plain launch
            before, plain_before = L.stats["direct"], L.stats["plain"]
            fast = [t.clone() for t in fn()]
            torch.cuda.synchronize()
            # (a consumer launch is followed by its one-program poison check, also launched directly)
            assert L.stats["plain"] == plain_before, f"{name}: a launch went through the plain path"
            assert L.stats["direct"] > before, f"{name}: not launched directly"
            for p, f in zip(plain, fast):
                assert torch.equal(p.view(torch.uint8), f.view(torch.uint8)), f"{name}: direct launch differs"
    finally:
        L.FAST = old


def _same_call(x, y):
    return len(x) == len(y) and all(a is b or (type(a) is int and type(b) is int and a == b) for a, b in zip(x, y))


def _argument_zoo(seed):
    """Every kind of launch argument: ints at each class boundary, floats, bools, None, tensors of
    several dtypes (aligned, misaligned, CPU, 'CUDA'), a float subclass, a tensor descriptor."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    g = torch.Generator().manual_seed(seed)
    buf = torch.zeros(256)
    on_dev = torch.zeros(64).as_subclass(_OnDevice)
    ints = [0, 1, -1, 2, 15, 16, 32, -16, 2**31 - 1, 2**31, -(2**31), -(2**31) - 1, 2**32, 2**62, 2**63 - 1,
            -(2**63)]  # fmt: skip
    tensors = [buf[:64], buf[1:65], buf[4:68], torch.zeros(8, dtype=torch.int32), torch.zeros(8, dtype=torch.bfloat16),
               torch.zeros(8, dtype=torch.float8_e4m3fn), on_dev, on_dev[1:], torch.zeros(0)]  # fmt: skip
    others = [0.5, 1.0, True, False, None, torch.nn.Parameter(torch.zeros(4)), float.__new__(type("F", (float,), {}), 2.0),
              TensorDescriptor.from_tensor(torch.zeros(64, 64, dtype=torch.float16), [32, 16])]  # fmt: skip
    pool = ints + tensors + others
    n = int(torch.randint(1, 48, (1,), generator=g))
    return [pool[int(i)] for i in torch.randint(0, len(pool), (n,), generator=g)]


@pytest.mark.parametrize("seed", range(40))
def test_the_c_binder_computes_what_the_python_one_does(seed, monkeypatch):
    from mptp_kernels.kernels.prepare_c import load

    fast = load()  # NOTE: not skipped where it does not build: CI and the GPU machine have a C compiler
    args = _argument_zoo(seed)
    L._prepare(args)  # numbers any new dtype (the C binder leaves that to Python)
    for ints in (True, False):
        monkeypatch.setattr(L, "INT_POINTERS", ints)
        want = L._prepare(args)
        got = fast(args, torch.Tensor, L._DTYPES, L._extra, ints)
        assert got is not None, "the C binder gave up on arguments it understands"
        assert got[0] == want[0] and got[1] == want[1] and _same_call(got[2], want[2]), (args, got, want)
        assert L._prepare_any(args)[0] == want[0]


def test_the_c_binder_leaves_what_it_does_not_know_to_python(monkeypatch):
    from mptp_kernels.kernels.prepare_c import load

    fast = load()
    t = torch.zeros(4, dtype=torch.complex64)
    L._DTYPES.pop(torch.complex64, None)
    for args in ([2**63], [-(2**63) - 1], [t]):  # beyond int64; a dtype not numbered yet
        assert fast(args, torch.Tensor, L._DTYPES, L._extra, True) is None
        want = L._prepare(args)
        assert L._prepare_any(args)[:2] == want[:2]
    assert fast([t], torch.Tensor, L._DTYPES, L._extra, True) is not None, "numbered by the Python pass"

    bad = torch.zeros(2).as_subclass(_OnDevice)
    monkeypatch.setattr(_OnDevice, "dtype", property(lambda self: (_ for _ in ()).throw(RuntimeError("no dtype"))),
                        raising=False)  # fmt: skip
    assert fast([bad], torch.Tensor, L._DTYPES, L._extra, True) is None  # an error inside: Python decides
    with pytest.raises(RuntimeError, match="no dtype"):
        L._prepare_any([bad])


def _launched_twice(args):
    """A new kernel launched twice with args (the first plainly, the second directly); (fn, its kernel)."""
    fn = _FakeJIT()
    for _ in range(2):
        L.launch(fn, (1,), args, dict(FLAG=True, BLOCK=32))
    (k,) = fn.compiled.values()
    return fn, k


def test_a_launch_without_the_c_binder_binds_in_python(fake_device, monkeypatch):
    import mptp_kernels.kernels.prepare_c as PC

    def no_compiler():
        raise RuntimeError("Failed to find C compiler")

    monkeypatch.setattr(PC, "load", no_compiler)
    monkeypatch.setattr(L, "_C_FN", None)
    dev = torch.zeros(64).as_subclass(_OnDevice)
    fn, k = _launched_twice([dev, dev, 64, 0.5])
    assert k.calls[-1][9:] == (dev.data_ptr(), dev.data_ptr(), 64, 0.5, 32, True)
    assert L._C_FN is False


@pytest.mark.parametrize("mode", ["clear", "grow", "replace"])
def test_the_c_binder_survives_args_changed_while_it_reads_them(mode):
    """A tensor attribute (a subclass, a __torch_function__) may run Python that edits the list."""
    from mptp_kernels.kernels.prepare_c import load

    fast = load()
    args = []

    class Evil(torch.Tensor):
        fired = False

        def data_ptr(self):
            if not Evil.fired:
                Evil.fired = True
                if mode == "clear":
                    args.clear()
                elif mode == "grow":
                    args.extend([0] * 100000)
                else:
                    args[1] = torch.zeros(8, dtype=torch.float16)
            return super().data_ptr()

    L._prepare([torch.zeros(1), torch.zeros(1, dtype=torch.float16)])
    args.append(torch.zeros(64).as_subclass(Evil))
    args += [torch.zeros(64 + i) for i in range(30)]  # referenced by the list only
    first = list(args)
    got = fast(args, torch.Tensor, L._DTYPES, L._extra, False)
    assert got is not None and len(got[2]) == 31
    assert all(a is b for a, b in zip(got[2], first)), "the binder read the arguments as they were at the call"


def test_the_c_binder_lets_keyboard_interrupt_through():
    from mptp_kernels.kernels.prepare_c import load

    class Interrupted(torch.Tensor):
        @property
        def dtype(self):
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        load()([torch.zeros(2).as_subclass(Interrupted)], torch.Tensor, L._DTYPES, L._extra, True)


@pytest.mark.parametrize("c_binder", [True, False])
def test_arguments_made_on_access_reach_the_launcher_as_themselves(fake_device, monkeypatch, c_binder):
    """Fresh views made on access: each one freed after use may give its id to the next one."""
    monkeypatch.setattr(L, "C_PREPARE", c_binder)
    fn = _FakeJIT()
    buf = torch.zeros(4096).as_subclass(_OnDevice)

    for i in range(100):
        L.launch(fn, (1,), _Lazy(i, buf), dict(FLAG=True, BLOCK=32))
    (k,) = fn.compiled.values()
    base = buf.data_ptr()
    for n, call in enumerate(k.calls, start=1):
        i = n  # the first launch (i = 0) went through the plain path
        want = [base + 4 * 16 * ((i + j) % 200) for j in range(2)]
        assert list(call[9:11]) == want, f"launch {i}: wrong addresses"


class _Lazy:
    """A sequence whose tensors are made on access (and freed after): launch must bind each once."""

    def __init__(self, i, buf):
        self.i, self.buf = i, buf

    def __len__(self):
        return 4

    def __getitem__(self, j):
        if j >= 4:
            raise IndexError(j)
        if j < 2:
            o = 16 * ((self.i + j) % 200)
            return self.buf[o : o + 16]
        return (64, 0.5)[j - 2]


def test_a_new_kernel_never_gets_a_freed_kernels_compiled_code(fake_device):
    import gc

    x, y = torch.zeros(64), torch.zeros(64, dtype=torch.float16)
    ids = set()
    for _ in range(50):
        fn = _FakeJIT()
        reused = id(fn) in ids
        for _ in range(2):
            L.launch(fn, (1,), [x, y, 64, 0.5], dict(FLAG=True, BLOCK=32))
        assert len(fn.plain) == 1, "a kernel's first launch is its own (compiles it), even at a reused address"
        assert not reused, "a launched kernel was freed and its id reused"
        ids.add(id(fn))
        del fn
        gc.collect()


def test_a_generator_of_arguments_is_bound_once_whichever_binder_runs(fake_device):
    """2**63 is beyond int64: the C binder gives up and the Python one must still see every argument."""
    fn = _FakeJIT()
    dev = torch.zeros(64).as_subclass(_OnDevice)
    for _ in range(2):
        L.launch(fn, (1,), (a for a in [dev, dev, 2**63, 0.5]), dict(FLAG=True, BLOCK=32))
    (k,) = fn.compiled.values()
    assert k.calls[-1][9:] == (dev.data_ptr(), dev.data_ptr(), 2**63, 0.5, 32, True)


@pytest.mark.parametrize("value, c_binder", [("0", False), ("off", False), ("1", True), ("bogus", True)])
def test_mptp_c_binder_chooses_the_binder_once(fake_device, monkeypatch, value, c_binder):
    monkeypatch.setenv("MPTP_C_BINDER", value)
    monkeypatch.setattr(L, "_C_FN", None)
    dev = torch.zeros(64).as_subclass(_OnDevice)
    fn, k = _launched_twice([dev, dev, 64, 0.5])
    assert k.calls[-1][9:] == (dev.data_ptr(), dev.data_ptr(), 64, 0.5, 32, True), "same arguments either way"
    assert bool(L._C_FN) is c_binder
    monkeypatch.setenv("MPTP_C_BINDER", "1" if value in ("0", "off") else "0")
    L.launch(fn, (1,), [dev, dev, 64, 0.5], dict(FLAG=True, BLOCK=32))
    assert bool(L._C_FN) is c_binder, "read once per process"
