"""Which features compose with which parallelism, generated from the config validation itself.

Every cell is one :func:`titanext.config.load_config` call: the row's overrides plus the
column's, at the world size their degrees multiply to, on the debug models (the 6-layer dense
``debugmodel``; the MoE ``deepseek_v3_16b`` where experts are involved, as only its
shape is read and its 27 blocks fill every pipeline split). A cell is supported exactly when the
trainer accepts that config, and otherwise shows the validation's own reason as a footnote, so
the table cannot drift from the rules: the copy in docs/support_matrix.md is compared with a
fresh one in tests/docs/test_support_matrix.py.

    titanext-support-matrix              # text table for the terminal
    titanext-support-matrix --markdown   # the table of docs/support_matrix.md
    titanext-support-matrix --update-docs docs/support_matrix.md

(the console script; ``python -m titanext.config.support_matrix`` is the same command).

>>> m = support_matrix(rows=["TP + SP"], columns=["FSDP"])
>>> m.cells[0][0].supported
True
"""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field

from titanext.config import ConfigError, load_config
from titanext.plugins.rules import FLOAT8_RECIPES
from titanext.schedules import SCHEDULE_NAMES

__all__ = ["ROWS", "COLUMNS", "Cell", "Matrix", "support_matrix", "to_markdown", "to_text",
           "update_page", "PAGE", "UPDATE_COMMAND", "BEGIN_MARK", "END_MARK"]

P = "parallelism."


def _pp(schedule: str) -> dict[str, str]:
    return {P + "pipeline_parallel_degree": "2", P + "pipeline_parallel_schedule": schedule}


_FSDP = {P + "data_parallel_shard_degree": "2"}
_HSDP = {P + "data_parallel_replicate_degree": "2", P + "data_parallel_shard_degree": "2"}
_TP = {P + "tensor_parallel_degree": "2"}
_CP = {P + "context_parallel_degree": "2"}
# Experts need a MoE flavor; ep borrows its ranks from dp_shard x cp.
_EP = {P + "expert_parallel_degree": "2", P + "data_parallel_shard_degree": "2",
       "model.flavor": "deepseek_v3_16b"}


def _f8(recipe: str, **extra: str) -> dict[str, str]:
    return {"float8.enable": "true", "float8.recipe": recipe, **extra}


# Features (rows): name -> the overrides that turn the feature on.
ROWS: dict[str, dict[str, str]] = {
    "FSDP (ZeRO-3)": _FSDP,
    "FSDP ZeRO-2": {**_FSDP, P + "zero_stage": "2"},
    "HSDP": _HSDP,
    "ZeRO-1 (DDP + sharded optimizer)": {**_FSDP, P + "zero_stage": "1"},
    "TP + SP": _TP,
    "TP without SP": {**_TP, P + "enable_sequence_parallel": "false"},
    "CP zigzag, p2p": _CP,
    "CP zigzag, allgather": {**_CP, P + "context_parallel_comm": "allgather"},
    "CP contiguous": {**_CP, P + "context_parallel_load_balance": "contiguous"},
    "CP Ulysses (alltoall)": {**_CP, P + "context_parallel_comm": "alltoall"},
    "document masking": {"training.document_masking": "true"},
    **{f"PP {name}": _pp(name) for name in SCHEDULE_NAMES},
    "EP": _EP,
    "EP hot-expert replication": {**_EP, "moe.replicate_hot_experts": "2"},
    "EP all-to-all overlap": {**_EP, P + "expert_parallel_comm_overlap": "true"},
    "EP two-level dispatch": {**_EP, P + "expert_parallel_dispatch": "two_level",
                              P + "expert_parallel_ranks_per_node": "1"},
    "EP float8 dispatch": {**_EP, P + "expert_parallel_float8_dispatch": "true"},
    **{f"float8 {r}": _f8(r) for r in FLOAT8_RECIPES},
    "float8 FSDP all-gather": _f8("tensorwise", **{"float8.enable_fsdp_float8_all_gather": "true",
                                                   "float8.precompute_scale": "true"}),
    "AC full": {"activation_checkpoint.mode": "full"},
    "AC full, keep all-to-all": {"activation_checkpoint.mode": "full",
                                 "activation_checkpoint.keep_all_to_all": True},
    "AC selective, op level": {"activation_checkpoint.mode": "selective",
                               "activation_checkpoint.selective_ac_option": "op"},
    "AC selective, every 2nd block": {"activation_checkpoint.mode": "selective",
                                      "activation_checkpoint.selective_ac_option": "2"},
    "compile": {"compile.enable": "true"},
}

# Parallelisms and schedules (columns): the layout each feature is checked in.
COLUMNS: dict[str, dict[str, str]] = {
    "1 rank": {},
    "FSDP": _FSDP,
    "HSDP": _HSDP,
    "TP/SP": _TP,
    "CP": _CP,
    "EP": _EP,
    "PP 1F1B": _pp("1F1B"),
    "PP ZBH1": _pp("ZBH1"),
    "PP ZBV": _pp("ZBV"),
    "PP DualPipe": _pp("DualPipe"),
    "PP DualPipeV": _pp("DualPipeV"),
}

_DEGREES = ("data_parallel_replicate_degree", "data_parallel_shard_degree",
            "context_parallel_degree", "tensor_parallel_degree", "pipeline_parallel_degree")


@dataclass(frozen=True)
class Cell:
    """One combination: ``supported``, or the validation's problem lines (``reasons``);
    ``applicable`` is False when row and column set the same key differently (two schedules)."""

    supported: bool
    reasons: tuple[str, ...] = ()
    applicable: bool = True


@dataclass
class Matrix:
    rows: list[str]
    columns: list[str]
    cells: list[list[Cell]] = field(default_factory=list)


def _merge(a: dict[str, str], b: dict[str, str]) -> dict[str, str] | None:
    if any(k in b and b[k] != v for k, v in a.items()):
        return None
    return {**a, **b}


def check(overrides: dict[str, str]) -> Cell:
    """Validate one combination at the world size its degrees multiply to."""
    world_size = math.prod(int(overrides.get(P + d, "1")) for d in _DEGREES)
    try:
        load_config(None, [f"--{k}={v}" for k, v in overrides.items()], world_size=world_size)
    except ConfigError as e:
        return Cell(False, tuple(e.problems))
    return Cell(True)


def support_matrix(rows: Sequence[str] | None = None,
                   columns: Sequence[str] | None = None) -> Matrix:
    """Validate every row x column combination (all of :data:`ROWS` x :data:`COLUMNS` by
    default); see the module docstring."""
    m = Matrix(list(rows or ROWS), list(columns or COLUMNS))
    for r in m.rows:
        line = []
        for c in m.columns:
            merged = _merge(ROWS[r], COLUMNS[c])
            line.append(Cell(False, applicable=False) if merged is None else check(merged))
        m.cells.append(line)
    return m


def _footnotes(m: Matrix) -> tuple[list[list[str]], list[str]]:
    """Cell texts and the numbered reasons they point to (one footnote per distinct reason)."""
    notes: dict[str, int] = {}
    texts = []
    for line in m.cells:
        row = []
        for cell in line:
            if not cell.applicable:
                row.append("·")
            elif cell.supported:
                row.append("✓")
            else:
                ids = [notes.setdefault(reason, len(notes) + 1) for reason in cell.reasons]
                row.append("✗ " + ",".join(str(i) for i in ids))
        texts.append(row)
    return texts, list(notes)


def to_markdown(m: Matrix) -> str:
    """The table as GitHub markdown, footnotes (the rejection messages) below it."""
    texts, notes = _footnotes(m)
    out = ["| feature | " + " | ".join(m.columns) + " |",
           "|---|" + "---|" * len(m.columns)]
    out += [f"| {r} | " + " | ".join(t) + " |" for r, t in zip(m.rows, texts, strict=True)]
    out += ["", "✓ accepted by the config validation; ✗ n rejected at config load with message n; "
            "· not applicable (two schedules).", ""]
    out += [f"{i}. {note}" for i, note in enumerate(notes, 1)]
    return "\n".join(out) + "\n"


def to_text(m: Matrix) -> str:
    """The table for a terminal (fixed-width columns), footnotes below."""
    texts, notes = _footnotes(m)
    w0 = max(map(len, m.rows))
    widths = [max(len(c), *(len(t[j]) for t in texts)) for j, c in enumerate(m.columns)]
    out = [" " * w0 + "  " + "  ".join(c.ljust(w) for c, w in zip(m.columns, widths, strict=True))]
    for r, t in zip(m.rows, texts, strict=True):
        cells = "  ".join(x.ljust(w) for x, w in zip(t, widths, strict=True))
        out.append(r.ljust(w0) + "  " + cells)
    out.append("")
    out += [f"{i}. {note}" for i, note in enumerate(notes, 1)]
    return "\n".join(out) + "\n"


PAGE = "docs/support_matrix.md"
UPDATE_COMMAND = f"titanext-support-matrix --update-docs {PAGE}"
BEGIN_MARK = f"<!-- support-matrix: generated by `{UPDATE_COMMAND}` -->"
END_MARK = "<!-- support-matrix end -->"


def update_page(text: str, table: str) -> str:
    """``text`` with the block between :data:`BEGIN_MARK` and :data:`END_MARK` replaced."""
    start, end = text.find(BEGIN_MARK), text.find(END_MARK)
    if start < 0 or end < start:
        raise ValueError(f"the page has no {BEGIN_MARK!r} ... {END_MARK!r} block")
    return text[:start] + BEGIN_MARK + "\n\n" + table + "\n" + text[end:]


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="titanext-support-matrix", description=__doc__.split("\n\n")[0]
    )
    ap.add_argument("--markdown", action="store_true", help="print GitHub markdown")
    ap.add_argument("--update-docs", metavar="PATH",
                    help=f"rewrite the generated block in PATH (the docs page: {PAGE})")
    a = ap.parse_args(argv)
    m = support_matrix()
    if a.update_docs:
        with open(a.update_docs, encoding="utf-8") as f:
            text = f.read()
        with open(a.update_docs, "w", encoding="utf-8") as f:
            f.write(update_page(text, to_markdown(m)))
        return 0
    sys.stdout.write(to_markdown(m) if a.markdown else to_text(m))
    return 0


if __name__ == "__main__":
    sys.exit(main())
