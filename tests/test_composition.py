"""Several parallelisms in one job follow the single-process fp32 loss curve (8 CPU ranks).

Each case runs the real Trainer from config overrides for several steps and compares the
per-step loss with one process on the same global batch. These are the few large cases; the
per-feature parity tests (test_parity.py, test_context_parallel.py, test_float8_distributed.py)
cover each axis on 2-4 ranks.
"""

from __future__ import annotations

import pytest
import torch

from tests.distributed import run_distributed

STEPS = 5
BASE = [
    "--model.flavor=debugtiny",
    "--training.dataset=synthetic",
    "--training.seq_len=64",
    f"--training.steps={STEPS}",
    "--training.mixed_precision_param=float32",
    "--training.mixed_precision_reduce=float32",
    "--optimizer.lr=3e-3",
    "--lr_scheduler.warmup_steps=1",
    "--metrics.enable_tensorboard=false",
    "--metrics.log_freq=100",
]


def _losses(rank: int, world_size: int, overrides: list[str], dump_folder: str) -> list[float]:
    from titanext.config import load_config
    from titanext.train import Trainer

    cfg = load_config(None, [*BASE, f"--job.dump_folder={dump_folder}", *overrides],
                      world_size=world_size)
    return Trainer(cfg).train()


F8 = ["--float8.enable=true"]

# name: (world size, overrides, the single-process reference's overrides, loss rtol)
CASES = {
    "dp2_x_cp2_x_tp2": (8, ["--training.local_batch_size=4",
                            "--parallelism.data_parallel_shard_degree=2",
                            "--parallelism.context_parallel_degree=2",
                            "--parallelism.tensor_parallel_degree=2"],
                        ["--training.local_batch_size=8"], 1e-5),
    # Float8 scales come from what each rank holds: under CP a rank sees half of every
    # sequence, so its activation amax (and float8 rounding) differs from one process's. The
    # curve agrees to float8's rounding noise (measured 2e-5), not to fp32's.
    "dp2_x_cp2_x_tp2_float8": (8, ["--training.local_batch_size=4",
                                   "--parallelism.data_parallel_shard_degree=2",
                                   "--parallelism.context_parallel_degree=2",
                                   "--parallelism.tensor_parallel_degree=2", *F8],
                               ["--training.local_batch_size=8", *F8], 1e-4),
}


@pytest.mark.parametrize("case", list(CASES))
def test_composition_follows_the_single_process_curve(case, tmp_path):
    world_size, overrides, ref_overrides, rtol = CASES[case]
    ref = run_distributed(_losses, 1, args=(ref_overrides, str(tmp_path / "ref")))[0]
    losses = run_distributed(_losses, world_size, args=(overrides, str(tmp_path / "run")),
                             timeout_s=120)[0]
    assert len(losses) == STEPS and losses[-1] < losses[0]
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref), rtol=rtol, atol=0)
