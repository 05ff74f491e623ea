"""The library example of docs/own_model.md: titanext plugins on your own model.

Run: torchrun --standalone --nproc_per_node 4 examples/own_model.py
"""

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

from titanext.distributed.grad_clip import clip_grad_norm_
from titanext.distributed.parallel_dims import ParallelDims
from titanext.distributed.process_group import init_distributed
from titanext.plugins.activation_checkpoint import apply_activation_checkpointing
from titanext.plugins.fsdp import apply_fsdp
from titanext.plugins.tensor_parallel import apply_tensor_parallel


class Block(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.up, self.down = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)
    def forward(self, x):
        return x + self.down(F.gelu(self.up(x)))

class MyModel(nn.Module):
    def __init__(self, d=64, n=4):
        super().__init__()
        self.body = nn.ModuleList(Block(d) for _ in range(n))
    def forward(self, x):
        for b in self.body:
            x = b(x)
        return x

device = init_distributed()                       # torchrun env -> gloo (CPU) or nccl (CUDA)
dims = ParallelDims(dp_replicate=1, dp_shard=-1, cp=1, tp=2, pp=1, ep=1,
                    world_size=dist.get_world_size())
dims.build_mesh(device.type)
torch.manual_seed(0)
model = MyModel().to(device)
# Your own TP plan: a plain dict from FQN (wildcards allowed) to ParallelStyle.
apply_tensor_parallel(model, dims.tp_mesh,
                      {"body.*.up": ColwiseParallel(), "body.*.down": RowwiseParallel()})
apply_activation_checkpointing(model, mode="full", blocks=model.body)
apply_fsdp(model, dims.fsdp_mesh, blocks=model.body)
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
for step in range(5):
    x = torch.randn(8, 16, 64, device=device)    # each dp rank would load its own shard
    model(x).square().mean().backward()
    norm = clip_grad_norm_(model.parameters(), max_norm=1.0)   # DTensor-aware, any mesh mix
    opt.step()
    opt.zero_grad()
    if dist.get_rank() == 0:
        print(step, norm.item())
dist.barrier()
dist.destroy_process_group()
