"""Validation loss under FSDP, PP, CP x TP and EP equals one process on the same batches.

One process trains each model a few steps on the held-out text and saves a checkpoint; each
layout builds the real Trainer from config overrides, loads that checkpoint and runs its
Validator. All layouts share one 4-rank spawn, the references one 1-rank spawn; a last test runs
a short training loop with validation on and reads the TensorBoard scalars back.
"""

from __future__ import annotations

import json
import math

import pytest

from tests.spawn import fp32_trainer_overrides, run_distributed

SEQ = 64
# A freshly initialised model barely uses positions (wrong RoPE positions under CP move its
# loss by 7e-7); after 8 steps on the held-out text they move it by far more than 1e-5.
TRAIN_STEPS = 8
P = "--parallelism."
TINY, SMALL, MOE = "debugtiny", "debugmodel", "debugmoe"


def _validation(path: str, batch: int) -> list[str]:
    return ["--validation.enable=true", "--validation.dataset=text",
            f"--validation.dataset_path={path}", "--validation.steps=2",
            f"--validation.local_batch_size={batch}"]


def _pp(schedule: str, microbatches: int) -> list[str]:
    return [P + "pipeline_parallel_degree=2", P + f"pipeline_parallel_schedule={schedule}",
            P + f"pipeline_parallel_microbatches={microbatches}"]


# name: (flavor, layout overrides, validation local batch); every case's global batch is 4
CASES = {
    "fsdp4": (TINY, [P + "data_parallel_shard_degree=4"], 1),
    "pp2_1F1B_x_fsdp2": (TINY, [P + "data_parallel_shard_degree=2", *_pp("1F1B", 2)], 2),
    "pp2_ZBV_x_cp2": (SMALL, [P + "context_parallel_degree=2", *_pp("ZBV", 4)], 4),
    "cp2_x_tp2": (TINY, [P + "context_parallel_degree=2", P + "tensor_parallel_degree=2"], 4),
    "moe_fsdp4_ep2": (MOE, [P + "data_parallel_shard_degree=4", P + "expert_parallel_degree=2"],
                      1),
}
# Document masking (validated with in-document positions and masks, as trained), against one
# process with document masking: its own reference, keyed "debugtiny+documents".
DOCS = ["--training.document_masking=true"]
CASES["documents_cp2_x_fsdp2"] = (TINY + "+documents", [
    P + "context_parallel_degree=2", P + "data_parallel_shard_degree=2"], 2)
CASES["documents_pp2_1F1B_x_cp2"] = (TINY + "+documents", [
    P + "context_parallel_degree=2", *_pp("1F1B", 2)], 4)


def _flavor(key: str) -> list[str]:
    """The overrides of a reference key: a flavor, '+documents' adds document masking."""
    flavor, _, docs = key.partition("+")
    return [f"--model.flavor={flavor}", *(DOCS if docs else [])]


def _losses(rank: int, world_size: int, runs: list[list[str]], dump: str, train: bool
            ) -> list[dict]:
    """Each run's validation result: after training (and saving) when ``train``, else after
    loading the checkpoint the training run saved."""
    from titanext.components.validation import Validator
    from titanext.config import load_config
    from titanext.trainer import Trainer

    out = []
    for i, overrides in enumerate(runs):
        cfg = load_config(None, [*fp32_trainer_overrides(steps=TRAIN_STEPS, seq_len=SEQ),
                                 f"--job.dump_folder={dump}/{i}", *overrides],
                          world_size=world_size)
        trainer = Trainer(cfg)
        if train:
            trainer.train()
        else:
            assert trainer.checkpointer.load() == TRAIN_STEPS
        out.append(Validator(trainer).run())
    return out


def _train_with_validation(rank: int, world_size: int, overrides: list[str], dump: str):
    """A 4-step run validating every 2 steps; the TensorBoard scalars it wrote."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from titanext.config import load_config
    from titanext.trainer import Trainer

    cfg = load_config(None, [*fp32_trainer_overrides(steps=4, seq_len=SEQ), *overrides,
                             f"--job.dump_folder={dump}", "--metrics.enable_tensorboard=true",
                             "--validation.freq=2"], world_size=world_size)
    Trainer(cfg).train()
    events = EventAccumulator(f"{dump}/{cfg.metrics.save_tb_folder}")
    events.Reload()
    return {tag: [(e.step, e.value) for e in events.Scalars(tag)]
            for tag in ("validation/loss", "validation/perplexity")}


@pytest.fixture
def heldout(tmp_path):
    path = tmp_path / "heldout.jsonl"
    with path.open("w", encoding="utf-8") as f:
        for i in range(200):
            f.write(json.dumps({"text": f"Held-out document {i}: " + "all the world's a stage, "
                                * (i % 5 + 1)}) + "\n")
    return str(path)


def _trained(heldout: str, checkpoints: str, flavor: str) -> list[str]:
    """Train on the held-out text (one process) and save; the layouts load that checkpoint."""
    return ["--training.dataset=text", f"--training.dataset_path={heldout}",
            "--training.local_batch_size=4", "--checkpoint.enable=true",
            f"--checkpoint.folder={checkpoints}/{flavor}"]


@pytest.mark.slow
def test_validation_loss_matches_one_process_under_every_layout(tmp_path, heldout):
    flavors = sorted({case[0] for case in CASES.values()})
    ckpt = str(tmp_path / "checkpoints")
    refs_runs = [[*_flavor(f), *_trained(heldout, ckpt, f), *_validation(heldout, 4)]
                 for f in flavors]
    refs = dict(zip(flavors, run_distributed(_losses, 1, timeout_s=300,
                                             args=(refs_runs, str(tmp_path / "ref"), True))[0],
                    strict=True))
    names = list(CASES)
    runs = [[*_flavor(CASES[n][0]), *_trained(heldout, ckpt, CASES[n][0]), *CASES[n][1],
             *_validation(heldout, CASES[n][2])] for n in names]
    per_rank = run_distributed(_losses, 4, args=(runs, str(tmp_path / "run"), False),
                               timeout_s=300)
    failures = []
    for i, name in enumerate(names):
        ref = refs[CASES[name][0]]
        for rank, results in enumerate(per_rank):  # every rank reports the same value
            got = results[i]
            assert got["tokens"] == ref["tokens"] == 2 * 4 * SEQ, name
            if abs(got["loss"] - ref["loss"]) > 1e-5 * abs(ref["loss"]):
                failures.append(f"{name} rank {rank}: {got['loss']!r} vs {ref['loss']!r}")
            assert got["perplexity"] == pytest.approx(math.exp(got["loss"]), rel=1e-12)
    assert not failures, "\n".join(failures)


@pytest.mark.slow
def test_the_trainer_validates_every_freq_steps_to_tensorboard(tmp_path, heldout):
    # trained on the held-out text itself, so its loss must fall
    overrides = ["--training.dataset=text", f"--training.dataset_path={heldout}",
                 *_validation(heldout, 2)]
    [scalars] = run_distributed(_train_with_validation, 1, args=(overrides, str(tmp_path / "run")),
                                timeout_s=180)
    losses = scalars["validation/loss"]
    assert [s for s, _ in losses] == [2, 4]
    assert losses[1][1] < losses[0][1]
    assert [round(math.log(v), 6) for _, v in scalars["validation/perplexity"]] == \
        [round(v, 6) for _, v in losses]
