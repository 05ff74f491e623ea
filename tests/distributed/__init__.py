"""Test helpers that run a body in several gloo processes (see titanext.local_launch), and the
trainer overrides the parity tests share."""

from titanext.local_launch import free_port, run_distributed

__all__ = ["free_port", "fp32_trainer_overrides", "run_distributed"]


def fp32_trainer_overrides(*, steps: int, seq_len: int, flavor: str | None = None) -> list[str]:
    """A short fp32 run on synthetic data with quiet metrics: what every layout-vs-one-process
    trainer test starts from (each adds its layout and feature overrides)."""
    return [
        *([f"--model.flavor={flavor}"] if flavor else []),
        "--training.dataset=synthetic",
        f"--training.seq_len={seq_len}",
        f"--training.steps={steps}",
        "--training.mixed_precision_param=float32",
        "--training.mixed_precision_reduce=float32",
        "--optimizer.lr=3e-3",
        "--lr_scheduler.warmup_steps=1",
        "--metrics.enable_tensorboard=false",
        "--metrics.log_freq=100",
    ]
