"""The trainer with [training] dataset = "hf" and [metrics] enable_wandb on 2 gloo ranks.

Reference: the same 2-rank run reading the same .jsonl file as dataset = "text" (the streaming
text source reads it into the same windows), uninterrupted. The "hf" run stops at step 3 (a
checkpoint), resumes, and must give the reference's losses bitwise; its wandb runs (one per
launch, rank 0 only, offline) must hold what TensorBoard got.
"""

from __future__ import annotations

import json
import os

import pytest

from tests.spawn import fp32_trainer_overrides, run_distributed

pytest.importorskip("datasets")
pytest.importorskip("wandb")

from tests.unit.test_metrics_wandb import tensorboard_scalars, wandb_history  # noqa: E402

STEPS = 6  # 4 windows of 32 tokens a step; blocks of 8 windows: step 3 is mid-block 2


def _train(rank, world_size, overrides, folder, until_step=None):
    from titanext.config import load_config
    from titanext.data import streaming
    from titanext.trainer import Trainer

    block_tokens, streaming.BLOCK_TOKENS = streaming.BLOCK_TOKENS, 256  # the resume seeks
    env = {"WANDB_MODE": "offline", "WANDB_SILENT": "true", "WANDB_CONSOLE": "off"}
    saved = {k: os.environ.get(k) for k in [*env, "WANDB_DIR"]}
    os.environ.update(env)
    os.environ.pop("WANDB_DIR", None)  # under job.dump_folder
    try:
        cfg = load_config(None, [*fp32_trainer_overrides(steps=STEPS, seq_len=32),
                                 "--model.flavor=debugtiny", "--training.local_batch_size=2",
                                 f"--job.dump_folder={folder}", *overrides],
                          world_size=world_size)
        return Trainer(cfg).train(until_step=until_step)
    finally:
        streaming.BLOCK_TOKENS = block_tokens
        for k, v in saved.items():
            os.environ.pop(k, None) if v is None else os.environ.__setitem__(k, v)


@pytest.mark.slow
def test_hf_dataset_and_wandb_through_the_trainer_with_a_resume(tmp_path):
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("".join(json.dumps({"text": f"Document {i}: " + "to be or not " * (i % 4)})
                              + "\n" for i in range(300)), encoding="utf-8")
    text = ["--training.dataset=text", f"--training.dataset_path={corpus}"]
    hf = ["--training.dataset=hf", f"--training.dataset_path={corpus}",
          "--metrics.enable_wandb=true", "--metrics.enable_tensorboard=true",
          "--metrics.log_freq=1", "--checkpoint.enable=true", "--checkpoint.interval=3"]
    run = tmp_path / "hf"
    reference = run_distributed(_train, 2, args=(text, str(tmp_path / "text")), timeout_s=60)[0]
    first = run_distributed(_train, 2, args=(hf, str(run)), kwargs={"until_step": 3})[0]
    rest = run_distributed(_train, 2, args=(hf, str(run)))[0]
    assert len(reference) == STEPS and first + rest == reference  # bitwise: same windows

    runs = sorted(run.glob("wandb/offline-run-*"))
    assert len(runs) == 2  # one per launch: rank 0 only
    tb = tensorboard_scalars(run / "tb")
    wb: dict[int, dict[str, float]] = {}
    for one in runs:  # the second launch starts at step 4
        for step, row in wandb_history(one.parent.parent, one.name).items():
            wb.setdefault(step, {}).update(row)
    assert sorted(wb) == sorted(tb) == list(range(1, STEPS + 1))
    for step, scalars in tb.items():
        assert set(wb[step]) == set(scalars), step
        for name, value in scalars.items():
            assert value == pytest.approx(wb[step][name], rel=1e-7, abs=0), (step, name)
        assert wb[step]["loss"] == pytest.approx(reference[step - 1], rel=1e-7, abs=0)
