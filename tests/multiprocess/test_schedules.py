"""titanext's generated schedules (ZBH1, ZBH2, ZBV, Auto) execute through torch's pipelining
runtime on gloo: each case runs one step on pp = 2 or 4 ranks (one spawn, every named schedule
in turn), and the loss and every stage's gradients match one process running the unsplit model
(1e-5 relative). The simulator and the generated orders: tests/unit/test_schedules.py; every
schedule, ours and torch's, with deferred weight gradients: test_schedules_runtime.py.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

from tests.spawn import run_distributed
from titanext.schedules import get_schedule_class

DIM, LAYERS_PER_STAGE = 16, 2


def _stage_module(stage: int) -> nn.Sequential:
    torch.manual_seed(100 + stage)
    layers = []
    for _ in range(LAYERS_PER_STAGE):
        layers += [nn.Linear(DIM, DIM), nn.Tanh()]
    return nn.Sequential(*layers)


def _loss(out, target):
    return ((out - target) ** 2).sum()


def _run_schedules(rank, world_size, names, microbatches):
    from torch.distributed.pipelining import PipelineStage

    from titanext.schedules import stage_ids

    results = {}
    g = torch.Generator().manual_seed(0)
    x = torch.randn(microbatches * 2, DIM, generator=g)
    y = torch.randn(microbatches * 2, DIM, generator=g)
    for name in names:
        cls = get_schedule_class(name)
        per_rank = cls.stages_per_rank or 1
        n_stages = world_size * per_rank
        ids = stage_ids(cls.placement, rank, world_size, per_rank)
        modules = {s: _stage_module(s) for s in ids}
        stages = [PipelineStage(modules[s], stage_index=s, num_stages=n_stages,
                                device=torch.device("cpu"), group=dist.group.WORLD) for s in ids]
        schedule = cls(stages, microbatches, loss_fn=_loss, scale_grads=False)
        losses = []
        kwargs = {}
        if 0 in ids:
            kwargs["x"] = x
        if n_stages - 1 in ids:
            kwargs.update(target=y, losses=losses)
        schedule.step(kwargs.pop("x", None), **kwargs) if 0 in ids else schedule.step(**kwargs)
        grads = {s: [p.grad.clone() for p in modules[s].parameters()] for s in ids}
        results[name] = (sum(float(v) for v in losses) if losses else None, grads)
    return results


def _reference(n_stages, microbatches):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(microbatches * 2, DIM, generator=g)
    y = torch.randn(microbatches * 2, DIM, generator=g)
    modules = [_stage_module(s) for s in range(n_stages)]
    out = x
    for m in modules:
        out = m(out)
    loss = _loss(out, y)
    loss.backward()
    return loss.item(), {s: [p.grad.clone() for p in m.parameters()] for s, m in enumerate(modules)}


@pytest.mark.parametrize("pp,microbatches,names", [
    (2, 4, ["ZBH1", "ZBH2", "ZBV", "Auto"]),
    (2, 6, ["ZBH1", "ZBH2"]),
    (4, 8, ["ZBH1", "ZBH2", "ZBV"]),
])
def test_generated_schedules_match_one_process(pp, microbatches, names):
    per_rank = run_distributed(_run_schedules, pp, args=(names, microbatches), timeout_s=60)
    for name in names:
        n_stages = pp * (get_schedule_class(name).stages_per_rank or 1)
        ref_loss, ref_grads = _reference(n_stages, microbatches)
        loss = next(r[name][0] for r in per_rank if r[name][0] is not None)
        assert loss == pytest.approx(ref_loss, rel=1e-5), name
        for r in per_rank:
            for s, grads in r[name][1].items():
                for got, want in zip(grads, ref_grads[s]):
                    assert ((got - want).norm() / want.norm()).item() < 1e-5, (name, s)
