"""The training command line: ``torchrun --nproc_per_node N -m titanext.train --config FILE``.

It parses the config and its overrides, exits 2 on a bad config before anything starts (one
line per problem), answers ``--help`` and ``--print-config`` without importing torch, then runs
the dry run (``[comm] mode = "fake_backend"``) or the :class:`titanext.trainer.Trainer`, guarded
so that no rank waits on another rank's error.

>>> main(["--config", "train_configs/debug_model.toml", "--print-config"])  # doctest: +ELLIPSIS
# resolved titanext config ...
[job]
...
0
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Sequence

from titanext.config import ConfigError, config_help, load_config, parse_cli, to_toml
from titanext.distributed.failsafe import exit_process, print_output, report_once, run_guarded

__all__ = ["main"]  # and Trainer, loaded on first use (see __getattr__)


def __getattr__(name: str):
    # ``from titanext.train import Trainer`` keeps working without loading torch for --help.
    if name == "Trainer":
        from titanext.trainer import Trainer  # --help and a bad config never load torch

        return Trainer
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def main(argv: Sequence[str] | None = None) -> int:
    """Parse, validate (exit code 2 on a bad config, before anything starts), then train."""
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        config_path, overrides, flags = parse_cli(argv)
        if flags.get("help"):
            return print_output(config_help())
        cfg = load_config(config_path, overrides, world_size=int(os.environ.get("WORLD_SIZE", "1")))
    except ConfigError as e:
        return report_once(e.problems)  # printed by rank 0 (under torchrun too)
    if flags.get("print_config"):
        return print_output(to_toml(cfg))
    if cfg.comm.mode == "fake_backend":  # one process plays one rank of a fake world
        from titanext.launch.dry_run import dry_run  # --help and a bad config never load torch

        return dry_run(cfg)

    def run() -> None:
        # --help and a bad config never load torch
        from titanext.launch.preflight import check_preflight
        from titanext.trainer import Trainer  # --help and a bad config never load torch

        check_preflight(cfg)  # output folders and the checkpoint, before the process group
        trainer = Trainer(cfg)
        start = time.time()
        trainer.train()
        if trainer.rank == 0:
            print(f"titanext: done, {trainer.step} steps in {time.time() - start:.1f}s", flush=True)

    return run_guarded(run)  # a failing rank is printed once and never leaves peers waiting


if __name__ == "__main__":
    exit_process(main())
