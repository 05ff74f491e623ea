"""One config on one cluster: memory, communication, bubble and step time (:func:`plan_config`).

The estimate is assembled from named pieces, each in its own module:

1. the layout (:func:`~titanext.planning.layout.resolve_layout`): degrees, dtypes, micro-batches
   and gradient accumulation (the config's rule), the pipeline split;
2. compute of one micro-batch through each pipeline stage (:func:`stage_times`, a roofline from
   :mod:`~titanext.planning.roofline`: the blocks, the first stage's embedding, the last
   stage's head, loss and MTP modules) and each pp rank's sum (:func:`microbatch_times`);
3. model-parallel communication on the busiest rank's critical path
   (:func:`~titanext.planning.comm.model_parallel_comm`);
4. the pipeline bubble and the micro-batches in flight (:func:`pipeline_pass`, replaying the
   schedule in the simulator with each stage's own costs, :func:`stage_costs`);
5. memory of each pp rank: parameters, gradients, optimizer state, gathered units and
   activations (:func:`~titanext.planning.memory.memory_per_pp_rank`);
6. data-parallel communication (:func:`~titanext.planning.comm.data_parallel_comm`) and the
   step time with what it leaves exposed (:func:`step_time`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from titanext.config import JobConfig
from titanext.planning.comm import comm_time, data_parallel_comm, model_parallel_comm
from titanext.planning.hardware import COMM_SMS, DEVICES, Device
from titanext.planning.layout import Layout, resolve_layout
from titanext.planning.memory import memory_per_pp_rank, rank_params, state_elements
from titanext.planning.muon import ns_seconds
from titanext.planning.recompute import recompute_flops_bytes
from titanext.planning.roofline import (
    MEMORY_EFFICIENCY,
    MicrobatchTime,
    matmul_seconds,
    microbatch_time,
    optimizer_time,
)
from titanext.planning.stages import RankStages, simulate_times
from titanext.plugins.expert_parallel.rules import REPLICATION_SLACK

__all__ = ["Plan", "StageCosts", "busy_compute", "charge_comm_sms", "ep_overlap_times",
           "microbatch_times", "mtp_time", "pipeline_pass", "plan_config", "stage_costs",
           "stage_times", "step_time"]


@dataclass
class Plan:
    """Everything estimated for one config on one cluster."""

    layout: dict
    memory: dict  # category -> bytes on the busiest rank
    comm: list[dict]  # per parallelism: bytes per rank per step, collectives, network level
    time: dict
    fits: bool
    memory_per_pp_rank: list[dict] = dataclasses.field(default_factory=list)

    @property
    def memory_total(self) -> float:
        return sum(self.memory.values())


@dataclass(frozen=True)
class StageCosts:
    """Seconds of one micro-batch through each pipeline stage, by stage index: F and I
    without the expert-parallel all-to-all, W, and the all-to-all of F and of I."""

    f: tuple[float, ...]
    i: tuple[float, ...]
    w: tuple[float, ...]
    a2a_f: tuple[float, ...]
    a2a_i: tuple[float, ...]


def _blocks_time(lo: Layout, device: Device, efficiency: float, *, dense: int, moe_blocks: int,
                 imbalance: float, embedding: bool = False, head: bool = False,
                 full: tuple[int, int] = (0, 0)) -> MicrobatchTime:
    """Roofline of one micro-batch through ``dense`` + ``moe_blocks`` blocks (and the
    embedding / the final norm, head and loss); ``full``: how many of the dense and of the MoE
    ones ``[activation_checkpoint] full_blocks`` fully checkpoints under ``mode = "modules"``."""
    if lo.ac == "modules" and any(full):
        return (_blocks_time(lo, device, efficiency, dense=dense - full[0],
                             moe_blocks=moe_blocks - full[1], imbalance=imbalance,
                             embedding=embedding, head=head)
                + _blocks_time(lo.with_full_ac(), device, efficiency, dense=full[0],
                               moe_blocks=full[1], imbalance=imbalance))
    shape, moe = lo.shape, lo.shape.moe
    common = dict(tokens=lo.tokens, seq_len=lo.cfg.training.seq_len, dim=shape.dim,
                  kv_dim=shape.kv_dim, vocab=shape.vocab, tp=lo.tp, sp=lo.sp, a=lo.a, ac=lo.ac,
                  efficiency=efficiency, autocast=lo.autocast,
                  float8_recipe=lo.cfg.float8.recipe)
    mt = microbatch_time(device, ffn=shape.ffn, linears=lo.linears, layers=dense,
                         embedding=embedding, head=head, head_float8=lo.head_float8, **common)
    if moe_blocks:
        # (at 1: the same rows, top_k x tokens, whether top_k is an int or a float)
        linears = [dataclasses.replace(lin, token_factor=lin.token_factor * imbalance)
                   if lin.name.startswith("moe.experts.") else lin
                   for lin in lo.moe_linears] if imbalance != 1.0 else lo.moe_linears
        routed = moe.top_k * moe.hidden * imbalance
        mt = mt + microbatch_time(device, ffn=0, linears=linears, layers=moe_blocks,
                                  ffn_replicated=routed + moe.shared_hidden, **common)
    if lo.ac == "modules":  # the named regions rerun just before each block's backward
        rerun = (dense * _recompute_seconds(lo, device, efficiency, False, imbalance)
                 + moe_blocks * _recompute_seconds(lo, device, efficiency, True, imbalance))
        mt = MicrobatchTime(mt.f, mt.i + rerun, mt.w, mt.attention_f)
    return mt


def _recompute_seconds(lo: Layout, device: Device, efficiency: float, moe_block: bool,
                       imbalance: float) -> float:
    """Seconds to rerun ``recompute_modules`` of one block for one micro-batch
    (:func:`titanext.planning.recompute.recompute_flops_bytes`; matmuls at the bf16 rate)."""
    shape, moe = lo.shape, lo.shape.moe
    routed = moe_block and moe is not None
    mm, attn, moved = recompute_flops_bytes(
        lo.recipe.recompute_modules, h=shape.dim, a=lo.a, mla=shape.mla,
        heads=shape.n_heads / lo.tp, ffn=0.0 if routed else shape.ffn / lo.tp,
        moe=(moe.top_k * imbalance, moe.hidden, moe.shared_hidden) if routed else None,
        seq_len=lo.cfg.training.seq_len)
    rate = device.bf16_flops * efficiency
    return lo.tokens * ((mm + attn) / rate + moved / (device.hbm_bw * MEMORY_EFFICIENCY))


def mtp_time(lo: Layout, device: Device, efficiency: float, *,
             imbalance: float = 1.0) -> MicrobatchTime:
    """One micro-batch through the MTP modules (on the last stage, after the head): each runs
    ``enorm`` and ``hnorm`` on the shifted tokens' embedding and the hidden state,
    ``eh_proj`` (2 h -> h, replicated over tp), its block (a MoE block in DeepSeek-V3) and
    the final norm, the shared head and the loss again (checked against FlopCounterMode on
    the module, tests/unit/test_plan_stages.py)."""
    shape = lo.shape
    out = MicrobatchTime(0.0, 0.0, 0.0, 0.0)
    if not shape.mtp_layers:
        return out
    moe = bool(shape.mtp_moe and shape.moe)
    bw = device.hbm_bw * MEMORY_EFFICIENCY
    mm = matmul_seconds(lo.tokens, 2 * shape.dim, shape.dim, rate=device.bf16_flops * efficiency,
                        bw=bw, weight_bytes=lo.a, io_bytes=lo.a)
    norms = 6 * lo.a * shape.dim * lo.tokens / bw  # two norms and the concat: read, write
    own = MicrobatchTime(mm + norms, mm + 2 * norms + (mm + norms if lo.ac == "full" else 0.0),
                         mm, 0.0)
    one = own + _blocks_time(lo, device, efficiency, dense=int(not moe), moe_blocks=int(moe),
                             imbalance=imbalance, embedding=True, head=True)
    for _ in range(shape.mtp_layers):
        out = out + one
    return out


def stage_times(lo: Layout, device: Device, efficiency: float, *,
                imbalance: float = 1.0) -> list[MicrobatchTime]:
    """Compute time (F, I, W) of one micro-batch through each pipeline stage, by stage index,
    no comm: its blocks, the first stage's embedding, the last stage's final norm, head and
    loss and the MTP modules (:func:`mtp_time`). ``imbalance`` (max / mean routed rows per ep
    rank) scales the routed experts' work: the busiest ep rank sets the pace."""
    moe = lo.shape.moe
    ids = {s: set(layer_ids) for rk in lo.pipe.ranks
           for s, layer_ids in zip(rk.stages, rk.stage_layer_ids)}
    last = max(ids)
    out = []
    seen: dict[tuple, MicrobatchTime] = {}  # stages alike (most of a deep pipeline's): once
    for s in range(last + 1):
        n_moe = len(moe.layer_ids & ids[s]) if moe else 0
        whole = lo.full_ac_ids(ids[s])
        full_moe = len(moe.layer_ids & whole) if moe else 0
        key = (len(ids[s]) - n_moe, n_moe, s == 0, s == last, (len(whole) - full_moe, full_moe))
        if key not in seen:
            seen[key] = _blocks_time(lo, device, efficiency, dense=key[0], moe_blocks=n_moe,
                                     imbalance=imbalance, embedding=key[2], head=key[3],
                                     full=key[4])
        mt = seen[key]
        out.append(mt + mtp_time(lo, device, efficiency, imbalance=imbalance) if s == last else mt)
    return out


def microbatch_times(lo: Layout, device: Device, efficiency: float, *,
                     imbalance: float = 1.0) -> list[MicrobatchTime]:
    """Compute time (F, I, W) of one micro-batch through each of a pp rank's stages (summed
    over the rank's stages: DualPipe's two mirrored ones each see half the micro-batches), no
    comm (:func:`stage_times`)."""
    return _rank_sums(lo, stage_times(lo, device, efficiency, imbalance=imbalance))


def _rank_sums(lo: Layout, per_stage: list[MicrobatchTime]) -> list[MicrobatchTime]:
    """Each pp rank's sum of ``per_stage`` over its stages (:func:`microbatch_times`)."""
    out = []
    for rank in lo.pipe.ranks:
        mt = MicrobatchTime(0.0, 0.0, 0.0, 0.0)
        for s in rank.stages:
            mt = mt + per_stage[s]
        out.append(mt)
    return out


def stage_costs(lo: Layout, per_stage: list[MicrobatchTime], rank: RankStages,
                raw: MicrobatchTime, with_comm: MicrobatchTime, a2a: tuple[float, float]
                ) -> StageCosts:
    """Each stage's seconds with its communication: the busiest ``rank``'s per-block
    model-parallel comm (``with_comm`` - ``raw`` - ``a2a``: TP, CP, expert copies) and its
    all-to-all per MoE block (``a2a``), applied to every stage's blocks (the MTP block too)."""
    shape, moe = lo.shape, lo.shape.moe
    blocks = max(1, rank.layers)
    n_moe_rank = lo.n_moe(rank)
    per_block_f = (with_comm.f - raw.f - a2a[0]) / blocks
    per_block_i = (with_comm.i - raw.i - a2a[1]) / blocks
    last = len(per_stage) - 1
    ids = {s: set(layer_ids) for rk in lo.pipe.ranks
           for s, layer_ids in zip(rk.stages, rk.stage_layer_ids)}
    f, i, af, ai = [], [], [], []
    for s, mt in enumerate(per_stage):
        n = len(ids[s]) + (shape.mtp_layers if s == last else 0)
        n_moe = (len(moe.layer_ids & ids[s]) + (shape.mtp_layers * shape.mtp_moe
                                                if s == last else 0)) if moe else 0
        share = n_moe / n_moe_rank if n_moe_rank else 0.0
        af.append(a2a[0] * share)
        ai.append(a2a[1] * share)
        f.append(mt.f + n * per_block_f)
        i.append(mt.i + n * per_block_i)
    return StageCosts(tuple(f), tuple(i), tuple(mt.w for mt in per_stage), tuple(af), tuple(ai))


def pipeline_pass(lo: Layout, costs: StageCosts, p2p: float, *, overlap: bool = False,
                  a2a: bool = True) -> tuple[float, float, list[int], list | None, float]:
    """(time of one pass: a pipeline flush or one micro-batch, bubble ratio, micro-batches in
    flight on each pp rank at its peak, the simulated actions (None without pp; their times in
    the simulation's units, :func:`~titanext.planning.stages.simulate_times`),
    the all-to-all seconds the busiest rank waits per pass). Each stage costs its own
    ``costs``; with ``overlap`` the schedule's paired chunks hide the all-to-all behind each
    other (``a2a=False``: none)."""
    pass_time, bubble, peak, sim, exposed = _pipeline_pass(lo, costs, p2p, overlap=overlap,
                                                           a2a=a2a)
    return pass_time, bubble, peak, sim.events if sim is not None else None, exposed


def _pipeline_pass(lo: Layout, costs: StageCosts, p2p: float, *, overlap: bool, a2a: bool
                   ) -> tuple[float, float, list[int], object, float]:
    """:func:`pipeline_pass` with the whole simulation (None without pp) in place of its
    events."""
    zero = tuple(0.0 for _ in costs.f)
    af, ai = (costs.a2a_f, costs.a2a_i) if a2a else (zero, zero)
    if lo.pp == 1:
        return (costs.f[0] + costs.i[0] + costs.w[0] + af[0] + ai[0], 0.0, [1], None,
                af[0] + ai[0])
    pass_time, sim, unit = simulate_times(lo.pipe, f=costs.f, i=costs.i, w=costs.w, comm=p2p,
                                          a2a=af, a2a_i=ai, overlap=overlap)
    exposed = max(sim.a2a_exposed)
    # the bubble is the idle time of the rank with the most work (stages differ: the others
    # wait more); an exposed all-to-all is communication, not bubble
    busy = [a + unit * t for a, t in zip(sim.a2a_exposed, sim.busy, strict=True)]
    bubble = max(0.0, 1.0 - max(busy) / pass_time)
    return pass_time, bubble, sim.peak_activations, sim, exposed


def busy_compute(lo: Layout, per_stage: list[MicrobatchTime], events: list | None) -> float:
    """Compute seconds per pass of the busiest pp rank: every F, I, W (B = I + W) it runs, at
    its stage's cost (DualPipe: each of a rank's two stages sees half the micro-batches)."""
    if events is None:
        return lo.pp_microbatches * per_stage[0].total
    busy = [0.0] * lo.pp
    cost = {(s, kind): c for s, mt in enumerate(per_stage)  # each stage's, worked out once
            for kind, c in (("F", mt.f), ("I", mt.i), ("W", mt.w), ("B", mt.i + mt.w))}
    for e in events:
        busy[e.rank] += cost[e.stage, e.kind]
    return max(busy)


#: how far the schedule simulation's rounding (each cost to 1% of the largest forward,
#: :func:`titanext.planning.stages.simulate_times`) can shorten a pass below its exact work
CEILING_SLACK = 0.03


def tokens_per_s_ceiling(lo: Layout, device: Device, efficiency: float) -> float:
    """An upper bound of :func:`plan_config`'s tokens/s for layout ``lo``, without simulating
    its schedule: the busiest pp rank's compute back to back (no bubble, no communication;
    DualPipe's two stages per rank each see half the micro-batches) and the optimizer step."""
    # plan_config's default routing: balanced (imbalance 1, which replication's slack keeps)
    per_stage = stage_times(lo, device, efficiency, imbalance=1.0)
    mirrored = lo.job is not None and lo.job.pipeline.mirrored
    m = lo.pp_microbatches / 2 if mirrored else lo.pp_microbatches
    busy = max(sum(m * per_stage[s].total for s in rk.stages) for rk in lo.pipe.ranks)
    elements = min(state_elements(lo, *rank_params(lo, rk.layer_ids, rk.embedding, rk.head)[:2],
                                  lo.zero_n) for rk in lo.pipe.ranks)  # the lightest rank's
    return _tokens_per_step(lo) / (lo.accum * busy * (1 - CEILING_SLACK)
                                   + _optimizer_seconds(lo, device, elements))


def _tokens_per_step(lo: Layout) -> float:
    t = lo.cfg.training
    return lo.accum * t.local_batch_size * lo.dp * t.seq_len


def _optimizer_seconds(lo: Layout, device: Device, elements: float) -> float:
    """The optimizer step over ``elements`` fp32 values as ``lo``'s config runs it."""
    o = lo.cfg.optimizer
    # Muon's elementwise part (momentum, weight decay, the update) is counted as AdamW's, which
    # runs its other groups; its Newton-Schulz and exchange are terms of their own (step_time)
    name = "AdamW" if o.name == "Muon" else o.name
    return optimizer_time(device, elements, implementation=o.implementation, name=name,
                          state_dtype=o.state_dtype,
                          weight_decay=o.weight_decay > 0, clip=lo.cfg.training.max_norm > 0)


def ep_overlap_times(lo: Layout, costs: dict[bool, StageCosts], p2p: float, per_step: float,
                     step: float, pass_time: float, imbalance: float) -> dict:
    """The expert-parallel all-to-all of a step: its total (``per_step`` seconds on the
    busiest rank), what the busiest rank waits for with ``expert_parallel_comm_overlap`` off
    and on (on: None where the schedule has no paired chunks) and the step time of each, at
    this routing ``imbalance`` (max / mean rows per ep rank; replicating hot experts brings it
    towards 1). ``costs``: the stages' costs with the overlap off and on (on: with the SMs
    charged to communication, :func:`charge_comm_sms`)."""
    out = {"imbalance": imbalance, "per_step_s": per_step}
    mine = lo.recipe.ep_comm_overlap
    for on in (False, True):
        if on and not _can_overlap(lo):
            out["exposed_on_s"] = out["step_on_s"] = None
            continue
        p, *_, exposed = pipeline_pass(lo, costs[on], p2p, overlap=on)
        key = "on" if on else "off"
        out[f"exposed_{key}_s"] = lo.accum * exposed
        out[f"step_{key}_s"] = step + lo.accum * (p - pass_time) if on != mine else step
    return out


def _can_overlap(lo: Layout) -> bool:
    """The schedule pairs chunks, so an expert-parallel all-to-all can hide behind compute."""
    # the planner loads without torch and the training runtime until it needs them
    from titanext.schedules.overlap import OVERLAP_SCHEDULES

    return lo.pp > 1 and lo.pipe.name in OVERLAP_SCHEDULES


def charge_comm_sms(lo: Layout, per_stage: list[MicrobatchTime], device: Device,
                    comm_sms: int, *, overlap: bool) -> list[MicrobatchTime]:
    """``per_stage`` with ``comm_sms`` of the device's SMs charged to communication where it
    overlaps compute (``titanext-plan --comm-sms``): with ``overlap`` (the all-to-all hidden
    behind paired chunks, ``expert_parallel_comm_overlap`` in a schedule that pairs them) the
    compute of every stage that holds a MoE block runs on ``sms - comm_sms`` SMs, so its F, I
    and W take ``sms / (sms - comm_sms)`` times as long. Every chunk of such a stage is
    charged, paired or not (DualPipe's warm-up and cool-down run a few unpaired): an upper
    bound of the charge. Data-parallel collectives (FSDP's all-gathers and reduce-scatters)
    are not charged: they run between blocks on their own stream.

    >>> from titanext.planning.roofline import MicrobatchTime
    >>> 132 / (132 - 20)  # DeepSeek-V3's 20 of 132 SMs: overlapped compute 1.18x as long
    1.1785714285714286
    """
    if not (comm_sms and overlap and lo.shape.moe is not None and lo.ep > 1
            and _can_overlap(lo)):
        return per_stage
    slow = device.sms / (device.sms - comm_sms)
    moe_ids = lo.shape.moe.layer_ids
    holds_moe = {s: bool(moe_ids.intersection(ids)) for rk in lo.pipe.ranks
                 for s, ids in zip(rk.stages, rk.stage_layer_ids)}
    return [MicrobatchTime(mt.f * slow, mt.i * slow, mt.w * slow, mt.attention_f * slow)
            if holds_moe.get(s) else mt for s, mt in enumerate(per_stage)]


def step_time(lo: Layout, device: Device, comm: list[dict], *, world_size: int, units: int,
              pass_time: float, compute: float, bubble: float,
              optimizer_elements: float, muon_ns: float = 0.0) -> dict:
    """Step time: the passes, the data-parallel traffic the compute does not hide (the first
    and last unit's at least) and the optimizer: its elementwise step, and with Muon the
    busiest owner's Newton-Schulz seconds ``muon_ns`` (:func:`titanext.planning.muon.
    ns_seconds`) and the owner exchange (the comm rows run inside the optimizer step, whole);
    MFU against the bf16 peak."""
    accum = lo.accum
    hidden = sum(comm_time(c, device) for c in comm if c["overlap"] == "compute")
    in_step = sum(comm_time(c, device) for c in comm if c["overlap"] == "optimizer step")
    step_compute = accum * pass_time
    exposed_dp = (max(0.0, hidden - step_compute) + hidden / max(1, units * accum)
                  if hidden else 0.0)
    optimizer = _optimizer_seconds(lo, device, optimizer_elements) + muon_ns
    step = step_compute + exposed_dp + optimizer + in_step
    tokens_step = _tokens_per_step(lo)
    mfu = lo.shape.flops_per_token * tokens_step / (step * device.bf16_flops * world_size)
    exposed = max(0.0, step - compute - optimizer - accum * bubble * pass_time)
    out = {"compute_s": compute, "exposed_comm_s": exposed, "bubble": bubble,
           "optimizer_s": optimizer, "step_s": step, "mfu": mfu,
           "tokens_per_s": tokens_step / step}
    if lo.cfg.optimizer.name == "Muon":
        out.update(muon_ns_s=muon_ns, muon_exchange_s=in_step)
    return out


def plan_config(cfg: JobConfig, world_size: int, *, device: Device = DEVICES["h100"],
                gpus_per_node: int = 8, efficiency: float = 0.6, imbalance: float = 1.0,
                compare_replication: bool = False, ep_overlap: bool = True,
                comm_sms: int = COMM_SMS) -> Plan:
    """Estimate memory, communication and time of ``cfg`` (already validated) on ``world_size``.

    ``efficiency`` is the fraction of the dense peak that large matmuls and attention reach
    (0.6-0.75 on H100); elementwise work runs at the memory roof
    (:mod:`titanext.planning.roofline`). MFU is reported against the bf16 peak, with the model's
    FLOPs (``num_flops_per_token``), as the trainer logs it.

    Ranks differ only along pp (the first holds the embedding, the last the head, each its own
    blocks and micro-batches in flight); ``memory`` is the busiest pp rank's and
    ``memory_per_pp_rank`` every pp rank's. A global batch that is not a whole number of
    ``local_batch_size x dp`` batches raises :class:`~titanext.config.ConfigError`, as in the
    trainer.

    ``imbalance`` is the routed rows of the busiest ep rank over the mean (1 = balanced; a
    measured ``moe_load``, or what hot-expert replication leaves): it scales that rank's expert
    work and all-to-all bytes. ``time["ep_all_to_all"]`` (MoE with ep > 1) gives the all-to-all
    waited for with ``expert_parallel_comm_overlap`` off and on, and the step time of each.
    With ``[moe] replicate_hot_experts`` the busiest rank is planned within the replication's
    slack of the mean (5%: what its plan reaches while copies last) and the copies' traffic is
    added; ``compare_replication`` adds ``time["ep_replication"]``: the step without copies at
    ``imbalance`` and with them (:func:`replication_comparison`). ``ep_overlap=False`` leaves
    ``time["ep_all_to_all"]`` out (two more schedule simulations; the advice's search does not
    rank by it). ``comm_sms``: SMs taken by communication while it overlaps compute
    (:func:`charge_comm_sms`; 0 charges none).
    """
    lo = resolve_layout(cfg, world_size, gpus_per_node=gpus_per_node,
                        float8_hardware=device.fp8_flops > 0)
    routed = imbalance
    if lo.recipe.expert_replicas:
        imbalance = min(imbalance, 1.0 + REPLICATION_SLACK)
    comm, time, memories, top, has_ep = _plan_step(lo, device, world_size, efficiency,
                                                   imbalance, ep_overlap, comm_sms)
    if has_ep and compare_replication:
        time["ep_replication"] = replication_comparison(
            cfg, world_size, device=device, gpus_per_node=gpus_per_node, efficiency=efficiency,
            imbalance=routed, comm_sms=comm_sms)
    total = sum(memories[top].values())
    return Plan(_layout_summary(lo), memories[top], comm, time,
                fits=total <= 0.9 * device.hbm_bytes, memory_per_pp_rank=memories)


def _plan_step(lo: Layout, device: Device, world_size: int, efficiency: float,
               imbalance: float, ep_overlap: bool, comm_sms: int
               ) -> tuple[list[dict], dict, list, int, bool]:
    """(comm rows, time, memory per pp rank, the pp rank with the most memory, whether an EP
    all-to-all row is among the rows) of ``lo``."""
    per_stage = stage_times(lo, device, efficiency, imbalance=imbalance)
    per_rank = _rank_sums(lo, per_stage)  # microbatch_times's
    # the rank with the most blocks (MoE blocks first) carries the most model-parallel
    # traffic: its rows are the per-step comm, its per-block rates every stage's
    busiest = max(range(lo.pp), key=lambda r: (lo.n_moe(lo.pipe.ranks[r]),
                                               lo.pipe.ranks[r].layers, per_rank[r].total))
    rank = lo.pipe.ranks[busiest]
    # DualPipe: each of a rank's two mirrored stages sees half the micro-batches, so a step's
    # traffic is half the micro-batches through both stages
    lo_comm = (dataclasses.replace(lo, pp_microbatches=lo.pp_microbatches // 2)
               if lo.job is not None and lo.job.pipeline.mirrored else lo)
    comm, mt, p2p = model_parallel_comm(lo_comm, device, rank, per_rank[busiest],
                                        imbalance=imbalance)
    ep_row = next((c for c in comm if c["parallelism"] == "EP all-to-all"), None)
    a2a = (ep_row["a2a_f_s"], ep_row["a2a_i_s"]) if ep_row else (0.0, 0.0)
    charged = {on: charge_comm_sms(lo, per_stage, device, comm_sms, overlap=on)
               for on in (False, True)}
    costs = {on: stage_costs(lo, charged[on], rank, per_rank[busiest], mt, a2a)
             for on in (False, True)}
    mine = lo.recipe.ep_comm_overlap
    pass_time, bubble, in_flight, sim, _ = _pipeline_pass(lo, costs[mine], p2p, overlap=mine,
                                                          a2a=True)
    events = sim.events if sim is not None else None
    compute = lo.accum * busy_compute(lo, charged[mine], events)
    memories, psis = memory_per_pp_rank(lo, in_flight, events,
                                        program=sim.program if sim is not None else None)
    top = max(range(lo.pp), key=lambda r: sum(memories[r].values()))
    psi_dense, psi_experts = psis[busiest]
    comm += data_parallel_comm(lo, rank, psi_dense, psi_experts)
    time = step_time(lo, device, comm, world_size=world_size, units=rank.layers + 1,
                     pass_time=pass_time, compute=compute, bubble=bubble,
                     optimizer_elements=state_elements(lo, psi_dense, psi_experts, lo.zero_n),
                     muon_ns=ns_seconds(lo, device, efficiency, rank))
    for c in comm:
        c["time_s"] = comm_time(c, device)
    time.update({"microbatch_f_i_w_s": [mt.f, mt.i, mt.w], "pp_p2p_s": p2p,
                 "stage_f_i_w_s": [[f, i, w] for f, i, w in zip(costs[mine].f, costs[mine].i,
                                                                costs[mine].w)]})
    if ep_row and ep_overlap:
        time["ep_all_to_all"] = ep_overlap_times(
            lo, costs, p2p, lo_comm.passes * (a2a[0] + a2a[1]), time["step_s"], pass_time,
            imbalance)
    return comm, time, memories, top, ep_row is not None


def _layout_summary(lo: Layout) -> dict:
    """The plan's ``layout``: the degrees and the recipe's choices it was made for."""
    cfg = lo.cfg
    return {"dp_replicate": lo.rep, "dp_shard": lo.shard, "cp": lo.cp, "tp": lo.tp,
            "pp": lo.pp, "ep": lo.ep, "zero_stage": lo.recipe.zero_stage, "ac": lo.ac,
            "full_blocks": (list(lo.recipe.ac_full_blocks)
                            if isinstance(lo.recipe.ac_full_blocks, tuple)
                            else lo.recipe.ac_full_blocks),
            "local_batch_size": cfg.training.local_batch_size,
            "gradient_accumulation": lo.accum, "microbatches": lo.accum,
            "pp_schedule": lo.pipe.name if lo.pp > 1 else None,
            "pp_microbatches": lo.pp_microbatches,
            "pp_stages_per_rank": lo.pipe.stages_per_rank, "float8": cfg.float8.enable}


def replication_comparison(cfg: JobConfig, world_size: int, *, imbalance: float,
                           **kwargs) -> dict:
    """The step of ``cfg`` at routing ``imbalance`` without hot-expert copies and with them
    (``[moe] replicate_hot_experts`` as configured, or 2 when it is 0): the busiest rank's
    expert work and all-to-all shrink to within the slack of the mean, and the copies' weights
    and gradients travel (their bytes per step are ``copy_gb``)."""
    copies = cfg.moe.replicate_hot_experts or 2
    out = {"imbalance": imbalance, "copies": copies,
           "imbalance_with_copies": min(imbalance, 1.0 + REPLICATION_SLACK)}
    for key, n in (("off", 0), ("on", copies)):
        variant = dataclasses.replace(cfg, moe=dataclasses.replace(cfg.moe,
                                                                   replicate_hot_experts=n))
        plan = plan_config(variant, world_size, imbalance=imbalance, **kwargs)
        out[f"step_{key}_s"] = plan.time["step_s"]
        if n:
            row = next((c for c in plan.comm if c["parallelism"].startswith("EP expert copies")),
                       None)
            out["copy_gb"] = row["bytes"] / 1e9 if row else 0.0
    return out
