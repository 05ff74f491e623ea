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

Every matmul is accounted for: :func:`matmul_kind` also sees transformers' ``Conv1D`` (weight
``[in, out]``, ``y = x W + b``: float8 and deferral convert it, TP has Conv1D styles) and any
other module whose forward multiplies by a 2-D parameter of its own (``F.linear(x, self.w)``,
``x @ self.w``): nothing converts that from outside, so it is named with the fix.

>>> class OwnParam(nn.Module):
...     def __init__(self):
...         super().__init__()
...         self.w = nn.Parameter(torch.zeros(4, 4))
...     def forward(self, x):
...         return F.linear(x, self.w)
>>> matmul_kind(OwnParam()), matmul_kind(nn.Embedding(3, 2)), matmul_kind(MyLinear(2, 2))
('param_matmul', None, 'linear')
"""

from __future__ import annotations

import inspect
import logging

import torch
import torch.distributed as dist
from torch import nn

__all__ = ["is_conv1d", "linear_kind", "log_rank0", "matmul_kind", "matmul_params",
           "stacked_experts", "stacked_experts_line",
           "own_forward_line", "param_matmul_reason", "unconverted_line"]

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


# -- every matmul accounted for -------------------------------------------------------------------

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


# -- stacked 3-D expert weights -------------------------------------------------------------------

def stacked_experts(model: nn.Module, handled: tuple[type, ...] = ()
                    ) -> list[tuple[str, nn.Module]]:
    """(FQN, module) of every module that multiplies by its own floating 3-D parameters
    (stacked expert weights: transformers' OLMoE / Granite MoE / DeepSeek-V2 experts with
    ``gate_up_proj`` [E, 2I, H] and ``down_proj`` [E, H, I]), except instances of ``handled``."""
    out = []
    for fqn, module in model.named_modules():
        if isinstance(module, handled) or getattr(type(module), "titanext_convert", True) is False:
            continue
        if any(p.dim() == 3 and torch.is_floating_point(p)
               for p in module.parameters(recurse=False)) and _forward_multiplies(module):
            out.append((fqn, module))
    return out


def stacked_experts_line(plugin: str, modules: list[tuple[str, nn.Module]], fix: str
                         ) -> str | None:
    """One line naming the stacked 3-D expert modules ``plugin`` leaves as they are, or None."""
    if not modules:
        return None
    names = ", ".join(
        f"{fqn or '<root>'} ({type(m).__name__}: "
        + "/".join(n for n, p in m.named_parameters(recurse=False) if p.dim() == 3) + ")"
        for fqn, m in modules)
    return (f"{plugin}: {len(modules)} module(s) with stacked 3-D expert weights not converted: "
            f"{names}. {fix}")
