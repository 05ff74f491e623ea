"""Parameter groups: which optimizer, learning rate and weight decay each parameter gets.

Torch-free: it reads parameter names and shapes only, so the same rules run in the trainer
and in the planner. ``[optimizer]`` chooses the groups by glob over parameter FQNs
(``fnmatch`` patterns, ``*`` crossing dots):

- ``muon_params``: the parameters Muon updates when ``name = "Muon"``. Unset, the shipped
  default: every parameter of two or more dimensions inside a block list (an FQN with a
  numeric segment, ``layers.3.``), routers excepted (a ``router`` or ``gate`` segment). A 3-D
  expert weight ``[experts, out, in]`` is one matrix per expert.
- ``no_decay_params``: AdamW / Adam parameters trained without weight decay. Unset: the
  1-D parameters (norms, biases) when ``name = "Muon"``, none with AdamW / Adam, so that
  existing AdamW runs train exactly as before.
- every other parameter: ``name``'s optimizer (AdamW under Muon) with ``lr`` and
  ``weight_decay``.

- ``muon_split_params``: fused Muon matrices orthogonalized per logical matrix
  (:mod:`titanext.config.muon_split`; :func:`muon_splits`).

The load-time rules give one line per problem (:func:`group_problems`): a glob that matches no
parameter, a parameter in both the Muon and the no-decay group, Muon on a 1-D parameter, a split
of a non-Muon parameter or one whose sizes do not add up to the dimension it splits.

>>> shapes = {"tok.weight": (8, 4), "layers.0.wq.weight": (4, 4), "layers.0.norm.weight": (4,),
...           "layers.0.moe.router.gate.weight": (2, 4), "layers.0.moe.experts.w1": (2, 4, 4)}
>>> groups = param_groups(shapes, name="Muon")
>>> [(g.optimizer, g.weight_decay_from, list(g.names))
...  for g in groups]  # doctest: +NORMALIZE_WHITESPACE
[('Muon', 'muon', ['layers.0.wq.weight', 'layers.0.moe.experts.w1']),
 ('AdamW', 'default', ['tok.weight', 'layers.0.moe.router.gate.weight']),
 ('AdamW', 'none', ['layers.0.norm.weight'])]
>>> group_problems(shapes, name="Muon", muon_params=["*.norm.*", "*.nothing"])
["optimizer.muon_params = '*.norm.*' selects 1-D parameters (layers.0.norm.weight); Muon \
updates matrices only (2-D, or 3-D expert weights)", "optimizer.muon_params = '*.nothing' \
matches no parameter of the model"]
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from fnmatch import fnmatchcase

from titanext.config.muon_split import parse_split

__all__ = ["ParamGroup", "default_muon", "group_problems", "muon_splits", "param_groups"]

_IN_BLOCK = re.compile(r"(^|\.)\d+\.")
_ROUTER_SEGMENTS = {"router", "gate"}


@dataclass(frozen=True)
class ParamGroup:
    """One optimizer group: ``optimizer`` ("Muon", "AdamW", "Adam"), the FQNs it holds, and
    where its weight decay comes from: "muon" (muon_weight_decay), "default" (weight_decay) or
    "none" (0)."""

    optimizer: str
    names: tuple[str, ...]
    weight_decay_from: str


def default_muon(name: str, shape: Sequence[int]) -> bool:
    """The shipped Muon selection: a matrix (or 3-D expert weight) inside a block list, not a
    router.

    >>> default_muon("layers.2.attention.wq.weight", (8, 8)), default_muon("output.weight", (8, 8))
    (True, False)
    >>> default_muon("model.layers.0.mlp.gate.weight", (4, 8))  # an HF MoE router
    False
    """
    segments = set(name.split("."))
    return len(shape) >= 2 and bool(_IN_BLOCK.search(name)) and not segments & _ROUTER_SEGMENTS


def _matches(name: str, globs: Sequence[str]) -> bool:
    return any(fnmatchcase(name, g) for g in globs)


def _selected(shapes: Mapping[str, Sequence[int]], *, name: str, muon_params, no_decay_params
              ) -> tuple[list[str], list[str]]:
    if name != "Muon":
        muon = []
    elif muon_params is None:
        muon = [n for n, s in shapes.items() if default_muon(n, s)]
    else:
        muon = [n for n in shapes if _matches(n, muon_params)]
    if no_decay_params is None:
        no_decay = [n for n, s in shapes.items() if name == "Muon" and len(s) < 2]
    else:
        no_decay = [n for n in shapes if _matches(n, no_decay_params)]
    return muon, no_decay


def group_problems(shapes: Mapping[str, Sequence[int]], *, name: str,
                   muon_params: Sequence[str] | None = None,
                   no_decay_params: Sequence[str] | None = None,
                   muon_split_params: Sequence[str] | None = None) -> list[str]:
    """One line per problem with the groups of a model whose parameters have ``shapes``
    (FQN -> shape): a glob matching nothing, a parameter in two groups, Muon on a 1-D one, a
    split that is not of a Muon matrix or does not tile its dimension."""
    problems = []
    for key, globs in (("muon_params", muon_params), ("no_decay_params", no_decay_params)):
        for glob in globs or ():
            hits = [n for n in shapes if fnmatchcase(n, glob)]
            if not hits:
                problems.append(f"optimizer.{key} = {glob!r} matches no parameter of the model")
            elif key == "muon_params":
                vectors = [n for n in hits if len(shapes[n]) < 2]
                if vectors:
                    more = f" and {len(vectors) - 2} more" if len(vectors) > 2 else ""
                    problems.append(
                        f"optimizer.muon_params = {glob!r} selects 1-D parameters "
                        f"({', '.join(vectors[:2])}{more}); Muon updates matrices only (2-D, "
                        "or 3-D expert weights)")
    if problems:
        return problems
    muon, no_decay = _selected(shapes, name=name, muon_params=muon_params,
                               no_decay_params=no_decay_params)
    both = sorted(set(muon) & set(no_decay))
    problems += [f"parameter {n} is in two groups (optimizer.muon_params and "
                 "optimizer.no_decay_params); remove it from one (Muon groups take "
                 "optimizer.muon_weight_decay = 0 for no decay)" for n in both]
    return problems + _split_problems(shapes, set(muon), muon_split_params or ())


def _split_problems(shapes: Mapping[str, Sequence[int]], muon: set[str],
                    entries: Sequence[str]) -> list[str]:
    problems, seen = [], {}
    for entry in entries:
        glob, (axis, sizes) = parse_split(entry)  # the schema checked the syntax
        key = f"optimizer.muon_split_params entry {entry!r}"
        hits = [n for n in shapes if fnmatchcase(n, glob)]
        if not hits:
            problems.append(f"{key} matches no parameter of the model")
        outside = [n for n in hits if n not in muon]
        if outside:
            problems.append(f"{key} selects {outside[0]}, which Muon does not update (not in "
                            "optimizer.muon_params); split only Muon matrices")
        untiled = []
        for n in hits:
            if n in seen:
                problems.append(f"{key} splits {n} again (also {seen[n]!r}); one entry a "
                                "parameter")
            seen[n] = entry
            if n in muon and sum(sizes) != tuple(shapes[n])[-2:][axis]:
                untiled.append(n)
        if untiled:
            n, dim = untiled[0], tuple(shapes[untiled[0]])[-2:][axis]
            more = f" and {len(untiled) - 1} more" if len(untiled) > 1 else ""
            problems.append(
                f"{key}: sizes {'+'.join(map(str, sizes))} = {sum(sizes)} do not tile the "
                f"{dim} {'columns' if axis else 'rows'} of {n}{more} (shape "
                f"{tuple(shapes[n])}); they must add up to {dim}")
    return problems


def muon_splits(shapes: Mapping[str, Sequence[int]], entries: Sequence[str] | None
                ) -> dict[str, tuple[int, tuple[int, ...]]]:
    """FQN -> ``(axis, sizes)`` of each parameter an entry splits (call :func:`group_problems`
    first).

    >>> muon_splits({"layers.0.qkv.weight": (12, 4), "layers.0.wo.weight": (4, 4)},
    ...             ["layers.*.qkv.weight = 4+4+4"])
    {'layers.0.qkv.weight': (0, (4, 4, 4))}
    """
    out = {}
    for entry in entries or ():
        glob, split = parse_split(entry)
        out.update({n: split for n in shapes if fnmatchcase(n, glob)})
    return out


def param_groups(shapes: Mapping[str, Sequence[int]], *, name: str,
                 muon_params: Sequence[str] | None = None,
                 no_decay_params: Sequence[str] | None = None) -> list[ParamGroup]:
    """The non-empty groups, in the order Muon, decayed, undecayed; each FQN in exactly one.
    Call :func:`group_problems` first: this function assumes they are none."""
    muon, no_decay = _selected(shapes, name=name, muon_params=muon_params,
                               no_decay_params=no_decay_params)
    rest_kind = "AdamW" if name == "Muon" else name
    taken = set(muon) | set(no_decay)
    groups = [ParamGroup("Muon", tuple(muon), "muon"),
              ParamGroup(rest_kind, tuple(n for n in shapes if n not in taken), "default"),
              ParamGroup(rest_kind, tuple(no_decay), "none")]
    return [g for g in groups if g.names]
