"""The config schema: one documented dataclass per TOML section, and the per-field checks.

Each TOML section is a dataclass, here or (the sections of how the job runs: ``[parallelism]``,
``[activation_checkpoint]``, ``[compile]``, ``[float8]``, ``[moe]``) in
:mod:`titanext.config.schema_parallel`, and every key carries an attribute docstring (the
string literal under the field) that doubles as ``--help`` text
(:func:`titanext.config.loader.config_help` reads them from the two files' source). A field's own
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

from titanext.config._fields import _field, _minus_one_or_positive, constraint_problem
from titanext.config._values import _coerce, _hints, _show, _type_name, _value_type_name
from titanext.config.muon_split import split_entries_problem
from titanext.config.schema_parallel import (
    ActivationCheckpoint,
    Compile,
    Float8,
    MoEConfig,
    Parallelism,
)

__all__ = ["SECTIONS", "Checkpoint", "Comm", "Job", "JobConfig", "LRSchedulerConfig", "Metrics",
           "Model", "OptimizerConfig", "Profiling", "Training", "Validation", "field_problems"]


# -- per-field constraints live next to the field (titanext.config._fields) ----------------------

def _load_step(value: int | str) -> str | None:
    if value in ("latest", "none") or (isinstance(value, int) and value >= 0):
        return None
    hint = "; write the step number without quotes" if str(value).isdecimal() else ""
    return f"'latest', 'none' or a step number >= 0{hint}"



_DATASETS = ("shakespeare", "text", "tokens", "synthetic", "hf")


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
    gc_freq: int = _field(50, ge=0)
    """Python's garbage collector: N > 0 turns its automatic collection off while training and
    collects the young generations after every N-th step instead (the profiler's titanext:gc
    range), on the same steps on every rank, so no collection pauses one rank mid-step while
    the others wait at a collective; 0 leaves Python's automatic collection on."""
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
    name: str = _field("AdamW", choices=("AdamW", "Adam", "Muon"))
    """Optimizer class: AdamW (decoupled weight decay), Adam (L2 weight decay), or Muon
    (torch.optim.Muon's orthogonalized momentum on the muon_params matrices, each matrix
    orthogonalized once on one owner rank under any layout, and AdamW on the other parameters;
    docs/muon.md)."""
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
    muon_params: list[str] | None = _field(None)
    """Globs (fnmatch, over parameter FQNs) of the parameters Muon updates with name = 'Muon'.
    Unset: every parameter of 2 or more dimensions inside the block list (an FQN with a numeric
    segment such as layers.3.), routers excepted; a 3-D expert weight is one matrix per expert.
    Embeddings, the output head, norms, biases and routers stay with AdamW. A glob matching
    nothing, or selecting a 1-D parameter, is an error."""
    no_decay_params: list[str] | None = _field(None)
    """Globs of the AdamW / Adam parameters trained without weight decay. Unset: the 1-D
    parameters (norms, biases) with name = 'Muon'; none with AdamW / Adam, so that their runs
    train as before (set ["*norm*", "*.bias"] to exempt norms and biases). A glob matching
    nothing, or a parameter also in muon_params, is an error."""
    muon_lr: float = _field(0.02, gt=0)
    """Muon's peak learning rate before its per-shape adjustment (muon_adjust_lr_fn); follows
    the same schedule as lr. 0.02 suits 'original'; with 'match_rms_adamw' use AdamW's lr."""
    muon_weight_decay: float | None = _field(None, ge=0)
    """Muon's decoupled weight decay (p *= 1 - lr x wd before the update); unset = weight_decay."""
    muon_momentum: float = _field(0.95, ge=0, lt=1)
    """Muon's momentum (buf = momentum x buf + grad)."""
    muon_nesterov: bool = _field(True)
    """Muon's Nesterov momentum: orthogonalize grad + momentum x buf instead of buf."""
    muon_ns_steps: int = _field(5, ge=1, lt=100)
    """Newton-Schulz iterations (torch.optim.Muon's quintic coefficients)."""
    muon_ns_dtype: str = _field("auto", choices=("auto", "bfloat16", "float32"))
    """dtype of Muon's Newton-Schulz iteration (and of the pieces sent to each matrix's owner):
    bfloat16 is torch.optim.Muon's; float32 costs twice the bytes and more FLOPs on a GPU, and
    is what the layout-vs-one-process tests use (bfloat16 rounding turns a 1e-7 difference in a
    gradient sum into a 1e-3 one in the update). 'auto': bfloat16 on CUDA (and in a dry run and
    the planner), float32 on CPU, whose bfloat16 GEMMs are slower than its float32 ones."""
    muon_adjust_lr_fn: str = _field("original", choices=("original", "match_rms_adamw"))
    """Muon's per-shape learning rate: original (sqrt(max(1, rows / cols)), Keller Jordan's and
    torch.optim.Muon's default) or match_rms_adamw (0.2 x sqrt(max(rows, cols)), Moonlight's:
    reuses AdamW's lr and weight decay)."""
    muon_split_params: list[str] | None = _field(
        None, check=split_entries_problem,
        rule="entries 'GLOB = SIZES' (rows) or 'GLOB = cols SIZES', sizes joined by +")
    """Fused projections that Muon orthogonalizes per logical matrix instead of whole (the
    default): each entry 'GLOB = SIZES' splits the rows of the matching Muon parameters (an
    nn.Linear weight's output features, or each expert's in a stacked [experts, out, in]
    weight) into matrices of those sizes, e.g. 'layers.*.qkv_proj.weight = 3072+1024+1024';
    'GLOB = cols SIZES' splits the columns (a Conv1D weight [in, out]). The owner still gathers
    the whole matrix, then orthogonalizes each part with its own shape's learning rate, as
    torch.optim.Muon on separate matrices. A glob matching nothing, a match outside the Muon
    group, or sizes that do not add up to the dimension is an error (docs/muon.md)."""
    state_dtype: str = _field("float32", choices=("float32", "bfloat16"))
    """dtype of Adam's two moments (exp_avg, exp_avg_sq). bfloat16 halves the optimizer state
    (8 to 4 bytes per parameter, as DeepSeek-V3 does): the update still runs in fp32, one
    parameter at a time, and rounds the moments to the nearest bf16 (deterministic, so a resume
    is bitwise). Works with FSDP, ZeRO-1, checkpoints and resharding; see docs/optimizer.md.
    Applies to AdamW / Adam; with name = 'Muon' keep float32."""


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
    fake_microbatches: str = _field("fewest", choices=("fewest", "all"))
    """Micro-batches a pipelined ``fake_backend`` dry run steps. ``fewest``: the fewest whose
    action list on this rank is the full list less repetitions of its steady state, which
    leave memory as they found it, so the peak is the full step's (the inputs of every
    micro-batch are built; the repeated actions' collectives are added to the step's comm;
    docs/dry_run.md). ``all``: every micro-batch (slower, for a check)."""


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
