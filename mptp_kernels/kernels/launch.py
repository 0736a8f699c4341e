"""Launching a Triton kernel with less host time than JITFunction.run (issue 14).

JITFunction.run binds and specializes every argument, builds and hashes a cache key and looks
the kernel up on every call: tens of microseconds for our 40-50 arguments (measured on a CPU
host: its binder alone 27 us for the pointer kernel's 43 arguments). launch() keys its own
cache on a cheap superset of Triton's specialization -- per argument one byte: tensor dtype and
16-byte alignment; int ==1, %16 and 32/64-bit range; plus, for tensor descriptors, dtype, block
shape and base alignment -- with the device, the constexprs and the launch options, and calls
the CompiledKernel's launcher directly. Being a superset, the key never maps a call to a kernel specialized for
other arguments; it may only compile-cache a little more.

NOTE: the plain launch (fn[grid](...)) is used for the first call of each key (it compiles, or
finds, and returns the kernel), under the interpreter, while a launch hook is installed
(profilers), and for good once a direct launch fails where the plain one then succeeds (this
Triton's launcher takes other arguments: FAST = False, logged once; a call both reject is the
caller's error, raised as the plain launch raises it, and the direct path stays).
The launcher's calling convention (grid, stream, function, packed metadata, launch metadata,
hooks, every bound argument including constexprs) is the one of Triton 3.3 to 3.8.
"""

from typing import Dict, Sequence

import torch
import triton

from .epilogue import interpreting

FAST = True
# CUDA tensors reach the launcher as their addresses (see _prepare); False: as tensors (profile_host.py compares).
INT_POINTERS = True
# _prepare in C (prepare_c.py) where it compiles; False: the Python loop (profile_host.py compares).
C_PREPARE = True
_C_FN = None  # the compiled function; False once it failed to build
stats = {"direct": 0, "plain": 0}
_KERNELS: Dict[tuple, object] = {}
_NAMES: Dict[tuple, tuple] = {}  # (id(fn), number of args) -> (fn, names of its constexprs)
_I32 = (-(2**31), 2**31)


_DTYPES: Dict[torch.dtype, int] = {}
_EXTRA = 255  # the code of an argument described in the key's side tuple instead


def _code(a) -> int:
    """One byte per argument: the part of it that can change the compiled kernel."""
    t = type(a)
    if t is int:  # bits: 1 == 1, 2 % 16 == 0, 4 fits int32, 8 needs uint64; 16 marks ints
        return 16 | (a == 1) | ((a & 15 == 0) << 1) | ((-2147483648 <= a < 2147483648) << 2) | ((a >= 2**63) << 3)
    if t is torch.Tensor or isinstance(a, torch.Tensor):  # 128 + 2 * dtype index + aligned
        d = _DTYPES.get(a.dtype)
        if d is None:
            d = _DTYPES[a.dtype] = len(_DTYPES)
        return 128 | (d << 1) | (a.data_ptr() & 15 == 0) if d < 63 else _EXTRA
    if t is float:
        return 32
    if t is bool:
        return 33 + a
    return _EXTRA


def _extra(a):
    base = getattr(a, "base", None)
    if base is not None and hasattr(a, "block_shape"):  # a host TensorDescriptor
        return (a.__class__, base.dtype, base.data_ptr() & 15 == 0, tuple(a.block_shape), getattr(a, "padding", None))
    if isinstance(a, torch.Tensor):
        return (a.dtype, a.data_ptr() & 15 == 0)
    return (a.__class__, a)


def _prepare(args):
    """(codes, extras, call): the launch key's two parts -- a superset of Triton's specialization
    of args: a byte per argument, plus what a byte cannot say -- and the arguments as the
    launcher gets them.

    In call, a CUDA tensor is its device address (an int): Triton's launcher takes an int as the
    pointer as is, where a tensor costs it a data_ptr() call and a driver query
    (cuPointerGetAttribute) per argument -- which for a device allocation returns the same
    address. Any other object (a CPU tensor, a tensor descriptor) is passed unchanged.
    """
    seen = {}  # NOTE: padding, scatter slots and dummies repeat a few tensors many times
    codes = bytearray()
    call = []
    extras = []
    put, code = call.append, codes.append
    Tensor, ints = torch.Tensor, INT_POINTERS
    for a in args:
        t = type(a)
        if t is int:
            code(16 | (a == 1) | ((a & 15 == 0) << 1) | ((-2147483648 <= a < 2147483648) << 2) | ((a >= 2**63) << 3))
            put(a)
            continue
        hit = seen.get(id(a))
        if hit is None:
            if t is Tensor or isinstance(a, Tensor):
                d = _DTYPES.get(a.dtype)
                if d is None:
                    d = _DTYPES[a.dtype] = len(_DTYPES)
                p = a.data_ptr()
                c = (128 | (d << 1) | (p & 15 == 0)) if d < 63 else _EXTRA
                hit = seen[id(a)] = (c, p if ints and a.is_cuda else a, _extra(a) if c == _EXTRA else None)
            else:
                c = _code(a)
                hit = seen[id(a)] = (c, a, _extra(a) if c == _EXTRA else None)
        code(hit[0])
        put(hit[1])
        if hit[0] == _EXTRA:
            extras.append(hit[2])
    return bytes(codes), tuple(extras), call


def _prepare_any(args):
    """_prepare, by the C function where it is built and understands every argument.

    args: a list or tuple (launch makes one of anything else: a generator would be consumed by
    the first binder, and objects made on access could be freed and their ids reused)."""
    global _C_FN
    if C_PREPARE:
        f = _C_FN
        if f is None:
            from .. import env

            try:
                wanted = env.c_binder_enabled()
            except ValueError as e:  # a bad value is not worth failing a launch for: the default
                env.log_once(("c_binder_env",), "kernels.launch: %s; using the C binder", e)
                wanted = True
            try:
                from .prepare_c import load

                f = load() if wanted else False
            except Exception as e:  # noqa: BLE001 - no compiler or headers: the Python loop
                env.log_once(("c_prepare", type(e).__name__), "kernels.launch: C argument binder unavailable "
                             "(%s: %s); binding in Python", type(e).__name__, e)  # fmt: skip
                f = False
            _C_FN = f
        if f:
            r = f(args, torch.Tensor, _DTYPES, _extra, INT_POINTERS)
            if r is not None:
                return r
    return _prepare(args)


def _active(hook) -> bool:
    # Triton 3.8 always has a HookChain there (active once something is added); older: None or a callable.
    return hook is not None and (not hasattr(hook, "calls") or len(hook.calls) > 0)


def _hooks() -> bool:
    rt = getattr(getattr(triton, "knobs", None), "runtime", None)
    return _active(getattr(rt, "launch_enter_hook", None)) or _active(getattr(rt, "launch_exit_hook", None))


def launch(fn, grid: Sequence[int], args: Sequence, constexprs: dict, **options) -> None:
    """fn[grid](*args, **constexprs, **options), with less host time (options: num_warps, ...).

    args are fn's leading (non-constexpr) parameters in order; constexprs its remaining ones.
    Like the plain launch, it runs on the current device's current stream.
    """
    launch_static(fn, grid, args, constexprs, options, None)


_STATIC: Dict[tuple, tuple] = {}  # (id(fn), static key) -> (constexpr values, the key's static part)


def launch_static(fn, grid: Sequence[int], args: Sequence, constexprs: dict, options: dict, static=None):
    """launch(fn, grid, args, constexprs, **options); static: None, or a hashable value that
    the caller guarantees determines constexprs, options and len(args) for this fn (a launch
    plan's key): their values and the key's part made of them are then looked up, not rebuilt.
    Returns what a direct launch gave the launcher -- (compiled kernel, grid as 3 ints, bound
    arguments, constexpr values, device index) -- or None after a plain launch.
    """
    global FAST
    if args.__class__ is not list and args.__class__ is not tuple:
        args = tuple(args)
    # NOTE: keyed on id(fn) (hashing a JITFunction hashes its source key). _NAMES holds every fn
    # launched here, so none is ever freed and its id reused by another kernel (_KERNELS's keys).
    hit = _NAMES.get((id(fn), len(args)))
    if hit is None:
        jit = isinstance(fn, triton.runtime.jit.JITFunction) and not interpreting()
        hit = _NAMES[(id(fn), len(args))] = (fn, tuple(fn.arg_names[len(args) :]) if jit else None)
    names = hit[1]
    if names is None or not FAST or _hooks():
        stats["plain"] += 1
        fn[grid](*args, **constexprs, **options)
        return
    device_index = torch.cuda.current_device()
    try:
        fixed = _STATIC.get((id(fn), static)) if static is not None else None
        if fixed is None:
            cvals = tuple(constexprs[n] for n in names)  # in parameter order: part of the key, and of the call
            if len(cvals) != len(constexprs):
                raise TypeError("constexprs do not match the kernel's trailing parameters")
            fixed = (cvals, (tuple(options.items()), len(args), cvals))
            if static is not None:
                if len(_STATIC) >= 4096:
                    _STATIC.clear()
                _STATIC[(id(fn), static)] = fixed
        cvals = fixed[0]
        codes, extras, call = _prepare_any(args)
        key = (id(fn), device_index, fixed[1], codes, extras)
        kernel = _KERNELS.get(key)
    except (TypeError, KeyError):  # unhashable or unexpected arguments: nothing to cache
        kernel, key = None, None
    if kernel is None:
        stats["plain"] += 1
        kernel = fn[grid](*args, **constexprs, **options)
        if key is not None and kernel is not None and hasattr(kernel, "packed_metadata"):
            _KERNELS[key] = kernel
        return
    try:
        run = kernel.run  # loads the module on first use
        stream = torch._C._cuda_getCurrentRawStream(device_index)
        g1 = grid[1] if len(grid) > 1 else 1
        g2 = grid[2] if len(grid) > 2 else 1
        run(grid[0], g1, g2, stream, kernel.function, kernel.packed_metadata, None, None, None, *call, *cvals)
        stats["direct"] += 1
        return kernel, (grid[0], g1, g2), call, cvals, device_index
    except Exception as e:  # noqa: BLE001 - see below
        # NOTE: the plain launch decides whose fault it was. If it raises too, the arguments are
        # bad (a CPU tensor, say): the caller gets Triton's own error and the direct path stays
        # (one bad call must not cost every later launch its host time, nor the launch memo its
        # records). If it succeeds, this Triton's launcher takes other arguments: fall back for good.
        stats["plain"] += 1
        fn[grid](*args, **constexprs, **options)
        FAST = False
        from .. import env

        env.log_once(("fast_launch", type(e).__name__), "kernels.launch: direct launch failed (%s: %s); "
                     "using Triton's launch from now on", type(e).__name__, e)  # fmt: skip
