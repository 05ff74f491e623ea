"""Expert parallelism in your own model and training loop: the experts split over the ranks.

    torchrun --nproc_per_node 2 examples/expert_parallel.py

Each rank reads different sequences (data parallel) and holds 8 / world of the experts; the MoE
sends every token to the rank that holds its experts and back (all-to-all). Gradients: the
dense parameters are replicated, so average them over the ranks; an expert's gradient already
sums the tokens of every rank (they came to it), so divide it by the world size to match.
Step 1 is checked against the same model on all the ranks' sequences in one process.
Your own experts module works too: ``apply_expert_parallel(model, mesh, filter_fn=lambda fqn, m:
isinstance(m, MyExperts))``, if it follows the protocol in titanext/plugins/expert_parallel/.
"""

import copy
import os

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

from titanext.models.moe import MoE, MoEArgs, update_expert_bias
from titanext.plugins.expert_parallel import apply_expert_parallel


class TinyMoEModel(nn.Module):
    def __init__(self, vocab: int = 64, dim: int = 32):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.moe = MoE(dim, MoEArgs(num_experts=8, top_k=2, hidden_dim=64, num_shared_experts=1,
                                    score_func="sigmoid", route_norm=True, load_balance_coeff=1e-2))
        self.head = nn.Linear(dim, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        return self.head(h + self.moe(h))


def batch(step: int, rank: int, world: int) -> torch.Tensor:
    """This rank's 4 sequences of the step's global batch of 4 x world (a learnable rule)."""
    g = torch.Generator().manual_seed(step)
    tokens = torch.randint(0, 64, (4 * world, 33), generator=g)
    tokens[:, 1:] = (tokens[:, :-1] * 7 + 3) % 64
    return tokens[4 * rank:4 * (rank + 1)]


def loss_of(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    logits = model(tokens[:, :-1])
    return nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())


def main(steps: int = 20) -> tuple[list[float], bool]:
    if not dist.is_initialized():
        dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("ep",))
    torch.manual_seed(0)  # the same initial weights on every rank
    model = TinyMoEModel()
    reference = copy.deepcopy(model)  # one process's view, for the step-1 check
    print(f"rank {rank}: expert parallel modules {apply_expert_parallel(model, mesh)}; local w1 "
          f"{tuple(model.moe.experts.w1.to_local().shape)}", flush=True)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=False)  # DTensor + plain params
    losses, ok = [], False
    for step in range(1, steps + 1):
        loss = loss_of(model, batch(step, rank, world))
        loss.backward()
        for p in model.parameters():
            if isinstance(p.grad, DTensor):  # an expert: summed over every rank's tokens already
                p.grad.div_(world)
            else:  # replicated: average over the ranks (gloo has no AVG)
                dist.all_reduce(p.grad)
                p.grad.div_(world)
        if step == 1:
            everyone = torch.cat([batch(step, r, world) for r in range(world)])
            ref_loss = loss_of(reference, everyone)
            ref_loss.backward()
            got = torch.tensor([loss.item()])
            dist.all_reduce(got)
            w1 = model.moe.experts.w1.grad.full_tensor()
            ok = (abs(got.item() / world - ref_loss.item()) < 1e-5
                  and torch.allclose(w1, reference.moe.experts.w1.grad, rtol=1e-4, atol=1e-7))
            if rank == 0:
                print(f"step 1 matches one process (loss and expert gradients): {ok}", flush=True)
        opt.step()
        opt.zero_grad()
        update_expert_bias(model, group=dist.group.WORLD)  # loads summed over the ranks
        losses.append(loss.item())
        if rank == 0 and (step == 1 or step % 10 == 0):
            print(f"step {step:2d}  loss {loss.item():.4f}", flush=True)
    return losses, ok


if __name__ == "__main__":
    main()
    if "RANK" in os.environ:
        dist.barrier()
        dist.destroy_process_group()
