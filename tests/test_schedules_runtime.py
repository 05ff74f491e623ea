"""Every schedule runs through torch's pipelining runtime on gloo and matches one process.

Each rank builds real ``PipelineStage`` objects for the stages ``stage_ids_for_rank`` gives it
(placement read from the class, never from the name) and runs one step; the loss and every
gradient must equal the unsplit fp32 model's (DualPipe: both copies of a stage hold the
summed gradient).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

from tests.distributed import run_distributed
from titanext.schedules import (
    build_schedule,
    get_schedule_class,
    num_stages_for,
    resolved_stages_per_rank,
    stage_ids_for_rank,
)

DIM = 8


def _block(stage: int) -> nn.Sequential:
    torch.manual_seed(100 + stage)
    return nn.Sequential(nn.Linear(DIM, DIM), nn.Tanh(), nn.Linear(DIM, DIM), nn.Tanh())


def _loss(out, target):
    return ((out - target) ** 2).sum()


def _data(microbatches):
    g = torch.Generator().manual_seed(0)
    return torch.randn(microbatches, DIM, generator=g), torch.randn(microbatches, DIM, generator=g)


def _run(rank, world_size, cases):
    from torch.distributed.pipelining import PipelineStage

    results = {}
    for name, m in cases:
        cls = get_schedule_class(name)
        spr = resolved_stages_per_rank(cls)
        n = num_stages_for(cls.placement, world_size, spr)
        ids = stage_ids_for_rank(cls.placement, rank, world_size, spr)
        mods = [_block(s) for s in ids]
        stages = [PipelineStage(mod, stage_index=s, num_stages=n, device=torch.device("cpu"),
                                group=dist.group.WORLD) for mod, s in zip(mods, ids)]
        sched = build_schedule(cls, stages, m, loss_fn=_loss, scale_grads=False)
        x, y = _data(m)
        losses: list = []
        if any(st.is_first for st in stages):
            sched.step(x, target=y if any(st.is_last for st in stages) else None, losses=losses)
        else:
            sched.step(target=y if any(st.is_last for st in stages) else None, losses=losses)
        loss = float(sum(losses)) if losses else None
        results[(name, m)] = (loss, [(s, [p.grad.clone() for p in mod.parameters()])
                                     for s, mod in zip(ids, mods)])
    dist.barrier()
    return results


def _reference(n_stages, m):
    x, y = _data(m)
    mods = [_block(s) for s in range(n_stages)]
    out = x
    for mod in mods:
        out = mod(out)
    loss = _loss(out, y)
    loss.backward()
    return loss.item(), [[p.grad for p in mod.parameters()] for mod in mods]


def _check(pp, cases, per_rank):
    for name, m in cases:
        cls = get_schedule_class(name)
        n = num_stages_for(cls.placement, pp, resolved_stages_per_rank(cls))
        ref_loss, ref_grads = _reference(n, m)
        losses = [r[(name, m)][0] for r in per_rank if r[(name, m)][0] is not None]
        assert losses, name
        for loss in losses:
            assert loss == pytest.approx(ref_loss, rel=1e-5), name
        copies: dict[int, list] = {}
        for r in per_rank:
            for s, grads in r[(name, m)][1]:
                copies.setdefault(s, []).append(grads)
                for got, want in zip(grads, ref_grads[s], strict=True):
                    assert ((got - want).norm() / want.norm()).item() < 1e-5, (name, m, s)
        for s, held in copies.items():  # DualPipe's mirrored copies: bitwise equal
            for other in held[1:]:
                assert all(torch.equal(a, b) for a, b in zip(held[0], other, strict=True)), \
                    (name, m, s)


PP2 = [("GPipe", 4), ("1F1B", 4), ("ZBH1", 4), ("ZBH2", 6), ("ZBV", 4), ("Auto", 4),
       ("DualPipe", 4), ("DualPipe", 6), ("DualPipeV", 4), ("DualPipeV", 5),
       ("Interleaved1F1B", 4), ("ZBVZeroBubble", 4)]
PP4 = [("ZBH1", 8), ("ZBH2", 8), ("ZBV", 8), ("Auto", 8), ("DualPipe", 8), ("DualPipeV", 8)]


@pytest.mark.parametrize("pp,cases", [(2, PP2), (4, PP4)])
def test_every_schedule_matches_one_process(pp, cases):
    _check(pp, cases, run_distributed(_run, pp, args=(cases,), timeout_s=120))
