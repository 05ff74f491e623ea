"""The parity check on a model written in another library's style (docs/own_model.md).

    python examples/parity_check.py          # four wirings, one set of 2 processes
    python -m titanext.parity --model examples/parity_check.py:build \\
        --wiring examples/parity_check.py:wire_tp --world-size 2 --mesh-names tp

``GPT`` below is what a model library typically looks like, and nothing in it knows titanext:
blocks nested under ``transformer.h`` (a ModuleList), a fused qkv whose rows are grouped per
KV head, a rotary whose tables take no positions, ``F.scaled_dot_product_attention`` called
directly, and a forward that skips nothing (``b, t = idx.size()``). Each ``wire_*`` function
is a user's parallel wiring of it; ``main`` checks them all against one process and asserts
that the right ones pass and the wrong one (the docs' old fused-qkv advice) fails.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

VOCAB, DIM, HEADS, KV_HEADS, SEQ, LAYERS = 96, 32, 4, 2, 16, 2
HD, GROUP = DIM // HEADS, HEADS // KV_HEADS


class RotaryTables(nn.Module):
    def __init__(self):
        super().__init__()
        angles = torch.outer(torch.arange(SEQ).float(),
                             1.0 / 10000 ** (torch.arange(0, HD, 2).float() / HD))
        self.register_buffer("cos", angles.cos(), persistent=False)
        self.register_buffer("sin", angles.sin(), persistent=False)

    def forward(self, x):  # x [batch, heads, seq, head_dim]; no positions argument
        cos, sin = self.cos[: x.shape[2]], self.sin[: x.shape[2]]
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln_1, self.ln_2 = nn.LayerNorm(DIM), nn.LayerNorm(DIM)
        # fused qkv, rows grouped per KV head: [q of group g (GROUP heads), k_g, v_g] for each g
        self.c_attn = nn.Linear(DIM, KV_HEADS * (GROUP + 2) * HD, bias=False)
        self.c_proj = nn.Linear(DIM, DIM, bias=False)
        self.c_fc, self.c_out = nn.Linear(DIM, 4 * DIM), nn.Linear(4 * DIM, DIM)
        self.rotary = RotaryTables()

    def forward(self, x):
        b, t, _ = x.shape
        q, k, v = self.c_attn(self.ln_1(x)).view(b, t, -1, (GROUP + 2) * HD).split(
            [GROUP * HD, HD, HD], dim=-1)
        q = self.rotary(q.reshape(b, t, -1, HD).transpose(1, 2))
        k, v = self.rotary(k.transpose(1, 2)), v.transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        x = x + self.c_proj(y.transpose(1, 2).reshape(b, t, -1))
        return x + self.c_out(F.gelu(self.c_fc(self.ln_2(x))))


class GPT(nn.Module):
    def __init__(self):
        super().__init__()
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(VOCAB, DIM), h=nn.ModuleList(Block() for _ in range(LAYERS)),
            ln_f=nn.LayerNorm(DIM)))
        self.lm_head = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, idx):
        b, t = idx.size()
        x = self.transformer.wte(idx)
        for block in self.transformer.h:
            x = block(x)
        return self.lm_head(self.transformer.ln_f(x))


def build() -> GPT:
    return GPT()


# -- wirings: (model, ctx) -> what to train --------------------------------------------------------

def _tp(model, ctx, qkv_style):
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    from titanext.plugins.tensor_parallel import apply_tensor_parallel

    apply_tensor_parallel(model, ctx.mesh["tp"], {
        "transformer.h.*.c_attn": qkv_style, "transformer.h.*.c_proj": RowwiseParallel(),
        "transformer.h.*.c_fc": ColwiseParallel(), "transformer.h.*.c_out": RowwiseParallel()})
    return model


def wire_tp(model, ctx):
    """Right: rows grouped per KV head, and tp divides the KV heads, so plain ColwiseParallel
    gives each rank whole groups."""
    from torch.distributed.tensor.parallel import ColwiseParallel

    return _tp(model, ctx, ColwiseParallel())


def wire_tp_fused(model, ctx):
    """Wrong: FusedColwiseParallel is for [q | k | v] concatenated, not grouped rows."""
    from titanext.plugins.tensor_parallel import FusedColwiseParallel

    return _tp(model, ctx, FusedColwiseParallel(split_sizes=(HEADS * HD, KV_HEADS * HD,
                                                             KV_HEADS * HD)))


def wire_cp(model, ctx):
    """Context parallelism without editing the model: SDPA calls routed to the ring, the
    rotary tables indexed by the rank's global positions, FSDP averaging over the cp ranks."""
    from titanext.plugins.context_parallel import ring_attention_sdpa
    from titanext.plugins.fsdp import apply_fsdp

    cp, positions = ctx.cp_mesh, ctx.positions()
    for block in model.transformer.h:
        block.rotary.cos, block.rotary.sin = (block.rotary.cos[positions],
                                              block.rotary.sin[positions])
    ctx.forward_context = lambda: ring_attention_sdpa(cp)  # forward and backward run in it
    return apply_fsdp(model, cp, blocks="transformer.h")


class Pipeline:
    """What ``wire_pp`` returns: this rank's stage modules (``parts``) and the schedule."""

    def __init__(self, parts, schedule, is_last):
        self.parts, self.schedule, self.is_last = parts, schedule, is_last


def wire_pp(model, ctx):
    """Two pipeline stages cut at ``transformer.h``; each runs the model's own forward
    (``skip_missing=True``) and keeps the model's parameter names."""
    from titanext.distributed.pipeline import build_pipeline, split_model

    pp = ctx.mesh["pp"]
    rank, tokens = pp.get_local_rank(), ctx.batch_size * ctx.seq_len
    stage = split_model(model, [1, 1], rank, blocks="transformer.h", first=["transformer.wte"],
                        last=["transformer.ln_f", "lm_head"], skip_missing=True)

    def loss_fn(logits, labels):  # a micro-batch's share of the global mean
        return F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="sum") / tokens

    _, schedule = build_pipeline([stage], [rank], num_stages=2, pp_group=pp.get_group(),
                                 device=torch.device("cpu"), schedule="1F1B", microbatches=2,
                                 loss_fn=loss_fn)
    return Pipeline([stage], schedule, is_last=rank == 1)


def pipeline_loss(wired: Pipeline, inputs, labels, ctx):
    """The per-rank step of a pipeline: the schedule runs forward and backward; the last stage
    returns the loss (already backpropagated), the others None."""
    losses: list[torch.Tensor] = []
    last = {"target": labels, "losses": losses} if wired.is_last else {}
    wired.schedule.step(idx=inputs, return_outputs=False, **last)  # inputs by keyword
    return torch.stack(losses).sum().detach() if wired.is_last else None


def main() -> None:
    from titanext.parity import ParityCheck, check_all

    checks = {
        "tp: ColwiseParallel on the grouped qkv": ParityCheck(build, wire_tp, mesh_names=("tp",)),
        "tp: FusedColwiseParallel on it (wrong)": ParityCheck(build, wire_tp_fused,
                                                              mesh_names=("tp",)),
        "cp: ring SDPA, rotary indexed by positions": ParityCheck(build, wire_cp,
                                                                  mesh_names=("cp",)),
        "pp: two stages of transformer.h, 1F1B": ParityCheck(build, wire_pp, mesh_names=("pp",),
                                                             loss_fn=pipeline_loss),
    }
    reports = dict(zip(checks, check_all(list(checks.values()))))
    for name, report in reports.items():
        worst = report.grad_errors[0] if report.grad_errors else ("-", float("nan"))
        print(f"{name}: {'ok' if report.ok else 'FAILED'}  worst gradient error "
              f"{worst[1]:.1e} ({worst[0]})")
    print()
    print(reports["tp: FusedColwiseParallel on it (wrong)"])
    expected = [True, False, True, True]
    assert [r.ok for r in reports.values()] == expected, [str(r) for r in reports.values()]


if __name__ == "__main__":
    main()
