"""float8 for transformers' ``Conv1D``: the same float8 matmuls as a converted ``nn.Linear``.

A Conv1D holds its weight as ``[in, out]`` and computes ``x @ W + b``. torchao's
``Float8Linear`` computes ``x @ weight.t()`` through ``matmul_with_hp_or_float8_args``, which
takes the *transposed* weight: a Conv1D's weight is that operand already. So a converted
Conv1D runs torchao's own float8 matmul (every recipe's scaling, emulation and layout handling)
on its weight as it is, and the blockwise recipe runs
:func:`~titanext.plugins.float8_blockwise.float8_blockwise_linear` on its transpose: the numerics
are those of ``Float8Linear`` on ``nn.Linear(weight.t())``, to the bit.

The conversion changes only the module's class (a subclass of its own class, so
``isinstance(m, Conv1D)`` holds): the parameter objects, their names and shapes, the state dict,
FSDP's and the optimizer's view stay as they were. FSDP's float8 all-gather
(``enable_fsdp_float8_all_gather``) wraps ``nn.Linear`` weights only: a Conv1D's weight is
all-gathered in high precision, and :func:`~titanext.plugins.float8.apply_float8` says so.
"""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["Float8Conv1DMixin", "convert_conv1d"]

_CLASSES: dict[type, type] = {}


class Float8Conv1DMixin(nn.Module):
    """The forward of a float8 Conv1D; its state is set by :func:`convert_conv1d`."""

    titanext_convert = False  # already converted
    float8_recipe: str = "tensorwise"
    emulate: bool = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.float8_recipe == "blockwise":
            from titanext.plugins.float8_blockwise import float8_blockwise_linear

            y = float8_blockwise_linear(x, self.weight.t().contiguous(), emulate=self.emulate)
        else:
            from torchao.float8.float8_linear import matmul_with_hp_or_float8_args

            if torch.is_autocast_enabled():  # as Float8Linear: keep the autocast dtype
                x = x.to(torch.get_autocast_gpu_dtype())
            y = matmul_with_hp_or_float8_args.apply(x, self.weight, self.linear_mm_config,
                                                    self.config)
        return y if self.bias is None else y + self.bias.to(y.dtype)


def _class(cls: type) -> type:
    if cls not in _CLASSES:
        _CLASSES[cls] = type(f"Float8{cls.__name__}", (Float8Conv1DMixin, cls),
                             {"__module__": cls.__module__})
    return _CLASSES[cls]


def convert_conv1d(module: nn.Module, recipe: str, config=None, emulate: bool = False) -> None:
    """Make the Conv1D ``module`` compute in float8, in place (``config``: torchao's
    ``Float8LinearConfig`` for the torchao recipes, None for ``"blockwise"``)."""
    module.__class__ = _class(type(module))
    module.float8_recipe, module.emulate = recipe, emulate
    if config is not None:
        from torchao.float8.float8_linear import Float8Linear

        # torchao's per-GEMM settings (emulation, fast accumulation, padding) as Float8Linear
        # builds them; a meta Float8Linear of the same shape lends them.
        with torch.device("meta"):
            donor = Float8Linear(module.weight.shape[0], module.weight.shape[1], bias=False,
                                 config=config)
        module.config, module.linear_mm_config = donor.config, donor.linear_mm_config
