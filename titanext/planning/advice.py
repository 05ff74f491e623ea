"""Advice: the fastest layouts of a world size that fit in memory and pass validation.

Following the Ultra-Scale Playbook's procedure: keep what fits in memory, reach the target
batch, then rank by estimated throughput (TP inside a node is cheap, across nodes expensive).
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import itertools
from collections.abc import Mapping, Sequence

from titanext.config import ConfigError, load_config
from titanext.planning.estimate import Plan, plan_config, tokens_per_s_ceiling
from titanext.planning.hardware import COMM_SMS, DEVICES, Device
from titanext.planning.layout import resolve_layout
from titanext.planning.memory import static_memory_floor
from titanext.planning.shapes import model_shape

__all__ = ["FIXABLE", "advise", "toml_snippet"]

#: the degrees the advice's search can be held to (``advise(fixed=...)``, ``titanext-plan --fix``)
FIXABLE = ("tp", "pp", "cp", "ep")


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


_MICROBATCH_SIZES = (1, 2, 4, 8)


def _local_batch_sizes(pp: int, microbatches: int) -> tuple[int, ...]:
    """The local batch sizes to try: micro-batches of 1, 2, 4 or 8 sequences. Without PP the
    local batch is one micro-batch (gradient accumulation reaches the global batch); with PP
    it is the config's micro-batch count (-1: 2 x pp) times the micro-batch size, since a
    pipeline needs its micro-batches to fill the stages (DualPipe: at least 2 x pp)."""
    if pp == 1:
        return _MICROBATCH_SIZES
    return tuple((microbatches if microbatches > 0 else 2 * pp) * b for b in _MICROBATCH_SIZES)


def _candidate_specs(base, world_size: int, global_batch: int, too_big: dict[tuple, int], *,
                     device: Device, gpus_per_node: int, efficiency: float,
                     fixed: Mapping[str, int]) -> list[tuple]:
    """Every layout the advice searches (with the degrees in ``fixed``), with its tokens/s
    ceiling: (ceiling, index, config, (tp, pp, cp, ep, local), recompute level); those whose
    memory floor does not fit mark ``too_big`` instead."""
    moe = model_shape(base).moe
    microbatches = base.parallelism.pipeline_parallel_microbatches
    hbm = 0.9 * device.hbm_bytes
    specs = []
    for tp in _divisors(world_size):
        if tp > 2 * gpus_per_node or fixed.get("tp", tp) != tp:
            continue
        for pp in (p for p in _divisors(world_size // tp) if fixed.get("pp", p) == p):
            for cp in (c for c in (1, 2, 4, 8) if (world_size // (tp * pp)) % c == 0
                       and fixed.get("cp", c) == c):
                dp = world_size // (tp * pp * cp)
                # expert parallelism borrows dp_shard x cp ranks (MoE models only)
                eps = [e for e in _divisors(dp * cp) if moe and moe.num_experts % e == 0] or [1]
                for ep, local, (level, ac) in itertools.product(
                        eps, _local_batch_sizes(pp, microbatches), enumerate(_RECOMPUTE)):
                    key = (tp, pp, cp, ep, local)
                    if (global_batch % (local * dp) or fixed.get("ep", ep) != ep
                            or too_big.get(key, len(_RECOMPUTE)) <= level):
                        continue
                    cfg = _candidate_config(base, key, dp, ac, global_batch)
                    try:
                        lo = resolve_layout(cfg, world_size, gpus_per_node=gpus_per_node,
                                            float8_hardware=device.fp8_flops > 0)
                        if static_memory_floor(lo) > hbm:
                            too_big[key] = level
                            continue
                        ceiling = tokens_per_s_ceiling(lo, device, efficiency)
                    except ValueError:  # e.g. fewer layers than stages: validation rejects it
                        continue
                    specs.append((ceiling, len(specs), cfg, key, level))
    return specs


def _candidate_config(base, key: tuple, dp: int, ac: tuple[str, int], global_batch: int):
    """``base`` with a candidate's degrees, micro-batch size and recompute level (mode, full
    blocks per stage)."""
    tp, pp, cp, ep, local = key
    return dataclasses.replace(
        base,
        parallelism=dataclasses.replace(
            base.parallelism, tensor_parallel_degree=tp,
            pipeline_parallel_degree=pp, context_parallel_degree=cp,
            expert_parallel_degree=ep, data_parallel_replicate_degree=1,
            data_parallel_shard_degree=dp),
        activation_checkpoint=dataclasses.replace(base.activation_checkpoint, mode=ac[0],
                                                  **_recompute_lists(base, *ac)),
        training=dataclasses.replace(base.training, local_batch_size=local,
                                     global_batch_size=global_batch))


def _recompute_lists(base, ac: str, full_blocks: int = 0) -> dict[str, list[str] | int]:
    """The config's ``recompute_modules`` and ``float8_storage`` where recompute mode ``ac``
    takes them (modules; float8 storage also without recompute), else empty; ``full_blocks``
    (modules only)."""
    ckpt = base.activation_checkpoint
    return {"recompute_modules": list(ckpt.recompute_modules) if ac == "modules" else [],
            "float8_storage": list(ckpt.float8_storage) if ac in ("modules", "none") else [],
            "full_blocks": full_blocks if ac == "modules" else 0}


@contextlib.contextmanager
def _collector_paused():
    """The cyclic garbage collector off, as it was after: the search makes millions of
    short-lived objects and no cycles of its own (reference counting frees them), and each
    full collection would walk every object the process holds (torch's too) again."""
    paused = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if paused:
            gc.enable()


@_collector_paused()
def advise(path: str | None, overrides: Sequence[str], world_size: int, *,
           device: Device = DEVICES["h100"], gpus_per_node: int = 8, top: int = 5,
           efficiency: float = 0.6, comm_sms: int = COMM_SMS,
           fixed: Mapping[str, int] | None = None) -> list[Plan]:
    """The ``top`` feasible layouts ranked by estimated tokens/s (best first).

    Each candidate gets a cheap ceiling first (:func:`~titanext.planning.estimate.
    tokens_per_s_ceiling`); they are planned in the order of their ceilings until the ``top``-th
    valid layout is ahead of every ceiling left (the same answer as planning them all), and
    validated in rank order through :func:`titanext.config.load_config` with ``world_size``,
    so a layout that fails validation is never proposed; those that do not fit in 90% of HBM
    are dropped. The global batch of the config is kept; the micro-batch size (1, 2, 4 or 8
    sequences; under PP, times the config's micro-batch count) and recompute level (the mode;
    under "modules" also 0, 1 or 2 ``full_blocks`` a stage) are searched. The schedule and
    the other pipeline keys stay the config's. ``top`` < 1: none.

    ``fixed`` holds degrees of :data:`FIXABLE` to their values (``{"pp": 16}``: only layouts
    with 16 pipeline stages): the same ranking among fewer layouts, so a faster search when
    some degrees are settled (a cluster's pipeline, a model's experts per rank). Another key
    raises :class:`ValueError`.
    """
    fixed = dict(fixed or {})
    unknown = sorted(set(fixed) - set(FIXABLE))
    if unknown:
        raise ValueError(f"advise(fixed=...): {', '.join(unknown)} cannot be fixed "
                         f"(only {', '.join(FIXABLE)})")
    if top < 1:
        return []
    base = load_config(path, overrides, world_size=world_size)
    global_batch = base.training.global_batch_size
    if global_batch <= 0:
        global_batch = base.training.local_batch_size * world_size
    # Every candidate with its ceiling (tokens/s without bubble or exposed communication: cheap),
    # then planned in the order of their ceilings until no unplanned one can reach the top.
    # per (tp, pp, cp, ep, local): the least recompute level that does not fit, by its memory
    # floor (static_memory_floor) or, once planned, by its plan; less recomputation keeps more
    too_big: dict[tuple, int] = {}
    specs = _candidate_specs(base, world_size, global_batch, too_big, device=device,
                             gpus_per_node=gpus_per_node, efficiency=efficiency,
                             fixed=fixed)
    specs.sort(key=lambda sp: (-sp[0], sp[1]))
    candidates: list[Plan] = []
    valid: dict[int, list[str] | None] = {}  # id(plan) -> its overrides, None: invalid

    def overrides_of(plan: Plan) -> list[str] | None:
        if id(plan) not in valid:
            valid[id(plan)] = _validated(plan, path, overrides, world_size, global_batch,
                                         base)
        return valid[id(plan)]

    rounded: list[float] = []  # each candidate's tokens/s to 10, as ranked
    order: list = [0, []]  # the ranking of the first n candidates (n, the ranked list)

    def ranked() -> list[Plan]:
        # Ties (the roofline cannot tell them apart) go to the simpler layout, then to less
        # memory. Sorted again only when a candidate came.
        if order[0] != len(candidates):
            order[:] = len(candidates), sorted(
                candidates, key=lambda pl: (-round(pl.time["tokens_per_s"], -1),
                                            pl.layout["tp"] * pl.layout["cp"] * pl.layout["pp"],
                                            pl.memory_total))
        return order[1]

    def best(limit: int) -> list[Plan]:
        out = []
        for plan in ranked():
            if overrides_of(plan) is not None:
                out.append(plan)
                if len(out) == limit:
                    break
        return out

    for ceiling, _, cfg, key, level in specs:
        # done once the top-th valid layout is ahead of anything an unplanned one can reach
        ahead = [x for x in rounded if x > ceiling + 10]
        if len(ahead) >= top:  # enough ahead, if enough of them validate
            chosen = best(top)
            if len(chosen) == top and round(chosen[-1].time["tokens_per_s"], -1) > ceiling + 10:
                break
        if too_big.get(key, len(_RECOMPUTE)) <= level:
            continue  # less recomputation than a layout that did not fit keeps more
        try:
            plan = plan_config(cfg, world_size, device=device, gpus_per_node=gpus_per_node,
                               efficiency=efficiency, ep_overlap=False, comm_sms=comm_sms)
        except ValueError:  # e.g. an ep the two-level dispatch cannot split into nodes
            continue
        if plan.fits:
            candidates.append(plan)
            rounded.append(round(plan.time["tokens_per_s"], -1))
        else:
            too_big[key] = min(too_big.get(key, level), level)
    chosen = best(top)
    for plan in chosen:
        plan.layout["overrides"] = valid[id(plan)]
    return chosen


#: recompute levels (mode, ``full_blocks`` per stage), most recomputation (least memory) first;
#: "modules" is the config's ``recompute_modules`` (unset: DeepSeek-V3's norms, MLA
#: up-projections and SwiGLU of those the model has), which saves more than selective's matmul
#: outputs, also with the first one or two blocks of each stage fully checkpointed
_RECOMPUTE = (("full", 0), ("selective", 0), ("modules", 2), ("modules", 1), ("modules", 0),
              ("none", 0))


def _validated(plan: Plan, path: str | None, overrides: Sequence[str], world_size: int,
               global_batch: int, base) -> list[str] | None:
    """The command-line overrides of ``plan``'s layout, if the config validates with them."""
    lo = plan.layout
    cand = [f"--parallelism.tensor_parallel_degree={lo['tp']}",
            f"--parallelism.pipeline_parallel_degree={lo['pp']}",
            f"--parallelism.context_parallel_degree={lo['cp']}",
            f"--parallelism.expert_parallel_degree={lo['ep']}",
            "--parallelism.data_parallel_replicate_degree=1",
            f"--parallelism.data_parallel_shard_degree={lo['dp_shard']}",
            f"--activation_checkpoint.mode={lo['ac']}",
            *(f"--activation_checkpoint.{k}={_cli(v)}"  # only where the config's differ
              for k, v in _recompute_lists(base, lo["ac"], lo["full_blocks"]).items()
              if v != getattr(base.activation_checkpoint, k)),
            f"--training.local_batch_size={lo['local_batch_size']}",
            f"--training.global_batch_size={global_batch}"]
    try:
        load_config(path, [*overrides, *cand], world_size=world_size)
    except ConfigError:
        return None
    return cand


def _cli(value: list | int) -> str:
    return ",".join(map(str, value)) if isinstance(value, list) else str(value)


def toml_snippet(plan: Plan) -> str:
    lo = plan.layout
    return "\n".join([
        "[parallelism]",
        f"data_parallel_shard_degree = {lo['dp_shard']}",
        f"tensor_parallel_degree = {lo['tp']}",
        f"context_parallel_degree = {lo['cp']}",
        f"pipeline_parallel_degree = {lo['pp']}",
        *([f"expert_parallel_degree = {lo['ep']}"] if lo["ep"] > 1 else []),
        "", "[training]", f"local_batch_size = {lo['local_batch_size']}",
        "", "[activation_checkpoint]", f'mode = "{lo["ac"]}"',
        *([f"full_blocks = {lo['full_blocks']}"] if lo["full_blocks"] else [])])
