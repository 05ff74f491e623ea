"""Hot-expert copies sent once per step (``copies_per_step``), not once per micro-batch.

Layer level (one 2-rank spawn, ep = 2, skewed routing, 4 micro-batches in a 1F1B order
F0 F1 B0 F2 B1 F3 B2 B3, each MoE call under activation checkpointing): the gradients equal
those of the layer without replication (and of one process), and the copy traffic
(``count_comm().weight_bytes_sent``) falls at least 4x against copies per dispatch (which sends
the weights in every forward and recompute and the gradients in every backward). A step
whose micro-batch count is wrong raises instead of dropping the copies' gradients.

Trainer level: ``COPIES_PER_STEP`` in tests/multiprocess/test_expert_parallel.py, whose 4-rank
spawn runs them.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.utils.checkpoint import checkpoint

from tests.multiprocess.test_expert_replication import _grads, _grads_ref, _skewed_moe
from tests.spawn import run_distributed

TOL = dict(rtol=1e-6, atol=1e-6)
MICRO = 4
ORDER = ("F0", "F1", "B0", "F2", "B1", "F3", "B2", "B3")  # 1F1B: backwards between forwards


def _run(model, xs, cs, mine, step_microbatches: int | None):
    """The ORDER over MICRO micro-batches (AC around each call); returns the EP counters."""
    import contextlib

    from titanext.plugins.expert_parallel import count_comm
    from titanext.plugins.expert_parallel.replication import copies_per_step

    ctx = (contextlib.nullcontext() if step_microbatches is None
           else copies_per_step([model], step_microbatches))
    losses = {}
    with count_comm() as cc, ctx:
        for action in ORDER:
            i = int(action[1])
            if action[0] == "F":
                y = checkpoint(model, xs[i][mine].clone(), use_reentrant=False)
                losses[i] = (y * cs[i][mine]).sum()
            else:
                losses.pop(i).backward()
    return cc


def _layer(rank: int, world_size: int) -> dict:
    from titanext.plugins.expert_parallel import apply_expert_parallel

    torch.set_num_threads(1)
    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("ep",))
    group = mesh.get_group()
    ref = _skewed_moe(True)
    plain, per_dispatch, per_step, wrong = (copy.deepcopy(ref) for _ in range(4))
    apply_expert_parallel(plain, mesh)
    for m in (per_dispatch, per_step, wrong):
        apply_expert_parallel(m, mesh, replicate_hot_experts=2)
    g = torch.Generator().manual_seed(7)
    xs = torch.randn(MICRO, 2 * world_size, 6, 16, generator=g)
    cs = torch.randn(MICRO, 2 * world_size, 6, 16, generator=g)
    for i in range(MICRO):
        (ref(xs[i]) * cs[i]).sum().backward()
    mine = slice(2 * rank, 2 * rank + 2)
    _run(plain, xs, cs, mine, None)
    cc_dispatch = _run(per_dispatch, xs, cs, mine, None)
    cc_step = _run(per_step, xs, cs, mine, MICRO)
    want, got = _grads(plain, group), _grads(per_step, group)
    one = _grads_ref(ref)
    for n in want:
        torch.testing.assert_close(got[n], want[n], **TOL, msg=lambda m, n=n: f"{n} vs ep: {m}")
        torch.testing.assert_close(got[n], one[n], **TOL, msg=lambda m, n=n: f"{n} vs one: {m}")
    raised = ""
    try:
        _run(wrong, xs, cs, mine, MICRO - 1)
    except RuntimeError as e:
        raised = str(e)
    dist.barrier(group)
    return {"dispatch_bytes": cc_dispatch.weight_bytes_sent,
            "step_bytes": cc_step.weight_bytes_sent,
            "step_replicas": cc_step.replicas, "step_all_to_alls": cc_step.weight_all_to_alls,
            "raised": raised}


@pytest.mark.slow
def test_copies_per_step_exact_and_4x_less_traffic():
    for got in run_distributed(_layer, 2, timeout_s=60):
        assert got["step_replicas"] > 0, got
        assert got["step_all_to_alls"] == 2, got  # the weights once, their gradients once
        assert 0 < 4 * got["step_bytes"] <= got["dispatch_bytes"], got
        assert "more backward passes" in got["raised"], got

