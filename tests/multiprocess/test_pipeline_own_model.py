"""The pipeline split on a model titanext did not write: blocks nested under ``transformer.h``
in a ``ModuleList``, a forward that skips nothing (``b, t = idx.size()``, embedding and head
called unconditionally). ``split_model(..., blocks="transformer.h", skip_missing=True)`` over
pp=2 must train exactly like one process, under torch's 1F1B and titanext's ZBH1, and every
stage must keep the original model's parameter names."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from tests.spawn import run_distributed

VOCAB, DIM, HEADS, SEQ, BATCH, LAYERS = 48, 32, 4, 8, 4, 4


class Block(nn.Module):  # GPT-2 style: pre-norm, fused qkv, GELU MLP
    def __init__(self):
        super().__init__()
        self.ln_1, self.ln_2 = nn.LayerNorm(DIM), nn.LayerNorm(DIM)
        self.c_attn, self.c_proj = nn.Linear(DIM, 3 * DIM), nn.Linear(DIM, DIM)
        self.mlp = nn.Sequential(nn.Linear(DIM, 4 * DIM), nn.GELU(), nn.Linear(4 * DIM, DIM))

    def forward(self, x):
        b, t, _ = x.shape
        q, k, v = (y.view(b, t, HEADS, -1).transpose(1, 2)
                   for y in self.c_attn(self.ln_1(x)).split(DIM, dim=2))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.c_proj(y.transpose(1, 2).reshape(b, t, DIM))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self):
        super().__init__()
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(VOCAB, DIM), wpe=nn.Embedding(SEQ, DIM),
            h=nn.ModuleList(Block() for _ in range(LAYERS)), ln_f=nn.LayerNorm(DIM)))
        self.lm_head = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, idx):
        b, t = idx.size()
        x = self.transformer.wte(idx) + self.transformer.wpe(torch.arange(t, device=idx.device))
        for block in self.transformer.h:
            x = block(x)
        return self.lm_head(self.transformer.ln_f(x))


SPLIT = dict(blocks="transformer.h", first=["transformer.wte", "transformer.wpe"],
             last=["transformer.ln_f", "lm_head"], skip_missing=True)


def _body(rank, world_size, schedules):
    from titanext.distributed.pipeline import build_pipeline, split_model

    torch.manual_seed(0)
    model = GPT()
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ + 1))
    inputs, labels = tokens[:, :-1], tokens[:, 1:]
    ref_loss = F.cross_entropy(model(inputs).flatten(0, 1), labels.flatten())
    ref_loss.backward()
    ref = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()

    def loss_fn(logits, target):  # normalised once, by the global token count
        return F.cross_entropy(logits.flatten(0, 1), target.flatten(), reduction="sum") / (
            labels.numel())

    out = {}
    for name in schedules:
        stage = split_model(model, [2, 2], rank, **SPLIT)
        _, schedule = build_pipeline([stage], [rank], num_stages=2, pp_group=dist.group.WORLD,
                                     device=torch.device("cpu"), schedule=name, microbatches=4,
                                     loss_fn=loss_fn)
        losses: list[torch.Tensor] = []
        last = {"target": labels, "losses": losses} if rank == 1 else {}
        schedule.step(idx=inputs, return_outputs=False, **last)  # inputs by keyword, every rank
        loss = torch.stack(losses).sum() if losses else torch.zeros(())
        dist.all_reduce(loss)
        grad_errs = {n: ((p.grad - ref[n]).norm() / ref[n].norm()).item()
                     for n, p in stage.named_parameters()}
        out[name] = {"loss_err": abs(loss.item() - ref_loss.item()) / ref_loss.item(),
                     "grad_errs": grad_errs,
                     "same_values": all(torch.equal(p, model.get_parameter(n))
                                        for n, p in stage.named_parameters())}
    out["all_names"] = [n for n, _ in model.named_parameters()]
    return out


def test_nested_modulelist_blocks_split_matches_one_process_and_keeps_fqns():
    r0, r1 = run_distributed(_body, 2, args=(["1F1B", "ZBH1"],), timeout_s=60)
    for name in ("1F1B", "ZBH1"):
        names0, names1 = set(r0[name]["grad_errs"]), set(r1[name]["grad_errs"])
        assert not names0 & names1  # no FQN collides across stages
        assert names0 | names1 == set(r0["all_names"])  # and together they are the model's
        assert "transformer.h.2.c_attn.weight" in names1 and "lm_head.weight" in names1
        assert "transformer.wte.weight" in names0 and r0[name]["same_values"]
        assert r0[name]["loss_err"] < 1e-5, name
        for res in (r0, r1):
            worst = max(res[name]["grad_errs"], key=res[name]["grad_errs"].get)
            assert res[name]["grad_errs"][worst] < 1e-5, (name, worst, res[name]["grad_errs"])


def test_split_errors_name_the_path_and_the_fix():
    import pytest

    from titanext.distributed.pipeline import split_model

    model = GPT()
    with pytest.raises(ValueError, match="no submodule 'transformer.blocks'.*transformer.h"):
        split_model(model, [2, 2], 0, blocks="transformer.blocks")
    with pytest.raises(ValueError, match="at least one block on every stage"):
        split_model(model, [0, 4], 0, **SPLIT)
    with pytest.raises(AttributeError, match="head"):
        split_model(model, [2, 2], 0, blocks="transformer.h", last=["head"])
