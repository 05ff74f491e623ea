"""Multi-token prediction (the debug DeepSeek flavor: MLA, MoE, one MTP module) under pipeline
schedules and data / context / expert / tensor parallelism follows one fp32 process (4 CPU
ranks, one spawn).

Each case runs the real Trainer for a few steps and compares, against one process on the same
global batch: the main loss and the MTP loss of every step, and the first step's gradients of
every parameter, those of the embedding on the first stage and of its MTP copy on the last
stage included (summed exactly, so both must equal the one-process gradient). The pipeline
cases cover the three ways the two embedding copies meet: on one rank (ZBV: stages 0 and
2pp-1 on rank 0), on one rank after DualPipe's mirrored sum, and across ranks (1F1B: stage 0
on rank 0, the last stage on rank 1). ZBV needs 4 blocks: it runs a tiny DeepseekV3ForCausalLM
from transformers (``flavor = "hf"``, 4 layers + its MTP layer), loaded with
``initial_load_in_hf``, checkpointed after step 2 and resumed by a new Trainer for step 3 (the
two embedding copies' optimizer states included), and exported with ``last_save_in_hf`` under
the layout; the export must equal the one-process export. Under TP (2 x FSDP 2, also with EP
2 and without SP and loss parallelism; 1F1B PP 2 x TP 2 with the MTP module on the last stage)
the gradients are gathered over tp.
"""

from __future__ import annotations

import os

import pytest
import torch

from tests.spawn import fp32_trainer_overrides, param_errors, param_problems, run_distributed

# 2 steps: the second loss is taken after the first step's update (a third added time, not a check)
STEPS = 2
BASE = [*fp32_trainer_overrides(steps=STEPS, seq_len=32), "--training.mtp_loss_weight=0.5"]
P = "--parallelism."
DEBUG = ["--model.flavor=debugdeepseek", "--model.num_mtp_layers=1"]


def _hf(directory: str) -> list[str]:
    """The tiny DeepseekV3 from HF, for 3 steps: 2, a checkpoint, then a resumed Trainer."""
    return ["--model.flavor=hf", f"--model.hf_assets_path={directory}",
            f"--checkpoint.initial_load_path={directory}", "--checkpoint.initial_load_in_hf",
            "--checkpoint.enable", "--checkpoint.last_save_in_hf",
            f"--checkpoint.interval={STEPS}", f"--training.steps={STEPS + 1}"]


def _runs(rank: int, world_size: int, runs: list[list[str]], dump_folder: str) -> list:
    """Per run: (losses, MTP losses, {param name: [first-step gradient of every copy]}) with
    the gradients of the ranks whose non-pp coordinates are 0 (their stages' copies)."""
    from torch.distributed.tensor import DTensor

    from titanext.config import load_config
    from titanext.trainer import Trainer

    out = []
    for i, overrides in enumerate(runs):
        cfg = load_config(None, [*BASE, f"--job.dump_folder={dump_folder}/{i}", *overrides],
                          world_size=world_size)
        trainer = Trainer(cfg)
        mesh = trainer.dims.world_mesh
        coords = zip(mesh.mesh_dim_names, mesh.get_coordinate(), strict=True)
        keep = all(c == 0 for name, c in coords if name != "pp")
        grads: dict[str, list[torch.Tensor]] = {}
        step = trainer._optimizer_step

        def first_step_grads(step=step, trainer=trainer, grads=grads, keep=keep) -> None:
            if not grads:  # every rank takes part in each full_tensor (a collective)
                for part in trainer.model_parts:
                    for n, p in part.named_parameters():
                        g = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
                        if keep:
                            grads.setdefault(n, []).append(g.detach().clone())
                grads.setdefault("", [])
            step()

        trainer._optimizer_step = first_step_grads
        losses, mtp = [], []
        for s in range(1, STEPS + 1):
            losses += trainer.train(until_step=s)
            mtp.append(trainer.mtp_loss)
        grads.pop("", None)
        if cfg.training.steps > STEPS:  # resume from the step-2 checkpoint, train step 3
            losses += Trainer(cfg).train()
        out.append((losses, mtp, grads))
    return out


def _pp(schedule: str, microbatches: int) -> list[str]:
    return [P + "pipeline_parallel_degree=2", P + f"pipeline_parallel_schedule={schedule}",
            P + f"pipeline_parallel_microbatches={microbatches}"]


FSDP2 = ["--training.local_batch_size=4", P + "data_parallel_shard_degree=2"]
TP2 = [P + "tensor_parallel_degree=2"]
# name: (reference, overrides); every case has a global batch of 8 sequences of 32 tokens.
CASES = {
    "hf_ZBV_pp2_x_fsdp2": ("hf", [*FSDP2, *_pp("ZBV", 4)]),
    "DualPipe_pp2_x_fsdp2": ("debug", [*DEBUG, *FSDP2, *_pp("DualPipe", 4)]),
    "1F1B_pp2_x_fsdp2ep2": ("debug", [*DEBUG, *FSDP2, P + "expert_parallel_degree=2",
                                      *_pp("1F1B", 2)]),
    # the MTP labels are shifted on the whole sequence, then sharded like the labels
    "cp2_x_fsdp2": ("debug", [*DEBUG, *FSDP2, P + "context_parallel_degree=2"]),
    # under TP, the gradients gathered over tp:
    "tp2_x_fsdp2": ("debug", [*DEBUG, *FSDP2, *TP2]),
    # the MTP block's MoE: replicated over tp as the blocks' are, its experts split over ep
    "tp2_x_fsdp2ep2": ("debug", [*DEBUG, *FSDP2, *TP2, P + "expert_parallel_degree=2"]),
    # replicated activations between blocks, the logits gathered over the vocabulary
    "tp2_x_fsdp2_no_sp_no_loss_parallel": ("debug", [*DEBUG, *FSDP2, *TP2,
                                                     P + "enable_sequence_parallel=false",
                                                     P + "enable_loss_parallel=false"]),
    # the MTP module on the last stage
    "1F1B_pp2_x_tp2": ("debug", [*DEBUG, "--training.local_batch_size=8", *TP2,
                                 *_pp("1F1B", 2)]),
}
LOSS_RTOL, GRAD_RTOL = 1e-5, 1e-5


def _export(folder: str) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    d = os.path.join(folder, "checkpoint", f"step-{STEPS + 1}-hf")
    return {k: v for f in sorted(os.listdir(d)) if f.endswith(".safetensors")
            for k, v in load_file(os.path.join(d, f)).items()}


def _export_start(hf_dir: str) -> dict[str, torch.Tensor]:
    """The weights both runs loaded at step 0 (HF names, as the exports have them)."""
    from safetensors.torch import load_file

    return {k: v for f in sorted(os.listdir(hf_dir)) if f.endswith(".safetensors")
            for k, v in load_file(os.path.join(hf_dir, f)).items()}


@pytest.mark.slow
def test_mtp_layouts_follow_one_process(tmp_path):
    from tests.hf_artifacts import make_tiny_deepseek_v3

    hf_dir = str(tmp_path / "tiny_deepseek_v3")
    make_tiny_deepseek_v3(hf_dir, layers=4)
    refs_runs = {"hf": _hf(hf_dir), "debug": DEBUG}
    refs = dict(zip(refs_runs, run_distributed(
        _runs, 1, args=([[*r, "--training.local_batch_size=8"] for r in refs_runs.values()],
                        str(tmp_path / "ref")), timeout_s=120)[0], strict=True))
    names = list(CASES)
    runs = [(_hf(hf_dir) if CASES[n][0] == "hf" else []) + CASES[n][1] for n in names]
    per_rank = run_distributed(_runs, 4, args=(runs, str(tmp_path / "run")), timeout_s=300)
    failures = []
    for i, name in enumerate(names):
        ref_losses, ref_mtp, ref_grads = refs[CASES[name][0]]
        copies = check_case(name, per_rank, i, (ref_losses, ref_mtp, ref_grads), failures)
        assert any(k.startswith("mtp.layers.0.eh_proj" if "tp2" in name else "mtp.")
                   for k in copies), name
        if "pp2" in name:  # the MTP's embedding copy on the last stage (two under DualPipe)
            assert len(copies["tok_embeddings.weight"]) == (4 if "DualPipe" in name else 2)
    ref_export = _export(str(tmp_path / "ref" / "0"))
    export = _export(str(tmp_path / "run" / str(names.index("hf_ZBV_pp2_x_fsdp2"))))
    assert sorted(export) == sorted(ref_export) and "model.layers.4.eh_proj.weight" in export
    start = _export_start(hf_dir)
    # after 3 Adam steps, relative to one process's update
    failures += param_problems("export", export, ref_export, rtol=3e-5, start=start)
    worst = max(param_errors(export, ref_export, start=start).values())
    print(f"export: parameters after {STEPS + 1} steps within {worst:.1e} of the update")
    assert not failures, "\n".join(failures)


def check_case(name: str, per_rank: list, i: int, ref: tuple, failures: list[str]
               ) -> dict[str, list[torch.Tensor]]:
    """Run ``i`` of every rank against one process: the main and MTP losses of every step
    (LOSS_RTOL) and every parameter's first-step gradient, each rank's copy (GRAD_RTOL);
    mismatches go to ``failures``. Returns the gathered gradient copies by name."""
    ref_losses, ref_mtp, ref_grads = ref
    losses, mtp = per_rank[0][i][0], per_rank[0][i][1]
    assert all(m > 0 for m in mtp), (name, mtp)
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
    assert copies.keys() == ref_grads.keys(), name
    worst = 0.0
    for k, tensors in copies.items():
        for t in tensors:
            err = ((t - ref_grads[k][0]).norm() / ref_grads[k][0].norm()).item()
            worst = max(worst, err)
            if err > GRAD_RTOL:
                failures.append(f"{name}: grad of {k}: relative error {err:.2e}")
    loss_err = max(abs(a - b) / abs(b) for a, b in zip(losses + mtp, ref_losses + ref_mtp))
    print(f"{name}: losses and MTP losses within {loss_err:.1e}, gradients within {worst:.1e} "
          "(relative)")
    return copies
