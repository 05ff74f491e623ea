"""Zigzag context parallelism in models titanext did not write, checked against one process.

    torchrun --nproc_per_node 2 examples/context_parallel.py

Two models, both calling ``F.scaled_dot_product_attention`` themselves (GQA, 2 KV heads):

- ``TinyLM`` takes ``position_ids``: pass it the global positions ``shard_batch`` returns;
- ``RotaryLM``'s rotary tables take no positions argument (``cos[:seq]``, as many libraries
  write it): index its tables by the rank's global positions once, before training.

Each run asserts that the CP loss and every gradient match the full sequence on one process,
and that ``RotaryLM`` *without* that indexing is wrong (loss close, gradients off): the trap.
"""

import copy

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

from titanext.plugins.context_parallel import ring_attention_sdpa, shard_batch

VOCAB, SEQ, DIM, HEADS, KV_HEADS = 64, 64, 32, 4, 2


class TinyLM(nn.Module):  # a learned position embedding, indexed by the positions it is given
    def __init__(self):
        super().__init__()
        self.hd = DIM // HEADS
        self.emb, self.pos = nn.Embedding(VOCAB, DIM), nn.Embedding(SEQ, DIM)
        self.qkv = nn.Linear(DIM, (HEADS + 2 * KV_HEADS) * self.hd)
        self.out, self.head = nn.Linear(DIM, DIM), nn.Linear(DIM, VOCAB)

    def forward(self, tokens, position_ids):
        b, s = tokens.shape
        x = self.emb(tokens) + self.pos(position_ids)  # positions must be the global ones
        q, k, v = self.qkv(x).view(b, s, -1, self.hd).transpose(1, 2).split(
            [HEADS, KV_HEADS, KV_HEADS], dim=1)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return self.head(x + self.out(y.transpose(1, 2).reshape(b, s, -1)))


class Rotary(nn.Module):  # tables for positions 0..max_len-1; forward takes no positions
    def __init__(self, head_dim, max_len=SEQ):
        super().__init__()
        freqs = 1.0 / 10000 ** (torch.arange(0, head_dim, 2).float() / head_dim)
        angles = torch.outer(torch.arange(max_len).float(), freqs)  # [max_len, head_dim / 2]
        self.register_buffer("cos", angles.cos(), persistent=False)
        self.register_buffer("sin", angles.sin(), persistent=False)

    def forward(self, x):  # x [batch, heads, seq, head_dim]: rows 0..seq-1 of the tables
        cos, sin = self.cos[: x.shape[2]], self.sin[: x.shape[2]]
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)


class RotaryLM(TinyLM):
    def __init__(self):
        super().__init__()
        del self.pos
        self.rotary = Rotary(self.hd)

    def forward(self, tokens):
        b, s = tokens.shape
        x = self.emb(tokens)
        q, k, v = self.qkv(x).view(b, s, -1, self.hd).transpose(1, 2).split(
            [HEADS, KV_HEADS, KV_HEADS], dim=1)
        q, k = self.rotary(q), self.rotary(k)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return self.head(x + self.out(y.transpose(1, 2).reshape(b, s, -1)))


def use_global_positions(rotary: Rotary, positions: torch.Tensor) -> None:
    """The CP wiring of a rotary without a positions argument: row i of its tables becomes
    the row of this rank's i-th token, so ``cos[:local_seq]`` is right on every rank."""
    rotary.cos, rotary.sin = rotary.cos[positions], rotary.sin[positions]


def worst_grad_error(model, ref_grads, cp_group):
    """Largest relative gradient error over the parameters (CP grads summed over the group)."""
    errs = []
    for p, ref in zip(model.parameters(), ref_grads, strict=True):
        grad = p.grad.clone()
        dist.all_reduce(grad, group=cp_group)  # what FSDP / DDP over the CP ranks would do
        errs.append(((grad - ref).norm() / ref.norm()).item())
    return max(errs)


def run(model, tokens, labels, cp, *, positions_arg, wire_rotary=False):
    """(full-sequence loss, CP loss, worst gradient error) of ``model`` on one batch."""
    pos_full = torch.arange(SEQ)
    logits = model(tokens, pos_full) if positions_arg else model(tokens)
    full = F.cross_entropy(logits.flatten(0, 1), labels.flatten())
    ref_grads = torch.autograd.grad(full, list(model.parameters()))

    cp_model = copy.deepcopy(model)
    tokens_cp, labels_cp, pos_cp = shard_batch(tokens, labels, cp)  # zigzag: chunks r, 2W-1-r
    if wire_rotary:
        use_global_positions(cp_model.rotary, pos_cp)
    with ring_attention_sdpa(cp):
        logits = cp_model(tokens_cp, pos_cp) if positions_arg else cp_model(tokens_cp)
        loss = F.cross_entropy(logits.flatten(0, 1), labels_cp.flatten(), reduction="sum")
        (loss / labels.numel()).backward()  # normalised once, by the global token count
    loss = loss.detach()
    dist.all_reduce(loss, group=cp.get_group())
    return full.item(), loss.item() / labels.numel(), worst_grad_error(cp_model, ref_grads,
                                                                         cp.get_group())


def main():
    dist.init_process_group("gloo")
    cp = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("cp",))["cp"]
    torch.manual_seed(0)
    tokens = torch.randint(0, VOCAB, (2, SEQ))
    labels = tokens.roll(-1, dims=1)
    rank0 = dist.get_rank() == 0

    full, cp_loss, grad_err = run(TinyLM(), tokens, labels, cp, positions_arg=True)
    if rank0:
        print(f"full-sequence loss {full:.6f}  context-parallel loss {cp_loss:.6f}  "
              f"worst grad error {grad_err:.1e}")
    assert abs(full - cp_loss) <= 1e-5 * abs(full) and grad_err < 1e-5, (full, cp_loss, grad_err)

    torch.manual_seed(1)
    rotary = RotaryLM()
    full, cp_loss, grad_err = run(rotary, tokens, labels, cp, positions_arg=False,
                                  wire_rotary=True)
    if rank0:
        print(f"rotary, tables indexed by positions: loss {full:.6f} vs {cp_loss:.6f}  "
              f"worst grad error {grad_err:.1e}")
    assert abs(full - cp_loss) <= 1e-5 * abs(full) and grad_err < 1e-5, (full, cp_loss, grad_err)

    full, cp_loss, grad_err = run(rotary, tokens, labels, cp, positions_arg=False)
    if rank0:
        print(f"rotary, tables NOT indexed (wrong): loss {full:.6f} vs {cp_loss:.6f}  "
              f"worst grad error {grad_err:.1e}")
    assert grad_err > 1e-3, "expected the unindexed rotary to train wrong under CP"
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
