"""titanext's MoE layer inside your own model, trained by your own loop (one process, CPU).

    python examples/moe_layer.py

The MoE replaces a feed-forward: ``MoE(dim, MoEArgs(...))`` maps [batch, seq, dim] to the same
shape. Two things to add to a training loop: call ``update_expert_bias`` after each optimizer
step (aux-loss-free balancing; pass the data-parallel group when there are several ranks), and
nothing else for the optional sequence-wise aux loss: its gradient is added in backward.
"""

import torch
from torch import nn

from titanext.models.moe import MoE, MoEArgs, expert_load, update_expert_bias


class TinyMoEModel(nn.Module):
    def __init__(self, vocab: int = 64, dim: int = 32):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.moe = MoE(dim, MoEArgs(num_experts=8, top_k=2, hidden_dim=64, num_shared_experts=1,
                                    score_func="sigmoid", route_norm=True,
                                    load_balance_coeff=1e-2, aux_loss_alpha=1e-2))
        self.head = nn.Linear(dim, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        return self.head(h + self.moe(h))


def main(steps: int = 30) -> None:
    torch.manual_seed(0)
    model = TinyMoEModel()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    for step in range(1, steps + 1):
        tokens = torch.randint(0, 64, (8, 33))
        tokens[:, 1:] = (tokens[:, :-1] * 7 + 3) % 64  # a learnable next-token rule
        logits = model(tokens[:, :-1])
        loss = nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
        loss.backward()  # + the MoE's sequence aux loss (mean over the 8 sequences)
        opt.step()
        opt.zero_grad()
        loads = update_expert_bias(model)  # [MoE layers, experts] tokens routed this step
        if step == 1 or step % 10 == 0:
            print(f"step {step:2d}  loss {loss.item():.4f}  aux {model.moe.aux_loss.item():.4f}  "
                  f"max/mean expert load {expert_load(loads).max().item():.2f}")


if __name__ == "__main__":
    main()
