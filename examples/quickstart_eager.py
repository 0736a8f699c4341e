"""The README's eager quickstart, runnable: torchrun --nproc-per-node 2 examples/quickstart_eager.py

One process per GPU uses NCCL; with fewer GPUs than processes the ranks share
a GPU and the group is gloo (symmetric memory works either way: its handles
go over the process group, the data never does). Without a GPU it runs on the
CPU over gloo, at a smaller size (the ops take their reference path). Prints
which path each op took and the error against the unfused computation.
"""

import torch
import torch.distributed as dist

import mptp_kernels

W = int(__import__("os").environ.get("WORLD_SIZE", "1"))
GPUS = torch.cuda.device_count()
dist.init_process_group("nccl" if GPUS >= W else "gloo")
rank = dist.get_rank()
if GPUS:
    torch.cuda.set_device(rank % GPUS)
DEV, D, H = ("cuda", 8192, 3584) if GPUS else ("cpu", 512, 256)  # (device, model dim, hidden)
group = dist.group.WORLD
mptp_kernels.enable_symm_mem_for_group(group.group_name)
torch.manual_seed(rank)

# column-parallel: gather the sequence-sharded activations, multiply by this rank's weight slices
x = torch.randn(D // W, D, device=DEV, dtype=torch.bfloat16)
w_up = torch.randn(D, H, device=DEV, dtype=torch.bfloat16) / D**0.5
w_gate = torch.randn(D, H, device=DEV, dtype=torch.bfloat16) / D**0.5
x_full, (up, gate) = mptp_kernels.fused_all_gather_matmul(x, [w_up, w_gate], gather_dim=0, group=group)

# row-parallel: multiply, then reduce-scatter the partial sums
w_down = torch.randn(H, D, device=DEV, dtype=torch.bfloat16) / H**0.5
y = mptp_kernels.fused_matmul_reduce_scatter(up, w_down, "sum", scatter_dim=0, group=group)

# or through the dispatcher, exactly like torch.ops.symm_mem
_, (up_op,) = torch.ops.mptp.fused_all_gather_matmul(x, [w_up], 0, group.group_name)

# the same math, unfused (gather on the CPU: gloo does not move CUDA tensors)
parts = [torch.empty_like(x, device="cpu") for _ in range(W)]
dist.all_gather(parts, x.cpu())
ref_full = torch.cat(parts).to(DEV)
ref_up = (ref_full.float() @ w_up.float()).bfloat16()
partial = (up.float() @ w_down.float()).cpu()
dist.all_reduce(partial)
ref_y = partial[rank * (D // W) : (rank + 1) * (D // W)].to(DEV)


def rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


print(f"rank {rank}: gathered A equal: {torch.equal(x_full, ref_full)}, up rel err {rel(up, ref_up):.2e}, "
      f"y rel err {rel(y, ref_y):.2e}, torch.ops up rel err {rel(up_op, ref_up):.2e}, paths {mptp_kernels.path_counts() if GPUS else 'reference (CPU tensors)'}",
      flush=True)  # fmt: skip
dist.destroy_process_group()
