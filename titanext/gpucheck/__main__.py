"""python -m titanext.gpucheck [--json FILE] [--only GROUP ...] [--device cuda|cpu] [--markdown]

Exit codes: 0 nothing failed, 1 a check failed, 2 bad arguments.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import sys
import time
from collections.abc import Sequence

import torch
import torch.distributed as dist

from titanext._text import format_table
from titanext.gpucheck import ROWS, Row, run_gpucheck


def machine() -> dict:
    """What ran: device, torch, torchao, CUDA, date."""
    try:
        import torchao  # optional dependency (torchao)

        ao = torchao.__version__
    except ImportError:
        ao = None
    cuda = torch.cuda.is_available()
    return {"device": torch.cuda.get_device_name() if cuda else "CPU",
            "capability": ".".join(map(str, torch.cuda.get_device_capability())) if cuda else None,
            "torch": torch.__version__, "cuda": torch.version.cuda, "torchao": ao,
            "date": datetime.date.today().isoformat()}


def table(rows: Sequence[Row], markdown: bool = False) -> str:
    return format_table([{"section": r.section, "row": r.name, "status": r.status,
                          "value": r.value, "target": r.target, "s": f"{r.seconds:.1f}",
                          "note": r.note} for r in rows], markdown=markdown)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m titanext.gpucheck",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--json", metavar="FILE", help="also write the table and machine as JSON")
    parser.add_argument("--only", nargs="+", choices=ROWS, metavar="GROUP",
                        help=f"run only these row groups: {', '.join(ROWS)}")
    parser.add_argument("--device", choices=("cuda", "cpu"), default=None,
                        help="default: cuda if available")
    parser.add_argument("--quick", action="store_true",
                        help="CPU-sized shapes (the default without CUDA)")
    parser.add_argument("--markdown", action="store_true", help="print the table as markdown")
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("gpucheck: --device cuda, but torch.cuda.is_available() is False", file=sys.stderr)
        return 2
    os.environ.setdefault("TORCHAO_FORCE_SKIP_LOADING_SO_FILES",
                          "0" if torch.cuda.is_available() else "1")
    info = machine()
    print(f"# titanext gpucheck: {info['device']}, torch {info['torch']} (CUDA {info['cuda']}), "
          f"torchao {info['torchao'] or 'missing'}, {info['date']}", flush=True)
    start, seen = time.perf_counter(), []

    def on_row(r: Row) -> None:  # progress, and the JSON so far (a run cut short keeps it)
        seen.append(r)
        print(f"  {r.status:8} {r.name}: {r.value or r.note} ({r.seconds:.1f} s)", flush=True)
        if args.json:
            _write_json(args.json, info, seen, time.perf_counter() - start)

    rows = run_gpucheck(args.device, quick=True if args.quick else None, only=args.only,
                        on_row=on_row)
    total = time.perf_counter() - start
    print()
    print(table(rows, markdown=args.markdown))
    failed = [r for r in rows if r.status == "FAIL"]
    print(f"\n{len(rows)} rows: {sum(r.status == 'pass' for r in rows)} passed, {len(failed)} "
          f"failed, {sum(r.status == 'skipped' for r in rows)} skipped, "
          f"{sum(r.status == 'measured' for r in rows)} measured, in {total:.0f} s")
    if args.json:
        _write_json(args.json, info, rows, total)
    _close_process_group()
    return 1 if failed else 0


def _write_json(path: str, info: dict, rows: Sequence[Row], seconds: float) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump({**info, "seconds": round(seconds, 1),
                   "rows": [dataclasses.asdict(r) for r in rows]}, f, indent=1, default=str)


def _close_process_group() -> None:

    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
