"""Shared benchmark utilities: timing, environment columns, CSV rows."""

import csv
import datetime
import math
import os
import subprocess

import torch

# MPTP_RESULTS_DIR redirects the CSVs (the device script points it at $OUT so a cut-off run keeps its rows).
RESULTS = os.environ.get("MPTP_RESULTS_DIR") or os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")

# Per-rank TP-8 (N, K) of Llama-3: 70B then 8B.
LLAMA_TP8_NK = [(7168, 8192), (8192, 3584), (1280, 8192), (3584, 4096), (4096, 1792), (768, 4096)]


def env_columns() -> dict:
    import triton

    # The device machine's copy of the tree may carry a stale .git: the caller's value wins.
    commit = os.environ.get("MPTP_BENCH_COMMIT")
    if not commit:
        try:
            commit = subprocess.check_output(["git", "rev-parse", "--short", "HEAD"], text=True,
                                             stderr=subprocess.DEVNULL).strip()  # fmt: skip
        except Exception:  # noqa: BLE001 - no git at all
            commit = "unknown"
    return {
        "date": datetime.date.today().isoformat(),
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        "torch": torch.__version__,
        "triton": triton.__version__,
        "commit": commit,
    }


def bench_us(fn, warmup_ms=25, rep_ms=100) -> float:
    """Median time of fn in microseconds (triton.testing.do_bench, CUDA events)."""
    import triton.testing

    return triton.testing.do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="median") * 1e3


def append_rows(name: str, rows: list) -> str:
    """Appends rows to results/<name>; a column the file lacks is added (empty in older rows)."""
    path = os.path.join(RESULTS, name)
    os.makedirs(RESULTS, exist_ok=True)
    fields = list(dict.fromkeys(k for r in rows for k in r))
    if os.path.exists(path):
        with open(path, newline="") as f:
            reader = csv.DictReader(f)
            header, old = list(reader.fieldnames or []), list(reader)
        if set(fields) - set(header):
            header += [k for k in fields if k not in header]
            with open(path, "w", newline="") as f:
                w = csv.DictWriter(f, fieldnames=header)
                w.writeheader()
                w.writerows(old)
        fields = header
    new = not os.path.exists(path)
    with open(path, "a", newline="") as f:
        w = csv.DictWriter(f, fieldnames=fields, restval="")
        if new:
            w.writeheader()
        w.writerows(rows)
    return path


def geomean(xs) -> float:
    xs = [x for x in xs if x > 0]
    return math.exp(sum(math.log(x) for x in xs) / len(xs)) if xs else float("nan")


def run_cases(csv_name, cases, make_fns, columns, summarize, out_dir=None, write=True):
    """Times every provider of every case; appends one CSV row per (case, provider).

    cases: iterable of dicts (the case's own columns); make_fns(case) -> {provider: fn}, or
    ({provider: fn}, {column: value}) to add columns the case learns when it is set up (e.g.
    the path an op took); summarize(case, times) -> the line printed for the case.
    """
    rows = []
    for case in cases:
        made = make_fns(case)
        fns, extra = made if isinstance(made, tuple) else (made, {})
        times = {name: bench_us(fn) for name, fn in fns.items()}
        new = [{**columns, **case, **extra, "provider": name, "median_us": round(us, 2)} for name, us in times.items()]
        rows += new
        print(summarize({**case, **extra}, times), flush=True)
        if write:  # NOTE: per case, so a case that raises keeps the rows of the cases before it
            path = append_rows(csv_name, new)
            if out_dir and os.path.abspath(out_dir) != os.path.abspath(RESULTS):
                import shutil

                shutil.copy(path, os.path.join(out_dir, csv_name))
    return rows


def op_path(fn, op: str) -> str:
    """Calls fn once (a torch.ops.mptp.<op> call on CUDA tensors) and returns the path it took,
    "fused" or "reference", from mptp_kernels.path_counts()."""
    import mptp_kernels

    before = mptp_kernels.path_counts()
    fn()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    took = {p for (o, p), n in mptp_kernels.path_counts().items() if o == op and n > before.get((o, p), 0)}
    return "+".join(sorted(took)) or "unknown"


def parse_fused_args(extra=()):
    """Arguments shared by the fused-op benchmarks. Returns (args, W, group_name): NCCL in real
    mode, a loopback group of W simulated ranks in loopback-op mode, no group in loopback mode.

    Modes: loopback     the fused pipeline assembled by hand on one GPU (not the op)
           loopback-op  torch.ops.mptp.* end to end on a loopback group (one GPU, one process)
           real         torch.ops.mptp.* on one process per GPU (torchrun)
    """
    import argparse

    p = argparse.ArgumentParser()
    p.add_argument("--mode", choices=["loopback", "loopback-op", "real"], default="loopback")
    p.add_argument("--world-size", type=int, default=8, help="simulated ranks (loopback)")
    p.add_argument("--Ms", default="4096,8192,16384")
    p.add_argument("--out", default=None)
    for flag, kw in extra:
        p.add_argument(flag, **kw)
    a = p.parse_args()
    if a.mode == "real":
        import torch.distributed as dist

        import mptp_kernels

        dist.init_process_group("nccl")
        torch.cuda.set_device(dist.get_rank() % torch.cuda.device_count())
        mptp_kernels.enable_symm_mem_for_group(dist.group.WORLD.group_name)
        return a, dist.get_world_size(), dist.group.WORLD.group_name
    if a.mode == "loopback-op":
        from mptp_kernels.symm.loopback import init_loopback_group

        return a, a.world_size, init_loopback_group(a.world_size)
    return a, a.world_size, None


def add_symm_mem(fns, name, group_name):
    """Adds PyTorch's torch.ops.symm_mem.<name> as a provider where it runs."""
    try:
        import torch.distributed._symmetric_memory as symm_mem

        symm_mem.enable_symm_mem_for_group(group_name)
        fn = fns["mptp_args"]
        op = getattr(torch.ops.symm_mem, name)
        fns["symm_mem"] = lambda: op(*fn)
        fns["symm_mem"]()
    except Exception as e:  # noqa: BLE001 - report and go on without it
        print(f"torch.ops.symm_mem.{name} unavailable: {type(e).__name__}: {e}")
        fns.pop("symm_mem", None)
    fns.pop("mptp_args", None)
    return fns


def with_env(env: dict, fn):
    """fn with os.environ updated by env for each call (the ops read MPTP_* at every call),
    restored after it."""

    def run():
        old = {k: os.environ.get(k) for k in env}
        os.environ.update(env)
        try:
            return fn()
        finally:
            for k, v in old.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v

    return run


def with_setting(module, name: str, value, fn):
    """fn with module.name set to value while it runs, restored after it (a CUDA graph captured
    from it keeps what that setting launched)."""

    def run():
        old = getattr(module, name)
        setattr(module, name, value)
        try:
            return fn()
        finally:
            setattr(module, name, old)

    return run


def with_graphs(fns: dict) -> dict:
    """Adds '<name>@graph' for each provider: the same work captured in a CUDA graph and replayed,
    which removes host launch overhead and leaves what the GPU does."""
    out = dict(fns)
    for name, fn in fns.items():
        try:
            fn()
            torch.cuda.synchronize()
            s = torch.cuda.Stream()
            s.wait_stream(torch.cuda.current_stream())
            g = torch.cuda.CUDAGraph()
            with torch.cuda.stream(s), torch.cuda.graph(g, stream=s):
                fn()
            torch.cuda.synchronize()
            out[f"{name}@graph"] = g.replay
        except Exception as e:  # noqa: BLE001 - report, keep the eager number
            print(f"{name}: no graph timing ({type(e).__name__}: {e})")
    return out


def loopback_summary(t: dict) -> str:
    """One line per timing kind ('@graph', eager) of a loopback case's provider times."""
    parts = []
    for sfx in ("@graph", ""):
        if f"mptp{sfx}" not in t:
            continue
        mptp, unfused = t[f"mptp{sfx}"], t[f"copy_cublas{sfx}"]
        bound = max(t[f"matmul_only{sfx}"], t[f"comm_only{sfx}"])
        parts.append(f"{sfx or '@eager'}: mptp {mptp:7.1f}us matmul {t[f'matmul_only{sfx}']:7.1f} "
                     f"comm {t[f'comm_only{sfx}']:6.1f} copy+cublas {unfused:7.1f} "
                     f"vs max {100 * (mptp / bound - 1):+5.1f}% speedup {unfused / mptp:.3f}"
                     + (f" reduction {t[f'reduce_only{sfx}']:6.1f}" if f"reduce_only{sfx}" in t else ""))  # fmt: skip
    return " | ".join(parts)
