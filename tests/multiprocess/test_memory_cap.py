"""A schedule capped at one pending weight gradient (titanext.schedules.memory_cap) trains like
the uncapped one, through the real Trainer at pp = 2: both runtimes (torch's lowering of
generated lists: ZBV; titanext's chain runtime: DualPipeV), one spawn for all four runs."""

from __future__ import annotations

from tests.multiprocess.test_pipeline import BASE, _check, _merge
from tests.spawn import run_distributed, trainer_runs

CAP = "--parallelism.pipeline_parallel_max_pending_weight_grads"
SCHEDULES = ("ZBV", "DualPipeV")


def _train_and_pending(rank, world_size, runs, dump_folder):
    """Per run: (losses, parameters, the most W's pending at once in this rank's lists)."""
    from titanext.schedules.memory_cap import max_pending_weight_grads

    return trainer_runs(BASE, runs, dump_folder, world_size, collect=lambda trainer:
                        max_pending_weight_grads(trainer.pipeline.schedule.pipeline_order)[rank])


def test_capped_schedules_match_uncapped(tmp_path):
    runs = [["--model.flavor=debugmodel", "--training.local_batch_size=8",
             "--parallelism.pipeline_parallel_degree=2", f"--parallelism.pipeline_parallel_schedule"
             f"={name}", "--parallelism.pipeline_parallel_microbatches=4", f"{CAP}={cap}"]
            for name in SCHEDULES for cap in (0, 1)]
    results = run_distributed(_train_and_pending, 2, args=(runs, str(tmp_path)), timeout_s=240)
    pending = [[r[i][2] for r in results] for i in range(len(runs))]
    merged = _merge([[(losses, params) for losses, params, _ in r] for r in results])
    for k, name in enumerate(SCHEDULES):
        plain, capped = merged[2 * k], merged[2 * k + 1]
        assert max(pending[2 * k]) >= 2, f"{name}: uncapped rank 1 defers several W's"
        assert max(pending[2 * k + 1]) == 1, f"{name}: the cap holds in the lists the runtime ran"
        # only the order of W's (the summation order of dW over micro-batches) changes
        _check(plain, capped, f"{name} capped at 1", param_rtol=1e-5)
