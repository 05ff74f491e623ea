"""titanext's trainer, a plain PyTorch loop and torchtitan, side by side on one device.

    python benchmarks/side_by_side.py [--tiny] [--json FILE] [--markdown]
        [--flavor 1B --batch 2 --seq-len 8192 --warmup 3 --rounds 8]

Same model shape, batch and device, stepped in turns (A B C A B C ...); medians after warm-up:
tokens/s, MFU, each variant's own peak memory, and titanext / plain (target >= 0.98x) and
titanext / torchtitan (target >= 1.0x). On a GPU: the 1B flavor at 2x8192, bf16, compile and
op-level selective AC. ``--tiny`` (the default without CUDA): the debug flavor at 2x64 on CPU,
no compile, no timing worth quoting. torchtitan comes from benchmarks/wheels/ (see
benchmarks/side_by_side_variants.py, the variants and the wheel loader); where it does not
import, its row says why. benchmarks/gpu_session.sh runs it after ``python -m titanext.gpucheck``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys

import torch

os.environ.setdefault("TORCHAO_FORCE_SKIP_LOADING_SO_FILES",
                      "0" if torch.cuda.is_available() else "1")

# the variants beside this script, also when it is loaded from elsewhere (the tests)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from side_by_side_variants import SHAPE, measure_side_by_side  # noqa: E402

from titanext._text import format_table  # noqa: E402
from titanext.gpucheck._common import Ctx  # noqa: E402


def _at_least(low: int):
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = None
        if value is None or value < low:
            raise argparse.ArgumentTypeError(f"{text!r} given; allowed: a whole number >= {low}")
        return value
    return parse


def main(argv: list[str] | None = None) -> int:
    from titanext.models import MODEL_FLAVORS

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tiny", action="store_true", help="CPU-sized shapes (default without CUDA)")
    p.add_argument("--device", choices=("cuda", "cpu"), default=None)
    p.add_argument("--flavor", choices=sorted(MODEL_FLAVORS["llama3"]), default=None)
    p.add_argument("--batch", type=_at_least(1), default=None)
    p.add_argument("--seq-len", type=_at_least(1), default=None)
    p.add_argument("--warmup", type=_at_least(0), default=None)
    p.add_argument("--rounds", type=_at_least(1), default=None)
    p.add_argument("--wheels", default=None, help="directory of the torchtitan wheel(s)")
    p.add_argument("--json", metavar="FILE", help="also write the rows as JSON")
    p.add_argument("--markdown", action="store_true")
    args = p.parse_args(argv)
    import torch.distributed as dist

    owned = not dist.is_initialized()  # the trainer makes a one-rank group unless one exists
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    ctx = Ctx(device, args.tiny or device.type != "cuda")
    shape = list(SHAPE["quick" if ctx.quick else "gpu"])
    given = (args.flavor, args.batch, args.seq_len, args.warmup, args.rounds)
    for i, v in enumerate(given):
        shape[i] = shape[i] if v is None else v
    # no shape given: the default, which a card under 100 GiB runs at 2 x SMALL_GPU_SEQ
    rows = measure_side_by_side(ctx, None if given == (None,) * 5 else tuple(shape), args.wheels)
    print(format_table([{"row": r.name, "status": r.status, "value": r.value,
                         "target": r.target, "note": r.note} for r in rows],
                       markdown=args.markdown))
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({"device": torch.cuda.get_device_name(device) if ctx.cuda else "CPU",
                       "torch": torch.__version__, "shape": shape,
                       "rows": [dataclasses.asdict(r) for r in rows]}, f, indent=1, default=str)
    if owned and dist.is_initialized():
        dist.destroy_process_group()
    return 1 if any(r.status == "FAIL" for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
