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

__all__ = ["Plan", "microbatch_times", "pipeline_pass", "plan_config", "step_time"]


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


def microbatch_times(lo: Layout, device: Device, efficiency: float) -> list[MicrobatchTime]:
    """Compute time (F, I, W) of one micro-batch through each pp rank's blocks, no comm."""
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
            mt = mt + microbatch_time(device, ffn=0, linears=lo.moe_linears, layers=n_moe,
                                      ffn_replicated=moe.top_k * moe.hidden + moe.shared_hidden,
                                      **common)
        per_rank.append(mt)
    return per_rank


def pipeline_pass(lo: Layout, mt: MicrobatchTime, p2p: float
                  ) -> tuple[float, float, list[int], list | None]:
    """(time of one pass: a pipeline flush or one micro-batch, bubble ratio, micro-batches in
    flight on each pp rank at its peak, the simulated actions (None without pp))."""
    if lo.pp == 1:
        return mt.total, 0.0, [1], None
    pass_time, sim = simulate_times(lo.pipe, f=mt.f, i=mt.i, w=mt.w, comm=p2p)
    return pass_time, sim.bubble_ratio, sim.peak_activations, sim.events


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
                gpus_per_node: int = 8, efficiency: float = 0.6) -> Plan:
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
    """
    lo = resolve_layout(cfg, world_size, gpus_per_node=gpus_per_node)
    per_rank = microbatch_times(lo, device, efficiency)
    busiest = max(range(lo.pp), key=lambda r: per_rank[r].total)
    rank = lo.pipe.ranks[busiest]
    comm, mt, p2p = model_parallel_comm(lo, device, rank, per_rank[busiest])
    pass_time, bubble, in_flight, events = pipeline_pass(lo, mt, p2p)
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
