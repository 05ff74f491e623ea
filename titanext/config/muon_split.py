"""The entries of ``[optimizer] muon_split_params``: which fused projections Muon orthogonalizes
per logical matrix, and how they split (torch-free; the schema checks the syntax, and
:func:`titanext.components.param_groups.group_problems` checks each entry against the model).

An entry is ``"GLOB = SIZES"``: a glob over parameter FQNs, then the logical matrices' sizes
joined by ``+`` along the rows (the output features of an ``nn.Linear`` weight ``[out, in]``, and
of each expert's matrix in a stacked ``[experts, out, in]`` weight); ``"GLOB = cols SIZES"``
splits the columns instead (a Conv1D weight ``[in, out]``, as GPT-2's ``c_attn``).

>>> parse_split("layers.*.attention.qkv.weight = 4096+1024+1024")
('layers.*.attention.qkv.weight', (0, (4096, 1024, 1024)))
>>> parse_split("h.*.attn.c_attn.weight = cols 768+768+768")
('h.*.attn.c_attn.weight', (1, (768, 768, 768)))
>>> split_entries_problem(["wq = 8"])
"'GLOB = SIZES' or 'GLOB = cols SIZES' with two or more sizes > 0 joined by + ('wq = 8' is not)"
"""

from __future__ import annotations

import re
from collections.abc import Sequence

__all__ = ["ns_dtype_on", "parse_split", "split_entries_problem"]

_ENTRY = re.compile(r"^\s*([^=\s]+)\s*=\s*(?:(rows|cols)\s+)?(\d+(?:\s*\+\s*\d+)+)\s*$")
_AXES = {None: 0, "rows": 0, "cols": 1}


def parse_split(entry: str) -> tuple[str, tuple[int, tuple[int, ...]]]:
    """``(glob, (axis, sizes))`` of one entry (axis 0 splits the rows, 1 the columns); ValueError
    when it does not parse."""
    match = _ENTRY.match(entry)
    sizes = tuple(int(s) for s in match.group(3).split("+")) if match else ()
    if not match or min(sizes) < 1:
        raise ValueError(entry)
    return match.group(1), (_AXES[match.group(2)], sizes)


def split_entries_problem(entries: Sequence[str]) -> str | None:
    """What the key allows, where an entry does not parse (the schema's field check)."""
    for entry in entries:
        try:
            parse_split(entry)
        except ValueError:
            return ("'GLOB = SIZES' or 'GLOB = cols SIZES' with two or more sizes > 0 joined by + "
                    f"({entry!r} is not)")
    return None


def ns_dtype_on(value: str, device_type: str) -> str:
    """``[optimizer] muon_ns_dtype`` on a device type: ``"auto"`` is bfloat16 on CUDA
    (torch.optim.Muon's, on tensor cores; a dry run and the planner stand for CUDA too) and
    float32 elsewhere (on CPU, bfloat16 GEMMs ran at 20 GFLOP/s against 78 in float32, and a
    4-rank debug-model step with Muon took 1.70x AdamW's against 1.20x: docs/muon.md).

    >>> ns_dtype_on("auto", "cuda"), ns_dtype_on("auto", "cpu"), ns_dtype_on("bfloat16", "cpu")
    ('bfloat16', 'float32', 'bfloat16')
    """
    if value != "auto":
        return value
    return "bfloat16" if device_type == "cuda" else "float32"
