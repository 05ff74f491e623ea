"""Every figure the planner produces for the shipped configs, as text: the oracle of a change
that must leave them all as they are (a speed-up of the planner or of the advice's search).

For each ``train_configs/*.toml`` the planner accepts at its own world size
(:func:`titanext.config.fake_world_size`): :func:`~titanext.planning.plan_config` on H100 and
H800 (and, for MoE configs, at a routing imbalance of 1.3 with the replication comparison), and
:func:`~titanext.planning.advice.advise` with ``top=10``; then the 671B's advice at 2048 GPUs on
H100 and H800. Every field of every plan is written with ``repr`` (floats to the last bit).

Run it on the tree before the change and on the tree after, then compare the two files::

    PYTHONPATH=/path/to/before python benchmarks/planner_oracle.py > before.txt
    PYTHONPATH=$PWD python benchmarks/planner_oracle.py > after.txt
    cmp before.txt after.txt

``--quick`` leaves out the 671B's advice (the longest part).
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

from titanext.config import ConfigError, load_config
from titanext.config.layout import fake_world_size
from titanext.planning.advice import advise
from titanext.planning.estimate import plan_config
from titanext.planning.hardware import DEVICES
from titanext.planning.shapes import model_shape

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10, as titanext.config.loader
    import tomli as tomllib

CONFIGS = Path(__file__).resolve().parent.parent / "train_configs"
BIG = "deepseek_v3_671b.toml"


def _plan_text(plan) -> str:
    return repr(dataclasses.asdict(plan))


def _dump_config(path: Path, out) -> None:
    try:
        with open(path, "rb") as f:  # read first: the config validates only at its world
            world = tomllib.load(f).get("comm", {}).get("fake_world_size")
        world = world or fake_world_size(load_config(str(path), []))
        cfg = load_config(str(path), [], world_size=world)
    except ConfigError as e:
        print(f"== {path.name}: rejected ({str(e).splitlines()[0]})", file=out)
        return
    moe = model_shape(cfg).moe is not None
    variants = [(name, {"device": DEVICES[name]}) for name in ("h100", "h800")]
    variants += [("h100 ep_overlap=False comm_sms=0", {"ep_overlap": False, "comm_sms": 0})]
    if moe:
        variants += [("h100 imbalance=1.3 compare_replication",
                      {"imbalance": 1.3, "compare_replication": True})]
    for name, kwargs in variants:
        try:
            text = _plan_text(plan_config(cfg, world, **kwargs))
        except (ValueError, ConfigError) as e:
            text = f"raises {type(e).__name__}: {e}"
        print(f"== {path.name} world {world} plan_config {name}\n{text}", file=out)
    if path.name != BIG:  # its advice comes last, on both devices (not with --quick)
        _dump_advice(str(path), world, "h100", out)


def _dump_advice(path: str, world: int, device: str, out, top: int = 10) -> None:
    try:
        plans = advise(path, [], world, device=DEVICES[device], top=top)
    except (ValueError, ConfigError) as e:
        print(f"== {Path(path).name} world {world} advise {device}: raises "
              f"{type(e).__name__}: {e}", file=out)
        return
    print(f"== {Path(path).name} world {world} advise {device} top={top}: {len(plans)} plans",
          file=out)
    for plan in plans:
        print(_plan_text(plan), file=out)


def main(argv: list[str]) -> None:
    out = sys.stdout
    for path in sorted(CONFIGS.glob("*.toml")):
        _dump_config(path, out)
        out.flush()
    if "--quick" not in argv:
        for device in ("h100", "h800"):
            _dump_advice(str(CONFIGS / BIG), 2048, device, out)
            out.flush()


if __name__ == "__main__":
    main(sys.argv[1:])
