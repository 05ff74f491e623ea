"""``titanext-run [torchrun options] --config FILE [overrides]``: validate, then torchrun.

The launcher (the console script ``titanext-run``, also ``python -m titanext.launch``) loads
the config for the world size torchrun will create, ``nnodes x nproc_per_node``, and checks
everything that can be checked before a process starts: every config rule (the world-size rules
included), the output folders (they must be creatable and writable) and the checkpoint to resume
from. On a problem it prints titanext's lines only and exits 2, before any worker exists.
Otherwise it hands the same options to torch's own torchrun entry (``torch.distributed.run``)
with ``-m titanext.train``::

    titanext-run --standalone --nproc_per_node 4 \\
        --config train_configs/debug_model.toml --training.steps=20

runs exactly ``torchrun --standalone --nproc_per_node 4 -m titanext.train --config ...``.
With an elastic node range (``--nnodes 1:4``) the world size is unknown until the rendezvous:
then the launcher checks the config with the *largest* world size, ``max_nodes x
nproc_per_node``, says so in one line, and each worker checks its own world size again at
start-up (``titanext.train`` always validates too).
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

from titanext.config import config_help, load_config, parse_cli, to_toml
from titanext.errors import ConfigError
from titanext.launch.preflight import preflight_problems

__all__ = ["main", "split_argv", "world_size_of"]

USAGE = ("usage: titanext-run [torchrun options] --config FILE [--section.key=value ...]"
         "\n       (python -m titanext.launch is the same command)")


def _starts_titanext_args(arg: str) -> bool:
    """True for the first argument that belongs to titanext.train, not to torchrun.

    torchrun's option names have no dots, titanext's overrides always do (``--section.key``).
    """
    name = arg.split("=", 1)[0]
    return name in ("--config", "--print-config", "--") or (name.startswith("--") and "." in name)


def split_argv(argv: Sequence[str]) -> tuple[list[str], list[str]]:
    """(torchrun options, titanext.train arguments); an optional ``--`` separates them.

    >>> split_argv(["--nproc_per_node", "2", "--config", "a.toml", "--training.steps=5"])
    (['--nproc_per_node', '2'], ['--config', 'a.toml', '--training.steps=5'])
    """
    argv = list(argv)
    for i, arg in enumerate(argv):
        if _starts_titanext_args(arg):
            return argv[:i], argv[i + 1:] if arg == "--" else argv[i:]
    return argv, []


def world_size_of(nnodes: str, nproc_per_node: str) -> tuple[int, str | None]:
    """(world size to validate with, a note when it is an upper bound), from torchrun's options.

    ``--nnodes N`` (or ``N:N``) x ``--nproc_per_node M`` is exact. An elastic range ``MIN:MAX``
    gives the largest world size and a note. ``nproc_per_node`` may be a number or torchrun's
    ``cpu`` / ``gpu`` / ``auto``, resolved the way torchrun resolves it. Raises ConfigError.

    >>> world_size_of("2", "4")
    (8, None)
    """
    # titanext-run checks its arguments before loading torch
    from torch.distributed.run import determine_local_world_size, parse_min_max_nnodes

    try:
        min_nodes, max_nodes = parse_min_max_nnodes(nnodes)
    except (ValueError, RuntimeError):
        raise ConfigError(f"--nnodes {nnodes!r} is not a node count N or a range MIN:MAX") from None
    try:
        per_node = determine_local_world_size(nproc_per_node)
    except ValueError as e:
        raise ConfigError(f"--nproc_per_node {nproc_per_node!r}: {e}; use a number of processes, "
                          "or cpu / gpu / auto") from None
    if min_nodes < 1 or max_nodes < min_nodes or per_node < 1:
        raise ConfigError(f"--nnodes {nnodes!r} x --nproc_per_node {nproc_per_node!r} gives no "
                          "process; both must be >= 1 (MIN <= MAX for a range)")
    note = None
    if min_nodes != max_nodes:
        note = (f"--nnodes {nnodes} is elastic: the config was checked for the largest world "
                f"size, {max_nodes} x {per_node} = {max_nodes * per_node}; each worker checks "
                "its actual world size again at start-up")
    return max_nodes * per_node, note


def _check(train_args: list[str], world_size: int) -> tuple[object | None, dict[str, bool]]:
    """Load, validate and preflight the config; (JobConfig or None for --help, flags)."""

    config_path, overrides, flags = parse_cli(train_args)
    if flags.get("help"):
        return None, flags
    cfg = load_config(config_path, overrides, world_size=world_size)
    problems = preflight_problems(cfg)
    if problems:
        raise ConfigError(problems)
    return cfg, flags


def main(argv: Sequence[str] | None = None) -> int:
    """Validate (exit 2 on any problem, nothing started), then run torchrun's own launcher."""
    argv = list(sys.argv[1:] if argv is None else argv)
    torchrun_args, train_args = split_argv(argv)
    if any(a in ("-h", "--help") for a in torchrun_args):
        print(USAGE)
        print("torchrun options: `torchrun --help`; config keys: `python -m titanext.train --help`")
        return 0
    if not any(a.split("=", 1)[0] == "--config" for a in train_args):
        print(f"titanext: config error: --config FILE is missing\n{USAGE}", file=sys.stderr)
        return 2
    # titanext-run checks its arguments before loading torch
    from torch.distributed.run import get_args_parser

    parser = get_args_parser()
    parser.prog = "titanext-run"
    # torchrun's own parser reads its options (so every spelling torchrun accepts works here);
    # the script is always titanext.train, with titanext's arguments behind it.
    args = parser.parse_args([*torchrun_args, "-m", "titanext.train", *train_args])
    try:
        world_size, note = world_size_of(args.nnodes, args.nproc_per_node)
        cfg, flags = _check(train_args, world_size)
    except ConfigError as e:
        for problem in e.problems:
            print(f"titanext: config error: {problem}", file=sys.stderr)
        return 2
    if cfg is None:  # --help after --config: the config reference

        print(config_help())
        return 0
    if flags.get("print_config"):

        print(to_toml(cfg))
        return 0
    if note:
        print(f"titanext: {note}", flush=True)
    return _hand_over(args)


def _hand_over(args) -> int:
    """torchrun's ``run``; a failed worker gives torchrun's summary and that worker's exit code."""
    # titanext-run checks its arguments before loading torch
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import run  # titanext-run checks its arguments before loading torch

    try:
        run(args)
    except ChildFailedError as e:
        print(e.format_msg(), file=sys.stderr, flush=True)
        codes = [f.exitcode for f in e.failures.values() if f.exitcode and f.exitcode > 0]
        return codes[0] if codes else 1
    return 0


def console_main() -> None:
    """Entry point of the ``titanext-run`` console script."""
    sys.exit(main())


if __name__ == "__main__":
    console_main()
