"""Pipeline schedules through the trainer: tokens/s of the debug model at pp = 2.

    python benchmarks/pipeline_trainer.py [--markdown] [--rounds 6] [--steps-per-turn 2]
        [--schedules 1F1B,ZBH1,ZBH2,ZBV,Auto,DualPipeV,DualPipe] [--autograd-split] [--profile]
        [--warmup 3] [--pin] [--against REV]

Every schedule gets its own ``titanext.trainer.Trainer`` (debug model, pp = 2 on gloo, one
thread per rank, 8 micro-batches of 2 x 512 tokens, fp32, synthetic data), all built in one
2-process spawn. After ``--warmup`` (3) steps each (Auto measures F, I, W on its first step and
switches), the trainers take turns: each round runs ``--steps-per-turn`` timed steps of every
schedule in turn, so a burst of load from elsewhere hits all of them alike. Per schedule: the
median step time over all timed steps, tokens/s (16 x 512 tokens per step), the ratio to 1F1B
(torch's Schedule1F1B), the spread of the per-round medians (min - max ratio over rounds) and
the load average. ``--autograd-split`` adds "ZBH1 (autograd split)": torch's
stage_backward_input / _weight instead of deferred weight gradients.

``--profile``: after the timed rounds, each trainer runs two more steps through its
``[profiling]`` keys (one profiler warm-up step, one traced), and the benchmark prints every
schedule's step table (docs/profiling.md): phases, F/I/W chunks, measured and simulated
bubble, send/recv time, per rank. The timed steps run without a profiler.
``benchmarks/pipeline_trace.py`` gives the finer table (waits, queue, gc, page faults, off-CPU
time) without a profiler.

``--pin`` pins rank r's process to core r (mod the cores it may use) before anything is built.
The ranks start with :data:`KEEP_FREED_MEMORY` in their environment (glibc keeps freed memory
instead of returning it: the CPU stand-in for a GPU's caching allocator), unless
``--glibc-default``.

``--against REV``: the same benchmark for this tree and for ``REV`` (any git revision of this
repository, built in a temporary ``git worktree``), the trees taking turns: ``--rounds`` runs of
each, in the order A B B A A B ..., each run a fresh spawn of this script with ``PYTHONPATH`` set
to its tree's root (so it imports that tree's titanext) doing ``--steps-per-turn`` rounds of
one step of every schedule in turn. Per tree and schedule: the median step, tokens/s, the
median over runs of the run's ratio to 1F1B, and that ratio's spread (min - max over runs);
then each schedule's step time in this tree against REV's (median over runs of this run /
REV's run of the same turn).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import torch.distributed as dist

# only what every revision --against may run has: the launcher, the config loader, the trainer
from titanext.launch.local import run_distributed

SCHEDULES = ["1F1B", "ZBH1", "ZBH2", "ZBV", "Auto", "DualPipeV", "DualPipe"]
AGAINST = ["1F1B", "ZBH1", "ZBV", "Auto", "DualPipeV"]  # --against's default: the targets
BATCH, SEQ, MICROBATCHES = 16, 512, 8
PROFILE_FREQ = 2  # --profile: step 1 warms the profiler up, step 2 is traced
PROFILE = ["--profiling.enable_profiling", f"--profiling.profile_freq={PROFILE_FREQ}",
           "--profiling.profiler_warmup=1", "--profiling.profiler_active=1"]


def _overrides(schedule: str, split: str, folder: str, profile: bool) -> list[str]:
    return [*(PROFILE if profile else []),
            "--model.flavor=debugmodel", "--training.dataset=synthetic",
            f"--training.local_batch_size={BATCH}", f"--training.seq_len={SEQ}",
            "--training.steps=100000", "--training.mixed_precision_param=float32",
            "--metrics.enable_tensorboard=false", "--metrics.log_freq=100000",
            "--metrics.progress_bar=false", f"--job.dump_folder={folder}",
            "--parallelism.pipeline_parallel_degree=2",
            f"--parallelism.pipeline_parallel_schedule={schedule}",
            f"--parallelism.pipeline_parallel_microbatches={MICROBATCHES}",
            f"--parallelism.pipeline_parallel_split_backward={split}"]


#: glibc's malloc keeps freed memory instead of handing it back to the OS (trim) or mapping
#: each large block afresh (mmap): without these a CPU step faults its activations' pages
#: back in (zeroed by the kernel) every step, 26,000 faults per step per rank under ZBV against
#: 9,000 under 1F1B here at about 5 us each (docs/pipeline.md#where-a-steps-time-goes).
#: torch has no caching allocator on CPU; a GPU run reuses its blocks and pays none of it.
KEEP_FREED_MEMORY = {"MALLOC_TRIM_THRESHOLD_": str(2**32), "MALLOC_MMAP_THRESHOLD_": str(2**25),
                     "MALLOC_TOP_PAD_": str(2**28)}


@contextlib.contextmanager
def rank_environment(glibc_default: bool):
    """``os.environ`` for ranks started inside (they read it at start-up): with
    :data:`KEEP_FREED_MEMORY` unless ``glibc_default``."""
    saved = dict(os.environ)
    if not glibc_default:
        os.environ.update(KEEP_FREED_MEMORY)
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)


def pin_rank(rank: int) -> None:
    """Pin this process (its compute thread and gloo's) to core ``rank`` mod the cores it may
    use, so that two ranks never share a core while another is idle."""
    cores = sorted(os.sched_getaffinity(0))
    os.sched_setaffinity(0, {cores[rank % len(cores)]})


def _turns(rank, world, variants, rounds, per_turn, folder, profile, warmup=2, pin=False):
    """Per variant: every timed step's seconds, grouped by round (then, with ``profile``, a
    profiled window of each trainer: its tables land in the variant's dump folder)."""
    if pin:
        pin_rank(rank)
    from titanext.config import load_config
    from titanext.trainer import Trainer

    trainers = {}
    for i, (name, split) in enumerate(variants):
        cfg = load_config(None, _overrides(name, split, f"{folder}/{i}", profile),
                          world_size=world)
        trainers[(name, split)] = Trainer(cfg)

    def step(trainer) -> float:
        dist.barrier()
        t0 = time.perf_counter()
        trainer.train_step(trainer.next_microbatches())
        elapsed = time.perf_counter() - t0
        dist.barrier()
        return elapsed

    for trainer in trainers.values():  # warm-up (Auto measures and switches on step 1)
        for _ in range(warmup):
            step(trainer)
    times = {v: [] for v in variants}
    for _ in range(rounds):
        for v, trainer in trainers.items():
            times[v].append([step(trainer) for _ in range(per_turn)])
    for trainer in trainers.values() if profile else ():
        with contextlib.redirect_stdout(io.StringIO()):  # the benchmark prints the tables
            trainer.train(until_step=PROFILE_FREQ)
    # the step time is the slowest rank's: every rank's barrier-to-return time
    everyone = [None] * world
    dist.all_gather_object(everyone, times)
    return {v: [[max(r[v][i][j] for r in everyone) for j in range(per_turn)]
                for i in range(rounds)] for v in variants}


def _label(variant: tuple[str, str]) -> str:
    name, split = variant
    return name if split == "deferred" or name == "1F1B" else f"{name} ({split} split)"


def _step_tables(folder: str, variants, world: int) -> dict[str, list[dict]]:
    """Per variant: the step table rows of its profiled window, from every rank's JSON."""
    from titanext.components.step_table import breakdown_rows  # (not needed by --against runs)

    out = {}
    for i, v in enumerate(variants):
        window = os.path.join(folder, str(i), "profile_traces", f"iteration_{PROFILE_FREQ}")
        tables = []
        for rank in range(world):
            with open(os.path.join(window, f"rank{rank}_step_table.json")) as f:
                tables.append(json.load(f))
        out[_label(v)] = breakdown_rows(tables)
    return out


def _variants(schedules, autograd_split: bool) -> list[tuple[str, str]]:
    variants = [(s, "deferred") for s in schedules]
    if autograd_split:
        variants.insert(schedules.index("ZBH1") + 1 if "ZBH1" in schedules else 1,
                        ("ZBH1", "autograd"))
    return variants


def measure(schedules, rounds: int, per_turn: int, autograd_split: bool = False,
            profile: bool = False, warmup: int = 2, pin: bool = False,
            glibc_default: bool = False) -> tuple[dict, dict]:
    """Every variant's timed steps (seconds, grouped by round), and ``info``: the load, the
    run's seconds and (``profile``) each variant's step table rows under ``"step_tables"``."""
    variants = _variants(schedules, autograd_split)
    assert variants[0][0] == "1F1B", "1F1B is the baseline"
    load_before, t0 = os.getloadavg(), time.time()
    with tempfile.TemporaryDirectory() as folder, rank_environment(glibc_default):
        times = run_distributed(_turns, 2, args=(variants, rounds, per_turn, folder, profile,
                                                 warmup, pin), timeout_s=3600)[0]
        tables = _step_tables(folder, variants, 2) if profile else {}
    info = {"load_before": load_before, "load_after": os.getloadavg(),
            "seconds": time.time() - t0, "step_tables": tables}
    return times, info


def trainer_table(schedules, rounds: int, per_turn: int, autograd_split: bool = False,
                  profile: bool = False, warmup: int = 2, pin: bool = False,
                  glibc_default: bool = False) -> tuple[list[dict], dict]:
    """The timing rows, and ``info`` (:func:`measure`)."""
    times, info = measure(schedules, rounds, per_turn, autograd_split, profile, warmup, pin,
                          glibc_default)
    variants = list(times)
    base = statistics.median(t for r in times[variants[0]] for t in r)
    base_rounds = [statistics.median(r) for r in times[variants[0]]]
    rows = []
    for v in variants:
        med = statistics.median(t for r in times[v] for t in r)
        per_round = [statistics.median(r) / b for r, b in zip(times[v], base_rounds, strict=True)]
        rows.append({"schedule": _label(v), "step (s)": f"{med:.3f}",
                     "tokens/s": f"{BATCH * SEQ / med:,.0f}", "vs 1F1B": f"{med / base:.3f}x",
                     "per-round range": f"{min(per_round):.3f}-{max(per_round):.3f}x"})
    return rows, info


def problems(a) -> list[str]:
    """One line per bad argument: the flag, the value and what is allowed."""
    out = []
    for flag, value, low in (("--rounds", a.rounds, 1), ("--steps-per-turn", a.steps_per_turn, 1),
                             ("--warmup", a.warmup, 1)):
        if value < low:
            out.append(f"{flag} {value}: allowed: a whole number >= {low}")
    names = a.schedules.split(",")
    unknown = [n for n in names if n not in SCHEDULES]
    if unknown or names[:1] != ["1F1B"]:
        out.append(f"--schedules {a.schedules}: allowed: 1F1B first (the baseline), then any of "
                   f"{', '.join(SCHEDULES[1:])}")
    if a.against is not None and (a.profile or a.json):
        out.append("--against: allowed without --profile and --json")
    return out


def _git(root: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["git", "-C", root, *args], capture_output=True, text=True)


def resolve_revision(root: str, rev: str) -> str | None:
    """``rev``'s commit in the repository at ``root``, or None when it names none."""
    if rev.startswith("-"):
        return None
    done = _git(root, "rev-parse", "--verify", "--quiet", f"{rev}^{{commit}}")
    return done.stdout.strip() if done.returncode == 0 else None


def _run_tree(tree: str, a) -> dict:
    """One run of this script in a fresh process importing ``tree``'s titanext: every
    schedule's median step (seconds) and the run's load."""
    env = {**os.environ, "PYTHONPATH": tree}
    with tempfile.TemporaryDirectory() as folder:
        out = os.path.join(folder, "times.json")
        # --steps-per-turn rounds of one step each: a burst of load lands on all schedules
        cmd = [sys.executable, os.path.abspath(__file__), "--json", out, "--rounds",
               str(a.steps_per_turn), "--steps-per-turn", "1", "--warmup", str(a.warmup),
               "--schedules", a.schedules, *(["--pin"] if a.pin else []),
               *(["--glibc-default"] if a.glibc_default else [])]
        subprocess.run(cmd, env=env, cwd=tree, check=True, stdout=subprocess.DEVNULL)
        with open(out) as f:
            got = json.load(f)
    where = os.path.realpath(got.pop("titanext"))
    if not where.startswith(os.path.realpath(tree) + os.sep):
        raise RuntimeError(f"the run of {tree} imported titanext from {where}: something on the "
                           "path shadows PYTHONPATH, so both trees would be the same code")
    return {k: statistics.median(t for r in v for t in r) for k, v in got["times"].items()}


def against_rows(runs: dict[str, list[dict]], names: list[str]) -> list[dict]:
    """Rows of the --against table: ``runs`` maps each tree's label to its runs (schedule ->
    median step, s), the runs of both trees paired by turn; the first tree is this one."""
    here, there = list(runs)
    rows = []
    for name in names:
        for tree in (here, there):
            steps = [r[name] for r in runs[tree]]
            ratios = [r[name] / r["1F1B"] for r in runs[tree]]
            row = {"schedule": name, "tree": tree,
                   "step (s)": f"{statistics.median(steps):.3f}",
                   "tokens/s": f"{BATCH * SEQ / statistics.median(steps):,.0f}",
                   "vs 1F1B": f"{statistics.median(ratios):.3f}x",
                   "spread over runs": f"{min(ratios):.3f}-{max(ratios):.3f}x"}
            if tree == here:
                mine = [h[name] / t[name] for h, t in zip(runs[here], runs[there], strict=True)]
                row[f"step vs {there}"] = (f"{statistics.median(mine):.3f}x "
                                           f"({min(mine):.3f}-{max(mine):.3f})")
            else:
                row[f"step vs {there}"] = ""
            rows.append(row)
    return rows


def against(a, root: str, commit: str) -> list[dict]:
    """Both trees in turns (A B B A ...); the rows of :func:`against_rows`."""
    label = f"{a.against} ({commit[:7]})" if not commit.startswith(a.against) else commit[:7]
    runs: dict[str, list[dict]] = {"this tree": [], label: []}
    with tempfile.TemporaryDirectory() as tmp:
        other = os.path.join(tmp, "tree")
        _git(root, "worktree", "prune")  # the entry of a run killed before its clean-up
        done = _git(root, "worktree", "add", "--detach", other, commit)
        if done.returncode:
            raise RuntimeError(f"git worktree add {commit}: {done.stderr.strip()}")
        try:
            for i in range(a.rounds):
                order = [("this tree", root), (label, other)]
                for name, tree in order if i % 2 == 0 else order[::-1]:
                    load = os.getloadavg()[0]
                    t0 = time.time()
                    runs[name].append(_run_tree(tree, a))
                    print(f"round {i + 1}, {name}: {time.time() - t0:.0f} s, load average "
                          f"{load:.1f} -> {os.getloadavg()[0]:.1f}", flush=True)
        finally:
            _git(root, "worktree", "remove", "--force", other)
    return against_rows(runs, a.schedules.split(","))


def main(argv=None) -> int:
    from titanext._text import format_table  # (the --against runs of older trees lack it)

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--markdown", action="store_true")
    ap.add_argument("--rounds", type=int, default=None,
                    help="rounds of turns (6); with --against, runs of each tree (3)")
    ap.add_argument("--steps-per-turn", type=int, default=2)
    ap.add_argument("--warmup", type=int, default=3,
                    help="untimed steps of each schedule first (Auto switches after step 1)")
    ap.add_argument("--schedules", default=None,
                    help=f"comma-separated, 1F1B first ({','.join(SCHEDULES)}; with --against "
                         f"{','.join(AGAINST)})")
    ap.add_argument("--autograd-split", action="store_true")
    ap.add_argument("--profile", action="store_true",
                    help="profile one step per schedule and print its step table")
    ap.add_argument("--pin", action="store_true", help="pin rank r to core r (mod cores)")
    ap.add_argument("--glibc-default", action="store_true",
                    help="leave glibc's malloc trimming freed memory (KEEP_FREED_MEMORY unset)")
    ap.add_argument("--against", metavar="REV", default=None,
                    help="also run git revision REV (a temporary worktree), the trees in turns")
    ap.add_argument("--json", metavar="FILE", default=None,
                    help="write the timed steps as JSON instead of the table")
    a = ap.parse_args(argv)
    if a.rounds is None:
        a.rounds = 6 if a.against is None else 3
    if a.schedules is None:
        a.schedules = ",".join(SCHEDULES if a.against is None else AGAINST)
    bad = problems(a)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    commit = None if a.against is None else resolve_revision(root, a.against)
    if a.against is not None and commit is None:
        bad.append(f"--against {a.against}: not a revision of the repository at {root}; "
                   "allowed: a commit, branch or tag that git rev-parse resolves")
    if bad:
        print("\n".join(bad), file=sys.stderr)
        return 2
    schedules = a.schedules.split(",")
    if a.json:
        import titanext

        times, _ = measure(schedules, a.rounds, a.steps_per_turn, a.autograd_split, False,
                           a.warmup, a.pin, a.glibc_default)
        with open(a.json, "w") as f:
            json.dump({"titanext": titanext.__file__,
                       "times": {_label(v): t for v, t in times.items()}}, f)
        return 0
    print(f"debug model, pp=2 on gloo, {MICROBATCHES} micro-batches of {BATCH // MICROBATCHES} "
          f"x {SEQ} tokens, fp32, one thread per rank{', ranks pinned to cores' if a.pin else ''}"
          f"{', glibc malloc defaults' if a.glibc_default else ', freed memory kept'}"
          f"; {a.warmup} warm-up steps, then {a.steps_per_turn} steps per schedule in turns, "
          + (f"{a.rounds} runs of each tree in turns (A B B A ...)" if a.against
             else f"{a.rounds} rounds"), flush=True)
    load_before, t0 = os.getloadavg(), time.time()
    if a.against is not None:
        rows, info = against(a, root, commit), {"step_tables": {}}
    else:
        rows, info = trainer_table(schedules, a.rounds, a.steps_per_turn, a.autograd_split,
                                   a.profile, a.warmup, a.pin, a.glibc_default)
    print(format_table(rows, markdown=a.markdown))
    for label, table in info["step_tables"].items():
        print(f"\nstep table of {label} (one profiled step, ms):")
        print(format_table(table, markdown=a.markdown))
    lb, la = load_before, os.getloadavg()
    print(f"load average before {lb[0]:.1f} {lb[1]:.1f} {lb[2]:.1f}, after {la[0]:.1f} "
          f"{la[1]:.1f} {la[2]:.1f}; {os.cpu_count()} cores; the run took {time.time() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
