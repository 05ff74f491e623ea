"""Seconds of the planner's advice on DeepSeek-V3 671B at 2048 GPUs
(``advise("train_configs/deepseek_v3_671b.toml", [], 2048, top=3)``, what ``titanext-plan
--advise`` and tests/e2e/test_configs_realistic.py run), for one tree or two compared.

Each run is a fresh process (imports outside the timing); with two trees they run in turns,
A B A B, and the medians and their ratio are printed, with the load average next to each::

    python benchmarks/planner_advice.py --trees /path/to/before /path/to/after --turns 2

Give each figure with its load: on a shared machine the wall time follows the load; the CPU
seconds (``process_time``) follow it less.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

CONFIG = str(Path(__file__).resolve().parent.parent / "train_configs" / "deepseek_v3_671b.toml")

_RUN = f"""
import json, time
from titanext.planning.advice import advise
wall, cpu = time.perf_counter(), time.process_time()
advise({CONFIG!r}, [], 2048, top=3)
print(json.dumps({{"wall": time.perf_counter() - wall, "cpu": time.process_time() - cpu,
                  "load": open("/proc/loadavg").read().split()[0]}}))
"""


def run_once(tree: str) -> dict:
    env = {**os.environ, "PYTHONPATH": tree}
    out = subprocess.run([sys.executable, "-c", _RUN], env=env, check=True,
                         capture_output=True, text=True, cwd=tree)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trees", nargs="+", default=[str(Path(__file__).resolve().parent.parent)])
    parser.add_argument("--turns", type=int, default=2)
    args = parser.parse_args()
    runs: dict[str, list[dict]] = {t: [] for t in args.trees}
    for turn in range(args.turns):
        for tree in args.trees:
            r = run_once(tree)
            runs[tree].append(r)
            print(f"turn {turn} {tree}: wall {r['wall']:.1f} s, cpu {r['cpu']:.1f} s, "
                  f"load {r['load']}", flush=True)
    medians = {t: {k: statistics.median(r[k] for r in rs) for k in ("wall", "cpu")}
               for t, rs in runs.items()}
    for tree, m in medians.items():
        print(f"median {tree}: wall {m['wall']:.1f} s, cpu {m['cpu']:.1f} s")
    if len(args.trees) == 2:
        a, b = (medians[t] for t in args.trees)
        print(f"ratio {args.trees[0]} / {args.trees[1]}: wall {a['wall'] / b['wall']:.2f}x, "
              f"cpu {a['cpu'] / b['cpu']:.2f}x")


if __name__ == "__main__":
    main()
