"""Compare pipeline schedules in the simulator.

    python -m titanext.schedules --pp 4 --microbatches 8 [--f 1 --b 1 --w 1 --comm 0]
        [--timeline ZBH1] [--svg timeline.svg] [--markdown] [--max-pending-weight-grads N]
"""

from __future__ import annotations

import argparse
import sys

from titanext._text import format_table
from titanext.schedules import schedule_problems, simulate
from titanext.schedules.memory_cap import CAPPABLE
from titanext.schedules.registry import _SIMULATED


def comparison_rows(pp: int, microbatches: int, cap: int = 0, **costs: float) -> list[dict]:
    """One row per schedule; ``cap`` > 0 caps the pending W's of the schedules that take it."""
    rows = []
    for name in _SIMULATED:
        if schedule_problems(name, pp=pp, microbatches=microbatches):
            continue  # e.g. DualPipe at fewer than 2 pp micro-batches
        r = simulate(name, pp=pp, microbatches=microbatches, **costs,
                     max_pending_weight_grads=cap if name in CAPPABLE else 0)
        rows.append({"schedule": name, "makespan": round(r.makespan, 3),
                     "bubble": f"{r.bubble_ratio:.3f}",
                     "peak stage activations": max(r.peak_activations),
                     "peak memory (1/pp units)": max(r.peak_memory)})
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m titanext.schedules",
                                 description=__doc__.splitlines()[0])
    ap.add_argument("--pp", type=int, default=4)
    ap.add_argument("--microbatches", type=int, default=8)
    ap.add_argument("--f", type=float, default=1.0, help="forward time per stage and micro-batch")
    ap.add_argument("--b", type=float, default=1.0, help="input-gradient (I) time")
    ap.add_argument("--w", type=float, default=1.0, help="weight-gradient (W) time")
    ap.add_argument("--comm", type=float, default=0.0, help="time of one stage-to-stage transfer")
    ap.add_argument("--timeline", default="ZBH1", help="schedule whose timeline is drawn")
    ap.add_argument("--svg", help="also write that timeline as SVG")
    ap.add_argument("--markdown", action="store_true")
    ap.add_argument("--max-pending-weight-grads", type=int, default=0,
                    help="cap the pending W's of " + ", ".join(CAPPABLE) + " (0: no cap)")
    a = ap.parse_args(argv)
    counts = (("pp", a.pp), ("microbatches", a.microbatches))
    problems = [f"--{k} = {v} must be >= 1" for k, v in counts if v < 1]
    times = (("f", a.f), ("b", a.b), ("w", a.w))
    problems += [f"--{k} = {v} must be > 0" for k, v in times if v <= 0]
    if a.microbatches < a.pp:
        problems.append(f"--microbatches = {a.microbatches} must be >= --pp = {a.pp}")
    if a.max_pending_weight_grads < 0:
        problems.append(f"--max-pending-weight-grads = {a.max_pending_weight_grads} must be >= 0")
    if a.timeline not in _SIMULATED:
        problems.append(f"--timeline = {a.timeline!r} is not one of {', '.join(_SIMULATED)}")
    if problems:
        for p in problems:
            print(f"titanext.schedules: error: {p}", file=sys.stderr)
        return 2
    costs = dict(f=a.f, b=a.b, w=a.w, comm=a.comm)
    print(f"pp={a.pp}, {a.microbatches} micro-batches, F={a.f} I={a.b} W={a.w} comm={a.comm}")
    cap = a.max_pending_weight_grads
    print(format_table(comparison_rows(a.pp, a.microbatches, cap, **costs), markdown=a.markdown))
    r = simulate(a.timeline, pp=a.pp, microbatches=a.microbatches, **costs,
                 max_pending_weight_grads=cap if a.timeline in CAPPABLE else 0)
    print(f"\n{a.timeline} timeline (digit = micro-batch starting, then F/I/W/B):")
    print(r.timeline())
    if a.svg:
        with open(a.svg, "w") as f:
            f.write(r.svg(f"{a.timeline}: pp={a.pp}, m={a.microbatches}"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
