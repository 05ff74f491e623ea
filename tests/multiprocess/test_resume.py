"""Checkpoints through the trainer: exact resume, resume under another layout, faults."""

from __future__ import annotations

import os

import pytest
import torch

from tests.spawn import run_distributed

BASE = [
    "--model.flavor=debugtiny",
    "--training.dataset=synthetic",
    "--training.seq_len=32",
    "--training.steps=8",
    "--training.local_batch_size=2",
    "--training.mixed_precision_param=float32",
    "--optimizer.lr=3e-3",
    "--lr_scheduler.warmup_steps=2",
    "--metrics.enable_tensorboard=false",
    "--metrics.log_freq=100",
    "--checkpoint.enable=true",
    "--checkpoint.interval=4",
]


def _run(rank, world_size, overrides, folder, until_step=None):
    from titanext.config import load_config
    from titanext.trainer import Trainer

    cfg = load_config(None, [*BASE, f"--job.dump_folder={folder}", *overrides],
                      world_size=world_size)
    trainer = Trainer(cfg)
    return trainer.train(until_step=until_step)


# Muon: its momentum buffers (DTensors like their parameters) and the owners' exchange, in
# torch.optim.Muon's bfloat16
@pytest.mark.parametrize("optimizer", [[], ["--optimizer.name=Muon",
                                            "--optimizer.muon_ns_dtype=bfloat16"]],
                         ids=["AdamW", "Muon"])
def test_stop_and_resume_reproduces_the_uninterrupted_curve_exactly(tmp_path, optimizer):
    full = run_distributed(_run, 4, args=(optimizer, str(tmp_path / "a")))[0]
    first = run_distributed(_run, 4, args=(optimizer, str(tmp_path / "b")),
                            kwargs={"until_step": 4})[0]
    rest = run_distributed(_run, 4, args=(optimizer, str(tmp_path / "b")))[0]
    assert len(first) == 4 and len(rest) == 4
    assert first + rest == full  # bitwise: same layout, same order of operations


def test_bf16_adam_moments_resume_bitwise_under_fsdp(tmp_path):
    """[optimizer] state_dtype = "bfloat16" under FSDP over 2 ranks: the stopped and resumed run
    is the uninterrupted one bit for bit (the moments round to nearest, and the checkpoint keeps
    them in bf16), and differs from fp32 moments' curve."""
    bf16 = ["--optimizer.state_dtype=bfloat16"]
    full = run_distributed(_run, 2, args=(bf16, str(tmp_path / "a")))[0]
    run_distributed(_run, 2, args=(bf16, str(tmp_path / "b")), kwargs={"until_step": 4})
    rest = run_distributed(_run, 2, args=(bf16, str(tmp_path / "b")))[0]
    assert rest == full[4:]
    fp32 = run_distributed(_run, 2, args=([], str(tmp_path / "c")), kwargs={"until_step": 3})[0]
    assert fp32[:2] == full[:2] and fp32[2] != full[2]  # step 2's update reads rounded moments


def test_resume_under_another_layout_continues_the_curve(tmp_path):
    """Saved with dp_shard=4, resumed with dp_shard=2 x tp=2."""
    full = run_distributed(_run, 4, args=([], str(tmp_path / "a")))[0]
    run_distributed(_run, 4, args=([], str(tmp_path / "b")), kwargs={"until_step": 4})
    rest = run_distributed(
        _run, 4, args=(["--parallelism.tensor_parallel_degree=2", "--training.local_batch_size=4"],
                       str(tmp_path / "b")))[0]
    torch.testing.assert_close(torch.tensor(rest), torch.tensor(full[4:]), rtol=1e-5, atol=0)


def _diverge(rank, world_size, folder):
    from titanext.config import load_config
    from titanext.trainer import Trainer, TrainingDiverged

    cfg = load_config(None, [*BASE, f"--job.dump_folder={folder}", "--checkpoint.interval=1"],
                      world_size=world_size)
    trainer = Trainer(cfg)
    real = trainer.compute_loss

    def poisoned(logits, labels):
        loss = real(logits, labels)
        return loss * float("nan") if trainer.step == 2 else loss  # the 3rd step goes NaN

    trainer.compute_loss = poisoned
    try:
        trainer.train()
    except TrainingDiverged as e:
        return str(e), trainer.checkpointer.latest_step(), trainer.step
    return None


def test_nan_loss_stops_the_run_and_keeps_the_last_good_checkpoint(tmp_path):
    results = run_distributed(_diverge, 2, args=(str(tmp_path),))
    for message, latest, step in results:
        assert "step 3" in message and "nan" in message.lower()
        assert latest == 2 and step == 2
    # ... and that checkpoint loads: a fresh run resumes from step 2.
    rest = run_distributed(_run, 2, args=([], str(tmp_path)))[0]
    assert len(rest) == 6


def _crash_in_save(rank, world_size, folder):
    import titanext.components.checkpoint as ckpt
    from titanext.config import load_config
    from titanext.trainer import Trainer

    cfg = load_config(None, [*BASE, f"--job.dump_folder={folder}", "--checkpoint.interval=2"],
                      world_size=world_size)
    trainer = Trainer(cfg)
    trainer.train(until_step=2)
    real_save = ckpt.dcp.save

    def crash(*a, **k):
        real_save(*a, **k)
        raise KeyboardInterrupt  # Ctrl-C after the data was written, before the commit

    ckpt.dcp.save = crash
    try:
        trainer.train(until_step=4)
    except KeyboardInterrupt:
        pass
    ckpt.dcp.save = real_save
    return trainer.checkpointer.latest_step()


@pytest.mark.slow
def test_crash_during_save_leaves_the_previous_checkpoint_loadable(tmp_path):
    latest = run_distributed(_crash_in_save, 1, args=(str(tmp_path),))[0]
    assert latest == 2
    rest = run_distributed(_run, 1, args=([], str(tmp_path)))[0]
    assert len(rest) == 6


# -- async saves: the resume bar on every layout ---------------------------------------------------
ASYNC_LAYOUTS = {
    # name: (async_mode, overrides); 4 ranks, a global batch of 8 sequences
    "fsdp4": ("async_with_pinned_mem", []),
    "fsdp2_x_tp2": ("async", ["--parallelism.tensor_parallel_degree=2",
                              "--training.local_batch_size=4"]),
    "pp2_x_fsdp2": ("async", ["--parallelism.pipeline_parallel_degree=2",
                              "--training.local_batch_size=4"]),
    "ep2_x_fsdp4": ("async", ["--model.flavor=debugmoe", "--parallelism.expert_parallel_degree=2"]),
}


def _async_resume(rank, world_size, mode, overrides, folder):
    """An uninterrupted run, then the same run stopped after step 3 and resumed from step 2 by
    a new Trainer; every save async. Returns (losses, full params) of both, and the steps on disk
    after the stop."""
    from torch.distributed.tensor import DTensor

    from titanext.config import load_config
    from titanext.trainer import Trainer

    def trainer(sub):
        cfg = load_config(None, [*BASE, "--training.steps=4", "--checkpoint.interval=2",
                                 f"--checkpoint.async_mode={mode}", *overrides,
                                 f"--job.dump_folder={folder}/{sub}"], world_size=world_size)
        return Trainer(cfg)

    def params(t):
        return {n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
                for part in t.model_parts for n, p in part.named_parameters()}

    def run(sub, until_step=None):
        t = trainer(sub)
        losses = t.train(until_step=until_step)
        t.checkpointer.close()  # the async writers' group and threads
        return t, losses

    full, full_losses = run("a")
    first = run("b", until_step=3)[1]  # step 3 trains while step 2's save may be writing
    saved = sorted(os.listdir(f"{folder}/b/checkpoint"))
    rest, rest_losses = run("b")
    return full_losses, params(full), first[:2] + rest_losses, params(rest), saved


@pytest.mark.parametrize("layout", list(ASYNC_LAYOUTS))
def test_resume_from_an_async_checkpoint_equals_the_uninterrupted_run(tmp_path, layout):
    mode, overrides = ASYNC_LAYOUTS[layout]
    results = run_distributed(_async_resume, 4, args=(mode, overrides, str(tmp_path)),
                              timeout_s=120)
    for rank, (full_losses, full_params, losses, params, saved) in enumerate(results):
        assert saved == ["step-2"]  # committed when train() returned, no .tmp left
        assert len(losses) == 4 and losses == full_losses  # bitwise
        assert params.keys() == full_params.keys()  # this rank's stages (pipeline) in full
        for name, want in full_params.items():
            assert torch.equal(params[name], want), f"rank {rank}: {name}"


def _export_then_start_from_it(rank, world_size, dtype, folder):
    """FSDP 2: train 2 steps with a weights-only last save in ``dtype``, then build a new run
    from it (initial_load_path); both runs' full parameters."""
    from torch.distributed.tensor import DTensor

    from titanext.config import load_config
    from titanext.trainer import Trainer

    def params(t):
        return {n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
                for part in t.model_parts for n, p in part.named_parameters()}

    cfg = load_config(None, [*BASE, "--training.steps=2", "--checkpoint.model_weights_only=true",
                             f"--checkpoint.export_dtype={dtype}", f"--job.dump_folder={folder}"],
                      world_size=world_size)
    first = Trainer(cfg)
    first.train()
    files = sorted(os.listdir(f"{folder}/checkpoint/step-2"))
    cfg = load_config(None, [*BASE, "--checkpoint.enable=false",
                             f"--checkpoint.initial_load_path={folder}/checkpoint/step-2",
                             f"--job.dump_folder={folder}/new"], world_size=world_size)
    new = Trainer(cfg)
    new.train(until_step=0)  # loads the initial weights, trains nothing
    return params(first), params(new), files


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_weights_only_export_starts_a_new_run_with_the_cast_weights(tmp_path, dtype):
    trained, started, files = run_distributed(_export_then_start_from_it, 2,
                                              args=(dtype, str(tmp_path)))[0]
    assert files == [".metadata", "__0_0.distcp", "__1_0.distcp", "manifest.json"]  # model only
    for name, want in trained.items():
        cast = want.to(getattr(torch, dtype)).float()
        assert started[name].dtype == torch.float32 and torch.equal(started[name], cast), name
    assert any(not torch.equal(trained[n], started[n]) for n in trained) == (dtype != "float32")
