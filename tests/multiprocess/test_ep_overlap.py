"""expert_parallel_comm_overlap: the overlapped run is bitwise the plain one (4 CPU ranks).

pp = 2 with expert parallelism inside each stage (ep = 2, borrowed from dp_shard = 2, so FSDP
shards the stages too), debugmoe with 4 blocks (1-3 MoE, so every rank holds one under every
placement), with activation checkpointing.
Each case trains the same steps with the overlap off and on, in ONE 4-rank spawn, and asserts
``torch.equal`` on every step's loss and every final parameter: one side computes at a time
(titanext.plugins._baton_threads), so every op sees the inputs and the summation order of the
plain run.
The plain runs themselves follow one process (tests/multiprocess/test_composition.py).
"""

from __future__ import annotations

import pytest
import torch

from tests.multiprocess.test_composition import _runs
from tests.spawn import fp32_trainer_overrides, run_distributed

STEPS = 2
P = "--parallelism."
FLAVOR = "debugmoe4"
BASE = [*fp32_trainer_overrides(steps=STEPS, seq_len=32, flavor=FLAVOR),
        "--training.local_batch_size=8", P + "data_parallel_shard_degree=2",
        P + "expert_parallel_degree=2", P + "pipeline_parallel_degree=2"]
ON = P + "expert_parallel_comm_overlap=true"

CASES = {
    "DualPipeV_full_ac": [P + "pipeline_parallel_schedule=DualPipeV",
                          P + "pipeline_parallel_microbatches=4",
                          "--activation_checkpoint.mode=full"],
    "1F1B_selective_ac": [P + "pipeline_parallel_schedule=1F1B",
                          P + "pipeline_parallel_microbatches=4",
                          "--activation_checkpoint.mode=selective",
                          "--activation_checkpoint.selective_ac_option=1"],
    "Interleaved1F1B_full_ac": [P + "pipeline_parallel_schedule=Interleaved1F1B",
                                P + "pipeline_parallel_microbatches=4",
                                "--activation_checkpoint.mode=full"],
    # float8 linears (attention and shared parts; the experts stay grouped GEMMs), deferred
    # weight gradients (titanext's split backward, the default)
    "DualPipeV_float8": [P + "pipeline_parallel_schedule=DualPipeV",
                         P + "pipeline_parallel_microbatches=4", "--float8.enable=true"],
}


def _with_flavor(rank: int, world_size: int, runs: list[list[str]], dump_folder: str):
    import dataclasses

    from titanext.models import MODEL_FLAVORS

    flavors = MODEL_FLAVORS["llama3"]
    flavors[FLAVOR] = dataclasses.replace(flavors["debugmoe"], n_layers=4)
    from titanext.plugins._baton_threads import comm_waits

    out = []
    for i, run in enumerate(runs):
        comm_waits(reset=True)
        (losses, params), = _runs(rank, world_size, [run], f"{dump_folder}/{i}")
        out.append((losses, params, comm_waits().handovers))
    return out


@pytest.mark.slow
def test_overlap_is_bitwise_the_plain_run(tmp_path):
    names = list(CASES)
    runs = [[*BASE, *CASES[n], *extra] for n in names for extra in ([], [ON])]
    per_rank = run_distributed(_with_flavor, 4, args=(runs, str(tmp_path)), timeout_s=180)
    failures = []
    for i, name in enumerate(names):
        plain, overlapped = 2 * i, 2 * i + 1
        losses = [per_rank[0][k][0] for k in (plain, overlapped)]
        assert len(losses[0]) == STEPS, name
        if losses[0] != losses[1]:
            failures.append(f"{name}: losses {losses[0]} (off) vs {losses[1]} (on)")
        # the overlapped run handed over at all-to-alls on every rank, the plain one never
        handovers = [rank_out[k][2] for rank_out in per_rank for k in (plain, overlapped)]
        assert all(h > 0 for h in handovers[1::2]) and not any(handovers[::2]), (name, handovers)
        # the full parameters, from the first rank of each stage (dp/ep coordinate 0)
        off = {k: v for rank_out in per_rank for k, v in rank_out[plain][1].items()}
        on = {k: v for rank_out in per_rank for k, v in rank_out[overlapped][1].items()}
        assert off.keys() == on.keys() and len(off) > 10, name
        bad = [k for k in off if not torch.equal(off[k], on[k])]
        if bad:
            failures.append(f"{name}: parameters differ: {', '.join(bad)}")
    assert not failures, "\n".join(failures)
