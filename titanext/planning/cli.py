"""Planner: per-rank memory, communication, bubble and throughput of a layout, and advice.

    titanext-plan --config train_configs/llama3_70b.toml --world-size 64 \\
        [--gpus-per-node 8] [--device h100] [--top 5] [--fix pp=16,tp=1] [--json] \\
        [--svg memory.svg] [--imbalance 1.0] [--comm-sms 20] \\
        [--section.key=value ...]

It answers "which degrees should I use?" in seconds, without a process group, following the
Ultra-Scale Playbook's procedure: keep what fits in memory, reach the target batch, then rank
by estimated throughput (TP inside a node is cheap, across nodes expensive).

This module is the command line (the console script ``titanext-plan``, also
``python -m titanext.planning``); the estimates live in :mod:`titanext.planning`:
:mod:`~titanext.planning.layout` (the resolved layout), :mod:`~titanext.planning.memory`
(model state and activations, with the formulas), :mod:`~titanext.planning.comm`,
:mod:`~titanext.planning.stages` (bubble), :mod:`~titanext.planning.roofline` (compute),
:mod:`~titanext.planning.estimate` (:func:`plan_config`, assembling them) and
:mod:`~titanext.planning.advice` (:func:`advise`). The names below stay importable from here.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from collections.abc import Sequence

from titanext._text import format_table
from titanext.config import ConfigError, load_config, parse_cli
from titanext.planning.advice import FIXABLE, advise, toml_snippet
from titanext.planning.estimate import Plan, plan_config
from titanext.planning.hardware import COMM_SMS, DEVICES, GB, Device
from titanext.planning.memory import (
    activation_bytes_per_token_layer,
    gpt_activation_bytes,
    zero_bytes_per_rank,
)
from titanext.planning.report import layout_name, memory_svg
from titanext.planning.shapes import ModelShape, model_shape

__all__ = ["DEVICES", "Device", "ModelShape", "Plan", "activation_bytes_per_token_layer",
           "advise", "gpt_activation_bytes", "main", "memory_svg", "model_shape", "plan_config",
           "toml_snippet", "zero_bytes_per_rank"]


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="titanext-plan",
                                 description=__doc__.splitlines()[0], add_help=True)
    ap.add_argument("--world-size", type=int, required=True, help="number of GPUs")
    ap.add_argument("--gpus-per-node", type=int, default=8)
    ap.add_argument("--device", choices=sorted(DEVICES), default="h100")
    ap.add_argument("--peak-tflops", type=float, help="override the device's dense bf16 TFLOP/s")
    ap.add_argument("--hbm-gb", type=float, help="override the device's memory (GB)")
    ap.add_argument("--efficiency", type=float, default=0.6,
                    help="fraction of peak FLOP/s the kernels reach (default 0.6)")
    ap.add_argument("--imbalance", type=float, default=1.0,
                    help="MoE routing: rows of the busiest ep rank / the mean (default 1.0; a "
                         "measured moe_load, or what hot-expert replication leaves)")
    ap.add_argument("--comm-sms", type=int, default=COMM_SMS,
                    help="SMs taken by communication while it overlaps compute: the stages "
                         "whose expert-parallel all-to-all hides behind paired chunks compute "
                         f"on the rest (default {COMM_SMS}, the DeepSeek-V3 report's 20 of the "
                         "H800's 132; 0 charges none; docs/planner.md)")
    ap.add_argument("--top", type=int, default=5,
                    help="layouts to advise (0: none, the config's plan only)")
    ap.add_argument("--fix", action="append", default=[], metavar="KEY=N[,KEY=N]",
                    help="search only layouts with these degrees (keys: " + ", ".join(FIXABLE)
                         + "; e.g. --fix pp=16,tp=1): the same ranking among fewer layouts, "
                           "a faster search")
    ap.add_argument("--json", action="store_true", help="print JSON instead of tables")
    ap.add_argument("--svg", help="write the memory picture to this file")
    return ap


def _option_problems(known: argparse.Namespace) -> list[str]:
    """One line per bad planner option (the config's own problems come from load_config)."""
    problems = []
    if known.world_size < 1:
        problems.append(f"--world-size = {known.world_size} must be >= 1")
    if not 0 < known.efficiency <= 1:
        problems.append(f"--efficiency = {known.efficiency} must be in (0, 1]")
    if known.imbalance < 1:
        problems.append(f"--imbalance = {known.imbalance} must be >= 1 (busiest / mean rows)")
    if known.gpus_per_node < 1:
        problems.append(f"--gpus-per-node = {known.gpus_per_node} must be >= 1")
    if known.top < 0:
        problems.append(f"--top = {known.top} must be >= 0 (0: no advice)")
    problems += _fixed(known.fix)[1]
    sms = DEVICES[known.device].sms
    if not 0 <= known.comm_sms < sms:
        problems.append(f"--comm-sms = {known.comm_sms} must be in [0, {sms}) "
                        f"({DEVICES[known.device].name} has {sms} SMs)")
    return problems


def _fixed(values: Sequence[str]) -> tuple[dict[str, int], list[str]]:
    """``--fix`` as advise's ``fixed``, and one line per bad item."""
    fixed, problems = {}, []
    for item in (i for v in values for i in v.split(",") if i):
        key, _, value = item.partition("=")
        if key in fixed:
            problems.append(f"--fix {item}: {key} is fixed twice")
        elif key not in FIXABLE:
            problems.append(f"--fix {item}: {key!r} cannot be fixed (one of {', '.join(FIXABLE)})")
        elif not value.isdigit() or int(value) < 1:
            problems.append(f"--fix {item}: {key} = {value!r} must be an integer >= 1")
        else:
            fixed[key] = int(value)
    return fixed, problems


def main(argv: Sequence[str] | None = None) -> int:
    known, rest = _parser().parse_known_args(list(sys.argv[1:] if argv is None else argv))
    problems = _option_problems(known)
    device = DEVICES[known.device]
    if known.peak_tflops:
        device = dataclasses.replace(device, bf16_flops=known.peak_tflops * 1e12)
    if known.hbm_gb:
        device = dataclasses.replace(device, hbm_bytes=known.hbm_gb * GB)
    try:
        path, overrides, _ = parse_cli(rest)
        if problems:
            raise ConfigError(problems)
        cfg = load_config(path, overrides, world_size=known.world_size)
    except ConfigError as e:
        for problem in e.problems:
            print(f"titanext-plan: error: {problem}", file=sys.stderr)
        return 2
    current = plan_config(cfg, known.world_size, device=device, gpus_per_node=known.gpus_per_node,
                          efficiency=known.efficiency, imbalance=known.imbalance,
                          compare_replication=True, comm_sms=known.comm_sms)
    advice = advise(path, overrides, known.world_size, device=device,
                    gpus_per_node=known.gpus_per_node, top=known.top, efficiency=known.efficiency,
                    comm_sms=known.comm_sms, fixed=_fixed(known.fix)[0]) if known.top else []
    if known.svg:
        with open(known.svg, "w") as f:
            labels = ["config", *(f"#{i + 1}" for i in range(len(advice)))]
            f.write(memory_svg([current, *advice], labels, device.hbm_bytes))
    if known.json:
        print(json.dumps({"device": dataclasses.asdict(device),
                          "config": dataclasses.asdict(current),
                          "advice": [dataclasses.asdict(pl) for pl in advice]}, indent=1))
        return 0
    _print_text(cfg, current, advice, device, known.world_size, known.gpus_per_node, known.top)
    return 0


def _print_text(cfg, current: Plan, advice: list[Plan], device: Device, world_size: int,
                gpus_per_node: int, top: int) -> None:
    """The planner's tables: this config's memory, communication and step, then the advice."""
    shape = model_shape(cfg)
    print(f"{cfg.model.name} {cfg.model.flavor}: {shape.total / 1e9:.2f}B parameters on "
          f"{world_size} x {device.name} ({gpus_per_node} per node)\n")
    print(f"Memory per rank, this config ({layout_name(current.layout)}):")
    rows = [{"category": k, "GB": v / GB} for k, v in current.memory.items()]
    rows.append({"category": "total", "GB": current.memory_total / GB})
    rows.append({"category": f"HBM ({'fits' if current.fits else 'does NOT fit'} in 90%)",
                 "GB": device.hbm_bytes / GB})
    print(format_table(rows))
    print("\nCommunication per step and rank:")
    print(format_table([{"parallelism": c["parallelism"], "collectives": c["collectives"],
                         "GB": c["bytes"] / GB, "level": c["level"], "time (s)": c["time_s"]}
                        for c in current.comm] or [{"parallelism": "none"}]))
    tm = current.time
    print(f"\nStep {tm['step_s']:.2f} s (compute {tm['compute_s']:.2f} s, exposed comm "
          f"{tm['exposed_comm_s']:.2f} s, bubble {tm['bubble']:.1%}), MFU {tm['mfu']:.1%}, "
          f"{tm['tokens_per_s']:,.0f} tokens/s")
    if "muon_ns_s" in tm:  # the optimizer step's Muon terms
        print(f"Optimizer {tm['optimizer_s'] * 1e3:.2f} ms, of which Muon's Newton-Schulz on the "
              f"busiest owner {tm['muon_ns_s'] * 1e3:.2f} ms; owner exchange "
              f"{tm['muon_exchange_s'] * 1e3:.2f} ms")
    print()
    if "ep_all_to_all" in tm:
        print(ep_all_to_all_line(tm["ep_all_to_all"]))
        print(replication_line(tm["ep_replication"]) + "\n")
    if not advice:
        print("Advice: none (--top 0)" if not top else
              "Advice: no layout of this world size fits and validates")
        return
    print(f"Advice: the {len(advice)} fastest layouts that fit and validate:")
    print(format_table([{"#": i + 1, "layout": layout_name(pl.layout),
                         "memory GB": pl.memory_total / GB, "MFU": f"{pl.time['mfu']:.1%}",
                         "tokens/s": pl.time["tokens_per_s"]}
                        for i, pl in enumerate(advice)]))
    for i, pl in enumerate(advice[:3]):
        print(f"\n# layout #{i + 1}\n{toml_snippet(pl)}")


def ep_all_to_all_line(ep: dict) -> str:
    """The planner's expert-parallel all-to-all line (``Plan.time["ep_all_to_all"]``)."""
    on = ("no paired chunks in this schedule" if ep["exposed_on_s"] is None else
          f"{ep['exposed_on_s']:.2f} s waited, step {ep['step_on_s']:.2f} s")
    return (f"EP all-to-all at imbalance {ep['imbalance']:.2f}: {ep['per_step_s']:.2f} s per "
            f"step; overlap off: {ep['exposed_off_s']:.2f} s waited, step "
            f"{ep['step_off_s']:.2f} s; overlap on: {on}")


def replication_line(r: dict) -> str:
    """The planner's hot-expert replication line (``Plan.time["ep_replication"]``)."""
    return (f"Hot-expert replication at routing imbalance {r['imbalance']:.2f}: without copies, "
            f"step {r['step_off_s']:.2f} s; with replicate_hot_experts = {r['copies']} "
            f"(imbalance {r['imbalance_with_copies']:.2f}, {r['copy_gb']:.2f} GB of copies per "
            f"step and rank), step {r['step_on_s']:.2f} s")


if __name__ == "__main__":
    sys.exit(main())
