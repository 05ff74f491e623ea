"""Every matmul accounted for: the modules that hold a 2-D weight used as a matmul, by kind.

float8, weight-gradient deferral and tensor parallelism each act on matmul modules. A module
they cannot convert must not vanish from their report, so they walk the model with
:func:`matmul_kind`, which sees three shapes of matmul:

- ``nn.Linear`` and its subclasses (``y = x W^T + b``, weight ``[out, in]``): see
  :func:`titanext.plugins._loud.linear_kind`;
- transformers' ``Conv1D`` (GPT-2, GPT-J's ancestors, ...): weight ``[in, out]``, ``y = x W + b``
  (:func:`is_conv1d`): converted by float8 and deferral, sharded by the Conv1D TP styles;
- any other module whose forward runs a matmul on a 2-D parameter of its own
  (``F.linear(x, self.w)``, ``x @ self.w``): nothing can convert it from outside, so it is
  named with the fix (make it an ``nn.Linear``).

>>> from torch import nn
>>> class OwnParam(nn.Module):
...     def __init__(self):
...         super().__init__()
...         self.w = nn.Parameter(torch.zeros(4, 4))
...     def forward(self, x):
...         return F.linear(x, self.w)
>>> matmul_kind(nn.Linear(2, 2)), matmul_kind(OwnParam()), matmul_kind(nn.Embedding(3, 2))
('linear', 'param_matmul', None)
"""

from __future__ import annotations

import inspect

import torch
import torch.nn.functional as F  # noqa: F401  (the doctest's F)
from torch import nn

from titanext.plugins._loud import linear_kind

__all__ = ["is_conv1d", "matmul_kind", "matmul_params", "param_matmul_reason", "unconverted_line"]

#: what a forward's source shows when it multiplies by a parameter
_MATMUL_MARKS = ("linear(", "matmul(", "@", "mm(", "einsum(", "bmm(")


def is_conv1d(module: nn.Module) -> bool:
    """Whether ``module`` is transformers' ``Conv1D`` (or a subclass): weight ``[in, out]``,
    ``forward(x) = x @ weight + bias``. Detected by class, without importing transformers."""
    return any(c.__name__ == "Conv1D" and c.__module__.startswith("transformers")
               for c in type(module).__mro__)


def matmul_params(module: nn.Module) -> list[str]:
    """Names of ``module``'s own floating 2-D parameters."""
    return [n for n, p in module.named_parameters(recurse=False)
            if p.dim() == 2 and torch.is_floating_point(p)]


def _forward_multiplies(module: nn.Module) -> bool:
    try:
        src = inspect.getsource(type(module).forward)
    except (OSError, TypeError):  # no source (built at run time): assume it may
        return True
    return any(mark in src for mark in _MATMUL_MARKS)


def matmul_kind(module: nn.Module) -> str | None:
    """How a converter sees ``module``: :func:`~titanext.plugins._loud.linear_kind`'s
    "linear" / "own_forward" / "kept" for ``nn.Linear``; "conv1d" for transformers' Conv1D
    ("kept" once converted: its class sets ``titanext_convert = False``); "param_matmul" for
    another module (not an embedding) that holds a 2-D parameter and whose forward multiplies;
    else None."""
    kind = linear_kind(module)
    if kind is not None:
        return kind
    if is_conv1d(module):
        return "kept" if getattr(type(module), "titanext_convert", True) is False else "conv1d"
    if isinstance(module, (nn.Embedding, nn.EmbeddingBag)) or not matmul_params(module):
        return None
    return "param_matmul" if _forward_multiplies(module) else None


def param_matmul_reason(module: nn.Module, plugin: str) -> str:
    """Why a "param_matmul" module stays as it is, and the fix."""
    names = "/".join(matmul_params(module))
    return (f"{type(module).__name__} multiplies by its own 2-D parameter {names} outside "
            f"nn.Linear, which {plugin} cannot convert; hold it in an nn.Linear (or subclass) "
            "to convert it")


def unconverted_line(plugin: str, modules: list[tuple[str, nn.Module]]) -> str | None:
    """The one WARNING line naming matmul modules a plugin leaves as they are, or None."""
    if not modules:
        return None
    names = "; ".join(f"{fqn or '<root>'} ({param_matmul_reason(m, plugin)})"
                      for fqn, m in modules)
    return f"{plugin}: {len(modules)} matmul module(s) not converted: {names}"
