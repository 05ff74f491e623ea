"""The parity check's settings (:class:`ParityCheck`), their problems (:func:`problems_of`), and
the runs: :func:`check` for one check, :func:`check_all` for several in one set of processes.
See :mod:`titanext.parity` for the whole story.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from math import prod
from typing import Any

from torch import nn

from titanext.launch.local import run_distributed
from titanext.parity._run import RunSpec, run_ranks, run_reference
from titanext.parity.context import DATA_DIMS, ParityContext, lm_loss, reference_lm_loss
from titanext.parity.report import EXPECTATIONS, ParityReport, build_report

__all__ = ["OPTIMIZERS", "ParityCheck", "check", "check_all", "problems_of"]

OPTIMIZERS = ("sgd", "adamw")


@dataclass
class ParityCheck:
    """One check's settings (see :func:`check` for their meaning)."""

    build: Callable[[], nn.Module]
    wiring: Callable[[nn.Module, ParityContext], Any]
    world_size: int = 2
    mesh_shape: Sequence[int] | None = None
    mesh_names: Sequence[str] = ("dp",)
    loss_fn: Callable = lm_loss
    reference_loss: Callable = reference_lm_loss
    steps: int = 2
    tol: float = 1e-4
    batch: int = 4
    seq: int = 16
    vocab: int | None = None
    seed: int = 0
    optimizer: str = "sgd"
    lr: float = 0.1
    data_dims: Sequence[str] | None = None
    expect: Sequence[str] | None = None
    extra: dict = field(default_factory=dict)

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.mesh_shape) if self.mesh_shape is not None else (self.world_size,)


def problems_of(c: ParityCheck) -> list[str]:
    """One line per bad setting (naming it, the value and what is allowed); empty if fine."""
    out = []
    shape, names = c.shape, tuple(c.mesh_names)
    if c.world_size < 1:
        out.append(f"world_size = {c.world_size}: must be >= 1")
    if len(shape) != len(names):
        out.append(f"mesh_shape = {shape} and mesh_names = {names}: give one name per dim")
    elif prod(shape) != c.world_size:
        out.append(f"mesh_shape = {shape}: its product {prod(shape)} must equal world_size = "
                   f"{c.world_size}")
    if len(set(names)) != len(names):
        out.append(f"mesh_names = {names}: names must be distinct")
    for key in ("steps", "batch", "seq"):
        if getattr(c, key) < 1:
            out.append(f"{key} = {getattr(c, key)}: must be >= 1")
    if not c.tol > 0:
        out.append(f"tol = {c.tol}: must be > 0")
    if c.optimizer not in OPTIMIZERS:
        out.append(f"optimizer = {c.optimizer!r}: allowed: {', '.join(OPTIMIZERS)}")
    for name in c.expect or ():
        if name not in EXPECTATIONS:
            out.append(f"expect = {name!r}: allowed: {', '.join(EXPECTATIONS)}")
    if len(shape) == len(names):
        sizes = dict(zip(names, shape))
        data = c.data_dims if c.data_dims is not None else [n for n in names if n in DATA_DIMS]
        rows = prod(sizes.get(n, 1) for n in data)
        if c.batch % rows:
            out.append(f"batch = {c.batch}: must be divisible by the {rows} row shards of the "
                       f"data dims {tuple(data)}")
        cp = sizes.get("cp", 1)
        if cp > 1 and c.seq % (2 * cp):
            out.append(f"seq = {c.seq}: must be divisible by 2 x cp = {2 * cp} (zigzag)")
    return out


def _vocab(c: ParityCheck) -> int:
    if c.vocab is not None:
        return c.vocab
    for m in c.build().modules():
        if isinstance(m, nn.Embedding):
            return m.num_embeddings
    raise ValueError("the model has no nn.Embedding to take the vocabulary size from; "
                     "pass vocab= (--vocab)")


def check_all(checks: Sequence[ParityCheck], *, timeout_s: float = 120.0) -> list[ParityReport]:
    """Run several checks of the same ``world_size`` in one set of processes (one spawn),
    each against its own one-process reference. Raises ValueError on bad settings."""

    if not checks:
        return []
    sizes = {c.world_size for c in checks}
    problems = [p for c in checks for p in problems_of(c)]
    if len(sizes) > 1:
        problems.append(f"check_all: every check needs the same world_size, got {sorted(sizes)}")
    if problems:
        raise ValueError("; ".join(problems))
    specs = [RunSpec(build=c.build, wiring=c.wiring, loss_fn=c.loss_fn, mesh_shape=c.shape,
                     mesh_names=tuple(c.mesh_names),
                     data_dims=None if c.data_dims is None else tuple(c.data_dims),
                     steps=c.steps, batch=c.batch, seq=c.seq, vocab=_vocab(c), seed=c.seed,
                     optimizer=c.optimizer, lr=c.lr) for c in checks]
    refs = [run_reference(s, c.reference_loss) for s, c in zip(specs, checks)]
    per_rank = run_distributed(run_ranks, checks[0].world_size, args=(specs,),
                               timeout_s=timeout_s)
    # A check that failed on some ranks only ended the process group (no rank left waiting):
    # the checks after it run again in new processes.
    while rerun := [i for i, r in enumerate(per_rank[0]) if r.get("rerun")]:
        again = run_distributed(run_ranks, checks[0].world_size,
                                args=([specs[i] for i in rerun],), timeout_s=timeout_s)
        for rank, results in enumerate(again):
            for i, result in zip(rerun, results):
                per_rank[rank][i] = result
    return [build_report([r[i] for r in per_rank], ref, tol=c.tol,
                         mesh=dict(zip(c.mesh_names, c.shape)), expect=c.expect)
            for i, (c, ref) in enumerate(zip(checks, refs))]


def check(build: Callable[[], nn.Module], wiring: Callable[[nn.Module, ParityContext], Any], *,
          world_size: int = 2, mesh_shape: Sequence[int] | None = None,
          mesh_names: Sequence[str] = ("dp",), loss_fn: Callable = lm_loss,
          reference_loss: Callable = reference_lm_loss, steps: int = 2, tol: float = 1e-4,
          batch: int = 4, seq: int = 16, vocab: int | None = None, seed: int = 0,
          optimizer: str = "sgd", lr: float = 0.1, data_dims: Sequence[str] | None = None,
          expect: Sequence[str] | None = None, timeout_s: float = 120.0) -> ParityReport:
    """Train ``build()`` wired by ``wiring`` in ``world_size`` gloo processes for ``steps``
    steps, and the same model unwired in this process, on the same global batches.

    Args:
        build: returns the model (called after ``torch.manual_seed(seed)``, on every rank and
            for the reference; must be importable, i.e. defined at module level).
        wiring: ``wiring(model, ctx) -> module`` (or a pipeline object with ``.parts``): your
            parallelism over ``ctx.mesh`` (:class:`ParityContext`).
        world_size / mesh_shape / mesh_names: the processes and the DeviceMesh built for the
            wiring (default: one dim named ``dp`` over every rank).
        loss_fn: ``loss_fn(wired, inputs, labels, ctx)``, per rank (default :func:`lm_loss`).
        reference_loss: ``reference_loss(model, inputs, labels)`` for the one process.
        steps / batch / seq / vocab / seed: the run; the batch is ``batch`` x ``seq`` random
            token ids (vocab: from the model's first nn.Embedding unless given).
        tol: the largest relative error allowed, for losses, gradients and parameters.
        optimizer / lr: "sgd" (parameter errors then equal gradient errors) or "adamw".
        data_dims: mesh dims that split the batch rows (default: those named as in DATA_DIMS).
        expect: mesh dims whose parallelism must have run (default: every dim of size > 1
            among tp, dp_shard, fsdp, ep, cp, pp).

    Returns the :class:`ParityReport` (``print`` it; ``.ok``). Raises ValueError on bad
    settings, naming each.

    >>> report = check(build, wire, world_size=2, mesh_names=("tp",))  # spawns  # doctest: +SKIP
    """
    c = ParityCheck(build=build, wiring=wiring, world_size=world_size, mesh_shape=mesh_shape,
                    mesh_names=mesh_names, loss_fn=loss_fn, reference_loss=reference_loss,
                    steps=steps, tol=tol, batch=batch, seq=seq, vocab=vocab, seed=seed,
                    optimizer=optimizer, lr=lr, data_dims=data_dims, expect=expect)
    return check_all([c], timeout_s=timeout_s)[0]
