"""``titanext-convert hf-to-dcp | dcp-to-hf SRC DST`` (also ``python -m
titanext.launch.convert``): the command line of :mod:`titanext.hf.convert`.

It sits here, above the config, because ``dcp-to-hf --config FILE`` reads the model's shape
from a training config (:func:`titanext.config.model_args`); the conversion itself knows only
:class:`~titanext.models.ModelArgs`.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from titanext.config import load_config, model_args
from titanext.errors import ConfigError
from titanext.hf import convert

__all__ = ["main"]


def main(argv: Sequence[str] | None = None) -> int:
    """The command line; exit code 2 on bad input (message names the file)."""
    parser = argparse.ArgumentParser(prog="titanext-convert", description=convert.__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("hf-to-dcp", help="HF safetensors directory -> titanext DCP checkpoint")
    p.add_argument("src")
    p.add_argument("dst")
    p = sub.add_parser("dcp-to-hf", help="titanext DCP checkpoint -> HF safetensors directory")
    p.add_argument("src")
    p.add_argument("dst")
    p.add_argument("--config", help="the training config (model flavor, hf_assets_path)")
    p.add_argument("--hf-assets", help="HF directory whose config.json describes the model")
    p.add_argument("--max-shard-gb", type=float, default=5.0,
                   help="largest safetensors file to write (default 5)")
    ns = parser.parse_args(argv)
    try:
        if ns.command == "hf-to-dcp":
            n = convert.hf_to_dcp(ns.src, ns.dst)
        else:
            args, assets = None, ns.hf_assets
            if ns.config is not None:

                cfg = load_config(ns.config)
                args, assets = model_args(cfg), cfg.model.hf_assets_path or None
            n = convert.dcp_to_hf(ns.src, ns.dst, model_args=args, hf_assets=assets,
                                  max_shard_gb=ns.max_shard_gb)
    except ConfigError as e:
        for problem in e.problems:
            print(f"titanext-convert: error: {problem}", file=sys.stderr)
        return 2
    print(f"titanext-convert: wrote {n} tensors to {ns.dst}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
