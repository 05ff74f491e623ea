"""``titanext-data tokenize`` (also ``python -m titanext.launch.data tokenize``): pre-tokenize a
corpus into ``.npy`` shards (:mod:`titanext.data.pretokenize`).

    titanext-data tokenize --tokenizer byte corpus/ tokens/
    titanext-data tokenize --config train_configs/debug_model.toml corpus/ tokens/

Exit status 2 on bad input (a missing SRC, a file without the text field, a non-empty DST).
It sits here, above the config, because ``--config FILE`` reads the tokenizer and the text
field from a training config.
"""

from __future__ import annotations

import argparse
import sys

from titanext.config import load_config
from titanext.data.pretokenize import tokenize_corpus
from titanext.errors import ConfigError

__all__ = ["main"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="titanext-data",
                                     description="Data tools for titanext.")
    sub = parser.add_subparsers(dest="command", required=True)
    tok = sub.add_parser("tokenize", help="pre-tokenize .txt/.jsonl/.parquet/.arrow files into "
                                          ".npy shards for [training] dataset = 'tokens'")
    which = tok.add_mutually_exclusive_group(required=True)
    which.add_argument("--config", metavar="FILE",
                       help="a training config: its [model] tokenizer is used (and its "
                            "[training] dataset_text_field unless --text-field is given)")
    which.add_argument("--tokenizer", metavar="SPEC",
                       help="'byte', or a tokenizer.json file or a directory holding one")
    tok.add_argument("--text-field", default=None,
                     help="the jsonl key / parquet column with the text (default 'text')")
    tok.add_argument("--workers", type=int, default=None,
                     help="processes (default: one per CPU core, at most one per file)")
    tok.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    tok.add_argument("src", metavar="SRC", help="a text file or a folder of them")
    tok.add_argument("dst", metavar="DST", help="a new or empty folder for the shards")
    # Unknown --section.key=value arguments are config overrides (with --config only).
    args, overrides = parser.parse_known_args(argv)
    try:
        field = args.text_field
        if args.config:

            cfg = load_config(args.config, overrides)
            spec: tuple[str, ...] = ("name", cfg.model.tokenizer, cfg.model.hf_assets_path)
            if field is None:
                field = cfg.training.dataset_text_field
        else:
            if overrides:
                parser.error(f"unrecognized arguments: {' '.join(overrides)}")
            name = args.tokenizer
            spec = ("name", name) if name == "byte" else ("path", name)
        manifest = tokenize_corpus(args.src, args.dst, tokenizer_spec=spec,
                                   text_field=field or "text", workers=args.workers,
                                   progress=not args.no_progress)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    rate = manifest["tokens"] / max(manifest["seconds"], 1e-9)
    print(f"wrote {len(manifest['shards'])} shards, {manifest['tokens']:,} tokens "
          f"({manifest['dtype']}) in {manifest['seconds']:.1f} s ({rate:,.0f} tokens/s) to "
          f"{args.dst}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
