"""Muon on every layout matches one process running Muon (which tests/unit/test_muon.py shows
is torch.optim.Muon + AdamW bit for bit): FSDP2, HSDP, ZeRO-1, FSDP2 x TP, PP x FSDP2 and MoE
experts over EP, each after several steps, in one 4-rank spawn (start-up dominates on 2 cores);
and fused matrices split per logical matrix (muon_split_params) under FSDP2 x TP, where the
split boundaries fall inside the ranks' shards. The 5-D composition is
tests/multiprocess/test_composition.py's Muon case."""

from __future__ import annotations

import pytest

from tests.spawn import fp32_trainer_overrides, param_problems, run_distributed, stage_runs

STEPS = 3
BASE = [*fp32_trainer_overrides(steps=STEPS, seq_len=32), "--optimizer.name=Muon",
        "--optimizer.muon_lr=2e-2", "--optimizer.muon_adjust_lr_fn=original",
        "--optimizer.muon_ns_dtype=float32"]  # bfloat16 NS rounds 1e-7 apart sums 1e-3 apart
P = "--parallelism."
TINY, MOE = "debugtiny", "debugmoe"
# w1 [192, 64] as [128; 64] rows (TP shards rows at 96), wo [64, 64] as [40 | 24] columns
# (TP shards columns at 32): each logical matrix spans two ranks' pieces
SPLIT = ["--optimizer.muon_split_params=layers.*.feed_forward.w1.weight = 128+64,"
         "layers.*.attention.wo.weight = cols 40+24"]
# the one-process references: name -> overrides
REFS = {TINY: [f"--model.flavor={TINY}"], MOE: [f"--model.flavor={MOE}"],
        "split": [f"--model.flavor={TINY}", *SPLIT]}

# name: (reference, overrides); every case has a global batch of 8 sequences on 4 ranks
CASES = {
    "fsdp4": (TINY, ["--training.local_batch_size=2"]),
    "hsdp_2x2": (TINY, ["--training.local_batch_size=2", P + "data_parallel_replicate_degree=2"]),
    "zero1_dp4": (TINY, ["--training.local_batch_size=2", P + "zero_stage=1"]),
    "fsdp2_x_tp2": (TINY, ["--training.local_batch_size=4", P + "tensor_parallel_degree=2"]),
    "pp2_x_fsdp2_1F1B": (TINY, ["--training.local_batch_size=4", P + "data_parallel_shard_degree=2",
                                P + "pipeline_parallel_degree=2",
                                P + "pipeline_parallel_schedule=1F1B",
                                P + "pipeline_parallel_microbatches=2"]),
    "moe_fsdp4_ep2": (MOE, ["--training.local_batch_size=2", P + "expert_parallel_degree=2"]),
    "split_fsdp2_x_tp2": ("split", ["--training.local_batch_size=4",
                                    P + "tensor_parallel_degree=2"]),
}


def _runs(rank: int, world_size: int, runs: list[list[str]], dump_folder: str):
    """Each run's losses and full parameters (every pipeline stage's first rank keeps them)."""
    return stage_runs(BASE, runs, dump_folder, world_size)


@pytest.mark.layout_parity
def test_muon_on_every_layout_matches_one_process(tmp_path):
    refs = dict(zip(REFS, run_distributed(
        _runs, 1, args=([[*r, "--training.local_batch_size=8"] for r in REFS.values()],
                        str(tmp_path / "ref")), timeout_s=120)[0]))
    names = list(CASES)
    per_rank = run_distributed(
        _runs, 4, args=([[*REFS[CASES[n][0]], *CASES[n][1]] for n in names],
                        str(tmp_path / "run")), timeout_s=120)
    failures = []
    for i, name in enumerate(names):
        ref_losses, ref_params = refs[CASES[name][0]]
        losses = per_rank[-1][i][0]  # the last rank holds the loss under PP
        params = {k: v for rank in per_rank for k, v in rank[i][1].items()}
        loss_err = max(abs(a - b) / abs(b) for a, b in zip(losses, ref_losses, strict=True))
        if not loss_err < 1e-5:
            failures.append(f"{name}: loss relative error {loss_err:.2e} >= 1e-05")
        failures += param_problems(name, params, ref_params)
    assert not failures, "\n".join(failures)
    assert refs[TINY][0][-1] < refs[TINY][0][0], "Muon should lower the loss"
    assert param_problems("split vs whole", refs["split"][1], refs[TINY][1]), (
        "splitting w1 and wo should change their update")
