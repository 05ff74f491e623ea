"""Float8 training: swap a model's ``nn.Linear`` layers for float8 ones (a converter).

Converters run first, on the meta model, before TP/AC/compile/FSDP. Recipes:

- ``tensorwise``: one dynamic scale per tensor (torchao's default; the fastest on H100 and the
  only one whose weights FSDP can all-gather in float8, see ``enable_fsdp_float8_all_gather``).
- ``rowwise``: one scale per row of every operand, power-of-two scales (more accurate with
  outliers, a bit slower).
- ``rowwise_with_gw_hp``: rowwise, but the weight-gradient matmul stays in high precision.
- ``blockwise``: DeepSeek-V3's 1x128 activation tiles and 128x128 weight blocks
  (``titanext.plugins.float8_blockwise``, plain PyTorch, torchao's kernels where available).

The first three wrap torchao's ``convert_to_float8_training`` with
``Float8LinearConfig.from_recipe_name``.

>>> import torch
>>> from torch import nn
>>> model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 10))
>>> converted = apply_float8(model, recipe="tensorwise")  # the 256->10 head is not % 16
>>> [type(m).__name__ for m in model]
['Float8Linear', 'ReLU', 'Linear']
>>> model(torch.randn(32, 64)).shape
torch.Size([32, 10])

With FSDP2 and ``enable_fsdp_float8_all_gather=True``, call :func:`precompute_float8_scales`
after each optimizer step (one all-reduce for all weight scales instead of one per layer).
gloo has no float8 collectives: there the float8 weight bytes travel as uint8.

transformers' ``Conv1D`` (weight ``[in, out]``, ``y = x W + b``) converts too. torchao's
``Float8Linear`` runs ``matmul_with_hp_or_float8_args(x, weight.t())``: a Conv1D's weight *is*
that transposed operand, so a converted Conv1D runs torchao's own float8 matmul on its weight as
it is (blockwise: :func:`~titanext.plugins.float8_blockwise.float8_blockwise_linear` on its
transpose), with the numerics of ``Float8Linear`` on ``nn.Linear(weight.t())``. Only its class
changes (a subclass of its own, so ``isinstance(m, Conv1D)`` holds): parameters, names, shapes,
state dict, FSDP's and the optimizer's view stay. FSDP's float8 all-gather wraps ``nn.Linear``
weights only; a Conv1D's weight is all-gathered in high precision (one WARNING line says so).
"""

from __future__ import annotations

import dataclasses
import fnmatch
import logging
import os
from collections.abc import Callable, Sequence

import torch
from torch import nn

from titanext._text import did_you_mean
from titanext.plugins._loud import (
    log_rank0,
    matmul_kind,
    own_forward_line,
    param_matmul_reason,
    stacked_experts,
    stacked_experts_line,
    unconverted_line,
)
from titanext.plugins.float8_blockwise import Float8BlockwiseLinear, float8_blockwise_linear
from titanext.plugins.rules import FLOAT8_ALL_GATHER_RECIPES, FLOAT8_RECIPES

__all__ = [
    "FLOAT8_ALL_GATHER_RECIPES",
    "FLOAT8_RECIPES",
    "Float8Conv1DMixin",
    "apply_float8",
    "auto_filter_keeps",
    "float8_linear_fqns",
    "float8_module_filter",
    "has_float8_hardware",
    "precompute_float8_scales",
    "resolve_auto_filter",
    "resolve_emulate",
    "supports_float8_tp",
]

logger = logging.getLogger("titanext")

ModuleFilter = Callable[[nn.Module, str], bool]


def _quiet_torchao_import() -> None:
    # torchao prints "Failed to load ... .so" for its CUDA kernels on a CPU build; harmless.
    if not torch.cuda.is_available():
        os.environ.setdefault("TORCHAO_FORCE_SKIP_LOADING_SO_FILES", "1")


def has_float8_hardware(device: torch.device | str | None = None) -> bool:
    """True on CUDA GPUs with float8 tensor cores (compute capability 8.9+: Ada, Hopper, ...)."""
    device = torch.device(device) if device is not None else None
    if device is not None and device.type != "cuda":
        return False
    if not torch.cuda.is_available():
        return False
    return torch.cuda.get_device_capability(device) >= (8, 9)


def resolve_emulate(emulate: bool | str, device: torch.device | str | None = None, *,
                    float8_hardware: bool | None = None) -> bool:
    """``"auto"`` -> emulate exactly when ``device`` has no float8 hardware (CPU included);
    ``float8_hardware`` says whether it has instead of asking (the planner's device)."""
    if isinstance(emulate, bool):
        return emulate
    if emulate != "auto":
        raise ValueError(f"emulate = {emulate!r}; allowed: true, false, 'auto'")
    return not (has_float8_hardware(device) if float8_hardware is None else float8_hardware)


def auto_filter_keeps(recipe: str, out_features: int, in_features: int) -> bool:
    """Whether a linear of this shape is expected to run faster in float8 than in bf16.

    Thresholds follow torchao's H100 fwd+bwd measurements: tensorwise loses when K <= 4096
    and N <= 1024 (1024x2048x1024 runs at 0.80x); the row- and blockwise recipes, with their
    costlier scaling, lose when N <= 2048, K <= 1024, or both N <= 4096 and K <= 2048.
    """
    n, k = out_features, in_features
    if recipe == "tensorwise":
        return not (k <= 4096 and n <= 1024)
    return not (n <= 2048 or k <= 1024 or (n <= 4096 and k <= 2048))


def _fqn_matches(fqn: str, pattern: str) -> bool:
    """``pattern`` names this module, a module it sits under, or a glob matching it."""
    if fqn == pattern or fqn.endswith("." + pattern) or fqn.startswith(pattern + "."):
        return True
    return any(ch in pattern for ch in "*?[") and fnmatch.fnmatchcase(fqn, pattern)


def resolve_auto_filter(auto_filter: bool | str, emulated: bool) -> bool:
    """``auto_filter="auto"`` (the config's default) -> torchao's size rule
    (:func:`auto_filter_keeps`) exactly where float8 runs on float8 tensor cores: there a linear
    that runs slower in float8 than in bf16 is never wanted. Emulated float8 (CPU, GPUs before
    compute capability 8.9) has no speed to gain, so every eligible linear converts and its
    numerics are what is checked."""
    if isinstance(auto_filter, bool):
        return auto_filter
    if auto_filter != "auto":
        raise ValueError(f"auto_filter = {auto_filter!r}; allowed: true, false, 'auto'")
    return not emulated


def _skip_reason(module: nn.Module, fqn: str, recipe: str, filter_fqns: Sequence[str],
                 auto_filter: bool, force_fqns: Sequence[str] = ()) -> str | None:
    """Why ``module`` stays in high precision, or None to convert it."""
    kind = matmul_kind(module)
    if kind is None:
        return "not a matmul module"
    if kind == "kept":
        return f"{type(module).__name__} sets titanext_convert = False"
    if kind == "param_matmul":
        return param_matmul_reason(module, "float8")
    for pattern in filter_fqns:
        if _fqn_matches(fqn, pattern):
            return f"in filter_fqns ({pattern!r})"
    n, k = module.weight.shape if kind != "conv1d" else module.weight.shape[::-1]
    if n % 16 or k % 16:
        return f"dims {k}x{n} not divisible by 16"
    if (auto_filter and not auto_filter_keeps(recipe, n, k)
            and not any(_fqn_matches(fqn, p) for p in force_fqns)):
        return f"auto_filter: {k}x{n} is too small to gain from float8"
    if kind == "own_forward":  # converting would replace that forward by nn.Linear's
        return OWN_FORWARD
    return None


OWN_FORWARD = "overrides forward"


def float8_module_filter(*, recipe: str = "tensorwise", filter_fqns: Sequence[str] = (),
                         auto_filter: bool = False, force_fqns: Sequence[str] = ()
                         ) -> ModuleFilter:
    """The ``module_filter_fn(module, fqn) -> bool`` that :func:`apply_float8` uses."""
    filter_fqns, force_fqns = tuple(filter_fqns), tuple(force_fqns)
    return lambda m, fqn: _skip_reason(m, fqn, recipe, filter_fqns, auto_filter,
                                       force_fqns) is None


def _check_args(recipe: str, enable_fsdp_float8_all_gather: bool) -> None:
    if recipe not in FLOAT8_RECIPES:

        raise ValueError(f"apply_float8: recipe = {recipe!r}; allowed: {', '.join(FLOAT8_RECIPES)}"
                         f"{did_you_mean(recipe, FLOAT8_RECIPES, fallback=False)}")
    if enable_fsdp_float8_all_gather and recipe not in FLOAT8_ALL_GATHER_RECIPES:
        raise ValueError(f"apply_float8: enable_fsdp_float8_all_gather needs one scale per weight "
                         f"tensor; recipe = {recipe!r} cannot, use recipe='tensorwise'")


def apply_float8(
    model: nn.Module,
    *,
    recipe: str = "tensorwise",
    filter_fqns: Sequence[str] = (),
    auto_filter: bool | str = False,
    force_fqns: Sequence[str] = (),
    enable_fsdp_float8_all_gather: bool = False,
    emulate: bool | str = "auto",
    device: torch.device | str | None = None,
    module_filter_fn: ModuleFilter | None = None,
) -> list[str]:
    """Convert ``model``'s eligible ``nn.Linear`` layers to float8 training linears, in place.

    Works on a meta model (before parallelizing) or a materialised one; parameter names and
    objects are unchanged, so optimizers and checkpoints see the same state.

    Args:
        recipe: one of :data:`FLOAT8_RECIPES`.
        filter_fqns: module names to keep in high precision (an entry matches the module with
            that FQN, any FQN ending in ``.entry``, modules under it, or a glob such as
            ``layers.*.attention.wq``). The output head is the usual entry.
        auto_filter: also skip shapes too small to run faster (:func:`auto_filter_keeps`);
            "auto": only where float8 is not emulated (:func:`resolve_auto_filter`).
        force_fqns: module names (as ``filter_fqns``) converted even where ``auto_filter``
            would keep them; ``filter_fqns`` and the divisible-by-16 rule still win.
        enable_fsdp_float8_all_gather: FSDP2 all-gathers weights in float8 (tensorwise only).
        emulate: True, False or "auto" (emulate when ``device`` -- default: CUDA if available,
            else CPU -- has no float8 hardware). Emulated float8 has float8's numerics, not
            its speed.
        device: the device the model will train on, for ``emulate="auto"``.
        module_filter_fn: an extra ``(module, fqn) -> bool``; False keeps a linear as it is.

    Every matmul module is converted or named (``titanext.plugins._loud``): ``nn.Linear``
    and its subclasses that keep ``nn.Linear.forward`` convert; so does transformers' ``Conv1D``
    (weight ``[in, out]``: torchao's float8 matmul on that weight as it is, parameters and
    state dict unchanged); subclasses with their own forward are listed in one WARNING line and
    convert only when ``module_filter_fn`` returns True for them (their forward is then
    replaced by float8's linear); modules that multiply by their own 2-D parameter
    (``F.linear(x, self.w)``) are named in one WARNING line; classes with
    ``titanext_convert = False`` stay as they are.

    Returns:
        The FQNs of the converted linears. Layers that stay in high precision are logged
        with the reason.

    Raises:
        ValueError: nothing converts (it names the model class and why each linear was kept).
    """
    _check_args(recipe, enable_fsdp_float8_all_gather)
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    emulated = resolve_emulate(emulate, device)
    chosen, skipped = _choose(model, recipe, tuple(filter_fqns),
                              resolve_auto_filter(auto_filter, emulated), module_filter_fn,
                              tuple(force_fqns))
    if emulated and emulate == "auto":
        _log(logging.WARNING, "float8: %d matmul module(s) converted; %s has no float8 hardware, "
             "so float8 matmuls are emulated (float8 numerics at high-precision speed); set "
             "emulate = false to insist", len(chosen), device)
    wanted = set(chosen)

    def keep(module: nn.Module, fqn: str) -> bool:
        return fqn in wanted

    if recipe == "blockwise":
        _swap_blockwise(model, wanted, emulated)
    else:
        _quiet_torchao_import()
        try:
            # optional dependency (torchao)
            from torchao.float8 import Float8LinearConfig, convert_to_float8_training
        except ImportError as e:
            raise ImportError(f"apply_float8: recipe {recipe!r} needs torchao >= 0.17 (pip install "
                              "torchao); the 'blockwise' recipe runs without it") from e
        config = Float8LinearConfig.from_recipe_name(recipe)
        config = dataclasses.replace(config, emulate=emulated,
                                     enable_fsdp_float8_all_gather=enable_fsdp_float8_all_gather)
        convert_to_float8_training(model, config=config, module_filter_fn=keep)
        if enable_fsdp_float8_all_gather:
            _use_byte_all_gather_weights(model)
    conv1d = _convert_conv1d(model, wanted, recipe, None if recipe == "blockwise" else config,
                             emulated)
    if conv1d and enable_fsdp_float8_all_gather:
        _log(logging.WARNING, "float8: the weights of %d Conv1D module(s) are all-gathered by "
             "FSDP in high precision (enable_fsdp_float8_all_gather wraps nn.Linear weights "
             "only); their matmuls still run in float8", conv1d)
    _log(logging.INFO, "float8 (%s%s): converted %d matmul module(s); kept in high precision: %s",
         recipe, ", emulated" if emulated else "", len(chosen), ", ".join(skipped) or "none")
    return chosen


_log = log_rank0


def _choose(model: nn.Module, recipe: str, filter_fqns: tuple[str, ...], auto_filter: bool,
            module_filter_fn: ModuleFilter | None, force_fqns: tuple[str, ...] = ()
            ) -> tuple[list[str], list[str]]:
    """(FQNs to convert, "fqn (reason)" kept); warns about subclasses with their own forward
    and raises when nothing would convert."""
    chosen: list[str] = []
    skipped: list[str] = []
    own: list[tuple[str, nn.Module]] = []
    outside: list[tuple[str, nn.Module]] = []
    for fqn, module in model.named_modules():
        kind = matmul_kind(module)
        if kind is None:
            continue
        if kind == "param_matmul":
            outside.append((fqn, module))
        reason = _skip_reason(module, fqn, recipe, filter_fqns, auto_filter, force_fqns)
        wanted = module_filter_fn(module, fqn) if module_filter_fn is not None else None
        if reason == OWN_FORWARD:
            own.append((fqn, module))
            reason = None if wanted else reason  # only an explicit True includes it
        elif reason is None and wanted is False:
            reason = "module_filter_fn"
        if reason is None:
            chosen.append(fqn)
        else:
            skipped.append(f"{fqn or '<root>'} ({reason})")
    experts = stacked_experts_line(
        "float8", stacked_experts(model, _grouped_experts_types()),
        "apply_float8 converts nn.Linear and Conv1D; titanext's GroupedExperts convert with "
        "apply_float8_experts ([float8] moe_experts); these run the library's own expert loop, "
        "which nothing converts: they stay in high precision")
    for line in (own_forward_line("float8", own, set(chosen)), unconverted_line("float8", outside),
                 experts):
        if line:
            _log(logging.WARNING, "%s", line)
    if not chosen:
        fixes = ["loosen filter_fqns / module_filter_fn / auto_filter"]
        if own:
            fixes.append("return True from module_filter_fn for the nn.Linear subclasses that "
                         "override forward (their forward becomes float8's linear)")
        if outside:
            fixes.append("hold the weights multiplied outside nn.Linear in nn.Linear modules")
        raise ValueError(
            f"apply_float8: no matmul of {type(model).__name__} converts to float8. Looked for "
            "nn.Linear modules (subclasses too) and transformers Conv1D with both dims "
            "divisible by 16, not named by filter_fqns, accepted by module_filter_fn and "
            f"auto_filter; found: {'; '.join(skipped) or 'no matmul module at all'}. Fix: "
            + ", ".join(fixes) + ", or leave float8 off for this model (docs/float8.md)")
    return chosen, skipped


def _grouped_experts_types() -> tuple[type, ...]:
    from titanext.models.moe import GroupedExperts  # converted by apply_float8_experts

    return (GroupedExperts,)


def _convert_conv1d(model: nn.Module, fqns: set[str], recipe: str, config, emulate: bool
                    ) -> int:
    """Convert the chosen transformers Conv1D modules; how many."""
    count = 0
    for fqn in fqns:
        module = model.get_submodule(fqn)
        if matmul_kind(module) == "conv1d":
            _float8_conv1d(module, recipe, config, emulate)
            count += 1
    return count


def _swap_blockwise(model: nn.Module, fqns: set[str], emulate: bool) -> None:

    if "" in fqns:
        raise ValueError("apply_float8: recipe 'blockwise' swaps child modules and the model is "
                         "itself a Linear; wrap it in a container such as nn.Sequential")
    for fqn in fqns:
        parent_name, _, child = fqn.rpartition(".")
        parent = model.get_submodule(parent_name)
        if not isinstance(getattr(parent, child), nn.Linear):  # a Conv1D: converted apart
            continue
        parent.register_module(child, Float8BlockwiseLinear.from_float(getattr(parent, child),
                                                                       emulate=emulate))


def float8_linear_fqns(model: nn.Module) -> list[str]:
    """FQNs of the float8 matmul modules in ``model`` (torchao's, blockwise, Conv1D)."""

    names = []
    for fqn, m in model.named_modules():
        if (isinstance(m, (Float8BlockwiseLinear, Float8Conv1DMixin))
                or type(m).__name__ == "Float8Linear"):
            names.append(fqn)
    return names


def supports_float8_tp(model: nn.Module, fqns: Sequence[str]) -> bool:
    """True when every module in ``fqns`` is a tensorwise torchao Float8Linear, which is what
    torchao's float8 TP styles (float8 all-gathers of activations) require."""
    _quiet_torchao_import()
    try:
        from torchao.float8.config import ScalingGranularity  # optional dependency (torchao)
        from torchao.float8.float8_linear import Float8Linear  # optional dependency (torchao)
    except ImportError:  # no torchao: no torchao float8 linears either
        return False

    for fqn in fqns:
        m = model.get_submodule(fqn)
        if not isinstance(m, Float8Linear):
            return False
        if m.config.cast_config_input.scaling_granularity is not ScalingGranularity.TENSORWISE:
            return False
    return True


@torch.no_grad()
def precompute_float8_scales(model: nn.Module) -> None:
    """After ``optimizer.step()``: compute every float8-all-gathered weight's scale with one
    all-reduce, so FSDP's pre-all-gather does not need one per layer. A no-op without them."""
    _quiet_torchao_import()
    # optional dependency (torchao)
    from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

    precompute_float8_dynamic_scale_for_fsdp(model)


# -- transformers' Conv1D ------------------------------------------------------------------------

_CONV1D_CLASSES: dict[type, type] = {}


class Float8Conv1DMixin(nn.Module):
    """The forward of a float8 transformers Conv1D (see the module docstring)."""

    titanext_convert = False  # already converted
    float8_recipe: str = "tensorwise"
    emulate: bool = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.float8_recipe == "blockwise":

            y = float8_blockwise_linear(x, self.weight.t().contiguous(), emulate=self.emulate)
        else:
            # optional dependency (torchao)
            from torchao.float8.float8_linear import matmul_with_hp_or_float8_args

            if torch.is_autocast_enabled():  # as Float8Linear: keep the autocast dtype
                x = x.to(torch.get_autocast_gpu_dtype())
            y = matmul_with_hp_or_float8_args.apply(x, self.weight, self.linear_mm_config,
                                                    self.config)
        return y if self.bias is None else y + self.bias.to(y.dtype)


def _float8_conv1d_class(cls: type) -> type:
    if cls not in _CONV1D_CLASSES:
        _CONV1D_CLASSES[cls] = type(f"Float8{cls.__name__}", (Float8Conv1DMixin, cls),
                                    {"__module__": cls.__module__})
    return _CONV1D_CLASSES[cls]


def _float8_conv1d(module: nn.Module, recipe: str, config=None, emulate: bool = False) -> None:
    """Make the Conv1D ``module`` compute in float8, in place (``config``: torchao's
    ``Float8LinearConfig`` for the torchao recipes, None for ``"blockwise"``)."""
    module.__class__ = _float8_conv1d_class(type(module))
    module.float8_recipe, module.emulate = recipe, emulate
    if config is not None:
        from torchao.float8.float8_linear import Float8Linear  # optional dependency (torchao)

        # torchao's per-GEMM settings (emulation, fast accumulation, padding) as Float8Linear
        # builds them; a meta Float8Linear of the same shape lends them.
        with torch.device("meta"):
            donor = Float8Linear(module.weight.shape[0], module.weight.shape[1], bias=False,
                                 config=config)
        module.config, module.linear_mm_config = donor.config, donor.linear_mm_config


# -- FSDP2 float8 all-gather over gloo ------------------------------------------------------------

def _use_byte_all_gather_weights(model: nn.Module) -> None:
    """Re-wrap torchao's float8-all-gather weights so that gloo moves their bytes as uint8."""
    # optional dependency (torchao)
    from torchao.float8.fsdp_utils import WeightWithDynamicFloat8CastTensor

    cls = _byte_weight_class()
    for module in model.modules():
        w = getattr(module, "weight", None)
        if isinstance(w, WeightWithDynamicFloat8CastTensor) and type(w) is not cls:
            new = cls(w._tensor, w._linear_mm_config, w._dtype)
            module.weight = nn.Parameter(new, requires_grad=w.requires_grad)


def _byte_weight_class():
    _quiet_torchao_import()
    # optional dependency (torchao): that module imports it
    from titanext.plugins._float8_fsdp import ByteAllGatherFloat8Weight

    return ByteAllGatherFloat8Weight
