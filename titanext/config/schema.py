"""The config schema: one documented dataclass per TOML section, and the per-field checks.

Each TOML section is a dataclass below, and every key carries an attribute docstring (the
string literal under the field) that doubles as ``--help`` text
(:func:`titanext.config.loader.config_help` reads them from this file's source). A field's own
constraints (choices, bounds, a custom check) sit in its metadata next to it, and
:func:`field_problems` checks them one field at a time; rules that involve several keys live in
:mod:`titanext.config.rules`.

A section class is named after its section with a ``Config`` suffix where the bare name would
shadow a runtime class (``MoEConfig`` is ``[moe]``, not :class:`titanext.models.moe.MoE`).

>>> JobConfig().parallelism.context_parallel_load_balance
'zigzag'
>>> SECTIONS["moe"].__name__
'MoEConfig'
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from titanext._text import did_you_mean as _did_you_mean
from titanext.config._fields import _field, constraint_problem
from titanext.config._values import _coerce, _hints, _show, _type_name, _value_type_name
from titanext.config.field_rules import _ac_option, _aten_ops, _pp_schedule
from titanext.plugins.expert_parallel.rules import EP_DISPATCH_MODES
from titanext.plugins.rules import DEFAULT_SAVE_OPS, FLOAT8_EXPERT_RECIPES, FLOAT8_RECIPES

__all__ = ["SECTIONS", "ActivationCheckpoint", "Checkpoint", "Comm", "Compile", "Float8", "Job",
           "JobConfig", "LRSchedulerConfig", "Metrics", "MoEConfig", "Model", "OptimizerConfig",
           "Parallelism", "Profiling", "Training", "Validation", "field_problems"]


# -- per-field constraints live next to the field (titanext.config._fields) ----------------------

def _minus_one_or_positive(value: int) -> str | None:
    return None if value == -1 or value >= 1 else "-1 or an integer >= 1"


_COMPILE_COMPONENTS = ("model", "loss")


def _compile_components(names: list[str]) -> str | None:
    for name in names:
        if name not in _COMPILE_COMPONENTS:
            return (f"any of 'model', 'loss'; {name!r} is not one of them"
                    f"{_did_you_mean(name, _COMPILE_COMPONENTS, fallback=False)}")
    return None


def _load_step(value: int | str) -> str | None:
    if value in ("latest", "none") or (isinstance(value, int) and value >= 0):
        return None
    hint = "; write the step number without quotes" if str(value).isdecimal() else ""
    return f"'latest', 'none' or a step number >= 0{hint}"



_DATASETS = ("shakespeare", "text", "tokens", "synthetic", "hf")


def _no_async_tp(value: bool) -> str | None:
    return (None if value is False else "false (async TP needs CUDA symmetric memory and "
            "torch.compile, which titanext cannot test; use plain TP)")


def _non_empty(value: str) -> str | None:
    return None if value else "a non-empty name"


# -- the sections ---------------------------------------------------------------------------------

@dataclass
class Job:
    dump_folder: str = _field("./outputs")
    """Folder for this job's outputs: checkpoints and TensorBoard events go below it."""
    description: str = _field("")
    """Free text describing the job; kept with the config, used nowhere else."""
    extends: str | None = _field(None)
    """Path of a base TOML file (relative to this file) whose values this file overrides,
    section by section and key by key. Only valid in a file, not on the command line."""


@dataclass
class Model:
    name: str = _field("llama3", rule="a key of titanext.models.MODEL_FLAVORS")
    """Model family (a key of titanext.models.MODEL_FLAVORS)."""
    flavor: str = _field("debugmodel", rule="a flavor of the chosen model, or 'hf'")
    """Named size of the model family, e.g. debugtiny, debugmodel, 1B, 8B, 70B, 405B; 'hf'
    takes the shapes from hf_assets_path/config.json (Llama, Mistral, Mixtral, Qwen3,
    DeepSeek-V3; see docs/hf_checkpoints.md)."""
    tokenizer: str = _field("byte", choices=("byte", "hf"))
    """Tokenizer: 'byte' is the built-in byte-level tokenizer (258 ids, no files needed); 'hf'
    reads hf_assets_path/tokenizer.json (BOS/EOS from tokenizer_config.json)."""
    hf_assets_path: str | None = _field(None)
    """A Hugging Face model directory (config.json, tokenizer.json, tokenizer_config.json) for
    flavor = 'hf' and tokenizer = 'hf'; its files are copied into HF exports."""
    num_mtp_layers: int = _field(-1, ge=-1)
    """Multi-token prediction modules after the last block (DeepSeek-V3: 1; each predicts one
    token further, through the shared embedding and output head; docs/deepseek_v3.md). -1
    keeps the flavor's (or config.json's num_nextn_predict_layers), 0 turns MTP off."""


@dataclass
class Training:
    local_batch_size: int = _field(8, ge=1)
    """Sequences per micro-batch on each data-parallel rank."""
    global_batch_size: int = _field(-1, check=_minus_one_or_positive, rule="-1 or >= 1")
    """Sequences per optimizer step over all ranks; -1 means local_batch_size x dp. A larger
    multiple of local_batch_size x dp gives gradient accumulation over global / (local x dp)
    micro-batches."""
    seq_len: int = _field(256, ge=1)
    """Tokens per sequence; at most the model's max_seq_len."""
    steps: int = _field(1000, ge=1)
    """Optimizer steps to train for."""
    max_norm: float = _field(1.0, ge=0)
    """Global gradient-norm clipping threshold; 0 disables clipping (the norm is still logged)."""
    mixed_precision_param: str = _field("auto", choices=("auto", "bfloat16", "float32"))
    """Parameter dtype for compute: auto = bfloat16 on CUDA, float32 on CPU (CPU kernels gain
    little from bfloat16). FSDP casts the parameters; where FSDP does not run (one rank, or
    ZeRO-1's DDP) the forward runs under torch.autocast to this dtype instead, as torchtitan
    does. Pipeline stages without FSDP keep float32."""
    mixed_precision_reduce: str = _field("float32", choices=("float32", "bfloat16"))
    """Gradient reduce-scatter / all-reduce dtype; float32 keeps the sum exact enough."""
    seed: int = _field(0, ge=0)
    """Seed for initialisation and data order; the same seed gives the same model in any layout."""
    deterministic: bool = _field(False)
    """Use deterministic algorithms only (slower; bitwise-repeatable runs)."""
    dataset: str = _field("shakespeare", choices=_DATASETS)
    """Data source: the built-in Shakespeare corpus, your own files streamed and tokenized as
    they are read ('text'), pre-tokenized .npy shards ('tokens', from titanext-data
    tokenize), synthetic random tokens (for benchmarks and parity tests), or a Hugging Face
    datasets split streamed through datasets.load_dataset ('hf': needs pip install
    'titanext[datasets]'). See docs/data.md."""
    dataset_path: str | None = _field(None)
    """For dataset = 'text': a .txt, .jsonl, .parquet or .arrow file, or a folder of them
    (searched recursively; .arrow: the shards of a datasets save_to_disk split folder);
    for 'tokens': a folder of .npy shards; for 'hf': what datasets.load_dataset takes (a hub
    name such as "allenai/c4", a local folder, or one .jsonl/.json/.parquet/.csv/.txt/.arrow
    file). Relative to the working directory. Leave unset (or "") for the other datasets."""
    dataset_name: str = _field("")
    """For dataset = 'hf': the dataset's config name (load_dataset's second argument, e.g.
    "en" for allenai/c4); "" for none."""
    dataset_split: str = _field("train", check=_non_empty, rule="a non-empty split name")
    """For dataset = 'hf': the split to stream, e.g. "train"."""
    dataset_text_field: str = _field("text", check=_non_empty, rule="a non-empty name")
    """The field of each .jsonl record, or the column of a .parquet or .arrow file or of a
    dataset = 'hf' split, that holds the text."""
    shuffle: bool = _field(True)
    """Shuffle the order of sequence windows each epoch (deterministically from the seed)."""
    mtp_loss_weight: float = _field(0.3, ge=0)
    """Weight of the multi-token prediction loss (models with MTP modules): the loss is the
    main token mean + mtp_loss_weight x the mean over MTP modules of each one's token-CE sum
    / the main token count (DeepSeek-V3's lambda: 0.3, then 0.1). Logged apart as mtp_loss."""
    document_masking: bool = _field(False)
    """Packed documents do not attend to each other: the loader numbers the documents of each
    row (a new one after every EOS), attention stays causal within a document (with or without
    CP: ring, Ulysses and hybrid skip the blocks that share no document; also under TP, FSDP
    and PP with every schedule), and RoPE positions restart at each document start. The loss
    is unchanged: every token predicts the next one, and the EOS between documents stays."""


@dataclass
class Validation:
    enable: bool = _field(False)
    """Every freq steps, run the model forward only over the first `steps` batches of a
    held-out source and log the mean token loss and perplexity (console and TensorBoard:
    validation/loss, validation/perplexity). Works under every parallelism. See docs/data.md."""
    dataset: str = _field("text", choices=_DATASETS)
    """The held-out source, as training.dataset (read unshuffled from its start every time)."""
    dataset_path: str | None = _field(None)
    """Its files, as training.dataset_path (the text field is training.dataset_text_field;
    with dataset = 'hf' the config name is training.dataset_name)."""
    dataset_split: str = _field("validation", check=_non_empty, rule="a non-empty split name")
    """For dataset = 'hf': the held-out split to read."""
    freq: int = _field(100, ge=1)
    """Validate after every this many training steps."""
    steps: int = _field(10, ge=1)
    """Batches per validation (each of local_batch_size sequences per data-parallel rank)."""
    local_batch_size: int = _field(8, ge=1)
    """Sequences per validation batch on each data-parallel rank (training.seq_len tokens)."""


@dataclass
class OptimizerConfig:
    name: str = _field("AdamW", choices=("AdamW", "Adam"))
    """Optimizer class: AdamW (decoupled weight decay) or Adam (L2 weight decay)."""
    lr: float = _field(8e-4, gt=0)
    """Peak learning rate, reached at the end of warmup."""
    beta1: float = _field(0.9, ge=0, lt=1)
    """Adam beta1: decay of the running mean of gradients."""
    beta2: float = _field(0.95, ge=0, lt=1)
    """Adam beta2: decay of the running mean of squared gradients."""
    eps: float = _field(1e-8, gt=0)
    """Adam epsilon, added to the denominator for numerical stability."""
    weight_decay: float = _field(0.1, ge=0)
    """Decoupled (AdamW) weight decay, applied to every parameter, norms and biases included,
    as torchtitan does."""
    implementation: str = _field("foreach", choices=("for-loop", "foreach", "fused"))
    """Kernel implementation of the optimizer step: for-loop (one kernel per tensor), foreach
    (batched) or fused (one kernel, where the device supports it)."""


@dataclass
class LRSchedulerConfig:
    warmup_steps: int = _field(2, ge=0)
    """Steps of linear warmup from near zero to the peak learning rate."""
    decay_ratio: float | None = _field(None, ge=0, le=1)
    """Fraction of all steps spent decaying at the end (warmup-stable-decay); unset = decay
    over every step after warmup."""
    decay_type: str = _field("linear", choices=("linear", "sqrt", "cosine"))
    """Shape of the decay from the peak to min_lr_factor x peak."""
    min_lr_factor: float = _field(0.0, ge=0, le=1)
    """Final learning rate as a fraction of the peak."""


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
    mode: str = _field("none", choices=("none", "selective", "full"))
    """Recompute activations in backward: none, selective (see selective_ac_option) or full
    (every transformer block)."""
    selective_ac_option: str = _field("op", check=_ac_option, rule="'op' or a positive integer")
    """For selective mode: 'op' (save the outputs of selective_op_save_list, recompute the
    rest) or a positive integer n written as a string (fully checkpoint every n-th block)."""
    selective_op_save_list: list[str] = _field(_DEFAULT_SAVE_OPS, check=_aten_ops,
                                               rule="names of torch.ops.aten ops")
    """aten op names whose outputs op-level selective AC keeps (matmuls and attention by
    default: expensive to recompute, cheap to store)."""
    keep_all_to_all: bool = _field(False)
    """Recompute without re-dispatch, for blocks that are fully checkpointed (mode = 'full' or
    a layer-level selective_ac_option): also keep what their expert-parallel collectives
    received (dispatched token rows, expert outputs before the combine, split sizes) and replay
    it in the recompute, so no all-to-all runs twice (4 per MoE layer and micro-batch instead
    of 6), for about 2 x top_k x dim more saved values per token and MoE layer."""


@dataclass
class Compile:
    enable: bool = _field(False)
    """torch.compile each transformer block (and the loss, see components)."""
    components: list[str] = _field(["model"], check=_compile_components,
                                   rule="any of 'model', 'loss'")
    """What to compile: any of model, loss."""
    backend: str = _field("inductor", choices=("inductor", "aot_eager", "eager"))
    """torch.compile backend; aot_eager and eager help to tell compiler bugs from model bugs."""


@dataclass
class Checkpoint:
    enable: bool = _field(False)
    """Save and resume distributed checkpoints (torch.distributed.checkpoint)."""
    folder: str = _field("checkpoint")
    """Checkpoint folder, relative to job.dump_folder."""
    interval: int = _field(100, ge=1)
    """Save every this many steps."""
    load_step: int | str = _field("latest", check=_load_step,
                                  rule="'latest', 'none' or a step >= 0")
    """Step to resume from: 'latest' (the newest complete checkpoint, if any), 'none' (start
    fresh) or a step number."""
    keep_latest_k: int = _field(0, ge=0)
    """Keep only the newest k checkpoints; 0 keeps all."""
    last_save: bool = _field(True)
    """Also save after the final step, whatever the interval."""
    initial_load_path: str | None = _field(None)
    """Weights to start from while the checkpoint folder holds no checkpoint: a titanext DCP
    checkpoint (a step-N folder, or `titanext-convert hf-to-dcp` output), or with
    initial_load_in_hf an HF safetensors directory. Only the model is read."""
    initial_load_in_hf: bool = _field(False)
    """initial_load_path is a Hugging Face directory (*.safetensors); each rank reads only its
    shards, under any layout."""
    last_save_in_hf: bool = _field(False)
    """The final save also writes <folder>/step-N-hf/ (safetensors, config.json, tokenizer
    files), loadable by transformers' AutoModelForCausalLM / AutoTokenizer."""
    async_mode: str = _field("disabled", choices=("disabled", "async", "async_with_pinned_mem"))
    """How saves are written: 'disabled' (the saving step waits for the files), 'async' (the
    state is copied to CPU memory in the saving step and a thread writes it while training goes
    on) or 'async_with_pinned_mem' (the copy goes to pinned memory and a separate checkpoint
    process writes it: faster device-to-host copies, no GIL contention, more host memory). An
    async save is committed (manifest written, step-N.tmp renamed) when the next save, a resume
    or the end of training finds every rank's write finished."""
    model_weights_only: bool = _field(False)
    """The last save (after training.steps) holds the model weights only, in export_dtype: no
    optimizer, scheduler, data or RNG state, so it cannot resume training; start a new run from
    it (initial_load_path) or convert it to HF. Earlier saves stay full checkpoints."""
    export_dtype: str = _field("float32", choices=("float32", "bfloat16", "float16"))
    """Dtype of the floating-point weights in the weights-only last save (model_weights_only =
    true); other values need model_weights_only."""


@dataclass
class Metrics:
    log_freq: int = _field(10, ge=1)
    """Log a metrics line every this many steps (and at the first and last)."""
    enable_tensorboard: bool = _field(True)
    """Write TensorBoard event files under job.dump_folder/save_tb_folder."""
    save_tb_folder: str = _field("tb")
    """TensorBoard folder, relative to job.dump_folder."""
    enable_wandb: bool = _field(False)
    """Also log the TensorBoard scalars to a Weights & Biases run, from the same rank (needs
    pip install 'titanext[wandb]'). wandb's environment variables set the rest: WANDB_PROJECT
    (default "titanext"), WANDB_ENTITY, WANDB_NAME (run name), WANDB_MODE=offline, WANDB_DIR
    (default job.dump_folder). See docs/checkpoints_and_faults.md."""
    disable_color_printing: bool = _field(False)
    """Plain log lines without ANSI colours."""
    progress_bar: bool = _field(True)
    """Draw a progress bar with ETA (only when stdout is a terminal, so logs stay clean)."""


@dataclass
class Profiling:
    enable_profiling: bool = _field(False)
    """Run torch.profiler in windows: every rank writes one Chrome trace per window to
    <job.dump_folder>/<save_traces_folder>/iteration_<N>/rank<R>_trace.json (open it in
    Perfetto) and prints where the step's time went (docs/profiling.md)."""
    save_traces_folder: str = _field("profile_traces")
    """Trace folder, relative to job.dump_folder."""
    profile_freq: int = _field(10, ge=1)
    """A window closes every this many steps (at profile_freq, 2 x profile_freq, ...); also the
    memory snapshot's period. Must not exceed training.steps."""
    profiler_warmup: int = _field(3, ge=0)
    """Steps the profiler runs untraced before each window's traced steps (its start-up cost
    stays out of the trace)."""
    profiler_active: int = _field(1, ge=1)
    """Traced steps per window: the last profiler_active steps of every profile_freq
    (profiler_warmup + profiler_active <= profile_freq)."""
    enable_memory_snapshot: bool = _field(False)
    """Write a memory snapshot every profile_freq steps to
    <job.dump_folder>/<save_memory_snapshot_folder>/iteration_<N>/: on CUDA the allocator's
    history as the pickle https://pytorch.org/memory_viz reads; without CUDA, torch's
    MemTracker breakdown (parameters, gradients, optimizer state, activations, temporaries)
    of one step as JSON and an SVG stack (see memory_snapshot_kind)."""
    save_memory_snapshot_folder: str = _field("memory_snapshot")
    """Memory snapshot folder, relative to job.dump_folder."""
    memory_snapshot_kind: str = _field("auto", choices=("auto", "cuda_history", "breakdown"))
    """'auto': the CUDA history where CUDA exists, else the MemTracker breakdown (said in one
    INFO line); 'cuda_history' insists on the CUDA pickle (a config error without CUDA);
    'breakdown' always writes the MemTracker breakdown."""


@dataclass
class Comm:
    init_timeout_seconds: int = _field(300, ge=1)
    """Collective timeout during start-up (model build, checkpoint load, compile)."""
    train_timeout_seconds: int = _field(100, ge=1)
    """Collective timeout once training runs: a dead or stuck rank fails the job after this."""
    mode: str = _field("real", choices=("real", "fake_backend"))
    """``real`` trains. ``fake_backend`` is a dry run: one ordinary process (no torchrun) becomes
    rank ``fake_rank`` of ``fake_world_size`` over torch's fake process group, builds the real
    trainer with fake tensors (no memory for weights, gradients, optimizer state, activations),
    runs one training step, and prints its per-rank memory and communication next to the
    planner's (docs/dry_run.md)."""
    fake_world_size: int = _field(0, ge=0)
    """World size of a ``fake_backend`` dry run; 0 means the product of the parallel degrees
    (data_parallel_shard_degree = -1 counting 1)."""
    fake_rank: int = _field(0, ge=0)
    """The rank a ``fake_backend`` dry run plays (pipeline ranks differ: the first holds the
    embedding, the last the head); must be below the world size."""


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


@dataclass
class JobConfig:
    """The whole job: one attribute per TOML section."""

    job: Job = field(default_factory=Job)
    """Where outputs go and what this file inherits from."""
    model: Model = field(default_factory=Model)
    """Which model and tokenizer to train."""
    training: Training = field(default_factory=Training)
    """Batch, sequence length, steps, precision and data."""
    validation: Validation = field(default_factory=Validation)
    """Loss and perplexity on a held-out source every few steps (forward only)."""
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    """The optimizer and its hyper-parameters."""
    lr_scheduler: LRSchedulerConfig = field(default_factory=LRSchedulerConfig)
    """Learning-rate warmup and decay."""
    parallelism: Parallelism = field(default_factory=Parallelism)
    """Parallel degrees; their product is the world size."""
    activation_checkpoint: ActivationCheckpoint = field(default_factory=ActivationCheckpoint)
    """Trade compute for memory by recomputing activations in backward."""
    compile: Compile = field(default_factory=Compile)
    """torch.compile."""
    checkpoint: Checkpoint = field(default_factory=Checkpoint)
    """Distributed checkpoints: saving, resuming and retention."""
    metrics: Metrics = field(default_factory=Metrics)
    """Console logging and TensorBoard."""
    profiling: Profiling = field(default_factory=Profiling)
    """torch.profiler traces, memory snapshots and the table of where each step went."""
    comm: Comm = field(default_factory=Comm)
    """Collective timeouts."""
    float8: Float8 = field(default_factory=Float8)
    """Float8 training of linear layers."""
    moe: MoEConfig = field(default_factory=MoEConfig)
    """Mixture-of-Experts settings (overrides of the MoE flavor's)."""


#: TOML section name -> its dataclass, in file order.
SECTIONS: dict[str, type] = {
    f.name: f.default_factory for f in dataclasses.fields(JobConfig)  # type: ignore[misc]
}


# -- per-field validation -------------------------------------------------------------------------

def field_problems(cfg: JobConfig, skip: set[str]) -> list[str]:
    """Type, enum, range and custom checks of each field on its own; failed keys join ``skip``."""
    problems: list[str] = []
    for section, cls in SECTIONS.items():
        obj = getattr(cfg, section)
        hints = _hints(cls)
        for f in dataclasses.fields(cls):
            key = f"{section}.{f.name}"
            if key in skip:
                continue
            value = getattr(obj, f.name)
            try:  # a config built in Python never went through the TOML type check
                _coerce(value, hints[f.name])
            except TypeError:
                problems.append(f"{key} = {_show(value)} has the wrong type: expected "
                                f"{_type_name(hints[f.name])}, got {_value_type_name(value)}")
                skip.add(key)
                continue
            problem = constraint_problem(f, value)
            if problem:
                problems.append(f"{key} = {_show(value)} {problem}")
                skip.add(key)
    return problems
