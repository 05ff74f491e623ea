"""The config rules of the flat plugins (float8, activation checkpointing) and the plain option
values they accept, importable without torch.

The config validates ``[float8] recipe`` and ``[activation_checkpoint] selective_op_save_list``
against these while loading a TOML file, so they live in a module that imports nothing; the
plugins (:mod:`titanext.plugins.float8`, :mod:`titanext.plugins.activation_checkpoint`)
import and re-export them. A plugin package keeps its own rules in its ``rules`` module
(:mod:`titanext.plugins.expert_parallel.rules`).

>>> "tensorwise" in FLOAT8_RECIPES, DEFAULT_SAVE_OPS[0]
(True, 'mm')
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable, Sequence
from typing import Any

__all__ = ["DEFAULT_SAVE_OPS", "FLOAT8_ALL_GATHER_RECIPES", "FLOAT8_EXPERT_RECIPES",
           "FLOAT8_RECIPES", "FLOAT8_STORAGE", "RECOMPUTE_MODULES", "any_full_blocks",
           "float8_experts_problems",
           "float8_problems", "keep_all_to_all_problem", "recompute_problems",
           "resolved_recompute_modules"]

#: Recipe names accepted by :func:`~titanext.plugins.float8.apply_float8` and ``[float8] recipe``.
FLOAT8_RECIPES = ("tensorwise", "rowwise", "rowwise_with_gw_hp", "blockwise")
#: ``[float8] moe_experts_recipe``: the routed experts' grouped GEMMs
#: (:mod:`titanext.plugins.float8_experts`).
FLOAT8_EXPERT_RECIPES = ("rowwise", "blockwise")
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

#: ``[activation_checkpoint] recompute_modules`` (``mode = "modules"``): the parts of a block
#: that are recomputed (Megatron-Core's ``recompute_modules`` names;
#: :mod:`titanext.plugins.recompute_modules`).
RECOMPUTE_MODULES = ("layernorm", "mla_up_proj", "core_attn", "moe_act", "mlp", "shared_experts")
#: The default: DeepSeek-V3's choice (the report recomputes RMSNorm and the MLA up-projections,
#: and keeps SwiGLU's input and recomputes its output): cheap to rerun, large to keep.
DEFAULT_RECOMPUTE_MODULES = ("layernorm", "mla_up_proj", "moe_act")
#: ``[activation_checkpoint] float8_storage``: tensors saved for the backward in float8 e4m3
#: with 1 x 128 scales (:mod:`titanext.plugins.float8_storage`).
FLOAT8_STORAGE = ("expert_up_proj_input", "attention_out_input", "expert_act_input")


def float8_problems(f: Any, p: Any, skip: set[str]) -> list[str]:
    """``[float8]`` (``f``) combinations that cannot work against ``[parallelism]`` (``p``),
    one line each; checked only with ``float8.enable``."""
    if not f.enable or skip & {"float8.recipe", "float8.enable_fsdp_float8_all_gather"}:
        return []
    problems = []
    if f.enable_fsdp_float8_all_gather and f.recipe not in FLOAT8_ALL_GATHER_RECIPES:
        problems.append(f"float8.enable_fsdp_float8_all_gather = true needs one scale per weight "
                        f"tensor, which recipe = {f.recipe!r} does not have; use recipe = "
                        "'tensorwise' or set enable_fsdp_float8_all_gather = false")
    if f.precompute_scale and not f.enable_fsdp_float8_all_gather:
        problems.append("float8.precompute_scale = true only precomputes the scales of float8 "
                        "all-gathered weights; set enable_fsdp_float8_all_gather = true too, or "
                        "precompute_scale = false")
    if f.enable_fsdp_float8_all_gather and p.zero_stage == 1:
        problems.append("float8.enable_fsdp_float8_all_gather = true needs FSDP, but "
                        "parallelism.zero_stage = 1 replicates parameters (DDP); use zero_stage "
                        "2 or 3")
    if f.recipe != "blockwise" and importlib.util.find_spec("torchao") is None:
        problems.append(f"float8.recipe = {f.recipe!r} needs torchao >= 0.17, which is not "
                        "installed here (pip install torchao); recipe = 'blockwise' runs "
                        "without it")
    if f.recipe == "blockwise" and p.tensor_parallel_degree > 1:
        problems.append(f"float8.recipe = 'blockwise' does not support tensor parallelism "
                        f"(tensor_parallel_degree = {p.tensor_parallel_degree}); use 'tensorwise' "
                        "or 'rowwise' with TP")
    return problems


def float8_experts_problems(cfg: Any, skip: set[str], model_args: Callable[[Any], Any]
                            ) -> list[str]:
    """One line per problem of ``[float8] moe_experts`` (float8 routed experts): it needs a
    model with routed experts, and a recipe with a kernel where emulation is refused.

    >>> from titanext.config import ConfigError, load_config
    >>> try:
    ...     load_config(None, ["--model.flavor=debugmodel", "--float8.moe_experts=true"])
    ... except ConfigError as e:
    ...     print(e.problems[0][:60])
    float8.moe_experts = true needs a MoE model, but model.flavo
    """
    f = cfg.float8
    if not f.moe_experts or "float8.moe_experts" in skip:
        return []
    problems = []
    if not skip & {"model.name", "model.flavor"}:
        try:
            args = model_args(cfg)
        except (KeyError, ValueError):  # a bad name, flavor or [moe] value: reported elsewhere
            args = None
        if args is not None and getattr(args, "moe", None) is None:
            problems.append(f"float8.moe_experts = true needs a MoE model, but model.flavor = "
                            f"{cfg.model.flavor!r} has no routed experts; use a MoE flavor (e.g. "
                            "'debugmoe') or set moe_experts = false")
    if (f.moe_experts_recipe == "blockwise" and f.emulate is False
            and "float8.moe_experts_recipe" not in skip):
        problems.append("float8.moe_experts_recipe = 'blockwise' has no float8 grouped GEMM "
                        "(torchao has none), so it always runs emulated, but float8.emulate = "
                        "false; use moe_experts_recipe = 'rowwise' or emulate = 'auto'")
    return problems


def any_full_blocks(full_blocks: int | Sequence[int]) -> bool:
    """Whether ``[activation_checkpoint] full_blocks`` (a count, or one per stage) fully
    checkpoints any block."""
    return any(v > 0 for v in (full_blocks if isinstance(full_blocks, list | tuple)
                               else (full_blocks,)))


def keep_all_to_all_problem(mode: str, option: str, full_blocks: int | Sequence[int] = 0
                            ) -> str | None:
    """Why ``[activation_checkpoint] keep_all_to_all = true`` cannot run with this ``mode`` /
    ``selective_ac_option`` / ``full_blocks`` (it keeps what a *fully* checkpointed block's
    collectives received), or None."""
    if mode in ("full", "selective") and not (mode == "selective" and option == "op"):
        return None
    if mode == "modules" and any_full_blocks(full_blocks):
        return None  # the fully checkpointed blocks keep it
    if mode == "modules":
        return ("activation_checkpoint.keep_all_to_all = true keeps what a recomputed block's "
                "all-to-alls received, but mode = 'modules' with full_blocks = 0 never recomputes "
                "an all-to-all; remove keep_all_to_all or set full_blocks")
    return (f"activation_checkpoint.keep_all_to_all = true needs whole checkpointed blocks, but "
            f"mode = {mode!r}" + (f" with selective_ac_option = {option!r}"
                                  if mode == "selective" else "")
            + " checkpoints none; use mode = 'full' or a layer-level selective_ac_option "
            "such as '2'")


def _model_has(args: Any) -> dict[str, bool]:
    """Which :data:`RECOMPUTE_MODULES` / :data:`FLOAT8_STORAGE` targets a model of ``args`` has."""
    moe = getattr(args, "moe", None)
    dense = moe is None or any(not args.is_moe_layer(i) for i in range(args.n_layers))
    return {"layernorm": True, "mla_up_proj": bool(getattr(args, "mla", False)),
            "core_attn": True, "moe_act": moe is not None, "mlp": dense,
            "shared_experts": moe is not None and moe.num_shared_experts > 0,
            "expert_up_proj_input": moe is not None, "attention_out_input": True,
            "expert_act_input": moe is not None}


def resolved_recompute_modules(names: Any, args: Any) -> tuple[str, ...]:
    """``recompute_modules`` as a recipe holds it: the names given, or (empty) the default
    :data:`DEFAULT_RECOMPUTE_MODULES` that a model of ``args`` has (None: all of them)."""
    if names:
        return tuple(names)
    has = _model_has(args) if args is not None else {}
    return tuple(n for n in DEFAULT_RECOMPUTE_MODULES if has.get(n, True))


def recompute_problems(cfg: Any, skip: set[str], model_args: Callable[[Any], Any]) -> list[str]:
    """One line per problem of ``[activation_checkpoint] recompute_modules``, ``full_blocks``
    and ``float8_storage``: recompute_modules or full_blocks without mode = 'modules', a name
    the model lacks,
    core_attn under context parallelism (its ring would communicate again), float8 storage
    with a full recompute, a tensor-parallel wo.

    >>> from titanext.config import ConfigError, load_config
    >>> try:
    ...     load_config(None, ["--activation_checkpoint.mode=modules",
    ...                        "--activation_checkpoint.recompute_modules=mla_up_proj"])
    ... except ConfigError as e:
    ...     print(e.problems[0][:72])
    activation_checkpoint.recompute_modules names 'mla_up_proj', but model.f
    """
    ac, key = cfg.activation_checkpoint, "activation_checkpoint"
    problems = []
    if ac.recompute_modules and ac.mode != "modules" and f"{key}.mode" not in skip:
        problems.append(f"{key}.recompute_modules = {ac.recompute_modules!r} only applies with "
                        f"mode = 'modules', but mode = {ac.mode!r}; set mode = 'modules' or "
                        "remove recompute_modules")
    if any_full_blocks(ac.full_blocks) and ac.mode != "modules" and f"{key}.mode" not in skip:
        problems.append(f"{key}.full_blocks = {ac.full_blocks} only applies with mode = "
                        f"'modules', but mode = {ac.mode!r}; set mode = 'modules' or "
                        "full_blocks = 0")
    named = [(f"{key}.recompute_modules", n) for n in ac.recompute_modules
             if ac.mode == "modules"] + [(f"{key}.float8_storage", n) for n in ac.float8_storage]
    if not named or skip & {"model.name", "model.flavor", f"{key}.recompute_modules",
                            f"{key}.float8_storage"}:
        return problems
    try:
        args = model_args(cfg)
    except (KeyError, ValueError):  # a bad name, flavor or [moe] value: reported elsewhere
        return problems
    has = _model_has(args)
    problems += [f"{field} names {n!r}, but model.flavor = {cfg.model.flavor!r} has none "
                 f"(no {_WHAT[n]}); remove it" for field, n in named if not has[n]]
    store = ac.float8_storage
    if store and ac.mode not in ("none", "modules"):
        problems.append(f"{key}.float8_storage = {store!r} keeps what the backward reads from a "
                        f"block's forward, but mode = {ac.mode!r} recomputes it instead; use "
                        "mode = 'none' or 'modules', or remove float8_storage")
    tp = cfg.parallelism.tensor_parallel_degree
    if "attention_out_input" in store and tp > 1:
        problems.append(f"{key}.float8_storage names 'attention_out_input', but "
                        f"parallelism.tensor_parallel_degree = {tp} (a tensor-parallel wo saves "
                        "a DTensor, not stored in float8 yet); remove it or use tp = 1")
    cp = cfg.parallelism.context_parallel_degree
    if "core_attn" in ac.recompute_modules and ac.mode == "modules" and cp > 1:
        problems.append(f"{key}.recompute_modules names 'core_attn', but "
                        f"parallelism.context_parallel_degree = {cp}: recomputing the attention "
                        "core would run context parallelism's exchanges again; remove it or "
                        "use context_parallel_degree = 1")
    return problems


_WHAT = {"mla_up_proj": "MLA attention: q_lora_rank / kv_lora_rank",
         "moe_act": "routed experts", "mlp": "dense block", "shared_experts": "shared experts",
         "expert_up_proj_input": "routed experts", "expert_act_input": "routed experts",
         "layernorm": "norms",
         "core_attn": "attention", "attention_out_input": "attention"}
