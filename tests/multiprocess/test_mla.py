"""Multi-head latent attention (debugdeepseek) trains like one fp32 process under every layout
attention supports: FSDP, TP + SP, CP ring / Ulysses / hybrid (with document masks), TP x CP,
PP x TP, activation checkpointing (full, op-level, and by module under FSDP x TP + SP).

The flavor has 4 heads, qk_nope_head_dim 16 != v_head_dim 12 (so the CP kernels move and
pad values of another head dim than q/k), a low-rank query, YaRN with the softmax rescale and
MoE blocks after the first. Each case runs the real Trainer for a few steps; the per-step loss
and the first step's gradients (at the same initial weights) are compared with one process on
the same global batch. All cases share ONE 4-rank spawn (and the references one 1-rank spawn).
"""

from __future__ import annotations

import pytest
import torch

from tests.spawn import fp32_trainer_overrides, run_distributed

STEPS = 3
BASE = fp32_trainer_overrides(steps=STEPS, seq_len=32, flavor="debugdeepseek")
P = "--parallelism."
DOCS = ["--training.document_masking=true"]


def _runs(rank: int, world_size: int, runs: list[list[str]], dump_folder: str
          ) -> list[tuple[list[float], dict[str, torch.Tensor]]]:
    """Each run's per-step losses and its first step's full gradients (of the parameters this
    rank's pipeline stage holds), one Trainer after the other in one process group."""
    from torch.distributed.tensor import DTensor

    from titanext.config import load_config
    from titanext.trainer import Trainer

    def full(t: torch.Tensor) -> torch.Tensor:
        return (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()

    out = []
    for i, overrides in enumerate(runs):
        cfg = load_config(None, [*BASE, f"--job.dump_folder={dump_folder}/{i}", *overrides],
                          world_size=world_size)
        trainer = Trainer(cfg)
        grads: dict[str, torch.Tensor] = {}
        step = trainer._optimizer_step

        def first_step_grads(step=step, trainer=trainer, grads=grads) -> None:
            if not grads:  # every rank takes part in each full_tensor (a collective)
                grads.update({n: full(p.grad) for part in trainer.model_parts
                              for n, p in part.named_parameters() if p.grad is not None})
            step()

        trainer._optimizer_step = first_step_grads
        out.append((trainer.train(), grads))
    return out


# name: (overrides, which reference); every case has a global batch of 8 sequences of 32.
CASES = {
    "fsdp4": (["--training.local_batch_size=2"], "plain"),
    # recompute by module, every part (MLA's up-projections column-wise over tp, the norms
    # sequence-parallel)
    "fsdp2_x_tp2_sp_modules_ac": (["--training.local_batch_size=4", P + "tensor_parallel_degree=2",
                                   "--activation_checkpoint.mode=modules",
                                   "--activation_checkpoint.recompute_modules=layernorm,"
                                   "mla_up_proj,core_attn,moe_act,mlp,shared_experts"], "plain"),
    "cp4_ring": (["--training.local_batch_size=8", P + "context_parallel_degree=4"], "plain"),
    "cp4_ulysses": (["--training.local_batch_size=8", P + "context_parallel_degree=4",
                     P + "context_parallel_comm=alltoall"], "plain"),
    "cp4_hybrid_u2_docs": (["--training.local_batch_size=8", P + "context_parallel_degree=4",
                            P + "context_parallel_ulysses_degree=2", *DOCS], "docs"),
    "tp2_x_cp2_ring_full_ac": (["--training.local_batch_size=8", P + "tensor_parallel_degree=2",
                                P + "context_parallel_degree=2",
                                "--activation_checkpoint.mode=full"], "plain"),
    "dp2_x_cp2_allgather_selective_op_ac_docs": (
        ["--training.local_batch_size=4", P + "context_parallel_degree=2",
         P + "context_parallel_comm=allgather", "--activation_checkpoint.mode=selective",
         *DOCS], "docs"),
    "pp2_x_tp2_1F1B": (["--training.local_batch_size=8", P + "tensor_parallel_degree=2",
                        P + "pipeline_parallel_degree=2", P + "pipeline_parallel_microbatches=2",
                        P + "pipeline_parallel_schedule=1F1B"], "plain"),
}
REFS = {"plain": ["--training.local_batch_size=8"], "docs": ["--training.local_batch_size=8",
                                                              *DOCS]}
LOSS_RTOL, GRAD_RTOL = 1e-5, 1e-5


def compare(name: str, got, want) -> list[str]:
    """Why a case's (losses, gradients) differ from the reference's; empty when they agree."""
    (losses, grads), (ref_losses, ref_grads) = got, want
    problems = []
    if len(losses) != STEPS or not losses[-1] < losses[0]:
        problems.append(f"{name}: losses {losses} do not fall over {STEPS} steps")
    err = max(abs(a - b) / abs(b) for a, b in zip(losses, ref_losses, strict=True))
    if err > LOSS_RTOL:
        problems.append(f"{name}: losses {losses} vs {ref_losses} (relative error {err:.2e})")
    if grads.keys() != ref_grads.keys():
        problems.append(f"{name}: gradients of {sorted(set(ref_grads) ^ set(grads))} missing")
    for key in grads.keys() & ref_grads.keys():
        ref = ref_grads[key]
        err = ((grads[key] - ref).norm() / ref.norm()).item()
        if not err <= GRAD_RTOL:
            problems.append(f"{name}: {key}: gradient relative error {err:.2e} > {GRAD_RTOL}")
    return problems


@pytest.mark.slow
def test_mla_layouts_match_one_process(tmp_path):
    refs = dict(zip(REFS, run_distributed(_runs, 1, args=(list(REFS.values()),
                                                          str(tmp_path / "ref")),
                                          timeout_s=120)[0], strict=True))
    names = list(CASES)
    per_rank = run_distributed(_runs, 4, args=([CASES[n][0] for n in names],
                                               str(tmp_path / "run")), timeout_s=120)
    failures = []
    for i, name in enumerate(names):
        # every rank's stage parameters (ranks of one stage hold the same full gradients)
        grads = {k: v for rank_out in per_rank for k, v in rank_out[i][1].items()}
        failures += compare(name, (per_rank[0][i][0], grads), refs[CASES[name][1]])
    assert not failures, "\n".join(failures)
