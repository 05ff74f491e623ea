"""A pipeline rank's compute alone: its schedule's action list run in one thread, no communication.

    python benchmarks/pipeline_replay.py [--markdown] [--schedules 1F1B,ZBH1,ZBV] [--rank 0]
        [--rounds 4] [--same-microbatch]

The shape of ``benchmarks/pipeline_trainer.py`` (debug model, pp = 2, 8 micro-batches of 2 x
512 tokens, fp32, one thread). For each schedule, the stage modules pp rank ``--rank`` holds
(``titanext.config.layout.pipeline_plan``, ``titanext.distributed.split_model``) run that
rank's action list (``titanext.schedules.schedule_order``) in order: F runs the stage's
forward (a later stage's input is a fresh tensor, as a receive buffer is), B its backward (the
last stage's from the loss, the others' from a fresh output gradient), I the backward with
the linears' weight GEMMs queued (``titanext.plugins.weight_grad``, as
``pipeline_parallel_split_backward = "deferred"``) and W that micro-batch's queue. What the
trainer adds (sends and receives, gloo's threads on the same cores, torch's schedule runtime)
is absent, so a chunk that costs more here than under 1F1B costs more because of the order
itself: what it keeps alive, and what ran just before it.

Rows: each kind's chunks (ms per step, medians over ``--rounds`` steps taken in turns with
the other schedules), the rank's compute and its ratio to 1F1B's. ``--same-microbatch`` adds
the split on one micro-batch with nothing in between: B against I then W, on every stage of
the rank (the split's own cost, free of any order).
Only lists of F, I, W and B (no overlapped pairs: DualPipe's are not replayed).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F

from titanext._text import format_table
from titanext.config.layout import pipeline_plan
from titanext.distributed.split import split_model
from titanext.models import build_model, get_model_args
from titanext.plugins.weight_grad import WeightGradQueue, defer_weight_grads, weight_grad_deferral
from titanext.schedules import schedule_order

BATCH, SEQ, MICROBATCHES, PP = 2, 512, 8, 2
KINDS = {"FORWARD": "F", "FULL_BACKWARD": "B", "BACKWARD_INPUT": "I", "BACKWARD_WEIGHT": "W"}


def rank_actions(schedule: str, rank: int, pp: int = PP, microbatches: int = MICROBATCHES
                 ) -> list[tuple[str, int, int]]:
    """``(kind, stage, micro-batch)`` of pp rank ``rank``'s compute list, kind one of F B I W;
    a ValueError names an action of another kind (an overlapped pair)."""
    out = []
    for a in schedule_order(schedule, pp=pp, microbatches=microbatches)[rank]:
        kind = KINDS.get(a.computation_type.name)
        if kind is None:
            raise ValueError(f"{schedule}: rank {rank} runs {a} ({a.computation_type.name}); "
                             f"replayed: {', '.join(KINDS)}")
        out.append((kind, a.stage_index, a.microbatch_index))
    return out


class _Rank:
    """One pp rank's stage modules of the debug model, and the state of a replay."""

    def __init__(self, schedule: str, rank: int):
        args = get_model_args("llama3", "debugmodel")
        self.plan = pipeline_plan(schedule, pp=PP, microbatches=MICROBATCHES,
                                  n_layers=args.n_layers)
        self.actions = rank_actions(schedule, rank)
        self.split = any(k in "IW" for k, _, _ in self.actions)
        self.last = self.plan.num_stages - 1
        torch.manual_seed(0)
        self.stages = {}
        for s in self.plan.stage_ids(rank):
            with torch.device("meta"):
                whole = build_model("llama3", args)
            stage = split_model(whole, self.plan.layers_per_stage, s, probe=False)
            stage.to_empty(device="cpu")
            stage.init_weights()
            if self.split:
                defer_weight_grads(stage)
            self.stages[s] = stage
        self.tokens = torch.randint(0, args.vocab_size, (BATCH, SEQ))
        self.labels = torch.randint(0, args.vocab_size, (BATCH, SEQ))
        self.dim = args.dim

    def _context(self, queue=None):
        return weight_grad_deferral(queue) if self.split else torch.enable_grad()

    def forward(self, s: int):
        x = (self.tokens if s == 0 else
             torch.randn(BATCH, SEQ, self.dim, requires_grad=True))  # a fresh receive buffer
        with self._context():
            out = self.stages[s](x)
            if s == self.last:
                out = F.cross_entropy(out.flatten(0, 1).float(), self.labels.flatten())
        return out

    def backward(self, out, s: int, queue=None) -> None:
        grad = None if s == self.last else torch.randn_like(out)
        with self._context(queue):
            torch.autograd.backward(out, grad)

    def step(self) -> dict[str, float]:
        """One replay of the action list: seconds per kind (the compute thread's wall)."""
        outs, queues, t = {}, {}, dict.fromkeys("FBIW", 0.0)
        for kind, s, mb in self.actions:
            t0 = time.perf_counter()
            if kind == "F":
                outs[s, mb] = self.forward(s)
            elif kind == "W":
                queues.pop((s, mb)).run()
            else:
                queues[s, mb] = queue = WeightGradQueue() if kind == "I" else None
                self.backward(outs.pop((s, mb)), s, queue)
            t[kind] += time.perf_counter() - t0
        for stage in self.stages.values():
            stage.zero_grad(set_to_none=True)
        return t

    def one_microbatch(self) -> tuple[float, float]:
        """Seconds of B, and of I then W, on one micro-batch through each of the rank's stages."""
        b = iw = 0.0
        for s, stage in self.stages.items():
            out = self.forward(s)
            split, self.split = self.split, False  # the same modules, plain autograd
            t0 = time.perf_counter()
            self.backward(out, s)
            b += time.perf_counter() - t0
            self.split = True
            out, queue = self.forward(s), WeightGradQueue()
            t0 = time.perf_counter()
            self.backward(out, s, queue)
            queue.run()
            iw += time.perf_counter() - t0
            self.split = split
            stage.zero_grad(set_to_none=True)
        return b, iw


def replay_rows(schedules: list[str], rank: int, rounds: int, same_microbatch: bool
                ) -> list[dict]:
    """One row per schedule (1F1B first): per-kind ms per step, compute, ratio to 1F1B."""
    ranks = {s: _Rank(s, rank) for s in schedules}
    for r in ranks.values():  # warm-up
        r.step()
    times = {s: [] for s in schedules}
    for _ in range(rounds):
        for s, r in ranks.items():
            times[s].append(r.step())
    rows, base = [], None
    for s in schedules:
        med = {k: statistics.median(t[k] for t in times[s]) for k in "FBIW"}
        total = statistics.median(sum(t.values()) for t in times[s])
        base = base or total
        row = {"schedule": s, **{k: f"{v * 1e3:,.1f}" if v else "" for k, v in med.items()},
               "compute (ms)": f"{total * 1e3:,.1f}", "vs 1F1B": f"{total / base:.3f}x"}
        if same_microbatch:
            pairs = [ranks[s].one_microbatch() for _ in range(rounds)]
            b, iw = (statistics.median(p[i] for p in pairs) for i in (0, 1))
            row["one micro-batch: B / I+W (ms)"] = f"{b * 1e3:.1f} / {iw * 1e3:.1f}"
        rows.append(row)
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--markdown", action="store_true")
    ap.add_argument("--schedules", default="1F1B,ZBH1,ZBV")
    ap.add_argument("--rank", type=int, default=0)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--same-microbatch", action="store_true")
    a = ap.parse_args(argv)
    names, bad = a.schedules.split(","), []
    if names[:1] != ["1F1B"]:
        bad.append(f"--schedules {a.schedules}: allowed: 1F1B first (the baseline), then others")
    if a.rank not in range(PP):
        bad.append(f"--rank {a.rank}: allowed: 0 to {PP - 1}")
    if a.rounds < 1:
        bad.append(f"--rounds {a.rounds}: allowed: a whole number >= 1")
    if bad:
        print("\n".join(bad), file=sys.stderr)
        return 2
    torch.set_num_threads(1)
    load, t0 = os.getloadavg(), time.time()
    try:
        rows = replay_rows(names, a.rank, a.rounds, a.same_microbatch)
    except ValueError as e:
        print(e, file=sys.stderr)
        return 2
    print(f"pp rank {a.rank}'s action list, one thread, no communication; ms per step, medians "
          f"of {a.rounds} steps in turns")
    print(format_table(rows, markdown=a.markdown))
    after = os.getloadavg()
    print(f"load average before {load[0]:.1f}, after {after[0]:.1f}; {time.time() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
