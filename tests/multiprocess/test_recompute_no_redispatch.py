"""Recompute without re-dispatch (``[activation_checkpoint] keep_all_to_all``) through the trainer
(debugmoe: block 0 dense, blocks 1 and 2 MoE; fp32, 4 gloo ranks, one spawn):

- ep = 2 over FSDP 4 (flat dispatch), ep = 4 as 2 "nodes" x 2 (two-level dispatch, two hot-expert
  copies), and ep = 2 inside pipeline stages (1F1B; DualPipe, whose split backward recomputes
  every block twice and so replays the tape twice): the losses, gradient norms and parameters
  after 4 steps are bitwise those of full AC, and follow one process
  (tests/multiprocess/test_expert_parallel.py's reference and bounds);
- the token all-to-alls per MoE layer and micro-batch fall from 6 (forward dispatch + combine,
  the recompute's two, the backward's two) to 4, and the count exchanges (each a device-to-host
  sync) from 2 to 1 (DualPipe: fewer, counted per direction elsewhere).
"""

from __future__ import annotations

import pytest
import torch
from torch.distributed.tensor import DTensor

from tests.multiprocess import test_expert_parallel as _ep
from tests.multiprocess.test_expert_parallel import BASE, STEPS, _assert_matches
from tests.spawn import run_distributed

P = "--parallelism."
FULL = ["--activation_checkpoint.mode=full"]
KEEP = [*FULL, "--activation_checkpoint.keep_all_to_all=true"]
# name: (overrides, micro-batches per step, MoE layers on rank 0 x dispatch levels), global
# batch 8; DualPipe's two directions are left to the ratio check
LAYOUTS = {
    "ep2_x_fsdp4": (["--training.local_batch_size=2", P + "expert_parallel_degree=2"], 1, 2),
    "ep4_two_level_rep2": (["--training.local_batch_size=2", P + "expert_parallel_degree=4",
                            P + "expert_parallel_dispatch=two_level",
                            P + "expert_parallel_ranks_per_node=2",
                            "--moe.replicate_hot_experts=2"], 1, 2 * 2),
    "pp2_x_ep2_1F1B": (["--training.local_batch_size=4", P + "expert_parallel_degree=2",
                        P + "pipeline_parallel_degree=2", P + "pipeline_parallel_schedule=1F1B",
                        P + "pipeline_parallel_microbatches=4"], 4, 1),
    "pp2_dualpipe_x_ep2": (["--training.local_batch_size=4", P + "expert_parallel_degree=2",
                            P + "pipeline_parallel_degree=2",
                            P + "pipeline_parallel_schedule=DualPipe"], None, None),
}


def _train(rank: int, world_size: int, folder: str) -> dict:
    """{case: (losses, grad norms, this rank's full params, token all-to-alls, count exchanges)}."""
    from titanext.config import load_config
    from titanext.plugins.expert_parallel import count_comm
    from titanext.trainer import Trainer

    out = {}
    for layout, (overrides, _, _) in LAYOUTS.items():
        for ac, extra in (("full", FULL), ("keep", KEEP)):
            name = f"{layout}_{ac}"
            cfg = load_config(None, [*BASE, f"--job.dump_folder={folder}/{name}", *overrides,
                                     *extra], world_size=world_size)
            trainer, norms = Trainer(cfg), []
            step = trainer.train_step

            def recording_step(microbatches, step=step, norms=norms):
                loss, norm = step(microbatches)
                norms.append(norm)
                return loss, norm

            trainer.train_step = recording_step
            with count_comm() as cc:
                losses = trainer.train()
            params = {n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
                      for part in trainer.model_parts for n, p in part.named_parameters()}
            out[name] = (losses, norms, params, cc.all_to_alls, cc.count_exchanges)
    return out


moe_reference = _ep.moe_reference  # the one-process reference runs (a module-scoped fixture)


@pytest.mark.slow
def test_recompute_without_redispatch(moe_reference, tmp_path):  # noqa: F811
    per_rank = run_distributed(_train, 4, args=(str(tmp_path),), timeout_s=240)
    counts = {}
    for rank, got in enumerate(per_rank):
        for layout, (_, microbatches, n_moe) in LAYOUTS.items():
            full, keep = got[f"{layout}_full"], got[f"{layout}_keep"]
            assert full[0] == keep[0] and full[1] == keep[1], (layout, full[:2], keep[:2])
            bad = [n for n in full[2] if not torch.equal(full[2][n], keep[2][n])]
            assert not bad, f"{layout} rank {rank}: parameters differ from full AC: {bad}"
            assert 0 < keep[3] < full[3] and 0 < keep[4] < full[4], (layout, full, keep)
            # every recompute full AC ran issued the forward's count exchange(s) and its two
            # token all-to-alls per level again; with keep_all_to_all no recompute issues any
            recomputes = full[4] - keep[4]
            assert full[3] - keep[3] == 2 * recomputes, (layout, rank, full[3:], keep[3:])
            if n_moe:  # per MoE layer, micro-batch (and level); a pipeline's start-up adds one
                per = n_moe * microbatches * STEPS  # forward per stage (the last one's with
                extra = keep[3] - 4 * per  # its backward: 2 or 4 more)
                assert recomputes >= per and 0 <= extra <= (4 * n_moe if "pp2" in layout else 0), (
                    layout, rank, full[3:], keep[3:], per)
                if rank == 0:
                    counts[layout] = ((full[3] - extra) / per, (keep[3] - extra) / per)
    assert counts == {k: (6.0, 4.0) for k in counts}, counts
    for layout in LAYOUTS:  # pipeline stages: rank 0 holds stage 0's parameters, rank 2 stage 1's
        got = per_rank[0][f"{layout}_keep"]
        params = {**got[2], **(per_rank[2][f"{layout}_keep"][2] if "pp2" in layout else {})}
        _assert_matches((got[0], got[1], params), moe_reference["ref"], f"{layout}_keep")
