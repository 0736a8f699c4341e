"""One training step (forward + backward) of a Llama-3 70B TP-8 MLP shard: fused styles against DTensor's.

    torchrun --nproc-per-node 8 bench/bench_tp_step.py     # one GPU per process (NCCL): every provider
    torchrun --nproc-per-node 2 bench/bench_tp_step.py     # W processes sharing one GPU (gloo group)

Each rank holds the TP-8 shard of the 70B MLP (dim 8192, hidden 28672 / 8 = 3584 per
rank, bf16, no bias) whatever W is, and tokens / W rows of the sequence-parallel
activations (--tokens, default 8192), so every rank multiplies what a TP-8 rank
multiplies and the gathered activations always have --tokens rows. The step is
down(silu(gate(x)) * up(x)) with gate/up column-parallel and down row-parallel,
then backward from a fixed output gradient, with x requiring grad as a layer
inside a model would. Providers (same weights, same inputs):
  fused_styles    FusedColwiseParallel / FusedRowwiseParallel: torch.ops.mptp forward and backward
  plain           ColumnParallelLinear / RowParallelLinear (no DTensor)
  unfused_styles  the fused styles under MPTP_DISABLE_FUSED=1: the ops' reference path
                  (the collective, then cuBLAS) on the group's transport
  dtensor         DTensor's ColwiseParallel / RowwiseParallel (NCCL only: gloo cannot
                  all-gather CUDA tensors, so it is skipped when ranks share a GPU)
  <name>@compile  the same under torch.compile (--compile)
Timing: warmup, then per iteration a barrier and CUDA events around the step; a
row's median_us is the median over iterations of the slowest rank's time; ratio is
the baseline's time over the provider's (baseline: dtensor where it runs, else
unfused_styles). With ranks sharing one GPU their kernels share it too: compare
providers with each other, not with a TP-8 step on 8 GPUs. Rows are appended to
bench/results/tp_step.csv. Without CUDA it runs on CPU (gloo, fp32, host timing:
a smoke test of the script, e.g. --tokens 64 --dim 64 --hidden 256 --tp 2).
"""

import argparse
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.nn as nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import append_rows, env_columns  # noqa: E402

import mptp_kernels  # noqa: E402
from mptp_kernels.tp import (
    ColumnParallelLinear,
    FusedColwiseParallel,
    FusedRowwiseParallel,
    RowParallelLinear,
)  # noqa: E402


class MLP(nn.Module):
    def __init__(self, gate, up, down):
        super().__init__()
        self.gate, self.up, self.down = gate, up, down

    def forward(self, x):
        return self.down(nn.functional.silu(self.gate(x)) * self.up(x))


def full_mlp(dim, hidden_full, device, dtype, seed=0):
    """The full MLP (identical on every rank); each provider shards it the same way."""
    torch.manual_seed(seed)
    lin = lambda i, o: nn.Linear(i, o, bias=False, device=device, dtype=dtype)  # noqa: E731
    m = MLP(lin(dim, hidden_full), lin(dim, hidden_full), lin(hidden_full, dim))
    with torch.no_grad():
        for p in m.parameters():
            p.normal_(0.0, p.shape[1] ** -0.5)
    return m


def build(provider, full, mesh):
    import copy

    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    m = copy.deepcopy(full)
    if provider == "plain":
        g = mesh.get_group()
        return MLP(ColumnParallelLinear.from_linear(m.gate, group=g, gather_dim=1),
                   ColumnParallelLinear.from_linear(m.up, group=g, gather_dim=1),
                   RowParallelLinear.from_linear(m.down, group=g, scatter_dim=1))  # fmt: skip
    col, row = (
        (ColwiseParallel, RowwiseParallel)
        if provider == "dtensor"
        else (FusedColwiseParallel, FusedRowwiseParallel)
    )
    plan = {
        "gate": col(input_layouts=Shard(1)),
        "up": col(input_layouts=Shard(1)),
        "down": row(output_layouts=Shard(1)),
    }
    return parallelize_module(m, mesh, plan, src_data_rank=None)  # every rank has the full weights


def make_step(model, x, gy, unfused):
    params = list(model.parameters())

    def step():
        prev = os.environ.get("MPTP_DISABLE_FUSED")
        if unfused:
            os.environ["MPTP_DISABLE_FUSED"] = "1"
        try:
            for p in params:
                p.grad = None
            x.grad = None
            model(x).backward(gy)
        finally:
            if unfused:
                if prev is None:
                    os.environ.pop("MPTP_DISABLE_FUSED")
                else:
                    os.environ["MPTP_DISABLE_FUSED"] = prev

    return step


def time_us(step, warmup, iters, cuda):
    for _ in range(warmup):
        step()
    if cuda:
        torch.cuda.synchronize()
    mine = []
    for _ in range(iters):
        dist.barrier()
        if cuda:
            torch.cuda.synchronize()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            step()
            end.record()
            end.synchronize()
            mine.append(start.elapsed_time(end) * 1e3)
        else:
            t0 = time.perf_counter()
            step()
            mine.append((time.perf_counter() - t0) * 1e6)
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    return statistics.median(max(ts) for ts in zip(*every))


def grads_of(model, x):
    out = [x.grad]
    for p in model.parameters():
        g = p.grad
        out.append(g.to_local() if hasattr(g, "to_local") else g)
    return out


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tokens", type=int, default=8192, help="sequence rows gathered (all ranks)")
    p.add_argument("--dim", type=int, default=8192)
    p.add_argument("--hidden", type=int, default=28672, help="the full model's hidden size")
    p.add_argument("--tp", type=int, default=8, help="each rank holds hidden / tp columns")
    p.add_argument("--providers", default="fused_styles,plain,unfused_styles,dtensor")
    p.add_argument(
        "--compile", action="store_true", help="also time torch.compile'd fused_styles and dtensor"
    )
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--no-write", action="store_true")
    a = p.parse_args()

    cuda = torch.cuda.is_available()
    W = int(os.environ.get("WORLD_SIZE", "1"))
    own_gpu = cuda and torch.cuda.device_count() >= W
    dist.init_process_group("nccl" if own_gpu else "gloo")
    rank, W = dist.get_rank(), dist.get_world_size()
    if cuda:
        torch.cuda.set_device(rank % torch.cuda.device_count())
    device, dtype = ("cuda", torch.bfloat16) if cuda else ("cpu", torch.float32)
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh(device, (W,))
    if cuda:
        mptp_kernels.enable_symm_mem_for_group(mesh.get_group().group_name)
    if a.tokens % W or a.hidden % a.tp:
        raise SystemExit(
            f"--tokens {a.tokens} must divide by W={W} and --hidden {a.hidden} by --tp {a.tp}"
        )
    h_local = a.hidden // a.tp
    full = full_mlp(a.dim, h_local * W, device, dtype)
    g = torch.Generator(device=device).manual_seed(7 + rank)
    x = torch.randn(
        1, a.tokens // W, a.dim, device=device, dtype=dtype, generator=g
    ).requires_grad_()
    gy = torch.randn(1, a.tokens // W, a.dim, device=device, dtype=dtype, generator=g)

    providers = [s for s in a.providers.split(",") if s]
    if "dtensor" in providers and cuda and not own_gpu:
        providers.remove("dtensor")
        if rank == 0:
            print(
                "dtensor: skipped (ranks share a GPU: gloo cannot all-gather CUDA tensors)",
                flush=True,
            )
    cases = [(name, name, False) for name in providers]
    if a.compile:
        cases += [(f"{n}@compile", n, True) for n in ("fused_styles", "dtensor") if n in providers]

    times, check = {}, {}
    for label, provider, compiled in cases:
        model = build("fused_styles" if provider == "unfused_styles" else provider, full, mesh)
        fwd = torch.compile(model) if compiled else model
        step = make_step(fwd, x, gy, unfused=provider == "unfused_styles")
        step()
        check[label] = grads_of(model, x)
        times[label] = time_us(step, a.warmup, a.iters, cuda)
        del model, fwd, step
        if cuda:
            torch.cuda.empty_cache()
    # Every provider computes the same gradients (bf16 rounding apart).
    ref = check[cases[0][0]]
    for label, gs in check.items():
        for i, (g0, g1) in enumerate(zip(ref, gs)):
            err = ((g1.float() - g0.float()).norm() / g0.float().norm()).item()
            assert err < 3e-2, f"{label}: gradient {i} differs from {cases[0][0]}'s by {err:.2e}"

    base = (
        "dtensor" if "dtensor" in times else "unfused_styles" if "unfused_styles" in times else None
    )
    flops = 3 * 3 * 2 * a.tokens * a.dim * h_local  # 3 matmuls, forward + 2x backward, per rank
    rows = []
    for label, us in times.items():
        ratio = times[base] / us if base else float("nan")
        rows.append({**env_columns(), "world_size": W, "mode": "gpu-per-rank" if own_gpu else ("shared-gpu" if cuda else "cpu"),
                     "dtype": str(dtype).replace("torch.", ""), "tokens": a.tokens, "dim": a.dim,
                     "hidden": a.hidden, "tp": a.tp, "provider": label, "median_us": round(us, 1),
                     "tflops": round(flops / us / 1e6, 1), "ratio": round(ratio, 3)})  # fmt: skip
    if rank == 0:
        for r in rows:
            print(f"{r['provider']:>22}: {r['median_us']:10.1f} us  {r['tflops']:7.1f} TFLOP/s/rank  "
                  f"x{r['ratio']:.3f} vs {base}", flush=True)  # fmt: skip
        if cuda:
            print(f"paths: {mptp_kernels.path_counts()}", flush=True)
        if not a.no_write:
            print(f"rows appended to {append_rows('tp_step.csv', rows)}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
