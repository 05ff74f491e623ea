"""Ring, Ulysses and hybrid context parallelism with packed documents, in your own attention code.

    torchrun --nproc_per_node 4 examples/context_parallel_attention.py

Every rank holds a zigzag shard of q, k, v and of the document ids; each variant's output and
q/k/v gradients are compared with one process running masked SDPA on the whole sequence.
"""

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh

from titanext.plugins.context_parallel import (
    hybrid_attention,
    ring_attention,
    shard_sequence,
    ulysses_attention,
)

dist.init_process_group("gloo")
world = dist.get_world_size()  # 4: hybrid runs as 2 (ring) x 2 (Ulysses)
cp = init_device_mesh("cpu", (world,), mesh_dim_names=("cp",))["cp"]
torch.manual_seed(0)
batch, heads, kv_heads, seq, head_dim = 2, 8, 2, 64, 16
q_full = torch.randn(batch, heads, seq, head_dim)
k_full, v_full = (torch.randn(batch, kv_heads, seq, head_dim) for _ in range(2))
# Packed rows: documents of 1, 5, 30 and 28 tokens (a new id at every document start).
doc_full = torch.repeat_interleave(torch.arange(4), torch.tensor([1, 5, 30, 28])).expand(batch, -1)

# The reference: one process, whole sequence, causal within each document.
q, k, v = (t.clone().requires_grad_() for t in (q_full, k_full, v_full))
causal = torch.ones(seq, seq, dtype=torch.bool).tril()
mask = (doc_full[:, :, None] == doc_full[:, None, :]) & causal  # [batch, seq, seq]
ref = F.scaled_dot_product_attention(q, k, v, attn_mask=mask[:, None], enable_gqa=True)
ref.sum().backward()
ref = ref.detach()
ref_grads = [t.grad for t in (q, k, v)]


def run(name, attention, mesh):
    """Shard in zigzag order over all CP ranks, attend, compare this rank's slice."""
    q, k, v = (shard_sequence(t, 2, mesh).clone().requires_grad_() for t in (q_full, k_full,
                                                                             v_full))
    out = attention(q, k, v, document_ids=shard_sequence(doc_full, 1, mesh))
    out.sum().backward()
    pairs = [(out, shard_sequence(ref, 2, mesh))]
    pairs += [(t.grad, shard_sequence(g, 2, mesh)) for t, g in zip((q, k, v), ref_grads)]
    errors = [(got - want).abs().max() / want.abs().max() for got, want in pairs]
    worst = torch.stack(errors).max()
    dist.all_reduce(worst, op=dist.ReduceOp.MAX)
    if dist.get_rank() == 0:
        print(f"{name}: max relative error of out, dq, dk, dv {worst.item():.1e}")


run("ring", lambda q, k, v, **kw: ring_attention(q, k, v, cp, **kw), cp)
run("ulysses", lambda q, k, v, **kw: ulysses_attention(q, k, v, cp, **kw), cp)  # 2 kv heads
if world == 4:  # replicated to the 4 ranks; hybrid: Ulysses in pairs, the ring across them
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("cp_ring", "cp_ulysses"))
    run("hybrid 2x2", lambda q, k, v, **kw: hybrid_attention(
        q, k, v, mesh["cp_ulysses"], mesh["cp_ring"], **kw), mesh)
dist.barrier()
dist.destroy_process_group()
