"""A titanext pipeline schedule driving your own PipelineStage objects (docs/pipeline.md:
"Using a titanext schedule with your own PipelineStages").

Run: torchrun --standalone --nproc_per_node 2 examples/pipeline_own_stages.py [SCHEDULE ...]

Each SCHEDULE is a name from titanext.schedules.SCHEDULE_NAMES (default ZBV). Each rank builds
only the stages the schedule's placement gives it, trains 3 SGD steps, and checks the result
against the same model trained in one process.
"""

import sys

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import PipelineStage

from titanext.schedules import (
    build_schedule,
    get_schedule_class,
    num_stages_for,
    stage_ids_for_rank,
)

DIM, MICROBATCHES, STEPS = 32, 8, 3


def my_stage_module(stage: int) -> nn.Module:
    """Your code: the layers of one pipeline stage (seeded so every process agrees)."""
    torch.manual_seed(stage)
    return nn.Sequential(nn.Linear(DIM, 2 * DIM), nn.GELU(), nn.Linear(2 * DIM, DIM))


def loss_fn(out, target):  # per micro-batch; sum, then divide by the whole batch yourself
    return ((out - target) ** 2).sum() / (MICROBATCHES * 4)


def train(name: str, rank: int, pp: int) -> float:
    """3 steps of schedule ``name`` on this rank's stages; the largest parameter error against
    the same model trained in one process."""
    cls = get_schedule_class(name)
    per_rank = cls.stages_per_rank or 2             # interleaved torch schedules: your choice
    n_stages = num_stages_for(cls.placement, pp, per_rank)
    mine = stage_ids_for_rank(cls.placement, rank, pp, per_rank)  # e.g. ZBV on rank 0: [0, 3]
    modules = [my_stage_module(s) for s in mine]
    stages = [PipelineStage(m, stage_index=s, num_stages=n_stages, device=torch.device("cpu"),
                            group=dist.group.WORLD) for m, s in zip(modules, mine)]
    schedule = build_schedule(name, stages, MICROBATCHES, loss_fn=loss_fn, scale_grads=False)
    opt = torch.optim.SGD([p for m in modules for p in m.parameters()], lr=0.1)

    g = torch.Generator().manual_seed(0)
    x = torch.randn(MICROBATCHES * 4, DIM, generator=g)
    y = torch.randn(MICROBATCHES * 4, DIM, generator=g)
    first, last = any(s.is_first for s in stages), any(s.is_last for s in stages)
    for step in range(STEPS):
        losses: list = []
        kwargs = {"target": y, "losses": losses} if last else {}
        schedule.step(x, **kwargs) if first else schedule.step(**kwargs)
        opt.step()
        opt.zero_grad()
        total = torch.tensor([sum(float(v.detach()) for v in losses) if last else 0.0])
        dist.all_reduce(total)
        copies = 2 if cls.placement == "dualpipe" else 1  # DualPipe: ranks 0 and pp-1 report
        if rank == 0:
            print(f"{name} step {step}: loss {total.item() / copies:.6f}")

    # the same model in one process (DualPipe's two copies of a stage count once)
    whole = nn.Sequential(*(my_stage_module(s) for s in range(n_stages)))
    ref_opt = torch.optim.SGD(whole.parameters(), lr=0.1)
    for _ in range(STEPS):
        pairs = zip(x.chunk(MICROBATCHES), y.chunk(MICROBATCHES))
        loss = sum(loss_fn(whole(a), b) for a, b in pairs)
        loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
    errs = [((p - whole[s].state_dict()[k]).norm() / p.norm()).item()
            for m, s in zip(modules, mine) for k, p in m.state_dict().items()]
    err = torch.tensor([max(errs)])
    dist.all_reduce(err, op=dist.ReduceOp.MAX)
    return err.item()


if __name__ == "__main__":
    dist.init_process_group("gloo")
    rank, pp = dist.get_rank(), dist.get_world_size()
    for name in sys.argv[1:] or ["ZBV"]:
        err = train(name, rank, pp)
        if rank == 0:
            print(f"{name}: largest parameter error vs one process: {err:.1e}")
    dist.destroy_process_group()
