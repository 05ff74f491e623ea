"""The zoo's table: one row per architecture, one cell per plugin (its variants merged), the
counts per plugin, and the section of docs/zoo.md that ``--write-docs`` replaces."""

from __future__ import annotations

import re
from pathlib import Path

__all__ = ["BEGIN", "END", "cell", "counts", "markdown", "write_docs"]

BEGIN, END = "<!-- zoo table: begin -->", "<!-- zoo table: end -->"
KINDS = ("exact", "refused", "WRONG")
#: the widest reason a table cell shows
WIDTH = 160


def _short(text: str) -> str:
    text = re.sub(r"\s+", " ", text).replace("|", "/")
    return text if len(text) <= WIDTH else text[:WIDTH - 3] + "..."


def cell(per_variant: dict[str, tuple[str, str]]) -> tuple[str, str]:
    """One plugin's (kind, text) over the variants: WRONG if any variant is; n/a if none
    applies; exact if some variant is (naming the variants refused); else refused."""
    kinds = {v: k for v, (k, _) in per_variant.items()}
    texts = {v: t for v, (_, t) in per_variant.items()}
    wrong = [v for v, k in kinds.items() if k == "WRONG"]
    if wrong:
        return "WRONG", "; ".join(f"{v}: {texts[v]}" for v in wrong)
    if all(k == "n/a" for k in kinds.values()):
        return "n/a", ""
    refused = [v for v, k in kinds.items() if k == "refused"]
    if any(k == "exact" for k in kinds.values()):
        notes = list(dict.fromkeys(texts[v].split("; ", 1)[1] for v, k in kinds.items()
                                   if k == "exact" and "; " in texts[v]))  # past the figure
        notes += [f"{v}: refused ({_short(texts[v])})" for v in refused]
        return "exact", "; ".join(notes)
    reasons = list(dict.fromkeys(texts[v] for v in refused))
    return "refused", " / ".join(reasons)


def _show(kind: str, text: str) -> str:
    return f"{kind} ({_short(text)})" if text and kind != "exact" else (
        f"exact; {text}" if text else kind)


def counts(rows: dict[str, dict], plugins) -> dict[str, dict[str, int]]:
    """Per plugin: how many architectures are exact / refused / WRONG."""
    out = {p: dict.fromkeys(KINDS, 0) for p in plugins}
    for result in rows.values():
        for p in plugins:
            kind = result[p][0] if p in result else "WRONG"
            if kind in out[p]:
                out[p][kind] += 1
    return out


def markdown(rows: dict[str, dict], plugins, excluded: dict[str, str], *, version: str,
             date: str, seconds: float | None = None, not_run=()) -> str:
    """The table, the counts and the exclusion list, in Markdown."""
    lines = [f"Certified with transformers {version} on {date}: {len(rows)} architectures"
             + (f", {seconds / 60:.1f} minutes on 2 gloo ranks" if seconds else "") + ".", "",
             "| plugin | exact | refused | WRONG |", "|---|---|---|---|"]
    for p, c in counts(rows, plugins).items():
        lines.append(f"| {p} | {c['exact']} | {c['refused']} | {c['WRONG']} |")
    lines += ["", "| model type | " + " | ".join(plugins) + " |",
              "|---" * (len(plugins) + 1) + "|"]
    for model_type, result in sorted(rows.items()):
        cells = [_show(*result[p]) if p in result else "WRONG (no result)" for p in plugins]
        lines.append(f"| {model_type} | " + " | ".join(cells) + " |")
    lines += ["", f"Excluded ({len(excluded)}):", ""]
    lines += [f"- `{t}`: {_short(r)}" for t, r in sorted(excluded.items())]
    if not_run:
        lines += ["", f"Not run in this table ({len(not_run)}): "
                  + ", ".join(f"`{t}`" for t in not_run)]
    return "\n".join(lines) + "\n"


def write_docs(path: Path, section: str) -> None:
    """Replace the generated section of ``path`` (between :data:`BEGIN` and :data:`END`)."""
    text = path.read_text()
    if BEGIN not in text or END not in text:
        raise ValueError(f"{path} has no {BEGIN} ... {END} markers to write the table between")
    head, rest = text.split(BEGIN, 1)
    tail = rest.split(END, 1)[1]
    path.write_text(f"{head}{BEGIN}\n{section}{END}{tail}")
