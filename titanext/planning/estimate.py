"""One config on one cluster: memory, communication, bubble and step time (:func:`plan_config`).

The estimate is assembled from named pieces, each in its own module:

1. the layout (:func:`~titanext.planning.layout.resolve_layout`): degrees, dtypes, micro-batches
   and gradient accumulation (the config's rule), the pipeline split;
2. compute of one micro-batch on each pp rank (:func:`microbatch_times`, a roofline from
   :mod:`~titanext.planning.roofline`);
3. model-parallel communication on the busiest rank's critical path
   (:func:`~titanext.planning.comm.model_parallel_comm`);
4. the pipeline bubble and the micro-batches in flight (:func:`pipeline_pass`, replaying the
   schedule in the simulator);
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
from titanext.planning.hardware import DEVICES, Device
from titanext.planning.layout import Layout, resolve_layout
from titanext.planning.memory import memory_per_pp_rank, state_elements
from titanext.planning.roofline import MicrobatchTime, microbatch_time, optimizer_time
from titanext.planning.stages import simulate_times
from titanext.plugins.options import REPLICATION_SLACK

__all__ = ["Plan", "ep_overlap_times", "microbatch_times", "pipeline_pass", "plan_config",
           "step_time"]


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


def microbatch_times(lo: Layout, device: Device, efficiency: float, *,
                     imbalance: float = 1.0) -> list[MicrobatchTime]:
    """Compute time (F, I, W) of one micro-batch through each pp rank's blocks, no comm.
    ``imbalance`` (max / mean routed rows per ep rank) scales the routed experts' work: the
    busiest ep rank sets the pace."""
    shape, moe = lo.shape, lo.shape.moe
    common = dict(tokens=lo.tokens, seq_len=lo.cfg.training.seq_len, dim=shape.dim,
                  kv_dim=shape.kv_dim, vocab=shape.vocab, tp=lo.tp, sp=lo.sp, a=lo.a, ac=lo.ac,
                  efficiency=efficiency)
    per_rank = []
    for rank in lo.pipe.ranks:
        n_moe = lo.n_moe(rank)
        mt = microbatch_time(device, ffn=shape.ffn, linears=lo.linears,
                             layers=rank.layers - n_moe, embedding=rank.embedding,
                             head=rank.head, head_float8=lo.head_float8, **common)
        if n_moe:
            linears = [dataclasses.replace(lin, token_factor=lin.token_factor * imbalance)
                       if lin.name.startswith("moe.experts.") else lin for lin in lo.moe_linears]
            routed = moe.top_k * moe.hidden * imbalance
            mt = mt + microbatch_time(device, ffn=0, linears=linears, layers=n_moe,
                                      ffn_replicated=routed + moe.shared_hidden, **common)
        per_rank.append(mt)
    return per_rank


def pipeline_pass(lo: Layout, mt: MicrobatchTime, p2p: float, *,
                  a2a: tuple[float, float] = (0.0, 0.0), overlap: bool = False
                  ) -> tuple[float, float, list[int], list | None, float]:
    """(time of one pass: a pipeline flush or one micro-batch, bubble ratio, micro-batches in
    flight on each pp rank at its peak, the simulated actions (None without pp), the
    all-to-all seconds the busiest rank waits per pass). ``mt`` includes the expert-parallel
    all-to-all time ``a2a`` (in F, in I); with ``overlap`` the schedule's paired chunks hide
    it behind each other."""
    if lo.pp == 1:
        return mt.total, 0.0, [1], None, a2a[0] + a2a[1]
    pass_time, sim = simulate_times(lo.pipe, f=mt.f - a2a[0], i=mt.i - a2a[1], w=mt.w, comm=p2p,
                                    a2a=a2a[0], a2a_i=a2a[1], overlap=overlap)
    exposed = max(sim.a2a_exposed)
    # the bubble is idle time: an exposed all-to-all is communication, not bubble
    bubble = max(0.0, sim.bubble_ratio - exposed / pass_time)
    return pass_time, bubble, sim.peak_activations, sim.events, exposed


def ep_overlap_times(lo: Layout, mt: MicrobatchTime, p2p: float, a2a: tuple[float, float],
                     step: float, pass_time: float, imbalance: float) -> dict:
    """The expert-parallel all-to-all of a step: its total, what the busiest rank waits for
    with ``expert_parallel_comm_overlap`` off and on (on: None where the schedule has no
    paired chunks) and the step time of each, at this routing ``imbalance`` (max / mean rows
    per ep rank; replicating hot experts brings it towards 1)."""
    from titanext.schedules.overlap import OVERLAP_SCHEDULES

    out = {"imbalance": imbalance, "per_step_s": lo.passes * (a2a[0] + a2a[1])}
    mine = lo.cfg.parallelism.expert_parallel_comm_overlap
    can = lo.pp > 1 and lo.pipe.schedule in OVERLAP_SCHEDULES
    for on in (False, True):
        if on and not can:
            out["exposed_on_s"] = out["step_on_s"] = None
            continue
        p, *_, exposed = pipeline_pass(lo, mt, p2p, a2a=a2a, overlap=on)
        key = "on" if on else "off"
        out[f"exposed_{key}_s"] = lo.accum * exposed
        out[f"step_{key}_s"] = step + lo.accum * (p - pass_time) if on != mine else step
    return out


def step_time(lo: Layout, device: Device, comm: list[dict], *, world_size: int, units: int,
              pass_time: float, compute: float, bubble: float,
              optimizer_elements: float) -> dict:
    """Step time: the passes, the data-parallel traffic the compute does not hide (the first
    and last unit's at least) and the optimizer; MFU against the bf16 peak."""
    accum, t = lo.accum, lo.cfg.training
    hidden = sum(comm_time(c, device) for c in comm if c["overlap"] == "compute")
    step_compute = accum * pass_time
    exposed_dp = (max(0.0, hidden - step_compute) + hidden / max(1, units * accum)
                  if hidden else 0.0)
    optimizer = optimizer_time(device, optimizer_elements)
    step = step_compute + exposed_dp + optimizer
    tokens_step = accum * t.local_batch_size * lo.dp * t.seq_len
    mfu = lo.shape.flops_per_token * tokens_step / (step * device.bf16_flops * world_size)
    exposed = max(0.0, step - compute - optimizer - accum * bubble * pass_time)
    return {"compute_s": compute, "exposed_comm_s": exposed, "bubble": bubble,
            "optimizer_s": optimizer, "step_s": step, "mfu": mfu,
            "tokens_per_s": tokens_step / step}


def plan_config(cfg: JobConfig, world_size: int, *, device: Device = DEVICES["h100"],
                gpus_per_node: int = 8, efficiency: float = 0.6, imbalance: float = 1.0,
                compare_replication: bool = False, ep_overlap: bool = True) -> Plan:
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
    rank by it).
    """
    routed = imbalance
    if cfg.moe.replicate_hot_experts and cfg.parallelism.expert_parallel_degree > 1:
        imbalance = min(imbalance, 1.0 + REPLICATION_SLACK)
    lo = resolve_layout(cfg, world_size, gpus_per_node=gpus_per_node)
    per_rank = microbatch_times(lo, device, efficiency, imbalance=imbalance)
    busiest = max(range(lo.pp), key=lambda r: per_rank[r].total)
    rank = lo.pipe.ranks[busiest]
    comm, mt, p2p = model_parallel_comm(lo, device, rank, per_rank[busiest], imbalance=imbalance)
    ep_row = next((c for c in comm if c["parallelism"] == "EP all-to-all"), None)
    a2a = (ep_row["a2a_f_s"], ep_row["a2a_i_s"]) if ep_row else (0.0, 0.0)
    overlap = cfg.parallelism.expert_parallel_comm_overlap
    pass_time, bubble, in_flight, events, _ = pipeline_pass(lo, mt, p2p, a2a=a2a,
                                                            overlap=overlap)
    compute = lo.passes * sum((per_rank[busiest].f, per_rank[busiest].i, per_rank[busiest].w))
    memories, psis = memory_per_pp_rank(lo, in_flight, events)
    top = max(range(lo.pp), key=lambda r: sum(memories[r].values()))
    psi_dense, psi_experts = psis[busiest]
    comm += data_parallel_comm(lo, rank, psi_dense, psi_experts)
    time = step_time(lo, device, comm, world_size=world_size, units=rank.layers + 1,
                     pass_time=pass_time, compute=compute, bubble=bubble,
                     optimizer_elements=state_elements(lo, psi_dense, psi_experts, lo.zero_n))
    for c in comm:
        c["time_s"] = comm_time(c, device)
    time.update({"microbatch_f_i_w_s": [mt.f, mt.i, mt.w], "pp_p2p_s": p2p})
    if ep_row and ep_overlap:
        time["ep_all_to_all"] = ep_overlap_times(lo, mt, p2p, a2a, time["step_s"], pass_time,
                                                 imbalance)
    if ep_row and compare_replication:
        time["ep_replication"] = replication_comparison(
            cfg, world_size, device=device, gpus_per_node=gpus_per_node, efficiency=efficiency,
            imbalance=routed)
    p = cfg.parallelism
    layout = {"dp_replicate": lo.rep, "dp_shard": lo.shard, "cp": lo.cp, "tp": lo.tp,
              "pp": lo.pp, "ep": lo.ep, "zero_stage": p.zero_stage, "ac": lo.ac,
              "local_batch_size": cfg.training.local_batch_size,
              "gradient_accumulation": lo.accum, "microbatches": lo.accum,
              "pp_schedule": lo.pipe.schedule if lo.pp > 1 else None,
              "pp_microbatches": lo.pp_microbatches,
              "pp_stages_per_rank": lo.pipe.stages_per_rank, "float8": cfg.float8.enable}
    total = sum(memories[top].values())
    return Plan(layout, memories[top], comm, time, fits=total <= 0.9 * device.hbm_bytes,
                memory_per_pp_rank=memories)


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
