"""Typed job configuration: TOML files + CLI overrides -> :class:`JobConfig`.

Each TOML section is a dataclass below, and every key carries an attribute docstring that
doubles as ``--help`` text. Loading is strict: unknown sections and keys (with a
did-you-mean hint), wrong types, out-of-range values, values outside an enum and cross-field
rules are all collected and raised together as one :class:`ConfigError`, before any process
group exists and before anything touches the disk.

>>> cfg = load_config("train_configs/debug_model.toml", ["--training.steps=10"], world_size=4)
>>> cfg.training.steps
10

A file can inherit from another with ``[job] extends = "base.toml"`` (relative to the file).
"""

from __future__ import annotations

import ast
import dataclasses
import difflib
import functools
import inspect
import os
import sys
import textwrap
import types
import typing
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Union

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

__all__ = [
    "ConfigError",
    "JobConfig",
    "config_help",
    "gradient_accumulation_steps",
    "load_config",
    "parse_cli",
    "resolved_dp_shard",
    "to_toml",
    "validate",
]


class ConfigError(ValueError):
    """Every user-facing config problem; ``problems`` holds one line per problem."""

    def __init__(self, problems: Sequence[str] | str):
        self.problems = [problems] if isinstance(problems, str) else list(problems)
        super().__init__("\n".join(self.problems))


# -- field helpers: constraints live next to the field ------------------------------------------

def _f(default: Any, *, choices: Sequence[Any] | None = None, ge: float | None = None,
       gt: float | None = None, le: float | None = None, lt: float | None = None) -> Any:
    meta = {"choices": choices, "ge": ge, "gt": gt, "le": le, "lt": lt}
    if isinstance(default, list):
        return field(default_factory=lambda: list(default), metadata=meta)
    return field(default=default, metadata=meta)


@dataclass
class Job:
    dump_folder: str = _f("./outputs")
    """Folder for this job's outputs: checkpoints and TensorBoard events go below it."""
    description: str = _f("")
    """Free text describing the job; printed nowhere, kept with the config."""
    extends: str | None = _f(None)
    """Path of a base TOML file (relative to this file) whose values this file overrides."""


@dataclass
class Model:
    name: str = _f("llama3")
    """Model family (a key of titanext.models.MODEL_FLAVORS)."""
    flavor: str = _f("debugmodel")
    """Named size of the model family, e.g. debugmodel, 1B, 8B, 70B, 405B."""
    tokenizer: str = _f("byte", choices=("byte",))
    """Tokenizer: 'byte' is the built-in byte-level tokenizer (258 ids)."""


@dataclass
class Training:
    local_batch_size: int = _f(8, ge=1)
    """Sequences per micro-batch on each data-parallel rank."""
    global_batch_size: int = _f(-1)
    """Sequences per optimizer step over all ranks; -1 means local_batch_size x dp. Larger values
    give gradient accumulation of global / (local x dp) micro-batches."""
    seq_len: int = _f(256, ge=1)
    """Tokens per sequence."""
    steps: int = _f(1000, ge=1)
    """Optimizer steps to train for."""
    max_norm: float = _f(1.0, ge=0)
    """Global gradient-norm clipping threshold; 0 disables clipping (the norm is still logged)."""
    mixed_precision_param: str = _f("auto", choices=("auto", "bfloat16", "float32"))
    """FSDP parameter dtype for compute: auto = bfloat16 on CUDA, float32 on CPU."""
    mixed_precision_reduce: str = _f("float32", choices=("float32", "bfloat16"))
    """FSDP gradient reduce-scatter dtype."""
    seed: int = _f(0, ge=0)
    """Seed for initialisation and data order; the same seed gives the same model in any layout."""
    deterministic: bool = _f(False)
    """Use deterministic algorithms only (slower; bitwise-repeatable runs)."""
    dataset: str = _f("shakespeare", choices=("shakespeare", "text", "synthetic"))
    """Data source: the built-in Shakespeare corpus, your own files ('text', see dataset_path),
    or synthetic tokens."""
    dataset_path: str | None = _f(None)
    """For dataset = 'text': a .txt or .jsonl file (field 'text'), or a folder of them."""
    shuffle: bool = _f(True)
    """Shuffle the order of sequence windows each epoch (deterministically from the seed)."""


@dataclass
class Optimizer:
    name: str = _f("AdamW", choices=("AdamW", "Adam"))
    """Optimizer class."""
    lr: float = _f(8e-4, gt=0)
    """Peak learning rate."""
    beta1: float = _f(0.9, ge=0, lt=1)
    """Adam beta1."""
    beta2: float = _f(0.95, ge=0, lt=1)
    """Adam beta2."""
    eps: float = _f(1e-8, gt=0)
    """Adam epsilon."""
    weight_decay: float = _f(0.1, ge=0)
    """Decoupled weight decay (AdamW)."""
    implementation: str = _f("foreach", choices=("for-loop", "foreach", "fused"))
    """Kernel implementation of the optimizer step."""


@dataclass
class LRScheduler:
    warmup_steps: int = _f(2, ge=0)
    """Steps of linear warmup to the peak learning rate."""
    decay_ratio: float | None = _f(None, ge=0, le=1)
    """Fraction of all steps spent decaying at the end (warmup-stable-decay); unset = decay
    over every step after warmup."""
    decay_type: str = _f("linear", choices=("linear", "sqrt", "cosine"))
    """Shape of the decay."""
    min_lr_factor: float = _f(0.0, ge=0, le=1)
    """Final learning rate as a fraction of the peak."""


@dataclass
class Parallelism:
    data_parallel_replicate_degree: int = _f(1, ge=1)
    """Replicas of the model (DDP-style; with FSDP this is HSDP's replicate dimension)."""
    data_parallel_shard_degree: int = _f(-1)
    """Ranks that shard parameters (FSDP); -1 means the rest of the world size."""
    fsdp_reshard_after_forward: str = _f("default", choices=("default", "always", "never"))
    """Free gathered parameters after forward: default = yes, except with pipeline parallelism."""
    zero_stage: int = _f(3, choices=(1, 2, 3))
    """ZeRO stage: 1 = replicated params (DDP) + sharded optimizer state, 2 = FSDP without
    resharding after forward, 3 = full FSDP."""
    tensor_parallel_degree: int = _f(1, ge=1)
    """Ranks that split each layer's matmuls (Megatron-style TP)."""
    enable_sequence_parallel: bool = _f(True)
    """With TP, shard norms and residual activations along the sequence (SP)."""
    enable_loss_parallel: bool = _f(True)
    """With TP, keep logits sharded over the vocabulary and compute the loss in parallel."""
    context_parallel_degree: int = _f(1, ge=1)
    """Ranks that split each sequence (context parallelism)."""
    pipeline_parallel_degree: int = _f(1, ge=1)
    """Pipeline stages over ranks."""
    expert_parallel_degree: int = _f(1, ge=1)
    """Ranks that split the experts of MoE layers (borrowed from dp_shard x cp)."""


_DEFAULT_SAVE_OPS = [
    "mm",
    "addmm",
    "bmm",
    "_scaled_dot_product_flash_attention",
    "_scaled_dot_product_efficient_attention",
    "_scaled_dot_product_flash_attention_for_cpu",
]


@dataclass
class ActivationCheckpoint:
    mode: str = _f("none", choices=("none", "selective", "full"))
    """Recompute activations in backward: none, selective or full (every block)."""
    selective_ac_option: str = _f("op")
    """For selective mode: 'op' (save the outputs of selective_op_save_list, recompute the
    rest) or a positive integer n (fully checkpoint every n-th block)."""
    selective_op_save_list: list[str] = _f(_DEFAULT_SAVE_OPS)
    """aten op names whose outputs op-level selective AC keeps."""


@dataclass
class Compile:
    enable: bool = _f(False)
    """torch.compile each transformer block (and the loss, see components)."""
    components: list[str] = _f(["model"])
    """What to compile: any of model, loss."""
    backend: str = _f("inductor", choices=("inductor", "aot_eager", "eager"))
    """torch.compile backend."""


@dataclass
class Checkpoint:
    enable: bool = _f(False)
    """Save and resume distributed checkpoints (torch.distributed.checkpoint)."""
    folder: str = _f("checkpoint")
    """Checkpoint folder, relative to job.dump_folder."""
    interval: int = _f(100, ge=1)
    """Save every this many steps."""
    load_step: Union[int, str] = _f("latest")
    """Step to resume from: 'latest', 'none' (start fresh) or a step number."""
    keep_latest_k: int = _f(0, ge=0)
    """Keep only the newest k checkpoints; 0 keeps all."""
    last_save: bool = _f(True)
    """Also save after the final step."""


@dataclass
class Metrics:
    log_freq: int = _f(10, ge=1)
    """Log a metrics line every this many steps (and at the first and last)."""
    enable_tensorboard: bool = _f(True)
    """Write TensorBoard event files under job.dump_folder/save_tb_folder."""
    save_tb_folder: str = _f("tb")
    """TensorBoard folder, relative to job.dump_folder."""
    disable_color_printing: bool = _f(False)
    """Plain log lines without ANSI colours."""
    progress_bar: bool = _f(True)
    """Draw a progress bar with ETA (only when stdout is a terminal)."""


@dataclass
class Comm:
    init_timeout_seconds: int = _f(300, ge=1)
    """Collective timeout during start-up (model build, checkpoint load, compile)."""
    train_timeout_seconds: int = _f(100, ge=1)
    """Collective timeout once training runs: a dead or stuck rank fails the job after this."""


@dataclass
class JobConfig:
    job: Job = field(default_factory=Job)
    model: Model = field(default_factory=Model)
    training: Training = field(default_factory=Training)
    optimizer: Optimizer = field(default_factory=Optimizer)
    lr_scheduler: LRScheduler = field(default_factory=LRScheduler)
    parallelism: Parallelism = field(default_factory=Parallelism)
    activation_checkpoint: ActivationCheckpoint = field(default_factory=ActivationCheckpoint)
    compile: Compile = field(default_factory=Compile)
    checkpoint: Checkpoint = field(default_factory=Checkpoint)
    metrics: Metrics = field(default_factory=Metrics)
    comm: Comm = field(default_factory=Comm)


SECTIONS: dict[str, type] = {f.name: f.default_factory for f in dataclasses.fields(JobConfig)}  # type: ignore[misc]


# -- docstrings --------------------------------------------------------------------------------

@functools.cache
def field_docs() -> dict[tuple[str, str], str]:
    """(section, key) -> the attribute docstring written under the field."""
    tree = ast.parse(inspect.getsource(sys.modules[__name__]))
    by_class = {}
    for node in tree.body:
        if isinstance(node, ast.ClassDef):
            docs = {}
            body = node.body
            for a, b in zip(body, body[1:]):
                if (isinstance(a, ast.AnnAssign) and isinstance(a.target, ast.Name)
                        and isinstance(b, ast.Expr) and isinstance(b.value, ast.Constant)
                        and isinstance(b.value.value, str)):
                    docs[a.target.id] = " ".join(b.value.value.split())
            by_class[node.name] = docs
    out = {}
    for section, cls in SECTIONS.items():
        for f in dataclasses.fields(cls):
            out[(section, f.name)] = by_class.get(cls.__name__, {}).get(f.name, "")
    return out


# -- types ------------------------------------------------------------------------------------

@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _type_name(tp: Any) -> str:
    args = typing.get_args(tp)
    if typing.get_origin(tp) in (Union, types.UnionType):
        return " or ".join("none" if a is type(None) else _type_name(a) for a in args)
    if typing.get_origin(tp) is list:
        return f"list of {_type_name(args[0])}"
    return {int: "integer", float: "number", bool: "boolean", str: "string"}.get(tp, str(tp))


def _coerce(value: Any, tp: Any) -> Any:
    """Check a TOML value against ``tp``; return it (converted) or raise TypeError."""
    origin = typing.get_origin(tp)
    if origin in (Union, types.UnionType):
        for arg in typing.get_args(tp):
            if arg is type(None):
                continue
            try:
                return _coerce(value, arg)
            except TypeError:
                pass
        raise TypeError
    if origin is list:
        if not isinstance(value, list):
            raise TypeError
        return [_coerce(v, typing.get_args(tp)[0]) for v in value]
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise TypeError
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise TypeError
    if tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        raise TypeError
    if tp is str:
        if isinstance(value, str):
            return value
        raise TypeError
    raise TypeError


def _parse_cli_value(text: str, tp: Any) -> Any:
    """Turn a CLI string into a TOML-like value for ``tp`` (then checked by _coerce)."""
    origin = typing.get_origin(tp)
    if origin in (Union, types.UnionType):
        non_none = [a for a in typing.get_args(tp) if a is not type(None)]
        for arg in non_none:
            try:
                return _coerce(_parse_cli_value(text, arg), arg)
            except (TypeError, ValueError):
                pass
        return text
    if origin is list:
        return [_parse_cli_value(p.strip(), typing.get_args(tp)[0]) for p in text.split(",") if p.strip()]
    if tp is bool:
        low = text.lower()
        if low in ("true", "1", "yes", "on"):
            return True
        if low in ("false", "0", "no", "off"):
            return False
        return text
    if tp is int:
        try:
            return int(text)
        except ValueError:
            return text
    if tp is float:
        try:
            return float(text)
        except ValueError:
            return text
    return text


# -- loading ----------------------------------------------------------------------------------

def _read_toml(path: str, problems: list[str], chain: tuple[str, ...] = ()) -> dict[str, Any]:
    real = os.path.realpath(path)
    if real in chain:
        problems.append(f"job.extends: inheritance cycle {' -> '.join([*chain, real])}")
        return {}
    try:
        with open(path, "rb") as f:
            data = tomllib.load(f)
    except FileNotFoundError:
        where = f" (extended from {chain[-1]})" if chain else ""
        problems.append(f"config file {path!r} does not exist{where}")
        return {}
    except tomllib.TOMLDecodeError as e:
        problems.append(f"config file {path!r} is not valid TOML: {e}")
        return {}
    base_ref = data.get("job", {}).get("extends") if isinstance(data.get("job"), dict) else None
    if not base_ref:
        return data
    if not isinstance(base_ref, str):
        problems.append(f"job.extends = {base_ref!r} must be a string path")
        return data
    base_path = os.path.join(os.path.dirname(path), base_ref)
    base = _read_toml(base_path, problems, (*chain, real))
    merged = {k: dict(v) if isinstance(v, dict) else v for k, v in base.items()}
    for section, values in data.items():
        if isinstance(values, dict) and isinstance(merged.get(section), dict):
            merged[section].update(values)
        else:
            merged[section] = values
    return merged


def _hint(name: str, choices: Sequence[str]) -> str:
    close = difflib.get_close_matches(name, list(choices), n=1, cutoff=0.6)
    return f"; did you mean {close[0]!r}?" if close else f"; known: {', '.join(choices)}"


def _check_field(section: str, f: dataclasses.Field, value: Any, problems: list[str]) -> None:
    key = f"{section}.{f.name}"
    m = f.metadata
    if m.get("choices") is not None and value not in m["choices"]:
        allowed = ", ".join(repr(c) for c in m["choices"])
        problems.append(f"{key} = {value!r} is not allowed; choose one of {allowed}")
        return
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        for bound, ok, word in (("ge", lambda v, b: v >= b, ">="), ("gt", lambda v, b: v > b, ">"),
                                ("le", lambda v, b: v <= b, "<="), ("lt", lambda v, b: v < b, "<")):
            b = m.get(bound)
            if b is not None and not ok(value, b):
                problems.append(f"{key} = {value!r} is out of range; it must be {word} {b}")
                return


def parse_cli(argv: Sequence[str]) -> tuple[str | None, list[str], dict[str, bool]]:
    """Split argv into (config path, normalised ``--section.key=value`` overrides, flags).

    Flags: ``help`` (``--help``/``-h``) and ``print_config`` (``--print-config``). A boolean key
    may be given bare (``--checkpoint.enable``).
    """
    config_path, overrides, problems = None, [], []
    flags = {"help": False, "print_config": False}
    i, argv = 0, list(argv)
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
            elif i < len(argv):
                config_path, i = argv[i], i + 1
            else:
                problems.append("--config needs a file path")
        elif arg.startswith("--") and "." in arg.split("=", 1)[0]:
            name, eq, value = arg[2:].partition("=")
            if not eq:
                section, _, key = name.partition(".")
                is_bool = section in SECTIONS and _hints(SECTIONS[section]).get(key) is bool
                if i < len(argv) and not argv[i].startswith("--"):
                    value, i = argv[i], i + 1
                elif is_bool:
                    value = "true"
                else:
                    problems.append(f"override --{name} has no value; write --{name}=VALUE")
                    continue
            overrides.append(f"--{name}={value}")
        else:
            problems.append(f"unrecognised argument {arg!r}; expected --config FILE, "
                            "--section.key=value, --print-config or --help")
    if problems:
        raise ConfigError(problems)
    return config_path, overrides, flags


def load_config(path: str | None, args: Sequence[str] = (), *, world_size: int | None = None) -> JobConfig:
    """Read ``path`` (and what it extends), apply ``args`` overrides, validate, return the config.

    Raises :class:`ConfigError` listing every problem found. Nothing is written anywhere.
    """
    problems: list[str] = []
    raw: dict[str, Any] = _read_toml(path, problems) if path else {}
    try:
        _, args, _ = parse_cli(args)  # accepts both --a.b=v and --a.b v
    except ConfigError as e:
        problems += e.problems
        args = []
    # CLI overrides are strings; parse them with the target field's type.
    for arg in args:
        if not arg.startswith("--") or "=" not in arg or "." not in arg.split("=", 1)[0]:
            problems.append(f"override {arg!r} must look like --section.key=value")
            continue
        name, value = arg[2:].split("=", 1)
        section, key = name.split(".", 1)
        tp = _hints(SECTIONS[section]).get(key) if section in SECTIONS else None
        raw.setdefault(section, {})
        if isinstance(raw[section], dict):
            raw[section][key] = _parse_cli_value(value, tp) if tp is not None else value
    cfg = JobConfig()
    for section, values in raw.items():
        if section not in SECTIONS:
            problems.append(f"unknown section [{section}]{_hint(section, list(SECTIONS))}")
            continue
        if not isinstance(values, dict):
            problems.append(f"[{section}] must be a table of keys, got {values!r}")
            continue
        obj, cls = getattr(cfg, section), SECTIONS[section]
        fields = {f.name: f for f in dataclasses.fields(cls)}
        for key, value in values.items():
            if key not in fields:
                problems.append(f"unknown key '{section}.{key}'{_hint(key, list(fields))}")
                continue
            tp = _hints(cls)[key]
            try:
                value = _coerce(value, tp)
            except TypeError:
                problems.append(f"{section}.{key} = {value!r} has the wrong type; expected {_type_name(tp)}")
                continue
            setattr(obj, key, value)
    for section in SECTIONS:
        for f in dataclasses.fields(SECTIONS[section]):
            _check_field(section, f, getattr(getattr(cfg, section), f.name), problems)
    if problems:  # cross-field rules assume each field is individually sane
        raise ConfigError(problems)
    validate(cfg, world_size)
    return cfg


_TOKENIZER_VOCAB = {"byte": 258}  # ids of each built-in tokenizer


# -- cross-field validation ---------------------------------------------------------------------

def resolved_dp_shard(cfg: JobConfig, world_size: int | None) -> int:
    """data_parallel_shard_degree with -1 resolved to the rest of the world (1 if unknown)."""
    p = cfg.parallelism
    if p.data_parallel_shard_degree != -1:
        return p.data_parallel_shard_degree
    if world_size is None:
        return 1
    others = (p.data_parallel_replicate_degree * p.context_parallel_degree
              * p.tensor_parallel_degree * p.pipeline_parallel_degree)
    return world_size // others if world_size % others == 0 else 1


def gradient_accumulation_steps(cfg: JobConfig, world_size: int | None) -> int:
    t = cfg.training
    if t.global_batch_size == -1:
        return 1
    dp = cfg.parallelism.data_parallel_replicate_degree * resolved_dp_shard(cfg, world_size)
    return max(1, t.global_batch_size // (t.local_batch_size * dp))


def _not_yet_supported(cfg: JobConfig) -> list[str]:
    """Degrees the trainer cannot run yet. Remove each line as its feature lands."""
    p, out = cfg.parallelism, []
    for key, what in (("context_parallel_degree", "context"), ("pipeline_parallel_degree", "pipeline"),
                      ("expert_parallel_degree", "expert")):
        value = getattr(p, key)
        if value > 1:
            out.append(f"parallelism.{key} = {value} is not supported yet by the trainer "
                       f"({what} parallelism lands in a later release); set it to 1")
    return out


def validate(cfg: JobConfig, world_size: int | None = None) -> None:
    """Cross-field rules; raises :class:`ConfigError` with one line per broken rule."""
    from titanext.models import get_model_args

    problems = _not_yet_supported(cfg)
    p, t = cfg.parallelism, cfg.training
    dp_rep, cp, tp, pp = (p.data_parallel_replicate_degree, p.context_parallel_degree,
                          p.tensor_parallel_degree, p.pipeline_parallel_degree)
    shard = p.data_parallel_shard_degree
    if shard == 0 or shard < -1:
        problems.append(f"parallelism.data_parallel_shard_degree = {shard} must be -1 (the rest) or >= 1")
        shard = 1
    others = dp_rep * cp * tp * pp
    if world_size is not None:
        if shard == -1:
            if world_size % others:
                problems.append(
                    f"parallelism: world size {world_size} is not divisible by dp_replicate({dp_rep}) x "
                    f"cp({cp}) x tp({tp}) x pp({pp}) = {others}, so data_parallel_shard_degree = -1 "
                    "cannot fill the rest")
            shard = max(1, world_size // others)
        elif others * shard != world_size:
            problems.append(
                f"parallelism: dp_replicate({dp_rep}) x dp_shard({shard}) x cp({cp}) x tp({tp}) x "
                f"pp({pp}) = {others * shard} must equal the world size {world_size}")
    elif shard == -1:
        shard = 1
    sp = tp > 1 and p.enable_sequence_parallel
    if cp > 1 and t.seq_len % (2 * cp * (tp if sp else 1)):
        need = 2 * cp * (tp if sp else 1)
        problems.append(f"training.seq_len = {t.seq_len} must be divisible by 2 x cp"
                        f"{' x tp' if sp else ''} = {need} (context parallelism)")
    elif sp and t.seq_len % tp:
        problems.append(f"training.seq_len = {t.seq_len} must be divisible by "
                        f"tensor_parallel_degree = {tp} (sequence parallelism)")
    dp = dp_rep * shard
    if t.global_batch_size != -1:
        per_micro = t.local_batch_size * dp
        if t.global_batch_size < 1 or t.global_batch_size % per_micro:
            problems.append(
                f"training.global_batch_size = {t.global_batch_size} must be a positive multiple of "
                f"local_batch_size({t.local_batch_size}) x dp({dp}) = {per_micro}")
    if t.dataset == "text" and not t.dataset_path:
        problems.append("training.dataset = 'text' needs training.dataset_path (a .txt/.jsonl file or folder)")
    if t.dataset_path and not os.path.exists(t.dataset_path):
        problems.append(f"training.dataset_path = {t.dataset_path!r} does not exist")
    if p.zero_stage == 1 and (tp > 1 or dp_rep > 1):
        problems.append(
            f"parallelism.zero_stage = 1 (DDP + sharded optimizer) needs tensor_parallel_degree = 1 and "
            f"data_parallel_replicate_degree = 1 (got {tp} and {dp_rep}); use zero_stage 2 or 3")
    if p.zero_stage == 2 and p.fsdp_reshard_after_forward != "default":
        problems.append(
            f"parallelism.fsdp_reshard_after_forward = {p.fsdp_reshard_after_forward!r} conflicts with "
            "zero_stage = 2 (which never reshards after forward); leave it 'default' or use zero_stage 3")
    ac = cfg.activation_checkpoint
    if ac.selective_ac_option != "op" and not (ac.selective_ac_option.isdigit() and int(ac.selective_ac_option) >= 1):
        problems.append(f"activation_checkpoint.selective_ac_option = {ac.selective_ac_option!r}; "
                        "allowed: 'op' or a positive integer such as '2'")
    import torch

    for op in ac.selective_op_save_list:
        if not hasattr(torch.ops.aten, op):
            problems.append(f"activation_checkpoint.selective_op_save_list: {op!r} is not an aten op")
    bad = [c for c in cfg.compile.components if c not in ("model", "loss")]
    if bad:
        problems.append(f"compile.components = {cfg.compile.components!r}: {bad[0]!r} is not allowed; "
                        "choose from 'model', 'loss'")
    ls = cfg.checkpoint.load_step
    if not ((isinstance(ls, int) and ls >= -1) or ls in ("latest", "none")):
        problems.append(f"checkpoint.load_step = {ls!r}; allowed: 'latest', 'none' or a step number >= 0")
    try:
        args = get_model_args(cfg.model.name, cfg.model.flavor)
    except KeyError as e:
        key = "model.name" if "model name" in str(e) else "model.flavor"
        problems.append(f"{key}: {e.args[0]}")
        args = None
    if args is not None:
        flavor = f"{cfg.model.name}/{cfg.model.flavor}"
        if tp > 1:
            for attr in ("n_heads", "kv_heads", "vocab_size"):
                value = getattr(args, attr)
                if value % tp:
                    problems.append(f"parallelism.tensor_parallel_degree = {tp} must divide the model's "
                                    f"{attr.replace('kv_heads', 'n_kv_heads')} ({value}, {flavor})")
        if t.seq_len > args.max_seq_len:
            problems.append(f"training.seq_len = {t.seq_len} exceeds the model's max_seq_len "
                            f"({args.max_seq_len}, {flavor})")
        if pp > args.n_layers:
            problems.append(f"parallelism.pipeline_parallel_degree = {pp} exceeds the model's "
                            f"{args.n_layers} layers ({flavor})")
        tok_vocab = _TOKENIZER_VOCAB.get(cfg.model.tokenizer, 0)
        if args.vocab_size < tok_vocab:
            problems.append(f"model.tokenizer = {cfg.model.tokenizer!r} has {tok_vocab} ids but the model's "
                            f"vocab_size is {args.vocab_size} ({flavor})")
    if problems:
        raise ConfigError(problems)


# -- output -------------------------------------------------------------------------------------

def _toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, str):
        return '"' + v.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(v, list):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    return repr(v)


def to_toml(cfg: JobConfig) -> str:
    """The resolved config as TOML (round-trips through :func:`load_config`)."""
    out = []
    for section in SECTIONS:
        out.append(f"[{section}]")
        obj = getattr(cfg, section)
        for f in dataclasses.fields(obj):
            value = getattr(obj, f.name)
            if value is None or (section == "job" and f.name == "extends"):
                continue  # TOML has no null; inheritance is already resolved
            out.append(f"{f.name} = {_toml_value(value)}")
        out.append("")
    return "\n".join(out)


def config_help() -> str:
    """Every section and key with its type, default and docstring (``--help`` text)."""
    docs = field_docs()
    lines = [
        "usage: torchrun --nproc_per_node N -m titanext.train --config FILE [--section.key=value ...]",
        "       [--print-config] [--help]",
        "",
        "Every key below can be set in the TOML file ([section] key = value) or overridden on the",
        "command line as --section.key=value or --section.key value.",
    ]
    for section, cls in SECTIONS.items():
        lines += ["", f"[{section}]"]
        for f in dataclasses.fields(cls):
            default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
            shown = "unset" if default is None else _toml_value(default)
            lines.append(f"  --{section}.{f.name}  ({_type_name(_hints(cls)[f.name])}, default {shown})")
            lines += textwrap.wrap(docs[(section, f.name)], width=92, initial_indent="      ",
                                   subsequent_indent="      ")
    return "\n".join(lines)
