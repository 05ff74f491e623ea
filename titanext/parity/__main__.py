"""python -m titanext.parity: a model and its wiring against one process (see the package).

    python -m titanext.parity --model mypkg.lm:build --wiring mypkg.lm:wire --world-size 2 \\
        --mesh-names tp [--mesh-shape 2 --steps 2 --tol 1e-4 --batch 4 --seq 16 ...]

``--model`` / ``--wiring`` / ``--loss`` are ``module:function`` or ``path/to/file.py:function``.
Exit 0 when within tolerance, 1 when not, 2 on bad arguments (one line each).
"""

from __future__ import annotations

import argparse
import importlib
import sys
from pathlib import Path

from titanext.parity import ParityCheck, check_all, lm_loss, problems_of

PROG = "python -m titanext.parity"


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line, no usage block
        print(f"{PROG}: {message}", file=sys.stderr)
        raise SystemExit(2)


def _parser() -> argparse.ArgumentParser:
    p = _Parser(prog=PROG, description="Run your model with your parallel wiring in N local "
                "gloo processes and compare it with one process on the same batches.")
    p.add_argument("--model", required=True, help="module:function (or file.py:function) "
                   "returning the model")
    p.add_argument("--wiring", required=True, help="module:function(model, ctx) applying "
                   "your parallelism and returning the module to train")
    p.add_argument("--loss", help="module:function(wired, inputs, labels, ctx) per rank "
                   "(default: a causal LM's cross entropy)")
    p.add_argument("--world-size", type=int, required=True, help="number of processes")
    p.add_argument("--mesh-shape", help="comma-separated mesh dims (default: world size)")
    p.add_argument("--mesh-names", default="dp", help="comma-separated mesh dim names "
                   "(default: dp); tp, dp_shard/fsdp, ep, cp, pp must then actually run")
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--tol", type=float, default=1e-4, help="largest relative error allowed")
    p.add_argument("--batch", type=int, default=4, help="global batch (sequences)")
    p.add_argument("--seq", type=int, default=16, help="sequence length")
    p.add_argument("--vocab", type=int, help="token ids drawn below this (default: the "
                   "model's first nn.Embedding)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--optimizer", default="sgd", help="sgd or adamw")
    p.add_argument("--lr", type=float, default=0.1)
    p.add_argument("--expect", help="comma-separated mesh dims whose parallelism must run, "
                   "and converters that must have converted a module (float8, deferred) "
                   "(default: every dim of size > 1); 'none' for no such check")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds for the whole run")
    p.add_argument("--traceback", action="store_true", help="when a rank fails, also print "
                   "the traceback of the rank that failed first")
    return p


def load_function(spec: str, flag: str):
    """The function ``module:name`` or ``path/file.py:name`` names; ValueError if not."""
    target, sep, name = spec.rpartition(":")
    if not sep or not target or not name:
        raise ValueError(f"{flag} {spec!r}: expected module:function or path/file.py:function")
    if target.endswith(".py"):
        path = Path(target).resolve()
        if not path.is_file():
            raise ValueError(f"{flag} {spec!r}: no file {target}")
        sys.path.insert(0, str(path.parent))  # the workers import it by the same name
        target = path.stem
    try:
        module = importlib.import_module(target)
    except ImportError as e:
        raise ValueError(f"{flag} {spec!r}: cannot import {target} ({e})") from None
    fn = getattr(module, name, None)
    if not callable(fn):
        raise ValueError(f"{flag} {spec!r}: {target} has no function {name!r}")
    return fn


def _ints(text: str | None, flag: str) -> tuple[int, ...] | None:
    if text is None:
        return None
    try:
        return tuple(int(x) for x in text.split(","))
    except ValueError:
        raise ValueError(f"{flag} {text!r}: expected comma-separated integers") from None


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)

    problems, fns = [], {}
    for key, flag in (("model", "--model"), ("wiring", "--wiring"), ("loss", "--loss")):
        if getattr(args, key) is not None:
            try:
                fns[key] = load_function(getattr(args, key), flag)
            except ValueError as e:
                problems.append(str(e))
    try:
        shape = _ints(args.mesh_shape, "--mesh-shape")
    except ValueError as e:
        problems.append(str(e))
        shape = None
    expect = None if args.expect is None else (
        () if args.expect == "none" else tuple(args.expect.split(",")))
    c = ParityCheck(build=fns.get("model"), wiring=fns.get("wiring"),
                    world_size=args.world_size, mesh_shape=shape,
                    mesh_names=tuple(args.mesh_names.split(",")),
                    loss_fn=fns.get("loss", lm_loss), steps=args.steps, tol=args.tol,
                    batch=args.batch, seq=args.seq, vocab=args.vocab, seed=args.seed,
                    optimizer=args.optimizer, lr=args.lr, expect=expect)
    problems += problems_of(c)
    if problems:
        for line in problems:
            print(f"{PROG}: {line}", file=sys.stderr)
        return 2
    try:
        report = check_all([c], timeout_s=args.timeout)[0]
    except ValueError as e:  # e.g. no vocabulary to draw token ids from
        print(f"{PROG}: {e}", file=sys.stderr)
        return 2
    print(report)
    if args.traceback and report.traceback:
        print(f"\ntraceback of the failing {report.traceback}")
    elif report.traceback:
        print("(--traceback shows the failing rank's traceback)")
    return 0 if report.ok else 1


if __name__ == "__main__":
    sys.exit(main())
