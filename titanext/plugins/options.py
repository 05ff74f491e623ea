"""Plain option values the plugins accept, importable without torch.

The config validates ``[float8] recipe`` and ``[activation_checkpoint] selective_op_save_list``
against these while loading a TOML file, so they live in a module that imports nothing; the
plugins (:mod:`titanext.plugins.float8`, :mod:`titanext.plugins.activation_checkpoint`)
import and re-export them.

>>> "tensorwise" in FLOAT8_RECIPES, DEFAULT_SAVE_OPS[0]
(True, 'mm')
"""

from __future__ import annotations

__all__ = ["DEFAULT_SAVE_OPS", "EP_DISPATCH_MODES", "FLOAT8_ALL_GATHER_RECIPES", "FLOAT8_RECIPES",
           "REPLICATION_SLACK"]

#: Recipe names accepted by :func:`~titanext.plugins.float8.apply_float8` and ``[float8] recipe``.
FLOAT8_RECIPES = ("tensorwise", "rowwise", "rowwise_with_gw_hp", "blockwise")
#: Recipes whose weights FSDP2 can all-gather in float8 (one scale per weight tensor).
FLOAT8_ALL_GATHER_RECIPES = ("tensorwise",)

#: aten ops whose outputs op-level selective activation checkpointing keeps by default:
#: matmuls and attention, expensive to recompute and cheap to store.
DEFAULT_SAVE_OPS = (
    "mm",
    "addmm",
    "bmm",
    "_scaled_dot_product_flash_attention",
    "_scaled_dot_product_efficient_attention",
    "_scaled_dot_product_cudnn_attention",
    "_scaled_dot_product_flash_attention_for_cpu",
)

#: Hot-expert replication makes no new copy while the busiest ep rank is within this fraction
#: of the mean rows (a copy would cost more than the rows it moves).
REPLICATION_SLACK = 0.05

#: ``[parallelism] expert_parallel_dispatch`` and ``apply_expert_parallel(dispatch=...)``: every
#: (token, expert) row sent on its own, or each token once per destination node, then fanned
#: out inside it (:mod:`titanext.plugins._ep_dispatch`).
EP_DISPATCH_MODES = ("flat", "two_level")
