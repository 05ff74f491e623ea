"""Zigzag context parallelism in a model titanext did not write.

    torchrun --nproc_per_node 2 examples/context_parallel.py
"""

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

from titanext.plugins.context_parallel import ring_attention_sdpa, shard_batch


class TinyLM(nn.Module):  # calls F.scaled_dot_product_attention itself, GQA with 2 KV heads
    def __init__(self, vocab=64, dim=32, heads=4, kv_heads=2, max_len=64):
        super().__init__()
        self.heads, self.kv_heads, self.hd = heads, kv_heads, dim // heads
        self.emb, self.pos = nn.Embedding(vocab, dim), nn.Embedding(max_len, dim)
        self.qkv = nn.Linear(dim, (heads + 2 * kv_heads) * self.hd)
        self.out, self.head = nn.Linear(dim, dim), nn.Linear(dim, vocab)

    def forward(self, tokens, position_ids):
        b, s = tokens.shape
        x = self.emb(tokens) + self.pos(position_ids)  # positions must be the global ones
        q, k, v = self.qkv(x).view(b, s, -1, self.hd).transpose(1, 2).split(
            [self.heads, self.kv_heads, self.kv_heads], dim=1)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return self.head(x + self.out(y.transpose(1, 2).reshape(b, s, -1)))


dist.init_process_group("gloo")
cp = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("cp",))["cp"]
torch.manual_seed(0)
model = TinyLM()
tokens = torch.randint(0, 64, (2, 64))
labels = tokens.roll(-1, dims=1)

# One process, whole sequence: the reference.
full = F.cross_entropy(model(tokens, torch.arange(64)).flatten(0, 1), labels.flatten())

# Context parallel: each rank keeps chunks r and 2W-1-r of the sequence.
tokens_cp, labels_cp, pos_cp = shard_batch(tokens, labels, cp)
with ring_attention_sdpa(cp):
    logits = model(tokens_cp, pos_cp)
loss = F.cross_entropy(logits.flatten(0, 1), labels_cp.flatten(), reduction="sum")
loss.backward()
dist.all_reduce(loss)  # sum over the CP group, then normalise by the global token count
loss = loss / labels.numel()
for p in model.parameters():  # what FSDP/DDP over the CP ranks would do
    dist.all_reduce(p.grad)
if dist.get_rank() == 0:
    print(f"full-sequence loss {full.item():.6f}  context-parallel loss {loss.item():.6f}")
dist.barrier()
dist.destroy_process_group()
