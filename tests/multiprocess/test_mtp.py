"""Multi-token prediction under pipeline schedules and data / context / expert parallelism
follows one fp32 process (4 CPU ranks, one spawn).

Each case runs the real Trainer for a few steps and compares, against one process on the same
global batch: the main loss and the MTP loss of every step, and every parameter after the
steps, the embedding on the first stage and its MTP copy on the last stage included (their
gradients are summed exactly, so both copies must equal the one-process embedding). The
pipeline cases cover the three ways the two embedding copies meet: on one rank (ZBV: stages 0
and 2pp-1 on rank 0), on one rank after DualPipe's mirrored sum, and across ranks (1F1B:
stage 0 on rank 0, the last stage on rank 1).
"""

from __future__ import annotations

import pytest
import torch

from tests.spawn import fp32_trainer_overrides, run_distributed

STEPS = 3
BASE = [*fp32_trainer_overrides(steps=STEPS, seq_len=32), "--model.num_mtp_layers=1",
        "--training.mtp_loss_weight=0.5"]
P = "--parallelism."
DENSE, MOE = "debugmodel", "debugmoe"


def _runs(rank: int, world_size: int, runs: list[list[str]], dump_folder: str) -> list:
    """Per run: (losses, MTP losses, {param name: [full tensor of every copy]}) on the ranks
    whose non-pp coordinates are 0 (their copies of the pipeline's stages)."""
    from torch.distributed.tensor import DTensor

    from titanext.config import load_config
    from titanext.trainer import Trainer

    out = []
    for i, overrides in enumerate(runs):
        cfg = load_config(None, [*BASE, f"--job.dump_folder={dump_folder}/{i}", *overrides],
                          world_size=world_size)
        trainer = Trainer(cfg)
        losses, mtp = [], []
        for step in range(1, STEPS + 1):
            losses += trainer.train(until_step=step)
            mtp.append(trainer.mtp_loss)
        mesh = trainer.dims.world_mesh
        coords = zip(mesh.mesh_dim_names, mesh.get_coordinate(), strict=True)
        keep = all(c == 0 for name, c in coords if name != "pp")
        params: dict[str, list[torch.Tensor]] = {}
        for part in trainer.model_parts:
            for name, p in part.named_parameters():
                full = p.full_tensor() if isinstance(p, DTensor) else p  # collective: every rank
                if keep:
                    params.setdefault(name, []).append(full.detach().clone())
        out.append((losses, mtp, params))
    return out


def _pp(schedule: str, microbatches: int) -> list[str]:
    return [P + "pipeline_parallel_degree=2", P + f"pipeline_parallel_schedule={schedule}",
            P + f"pipeline_parallel_microbatches={microbatches}"]


# name: (flavor, overrides); the reference is one process with local_batch_size=8.
CASES = {
    "ZBV_pp2_x_fsdp2": (DENSE, ["--training.local_batch_size=4",
                                P + "data_parallel_shard_degree=2", *_pp("ZBV", 4)]),
    "DualPipe_pp2_x_fsdp2_moe": (MOE, ["--training.local_batch_size=4",
                                       P + "data_parallel_shard_degree=2", *_pp("DualPipe", 4)]),
    "1F1B_pp2_x_fsdp2ep2_moe": (MOE, ["--training.local_batch_size=4",
                                      P + "data_parallel_shard_degree=2",
                                      P + "expert_parallel_degree=2", *_pp("1F1B", 2)]),
    "cp2_x_fsdp2_moe": (MOE, ["--training.local_batch_size=4", P + "data_parallel_shard_degree=2",
                              P + "context_parallel_degree=2"]),
}
LOSS_RTOL, PARAM_RTOL = 1e-5, 3e-5


@pytest.mark.slow
def test_mtp_layouts_follow_one_process(tmp_path):
    flavors = [DENSE, MOE]
    refs = run_distributed(_runs, 1, args=([[f"--model.flavor={f}",
                                             "--training.local_batch_size=8"] for f in flavors],
                                           str(tmp_path / "ref")), timeout_s=120)[0]
    refs = dict(zip(flavors, refs, strict=True))
    names = list(CASES)
    runs = [[f"--model.flavor={CASES[n][0]}", *CASES[n][1]] for n in names]
    per_rank = run_distributed(_runs, 4, args=(runs, str(tmp_path / "run")), timeout_s=240)
    failures = []
    for i, name in enumerate(names):
        ref_losses, ref_mtp, ref_params = refs[CASES[name][0]]
        losses, mtp = per_rank[0][i][0], per_rank[0][i][1]
        assert all(m > 0 for m in mtp) and mtp[-1] < mtp[0], (name, mtp)
        for what, got, want in (("loss", losses, ref_losses), ("mtp_loss", mtp, ref_mtp)):
            try:
                torch.testing.assert_close(torch.tensor(got), torch.tensor(want),
                                           rtol=LOSS_RTOL, atol=0)
            except AssertionError as e:
                failures.append(f"{name}: {what} {got} vs {want}\n{e}")
        copies: dict[str, list[torch.Tensor]] = {}
        for rank_out in per_rank:
            for k, v in rank_out[i][2].items():
                copies.setdefault(k, []).extend(v)
        assert copies.keys() == ref_params.keys(), name
        if "pp2" in name:  # the MTP's embedding copy on the last stage (two under DualPipe)
            assert len(copies["tok_embeddings.weight"]) == (4 if "DualPipe" in name else 2)
        for k, tensors in copies.items():
            ref = ref_params[k][0]
            for t in tensors:
                err = ((t - ref).norm() / ref.norm()).item()
                if err > PARAM_RTOL:
                    failures.append(f"{name}: {k} relative error {err:.2e} > {PARAM_RTOL}")
    assert not failures, "\n".join(failures)
