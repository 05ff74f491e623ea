"""A pipeline rank's memory peak, replayed over its simulated actions in execution order.

The terms per stage come from :func:`titanext.planning.memory._stage_terms` (see
:func:`titanext.planning.memory._pipeline_peak` for what each holds); this module walks the
rank's events and keeps the moment with the most memory. The advice replays thousands of
ranks, so each term is summed again only when what it reads changes.
"""

from __future__ import annotations

import bisect
import math

__all__ = ["PEAK_TERMS", "replay_peak"]

#: the terms of a moment, in the order :func:`replay_peak` sums them
PEAK_TERMS = ("grads (fp32)", "unsharded grads (pp)", "activations", "pipeline buffers",
              "backward transients", "loss backward")


def replay_peak(lo, rk, rank_events, per_stage: tuple[dict, ...], posts: list, frees: list, *,
                sharded: bool, boundary: float) -> dict[str, float]:
    """Replay pp rank ``rk``'s events of layout ``lo`` in execution order, keeping the moment
    with the most memory (:data:`PEAK_TERMS`); ``posts`` and ``frees``: the sorted times its
    receive buffers (``boundary`` bytes each) are posted and freed."""
    act, wact, acc, grad, transient = per_stage
    m = lo.pipe.microbatches
    stages = rk.stages
    live, pending, done = (dict.fromkeys(stages, 0) for _ in range(3))  # pending: I done, W not
    acc_on = dict.fromkeys(stages, False)
    reduced = dict.fromkeys(stages, lo.accum > 1)  # earlier rounds' sharded gradients
    events = [e for e in rank_events if e.stage in live]

    def gradients() -> tuple[float, float]:  # at a backward's start and a reduce
        return (sum([grad[s] for s in stages  # without FSDP: param.grad
                     if reduced[s] or (acc_on[s] and not sharded)]),
                sum([acc[s] for s in stages if acc_on[s]]))

    # each stage's share of the held activations, updated for the stage an event changes
    held_by_stage = {s: live[s] * act[s] + pending[s] * wact[s] for s in stages}

    def held(s: int) -> float:
        held_by_stage[s] = live[s] * act[s] + pending[s] * wact[s]
        return sum(held_by_stage.values())

    (g_dense, g_acc), held_now = gradients(), sum(held_by_stage.values())
    best = (g_dense, g_acc, held_now, _buffers(posts, frees, 0.0, boundary), 0.0, 0.0)
    best_total = sum(best)
    # the receive buffers at each event's end: two cursors while the events end in order (a
    # rank's do), bisection where one ends before the one before
    n_posts, n_frees, i_post, i_free, then = len(posts), len(frees), 0, 0, -math.inf
    for e in events:
        s, kind, now = e.stage, e.kind, e.end  # each moment as (terms, their sum)
        if now >= then:
            while i_post < n_posts and posts[i_post] <= now:
                i_post += 1
            while i_free < n_frees and frees[i_free] <= now:
                i_free += 1
        else:
            i_post, i_free = bisect.bisect_right(posts, now), bisect.bisect_right(frees, now)
        then = now
        buffers_now = boundary * (i_post - i_free)
        if kind == "F":
            live[s] += 1
            held_now = held(s)
            terms = (g_dense, g_acc, held_now, buffers_now, 0.0, 0.0)
            total = sum(terms)
            if total > best_total:
                best, best_total = terms, total
            continue
        if kind != "W":  # I or B: the loss backward runs first, freed before the blocks'
            if not acc_on[s]:
                acc_on[s] = True
                g_dense, g_acc = gradients()
            terms = (g_dense, g_acc, held_now, buffers_now, 0.0, transient[s][1])
            total = sum(terms)
            if total > best_total:
                best, best_total = terms, total
        if kind == "I":  # then its weight-gradient inputs build up
            live[s] -= 1
            pending[s] += 1
            held_now = held(s)
            terms = (g_dense, g_acc, held_now, buffers_now, 0.0, 0.0)
        else:  # B: one block's recompute on top; W: its inputs freed after
            terms = (g_dense, g_acc, held_now, buffers_now,
                     transient[s][0] if kind == "B" else 0.0, 0.0)
        total = sum(terms)
        if total > best_total:
            best, best_total = terms, total
        if kind == "I":
            continue
        if kind == "B":
            live[s] -= 1
        else:
            pending[s] -= 1
        held_now = held(s)
        done[s] += 1
        if done[s] == m:  # the reduce-scatter: sharded gradients next to the accumulators
            reduced[s] = True
            g_dense, g_acc = gradients()
            terms = (g_dense, g_acc, held_now, buffers_now, 0.0, 0.0)
            total = sum(terms)
            if total > best_total:
                best, best_total = terms, total
            acc_on[s] = False
            g_dense, g_acc = gradients()
    return dict(zip(PEAK_TERMS, best))


def _buffers(posts: list, frees: list, now: float, boundary: float) -> float:
    """Bytes of the receive buffers with posted <= ``now`` < freed (posted < freed)."""
    return boundary * (bisect.bisect_right(posts, now) - bisect.bisect_right(frees, now))
