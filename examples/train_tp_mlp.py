"""Trains a stack of Llama-style MLP blocks with tensor parallelism, in eager mode, on the fused ops.

    torchrun --nproc-per-node 2 examples/train_tp_mlp.py                    # fused DTensor styles
    torchrun --nproc-per-node 2 examples/train_tp_mlp.py --styles dtensor   # DTensor's own styles
    torchrun --nproc-per-node 2 examples/train_tp_mlp.py --styles plain     # no DTensor
    torchrun --nproc-per-node 2 examples/train_tp_mlp.py --compile

Each block is x + down(silu(gate(x)) * up(x)) with gate/up column-parallel and down
row-parallel, and sequence-parallel activations: every rank holds [batch, seq / W,
dim]. The column-parallel layers all-gather the sequence while multiplying
(fused_all_gather_matmul), the row-parallel layer reduce-scatters it back while
multiplying (fused_matmul_reduce_scatter), and the backward runs the same fused
ops. The two plans differ only in the style names:

    {"gate": ColwiseParallel(input_layouts=Shard(1)),       FusedColwiseParallel(input_layouts=Shard(1))
     "up":   ColwiseParallel(input_layouts=Shard(1)),       FusedColwiseParallel(input_layouts=Shard(1))
     "down": RowwiseParallel(output_layouts=Shard(1))}      FusedRowwiseParallel(output_layouts=Shard(1))

Runs on CPU (gloo, the ops' reference path) and on GPUs: NCCL with one GPU per
process; with fewer GPUs than processes the ranks share a GPU over a gloo group
(the fused path only exchanges handles through it; DTensor's own styles cannot run
there, as gloo does not all-gather CUDA tensors). The task: fit a fixed random
teacher block; the loss printed is the mean over all ranks' tokens.
"""

import argparse
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

import mptp_kernels
from mptp_kernels.tp import (
    ColumnParallelLinear,
    FusedColwiseParallel,
    FusedRowwiseParallel,
    RowParallelLinear,
)


class MLP(nn.Module):
    """Llama's feed-forward block with its residual: x + down(silu(gate(x)) * up(x))."""

    def __init__(self, dim, hidden, dtype=None, device=None):
        super().__init__()
        kw = dict(bias=False, dtype=dtype, device=device)
        self.gate = nn.Linear(dim, hidden, **kw)
        self.up = nn.Linear(dim, hidden, **kw)
        self.down = nn.Linear(hidden, dim, **kw)

    def forward(self, x):
        return x + self.down(nn.functional.silu(self.gate(x)) * self.up(x))


def plan(styles: str, seq_dim: int = 1) -> dict:
    col, row = {"fused": (FusedColwiseParallel, FusedRowwiseParallel),
                "dtensor": (ColwiseParallel, RowwiseParallel)}[styles]  # fmt: skip
    return {
        "gate": col(input_layouts=Shard(seq_dim)),
        "up": col(input_layouts=Shard(seq_dim)),
        "down": row(output_layouts=Shard(seq_dim)),
    }


def to_plain(block: MLP, group, seq_dim: int = 1) -> MLP:
    """The same block with ColumnParallelLinear / RowParallelLinear shards (no DTensor)."""
    block.gate = ColumnParallelLinear.from_linear(block.gate, group=group, gather_dim=seq_dim)
    block.up = ColumnParallelLinear.from_linear(block.up, group=group, gather_dim=seq_dim)
    block.down = RowParallelLinear.from_linear(block.down, group=group, scatter_dim=seq_dim)
    return block


def build(styles, layers, dim, hidden, device, dtype, mesh, seed=0) -> nn.Sequential:
    """The model, from full weights that are identical on every rank (same seed)."""
    torch.manual_seed(seed)
    model = nn.Sequential(*[MLP(dim, hidden, dtype, device) for _ in range(layers)])
    for block in model:
        block.down.weight.data.mul_(0.5)  # residual branches start small
        if styles == "plain":
            to_plain(block, mesh.get_group())
        else:
            try:  # every rank holds the full weights: shard locally, no scatter
                parallelize_module(block, mesh, plan(styles), src_data_rank=None)
            except TypeError:  # torch without src_data_rank
                parallelize_module(block, mesh, plan(styles))
    return model


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--styles", choices=["fused", "dtensor", "plain"], default="fused")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--batch", type=int, default=2)
    # GPU defaults: Llama-3 8B's MLP on 8192 tokens, large enough for the size rule to fuse
    # at W = 2 (smaller problems run the reference path unless MPTP_FORCE_FUSED=1).
    p.add_argument("--seq", type=int, default=None, help="default 4096 on GPU, 64 on CPU")
    p.add_argument("--dim", type=int, default=None, help="default 4096 on GPU, 64 on CPU")
    p.add_argument("--hidden", type=int, default=None, help="default 14336 on GPU, 4 * dim on CPU")
    p.add_argument("--lr", type=float, default=1e-3, help="AdamW learning rate")
    p.add_argument("--compile", action="store_true", help="torch.compile the model")
    a = p.parse_args()

    cuda = torch.cuda.is_available()
    W = int(os.environ.get("WORLD_SIZE", "1"))
    own_gpu = cuda and torch.cuda.device_count() >= W
    dist.init_process_group("nccl" if own_gpu else "gloo")
    rank, W = dist.get_rank(), dist.get_world_size()
    if cuda:
        torch.cuda.set_device(rank % torch.cuda.device_count())
    if a.styles == "dtensor" and cuda and not own_gpu:
        raise SystemExit(
            "--styles dtensor needs one GPU per process (NCCL): gloo does not all-gather CUDA tensors"
        )
    device, dtype = ("cuda", torch.bfloat16) if cuda else ("cpu", torch.float32)
    seq, dim = a.seq or (4096 if cuda else 64), a.dim or (4096 if cuda else 64)
    hidden, lr = a.hidden or (14336 if cuda else 4 * dim), a.lr
    mesh = init_device_mesh(device, (W,))
    if cuda:
        mptp_kernels.enable_symm_mem_for_group(mesh.get_group().group_name)

    model = build(a.styles, a.layers, dim, hidden, device, dtype, mesh)
    teacher = build("plain", 1, dim, hidden, device, dtype, mesh, seed=1)  # a fixed target function
    if a.compile:
        model = torch.compile(model)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    if rank == 0:
        print(f"W={W} {device} {dtype} styles={a.styles} compile={a.compile} layers={a.layers} "
              f"batch={a.batch} seq={seq} dim={dim} hidden={hidden}", flush=True)  # fmt: skip

    g = torch.Generator(device=device).manual_seed(1234 + rank)  # each rank its own tokens
    t0 = time.perf_counter()
    for step in range(a.steps):
        x = torch.randn(a.batch, seq // W, dim, device=device, dtype=dtype, generator=g)
        with torch.no_grad():
            target = teacher(x)
        y = model(x)
        # this rank's share of the mean over all W * batch * seq/W tokens
        loss = (y.float() - target.float()).square().sum() / (W * y.numel())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        total = loss.detach().to("cuda" if own_gpu else "cpu")
        dist.all_reduce(total)
        if rank == 0 and (step % 5 == 0 or step == a.steps - 1):
            print(f"step {step:3d}  loss {total.item():.5f}", flush=True)
    if cuda:
        torch.cuda.synchronize()
    if rank == 0:
        print(f"{a.steps} steps in {time.perf_counter() - t0:.2f} s", flush=True)
        if cuda:
            print(f"paths: {mptp_kernels.path_counts()}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
