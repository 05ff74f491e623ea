"""Planner: per-rank memory, communication, bubble and throughput of a layout, and advice.

    python -m titanext.plan --config train_configs/llama3_70b.toml --world-size 64 \\
        [--gpus-per-node 8] [--device h100] [--top 5] [--json] [--svg memory.svg] [--section.key=value ...]

It answers "which degrees should I use?" in seconds, without a process group, following the
Ultra-Scale Playbook's procedure: keep what fits in memory, reach the target batch, then rank
by estimated throughput (TP inside a node is cheap, across nodes expensive).

Model state (bytes per parameter; Psi parameters, N ranks sharding them). The playbook's
mixed-precision accounting is :func:`zero_bytes_per_rank`: bf16 params 2 + bf16 grads 2 +
fp32 master 4 + Adam 8 = 16 bytes (20 with an fp32 gradient-accumulation copy); ZeRO-1 keeps
4 Psi + 12 Psi/N, ZeRO-2 2 Psi + 14 Psi/N, ZeRO-3 16 Psi/N. titanext's own runs are FSDP2:
the fp32 parameter is the master (sharded), gradients are sharded fp32 (reduce dtype), Adam
holds two fp32 moments and a step scalar per tensor, and the compute-dtype copy of a unit
exists only while it is gathered (two units in flight).

Activations (bytes per token per transformer layer, a = bytes of the activation dtype, h =
dim, h_kv = kv_heads x head_dim, f = FFN hidden, n = heads), derived for titanext's Llama
block (RMSNorm, SwiGLU, GQA, no dropout, flash-style SDPA so no s^2 term) and checked against
saved-tensor measurements (tests/test_plan.py)::

    none:       a (10 h + 4 f) + 4 (n + 2)        # K/V expanded to n heads for SDPA
    selective:  a (5 h + 2 h_kv + 2 f) + 4 n      # outputs of matmuls and attention + block input
    full:       a h                               # the block input only

The GPT layer of Korthikanti et al. (the playbook's figure) is :func:`gpt_activation_bytes`:
34 s b h + 5 a s^2 b bytes per layer in 16-bit. The Llama form drops the s^2 term (attention
scores are never stored), the dropout masks and the GELU input, and adds SwiGLU's gate.
Under TP the parts split by heads or FFN columns divide by tp, the norm parts only with SP,
and the all-gathered matmul inputs (2 h) never; under CP every part divides by cp and ring
attention keeps K/V un-expanded (a (2 h + 2 h_kv) instead of 4 a h).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import itertools
import json
import sys
from collections.abc import Sequence
from dataclasses import dataclass

from titanext.config import ConfigError, JobConfig, load_config, parse_cli, resolved_dp_shard
from titanext.planning.hardware import DEVICES, GB, Device
from titanext.planning.moe import (
    MoEShape,
    all_to_all_bytes,
    moe_activation_extra,
    moe_shape,
    with_ep,
)
from titanext.planning.pipeline import pipeline_layout, simulate_times
from titanext.planning.roofline import Linear, microbatch_time, optimizer_time

__all__ = ["DEVICES", "Device", "Plan", "advise", "gpt_activation_bytes", "model_shape",
           "plan_config", "toml_snippet", "zero_bytes_per_rank"]


# -- the playbook's closed forms ------------------------------------------------------------------

def zero_bytes_per_rank(psi: float, n: int, stage: int, *, fp32_grad_accum: bool = False) -> float:
    """Model-state bytes per rank under ZeRO-``stage`` (0 = plain DP) with bf16 mixed precision."""
    params, grads, rest = 2 * psi, (6 if fp32_grad_accum else 2) * psi, 12 * psi
    if stage >= 1:
        rest /= n
    if stage >= 2:
        grads /= n
    if stage >= 3:
        params /= n
    return params + grads + rest


def gpt_activation_bytes(s: int, b: int, h: int, heads: int) -> float:
    """Korthikanti et al.'s GPT layer without recomputation: 34 s b h + 5 a s^2 b (16-bit)."""
    return 34 * s * b * h + 5 * heads * s * s * b


# -- the model ------------------------------------------------------------------------------------

@dataclass
class ModelShape:
    """Exact parameter counts of the model built on the meta device, by role."""

    dim: int
    n_layers: int
    n_heads: int
    kv_dim: int
    ffn: int
    vocab: int
    layer_sharded: int  # per layer: split by TP (attention and FFN matmuls)
    layer_replicated: int  # per layer: norms
    embedding: int
    output: int
    final_norm: int
    flops_per_token: float
    layer_tensors: int  # parameter tensors per layer (Adam keeps a step scalar for each)
    linears: tuple[Linear, ...] = ()  # one layer's matmuls (TP direction from the TP plan)
    moe: MoEShape | None = None  # the MoE blocks (the fields above describe the dense ones)

    @property
    def n_moe_layers(self) -> int:
        return len(self.moe.layer_ids) if self.moe else 0

    @property
    def total(self) -> int:
        moe = self.n_moe_layers * (self.moe.sharded + self.moe.replicated + self.moe.experts
                                   ) if self.moe else 0
        return ((self.n_layers - self.n_moe_layers) * (self.layer_sharded + self.layer_replicated)
                + moe + self.embedding + self.output + self.final_norm)


def model_shape(cfg: JobConfig) -> ModelShape:
    return _model_shape(cfg.model.name, cfg.model.flavor, cfg.training.seq_len,
                        cfg.model.hf_assets_path)


@functools.lru_cache(maxsize=8)
def _meta_model(name: str, flavor: str, hf_assets_path: str | None = None):
    from titanext.models import build_model, get_model_args

    return build_model(name, get_model_args(name, flavor, hf_assets_path), device="meta")


def _linears(layer) -> tuple[Linear, ...]:
    """A layer's nn.Linear modules; rowwise where the llama TP plan splits their input."""
    from torch import nn
    from torch.distributed.tensor.parallel import RowwiseParallel

    from titanext.plugins.tensor_parallel import llama_tp_plan

    plan = llama_tp_plan(layers_prefix="layer")
    return tuple(Linear(fqn, m.in_features, m.out_features,
                        rowwise=isinstance(plan.get(f"layer.{fqn}"), RowwiseParallel))
                 for fqn, m in layer.named_modules() if isinstance(m, nn.Linear))


@functools.lru_cache(maxsize=64)
def _float8_flags(name: str, flavor: str, recipe: str, filter_fqns: tuple[str, ...],
                  auto_filter: bool, hf_assets_path: str | None = None
                  ) -> tuple[tuple[bool, ...], bool]:
    """Which of layer 0's linears, and whether the output head, the float8 converter swaps."""
    from torch import nn

    from titanext.plugins.float8 import float8_module_filter

    keep = float8_module_filter(recipe=recipe, filter_fqns=filter_fqns, auto_filter=auto_filter)
    model = _meta_model(name, flavor, hf_assets_path)
    layer = tuple(keep(m, f"layers.0.{fqn}") for fqn, m in model.layers["0"].named_modules()
                  if isinstance(m, nn.Linear))
    return layer, keep(model.output, "output")


@functools.lru_cache(maxsize=16)
def _model_shape(name: str, flavor: str, seq_len: int,
                 hf_assets_path: str | None = None) -> ModelShape:
    from titanext.models import get_model_args

    args = get_model_args(name, flavor, hf_assets_path)  # flavor 'hf': its config.json
    model = _meta_model(name, flavor, hf_assets_path)
    # a dense block describes the dense fields (a MoE-only model has none, they count 0 times)
    layer = next((blk for blk in model.layers.values() if not hasattr(blk, "moe")),
                 model.layers["0"])
    norms = sum(p.numel() for n, p in layer.named_parameters() if "norm" in n)
    linears = _linears(layer)
    return ModelShape(
        dim=args.dim, n_layers=args.n_layers, n_heads=args.n_heads,
        kv_dim=args.kv_heads * args.head_dim, ffn=args.ffn_hidden_dim, vocab=args.vocab_size,
        layer_sharded=sum(p.numel() for p in layer.parameters()) - norms, layer_replicated=norms,
        embedding=model.tok_embeddings.weight.numel(), output=model.output.weight.numel(),
        final_norm=model.norm.weight.numel(),
        flops_per_token=model.num_flops_per_token(seq_len),
        layer_tensors=len(list(layer.parameters())), linears=linears,
        moe=moe_shape(model, linears))


# -- one layout -----------------------------------------------------------------------------------

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


def _dtype_bytes(name: str, on_gpu: bool) -> int:
    return 4 if name == "float32" or (name == "auto" and not on_gpu) else 2


def _level(stride: int, size: int, gpus_per_node: int) -> str:
    """A mesh axis group spans stride x size consecutive ranks: inside a node or not."""
    if size == 1:
        return "-"
    return "intra-node" if stride * size <= gpus_per_node else "inter-node"


def activation_bytes_per_token_layer(shape: ModelShape, mode: str, *, a: int, tp: int = 1,
                                     sp: bool = True, cp: int = 1, moe: bool = False) -> float:
    """Saved activation bytes of one layer per token of the *whole* sequence (see module doc).

    ``moe``: a MoE block: the attention part (``f = 0``) plus the routed part of
    :func:`titanext.planning.moe.moe_activation_extra` (replicated over tp)."""
    if moe:
        return (_activation_bytes(shape, mode, a=a, tp=tp, sp=sp, cp=cp, ffn=0)
                + moe_activation_extra(shape.moe, mode, dim=shape.dim, a=a) / cp)
    return _activation_bytes(shape, mode, a=a, tp=tp, sp=sp, cp=cp, ffn=shape.ffn)


def _activation_bytes(shape: ModelShape, mode: str, *, a: int, tp: int, sp: bool, cp: int,
                      ffn: int) -> float:
    h, hkv, f, n = shape.dim, shape.kv_dim, ffn, shape.n_heads
    if mode == "full":
        return a * h / (tp if sp else 1) / cp
    attention = a * (2 * h + 2 * hkv) if cp > 1 else a * 4 * h  # q, k, v, out (ring: K/V unexpanded)
    if mode == "selective":
        sharded = a * (3 * h + 2 * hkv + 2 * f) + 4 * n  # matmul and attention outputs
        if cp > 1:  # the ring is not an SDPA op: its output is recomputed
            sharded -= a * h + 4 * n
        return (sharded / tp + a * h / (tp if sp else 1)) / cp
    sharded = attention + a * 4 * f + 4 * n
    norms = a * 4 * h + 8  # residual inputs and normalised values of the two norms, rstds
    matmul_inputs = a * 2 * h  # gathered under TP, so never divided by tp
    return (sharded / tp + norms / (tp if sp else 1) + matmul_inputs) / cp


def _comm_time(c: dict, device: Device) -> float:
    """alpha-beta time of a communication row: latency per collective plus bytes over the link."""
    inter = c["level"] == "inter-node"
    return (c["collectives"] * (device.inter_latency if inter else device.intra_latency)
            + c["bytes"] / (device.inter_bw if inter else device.intra_bw))


def gradient_accumulation(cfg: JobConfig, dp: int) -> int:
    """Forward/backward passes per optimizer step on each rank (the trainer's rule)."""
    t = cfg.training
    return max(1, t.global_batch_size // (t.local_batch_size * dp)) if t.global_batch_size > 0 else 1


def plan_config(cfg: JobConfig, world_size: int, *, device: Device = DEVICES["h100"],
                gpus_per_node: int = 8, efficiency: float = 0.6) -> Plan:
    """Estimate memory, communication and time of ``cfg`` (already validated) on ``world_size``.

    ``efficiency`` is the fraction of the dense peak that large matmuls and attention reach
    (0.6-0.75 on H100); elementwise work runs at the memory roof
    (:mod:`titanext.planning.roofline`). MFU is reported against the bf16 peak, with the model's
    FLOPs (``num_flops_per_token``), as the trainer logs it.

    Ranks differ only along pp (the first holds the embedding, the last the head, each its own
    blocks and micro-batches in flight); ``memory`` is the busiest pp rank's and
    ``memory_per_pp_rank`` every pp rank's.
    """
    from titanext.pipeline import resolve_microbatches
    from titanext.plugins.fsdp import resolve_reshard_after_forward

    p, t, f8 = cfg.parallelism, cfg.training, cfg.float8
    shape = model_shape(cfg)
    rep, tp, cp, pp, ep = (p.data_parallel_replicate_degree, p.tensor_parallel_degree,
                           p.context_parallel_degree, p.pipeline_parallel_degree,
                           p.expert_parallel_degree)
    moe = shape.moe
    shard = resolved_dp_shard(cfg, world_size)
    dp, n_fsdp = rep * shard, shard * cp
    a = _dtype_bytes(t.mixed_precision_param, True)
    reduce_bytes = 2 if t.mixed_precision_reduce == "bfloat16" else 4
    sp = tp > 1 and p.enable_sequence_parallel
    ac = cfg.activation_checkpoint.mode
    accum = gradient_accumulation(cfg, dp)
    pp_mb = resolve_microbatches(pp, p.pipeline_parallel_microbatches, t.local_batch_size) if pp > 1 else 1
    pipe = pipeline_layout(p.pipeline_parallel_schedule if pp > 1 else "1F1B", pp=pp,
                           microbatches=pp_mb, n_layers=shape.n_layers,
                           stages_per_rank=p.pipeline_parallel_stages_per_rank if
                           p.pipeline_parallel_stages_per_rank > 0 else None,
                           first_stage_less_layers=p.pipeline_parallel_first_stage_less_layers,
                           last_stage_less_layers=p.pipeline_parallel_last_stage_less_layers,
                           layers_per_stage_explicit=tuple(p.pipeline_parallel_layers_per_stage))
    tokens_mb = t.local_batch_size // pp_mb * t.seq_len  # one micro-batch, the whole sequence
    tokens = tokens_mb / cp  # what this rank's matmuls see (SP gathers the sequence back)
    f8_layer, f8_head = (_float8_flags(cfg.model.name, cfg.model.flavor, f8.recipe,
                                       tuple(f8.filter_fqns), f8.auto_filter,
                                       cfg.model.hf_assets_path)
                         if f8.enable else ((False,) * len(shape.linears), False))
    linears = [dataclasses.replace(lin, float8=flag) for lin, flag in zip(shape.linears, f8_layer)]
    zero_n = n_fsdp if p.zero_stage >= 2 else dp * cp  # ranks sharding the optimizer state
    reshard = resolve_reshard_after_forward(p.fsdp_reshard_after_forward,
                                            zero_stage=max(p.zero_stage, 2), pp_enabled=pp > 1)
    f8_weights = sum(lin.in_features * lin.out_features for lin in linears if lin.float8)
    gathered_layer = ((1 if f8.enable_fsdp_float8_all_gather else a) * f8_weights
                      + a * (shape.layer_sharded - f8_weights)) / tp + a * shape.layer_replicated
    gathered_per_element = gathered_layer / (shape.layer_sharded / tp + shape.layer_replicated)
    if moe:  # a MoE unit gathers its attention, router, shared and this rank's experts
        gathered_layer = max(gathered_layer, a * (moe.sharded / tp + moe.replicated
                                                  + moe.experts / ep))
        moe_linears = with_ep(moe.linears, moe.num_experts, ep)

    def n_moe(rank) -> int:  # MoE blocks among a pp rank's blocks
        return len(moe.layer_ids.intersection(rank.layer_ids)) if moe else 0

    def act(rank_layers: float) -> float:  # one block-boundary activation (p2p, TP collectives)
        return tokens * shape.dim * a / (tp if sp else 1) * rank_layers

    # -- time of one micro-batch on each pp rank, with the TP collectives on its critical path
    tp_fwd = (4 if sp else 2) * (tp > 1)  # SP: 2 all-gathers + 2 reduce-scatters per block
    tp_bytes = tokens * shape.dim * a * (tp - 1) / tp * (1 if sp else 2)  # per collective
    per_rank = []
    common = dict(tokens=tokens, seq_len=t.seq_len, dim=shape.dim, kv_dim=shape.kv_dim,
                  vocab=shape.vocab, tp=tp, sp=sp, a=a, ac=ac, efficiency=efficiency)
    for rank in pipe.ranks:
        mt = microbatch_time(device, ffn=shape.ffn, linears=linears,
                             layers=rank.layers - n_moe(rank), embedding=rank.embedding,
                             head=rank.head, head_float8=f8_head, **common)
        if n_moe(rank):
            mt = mt + microbatch_time(device, ffn=0, linears=moe_linears, layers=n_moe(rank),
                                      ffn_replicated=moe.top_k * moe.hidden + moe.shared_hidden,
                                      **common)
        per_rank.append(mt)
    level = functools.partial(_level, gpus_per_node=gpus_per_node)
    strides = {"tp": 1, "cp": tp, "dp_shard": tp * cp, "dp_replicate": tp * cp * shard,
               "pp": tp * cp * shard * rep}
    busiest = max(range(pp), key=lambda r: per_rank[r].total)
    rank, mt = pipe.ranks[busiest], per_rank[busiest]
    comm = []
    passes = accum * pp_mb  # micro-batches through this rank per optimizer step
    if tp > 1:
        n_f = tp_fwd * rank.layers
        n_i = n_f * (2 if ac == "full" else 1)  # backward (+ the recomputed forward's)
        c = {"parallelism": "TP/SP" if sp else "TP", "collectives": (n_f + n_i) * passes,
             "bytes": (n_f + n_i) * tp_bytes * passes, "level": level(1, tp),
             "overlap": "none"}
        comm.append(c)
        one = _comm_time({**c, "collectives": 1, "bytes": tp_bytes}, device)
        mt = dataclasses.replace(mt, f=mt.f + n_f * one, i=mt.i + n_i * one)
    if cp > 1:
        kv = 2 * tokens * shape.kv_dim / tp  # K and V elements of this rank's slice
        rounds = (cp - 1) * (2 if ac == "full" else 1)  # forward (+ its recompute)
        ring = p.context_parallel_comm != "allgather"
        c = {"parallelism": f"CP ({p.context_parallel_comm})",
             "collectives": rank.layers * passes * ((rounds + 2 * (cp - 1)) if ring
                                                   else (2 if ac == "full" else 1) + 1),
             # K/V blocks forward; K/V again and their fp32 gradients backward
             "bytes": rank.layers * passes * kv * (rounds * a + (cp - 1) * (a + 4)),
             "level": level(tp, cp), "overlap": "attention"}
        comm.append(c)
        hidden = mt.attention_f * (1 + 2.5 + (1 if ac == "full" else 0))
        mt = dataclasses.replace(mt, i=mt.i + max(0.0, _comm_time(c, device) / passes - hidden))
    if ep > 1 and n_moe(rank):
        # dispatch + combine forward, again backward (and in the recompute); one count exchange
        # per dispatch; on the critical path (the MoE waits for its tokens)
        n_f = 2 * n_moe(rank)
        n_i = n_f * (2 if ac == "full" else 1)
        one = all_to_all_bytes(tokens, dim=shape.dim, top_k=moe.top_k, ep=ep, a=a)
        counts = n_moe(rank) * (2 if ac == "full" else 1)  # split sizes, once per dispatch
        c = {"parallelism": "EP all-to-all", "collectives": (n_f + n_i + counts) * passes,
             "bytes": (n_f + n_i) * one * passes, "level": level(tp, ep), "overlap": "none"}
        comm.append(c)
        t_one = _comm_time({**c, "collectives": 1, "bytes": one}, device)
        mt = dataclasses.replace(mt, f=mt.f + n_f * t_one, i=mt.i + n_i * t_one)
    p2p = 0.0
    if pp > 1:
        send = act(1)
        c = {"parallelism": f"PP p2p ({pipe.schedule})", "collectives": rank.sends * passes,
             "bytes": rank.sends * passes * send, "level": level(strides["pp"], pp),
             "overlap": "in the schedule"}
        comm.append(c)
        p2p = _comm_time({**c, "collectives": 1, "bytes": send}, device)

    # -- one pass (a pipeline flush, or one micro-batch) and the schedule's bubble
    bubble, in_flight = 0.0, [1] * pp
    if pp > 1:
        pass_time, sim = simulate_times(pipe, f=mt.f, i=mt.i, w=mt.w, comm=p2p)
        bubble, in_flight = sim.bubble_ratio, sim.peak_activations
    else:
        pass_time = mt.total
    compute = passes * sum((per_rank[busiest].f, per_rank[busiest].i, per_rank[busiest].w))

    # -- memory of each pp rank
    per_layer = activation_bytes_per_token_layer(shape, ac, a=a, tp=tp, sp=sp, cp=cp)
    head_act = tokens * (a * 3 * shape.dim / (tp if sp else 1) + 4 * shape.vocab / tp + 16)
    memories, psis = [], []
    per_moe_layer = (activation_bytes_per_token_layer(shape, ac, a=a, tp=tp, sp=sp, cp=cp, moe=True)
                     if moe else 0.0)
    sharded = p.zero_stage >= 2 and n_fsdp * rep > 1

    def per_rank_elements(psi_dense: float, psi_experts: float, ranks: int) -> float:
        """Elements on one rank when ``ranks`` data-parallel ranks shard the state: the ep
        ranks already split the experts, the other ``ranks / ep`` shard them further."""
        return psi_dense / ranks + psi_experts / max(1, ranks // ep)

    for r, rk in enumerate(pipe.ranks):
        n_m = n_moe(rk)
        psi_dense = ((rk.layers - n_m) * (shape.layer_sharded / tp + shape.layer_replicated)
                     + n_m * ((moe.sharded / tp + moe.replicated) if moe else 0)
                     + (shape.embedding / tp if rk.embedding else 0)
                     + (shape.output / tp + shape.final_norm if rk.head else 0))
        psi_experts = n_m * moe.experts / ep if moe else 0.0
        psi = psi_dense + psi_experts
        tensors = ((rk.layers - n_m) * shape.layer_tensors + n_m * (moe.tensors if moe else 0)
                   + rk.embedding + 2 * rk.head)
        state = per_rank_elements(psi_dense, psi_experts, n_fsdp if sharded else 1)
        mem = {"params (fp32 master)": 4 * state, "grads (fp32)": 4 * state,
               # two fp32 moments per element, and a 4-byte step per parameter tensor
               "optimizer (Adam)": 8 * per_rank_elements(psi_dense, psi_experts, zero_n)
               + 4 * tensors}
        if sharded and n_fsdp > 1:  # gathered units: two in flight, or all without resharding
            mem["gathered params"] = gathered_layer * (2 if reshard else rk.layers)
        else:
            mem["gathered params"] = 0.0
        stages = len(rk.stages)
        mem["activations"] = (in_flight[r] * tokens_mb / stages
                              * ((rk.layers - n_m) * per_layer + n_m * per_moe_layer)
                              + (head_act if rk.head else 0.0))
        memories.append(mem)
        psis.append((psi_dense, psi_experts))
    top = max(range(pp), key=lambda r: sum(memories[r].values()))
    psi_dense, psi_experts = psis[busiest]
    psi = psi_dense + psi_experts

    # -- data-parallel traffic, hidden behind the step's compute except the first/last unit
    units = rank.layers + 1
    if n_fsdp > 1 and p.zero_stage >= 2:
        gathers = 1 if (p.zero_stage == 2 or not reshard) else 2
        frac = (n_fsdp - 1) / n_fsdp
        per_element = gathered_per_element * gathers + reduce_bytes
        dense_only = psi_experts and ep > 1  # experts have their own FSDP group
        comm.append({"parallelism": "FSDP (dp_shard x cp)", "collectives": units * (gathers + 1) * accum,
                     "bytes": (psi_dense if dense_only else psi) * frac * per_element * accum,
                     "level": level(strides["dp_shard"], n_fsdp), "overlap": "compute"})
        n_e = n_fsdp // ep
        if dense_only and n_e > 1:
            comm.append({"parallelism": "FSDP experts (dp_shard x cp / ep)",
                         "collectives": n_moe(rank) * (gathers + 1) * accum,
                         "bytes": psi_experts * (n_e - 1) / n_e * (a * gathers + reduce_bytes) * accum,
                         "level": level(tp * ep, n_e), "overlap": "compute"})
    if rep > 1 and p.zero_stage >= 2:
        comm.append({"parallelism": "HSDP all-reduce (dp_replicate)", "collectives": units * accum,
                     "bytes": 2 * (rep - 1) / rep * reduce_bytes * accum
                     * per_rank_elements(psi_dense, psi_experts, n_fsdp),
                     "level": level(strides["dp_replicate"], rep), "overlap": "compute"})
    if p.zero_stage == 1 and dp * cp > 1:
        d = dp * cp  # DDP all-reduce once per step, then the sharded optimizer's fp32 all-gather
        comm.append({"parallelism": "DP all-reduce + ZeRO-1 gather", "collectives": 2 * units,
                     "bytes": (2 * reduce_bytes + 4) * (d - 1) / d * psi,
                     "level": level(tp, d), "overlap": "compute"})
    hidden = sum(_comm_time(c, device) for c in comm if c["overlap"] == "compute")
    step_compute = accum * pass_time
    exposed_dp = max(0.0, hidden - step_compute) + hidden / max(1, units * accum) if hidden else 0.0
    optimizer = optimizer_time(device, per_rank_elements(psi_dense, psi_experts, zero_n))
    step = step_compute + exposed_dp + optimizer
    for c in comm:
        c["time_s"] = _comm_time(c, device)
    tokens_step = accum * t.local_batch_size * dp * t.seq_len
    mfu = shape.flops_per_token * tokens_step / (step * device.bf16_flops * world_size)
    exposed = max(0.0, step - compute - optimizer - accum * bubble * pass_time)
    time = {"compute_s": compute, "exposed_comm_s": exposed,
            "bubble": bubble, "optimizer_s": optimizer, "step_s": step, "mfu": mfu,
            "tokens_per_s": tokens_step / step, "microbatch_f_i_w_s": [mt.f, mt.i, mt.w],
            "pp_p2p_s": p2p}
    layout = {"dp_replicate": rep, "dp_shard": shard, "cp": cp, "tp": tp, "pp": pp, "ep": ep,
              "zero_stage": p.zero_stage, "ac": ac, "local_batch_size": t.local_batch_size,
              "gradient_accumulation": accum, "microbatches": accum,
              "pp_schedule": pipe.schedule if pp > 1 else None, "pp_microbatches": pp_mb,
              "pp_stages_per_rank": pipe.stages_per_rank, "float8": f8.enable}
    total = sum(memories[top].values())
    return Plan(layout, memories[top], comm, time, fits=total <= 0.9 * device.hbm_bytes,
                memory_per_pp_rank=memories)


# -- advice ---------------------------------------------------------------------------------------

def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def advise(path: str | None, overrides: Sequence[str], world_size: int, *,
           device: Device = DEVICES["h100"], gpus_per_node: int = 8, top: int = 5,
           efficiency: float = 0.6) -> list[Plan]:
    """The ``top`` feasible layouts ranked by estimated tokens/s (best first).

    Candidates are estimated first (cheap), then validated in rank order through
    :func:`titanext.config.load_config` with ``world_size``, so a layout that fails validation
    is never proposed; those that do not fit in 90% of HBM are dropped. The global batch of the
    config is kept; the micro-batch size and recompute mode are searched.
    """
    base = load_config(path, overrides, world_size=world_size)
    global_batch = base.training.global_batch_size
    if global_batch <= 0:
        global_batch = base.training.local_batch_size * world_size
    moe = model_shape(base).moe
    candidates = []
    for tp in _divisors(world_size):
        if tp > 2 * gpus_per_node:
            continue
        for pp in _divisors(world_size // tp):
            for cp in (c for c in (1, 2, 4, 8) if (world_size // (tp * pp)) % c == 0):
                dp = world_size // (tp * pp * cp)
                # expert parallelism borrows dp_shard x cp ranks (MoE models only)
                eps = [e for e in _divisors(dp * cp) if moe and moe.num_experts % e == 0] or [1]
                for ep, ac, local in itertools.product(eps, ("none", "selective", "full"),
                                                       (1, 2, 4, 8)):
                    if global_batch % (local * dp):
                        continue
                    cfg = dataclasses.replace(
                        base,
                        parallelism=dataclasses.replace(
                            base.parallelism, tensor_parallel_degree=tp,
                            pipeline_parallel_degree=pp, context_parallel_degree=cp,
                            expert_parallel_degree=ep, data_parallel_replicate_degree=1,
                            data_parallel_shard_degree=dp),
                        activation_checkpoint=dataclasses.replace(base.activation_checkpoint,
                                                                  mode=ac),
                        training=dataclasses.replace(base.training, local_batch_size=local,
                                                     global_batch_size=global_batch))
                    try:
                        plan = plan_config(cfg, world_size, device=device,
                                           gpus_per_node=gpus_per_node, efficiency=efficiency)
                    except ValueError:  # e.g. fewer layers than stages: validation rejects it
                        continue
                    if plan.fits:
                        candidates.append(plan)
    # Ties (the roofline cannot tell them apart) go to the simpler layout, then to less memory.
    candidates.sort(key=lambda pl: (-round(pl.time["tokens_per_s"], -1),
                                    pl.layout["tp"] * pl.layout["cp"] * pl.layout["pp"],
                                    pl.memory_total))
    chosen = []
    for plan in candidates:
        lo = plan.layout
        cand = [f"--parallelism.tensor_parallel_degree={lo['tp']}",
                f"--parallelism.pipeline_parallel_degree={lo['pp']}",
                f"--parallelism.context_parallel_degree={lo['cp']}",
                f"--parallelism.expert_parallel_degree={lo['ep']}",
                "--parallelism.data_parallel_replicate_degree=1",
                f"--parallelism.data_parallel_shard_degree={lo['dp_shard']}",
                f"--activation_checkpoint.mode={lo['ac']}",
                f"--training.local_batch_size={lo['local_batch_size']}",
                f"--training.global_batch_size={global_batch}"]
        try:
            load_config(path, [*overrides, *cand], world_size=world_size)
        except ConfigError:
            continue
        lo["overrides"] = cand
        chosen.append(plan)
        if len(chosen) == top:
            break
    return chosen


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
        "", "[activation_checkpoint]", f'mode = "{lo["ac"]}"'])


# -- output ---------------------------------------------------------------------------------------

_COLOURS = {"params (fp32 master)": "#4c78a8", "grads (fp32)": "#f58518",
            "optimizer (Adam)": "#54a24b", "gathered params": "#b279a2", "activations": "#e45756"}


def memory_svg(plans: Sequence[Plan], labels: Sequence[str], hbm: float) -> str:
    """A stacked bar per plan (the busiest rank's memory by category), with the HBM line."""
    width, bar, gap, top, height = 160 + 90 * len(plans), 48, 42, 30, 260
    scale = height / max(hbm, max(pl.memory_total for pl in plans))
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height + 120}" '
           'font-family="sans-serif" font-size="11">',
           '<text x="10" y="18" font-size="13">Memory per rank (GB), busiest rank</text>']
    for i, (pl, label) in enumerate(zip(plans, labels)):
        x, y = 60 + i * (bar + gap), top + height
        for cat, value in pl.memory.items():
            h = value * scale
            y -= h
            out.append(f'<rect x="{x}" y="{y:.1f}" width="{bar}" height="{h:.1f}" '
                       f'fill="{_COLOURS[cat]}"><title>{cat}: {value / GB:.1f} GB</title></rect>')
        out.append(f'<text x="{x + bar / 2}" y="{y - 4:.1f}" text-anchor="middle">'
                   f'{pl.memory_total / GB:.1f}</text>')
        out.append(f'<text x="{x + bar / 2}" y="{top + height + 14}" text-anchor="middle">{label}</text>')
    hy = top + height - hbm * scale
    out.append(f'<line x1="50" x2="{width - 10}" y1="{hy:.1f}" y2="{hy:.1f}" stroke="black" '
               f'stroke-dasharray="4 3"/><text x="{width - 10}" y="{hy - 4:.1f}" '
               f'text-anchor="end">HBM {hbm / GB:.0f} GB</text>')
    for j, (cat, colour) in enumerate(_COLOURS.items()):
        y = top + height + 34 + 14 * j
        out.append(f'<rect x="60" y="{y - 9}" width="10" height="10" fill="{colour}"/>'
                   f'<text x="76" y="{y}">{cat}</text>')
    out.append("</svg>")
    return "\n".join(out)


def _layout_name(lo: dict) -> str:
    ep = f" ep{lo['ep']}" if lo["ep"] > 1 else ""
    return (f"dp{lo['dp_shard']} tp{lo['tp']} cp{lo['cp']} pp{lo['pp']}{ep} {lo['ac']} "
            f"mb{lo['local_batch_size']}")


def main(argv: Sequence[str] | None = None) -> int:
    from titanext.metrics import format_table

    ap = argparse.ArgumentParser(prog="python -m titanext.plan", description=__doc__.splitlines()[0],
                                 add_help=True)
    ap.add_argument("--world-size", type=int, required=True, help="number of GPUs")
    ap.add_argument("--gpus-per-node", type=int, default=8)
    ap.add_argument("--device", choices=sorted(DEVICES), default="h100")
    ap.add_argument("--peak-tflops", type=float, help="override the device's dense bf16 TFLOP/s")
    ap.add_argument("--hbm-gb", type=float, help="override the device's memory (GB)")
    ap.add_argument("--efficiency", type=float, default=0.6,
                    help="fraction of peak FLOP/s the kernels reach (default 0.6)")
    ap.add_argument("--top", type=int, default=5, help="layouts to advise")
    ap.add_argument("--json", action="store_true", help="print JSON instead of tables")
    ap.add_argument("--svg", help="write the memory picture to this file")
    known, rest = ap.parse_known_args(list(sys.argv[1:] if argv is None else argv))
    problems = []
    if known.world_size < 1:
        problems.append(f"--world-size = {known.world_size} must be >= 1")
    if not 0 < known.efficiency <= 1:
        problems.append(f"--efficiency = {known.efficiency} must be in (0, 1]")
    if known.gpus_per_node < 1:
        problems.append(f"--gpus-per-node = {known.gpus_per_node} must be >= 1")
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
            print(f"titanext.plan: error: {problem}", file=sys.stderr)
        return 2
    current = plan_config(cfg, known.world_size, device=device, gpus_per_node=known.gpus_per_node,
                          efficiency=known.efficiency)
    advice = advise(path, overrides, known.world_size, device=device,
                    gpus_per_node=known.gpus_per_node, top=known.top, efficiency=known.efficiency)
    if known.svg:
        with open(known.svg, "w") as f:
            f.write(memory_svg([current, *advice], ["config", *(f"#{i + 1}" for i in range(len(advice)))],
                               device.hbm_bytes))
    if known.json:
        print(json.dumps({"device": dataclasses.asdict(device), "config": dataclasses.asdict(current),
                          "advice": [dataclasses.asdict(pl) for pl in advice]}, indent=1))
        return 0
    shape = model_shape(cfg)
    print(f"{cfg.model.name} {cfg.model.flavor}: {shape.total / 1e9:.2f}B parameters on "
          f"{known.world_size} x {device.name} ({known.gpus_per_node} per node)\n")
    print(f"Memory per rank, this config ({_layout_name(current.layout)}):")
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
          f"{tm['tokens_per_s']:,.0f} tokens/s\n")
    print(f"Advice: the {len(advice)} fastest layouts that fit and validate:")
    print(format_table([{"#": i + 1, "layout": _layout_name(pl.layout), "memory GB": pl.memory_total / GB,
                         "MFU": f"{pl.time['mfu']:.1%}", "tokens/s": pl.time["tokens_per_s"]}
                        for i, pl in enumerate(advice)]))
    for i, pl in enumerate(advice[:3]):
        print(f"\n# layout #{i + 1}\n{toml_snippet(pl)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
