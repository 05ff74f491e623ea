"""``titanext-zoo`` (also ``python -m titanext.hf.zoo``): certify transformers architectures.

    titanext-zoo                                # every decoder-only causal LM of the auto mapping
    titanext-zoo --only llama,gemma3_text --plugins tp,cp
    titanext-zoo --write-docs                   # the table into docs/zoo.md
    titanext-zoo --list                         # what is certified, what is excluded and why
    titanext-zoo --results zoo.jsonl            # keep each result; a rerun resumes
    titanext-zoo --results zoo.jsonl --from-results --write-docs   # the table of a saved run

Prints one progress line per architecture, then the table and the total time. Exits 1 when any
cell is WRONG, 2 on bad arguments (one line per problem).
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
import time
from pathlib import Path

from titanext.hf.zoo.cells import PLUGINS, certify_type
from titanext.hf.zoo.configs import causal_lm_types, classify
from titanext.hf.zoo.pool import ZooPool
from titanext.hf.zoo.table import cell, markdown, write_docs

__all__ = ["certify", "main"]

DOCS = Path(__file__).resolve().parents[3] / "docs" / "zoo.md"


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line, no usage block
        print(f"titanext-zoo: {message}", file=sys.stderr)
        raise SystemExit(2)


def _parser() -> argparse.ArgumentParser:
    p = _Parser(prog="titanext-zoo", description=__doc__.split("\n\n")[0])
    p.add_argument("--only", help="comma-separated model types (default: every certified one)")
    p.add_argument("--plugins", help=f"comma-separated plugins out of {','.join(PLUGINS)}")
    p.add_argument("--write-docs", nargs="?", const=str(DOCS), metavar="PATH",
                   help=f"write the table between the markers of PATH (default {DOCS})")
    p.add_argument("--list", action="store_true", help="list certified and excluded types")
    p.add_argument("--results", metavar="PATH", help="append each architecture's cells to PATH "
                   "(JSON lines) and skip those already there: a long run resumes where it "
                   "stopped")
    p.add_argument("--from-results", action="store_true", help="run nothing: the table from "
                   "--results alone (types not in it are listed as not run)")
    p.add_argument("--deadline", type=float, default=600.0,
                   help="seconds one architecture may take before its case counts as hung")
    return p


def _names(text: str | None, allowed, key: str, problems: list[str]) -> list[str] | None:
    if text is None:
        return None
    names = [n.strip() for n in text.split(",") if n.strip()]
    bad = [n for n in names if n not in allowed]
    for n in bad:
        problems.append(f"{key}: {n!r} is not one of the allowed values ("
                        f"{', '.join(sorted(allowed)) if len(allowed) < 20 else 'see --list'})")
    return names if names else problems.append(f"{key}: {text!r} names nothing") or None


def _load_results(path: Path | None, plugins) -> tuple[dict, dict]:
    rows, unbuilt = {}, {}
    if path is None or not path.exists():
        return rows, unbuilt
    for line in path.read_text().splitlines():
        entry = json.loads(line)
        if "build" in entry:
            unbuilt[entry["type"]] = entry["build"]
        elif all(p in entry["variants"] for p in plugins):
            rows[entry["type"]] = {p: cell({v: tuple(kt) for v, kt in entry["variants"][p].items()})
                                   for p in plugins}
    return rows, unbuilt


def certify(model_types, plugins=PLUGINS, *, deadline_s: float = 600.0, log=print,
            results: Path | None = None) -> tuple:
    """Run the zoo over ``model_types`` on a persistent group of 2 gloo ranks.

    Returns (rows, failed_to_build): rows maps a type to ``{plugin: (kind, text)}``;
    failed_to_build maps a type whose tiny copy fails in one process to the error. With
    ``results`` (a JSON-lines file), types already there are not run again, and each new one is
    appended as it finishes."""
    pool = ZooPool(2, deadline_s=deadline_s)
    rows, unbuilt = _load_results(results, plugins)
    rows = {t: r for t, r in rows.items() if t in model_types}
    unbuilt = {t: r for t, r in unbuilt.items() if t in model_types}
    try:
        for i, t in enumerate(model_types, 1):
            if t in rows or t in unbuilt:
                continue
            start = time.monotonic()
            try:
                result = certify_type(pool.run, t, plugins)
            except (RuntimeError, TimeoutError) as e:  # the case ended its group: say so
                lines = [s for s in str(e).splitlines() if s.strip()]
                result = {p: {"": ("WRONG", f"case failed: {lines[-1][:160]}")} for p in plugins}
            if "_build" in result:
                unbuilt[t] = result["_build"]
                _append(results, {"type": t, "build": unbuilt[t]})
                log(f"[{i}/{len(model_types)}] {t}: excluded (fails to build tiny: "
                    f"{result['_build'][:120]})")
                continue
            rows[t] = {p: cell(result[p]) for p in plugins}
            _append(results, {"type": t, "variants": {p: result[p] for p in plugins}})
            summary = ", ".join(f"{p} {rows[t][p][0]}" for p in plugins)
            log(f"[{i}/{len(model_types)}] {t}: {time.monotonic() - start:.1f} s  {summary}")
    finally:
        pool.close()
    return rows, unbuilt


def _append(path: Path | None, entry: dict) -> None:
    if path is not None:
        with path.open("a") as f:
            f.write(json.dumps(entry) + "\n")


def main(argv: list[str] | None = None) -> int:
    import transformers  # the dev extra: only the zoo needs transformers

    args = _parser().parse_args(argv)
    transformers.logging.set_verbosity_error()  # the default configs' token-id warnings
    mapping = causal_lm_types()
    problems: list[str] = []
    only = _names(args.only, set(mapping), "--only", problems)
    plugins = _names(args.plugins, set(PLUGINS), "--plugins", problems) or list(PLUGINS)
    chosen = [t for t in only if t in mapping] if only else [] if problems else sorted(mapping)
    types = [classify(t, mapping[t]) for t in chosen]
    certified = [t.model_type for t in types if not t.excluded]
    excluded = {t.model_type: t.excluded for t in types if t.excluded}
    for t in only or ():
        if t in excluded:
            problems.append(f"--only: {t!r} is excluded: {excluded[t]}")
    if args.from_results and not args.results:
        problems.append("--from-results: needs --results PATH (the JSON lines of a run)")
    if problems:
        print("\n".join(f"titanext-zoo: {p}" for p in problems), file=sys.stderr)
        return 2
    if args.list:
        print("\n".join(f"{t}" for t in certified))
        print("\n".join(f"excluded {t}: {r}" for t, r in excluded.items()))
        return 0
    chosen = certified
    log = lambda line: print(line, file=sys.stderr, flush=True)  # noqa: E731
    log(f"titanext-zoo: {len(chosen)} architecture(s) x {len(plugins)} plugin(s) on 2 gloo ranks")
    start = time.monotonic()
    results = Path(args.results) if args.results else None
    if args.from_results:
        rows, unbuilt = _load_results(results, plugins)
        seconds = None
    else:
        rows, unbuilt = certify(chosen, plugins, deadline_s=args.deadline, log=log,
                                results=results)
        seconds = time.monotonic() - start
    not_run = [t for t in chosen if t not in rows and t not in unbuilt]
    excluded.update({t: f"fails to build tiny: {e}" for t, e in unbuilt.items()})
    if only:
        excluded = {t: r for t, r in excluded.items() if t in only}
    section = markdown(rows, plugins, excluded, version=transformers.__version__,
                       date=datetime.date.today().isoformat(), seconds=seconds, not_run=not_run)
    print(section)
    print(f"titanext-zoo: {len(rows)} architecture(s)"
          + (f" in {seconds:.0f} s" if seconds is not None else " (from --results)"))
    if args.write_docs:
        write_docs(Path(args.write_docs), section)
        print(f"titanext-zoo: wrote the table into {args.write_docs}")
    wrong = [f"{t}/{p}" for t, r in rows.items() for p, (k, _) in r.items() if k == "WRONG"]
    if wrong:
        print(f"titanext-zoo: {len(wrong)} WRONG cell(s): {', '.join(wrong)}", file=sys.stderr)
        return 1
    return 0
