"""Loud or correct: what the plugins share to say what they did and to pick modules by behaviour.

A plugin either changes the model and says so (a return value, or one WARNING line, shown by
Python's default logging), or raises a ``ValueError`` that names the model class, what it looked
for and the fix. Converters pick linears by what they compute, not by their exact type:

>>> import torch.nn.functional as F
>>> from torch import nn
>>> class MyLinear(nn.Linear):           # keeps nn.Linear.forward: a linear
...     pass
>>> class Scaled(nn.Linear):             # its own forward: converting would drop it
...     def forward(self, x):
...         return 2 * F.linear(x, self.weight, self.bias)
>>> linear_kind(MyLinear(2, 2)), linear_kind(Scaled(2, 2)), linear_kind(nn.ReLU())
('linear', 'own_forward', None)
"""

from __future__ import annotations

import logging

import torch.distributed as dist
from torch import nn

__all__ = ["linear_kind", "log_rank0", "own_forward_line"]

logger = logging.getLogger("titanext")


def log_rank0(level: int, msg: str, *args) -> None:
    """Log once per job, not once per rank."""
    if not dist.is_initialized() or dist.get_rank() == 0:
        logger.log(level, msg, *args)


def linear_kind(module: nn.Module) -> str | None:
    """How converters treat ``module``: "linear" (``nn.Linear`` or a subclass that keeps
    ``nn.Linear.forward``: converted), "own_forward" (a subclass with its own forward: kept
    unless a filter includes it), "kept" (its class sets ``titanext_convert = False``: kept on
    purpose, e.g. titanext's fp32 router gate or an already converted linear), or None."""
    if not isinstance(module, nn.Linear):
        return None
    if (getattr(type(module), "titanext_convert", True) is False
            or type(module).__name__ == "Float8Linear"):  # torchao's: already converted
        return "kept"
    return "linear" if type(module).forward is nn.Linear.forward else "own_forward"


def own_forward_line(plugin: str, modules: list[tuple[str, nn.Module]], included: set[str]
                     ) -> str | None:
    """The one WARNING line listing the ``nn.Linear`` subclasses with their own forward."""
    if not modules:
        return None
    names = ", ".join(f"{fqn} ({type(m).__name__}{', included' if fqn in included else ''})"
                      for fqn, m in modules)
    return (f"{plugin}: {len(modules)} nn.Linear subclass(es) override forward: {names}. "
            "Excluded ones keep their own forward in high precision; to convert one anyway "
            "(its forward becomes nn.Linear's), pass module_filter_fn=... returning True for it")
