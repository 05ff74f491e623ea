"""The wiring-time probe: does a rewritten model (a pipeline stage, a model under TP or CP)
compute what the original did, module by module, on a small probe batch?

The replicated-gradient check cannot see an adapter that drops a model's own factor (Granite's
``embedding_multiplier``), runs a block under another layer's mask (Gemma 3's ``layer_types``)
or replaces a module's own forward: every rank agrees, and all are wrong. The probe runs the
original and the rewritten computation once, without gradients, records every module's output
by FQN, and names the first module (in the original's execution order) whose output differs.

API (for every adapter that rewrites structure)::

    first_difference(original, rewritten, batch, group=None, *, rewritten_batch=None,
                     rtol=1e-4, gather=None) -> str | None

``original`` / ``rewritten`` are modules called as ``m(**batch)`` (a dict), ``m(*batch)`` (a
tuple) or ``m(batch)``, both in eval mode (restored after); ``rewritten_batch`` is what the
rewritten module gets when it differs, or a function of the original's recorded outputs
``{fqn: tensor}`` giving it (a later pipeline stage gets the hidden state its first block
saw). Modules are matched by FQN (wrapper components such as ``_checkpoint_wrapped_module``
dropped); outputs of different shapes (a column-parallel linear's local shard) are not
compared. DTensor outputs are compared in full; ``gather(fqn,
tensor)`` maps any other rewritten output to the original's layout first (CP: all-gather the
sequence shards), returning None to skip it. With a ``group``, every rank returns the same
answer (the first difference on any rank). ``from_module``: compare only what the original
computes from that module on (a later pipeline stage: its first block; the prelude it runs on
the received hidden state is discarded). The answer is the FQN, ``"<output>"`` when only the
final outputs differ, or None.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

__all__ = ["Call", "first_difference", "ProbeMismatch", "OUTPUT"]

OUTPUT = "<output>"
_WRAPPERS = ("_checkpoint_wrapped_module", "_orig_mod", "_fsdp_wrapped_module")


class ProbeMismatch(ValueError):
    """A rewritten model computes something else than the original on the probe batch."""


def _tensor(out: Any) -> torch.Tensor | None:
    if isinstance(out, torch.Tensor):
        return out
    if isinstance(out, Mapping):
        if isinstance(out.get("logits"), torch.Tensor):
            return out["logits"]
        out = list(out.values())
    if isinstance(out, tuple | list):
        return next((t for t in out if isinstance(t, torch.Tensor)), None)
    return None


def _clean(fqn: str) -> str:
    return ".".join(p for p in fqn.split(".") if p not in _WRAPPERS)


class _Keep:
    """Forward hook: keep a module's first output under its FQN."""

    def __init__(self, outputs: dict[str, torch.Tensor], fqn: str):
        self.outputs, self.fqn = outputs, fqn

    def __call__(self, _module, _args, out) -> None:
        t = _tensor(out)
        if self.fqn and t is not None and self.fqn not in self.outputs:
            self.outputs[self.fqn] = t.detach()


def _record(model: nn.Module, call: Callable[[], Any]) -> tuple[dict[str, torch.Tensor], Any]:
    """Run ``call`` with forward hooks on every module of ``model``: {FQN: first output}."""
    outputs: dict[str, torch.Tensor] = {}
    handles = []
    for fqn, module in model.named_modules():
        if getattr(type(module), "titanext_probe_skip", False):
            continue  # a stand-in for a part held elsewhere (a pipeline stage's)

        handles.append(module.register_forward_hook(_Keep(outputs, _clean(fqn))))
    try:
        with torch.no_grad():
            result = call()
    finally:
        for h in handles:
            h.remove()
    return outputs, _tensor(result)


class Call:
    """A probe batch given as positional and keyword arguments together:
    ``Call(hidden, input_ids=ids)`` calls ``m(hidden, input_ids=ids)``."""

    def __init__(self, *args: Any, **kwargs: Any):
        self.args, self.kwargs = args, kwargs


def _call(module: nn.Module, batch: Any) -> Callable[[], Any]:
    if isinstance(batch, Call):
        return lambda: module(*batch.args, **batch.kwargs)
    if isinstance(batch, Mapping):
        return lambda: module(**batch)
    if isinstance(batch, tuple):
        return lambda: module(*batch)
    return lambda: module(batch)


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def _differs(a: torch.Tensor, b: torch.Tensor, rtol: float) -> bool:
    a, b = a.double(), b.double()
    scale = a.abs().max().clamp_min(1e-30)
    return bool(((a - b).abs().max() / scale > rtol) | ~torch.isfinite(b).all())


def first_difference(original: nn.Module, rewritten: nn.Module, batch: Any, group=None, *,
                     rewritten_batch: Any = None, rtol: float = 1e-4,
                     gather: Callable[[str, torch.Tensor], torch.Tensor | None] | None = None,
                     from_module: str | None = None) -> str | None:
    """The FQN of the first module whose output differs between ``original`` and ``rewritten``
    on ``batch`` (see the module docstring), ``"<output>"`` or None."""
    modes = [(m, m.training) for m in (*original.modules(), *rewritten.modules())]
    original.eval(), rewritten.eval()  # no dropout, no router jitter: one computation each
    try:
        ref, ref_out = _record(original, _call(original, batch))
        if callable(rewritten_batch):
            rewritten_batch = rewritten_batch(ref)
        got, got_out = _record(rewritten, _call(rewritten, batch if rewritten_batch is None
                                                else rewritten_batch))
    finally:
        for m, training in modes:
            m.training = training
    order = [*ref, OUTPUT]
    if from_module is not None:  # what the original computes before it is not the rewrite's
        order = order[next((i for i, f in enumerate(order)
                            if f == from_module or f.startswith(from_module + ".")), 0):]
    ref[OUTPUT], got[OUTPUT] = ref_out, got_out
    first = len(order)
    for i, fqn in enumerate(order):
        if fqn not in got or ref[fqn] is None or got[fqn] is None:
            continue
        value = _full(got[fqn])
        if gather is not None:
            value = gather(fqn, value)
        if value is None or value.shape != ref[fqn].shape:
            continue
        if _differs(_full(ref[fqn]), value, rtol) and first == len(order):
            first = i  # no early stop: every rank runs the same DTensor / gather collectives
    if group is not None and dist.is_initialized():
        device = ref_out.device if isinstance(ref_out, torch.Tensor) else "cpu"
        index = torch.tensor([first], device=device)
        dist.all_reduce(index, op=dist.ReduceOp.MIN, group=group)
        first = int(index.item())
    return order[first] if first < len(order) else None
