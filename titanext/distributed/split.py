"""Cutting one pipeline stage out of a model, any model: :func:`split_model`.

The stage keeps the whole model's FQNs (``transformer.h.5...`` on the stage holding block 5,
for a ``ModuleDict`` or a ``ModuleList`` of blocks), takes a dotted path to the blocks, and
either relies on a forward that skips ``None`` parts (titanext's reference model) or runs the
model's own forward unchanged (``skip_missing=True``: :func:`run_own_forward`). Re-exported by
:mod:`titanext.distributed.pipeline`, which builds the schedule around the stages.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence

import torch
from torch import nn

from titanext.distributed._stage_probe import probe_stage
from titanext.distributed.failsafe import guarded
from titanext.plugins._blocks import block_container

__all__ = ["split_model", "StageModuleList", "pass_on", "run_own_forward"]


@guarded  # an error on one rank ends every rank (titanext.distributed.failsafe)
def split_model(model: nn.Module, counts: Sequence[int], stage_index: int, *,
                blocks: str = "layers", first: Sequence[str] = ("tok_embeddings",),
                last: Sequence[str] = ("norm", "output"), skip_missing: bool = False,
                probe: bool = True) -> nn.Module:
    """A copy of ``model`` that keeps only stage ``stage_index``'s blocks.

    ``model.<blocks>`` (a dotted path such as ``"transformer.h"``) is an ``nn.ModuleDict`` or
    ``nn.ModuleList`` of blocks in order; the submodules in ``first`` (dotted paths) stay only
    on stage 0 and those in ``last`` only on the last stage. Block names (``layers.5``,
    ``transformer.h.5``) are kept for a ``ModuleList`` too (a :class:`StageModuleList`), so
    every stage's FQNs are the whole model's and checkpoints and TP plans stay
    layout-independent. Call it on a meta-device model: the copy is then free.

    What a stage does with the parts it lacks:

    - ``skip_missing=False``: they become ``None``; the model's ``forward`` must skip a ``None``
      part, as :class:`titanext.models.llama.Transformer` does.
    - ``skip_missing=True``, for a model whose ``forward`` does not: the stage runs the model's
      own ``forward`` unchanged (:func:`run_own_forward`). Its missing ``first`` parts return
      zeros of their output's shape; a later stage feeds the hidden state it receives into its
      first block instead of what the prelude computed, and a stage before the last returns its
      last block's output (the head is never reached). Every stage then takes the model's
      inputs as keyword arguments, the later ones after the received hidden state:
      ``schedule.step(target=..., losses=..., idx=tokens)`` on every rank (torch hands the
      keywords of ``step`` to every stage). Blocks must take the hidden state as their first
      positional argument, and every stage needs at least one block. ``probe`` (default True),
      on a materialised token model (``config.vocab_size``, a forward taking ``input_ids``):
      before returning, the stage runs on 16 random tokens beside the whole model and a
      ValueError names the first module that differs, or the error the stage raised (a forward
      that reads a block or a weight another stage holds); nothing runs on the meta device
      (:func:`titanext.distributed._stage_probe.probe_stage`).

    What a stage passes on is one tensor: the last block's output on a stage before the last,
    the model's output on the last. A ``ModelOutput`` (Hugging Face) gives its ``logits`` (or
    its one tensor), a tuple its one tensor (``(hidden, None)``, a block's ``(hidden, cache)``);
    an output holding several tensors raises a ValueError naming them, on the first step's
    forward, which runs before any backward. A parameter shared by parts that land on
    different stages (tied input and output embeddings) raises here: its copies would train
    apart.

    >>> from torch import nn
    >>> class GPT(nn.Module):  # a forward that does not skip missing parts
    ...     def __init__(self):
    ...         super().__init__()
    ...         self.transformer = nn.Module()
    ...         self.transformer.wte = nn.Embedding(10, 4)
    ...         self.transformer.h = nn.ModuleList(nn.Linear(4, 4) for _ in range(4))
    ...         self.lm_head = nn.Linear(4, 10)
    ...     def forward(self, idx):
    ...         x = self.transformer.wte(idx)
    ...         for block in self.transformer.h:
    ...             x = block(x)
    ...         return self.lm_head(x)
    >>> gpt = GPT()
    >>> parts = [split_model(gpt, [2, 2], i, blocks="transformer.h", first=["transformer.wte"],
    ...                      last=["lm_head"], skip_missing=True) for i in (0, 1)]
    >>> [n for n, _ in parts[1].named_parameters()][:2]
    ['transformer.h.2.weight', 'transformer.h.2.bias']
    >>> idx = torch.tensor([[1, 2, 3]])
    >>> hidden = parts[0](idx=idx)
    >>> torch.allclose(parts[1](hidden, idx=idx), gpt(idx))
    True
    """
    counts = list(counts)
    if not 0 <= stage_index < len(counts):
        raise ValueError(f"stage_index = {stage_index} is not in 0..{len(counts) - 1}")
    src = block_container(model, blocks)
    if sum(counts) != len(src):
        raise ValueError(f"layer counts {counts} sum to {sum(counts)}, but model.{blocks} has "
                         f"{len(src)} blocks")
    if skip_missing and 0 in counts:
        raise ValueError(f"skip_missing=True needs at least one block on every stage; layer "
                         f"counts {counts} leave stage {counts.index(0)} without one")
    _refuse_split_ties(model, src, blocks, counts, first, last)
    start = sum(counts[:stage_index])
    keep = range(start, start + counts[stage_index])
    # Copy without the blocks, then attach the kept ones (deepcopy of a meta model is cheap).
    _set_submodule(model, blocks, type(src)())
    try:
        stage = copy.deepcopy(model)
    finally:
        _set_submodule(model, blocks, src)
    if isinstance(src, nn.ModuleDict):
        names = list(src.keys())
        kept = nn.ModuleDict({names[i]: copy.deepcopy(src[names[i]]) for i in keep})
    else:
        kept = StageModuleList([copy.deepcopy(src[i]) for i in keep], start=start,
                               total=len(src))
    _set_submodule(stage, blocks, kept)
    is_first, is_last = stage_index == 0, stage_index == len(counts) - 1
    for name in (*(first if not is_first else ()), *(last if not is_last else ())):
        part = model.get_submodule(name)  # an error naming the path if it is not there
        _set_submodule(stage, name, _Absent(part) if skip_missing else None)
    if skip_missing:
        run_own_forward(stage, blocks, is_first=is_first, is_last=is_last)
        if probe:
            probe_stage(model, stage, counts, stage_index, blocks, who="split_model")
    return stage


def _refuse_split_ties(model: nn.Module, src: nn.Module, blocks: str, counts: list[int],
                       first: Sequence[str], last: Sequence[str]) -> None:
    """A ValueError if one parameter (tied weights) sits under parts on different stages."""
    if len(counts) < 2:
        return
    names, owner, start = list(src._modules), {}, 0
    for stage, n in enumerate(counts):
        owner.update({f"{blocks}.{name}.": stage for name in names[start:start + n]})
        start += n
    owner.update({f"{name}.": 0 for name in first})
    owner.update({f"{name}.": len(counts) - 1 for name in last})

    def stage_of(fqn: str) -> str:
        return next((str(st) for pre, st in owner.items() if fqn.startswith(pre)), "every")

    fqns: dict[int, list[str]] = {}
    for fqn, p in model.named_parameters(remove_duplicate=False):
        fqns.setdefault(id(p), []).append(fqn)
    for tied in (names for names in fqns.values() if len(names) > 1):
        if len({stage_of(n) for n in tied}) > 1:
            where = ", ".join(f"{n} (stage {stage_of(n)})" for n in tied)
            raise ValueError(f"{where} are one tied parameter, but the split puts them on "
                             "different stages, where their copies would train apart; untie "
                             "them (e.g. tie_word_embeddings=False) or keep those parts on one "
                             "stage")


def _set_submodule(model: nn.Module, path: str, module: nn.Module | None) -> None:
    parent, _, name = path.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, name, module)


class StageModuleList(nn.ModuleList):
    """The blocks ``start .. start+n-1`` of a split ``nn.ModuleList``, under their original
    indices: FQNs stay ``h.5.attn...`` on the stage that holds block 5. Iteration, ``len``
    and positional indexing (``blocks[0]`` is this stage's first block) work as on a list.

    >>> kept = StageModuleList([nn.Linear(2, 2), nn.Linear(2, 2)], start=4)
    >>> [name for name, _ in kept.named_children()], len(kept), kept[0] is kept[-2]
    (['4', '5'], 2, True)
    """

    def __init__(self, modules: Sequence[nn.Module] = (), start: int = 0, total: int = 0):
        super().__init__()
        for i, module in enumerate(modules):
            self.add_module(str(start + i), module)
        self._global_view = False
        self._total = max(int(total), start + len(modules))

    def global_view(self) -> list:
        """The whole model's block list, this stage's blocks at their global positions and a
        :class:`_SkippedBlock` elsewhere: what the model's own ``forward`` iterates over while
        a stage runs it (:func:`run_own_forward`), so ``enumerate(self.layers)`` and
        ``config.layer_types[i]`` see each block's global index ``i``."""
        return [self._modules.get(str(i)) or _SkippedBlock(i) for i in range(self._total)]

    def _key(self, idx: int) -> str:
        keys = list(self._modules)
        if not -len(keys) <= idx < len(keys):
            raise IndexError(f"index {idx} is out of range for {len(keys)} blocks")
        return keys[idx]

    def __len__(self) -> int:
        return self._total if self._global_view else len(self._modules)

    def __iter__(self):
        return iter(self.global_view() if self._global_view else list(self._modules.values()))

    def __getitem__(self, idx):
        if self._global_view:
            return self.global_view()[idx]
        if isinstance(idx, slice):
            return nn.ModuleList(list(self._modules.values())[idx])
        return self._modules[self._key(idx)]

    def __setitem__(self, idx: int, module: nn.Module) -> None:
        setattr(self, self._key(idx), module)

    def __delitem__(self, idx) -> None:
        raise TypeError("StageModuleList keeps the original block indices: do not delete blocks")

    def append(self, module: nn.Module) -> StageModuleList:
        last = int(next(reversed(self._modules))) if self._modules else -1
        self.add_module(str(last + 1), module)
        return self

    def insert(self, index: int, module: nn.Module) -> None:
        raise TypeError("StageModuleList keeps the original block indices: do not insert blocks")


class _SkippedBlock:
    """A block another stage holds, as the model's own ``forward`` sees it on this stage: it
    passes its first argument on unchanged (what it computes never reaches this stage's blocks:
    the received hidden state replaces it). Not a module, so no FQN changes."""

    def __init__(self, index: int):
        self.index = index

    def __call__(self, *args, **kwargs):
        return args[0] if args else kwargs.get("hidden_states")

    def __repr__(self) -> str:
        return f"_SkippedBlock({self.index})"


class _Absent(nn.Module):
    """Stands for a part another stage holds: returns zeros shaped like that part's output
    (computed on a parameter-free meta copy), so the model's own forward can still call it."""

    titanext_probe_skip = True  # its zeros are no output to compare (titanext.distributed.probe)

    def __init__(self, part: nn.Module):
        super().__init__()
        object.__setattr__(self, "_meta_part", copy.deepcopy(part).to("meta"))  # unregistered
        self.part_type = type(part).__name__

    def forward(self, *args, **kwargs):
        tensors = [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)]
        device = tensors[0].device if tensors else torch.device("cpu")

        def meta(x):
            return x.to("meta") if isinstance(x, torch.Tensor) else x

        with torch.no_grad():
            out = self._meta_part(*map(meta, args), **{k: meta(v) for k, v in kwargs.items()})
        return _zeros_like(out, device)

    def extra_repr(self) -> str:
        return f"held by another stage: {self.part_type}"


def _zeros_like(out, device: torch.device):
    if isinstance(out, torch.Tensor):
        return torch.zeros(out.shape, dtype=out.dtype, device=device)
    if isinstance(out, tuple | list):
        return type(out)(_zeros_like(x, device) for x in out)
    return out


class _StageOutput(Exception):  # noqa: N818 (a control-flow signal, not an error)
    def __init__(self, output):
        super().__init__("stage output")
        self.output = output


class _OwnForwardStage:
    """Mixed into a stage's class by :func:`run_own_forward` (its ``forward`` comes first)."""

    def forward(self, *args, **kwargs):
        spec = self._titanext_stage
        hidden = None
        if not spec["is_first"]:
            if not args:
                raise ValueError("a later pipeline stage is called as stage(hidden, **inputs): "
                                 "it got no hidden state (pass the model inputs by keyword)")
            hidden, args = args[0], args[1:]
        container = block_container(self, spec["blocks"])
        kept = list(container)
        handles = []
        if hidden is not None and spec.get("hidden_as") and not args and not any(
                k in kwargs for k in spec["inputs"]):
            # shapes for masks and positions; a copy, which the model's own code may change in
            # place (CTRL scales its inputs_embeds by sqrt(d) in place) without touching what
            # the first block is fed
            kwargs = {**kwargs, spec["hidden_as"]: hidden.detach().clone()}
        if hidden is not None:
            def feed(module, a, k):
                if not a:
                    raise ValueError(f"{spec['blocks']}: a block called without a positional "
                                     "hidden state cannot be fed the received one")
                return (hidden, *a[1:]), k
            handles.append(kept[0].register_forward_pre_hook(feed, with_kwargs=True,
                                                             prepend=True))
        if not spec["is_last"]:
            def done(module, a, out):
                raise _StageOutput(out)
            handles.append(kept[-1].register_forward_hook(done))
        global_view = isinstance(container, StageModuleList)
        if global_view:  # the model's forward sees every block at its global index
            container._global_view = True
        try:
            return pass_on(spec["forward"](self, *args, **kwargs),
                           f"{type(self).__mro__[2].__name__}.forward", last=True)
        except _StageOutput as stop:
            return pass_on(stop.output, f"the last block of {spec['blocks']} on this stage",
                           last=False)
        finally:
            if global_view:
                container._global_view = False
            for handle in handles:
                handle.remove()


def pass_on(output, where: str, *, last: bool) -> torch.Tensor:
    """The one tensor a pipeline stage sends on (or the loss reads) from what ``where`` returned:
    a tensor as it is; a ``ModelOutput`` (any mapping) its ``logits`` on the last stage, else its
    one tensor; a tuple or list its one tensor (``None`` and non-tensor entries, such as a
    cache, are dropped). Several tensors raise a ValueError naming them and the fix.

    >>> pass_on((torch.ones(2), None), "block", last=False).shape
    torch.Size([2])
    """
    if isinstance(output, torch.Tensor):
        return output
    if isinstance(output, Mapping):
        logits = output.get("logits") if last else None
        if isinstance(logits, torch.Tensor):
            return logits
        found = [(str(k), v) for k, v in output.items() if isinstance(v, torch.Tensor)]
    elif isinstance(output, tuple | list):
        found = [(f"[{i}]", v) for i, v in enumerate(output) if isinstance(v, torch.Tensor)]
    else:
        found = []
    if len(found) == 1:
        return found[0][1]
    role = "the logits (the loss reads them)" if last else "the hidden state to the next stage"
    held = ", ".join(f"{k} {tuple(v.shape)}" for k, v in found) or "no tensor"
    raise ValueError(f"pipeline stage: {where} returned a {type(output).__name__} holding {held}; "
                     f"a stage passes on one tensor, {role}. Make it return that tensor (or a "
                     "ModelOutput with .logits on the last stage), e.g. with a small wrapper "
                     "module around the blocks or the model")


def run_own_forward(stage: nn.Module, blocks: str, *, is_first: bool, is_last: bool,
                    hidden_as: str | None = None, inputs: Sequence[str] = ()) -> None:
    """Make ``stage`` (a split model) a pipeline stage that runs the model's own ``forward``
    (see :func:`split_model`, ``skip_missing=True``, which calls this), in place. Its class
    becomes a subclass of the model's, so FQNs, ``isinstance`` and FSDP / TP are unchanged.
    While it runs, the model's ``forward`` sees every block at its global index (a
    ``StageModuleList`` iterates over all of them, another stage's blocks passing the hidden
    state on), so ``enumerate(self.layers)`` and ``config.layer_types[i]`` mean what they mean
    in the whole model. ``hidden_as``: a keyword of the model's forward that a later stage
    called as ``stage(hidden)`` alone also gets the hidden state under (a Hugging Face model's
    ``inputs_embeds``, for its shapes), unless one of ``inputs`` is given."""
    cls = type(stage)
    if isinstance(stage, _OwnForwardStage):
        cls = cls.__mro__[2]  # already converted: re-target the model's own class
    stage.__class__ = type(f"{cls.__name__}Stage", (_OwnForwardStage, cls), {})
    stage._titanext_stage = {"blocks": blocks, "is_first": is_first, "is_last": is_last,
                             "forward": cls.forward, "hidden_as": hidden_as,
                             "inputs": (*inputs, hidden_as) if hidden_as else tuple(inputs)}
