"""What ``apply_hf_context_parallel`` checks on a ``transformers`` model, before and while it runs.

CP replaces one function: the attention that a model reaches through transformers' attention
interface. That is exact only if (a) every sequence mixer of the model is such attention, (b)
each of them really calls the interface, and (c) the mask each layer means is one the CP kernels
compute (causal, a sliding window, documents). A state-space, convolution or linear-attention
mixer, or attention that bypasses the interface, would run on each rank's slice of the sequence
alone, and every rank would agree on the wrong gradients. So:

- :func:`check_cp_model` refuses, before anything is rewritten, every module and config entry
  that is not such attention, naming its path and the reason;
- :func:`layer_window` says which window a layer's mask has (from ``config.layer_types`` and
  ``config.sliding_window``, as transformers' masking does), and the attention function refuses
  a call whose ``sliding_window`` disagrees or that asks for something the kernels do not do;
- :class:`AttentionCallCheck` watches every decoder block run: a block that returns without
  having called the CP attention raises, naming the block (the interface was bypassed).
"""

from __future__ import annotations

import re

from torch import nn

_CONV = ("a convolution over the sequence: it mixes neighbouring tokens, which under CP sit on "
         "other ranks")
# (class-name pattern, why CP cannot split it); the first match names a module.
_MIXERS = (
    (re.compile(r"mamba|mixer|ssm", re.I),
     "a state-space (Mamba) mixer: it scans the sequence in order, so under CP each rank would "
     "scan only its own slice of it"),
    (re.compile(r"deltanet|linearattention|lightning|rwkv|retention", re.I),
     "a linear-attention mixer: it carries a recurrent state along the sequence, so under CP "
     "each rank would start from an empty state on its own slice"),
    (re.compile(r"recurrent|rglru", re.I),
     "a recurrent mixer: it carries a state along the sequence, so under CP each rank would "
     "start from an empty state on its own slice"),
    (re.compile(r"shortconv|hyena", re.I), _CONV),
)
_SEQUENCE_CONVS = (nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.ConvTranspose1d)
ATTENTION_LAYER_TYPES = ("full_attention", "sliding_attention")
_MAX_LINES = 12


def _mixer_reason(module: nn.Module, family: str) -> str | None:
    if isinstance(module, _SEQUENCE_CONVS):
        return _CONV
    name = type(module).__name__
    if family and name.startswith(family):  # RecurrentGemmaAttention is attention
        name = name[len(family):]
    for pattern, reason in _MIXERS:
        if pattern.search(name):
            return reason
    return None


def _config_refusals(config) -> list[str]:
    lines = []
    for i, kind in enumerate(getattr(config, "layer_types", None) or ()):
        if kind not in ATTENTION_LAYER_TYPES:
            lines.append(f"config.layer_types[{i}] = {kind!r}: only "
                         f"{' and '.join(map(repr, ATTENTION_LAYER_TYPES))} layers are attention "
                         "whose mask titanext computes")
    if getattr(config, "use_bidirectional_attention", False):
        lines.append("config.use_bidirectional_attention = True: CP attention is causal (with an "
                     "optional sliding window), not bidirectional")
    for key in ("attn_logit_softcapping", "attention_chunk_size"):
        if getattr(config, key, None) is not None:
            lines.append(f"config.{key} = {getattr(config, key)!r}: the CP attention kernels do "
                         f"not apply it; set it to None or train without CP")
    return lines


def cp_refusals(model: nn.Module) -> list[str]:
    """One line per reason ``model`` cannot run its sequence mixing as CP attention (empty
    when it can): every module of a decoder block that mixes the sequence without attention
    (matched by class name, the model family's prefix removed, or a convolution); when there is
    none, config entries, and a model that does not route attention through the interface."""
    lines, found = [], []
    family = re.sub(r"(For[A-Z]\w*|Model)$", "", type(model).__name__)
    for block_path, block in decoder_blocks(model):
        for sub, module in block.named_modules():
            path = f"{block_path}.{sub}" if sub else block_path
            if any(path.startswith(p + ".") for p in found):
                continue  # name the outermost mixer only
            reason = _mixer_reason(module, family)
            if reason is not None:
                found.append(path)
                lines.append(f"{path} ({type(module).__name__}): {reason}")
    if len(lines) > _MAX_LINES:
        lines = [*lines[:_MAX_LINES], f"... and {len(lines) - _MAX_LINES} more such modules"]
    if lines:  # the modules say it all (their layer_types and attention flags would repeat it)
        return lines
    config = getattr(model, "config", None)
    lines += _config_refusals(getattr(config, "get_text_config", lambda: config)())
    if not getattr(type(model), "_supports_attention_backend", False):
        lines.append(f"{type(model).__name__}: its attention does not go through transformers' "
                     "attention interface (_supports_attention_backend = False), so the CP "
                     "attention function would never be called")
    return lines


def check_cp_model(model: nn.Module) -> None:
    """ValueError listing every reason of :func:`cp_refusals`; nothing of ``model`` is changed."""
    lines = cp_refusals(model)
    if lines:
        raise ValueError(f"apply_hf_context_parallel: {type(model).__name__} cannot run under "
                         "context parallelism, which splits the sequence over ranks and replaces "
                         "only the attention function (nothing was changed):\n"
                         + "\n".join(f"  - {line}" for line in lines))


def layer_window(config, module: nn.Module, passed: int | None) -> int | None:
    """The sliding window of the layer ``module`` is in, as transformers' masks define it
    (``config.layer_types`` per layer, else ``config.sliding_window`` for every layer); a
    ValueError when the ``sliding_window`` the module passed (``passed``) disagrees with it."""
    types = getattr(config, "layer_types", None)
    index = getattr(module, "layer_idx", None)
    if types is not None and index is not None:
        want = config.sliding_window if types[index] == "sliding_attention" else None
        source = f"config.layer_types[{index}] = {types[index]!r}"
    else:
        want = getattr(config, "sliding_window", None)
        source = f"config.sliding_window = {want!r} (no config.layer_types)"
    if passed != want:
        raise ValueError(f"context parallelism: {type(module).__name__} (layer {index}) called "
                         f"attention with sliding_window = {passed!r}, but its mask is set by "
                         f"{source}; titanext cannot tell which window the model means, so it "
                         "refuses rather than train with another mask")
    return want


class AttentionCallCheck:
    """Forward hooks on every decoder block: a block that returns without calling the CP
    attention function (counted by :meth:`called`) raises, naming the block."""

    def __init__(self, model: nn.Module):
        self.calls = 0
        self._entered: dict[int, int] = {}
        self.blocks = decoder_blocks(model)
        for path, block in self.blocks:
            block.register_forward_pre_hook(self._enter)
            block.register_forward_hook(self._make_leave(path))

    def called(self) -> None:
        self.calls += 1

    def _enter(self, block: nn.Module, args) -> None:
        self._entered[id(block)] = self.calls

    def _make_leave(self, path: str):
        def leave(block: nn.Module, args, output) -> None:
            if self.calls == self._entered.pop(id(block), self.calls - 1):
                raise ValueError(
                    f"context parallelism: block {path} ({type(block).__name__}) ran without "
                    "calling transformers' attention interface, so its attention saw only this "
                    "rank's slice of the sequence; this model's attention bypasses the "
                    "interface and cannot run under CP")
        return leave


def block_list_path(model: nn.Module) -> str | None:
    """The dotted path of the first ``nn.ModuleList`` below ``model`` with as many entries as
    its (text) config's ``num_hidden_layers`` (``model.layers``, ``transformer.h``,
    ``backbone.layers``, ...), or None."""
    config = getattr(model, "config", None)
    config = getattr(config, "get_text_config", lambda: config)()
    layers = getattr(config, "num_hidden_layers", None)
    return next((p for p, m in model.named_modules()
                 if p and isinstance(m, nn.ModuleList) and len(m) and len(m) == layers), None)


def decoder_blocks(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """(path, block) of the model's decoder blocks: the ModuleList with as many entries as
    ``config.num_hidden_layers`` (else the longest one); ValueError when there is none."""
    path = block_list_path(model)
    lists = [(p, m) for p, m in model.named_modules() if isinstance(m, nn.ModuleList) and len(m)]
    candidates = ([(path, model.get_submodule(path))] if path is not None
                  else sorted(lists, key=lambda pm: -len(pm[1])))
    if not candidates:
        raise ValueError(f"apply_hf_context_parallel: {type(model).__name__} has no list of "
                         "decoder blocks (an nn.ModuleList), so titanext cannot check that "
                         "every block runs the CP attention")
    path, blocks = candidates[0]
    return [(f"{path}.{i}", b) for i, b in enumerate(blocks)]
