"""Test helpers that run a body in several gloo processes, and the trainer overrides the parity
tests share. ``run_distributed`` hands the body to a worker pool that lives for the whole pytest
run (tests/pool.py): one process start-up per world size, not per test."""

from typing import Any

from tests import pool
from titanext.launch.local import free_port

__all__ = ["ADAM_EPS", "PARAM_RTOL", "assert_params_follow", "free_port", "fp32_trainer_overrides",
           "param_errors", "param_problems", "record_grad_norms", "run_distributed", "run_example",
           "trainer_runs"]


def run_distributed(fn, world_size: int, args: tuple = (), kwargs: dict | None = None,
                    timeout_s: float = 60.0) -> list[Any]:
    """``fn(rank, world_size, *args, **kwargs)`` on ``world_size`` gloo ranks (a module-level
    ``fn``); the per-rank results. ``timeout_s`` is the default group's collective timeout.
    Same contract as :func:`titanext.launch.local.run_distributed`, on pooled workers: an error
    on any rank fails the test naming it and its rank."""
    return pool.run(fn, world_size, args, kwargs, timeout_s)


#: Adam's epsilon in the layout-vs-one-process tests. Adam divides each gradient element by its
#: own magnitude (+ eps): with torch's 1e-8, an element whose gradient sits at the rounding level
#: (~1e-10, summed in another order by another layout) moves by a sizeable part of the learning
#: rate either way, and a few such elements put a whole tensor 6e-5 off after 4 steps while
#: every gradient agrees to 5e-7 (test_mtp on one CPU kind, 2026-11). With 1e-5, a gradient
#: error moves a parameter by at most lr x error / eps: the step no longer amplifies rounding,
#: and the same comparison agrees to 1e-6, while elements with real gradients still take Adam's
#: normalised step.
ADAM_EPS = 1e-5

#: The bound of a layout-vs-one-process parameter comparison after optimizer steps, for runs at
#: ADAM_EPS: whole-tensor relative error (of the update when the start is known).
PARAM_RTOL = 1e-5


def param_errors(params: dict, ref: dict, *, start: dict | None = None) -> dict[str, float]:
    """Per name in ``ref``: the parity check's measure of a parameter after optimizer steps
    against one process's (:func:`titanext.parity.report.update_error`), relative to the update
    one process made from ``start``, or without ``start`` to the tensor's own norm (a name
    missing from ``params``: inf)."""
    import torch

    from titanext.parity.report import update_error

    return {name: update_error(params[name], want,
                               torch.zeros_like(want) if start is None else start[name])
            if name in params else float("inf") for name, want in ref.items()}


def param_problems(label: str, params: dict, ref: dict, *, rtol: float = PARAM_RTOL,
                   start: dict | None = None) -> list[str]:
    """The one comparison of a layout's parameters after optimizer steps with one process's:
    one line per tensor of ``ref`` whose :func:`param_errors` is ``rtol`` or more. Meant for
    runs at :data:`ADAM_EPS` (fp32_trainer_overrides): at torch's 1e-8, Adam turns another
    summation order of a near-zero gradient into a sizeable step, and the outcome depends on
    the CPU's kernels (docs/cpu_kernel_paths.md). tests/docs/test_layout_comparisons.py fails
    on a comparison that bypasses this or another eps without a stated reason."""
    of = " (of the update)" if start is not None else ""
    return [f"{label}: {name}: relative error {err:.2e}{of} >= {rtol:g}"
            for name, err in param_errors(params, ref, start=start).items() if not err < rtol]


def assert_params_follow(label: str, params: dict, ref: dict, *, rtol: float = PARAM_RTOL,
                         start: dict | None = None) -> None:
    """:func:`param_problems`, raised as one AssertionError listing every tensor off."""
    problems = param_problems(label, params, ref, rtol=rtol, start=start)
    assert not problems, "\n".join(problems)


def record_grad_norms(trainer, norms: list) -> None:
    """Make ``trainer.train_step`` append each step's gradient norm to ``norms``."""
    step = trainer.train_step

    def recording_step(microbatches):
        loss, norm = step(microbatches)
        norms.append(norm)
        return loss, norm

    trainer.train_step = recording_step


def fp32_trainer_overrides(*, steps: int, seq_len: int, flavor: str | None = None,
                           check_steps: int | None = 1) -> list[str]:
    """A short fp32 run on synthetic data with quiet metrics: what every layout-vs-one-process
    trainer test starts from (each adds its layout and feature overrides). ``check_steps``:
    the replicated-gradient check's steps (None: the config's default)."""
    return [
        *([f"--model.flavor={flavor}"] if flavor else []),
        "--training.dataset=synthetic",
        f"--training.seq_len={seq_len}",
        f"--training.steps={steps}",
        "--training.mixed_precision_param=float32",
        "--training.mixed_precision_reduce=float32",
        "--optimizer.lr=3e-3",
        f"--optimizer.eps={ADAM_EPS}",
        "--lr_scheduler.warmup_steps=1",
        "--metrics.enable_tensorboard=false",
        "--metrics.log_freq=100",
        # the replicated-gradient check on the first step only: these tests compare every
        # step with one process, which a replica drifting later also fails (the check's own
        # steps are tests/multiprocess/test_replicated_grads.py's); 2 steps cost a third of a
        # small 8-rank case
        *([f"--parallelism.check_replicated_grads_steps={check_steps}"]
          if check_steps is not None else []),
    ]


def run_example(script, nproc: int, *args: str, cwd, timeout: float = 120):
    """``torchrun --standalone --nproc_per_node nproc script *args`` from ``cwd``; returns the
    CompletedProcess (text output). The script runs whole through a small wrapper that then
    leaves with ``os._exit`` (an error inside it still fails the run): at interpreter exit,
    gloo's threads can race C++ static destructors and abort a rank that has finished
    ("terminate called without an active exception"), which would fail a passing example."""
    import subprocess
    import sys
    from pathlib import Path

    wrapper = Path(cwd) / f"_run_{Path(script).stem}.py"
    wrapper.write_text("import os, runpy, sys\n"
                       f"runpy.run_path({str(script)!r}, run_name='__main__')\n"
                       "sys.stdout.flush(); sys.stderr.flush(); os._exit(0)\n")
    return subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node",
                           str(nproc), "--standalone", str(wrapper), *args],
                          capture_output=True, text=True, timeout=timeout, cwd=cwd)


def trainer_runs(base, runs, dump_folder: str, world_size: int, collect=None) -> list[tuple]:
    """Inside a spawned rank: one Trainer per run (``[*base, *run]`` overrides, its own dump
    folder), one after the other in this process group (start-up dominates on 2 cores).

    Per run: (per-step losses, the full parameters of this rank's model parts) and, with
    ``collect(trainer)``, what it returns as a third element. ``full_tensor()`` is a
    collective, so every rank gathers every parameter.
    """
    from torch.distributed.tensor import DTensor

    from titanext.config import load_config
    from titanext.trainer import Trainer

    out = []
    for i, overrides in enumerate(runs):
        cfg = load_config(None, [*base, f"--job.dump_folder={dump_folder}/{i}", *overrides],
                          world_size=world_size)
        trainer = Trainer(cfg)
        losses = trainer.train()
        params = {name: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
                  for part in trainer.model_parts for name, p in part.named_parameters()}
        out.append((losses, params) if collect is None else (losses, params, collect(trainer)))
    return out


def check_one_schedule_everywhere(trainer) -> None:
    """Inside a spawned rank, after training: a schedule that measures its costs (Auto) must
    have searched its lists from the same figures on every rank; data-parallel replicas that
    searched from their own timings would run their stages' FSDP collectives in different
    orders. A collective: every rank of the run calls it."""
    import torch.distributed as dist

    costs = trainer.pipeline.costs if trainer.pipeline is not None else None
    if costs is None:
        return
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, costs)
    assert all(c == everyone[0] for c in everyone), \
        f"Auto's measured costs differ between ranks: {everyone}"


def stage_runs(base, runs, dump_folder: str, world_size: int) -> list[tuple]:
    """:func:`trainer_runs` keeping the parameters only on each pipeline stage's first rank (its
    other mesh coordinates 0): per run, (per-step losses, full parameters or {}). Checks
    :func:`check_one_schedule_everywhere` on every run."""
    def first_of_stage(trainer) -> bool:
        check_one_schedule_everywhere(trainer)
        mesh = trainer.dims.world_mesh
        coords = zip(mesh.mesh_dim_names, mesh.get_coordinate(), strict=True)
        return all(c == 0 for name, c in coords if name != "pp")

    return [(losses, params if keep else {}) for losses, params, keep in
            trainer_runs(base, runs, dump_folder, world_size, collect=first_of_stage)]
