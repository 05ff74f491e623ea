"""Typed job configuration: TOML files + CLI overrides -> :class:`JobConfig`.

Each TOML section is a dataclass below, and every key carries an attribute docstring (the
string literal under the field) that doubles as ``--help`` text. Loading is strict: unknown
sections and keys (with a did-you-mean hint), wrong types, out-of-range values, values outside
an enum and cross-field rules are all collected and raised together as one
:class:`ConfigError`, one line per problem, before any process group exists. Loading reads the
TOML files and, for ``dataset = "text"``, checks that ``dataset_path`` exists; it writes
nothing.

>>> cfg = load_config("train_configs/debug_model.toml", ["--training.steps=10"], world_size=4)
>>> cfg.training.steps
10
>>> resolved_dp_shard(cfg, 4), gradient_accumulation_steps(cfg, 4)
(4, 1)

A file can inherit from another with ``[job] extends = "base.toml"`` (relative to the file);
sections are merged key by key, so a child file only lists what it changes.
"""

from __future__ import annotations

import ast
import dataclasses
import difflib
import inspect
import json
import operator
import os
import re
import sys
import textwrap
import types
import typing
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Union

from titanext._hints import did_you_mean as _did_you_mean
from titanext.errors import ConfigError
from titanext.plugins.activation_checkpoint import DEFAULT_SAVE_OPS
from titanext.plugins.float8 import FLOAT8_RECIPES

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

__all__ = [
    "ConfigError",
    "JobConfig",
    "config_help",
    "field_docs",
    "gradient_accumulation_steps",
    "load_config",
    "parse_cli",
    "resolved_dp_shard",
    "model_args",
    "to_toml",
    "validate",
]


# -- per-field constraints live next to the field ------------------------------------------------

# A custom check returns None when the value is fine, else what is allowed (for the message).
_Check = Callable[[Any], Union[str, None]]


def _field(
    default: Any,
    *,
    choices: Sequence[Any] | None = None,
    ge: float | None = None,
    gt: float | None = None,
    le: float | None = None,
    lt: float | None = None,
    check: _Check | None = None,
    rule: str | None = None,
) -> Any:
    """A dataclass field whose constraints are stored in its metadata for :func:`validate`.

    ``rule`` describes a custom ``check`` for ``--help``; choices and bounds describe themselves.
    """
    meta = {"choices": choices, "ge": ge, "gt": gt, "le": le, "lt": lt, "check": check,
            "rule": rule}
    if isinstance(default, list):
        return field(default_factory=lambda: list(default), metadata=meta)
    return field(default=default, metadata=meta)


def _minus_one_or_positive(value: int) -> str | None:
    return None if value == -1 or value >= 1 else "-1 or an integer >= 1"


def _pp_schedule(value: str) -> str | None:
    from titanext.schedules import SCHEDULE_NAMES

    if value in SCHEDULE_NAMES:
        return None
    return f"one of {', '.join(SCHEDULE_NAMES)}{_did_you_mean(value, list(SCHEDULE_NAMES), fallback=False)}"


def _ac_option(value: str) -> str | None:
    # isdecimal() rejects '²' and similar, which int() would not parse anyway.
    if value == "op" or (value.isdecimal() and int(value) >= 1):
        return None
    return "'op' or a positive integer written as a string, such as '2'"


def _aten_ops(names: list[str]) -> str | None:
    import torch  # lazy: --help and TOML parsing should not pay for importing torch

    for name in names:
        if not hasattr(torch.ops.aten, name):
            return f"aten op names only; {name!r} is not torch.ops.aten.{name}{_aten_hint(name)}"
    return None


def _aten_hint(name: str) -> str:
    try:  # private, but only feeds a hint; losing it loses nothing else
        import torch

        known = {n.split("::", 1)[1].split(".", 1)[0]
                 for n in torch._C._dispatch_get_all_op_names() if n.startswith("aten::")}
    except (AttributeError, RuntimeError):
        return ""
    return _did_you_mean(name, sorted(known), fallback=False)


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
    takes the shapes from hf_assets_path/config.json (Llama, Mistral, Mixtral; see
    docs/hf_checkpoints.md)."""
    tokenizer: str = _field("byte", choices=("byte", "hf"))
    """Tokenizer: 'byte' is the built-in byte-level tokenizer (258 ids, no files needed); 'hf'
    reads hf_assets_path/tokenizer.json (BOS/EOS from tokenizer_config.json)."""
    hf_assets_path: str | None = _field(None)
    """A Hugging Face model directory (config.json, tokenizer.json, tokenizer_config.json) for
    flavor = 'hf' and tokenizer = 'hf'; its files are copied into HF exports."""


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
    """Parameter dtype for compute under FSDP: auto = bfloat16 on CUDA, float32 on CPU (CPU
    kernels gain little from bfloat16)."""
    mixed_precision_reduce: str = _field("float32", choices=("float32", "bfloat16"))
    """Gradient reduce-scatter / all-reduce dtype; float32 keeps the sum exact enough."""
    seed: int = _field(0, ge=0)
    """Seed for initialisation and data order; the same seed gives the same model in any layout."""
    deterministic: bool = _field(False)
    """Use deterministic algorithms only (slower; bitwise-repeatable runs)."""
    dataset: str = _field("shakespeare", choices=("shakespeare", "text", "synthetic"))
    """Data source: the built-in Shakespeare corpus, your own files ('text', see dataset_path),
    or synthetic random tokens (for benchmarks and parity tests)."""
    dataset_path: str | None = _field(None)
    """For dataset = 'text': a .txt or .jsonl file (field 'text'), or a folder of them; relative
    to the working directory. Leave unset (or "") for the other datasets."""
    shuffle: bool = _field(True)
    """Shuffle the order of sequence windows each epoch (deterministically from the seed)."""


@dataclass
class Optimizer:
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
    """Weight decay; norms and biases are excluded (see titanext.optim)."""
    implementation: str = _field("foreach", choices=("for-loop", "foreach", "fused"))
    """Kernel implementation of the optimizer step: for-loop (one kernel per tensor), foreach
    (batched) or fused (one kernel, where the device supports it)."""


@dataclass
class LRScheduler:
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
    context_parallel_degree: int = _field(1, ge=1)
    """Ranks that split each sequence (context parallelism with exact ring attention, see
    titanext.plugins.context_parallel). CP ranks also shard parameters: FSDP runs over
    dp_shard x cp."""
    context_parallel_load_balance: str = _field("zigzag", choices=("zigzag", "none"))
    """How CP splits a sequence: zigzag (rank r of W holds chunks r and 2W-1-r of 2W, so causal
    attention costs every rank the same) or none (contiguous slices; the last rank does the most
    work)."""
    context_parallel_comm: str = _field("p2p", choices=("p2p", "allgather"))
    """How CP moves keys and values: p2p (a ring of send/recv overlapped with compute; memory of
    two KV blocks) or allgather (one all-gather forward and one reduce-scatter of their
    gradients backward; memory of the whole sequence's KV, fewer and larger messages)."""
    pipeline_parallel_degree: int = _field(1, ge=1)
    """Ranks the pipeline spans (pp); each holds pipeline_parallel_stages_per_rank stages."""
    pipeline_parallel_schedule: str = _field("1F1B", check=_pp_schedule,
                                             rule="a name from titanext.schedules")
    """Pipeline schedule: torch's (GPipe, 1F1B, Interleaved1F1B, LoopedBFS,
    InterleavedZeroBubble, ZBVZeroBubble) or titanext's (ZBH1, ZBH2, ZBV, Auto, ...). Auto
    measures F, I and W on the first step, then runs the schedule generated for those costs."""
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


_DEFAULT_SAVE_OPS = list(DEFAULT_SAVE_OPS)  # the plugin owns the list


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
    checkpoint (a step-N folder, or `python -m titanext.convert hf-to-dcp` output), or with
    initial_load_in_hf an HF safetensors directory. Only the model is read."""
    initial_load_in_hf: bool = _field(False)
    """initial_load_path is a Hugging Face directory (*.safetensors); each rank reads only its
    shards, under any layout."""
    last_save_in_hf: bool = _field(False)
    """The final save also writes <folder>/step-N-hf/ (safetensors, config.json, tokenizer
    files), loadable by transformers' AutoModelForCausalLM / AutoTokenizer."""


@dataclass
class Metrics:
    log_freq: int = _field(10, ge=1)
    """Log a metrics line every this many steps (and at the first and last)."""
    enable_tensorboard: bool = _field(True)
    """Write TensorBoard event files under job.dump_folder/save_tb_folder."""
    save_tb_folder: str = _field("tb")
    """TensorBoard folder, relative to job.dump_folder."""
    disable_color_printing: bool = _field(False)
    """Plain log lines without ANSI colours."""
    progress_bar: bool = _field(True)
    """Draw a progress bar with ETA (only when stdout is a terminal, so logs stay clean)."""


@dataclass
class Comm:
    init_timeout_seconds: int = _field(300, ge=1)
    """Collective timeout during start-up (model build, checkpoint load, compile)."""
    train_timeout_seconds: int = _field(100, ge=1)
    """Collective timeout once training runs: a dead or stuck rank fails the job after this."""


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
    auto_filter: bool = _field(False)
    """Also keep linears too small to run faster in float8 (torchao's H100 thresholds, e.g.
    tensorwise skips K <= 4096 with N <= 1024)."""
    enable_fsdp_float8_all_gather: bool = _field(False)
    """FSDP2 all-gathers weights in float8 (half the bytes of bf16); tensorwise only. On gloo
    the float8 bytes travel as uint8."""
    precompute_scale: bool = _field(False)
    """With float8 all-gather: compute all weight scales with one all-reduce after each
    optimizer step instead of one per layer in the all-gather."""
    emulate: bool | str = _field("auto", check=_emulate, rule="true, false or 'auto'")
    """Emulate float8 matmuls in high precision: 'auto' emulates where there is no float8
    hardware (CPU, GPUs before compute capability 8.9) and logs it."""


def _grouped_mm_value(value: bool | str) -> str | None:
    return None if isinstance(value, bool) or value == "auto" else "true, false or 'auto'"


@dataclass
class MoE:
    """Overrides of the model flavor's MoE settings; an unset key keeps the flavor's value.
    Only for MoE flavors (debugmoe, deepseek_v3_16b, deepseek_v3_671b)."""

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


@dataclass
class JobConfig:
    """The whole job: one attribute per TOML section."""

    job: Job = field(default_factory=Job)
    """Where outputs go and what this file inherits from."""
    model: Model = field(default_factory=Model)
    """Which model and tokenizer to train."""
    training: Training = field(default_factory=Training)
    """Batch, sequence length, steps, precision and data."""
    optimizer: Optimizer = field(default_factory=Optimizer)
    """The optimizer and its hyper-parameters."""
    lr_scheduler: LRScheduler = field(default_factory=LRScheduler)
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
    comm: Comm = field(default_factory=Comm)
    """Collective timeouts."""
    float8: Float8 = field(default_factory=Float8)
    """Float8 training of linear layers."""
    moe: MoE = field(default_factory=MoE)
    """Mixture-of-Experts settings (overrides of the MoE flavor's)."""


#: TOML section name -> its dataclass, in file order.
SECTIONS: dict[str, type] = {
    f.name: f.default_factory for f in dataclasses.fields(JobConfig)  # type: ignore[misc]
}


# -- attribute docstrings ---------------------------------------------------------------------------

def _read_attribute_docs() -> dict[str, dict[str, str]]:
    """class name -> field name -> the string literal written under the field.

    Python keeps no attribute docstrings at runtime, so they are read from this module's source
    with ``ast``; that is done once, at import.
    """
    try:
        tree = ast.parse(inspect.getsource(sys.modules[__name__]))
    except (OSError, TypeError):  # shipped without source: help text loses its descriptions
        return {}
    docs: dict[str, dict[str, str]] = {}
    for node in tree.body:
        if not isinstance(node, ast.ClassDef):
            continue
        docs[node.name] = {}
        for a, b in zip(node.body, node.body[1:]):
            if (isinstance(a, ast.AnnAssign) and isinstance(a.target, ast.Name)
                    and isinstance(b, ast.Expr) and isinstance(b.value, ast.Constant)
                    and isinstance(b.value.value, str)):
                docs[node.name][a.target.id] = " ".join(b.value.value.split())
    return docs


_ATTRIBUTE_DOCS = _read_attribute_docs()


def field_docs() -> dict[tuple[str, str], str]:
    """``(section, key) -> docstring`` for every key ("" where a docstring is missing).

    >>> field_docs()[("training", "steps")]
    'Optimizer steps to train for.'
    """
    return {(section, f.name): _ATTRIBUTE_DOCS.get(cls.__name__, {}).get(f.name, "")
            for section, cls in SECTIONS.items() for f in dataclasses.fields(cls)}


# -- types ----------------------------------------------------------------------------------------

_HINTS: dict[type, dict[str, Any]] = {}


def _hints(cls: type) -> dict[str, Any]:
    # Annotations are strings (``from __future__ import annotations``); resolve them once.
    if cls not in _HINTS:
        _HINTS[cls] = typing.get_type_hints(cls)
    return _HINTS[cls]


def _is_union(tp: Any) -> bool:
    return typing.get_origin(tp) in (Union, types.UnionType)


def _type_name(tp: Any) -> str:
    if _is_union(tp):
        return " or ".join("unset" if a is type(None) else _type_name(a)
                           for a in typing.get_args(tp))
    if typing.get_origin(tp) is list:
        return f"list of {_type_name(typing.get_args(tp)[0])}"
    return {int: "integer", float: "number", bool: "boolean", str: "string"}.get(tp, str(tp))


def _value_type_name(value: Any) -> str:
    for tp, name in ((bool, "boolean"), (int, "integer"), (float, "number"), (str, "string"),
                     (list, "list"), (dict, "table")):
        if isinstance(value, tp):
            return name
    return type(value).__name__


def _coerce(value: Any, tp: Any) -> Any:
    """Check a TOML value against ``tp`` and return it (ints widened to float); else TypeError.

    TOML already types its values, so nothing is parsed here: a bool is never an int, and a
    string is never a number.
    """
    if _is_union(tp):
        if value is None and type(None) in typing.get_args(tp):
            return None
        for arg in typing.get_args(tp):
            if arg is type(None):
                continue
            try:
                return _coerce(value, arg)
            except TypeError:
                pass
        raise TypeError(tp)
    if typing.get_origin(tp) is list:
        if not isinstance(value, list):
            raise TypeError(tp)
        return [_coerce(v, typing.get_args(tp)[0]) for v in value]
    if tp is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)  # `lr = 1` means 1.0
    if tp is int and isinstance(value, bool):
        raise TypeError(tp)
    if tp in (bool, int, float, str) and isinstance(value, tp):
        return value
    raise TypeError(tp)


_TRUE, _FALSE = ("true", "1", "yes", "on"), ("false", "0", "no", "off")


def _parse_cli_value(text: str, tp: Any) -> Any:
    """Turn a CLI string into the value TOML would have given for ``tp``.

    Text that does not parse is returned unchanged, so that :func:`_coerce` reports it with the
    same wrong-type message a TOML file would get.
    """
    if _is_union(tp):
        args = typing.get_args(tp)
        if type(None) in args and text.strip().lower() in ("", "none", "null"):
            return None  # only way to unset an optional key, as TOML has no null
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _coerce(_parse_cli_value(text, arg), arg)
            except TypeError:
                pass
        return text
    if typing.get_origin(tp) is list:
        item = typing.get_args(tp)[0]
        return [_parse_cli_value(p.strip(), item) for p in text.split(",") if p.strip()]
    if tp is bool:
        low = text.strip().lower()
        return True if low in _TRUE else False if low in _FALSE else text
    for number in (int, float):
        if tp is number:
            try:
                return number(text)
            except ValueError:
                return text
    return text


def _show(value: Any) -> str:
    """A value as the user wrote it in TOML (true, not True), strings quoted."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if value is None:
        return "unset"
    if isinstance(value, list):
        return "[" + ", ".join(_show(v) for v in value) + "]"
    return repr(value)


# -- command line -----------------------------------------------------------------------------------

_OVERRIDE_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\.[A-Za-z_][A-Za-z0-9_]*")


def _is_bool_key(section: str, key: str) -> bool:
    return section in SECTIONS and _hints(SECTIONS[section]).get(key) is bool


def _split_argv(argv: Sequence[str]) -> tuple[str | None, list[tuple[str, str, str]],
                                              dict[str, bool], list[str]]:
    """(config path, overrides as (section, key, text), flags, problems)."""
    config_path: str | None = None
    overrides: list[tuple[str, str, str]] = []
    flags = {"help": False, "print_config": False}
    problems: list[str] = []
    argv = list(argv)
    i = 0
    while i < len(argv):
        arg = argv[i]
        i += 1
        if arg in ("--help", "-h"):
            flags["help"] = True
        elif arg == "--print-config":
            flags["print_config"] = True
        elif arg == "--config" or arg.startswith("--config="):
            if "=" in arg:
                config_path = arg.split("=", 1)[1]
            elif i < len(argv) and not argv[i].startswith("--"):
                config_path, i = argv[i], i + 1
            if not config_path:
                problems.append("--config needs a file path: --config FILE or --config=FILE")
        elif arg.startswith("--") and "." in arg.split("=", 1)[0]:
            name, eq, text = arg[2:].partition("=")
            if not _OVERRIDE_NAME.fullmatch(name):
                problems.append(f"override {arg!r} is malformed; write --section.key=value "
                                "(one dot, letters, digits and underscores)")
                continue
            section, key = name.split(".")
            if not eq:
                # `--section.key value`; a bare boolean key means true (`--checkpoint.enable`).
                # Values may start with a single dash (`-1`), never with two.
                if i < len(argv) and not argv[i].startswith("--") and argv[i] != "-h":
                    text, i = argv[i], i + 1
                elif _is_bool_key(section, key):
                    text = "true"
                else:
                    problems.append(f"override --{name} has no value; write --{name}=VALUE "
                                    f"or --{name} VALUE")
                    continue
            overrides.append((section, key, text))
        else:
            problems.append(f"unrecognised argument {arg!r}; expected --config FILE, "
                            "--section.key=value, --print-config or --help")
    return config_path, overrides, flags, problems


def parse_cli(argv: Sequence[str]) -> tuple[str | None, list[str], dict[str, bool]]:
    """Split argv into (config path, overrides normalised to ``--section.key=value``, flags).

    Flags are ``help`` (``--help``/``-h``) and ``print_config`` (``--print-config``). A boolean
    key may be given bare (``--checkpoint.enable`` means ``=true``). Raises :class:`ConfigError`
    for a malformed override, an override without a value or an unknown argument.

    >>> parse_cli(["--config", "a.toml", "--training.steps", "5", "--print-config"])
    ('a.toml', ['--training.steps=5'], {'help': False, 'print_config': True})
    """
    config_path, overrides, flags, problems = _split_argv(argv)
    if problems:
        raise ConfigError(problems)
    return config_path, [f"--{s}.{k}={v}" for s, k, v in overrides], flags


# -- loading ----------------------------------------------------------------------------------------

def _deep_merge(base: dict[str, Any], child: dict[str, Any]) -> dict[str, Any]:
    """``child`` over ``base``, table by table; lists and scalars are replaced, not merged."""
    out = dict(base)
    for key, value in child.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _deep_merge(out[key], value)
        else:
            out[key] = value
    return out


def _read_toml(path: str, problems: list[str], chain: tuple[tuple[str, str], ...] = (),
               via: str = "") -> dict[str, Any]:
    """The TOML at ``path`` with its ``[job] extends`` chain merged in.

    ``chain`` holds (real path, path as written) of the files that extend this one, to detect
    cycles; ``via`` names the extends entry that led here, for messages.
    """
    real = os.path.realpath(path)
    if any(real == seen for seen, _ in chain):
        names = " -> ".join([shown for _, shown in chain] + [path])
        problems.append(f"job.extends: inheritance cycle {names}; remove one of the extends")
        return {}
    where = f"{via}: " if via else ""
    try:
        with open(path, "rb") as f:
            data = tomllib.load(f)
    except FileNotFoundError:
        problems.append(f"{where}config file {path!r} does not exist")
        return {}
    except OSError as e:
        problems.append(f"{where}config file {path!r} cannot be read: {e.strerror or e}")
        return {}
    except tomllib.TOMLDecodeError as e:
        problems.append(f"{where}config file {path!r} is not valid TOML: {e}")
        return {}
    job = data.get("job")
    base_ref = job.get("extends") if isinstance(job, dict) else None
    if base_ref is None:
        return data
    if not isinstance(base_ref, str) or not base_ref:
        problems.append(f"job.extends = {_show(base_ref)} in {path!r} must be a non-empty path "
                        "string")
        return data
    base_path = os.path.join(os.path.dirname(path), base_ref)
    base = _read_toml(base_path, problems, (*chain, (real, path)),
                      via=f"job.extends = {base_ref!r} in {path!r}")
    return _deep_merge(base, data)


def _unknown_key_message(section: str, key: str) -> str:
    fields = [f.name for f in dataclasses.fields(SECTIONS[section])]
    close = difflib.get_close_matches(key, fields, n=1, cutoff=0.6)
    if close:
        return f"unknown key '{section}.{key}'; did you mean {close[0]!r}?"
    owners = [s for s, cls in SECTIONS.items() if key in {f.name for f in dataclasses.fields(cls)}]
    if owners:
        return f"unknown key '{section}.{key}'; did you mean '{owners[0]}.{key}'?"
    return f"unknown key '{section}.{key}'; known keys in [{section}]: {', '.join(fields)}"


def _apply(raw: dict[str, Any], cfg: JobConfig, problems: list[str], bad: set[str]) -> None:
    """Type-check ``raw`` (sections of TOML values) and set it on ``cfg``.

    A value of the wrong type is not set (the field keeps its default) and its key goes into
    ``bad``, so cross-field rules do not reason about it.
    """
    for section, values in raw.items():
        if section not in SECTIONS:
            if isinstance(values, dict):
                problems.append(f"unknown section [{section}]{_did_you_mean(section, SECTIONS)}")
                continue
            owners = [s for s, cls in SECTIONS.items()
                      if section in {f.name for f in dataclasses.fields(cls)}]
            hint = (f"; did you mean '{owners[0]}.{section}' (under [{owners[0]}])?" if owners
                    else "; put it under its [section]")
            problems.append(f"key {section!r} = {_show(values)} is outside any [section]{hint}")
            continue
        if not isinstance(values, dict):
            problems.append(f"{section} = {_show(values)} must be a [{section}] table of keys")
            continue
        obj, cls = getattr(cfg, section), SECTIONS[section]
        hints = _hints(cls)
        for key, value in values.items():
            if key not in hints:
                problems.append(_unknown_key_message(section, key))
                continue
            try:
                setattr(obj, key, _coerce(value, hints[key]))
            except TypeError:
                bad.add(f"{section}.{key}")
                problems.append(f"{section}.{key} = {_show(value)} has the wrong type: expected "
                                f"{_type_name(hints[key])}, got {_value_type_name(value)}")


def load_config(path: str | None, args: Sequence[str] = (), *,
                world_size: int | None = None) -> JobConfig:
    """Read ``path`` (and what it extends), apply ``args`` overrides, validate, return the config.

    ``args`` are overrides, ``--section.key=value`` or ``--section.key value``; their text is
    parsed by the key's type (booleans as true/false/1/0/yes/no, lists comma-separated).
    ``path=None`` starts from the defaults. With ``world_size`` the parallel degrees are checked
    against it (see :func:`validate`). Raises :class:`ConfigError` listing every problem found.

    >>> load_config(None, ["--parallelism.tensor_parallel_degree", "2"], world_size=8).parallelism.tensor_parallel_degree
    2
    """
    problems: list[str] = []
    raw: dict[str, Any] = _read_toml(path, problems) if path is not None else {}
    config_path, overrides, flags, arg_problems = _split_argv(args)
    problems += arg_problems
    if config_path is not None or any(flags.values()):
        problems.append("load_config() args take only --section.key overrides; pass the config "
                        "file as `path` and handle --help/--print-config with parse_cli()")
    for section, key, text in overrides:
        if (section, key) == ("job", "extends"):
            problems.append(f"--job.extends={text} is not allowed on the command line; "
                            "inheritance is resolved from files (use --config on the child file)")
            continue
        tp = _hints(SECTIONS[section]).get(key) if section in SECTIONS else None
        table = raw.setdefault(section, {})
        if isinstance(table, dict):  # a non-table here is reported by _apply
            table[key] = _parse_cli_value(text, tp) if tp is not None else text
    cfg = JobConfig()
    bad: set[str] = set()
    _apply(raw, cfg, problems, bad)
    problems += _problems(cfg, world_size, bad)
    if problems:
        # A broken base file reached twice (diamond inheritance) would repeat its messages.
        raise ConfigError(list(dict.fromkeys(problems)))
    return cfg


# -- validation -------------------------------------------------------------------------------------

_BOUND_OPS = {"ge": operator.ge, "gt": operator.gt, "le": operator.le, "lt": operator.lt}
_BOUND_WORDS = {"ge": ">=", "gt": ">", "le": "<=", "lt": "<"}


def _bounds_rule(meta: typing.Mapping[str, Any]) -> str:
    return " and ".join(f"{_BOUND_WORDS[k]} {meta[k]:g}" for k in _BOUND_WORDS
                        if meta.get(k) is not None)


def _field_rule(f: dataclasses.Field) -> str:
    """What a field allows, in words ("" when any value of its type is fine)."""
    m = f.metadata
    if m.get("choices") is not None:
        return "one of " + ", ".join(_show(c) for c in m["choices"])
    return m.get("rule") or _bounds_rule(m)


def _field_problems(cfg: JobConfig, skip: set[str]) -> list[str]:
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
            problem = _constraint_problem(f, value)
            if problem:
                problems.append(f"{key} = {_show(value)} {problem}")
                skip.add(key)
    return problems


def _constraint_problem(f: dataclasses.Field, value: Any) -> str | None:
    """What is wrong with a well-typed ``value`` of field ``f`` and what it allows, or None."""
    m = f.metadata
    if value is None:  # an unset optional key has nothing to check
        return None
    if m.get("choices") is not None:
        if value in m["choices"]:  # types are already checked, so True never passes for 1
            return None
        hint = (_did_you_mean(value, m["choices"], fallback=False)
                if isinstance(value, str) and all(isinstance(c, str) for c in m["choices"]) else "")
        return f"is not allowed; choose {_field_rule(f)}{hint}"
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        if any(m.get(k) is not None and not op(value, m[k]) for k, op in _BOUND_OPS.items()):
            return f"is out of range; it must be {_bounds_rule(m)}"
    if m.get("check") is not None:
        allowed = m["check"](value)
        if allowed:
            return f"is not allowed; allowed: {allowed}"
    return None


def _resolve_shard(p: Parallelism, world_size: int | None) -> tuple[int, str | None]:
    """(dp_shard with -1 resolved, the problem if the degrees do not fit ``world_size``)."""
    from titanext.parallel_dims import resolve_dp_shard  # the one owner of degree arithmetic

    try:
        shard = resolve_dp_shard(
            dp_replicate=p.data_parallel_replicate_degree, dp_shard=p.data_parallel_shard_degree,
            cp=p.context_parallel_degree, tp=p.tensor_parallel_degree,
            pp=p.pipeline_parallel_degree, world_size=world_size)
    except ConfigError as e:
        return (1 if p.data_parallel_shard_degree == -1 else p.data_parallel_shard_degree), e.problems[0]
    return shard, None


def _tokenizer_vocab(name: str) -> int:
    from titanext.tokenizer import build_tokenizer

    return build_tokenizer(name).vocab_size


def _model_problems(cfg: JobConfig, skip: set[str], degrees_ok: bool) -> list[str]:
    """Name and flavor against the registry, then the rules that need the model's shape."""
    from titanext.models import MODEL_FLAVORS, get_model_args

    m, t, p = cfg.model, cfg.training, cfg.parallelism
    if skip & {"model.name", "model.flavor"}:
        return []
    if m.name not in MODEL_FLAVORS:
        return [f"model.name = {m.name!r} is not a known model; choose one of "
                f"{', '.join(map(repr, MODEL_FLAVORS))}"
                f"{_did_you_mean(m.name, list(MODEL_FLAVORS), fallback=False)}"]
    flavors = list(MODEL_FLAVORS[m.name])
    if m.flavor not in (*flavors, "hf"):
        return [f"model.flavor = {m.flavor!r} is not a flavor of model {m.name!r}; choose one "
                f"of {', '.join(map(repr, flavors))} or 'hf' (shapes from "
                f"model.hf_assets_path){_did_you_mean(m.flavor, flavors, fallback=False)}"]
    problems = _hf_rule_problems(cfg, skip)
    if m.flavor == "hf":
        if problems or not m.hf_assets_path:
            return problems
        from titanext.models.hf import model_args_from_hf

        args = model_args_from_hf(m.hf_assets_path)
    else:
        args = get_model_args(m.name, m.flavor)
    which = f"{m.name} {m.flavor}"
    tp, pp = p.tensor_parallel_degree, p.pipeline_parallel_degree
    if degrees_ok and tp > 1:
        n_kv_heads = args.n_kv_heads or args.n_heads  # None means multi-head, not grouped
        for attr, value in (("n_heads", args.n_heads), ("n_kv_heads", n_kv_heads),
                            ("vocab_size", args.vocab_size)):
            if value % tp:
                problems.append(f"parallelism.tensor_parallel_degree = {tp} must divide the "
                                f"model's {attr} = {value} ({which}); choose a divisor of {value}")
    if "training.seq_len" not in skip and t.seq_len > args.max_seq_len:
        problems.append(f"training.seq_len = {t.seq_len} exceeds the model's max_seq_len = "
                        f"{args.max_seq_len} ({which})")
    if degrees_ok and pp > args.n_layers:
        problems.append(f"parallelism.pipeline_parallel_degree = {pp} is more than the model's "
                        f"n_layers = {args.n_layers} ({which}); every stage needs a layer")
    if "model.tokenizer" not in skip and m.tokenizer != "hf":  # 'hf': in _hf_rule_problems
        vocab = _tokenizer_vocab(m.tokenizer)
        if args.vocab_size < vocab:
            problems.append(f"model.tokenizer = {m.tokenizer!r} produces {vocab} token ids but "
                            f"the model's vocab_size = {args.vocab_size} ({which}); pick a flavor "
                            f"with vocab_size >= {vocab}")
    return problems


def _hf_rule_problems(cfg: JobConfig, skip: set[str]) -> list[str]:
    """The HF path (docs/hf_checkpoints.md): hf_assets_path files, tokenizer vocab against the
    model, tied embeddings against TP / PP, initial_load_path against the model, HF export."""
    from titanext.models import get_model_args
    from titanext.models.hf import hf_config_from_model_args, hf_problems

    m, c, p = cfg.model, cfg.checkpoint, cfg.parallelism
    problems = []
    if c.initial_load_in_hf and not c.initial_load_path:
        problems.append("checkpoint.initial_load_in_hf = true needs checkpoint.initial_load_path "
                        "(a Hugging Face model directory)")
    if c.last_save_in_hf and not c.enable:
        problems.append("checkpoint.last_save_in_hf = true needs checkpoint.enable = true (the "
                        "HF copy is written next to the final checkpoint)")
    named = None if m.flavor == "hf" else get_model_args(m.name, m.flavor)
    found = hf_problems(
        flavor=m.flavor, tokenizer=m.tokenizer, hf_assets_path=m.hf_assets_path,
        model_vocab=None if named is None else named.vocab_size,
        tp=p.tensor_parallel_degree, pp=p.pipeline_parallel_degree,
        initial_load_path=c.initial_load_path, initial_load_in_hf=c.initial_load_in_hf,
        model_args=named)
    problems.extend(found)
    if c.last_save_in_hf and not found:
        try:
            hf_config_from_model_args(model_args(cfg))
        except ValueError as e:
            problems.append(f"checkpoint.last_save_in_hf = true: {e}")
    return problems


def _moe_overrides(cfg: JobConfig) -> dict[str, Any]:
    return {f.name: getattr(cfg.moe, f.name) for f in dataclasses.fields(MoE)
            if getattr(cfg.moe, f.name) is not None}


def model_args(cfg: JobConfig):
    """The :class:`~titanext.models.ModelArgs` the job trains: the flavor's, with the [moe]
    overrides applied (call on a validated config).

    >>> model_args(load_config("train_configs/debug_moe.toml", ["--moe.top_k=1"])).moe.top_k
    1
    """
    from titanext.models import get_model_args, with_moe_overrides
    from titanext.models.hf import model_args_from_hf

    if cfg.model.flavor == "hf":
        base = model_args_from_hf(cfg.model.hf_assets_path)
    else:
        base = get_model_args(cfg.model.name, cfg.model.flavor)
    return with_moe_overrides(base, **_moe_overrides(cfg))


def _moe_problems(cfg: JobConfig, skip: set[str]) -> list[str]:
    """[moe] against the flavor: only for MoE flavors, and the merged values must fit together."""
    from titanext.models import MODEL_FLAVORS

    m = cfg.model
    if skip & {"model.name", "model.flavor"} or m.flavor not in MODEL_FLAVORS.get(m.name, {}):
        return []
    given = {k: v for k, v in _moe_overrides(cfg).items() if f"moe.{k}" not in skip}
    args = MODEL_FLAVORS[m.name][m.flavor]
    if args.moe is None:
        if not given:
            return []
        moe_flavors = [f for f, a in MODEL_FLAVORS[m.name].items() if a.moe is not None]
        keys = ", ".join(f"moe.{k}" for k in given)
        return [f"{keys} set, but model.flavor = {m.flavor!r} is a dense model (no MoE blocks); "
                f"use a MoE flavor ({', '.join(moe_flavors)}) or remove the [moe] keys"]
    # The flavor's values where the [moe] key is unset (or failed its own check).
    v = {**dataclasses.asdict(args.moe), "n_dense_layers": args.n_dense_layers,
         "moe_layer_interval": args.moe_layer_interval, **given}
    which = f"model.flavor {m.flavor!r} with [moe]"
    problems = []
    e, k, g, lg = v["num_experts"], v["top_k"], v["num_expert_groups"], v["num_limited_groups"]
    if k > e:
        problems.append(f"moe.top_k = {k} must be <= num_experts = {e} ({which})")
    if e % g:
        problems.append(f"moe.num_expert_groups = {g} must divide num_experts = {e} ({which})")
    elif lg > g:
        problems.append(f"moe.num_limited_groups = {lg} must be <= num_expert_groups = {g} ({which})")
    elif k <= e and k > lg * (e // g):
        problems.append(f"moe.top_k = {k} does not fit in the limited groups: num_limited_groups "
                        f"({lg}) x experts per group ({e // g}) = {lg * e // g} ({which})")
    if v["n_dense_layers"] >= args.n_layers:  # the first MoE block is block n_dense_layers
        problems.append(f"moe.n_dense_layers = {v['n_dense_layers']} leaves no MoE block among the "
                        f"model's {args.n_layers} blocks ({which})")
    # Expert parallelism rules on the merged values (experts % ep, ...) belong here.
    return problems


def _ep_problems(cfg: JobConfig, skip: set[str], shard: int | None) -> list[str]:
    """Expert parallelism: a MoE model whose experts split evenly, ranks borrowed from
    dp_shard x cp (``shard``: the resolved dp_shard, None when the degrees do not fit), FSDP."""
    p = cfg.parallelism
    ep, cp = p.expert_parallel_degree, p.context_parallel_degree
    if ep == 1 or skip & {"parallelism.expert_parallel_degree", "model.name", "model.flavor"}:
        return []
    try:
        args = model_args(cfg)
    except (KeyError, ValueError):  # a bad name, flavor or [moe] value: reported elsewhere
        return []
    key = f"parallelism.expert_parallel_degree = {ep}"
    if args.moe is None:
        return [f"{key} needs a MoE model, but model.flavor = {cfg.model.flavor!r} has no MoE "
                "blocks; use a MoE flavor (e.g. 'debugmoe') or set it to 1"]
    problems = []
    if args.moe.num_experts % ep:
        problems.append(f"{key} must divide moe.num_experts = {args.moe.num_experts} (each ep "
                        "rank holds the same number of experts)")
    if shard is not None and (ep % cp or (shard * cp) % ep):
        problems.append(f"{key} must divide data_parallel_shard_degree({shard}) x "
                        f"context_parallel_degree({cp}) = {shard * cp} and be a multiple of "
                        f"context_parallel_degree ({cp}): ep borrows its ranks from dp_shard x cp")
    if p.zero_stage == 1:
        problems.append(f"{key} needs FSDP (zero_stage 2 or 3): parallelism.zero_stage = 1 "
                        "replicates every parameter with DDP, experts included")
    ac = cfg.activation_checkpoint
    if ac.mode == "selective" and ac.selective_ac_option == "op" \
            and "activation_checkpoint.selective_ac_option" not in skip:
        problems.append(f"{key} cannot run with activation_checkpoint.mode = 'selective' and "
                        "selective_ac_option = 'op': with the all-to-alls and the experts' FSDP "
                        "unit inside the block, the recomputation runs other profiler ops than the "
                        "forward, which op-level checkpointing refuses; use mode = 'full' or a layer-level "
                        "selective_ac_option such as '2'")
    return problems


def _float8_problems(cfg: JobConfig, skip: set[str]) -> list[str]:
    """[float8] combinations that cannot work (checked only with float8.enable)."""
    from titanext.plugins.float8 import FLOAT8_ALL_GATHER_RECIPES

    f, p = cfg.float8, cfg.parallelism
    if not f.enable or skip & {"float8.recipe", "float8.enable_fsdp_float8_all_gather"}:
        return []
    problems = []
    if f.enable_fsdp_float8_all_gather and f.recipe not in FLOAT8_ALL_GATHER_RECIPES:
        problems.append(f"float8.enable_fsdp_float8_all_gather = true needs one scale per weight "
                        f"tensor, which recipe = {f.recipe!r} does not have; use recipe = "
                        "'tensorwise' or set enable_fsdp_float8_all_gather = false")
    if f.precompute_scale and not f.enable_fsdp_float8_all_gather:
        problems.append("float8.precompute_scale = true only precomputes the scales of float8 "
                        "all-gathered weights; set enable_fsdp_float8_all_gather = true too, or "
                        "precompute_scale = false")
    if f.enable_fsdp_float8_all_gather and p.zero_stage == 1:
        problems.append("float8.enable_fsdp_float8_all_gather = true needs FSDP, but "
                        "parallelism.zero_stage = 1 replicates parameters (DDP); use zero_stage "
                        "2 or 3")
    if f.recipe == "blockwise" and p.tensor_parallel_degree > 1:
        problems.append(f"float8.recipe = 'blockwise' does not support tensor parallelism "
                        f"(tensor_parallel_degree = {p.tensor_parallel_degree}); use 'tensorwise' "
                        "or 'rowwise' with TP")
    return problems


def _pipeline_composition_problems(cfg: JobConfig, skip: set[str]) -> list[str]:
    """Features that cannot run inside pipeline stages (checked only with pp > 1).

    Everything else composes with PP: FSDP/HSDP, TP/SP with loss parallel, CP (the stages get
    the CP-sharded position ids), float8, full and layer-level AC (tests/test_composition.py).
    ZeRO-1 and DualPipe x TP are rejected by titanext.pipeline.pipeline_config_problems.
    """
    from titanext.schedules import get_schedule_class

    p, ac = cfg.parallelism, cfg.activation_checkpoint
    pp = p.pipeline_parallel_degree
    if pp == 1:
        return []
    problems = []
    try:
        splits = getattr(get_schedule_class(p.pipeline_parallel_schedule), "splits_backward", False)
    except ValueError:  # an unknown schedule is reported by its own check
        splits = False
    if splits and ac.mode == "selective" and ac.selective_ac_option == "op" \
            and not skip & {"activation_checkpoint.mode", "activation_checkpoint.selective_ac_option"}:
        problems.append(f"activation_checkpoint.mode = 'selective' with selective_ac_option = 'op' "
                        f"cannot run under parallelism.pipeline_parallel_schedule = "
                        f"{p.pipeline_parallel_schedule!r}, which splits the backward into input "
                        "and weight gradients (torch's op-level checkpoint allows one backward); "
                        "use mode = 'full', a layer-level selective_ac_option such as '2', or a "
                        "schedule without split backward (1F1B, Interleaved1F1B, GPipe)")
    return problems


def _problems(cfg: JobConfig, world_size: int | None, skip: set[str]) -> list[str]:
    """Every problem of ``cfg``; keys in ``skip`` are known bad and left out of the rules."""
    skip = set(skip)
    problems = _field_problems(cfg, skip)
    if world_size is not None and (isinstance(world_size, bool) or not isinstance(world_size, int)
                                   or world_size < 1):
        problems.append(f"world size {world_size!r} must be a positive integer")
        world_size = None

    def ok(*keys: str) -> bool:
        """True when none of ``keys`` failed its own check (bare names are parallelism keys)."""
        return not skip.intersection(k if "." in k else f"parallelism.{k}" for k in keys)

    p, t = cfg.parallelism, cfg.training
    degrees_ok = ok("data_parallel_replicate_degree", "data_parallel_shard_degree",
                    "context_parallel_degree", "tensor_parallel_degree",
                    "pipeline_parallel_degree")
    rep, cp, tp = p.data_parallel_replicate_degree, p.context_parallel_degree, p.tensor_parallel_degree

    shard = None
    if degrees_ok:
        shard, problem = _resolve_shard(p, world_size)
        if problem:
            problems.append(problem)
            shard = None  # batch arithmetic on a layout that cannot exist says nothing useful

    if degrees_ok and ok("training.seq_len", "enable_sequence_parallel"):
        sp = tp > 1 and p.enable_sequence_parallel  # SP shards the sequence over tp as well
        zigzag = p.context_parallel_load_balance == "zigzag"
        if cp > 1 and t.seq_len % ((2 if zigzag else 1) * cp * (tp if sp else 1)):
            # Zigzag CP cuts each sequence into 2 x cp chunks (contiguous CP into cp), which SP
            # then splits by tp.
            need = (2 if zigzag else 1) * cp * (tp if sp else 1)
            sp_part = f" x tensor_parallel_degree({tp}) (sequence parallel)" if sp else ""
            two = "2 x " if zigzag else ""
            problems.append(f"training.seq_len = {t.seq_len} must be divisible by {two}"
                            f"context_parallel_degree({cp}){sp_part} = {need}")
        elif cp == 1 and sp and t.seq_len % tp:
            problems.append(f"training.seq_len = {t.seq_len} must be divisible by "
                            f"tensor_parallel_degree = {tp} with enable_sequence_parallel = true")

    problems += _model_problems(cfg, skip, degrees_ok)
    if degrees_ok and p.pipeline_parallel_degree > 1 and ok("pipeline_parallel_schedule"):
        from titanext.pipeline import pipeline_config_problems

        problems += pipeline_config_problems(cfg)
    problems += _float8_problems(cfg, skip)
    problems += _moe_problems(cfg, skip)
    problems += _ep_problems(cfg, skip, shard if degrees_ok else None)
    if degrees_ok:
        problems += _pipeline_composition_problems(cfg, skip)

    if shard is not None and ok("training.local_batch_size", "training.global_batch_size"):
        dp = rep * shard
        per_step = t.local_batch_size * dp
        if t.global_batch_size != -1 and t.global_batch_size % per_step:
            problems.append(
                f"training.global_batch_size = {t.global_batch_size} must be a multiple of "
                f"local_batch_size({t.local_batch_size}) x dp({dp}) = {per_step}, where dp = "
                f"data_parallel_replicate_degree({rep}) x data_parallel_shard_degree({shard}); "
                "gradient accumulation runs global / (local x dp) micro-batches per step")

    if ok("zero_stage", "tensor_parallel_degree", "data_parallel_replicate_degree") \
            and p.zero_stage == 1 and (tp > 1 or rep > 1):
        problems.append(
            f"parallelism.zero_stage = 1 (DDP + sharded optimizer state over replicated "
            f"parameters) needs tensor_parallel_degree = 1 and data_parallel_replicate_degree = 1,"
            f" got {tp} and {rep}; use zero_stage 2 or 3")
    if ok("zero_stage", "fsdp_reshard_after_forward") and p.zero_stage == 2 \
            and p.fsdp_reshard_after_forward != "default":
        problems.append(
            f"parallelism.fsdp_reshard_after_forward = {p.fsdp_reshard_after_forward!r} conflicts "
            "with zero_stage = 2, which never reshards after forward; leave it 'default' or use "
            "zero_stage = 3")

    if ok("training.dataset", "training.dataset_path"):
        if t.dataset == "text":
            if not t.dataset_path:
                problems.append("training.dataset = 'text' needs training.dataset_path (a .txt or "
                                ".jsonl file, or a folder of them), which is unset")
            elif not os.path.exists(t.dataset_path):
                problems.append(f"training.dataset_path = {t.dataset_path!r} does not exist "
                                f"(relative paths start at {os.getcwd()!r})")
        elif t.dataset_path:
            problems.append(f"training.dataset_path = {t.dataset_path!r} is only read with "
                            f"dataset = 'text', but training.dataset = {t.dataset!r}; set "
                            "dataset = 'text' or dataset_path = \"\"")
    return problems


def validate(cfg: JobConfig, world_size: int | None = None) -> None:
    """Check every field and every cross-field rule; raise :class:`ConfigError` listing all.

    Works on any :class:`JobConfig`, including one built or modified in Python. With
    ``world_size`` the degrees must multiply to it (``data_parallel_shard_degree = -1`` takes the
    rest); without it only what does not depend on it is checked, with -1 counted as 1.

    >>> validate(JobConfig(), world_size=4)
    """
    problems = _problems(cfg, world_size, set())
    if problems:
        raise ConfigError(problems)


def resolved_dp_shard(cfg: JobConfig, world_size: int | None) -> int:
    """``data_parallel_shard_degree`` with -1 resolved to the rest of the world (1 without one).

    Raises :class:`ConfigError` when the degrees cannot fit ``world_size``.

    >>> resolved_dp_shard(load_config(None, ["--parallelism.tensor_parallel_degree=2"]), 8)
    4
    """
    shard, problem = _resolve_shard(cfg.parallelism, world_size)
    if problem:
        raise ConfigError([problem])
    return shard


def gradient_accumulation_steps(cfg: JobConfig, world_size: int | None) -> int:
    """Micro-batches per optimizer step: global_batch_size / (local_batch_size x dp).

    1 when ``global_batch_size = -1``. Raises :class:`ConfigError` when it is not a whole number.

    >>> gradient_accumulation_steps(load_config(None, ["--training.global_batch_size=64"]), 4)
    2
    """
    t, p = cfg.training, cfg.parallelism
    if t.global_batch_size == -1:
        return 1
    dp = p.data_parallel_replicate_degree * resolved_dp_shard(cfg, world_size)
    per_step = t.local_batch_size * dp
    if t.global_batch_size < per_step or t.global_batch_size % per_step:
        raise ConfigError([f"training.global_batch_size = {t.global_batch_size} must be a "
                           f"multiple of local_batch_size({t.local_batch_size}) x dp({dp}) = "
                           f"{per_step}"])
    return t.global_batch_size // per_step


# -- output -----------------------------------------------------------------------------------------

def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        # JSON string escapes (\n, \", \\, \uXXXX) are all valid TOML basic-string escapes.
        return json.dumps(value, ensure_ascii=False)
    if isinstance(value, list):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    return repr(value)  # ints, and floats as repr (1e-08, inf) which TOML reads back exactly


def to_toml(cfg: JobConfig) -> str:
    """The resolved config as TOML, every key listed; :func:`load_config` reads it back equal.

    Unset optional keys are left out (TOML has no null), and so is ``job.extends``, since the
    inherited values are already in the output.

    >>> print(to_toml(JobConfig()).splitlines()[1])
    [job]
    """
    out = ["# resolved titanext config (inheritance and overrides applied)"]
    for section in SECTIONS:
        out.append(f"[{section}]")
        obj = getattr(cfg, section)
        for f in dataclasses.fields(obj):
            value = getattr(obj, f.name)
            if value is None or (section, f.name) == ("job", "extends"):
                continue
            out.append(f"{f.name} = {_toml_value(value)}")
        out.append("")
    return "\n".join(out)


def config_help(width: int = 96) -> str:
    """Every section and key with its type, default, allowed values and docstring (``--help``).

    >>> "--training.seq_len" in config_help()
    True
    """
    docs = field_docs()
    section_docs = _ATTRIBUTE_DOCS.get(JobConfig.__name__, {})
    lines = [
        "usage: torchrun --nproc_per_node N -m titanext.train --config FILE "
        "[--section.key=value ...]",
        "       python -m titanext.train --config FILE --print-config | --help",
        "",
        *textwrap.wrap("Every key below can be set in the TOML file ([section] then key = value) "
                       "or overridden on the command line as --section.key=value or "
                       "--section.key value. Lists are comma-separated on the command line; "
                       "a bare boolean key means true.", width=width),
    ]
    for section, cls in SECTIONS.items():
        lines += ["", f"[{section}]" + (f"  {section_docs[section]}" if section in section_docs
                                        else "")]
        hints = _hints(cls)
        for f in dataclasses.fields(cls):
            default = (f.default_factory() if f.default_factory is not dataclasses.MISSING
                       else f.default)
            shown = "unset" if default is None else _toml_value(default)
            rule = _field_rule(f)
            lines.append(f"  --{section}.{f.name}  ({_type_name(hints[f.name])}, default {shown}"
                         + (f"; {rule}" if rule else "") + ")")
            lines += textwrap.wrap(docs[(section, f.name)], width=width,
                                   initial_indent="      ", subsequent_indent="      ")
    return "\n".join(lines)
