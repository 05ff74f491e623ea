"""Memory per rank: model state (parameters, gradients, optimizer) and activations.

Model state (bytes per parameter; Psi parameters, N ranks sharding them). The playbook's
mixed-precision accounting is :func:`zero_bytes_per_rank`: bf16 params 2 + bf16 grads 2 +
fp32 master 4 + Adam 8 = 16 bytes (20 with an fp32 gradient-accumulation copy); ZeRO-1 keeps
4 Psi + 12 Psi/N, ZeRO-2 2 Psi + 14 Psi/N, ZeRO-3 16 Psi/N. titanext's own runs are FSDP2:
the fp32 parameter is the master (sharded), gradients are sharded fp32 (reduce dtype), Adam
holds two fp32 moments (bf16 with ``[optimizer] state_dtype``: 4 bytes, not 8) and a step
scalar per tensor, and the compute-dtype copy of a unit
exists only while it is gathered (two units in flight).

Activations (bytes per token per transformer layer, a = bytes of the activation dtype, h =
dim, h_kv = kv_heads x head_dim, f = FFN hidden, n = heads), derived for titanext's Llama
block (RMSNorm, SwiGLU, GQA, no dropout, flash-style SDPA so no s^2 term) and checked against
saved-tensor measurements (tests/unit/test_plan.py)::

    none:       a (10 h + 4 f) + 4 (n + 2)        # K/V expanded to n heads for SDPA
    selective:  r h + a (4 h + 2 h_kv + 2 f) + 4 n  # the block input, matmul + attention outputs
    full:       r h                               # the block input only

``r`` is the residual stream's bytes: ``a`` where FSDP casts the parameters, 4 under
``torch.autocast`` (one rank, ZeRO-1's DDP): the embedding's output and every residual add
stay float32 there, only the matmuls and attention run in ``a`` (the 1B on one H200,
docs/planner.md#calibration).

The GPT layer of Korthikanti et al. (the playbook's figure) is :func:`gpt_activation_bytes`:
34 s b h + 5 a s^2 b bytes per layer in 16-bit. The Llama form drops the s^2 term (attention
scores are never stored), the dropout masks and the GELU input, and adds SwiGLU's gate.
Under TP the parts split by heads or FFN columns divide by tp, the norm parts only with SP,
and the all-gathered matmul inputs (2 h) and the row-wise matmuls' outputs (partial sums of
width h, saved by selective AC) never; under CP every part divides by cp and ring
attention keeps K/V un-expanded (a (2 h + 2 h_kv) instead of 4 a h). Ulysses (u ranks) saves
the head-sharded, whole-sequence q, k, v: as many bytes as the sequence shards, except that
kv heads per TP rank fewer than u are replicated up to u (h_kv x u tp / kv_heads).

A step has two candidate peaks, and a rank's figure is the larger (:func:`memory_per_pp_rank`):
the forward and backward (activations, the loss backward; gradients only where accumulation or
ZeRO-1's DDP keeps them, since the trainer zeroes them with ``set_to_none``) and the optimizer
step (every gradient and :func:`optimizer_step_bytes`). Checked against the 1B on one H200
(docs/planner.md#calibration: 27.91 GiB planned, 27.98 measured, the optimizer step's peak).

A pipeline rank's backward peak is found by replaying the simulated schedule (the same action lists
torch runs) stage by stage, see :func:`_pipeline_peak`: activations of the micro-batches in
flight, their receive buffers (titanext.schedules.follow_in_flight), FSDP's unsharded
gradient accumulators from a stage's first backward to its reduce-scatter, the sharded
gradients after it, and the transients of the backward running (AC's recompute of a block,
a split backward's weight-gradient inputs, or the loss backward). Every term was attributed
tensor by tensor in the dry run of the shipped configs (docs/dry_run.md).

>>> zero_bytes_per_rank(1e9, 8, 3) / 1e9       # ZeRO-3: 16 Psi / N
2.0
"""

from __future__ import annotations

from titanext.planning.closed_forms import gpt_activation_bytes, zero_bytes_per_rank
from titanext.planning.layout import Layout
from titanext.planning.moe import moe_activation_extra
from titanext.planning.muon import step_bytes
from titanext.planning.peak_replay import replay_peak
from titanext.planning.recompute import (
    backward_walk,
    drop_bytes,
    float8_storage_saving,
    mla_saved_bytes,
)
from titanext.planning.shapes import ModelShape
from titanext.planning.stages import events_by_rank
from titanext.planning.weight_grads import float8_not_kept, weight_grad_inputs

__all__ = ["activation_bytes_per_token_layer", "gpt_activation_bytes", "memory_per_pp_rank",
           "moment_bytes", "optimizer_step_bytes", "static_memory_floor", "zero_bytes_per_rank"]

#: the categories every moment of a step holds (a lower bound of any rank's peak)
#: the optimizer state's row: Adam / AdamW, or Muon's matrices with AdamW on the rest
OPTIMIZER_LABELS = {"AdamW": "optimizer (Adam)", "Adam": "optimizer (Adam)",
                    "Muon": "optimizer (Muon + AdamW)"}
_STATIC = ("params (fp32 master)", *dict.fromkeys(OPTIMIZER_LABELS.values()), "gathered params")


# -- activations ----------------------------------------------------------------------------------

def activation_bytes_per_token_layer(shape: ModelShape, mode: str, *, a: int, tp: int = 1,
                                     sp: bool = True, cp: int = 1, moe: bool = False,
                                     ulysses: int = 1, residual: int | None = None,
                                     modules: tuple[str, ...] = ()) -> float:
    """Saved activation bytes of one layer per token of the *whole* sequence (see module doc).

    ``moe``: a MoE block: the attention part (``f = 0``) plus the routed part of
    :func:`titanext.planning.moe.moe_activation_extra` (replicated over tp). ``ulysses``: CP's
    Ulysses degree (1: ring). ``residual``: bytes of the residual stream (``r``; ``a`` when
    None, 4 under autocast: :attr:`titanext.planning.layout.Layout.residual`). A block of
    multi-head latent attention without recompute, and ``mode = "modules"`` (what
    ``modules`` stop saving): :mod:`titanext.planning.recompute`."""
    r = a if residual is None else residual
    if mode == "modules":
        return (activation_bytes_per_token_layer(shape, "none", a=a, tp=tp, sp=sp, cp=cp,
                                                 moe=moe, ulysses=ulysses, residual=residual)
                - _block_terms(shape, a, tp, moe, modules) / cp)
    if mode == "none" and shape.mla[1]:
        heads, ffn, routed = _mla_block(shape, tp, moe)
        return (mla_saved_bytes(h=shape.dim, a=a, mla=shape.mla, heads=heads, ffn=ffn)
                + (moe_activation_extra(shape.moe, mode, dim=shape.dim, a=a) if routed else 0.0)
                ) / cp
    if moe:
        return (_activation_bytes(shape, mode, a=a, tp=tp, sp=sp, cp=cp, ffn=0, ulysses=ulysses,
                                  r=r)
                + moe_activation_extra(shape.moe, mode, dim=shape.dim, a=a) / cp)
    return _activation_bytes(shape, mode, a=a, tp=tp, sp=sp, cp=cp, ffn=shape.ffn,
                             ulysses=ulysses, r=r)


def _mla_block(shape: ModelShape, tp: int, moe: bool) -> tuple[float, float, bool]:
    """(attention heads per TP rank, the dense FFN's width per TP rank (0 in a MoE block),
    whether the block has routed experts)."""
    routed = moe and shape.moe is not None
    return shape.n_heads / tp, 0.0 if routed else shape.ffn / tp, routed


def _block_terms(shape: ModelShape, a: int, tp: int, moe: bool,
                 modules: tuple[str, ...]) -> float:
    """Bytes per token a block stops saving when ``modules`` are recomputed."""
    heads, ffn, routed = _mla_block(shape, tp, moe)
    m = shape.moe
    return drop_bytes(modules, h=shape.dim, a=a, mla=shape.mla, heads=heads, ffn=ffn,
                      moe=(m.top_k, m.hidden, m.shared_hidden) if routed else None)


def _activation_bytes(shape: ModelShape, mode: str, *, a: int, tp: int, sp: bool, cp: int,
                      ffn: int, ulysses: int = 1, r: int | None = None) -> float:
    h, hkv, f, n = shape.dim, shape.kv_dim, ffn, shape.n_heads
    r = a if r is None else r
    if cp > 1:  # Ulysses replicates kv heads up to u per TP rank (see the module doc)
        kv_heads = hkv * n // h
        hkv = hkv * max(1.0, ulysses * tp / kv_heads)
    if mode == "full":
        return r * h / (tp if sp else 1) / cp
    # q, k, v, out (ring: K/V unexpanded)
    attention = a * (2 * h + 2 * hkv) if cp > 1 else a * 4 * h
    if mode == "selective":
        # matmul and attention outputs: q, k, v, attention, w1, w3 (split by TP), and the
        # outputs of the row-wise matmuls wo and w2: partial sums of the whole width h before
        # TP's reduce(-scatter), never split (the 8B dry run at TP 2: 2 x 128 MiB per block)
        sharded = a * (2 * h + 2 * hkv + 2 * f) + 4 * n
        if cp > 1:  # the ring is not an SDPA op: its output is recomputed
            sharded -= a * h + 4 * n
        return (sharded / tp + a * 2 * h + r * h / (tp if sp else 1)) / cp
    sharded = attention + a * 4 * f + 4 * n
    norms = a * 4 * h + 8  # residual inputs and normalised values of the two norms, rstds
    matmul_inputs = a * 2 * h  # gathered under TP, so never divided by tp
    return (sharded / tp + norms / (tp if sp else 1) + matmul_inputs) / cp


# -- per pp rank ----------------------------------------------------------------------------------

def state_elements(lo: Layout, psi_dense: float, psi_experts: float, ranks: int) -> float:
    """Elements on one rank when ``ranks`` data-parallel ranks shard the state: the ep ranks
    already split the experts, the other ``ranks / ep`` shard them further."""
    return psi_dense / ranks + psi_experts / max(1, ranks // lo.ep)


def rank_params(lo: Layout, layer_ids, embedding: bool, head: bool) -> tuple[float, float, int]:
    """(dense, expert) parameters on one rank of these blocks (and the embedding or the head),
    after TP and EP, and their number of parameter tensors."""
    shape, moe, tp = lo.shape, lo.shape.moe, lo.tp
    n_m = len(moe.layer_ids.intersection(layer_ids)) if moe else 0
    n = len(layer_ids)
    dense = ((n - n_m) * (shape.layer_sharded / tp + shape.layer_replicated)
             + n_m * ((moe.sharded / tp + moe.replicated) if moe else 0)
             + (shape.embedding / tp if embedding else 0)
             + (shape.output / tp + shape.final_norm if head else 0))
    experts = n_m * moe.experts / lo.ep if moe else 0.0
    tensors = (n - n_m) * shape.layer_tensors + n_m * (moe.tensors if moe else 0) + embedding \
        + 2 * head
    if head and shape.mtp_layers:  # MTP modules after the head, and (PP) an embedding copy
        d, tp_moe = shape.mtp_layers, shape.mtp_moe and moe
        dense += d * ((moe.sharded / tp + moe.replicated) if tp_moe
                      else shape.layer_sharded / tp + shape.layer_replicated) \
            + d * (shape.mtp_extra + shape.mtp_eh_proj / tp)
        experts += d * moe.experts / lo.ep if tp_moe else 0.0
        tensors += d * ((moe.tensors if tp_moe else shape.layer_tensors) + 4)
        if lo.pp > 1 and not embedding:
            dense += shape.embedding / tp
            tensors += 1
    return dense, experts, tensors


def mtp_activation_bytes(lo: Layout, per_layer: float, per_moe_layer: float,
                         head_act: float) -> float:
    """Saved bytes of one micro-batch through the MTP modules: per module, one block's
    activations per token, the embedding and the two normed inputs of eh_proj (3 a h per token)
    and a second head's (its logits and loss)."""
    shape = lo.shape
    if not shape.mtp_layers:
        return 0.0
    block = per_moe_layer if shape.mtp_moe and shape.moe else per_layer
    return shape.mtp_layers * (lo.tokens_mb * (block + 3 * lo.a * shape.dim / lo.cp) + head_act)


def _two_level_saved(lo: Layout) -> float:
    """Bytes per token and MoE block that two-level dispatch saves beyond the flat one without
    AC: the route's indices and weights (16 per routed row). Its combine sums rows that the
    experts weighted already, and its sums keep only their indices, so no expert output is kept
    (before the weighted SwiGLU, 4 h more per routed row). AC recomputes them."""
    moe = lo.shape.moe
    if (moe is None or lo.ep == 1 or lo.ac not in ("none", "modules")
            or lo.recipe.ep_dispatch != "two_level"):
        return 0.0
    return moe.top_k * 16 / lo.cp


def _ddp(lo: Layout) -> bool:
    """ZeRO-1's DDP: its buckets keep a gradient copy of every parameter all step."""
    return lo.zero1 and lo.pp == 1


def moment_bytes(lo: Layout) -> int:
    """Bytes of one Adam moment per element: ``[optimizer] state_dtype``."""
    return 2 if lo.cfg.optimizer.state_dtype == "bfloat16" else 4


def _largest_state_tensor(lo: Layout) -> float:
    """Elements of the largest parameter tensor one rank's optimizer steps: the embedding or
    the head (split by tp), or one stacked expert weight (``num_experts / ep`` experts)."""
    shape, moe = lo.shape, lo.shape.moe
    largest = max(shape.embedding, shape.output) / lo.tp / max(1, lo.zero_n)
    if moe is not None:  # w1, w2, w3 stacked over the rank's experts
        largest = max(largest, moe.experts / 3 / lo.ep / max(1, lo.zero_n // lo.ep))
    return largest


def _muon_elements(lo: Layout, rk, psi_experts: float) -> float:
    """Muon elements a rank of pp rank ``rk`` holds: its blocks' matrices (routers counted)."""
    shape, moe, n_m = lo.shape, lo.shape.moe, lo.n_moe(rk)
    muon_dense = (len(rk.layer_ids) - n_m) * shape.layer_sharded / lo.tp + (
        n_m * moe.sharded / lo.tp if moe else 0.0)
    return state_elements(lo, muon_dense, psi_experts, lo.zero_n)


def optimizer_step_bytes(lo: Layout, psi_dense: float, psi_experts: float, rk=None) -> float:
    """Bytes the optimizer step allocates beside its state, freed when it returns.

    torch's foreach Adam/AdamW computes ``sqrt(v)`` of every element at once (one float32
    list the size of the optimizer's parameters: the 1B on one H200 peaks there, params +
    grads + two moments + this = 5 x 4 bytes per parameter, measured 1.00x); the for-loop
    one tensor at a time (the largest: the embedding or the head); the fused kernel none.
    With bf16 moments (``state_dtype``, :mod:`titanext.components.lowp_adam`) the step runs
    one tensor at a time whatever the implementation, on fp32 copies of its two moments
    beside the ``sqrt(v)`` temporary: 12 bytes per element of the largest tensor. With Muon
    (pp rank ``rk``), foreach AdamW's temporary covers the other parameters, and Muon's owner
    buffers are :func:`titanext.planning.muon.step_bytes`."""
    if lo.cfg.optimizer.name == "Muon" and rk is not None:
        muon = _muon_elements(lo, rk, psi_experts)
        rest = 0.0 if lo.cfg.optimizer.implementation != "foreach" else 4 * (
            state_elements(lo, psi_dense, psi_experts, lo.zero_n) - muon)
        return rest + step_bytes(lo, rk, muon)
    impl = lo.cfg.optimizer.implementation
    if moment_bytes(lo) != 4:
        return 12 * _largest_state_tensor(lo)
    if impl == "fused":
        return 0.0
    if impl == "for-loop":
        largest = max(lo.shape.embedding, lo.shape.output) / lo.tp
        return 4 * largest / max(1, lo.zero_n)
    return 4 * state_elements(lo, psi_dense, psi_experts, lo.zero_n)


MOMENTS = ("peak", "backward", "optimizer step")


def _later_peak(at_backward: dict[str, float], at_step: dict[str, float],
                moment: str = "peak") -> dict[str, float]:
    """One of two moments of a step, by category: ``at_backward`` (the peak found in the
    forward and backward) or the optimizer step, where every gradient is there, the
    activations are freed and ``at_step`` overrides what differs; ``moment="peak"``: the
    larger."""
    step = {k: (0.0 if k not in _STATIC else v) for k, v in at_backward.items()}
    step.update(at_step)
    if moment == "peak":
        return step if sum(step.values()) > sum(at_backward.values()) else at_backward
    return step if moment == "optimizer step" else at_backward


def _model_state(lo: Layout, rk, sharded: bool) -> tuple[dict[str, float], float, float, float]:
    """(bytes of a pp rank's parameters, gradients, optimizer state, gathered units and hosted
    expert copies; its dense and expert parameters; the state elements it holds)."""
    shape, moe, tp, a = lo.shape, lo.shape.moe, lo.tp, lo.a
    n_m = lo.n_moe(rk)
    psi_dense, psi_experts, tensors = rank_params(lo, rk.layer_ids, rk.embedding, rk.head)
    state = state_elements(lo, psi_dense, psi_experts, lo.n_fsdp if sharded else 1)
    mem = {"params (fp32 master)": 4 * state, "grads (fp32)": 4 * state,
           # two moments per element (fp32, or bf16 with [optimizer] state_dtype), and a
           # 4-byte step per parameter tensor
           "optimizer": 2 * moment_bytes(lo)
           * state_elements(lo, psi_dense, psi_experts, lo.zero_n) + 4 * tensors}
    if lo.cfg.optimizer.name == "Muon":  # one fp32 momentum buffer per Muon matrix, no step
        mem["optimizer"] -= 4 * _muon_elements(lo, rk, psi_experts)
    mem[OPTIMIZER_LABELS[lo.cfg.optimizer.name]] = mem.pop("optimizer")
    if sharded and lo.n_fsdp > 1:  # gathered units: two in flight, or all without resharding
        dense_unit, moe_unit = lo.gathered_by_kind
        mem["gathered params"] = (lo.gathered_layer * 2 if lo.reshard
                                  else dense_unit * (rk.layers - n_m) + moe_unit * n_m)
        if not lo.reshard:  # the embedding, the head and the MTP modules stay gathered too
            mtp = shape.mtp_layers * (moe_unit if shape.mtp_moe else dense_unit) + a * (
                shape.mtp_layers * (shape.mtp_extra + shape.mtp_eh_proj / tp))
            mem["gathered params"] += a * ((shape.embedding / tp if rk.embedding else 0)
                                           + (shape.output / tp if rk.head else 0)) + (
                mtp if rk.head else 0)
    else:
        mem["gathered params"] = 0.0
    copies = lo.recipe.expert_replicas if moe else 0
    if copies and n_m:  # the step's hosted copies: weights and fp32 gradient sums, held
        # from the first forward to the last backward (expert_replication.copies_per_step)
        mem["expert copies (step)"] = n_m * copies * moe.experts / moe.num_experts * (a + 4)
    return mem, psi_dense, psi_experts, state


def memory_per_pp_rank(lo: Layout, in_flight: list[int], events=None, *, moment: str = "peak",
                       program=None) -> tuple[list[dict[str, float]], list[tuple[float, float]]]:
    """(bytes by category, (dense, expert) parameters) of each pp rank at its peak.

    Two moments compete: the forward and backward (activations, the loss backward; the
    gradients only where accumulation or DDP keeps them from the start) and the optimizer
    step (every gradient and :func:`optimizer_step_bytes`, no activations); ``moment``
    (``"backward"`` or ``"optimizer step"``) picks one instead of the larger.

    ``in_flight``: micro-batches whose activations a pp rank holds at its peak (the schedule's);
    ``events``: the simulated schedule (:class:`titanext.schedules.simulator.Event` list), from
    which a pipeline rank's peak is found by replaying its memory (:func:`_pipeline_peak`;
    without it, every term at its own maximum); ``program``: the simulation's
    ``SimResult.program``, if known (the same figures, sooner:
    :func:`~titanext.planning.stages.events_by_rank`).
    """
    if moment not in MOMENTS:
        raise ValueError(f"moment = {moment!r}; allowed: {', '.join(MOMENTS)}")
    shape, tp, a = lo.shape, lo.tp, lo.a
    per_layer, per_moe_layer = saved_bytes_per_token(lo)
    full = _full_blocks_saved(lo)
    head_act = lo.tokens * (a * 3 * shape.dim / (tp if lo.sp else 1) + 4 * shape.vocab / tp + 16)
    if lo.autocast:  # the head is not a checkpointed block: its matmul keeps autocast's
        head_act += a * shape.output / tp  # 16-bit copy of the weight for its backward
    # The loss's backward, on top of the saved activations (whose head part holds log_softmax's
    # float32 output, 4 per entry), per token and local vocabulary entry: the logits the train
    # step still holds (a) and float32 gradients: nll_loss's (dense) and the logits' that
    # log_softmax's backward writes in one kernel (8: the dry run's "Temp" of that moment, and
    # the 1B at 2 x 8192 on an H200 peaks there at 1.01x this, docs/planner.md#calibration).
    # Under TP's loss_parallel, torch's sharded nll_loss backward computes both at once from
    # zeros, exp(input) and their sum (12: three float32 tensors alive, the 8B's dry run).
    loss_parallel = lo.recipe.loss_parallel_on(lo)
    loss_backward = lo.tokens * (a + (12 if loss_parallel else 8)) * shape.vocab / tp
    sharded = lo.fsdp
    memories, psis = [], []
    # each rank's events in execution order, and its receive buffers
    by_rank, recv = events_by_rank(events or (), program)
    split = any(e.kind == "W" for e in events or ())  # a split backward: its Ws on their own
    for r, rk in enumerate(lo.pipe.ranks):
        mem, psi_dense, psi_experts, state = _model_state(lo, rk, sharded)
        if lo.pp > 1 and events is not None:
            grads = mem["grads (fp32)"]
            mem.update(_pipeline_peak(lo, r, rk, split, by_rank, recv, sharded=sharded,
                                      grads=grads, per_layer=per_layer,
                                      per_moe_layer=per_moe_layer, head_act=head_act,
                                      loss_backward=loss_backward, full=full))
            mem["optimizer step"] = 0.0
            mem = _later_peak(mem, {"grads (fp32)": grads,  # torch's stage buffers stay
                                    "pipeline buffers": mem["pipeline buffers"],
                                    "optimizer step": optimizer_step_bytes(lo, psi_dense,
                                                                           psi_experts, rk)},
                              moment)
        else:
            if sharded and lo.pp > 1:
                mem["unsharded grads (pp)"] = lo.reduce_bytes * (psi_dense + psi_experts)
            stages = len(rk.stages)
            mem["activations"] = (in_flight[r] * lo.tokens_mb / stages
                                  * sum(_over_blocks(lo, ids, per_layer, per_moe_layer, full)
                                        for ids in rk.stage_layer_ids)
                                  + (head_act + mtp_activation_bytes(lo, per_layer, per_moe_layer,
                                                                     head_act)
                                     if rk.head else 0.0))
            mem["loss backward"] = loss_backward if rk.head else 0.0
            # the loss backward, or a block's recompute beside what the blocks before it saved
            # (one stage: the blocks' backward walked, last first), whichever is larger
            ids, moe = sorted(rk.layer_ids), lo.shape.moe
            reruns = [x for s_ids in rk.stage_layer_ids for x in _reruns(lo, s_ids)]
            held = [in_flight[r] * lo.tokens_mb * (full if full and i in lo.full_ac_ids(ids) else (
                per_layer, per_moe_layer))[bool(moe) and i in moe.layer_ids] for i in ids]
            walk = (backward_walk(held, reruns) if lo.pp == 1
                    else mem["activations"] + max(reruns, default=0.0))
            if walk > mem["activations"] + mem["loss backward"]:
                mem["loss backward"], mem["backward transients"] = 0.0, walk - mem["activations"]
            mem["optimizer step"] = 0.0
            # zero_grad(set_to_none=True): the backward starts without gradients, unless an
            # earlier micro-batch left them (accumulation) or DDP's buckets hold them (ZeRO-1)
            if lo.accum == 1 and not _ddp(lo):
                mem["grads (fp32)"] = 0.0
            mem = _later_peak(mem, {"grads (fp32)": 4 * state,
                                    "optimizer step": optimizer_step_bytes(lo, psi_dense,
                                                                           psi_experts, rk)},
                              moment)
        memories.append(mem)
        psis.append((psi_dense, psi_experts))
    return memories, psis


def saved_bytes_per_token(lo: Layout) -> tuple[float, float]:
    """Saved activation bytes per token of one dense block and of one MoE block (0 without
    MoE) under ``lo``'s recompute, TP, SP, CP and dispatch."""
    shape, modules = lo.shape, lo.recipe.recompute_modules
    per_layer = activation_bytes_per_token_layer(shape, lo.ac, a=lo.a, tp=lo.tp, sp=lo.sp,
                                                 cp=lo.cp, ulysses=lo.ulysses,
                                                 residual=lo.residual, modules=modules)
    per_moe_layer = (activation_bytes_per_token_layer(shape, lo.ac, a=lo.a, tp=lo.tp, sp=lo.sp,
                                                      cp=lo.cp, moe=True, ulysses=lo.ulysses,
                                                      residual=lo.residual, modules=modules)
                     + lo.kept_all_to_all_per_token + _two_level_saved(lo)
                     - _float8_stored(lo, moe=True) if shape.moe else 0.0)
    per_layer -= _float8_stored(lo, moe=False)
    return per_layer, per_moe_layer


def _full_blocks_saved(lo: Layout) -> tuple[float, float] | None:
    """Saved bytes per token of a dense and of a MoE block that ``[activation_checkpoint]
    full_blocks`` fully checkpoints under ``mode = "modules"`` (None: no such block)."""
    if lo.ac != "modules" or not any(lo.full_ac_ids(ids) for rk in lo.pipe.ranks
                                     for ids in rk.stage_layer_ids):
        return None
    return saved_bytes_per_token(lo.with_full_ac())


def _float8_stored(lo: Layout, *, moe: bool) -> float:
    """Bytes per token a dense or MoE block stops saving with ``float8_storage``."""
    shape = lo.shape
    wo_in = (shape.n_heads * shape.mla[4] if shape.mla[1] else shape.dim) / lo.tp
    routed = moe and shape.moe
    return float8_storage_saving(lo.recipe.float8_storage, a=lo.a, wo_in=wo_in, h=shape.dim,
                                 top_k=shape.moe.top_k if routed else 0,
                                 expert_hidden=shape.moe.hidden if routed else 0) / lo.cp


def static_memory_floor(lo: Layout) -> float:
    """A lower bound of the busiest pp rank's peak, without simulating the schedule (the
    planner's advice drops a layout whose floor does not fit before timing it): the parameters,
    optimizer state and gathered parameters that every moment of its step holds, and the
    activations its most micro-batches in flight at once save (the rank's own action order
    fixes that count whatever the costs, :func:`titanext.schedules.forwards_in_flight`; one
    without a pipeline, or where the order follows measured costs), each in the rank's
    lightest stage. Of the 671B's advice candidates, this drops most that do not fit before
    their schedule is simulated."""
    # the planner loads without torch and the training runtime until it needs them
    from titanext.schedules import forwards_in_flight

    # the static terms are _model_state's at every moment (memory_per_pp_rank changes others)
    statics = [_model_state(lo, rk, lo.fsdp)[0] for rk in lo.pipe.ranks]
    saved = (*saved_bytes_per_token(lo), _full_blocks_saved(lo))
    pipe = lo.pipe
    counts = (forwards_in_flight(pipe.schedule, pp=pipe.pp, microbatches=pipe.microbatches,
                                 stages_per_rank=pipe.stages_per_rank)
              if lo.pp > 1 else None) or (1,) * lo.pp
    return max(sum(m.get(k, 0.0) for k in _STATIC) + max(1, n) * lo.tokens_mb
               * min(_over_blocks(lo, ids, *saved) for ids in rk.stage_layer_ids)
               for m, rk, n in zip(statics, pipe.ranks, counts, strict=True))


def _over_blocks(lo: Layout, layer_ids, dense: float, moe: float,
                 full: tuple[float, float] | None = None) -> float:
    """``dense`` per dense block plus ``moe`` per MoE block, over the blocks ``layer_ids`` of one
    stage; those ``full_blocks`` fully checkpoints at ``full``'s (dense, moe) instead."""
    if full is not None:
        whole = lo.full_ac_ids(layer_ids)
        return (_over_blocks(lo, set(layer_ids) - whole, dense, moe)
                + _over_blocks(lo, whole, *full))
    n_m = len(lo.shape.moe.layer_ids.intersection(layer_ids)) if lo.shape.moe else 0
    return (len(layer_ids) - n_m) * dense + n_m * moe


def _pipeline_peak(lo: Layout, r: int, rk, split: bool, by_rank, recv, *, sharded: bool,
                   grads: float, per_layer: float, per_moe_layer: float, head_act: float,
                   loss_backward: float, full: tuple[float, float] | None = None
                   ) -> dict[str, float]:
    """The step's memory peak of pipeline rank ``r``, replaying its actions in the order the
    trainer runs them (``by_rank``, ``recv``: :func:`titanext.planning.stages.events_by_rank`
    of the simulation, :func:`titanext.planning.stages.simulate_times`; ``split``: it has Ws).

    Per stage ``s`` of the rank (``m`` micro-batches, ``T`` tokens of one):

    - **activations**: each micro-batch between its F and its backward holds
      ``T x (the blocks' saved bytes + the stage output (a h / tp_sp) [+ the head's])``; under
      a split backward it then holds what :mod:`~titanext.planning.weight_grads` counts of
      every block from its I to its W (the 70B's rank 0 runs W right after I: +4.1 GiB at I,
      -5.1 GiB at W; its middle ranks defer seven Ws to the cooldown and peak at 79 GiB there);
    - **backward transients**: a full backward (B) under full AC recomputes one block (its
      saved bytes without AC);
    - **pipeline buffers**: receive buffers (``T a h / tp_sp`` each) of the micro-batches in
      flight (:func:`titanext.schedules.follow_in_flight`): a micro-batch's input activation
      from another rank is held from its sender's F to this stage's I or B, its output
      gradient from its sender's I or B to the same point (one from this rank is the sender's
      tensor, counted there); torch alone would hold ``2 m`` of them per stage all step;
    - **unsharded grads (pp)**: PP x FSDP accumulates the stage's unsharded gradients in the
      reduce dtype (``reduce_bytes`` a parameter, from the stage's first backward to its one
      reduce-scatter after its last); torch's split W (``"autograd"``) writes the stage's
      param-dtype gradients all at once before
      :class:`~titanext.plugins.weight_grad.AutogradSplitStage` folds them (``a`` more, counted
      here from the first backward: an upper bound, since 2026-11-29 they live only to the end
      of each W); a deferred W folds each one as it goes;
    - **grads (fp32)**: the sharded gradients appear at the stage's reduce-scatter (held all
      step by a step with gradient accumulation); without FSDP the gradients accumulate in
      place from the stage's first backward;
    - **loss backward**: the last stage's backward first runs the loss backward, whose
      transients are freed before the blocks' backward starts.

    Measured against the dry run (docs/dry_run.md): the 405B's rank 0 (Interleaved1F1B) peaks
    in its later stage's second backward, the 70B's (ZBV) in a W, the middle ranks of ZBV and
    DualPipe in the cooldown where the deferred Ws' inputs pile up.
    """
    boundary = lo.tokens_mb * lo.a * lo.shape.dim / (lo.tp if lo.sp else 1) / lo.cp
    per_stage = _stage_terms(lo, rk, split=split, sharded=sharded, grads=grads,
                             per_layer=per_layer, per_moe_layer=per_moe_layer,
                             head_act=head_act, loss_backward=loss_backward, boundary=boundary,
                             full=full)
    posts, frees = recv(r, rk.stages)  # its receive buffers (recv_intervals)
    return replay_peak(lo, rk, by_rank.get(r, ()), per_stage, posts, frees,
                        sharded=sharded, boundary=boundary)


def _stage_terms(lo: Layout, rk, *, split: bool, sharded: bool, grads: float, per_layer: float,
                 per_moe_layer: float, head_act: float, loss_backward: float, boundary: float,
                 full: tuple[float, float] | None = None) -> tuple[dict, ...]:
    """Per stage of pp rank ``rk`` (see :func:`_pipeline_peak`): a micro-batch's activations
    between F and backward, its weight-gradient inputs between I and W, the unsharded
    gradient accumulators, the sharded gradients, and the backward transients (recompute,
    loss backward)."""
    shape, moe, a = lo.shape, lo.shape.moe, lo.a
    last_stage = max(s for k in lo.pipe.ranks for s in k.stages)
    # float8 linears compute their dW at I: they keep nothing to W
    wgrad_dense = (weight_grad_inputs(lo, shape.ffn)
                   - float8_not_kept(lo.linears, a=a, tp=lo.tp, cp=lo.cp))
    # a MoE block: its attention and shared experts like a dense block's, and per routed row
    # (k per token, replicated over tp) the experts' inputs and output gradients (2 h) and
    # the SwiGLU product and two hidden gradients (3 f_e): the DeepSeek-V3 dry run's index_select
    # / index_add rows of [k T, h] per block and micro-batch; none where float8 kernels
    # compute the experts' dW at I (Layout.experts_defer)
    routed_rows = (a * moe.top_k * (2 * shape.dim + 3 * moe.hidden) / lo.cp
                   if moe and lo.experts_defer else 0.0)
    wgrad_moe = (weight_grad_inputs(lo, moe.shared_hidden)
                 - float8_not_kept(lo.moe_linears, a=a, tp=lo.tp, cp=lo.cp)
                 + routed_rows) if moe else 0.0
    mtp_act = mtp_activation_bytes(lo, per_layer, per_moe_layer, head_act)
    act, wact, acc, grad, transient = {}, {}, {}, {}, {}
    psi_rank = sum(rank_params(lo, rk.layer_ids, rk.embedding, rk.head)[:2])
    leaves = split and lo.job.pipeline.split_backward != "deferred"  # see _pipeline_peak
    for s, ids in zip(rk.stages, rk.stage_layer_ids):
        act[s] = (lo.tokens_mb * _over_blocks(lo, ids, per_layer, per_moe_layer, full) + boundary
                  + (head_act + mtp_act if s == last_stage else 0.0))
        wact[s] = lo.tokens_mb * _over_blocks(lo, ids, wgrad_dense, wgrad_moe)
        psi = sum(rank_params(lo, ids, s == 0, s == last_stage)[:2])
        acc[s] = ((lo.reduce_bytes if lo.reduce_bytes != a else 0) + (a if leaves else 0)) * psi \
            if sharded else 0.0
        grad[s] = grads * psi / psi_rank if psi_rank else 0.0
        transient[s] = (max(_reruns(lo, ids), default=0.0),
                        loss_backward if s == last_stage else 0.0)
    return act, wact, acc, grad, transient


def _reruns(lo: Layout, ids) -> list[float]:
    """Each block's recompute among a stage's blocks ``ids`` (in order), alive in its backward:
    a fully checkpointed one's activations, or the regions of one by module."""
    shape, moe, whole, tokens = lo.shape, lo.shape.moe, lo.full_ac_ids(ids), lo.tokens_mb
    modules = lo.recipe.recompute_modules if lo.ac == "modules" else ()
    kw = dict(a=lo.a, tp=lo.tp, sp=lo.sp, cp=lo.cp, ulysses=lo.ulysses)
    return [tokens * activation_bytes_per_token_layer(shape, "none", moe=routed, **kw)
            if block in whole else tokens / lo.cp * _block_terms(shape, lo.a, lo.tp, routed,
                                                                 modules) if modules else 0.0
            for block in sorted(ids) for routed in [bool(moe) and block in moe.layer_ids]]
