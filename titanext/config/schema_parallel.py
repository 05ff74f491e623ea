"""The config sections of how the job runs: ``[parallelism]``, ``[activation_checkpoint]``,
``[compile]``, ``[float8]`` and ``[moe]``, each a documented dataclass (the rest of the schema,
and :class:`~titanext.config.schema.JobConfig` holding them all, is
:mod:`titanext.config.schema`; its conventions hold here).

>>> Parallelism().context_parallel_load_balance
'zigzag'
"""

from __future__ import annotations

from dataclasses import dataclass

from titanext._text import did_you_mean as _did_you_mean
from titanext.config._fields import _field, _minus_one_or_positive
from titanext.config.field_rules import _ac_option, _aten_ops, _pp_schedule
from titanext.plugins.expert_parallel.rules import EP_DISPATCH_MODES
from titanext.plugins.rules import (
    DEFAULT_SAVE_OPS,
    FLOAT8_EXPERT_RECIPES,
    FLOAT8_RECIPES,
    FLOAT8_STORAGE,
    RECOMPUTE_MODULES,
)

__all__ = ["ActivationCheckpoint", "Compile", "Float8", "MoEConfig", "Parallelism"]


_COMPILE_COMPONENTS = ("model", "loss")


def _counts(value: int | list[int]) -> str | None:
    """A check for an integer >= 0 or a list of them."""
    if any(v < 0 for v in (value if isinstance(value, list) else [value])):
        return "an integer >= 0 or a list of them, one per pipeline stage"
    return None


def _any_of(allowed: tuple[str, ...]):
    """A check for a list whose every entry is one of ``allowed``."""
    def check(names: list[str]) -> str | None:
        for name in names:
            if name not in allowed:
                return (f"any of {', '.join(map(repr, allowed))}; {name!r} is not one of them"
                        f"{_did_you_mean(name, allowed, fallback=False)}")
        return None
    return check


def _no_async_tp(value: bool) -> str | None:
    return (None if value is False else "false (async TP needs CUDA symmetric memory and "
            "torch.compile, which titanext cannot test; use plain TP)")


@dataclass
class Parallelism:
    data_parallel_replicate_degree: int = _field(1, ge=1)
    """Replicas of the model (DDP-style; with FSDP this is HSDP's replicate dimension)."""
    data_parallel_shard_degree: int = _field(-1, check=_minus_one_or_positive,
                                             rule="-1 or >= 1")
    """Ranks that shard parameters (FSDP); -1 means the rest of the world size after the other
    degrees."""
    fsdp_reshard_after_forward: str = _field("default", choices=("default", "always", "never"))
    """Free gathered parameters after forward: default = yes, except with pipeline parallelism
    (where each micro-batch would gather them again)."""
    zero_stage: int = _field(3, choices=(1, 2, 3))
    """ZeRO stage: 1 = replicated params (DDP) + sharded optimizer state, 2 = FSDP without
    resharding after forward, 3 = full FSDP."""
    tensor_parallel_degree: int = _field(1, ge=1)
    """Ranks that split each layer's matmuls (Megatron-style TP); keep it inside a node."""
    enable_sequence_parallel: bool = _field(True)
    """With TP, shard norms and residual activations along the sequence (SP)."""
    enable_loss_parallel: bool = _field(True)
    """With TP, keep logits sharded over the vocabulary and compute the loss in parallel."""
    enable_async_tensor_parallel: bool = _field(False, check=_no_async_tp, rule="false")
    """Async TP (torch's micro-pipelined all-gather matmuls) is not offered: it needs CUDA
    symmetric memory and torch.compile, which no test here can check; true is refused at load.
    Accepted as false so torchtitan configs read unchanged (docs/torchtitan.md)."""
    context_parallel_degree: int = _field(1, ge=1)
    """Ranks that split each sequence (context parallelism with exact ring attention, see
    titanext.plugins.context_parallel). CP ranks also shard parameters: FSDP runs over
    dp_shard x cp."""
    context_parallel_load_balance: str = _field("zigzag", choices=("zigzag", "contiguous"),
                                                aliases={"none": "contiguous"})
    """How CP splits a sequence: zigzag (rank r of W holds chunks r and 2W-1-r of 2W, so causal
    attention costs every rank the same) or contiguous (rank r holds slice r; the last rank does
    the most work). These are the `layout` names of titanext.plugins.context_parallel; 'none'
    (no load balancing) is accepted as another name for contiguous and read as 'contiguous'."""
    context_parallel_comm: str = _field("p2p", choices=("p2p", "allgather", "alltoall"))
    """How CP moves keys and values: p2p (a ring of send/recv overlapped with compute; memory of
    two KV blocks), allgather (one all-gather forward and one reduce-scatter of their
    gradients backward; memory of the whole sequence's KV, fewer and larger messages) or
    alltoall (pure Ulysses: all-to-alls swap the sequence split for a head split, and every rank
    attends the whole sequence for heads / cp heads; context_parallel_ulysses_degree = cp)."""
    context_parallel_ulysses_degree: int = _field(1, ge=1)
    """Ulysses ranks inside CP (u): cp = u x r runs Ulysses (all-to-all, head split) inside
    groups of u ranks and the context_parallel_comm ring (p2p or allgather) across the r = cp / u
    groups (hybrid, USP-style; keep the u ranks in a node). 1 = ring only; cp = pure Ulysses.
    u must divide context_parallel_degree, and the heads per TP rank must divide by u; the kv
    heads per TP rank must be a multiple of u or divide it (they are then replicated)."""
    pipeline_parallel_degree: int = _field(1, ge=1)
    """Ranks the pipeline spans (pp); each holds pipeline_parallel_stages_per_rank stages."""
    pipeline_parallel_schedule: str = _field("1F1B", check=_pp_schedule,
                                             rule="a name from titanext.schedules")
    """Pipeline schedule: torch's (GPipe, 1F1B, Interleaved1F1B, LoopedBFS,
    InterleavedZeroBubble, ZBVZeroBubble) or titanext's (ZBH1, ZBH2, ZBV, Auto, ...). Auto
    measures F, I and W on the first step, then runs the schedule generated for those costs."""
    pipeline_parallel_split_backward: str = _field("deferred", choices=("deferred", "autograd"))
    """How schedules that split the backward into I (input gradient) and W (weight gradient)
    compute them: 'deferred' runs one plain backward for I in which every linear (and MoE
    expert GEMM) queues its weight-gradient GEMM, and W runs the queue
    (titanext.plugins.weight_grad); 'autograd' is torch's stage_backward_input /
    stage_backward_weight pair (walks the graph twice and keeps it alive until W; rejected with
    compile). No effect on schedules without I/W actions (1F1B, GPipe, Interleaved1F1B)."""
    pipeline_parallel_max_pending_weight_grads: int = _field(0, ge=0)
    """Memory cap of the zero-bubble and DualPipe schedules (ZBH1, ZBH2, ZBV, Auto, DualPipe,
    DualPipeV): at most this many micro-batches per rank keep the inputs of a deferred weight
    gradient W (every matmul's input and output gradient) at once; before an input-gradient
    step I that would exceed it, the oldest pending W runs first (titanext.schedules.memory_cap).
    Saves those inputs on the ranks that defer many W's (the middle ranks' cool-down) at the
    cost of pipeline bubble; 0 = no cap."""
    pipeline_parallel_microbatches: int = _field(-1, check=_minus_one_or_positive,
                                                 rule="-1 or >= 1")
    """Micro-batches per pipeline step (local_batch_size must be divisible by it); -1 means
    2 x pipeline_parallel_degree, capped at local_batch_size."""
    pipeline_parallel_stages_per_rank: int = _field(-1, check=_minus_one_or_positive,
                                                    rule="-1 or >= 1")
    """Stages each pp rank holds; -1 = the schedule's own (1 for 1F1B/ZBH1/ZBH2, 2 for ZBV
    and the V schedules, 2 for torch's interleaved schedules, which accept any count >= 2)."""
    pipeline_parallel_first_stage_less_layers: int = _field(0, ge=0)
    """How many fewer transformer blocks the first stage holds than the others (it also runs
    the embedding)."""
    pipeline_parallel_last_stage_less_layers: int = _field(0, ge=0)
    """How many fewer transformer blocks the last stage holds than the others (it also runs
    the norm, the output head and the loss)."""
    pipeline_parallel_layers_per_stage: list[int] = _field([])
    """Explicit blocks per stage, one entry per stage in stage order (overrides the two
    *_less_layers keys); empty = split evenly."""
    expert_parallel_degree: int = _field(1, ge=1)
    """Ranks that split the experts of MoE layers, borrowed from dp_shard x cp (tokens go to
    their experts by all-to-all). Needs a MoE flavor and FSDP (zero_stage 2 or 3); must divide
    moe.num_experts and dp_shard x cp, and be a multiple of context_parallel_degree."""

    check_replicated_grads_steps: int = _field(2, ge=0)
    """Before each of the first this many optimizer steps, check that every parameter replicated
    over tp or cp (or, under ZeRO-1, the data-parallel ranks) has the same gradient on all of
    them, and stop naming the parameter, the dim and the difference if not (a replicated weight
    inside a tensor-parallel region without a TP rule, say). One small all-reduce per dim, in
    the checked steps only; 0 = off (titanext.plugins.replicated_grads)."""
    expert_parallel_comm_overlap: bool = _field(False)
    """Hide the expert-parallel all-to-alls of one micro-batch behind another's compute: the
    paired forward and backward chunks of DualPipe, DualPipeV, 1F1B and Interleaved1F1B (their
    steady state) run interleaved, each side's dispatch and combine in flight while the other
    side computes. Results are bitwise those of the run without it. Needs
    expert_parallel_degree > 1 and pipeline_parallel_degree > 1 with one of those schedules
    (1F1B: one more micro-batch in flight per rank, and more than pp micro-batches)."""
    expert_parallel_dispatch: str = _field("flat", choices=EP_DISPATCH_MODES)
    """How tokens reach their experts: 'flat' sends every (token, expert) row on its own;
    'two_level' (DeepSeek-V3's node-limited dispatch) sends each token once to every node that
    holds one of its experts, then to the experts inside it, and sums each node's weighted
    expert outputs there before they cross back, so a token crosses the network at most
    moe.num_limited_groups times (one expert group or more per node). Needs
    expert_parallel_ranks_per_node; same results as 'flat'."""
    expert_parallel_ranks_per_node: int = _field(0, ge=0)
    """Consecutive ep ranks that share a node (NVLink): GPUs per node / tensor_parallel_degree
    when ep is laid out inside nodes first. Needed by expert_parallel_dispatch = 'two_level'
    (a divisor of expert_parallel_degree below it); with 'flat' it only splits the EP traffic
    counters into inter- and intra-node bytes. 0 = unknown."""
    expert_parallel_float8_dispatch: bool = _field(False)
    """Send the dispatched token rows as float8 e4m3 with one power-of-two scale per 1 x 128
    block (dim + dim / 128 bytes a row instead of 2 x dim in bf16); the combine and every
    gradient stay in the activations' dtype. Within float8 error of the bf16 dispatch. Needs
    expert_parallel_degree > 1."""


_DEFAULT_SAVE_OPS = list(DEFAULT_SAVE_OPS)  # titanext.plugins.rules owns the list


@dataclass
class ActivationCheckpoint:
    mode: str = _field("none", choices=("none", "selective", "full", "modules"))
    """Recompute activations in backward: none, selective (see selective_ac_option), full
    (every transformer block) or modules (only the parts of each block named in
    recompute_modules; everything else is saved)."""
    selective_ac_option: str = _field("op", check=_ac_option, rule="'op' or a positive integer")
    """For selective mode: 'op' (save the outputs of selective_op_save_list, recompute the
    rest) or a positive integer n written as a string (fully checkpoint every n-th block)."""
    selective_op_save_list: list[str] = _field(_DEFAULT_SAVE_OPS, check=_aten_ops,
                                               rule="names of torch.ops.aten ops")
    """aten op names whose outputs op-level selective AC keeps (matmuls and attention by
    default: expensive to recompute, cheap to store)."""
    keep_all_to_all: bool = _field(False)
    """Recompute without re-dispatch, for blocks that are fully checkpointed (mode = 'full', a
    layer-level selective_ac_option, or full_blocks with mode = 'modules'): also keep what
    their expert-parallel collectives received (dispatched token rows, expert outputs before
    the combine, split sizes) and replay it in the recompute, so no all-to-all runs twice (4
    per MoE layer and micro-batch instead of 6), for about 2 x top_k x dim more saved values
    per token and MoE layer."""
    recompute_modules: list[str] = _field([], check=_any_of(RECOMPUTE_MODULES),
                                          rule="any of " + ", ".join(map(repr, RECOMPUTE_MODULES)))
    """With mode = 'modules': the parts of each block recomputed in backward (Megatron-Core's
    names): layernorm (the block's norms), mla_up_proj (MLA's q/kv up-projections with their
    norms and RoPE: q, k, v recomputed), core_attn (scores, softmax, SDPA), moe_act (the
    experts' weighted SwiGLU: its input kept, its output recomputed), mlp (a dense block's
    feed-forward), shared_experts. Each must exist
    in the model. Empty: DeepSeek-V3's choice, layernorm + mla_up_proj + moe_act, of those the
    model has. No all-to-all runs twice; losses and gradients are bitwise those of mode =
    'none'."""
    full_blocks: int | list[int] = _field(0, check=_counts, rule="an integer >= 0 or a list of "
                                          "them, one per pipeline stage")
    """With mode = 'modules': the first full_blocks transformer blocks of each pipeline stage
    (of the model without pipeline parallelism) are fully checkpointed instead (with
    keep_all_to_all as under mode = 'full'), the rest recompute only recompute_modules
    (Megatron-Core's recompute_method = 'block' with recompute_num_layers). A list gives each
    stage its own count, in stage order (DualPipe: a stage's two copies share its entry), as
    a pipeline's stages hold different micro-batches in flight. More full blocks: less memory,
    slower; titanext-plan prints both. 0 = none; float8_storage applies to the other blocks.
    Losses and gradients are bitwise those of mode = 'none'."""
    float8_storage: list[str] = _field([], check=_any_of(FLOAT8_STORAGE),
                                       rule="any of " + ", ".join(map(repr, FLOAT8_STORAGE)))
    """Tensors saved for the backward in float8 e4m3 with one power-of-two scale per 1 x 128
    block (DeepSeek-V3's activation caching), dequantized in the backward:
    expert_up_proj_input (the dispatched rows feeding the routed experts' up-projections),
    attention_out_input (the input of the linear after attention, wo) and expert_act_input (the
    routed experts' SwiGLU inputs, w1 and w3 outputs). About half the bytes of bf16; with float8
    linears and experts too. Weight gradients change within the measured float8 error (and with
    expert_act_input the gradients upstream of SwiGLU: docs/deepseek_v3.md)."""


@dataclass
class Compile:
    enable: bool = _field(False)
    """torch.compile each transformer block (and the loss, see components)."""
    components: list[str] = _field(["model"], check=_any_of(_COMPILE_COMPONENTS),
                                   rule="any of 'model', 'loss'")
    """What to compile: any of model, loss."""
    backend: str = _field("inductor", choices=("inductor", "aot_eager", "eager"))
    """torch.compile backend; aot_eager and eager help to tell compiler bugs from model bugs."""


def _emulate(value: bool | str) -> str | None:
    return None if isinstance(value, bool) or value == "auto" else "true, false or 'auto'"


@dataclass
class Float8:
    enable: bool = _field(False)
    """Train the model's linear layers in float8 (torchao float8 linears; see
    titanext.plugins.float8). Converted on the meta model before any parallelism."""
    recipe: str = _field("tensorwise", choices=FLOAT8_RECIPES)
    """Scaling recipe: tensorwise (one scale per tensor; fastest), rowwise (one per row),
    rowwise_with_gw_hp (rowwise, weight gradient in high precision) or blockwise
    (DeepSeek-V3: 1x128 activation tiles, 128x128 weight blocks)."""
    filter_fqns: list[str] = _field(["output"])
    """Module names kept in high precision: an entry matches that FQN, FQNs ending in
    '.entry', modules under it, or a glob. Linears with a dimension not divisible by 16 are
    always kept."""
    auto_filter: bool | str = _field("auto", check=_emulate, rule="true, false or 'auto'")
    """Also keep linears too small to run faster in float8 (torchao's H100 thresholds: tensorwise
    keeps K <= 4096 with N <= 1024; the other recipes keep N <= 2048, K <= 1024, or N <= 4096
    with K <= 2048). 'auto': on where float8 runs on float8 tensor cores, off where it is
    emulated (no speed to gain; every linear converts). docs/float8.md tabulates the flavors."""
    force_fqns: list[str] = _field([])
    """Module names (matched as filter_fqns) converted even where auto_filter would keep them;
    filter_fqns and the divisible-by-16 rule still win."""
    enable_fsdp_float8_all_gather: bool = _field(False)
    """FSDP2 all-gathers weights in float8 (half the bytes of bf16); tensorwise only. On gloo
    the float8 bytes travel as uint8."""
    precompute_scale: bool = _field(False)
    """With float8 all-gather: compute all weight scales with one all-reduce after each
    optimizer step instead of one per layer in the all-gather."""
    emulate: bool | str = _field("auto", check=_emulate, rule="true, false or 'auto'")
    """Emulate float8 matmuls in high precision: 'auto' emulates where there is no float8
    hardware (CPU, GPUs before compute capability 8.9) and logs it."""
    moe_experts: bool = _field(False)
    """Run the MoE routed experts' grouped GEMMs (w1, w3, w2 of every GroupedExperts) in float8
    with moe_experts_recipe, in forward and backward (deferred weight gradients too). Independent
    of enable (which converts the linears); MoE flavors only. On CUDA compute capability 9.0+
    with torchao's prototype.moe_training the rowwise recipe runs torchao's float8 grouped GEMMs;
    elsewhere (and with emulate = true) it is emulated."""
    moe_experts_recipe: str = _field("rowwise", choices=FLOAT8_EXPERT_RECIPES)
    """Scaling of the float8 experts: rowwise (torchao's FP8 rowwise: a power-of-two scale per
    row, per expert) or blockwise (DeepSeek-V3: 1x128 activation tiles, 128x128 weight blocks
    per expert; always emulated, torchao has no blockwise grouped GEMM)."""


def _grouped_mm_value(value: bool | str) -> str | None:
    return None if isinstance(value, bool) or value == "auto" else "true, false or 'auto'"


@dataclass
class MoEConfig:
    """Overrides of the model flavor's MoE settings; an unset key keeps the flavor's value.
    Only for MoE flavors (debugmoe, debugdeepseek, deepseek_v3_16b, deepseek_v3_671b)."""

    num_experts: int | None = _field(None, ge=1)
    """Routed experts per MoE block."""
    top_k: int | None = _field(None, ge=1)
    """Routed experts each token is sent to (<= num_experts)."""
    num_shared_experts: int | None = _field(None, ge=0)
    """Shared experts every token goes through (one SwiGLU of num_shared_experts x the expert
    hidden size); 0 = none."""
    score_func: str | None = _field(None, choices=("softmax", "sigmoid"))
    """Router scores: softmax over experts or a sigmoid per expert (DeepSeek-V3), in fp32."""
    route_norm: bool | None = _field(None)
    """Renormalise each token's top-k routing weights to sum to 1."""
    route_scale: float | None = _field(None, gt=0)
    """Multiply the routing weights by this (DeepSeek-V3: 2.5)."""
    num_expert_groups: int | None = _field(None, ge=1)
    """Group-limited routing: the experts form this many equal groups (must divide
    num_experts); 1 = no groups."""
    num_limited_groups: int | None = _field(None, ge=1)
    """Group-limited routing: each token picks its top_k experts inside its best this-many
    groups (<= num_expert_groups; the groups must hold at least top_k experts)."""
    load_balance_coeff: float | None = _field(None, ge=0)
    """Aux-loss-free balancing: after each optimizer step the selection-only expert bias moves
    by this x sign(mean load - load); 0 = off."""
    aux_loss_alpha: float | None = _field(None, ge=0)
    """Weight of DeepSeek-V3's sequence-wise balance loss (alpha x sum_i f_i P_i per
    sequence, averaged over the step's sequences); 0 = off."""
    capacity_factor: float | None = _field(None, gt=0)
    """Token dropping: each expert takes at most ceil(tokens x top_k / num_experts x this)
    assignments per forward (lowest router score dropped first); unset = the flavor's
    (dropless for the built-in flavors)."""
    use_grouped_mm: bool | str | None = _field(None, check=_grouped_mm_value,
                                               rule="true, false or 'auto'")
    """Experts as one torch._grouped_mm per projection (true), a loop over experts (false), or
    'auto' (grouped where the device and dtype support it; same results)."""
    n_dense_layers: int | None = _field(None, ge=0)
    """The first this-many blocks keep a dense feed-forward (DeepSeek's first-k-dense)."""
    moe_layer_interval: int | None = _field(None, ge=1)
    """After the dense ones, every this-many-th block is a MoE block (1 = all of them)."""
    replicate_hot_experts: int = _field(0, ge=0)
    """Hot-expert replication under expert parallelism: up to this many of the most loaded
    experts are copied to the least loaded ep ranks, so every rank computes about the mean
    number of rows; exact. The copies are chosen by a step's first micro-batch and reused by
    all of its micro-batches (weights sent once per step, gradients summed and sent back once).
    0 = off; at most num_experts - num_experts / expert_parallel_degree (docs/moe_ep.md)."""
