"""torchtitan's TOML keys (its 0.1 and 0.2 releases, and the llama3 train configs of that era),
each read under its titanext name, ignored with a line where it changes nothing, or refused.

:data:`TORCHTITAN_KEYS` is the table: torchtitan key (``section.key``, nested tables dotted)
-> :class:`Entry` (kind, titanext key, converter, why). :func:`translate_torchtitan` applies it
to a TOML file's sections before the loader validates them; it changes nothing unless the file
holds at least one torchtitan-only key (one whose kind is not ``same``), so a titanext file is
never reinterpreted. Nothing is dropped silently: a renamed key gives one INFO line, an ignored
one a line saying why it changes nothing, a refused one a config error naming it and why.

>>> raw = {"training": {"batch_size": 4}, "job": {"print_args": False}}
>>> out, notes, problems = translate_torchtitan(raw)
>>> out["training"], problems
({'local_batch_size': 4}, [])
>>> print(notes[0])
torchtitan's training.batch_size is read as training.local_batch_size
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Union

from titanext.config._values import _show
from titanext.config.schema import SECTIONS

__all__ = ["TORCHTITAN_KEYS", "Entry", "is_torchtitan", "key_table_markdown",
           "translate_torchtitan"]

# A converter gets the value and every key of the file (flattened, torchtitan spelling) and
# returns {titanext key: value} to set (a rename or a conversion), None to ignore the key, or a
# str: why it is refused.
_Result = Union[dict[str, Any], str, None]
_Converter = Callable[[Any, dict[str, Any]], _Result]


@dataclass(frozen=True)
class Entry:
    """One torchtitan key: ``kind`` is rename, same, convert, ignore or refuse."""

    kind: str
    target: str | None
    convert: _Converter | None
    why: str


# -- converters -----------------------------------------------------------------------------------

def _ignore_if(*off: Any, refuse: str) -> _Converter:
    """Ignore the key at one of its ``off`` values (they change nothing); refuse any other."""
    return lambda v, ctx: None if v in off else refuse


def _ignore_unless_checkpointing() -> _Converter:
    """A last-save option: changes nothing while checkpointing is off (no checkpoint is written,
    so what the last one holds is moot); else titanext's model_weights_only."""
    def convert(v: Any, ctx: dict[str, Any]) -> _Result:
        enabled = ctx.get("checkpoint.enable", ctx.get("checkpoint.enable_checkpoint", False))
        return {"checkpoint.model_weights_only": v} if enabled else None
    return convert


def _float8_filter(v: Any, ctx: dict[str, Any]) -> _Result:
    """torchtitan keeps a linear in high precision when any entry is a substring of its FQN;
    titanext matches FQNs and globs, so ``x`` becomes ``*x*``. ``auto_filter_small_kn`` is
    torchao's size filter, titanext's float8.auto_filter."""
    entries = [s.strip() for s in v.split(",")] if isinstance(v, str) else list(v)
    if any(not isinstance(e, str) or any(c in e for c in "*?[") for e in entries):
        return "its entries must be plain FQN substrings (torchtitan matches no globs)"
    out: dict[str, Any] = {"float8.filter_fqns": [f"*{e}*" for e in entries
                                                  if e and e != "auto_filter_small_kn"]}
    if "auto_filter_small_kn" in entries:
        out["float8.auto_filter"] = True
    return out


def _converters(v: Any, ctx: dict[str, Any]) -> _Result:
    names = [s.strip() for s in v.split(",")] if isinstance(v, str) else list(v)
    other = [n for n in names if n not in ("float8", "quantize.linear.float8")]
    if other:
        return (f"titanext converts linears to float8 only ([float8] enable); it has no "
                f"{', '.join(map(repr, other))} converter")
    return {"float8.enable": True} if names else None


def _tokenizer_path(v: Any, ctx: dict[str, Any]) -> _Result:
    if not isinstance(v, str) or v.endswith((".model", ".json")):
        return ("titanext reads a Hugging Face tokenizer.json from a directory (tiktoken and "
                "sentencepiece .model files are not read); set it to that directory, or use "
                "model.hf_assets_path")
    return {"model.hf_assets_path": v, **({} if "model.tokenizer" in ctx
                                           else {"model.tokenizer": "hf"})}


def _hf_assets_path(v: Any, ctx: dict[str, Any]) -> _Result:
    # torchtitan always reads its tokenizer from hf_assets_path; titanext only with tokenizer=hf
    return {"model.hf_assets_path": v, **({} if "model.tokenizer" in ctx
                                           else {"model.tokenizer": "hf"})}


def _compile(v: Any, ctx: dict[str, Any]) -> _Result:
    # torchtitan 0.1's training.compile compiled the blocks and the loss
    return {"compile.enable": v, **({"compile.components": ["model", "loss"]} if v is True
                                     and "compile.components" not in ctx else {})}


def _hf_dataset_hint(key: str) -> str:
    return f", or {key} = \"hf\" with its Hugging Face name"


def _dataset(key: str) -> _Converter:
    def convert(v: Any, ctx: dict[str, Any]) -> _Result:
        if isinstance(v, str) and v.startswith("c4"):
            if key.startswith("validation.") and not ctx.get("validation.enable",
                                                             ctx.get("validation.enabled")):
                return None  # validation is off: the held-out source is never read
            return (f"torchtitan's {v!r} is a Hugging Face dataset titanext does not download; "
                    f"set {key} = \"text\" and {key}_path to your copy (.jsonl, .parquet, .arrow "
                    f"or .txt; docs/data.md){_hf_dataset_hint(key)}")
        return {key: v}
    return convert


def _int(ctx: dict[str, Any], key: str, default: int) -> int:
    """An int of the file, or torchtitan's default where it is unset or not an int (the loader
    reports the wrong type of a key on its own)."""
    value = ctx.get(key, default)
    return value if isinstance(value, int) and not isinstance(value, bool) else default


def _microbatch_size(v: Any, ctx: dict[str, Any]) -> _Result:
    if _int(ctx, "parallelism.pipeline_parallel_degree", 1) == 1:
        return None
    local = _int(ctx, "training.local_batch_size", _int(ctx, "training.batch_size", 8))
    if not isinstance(v, int) or v < 1 or local % v:
        return f"training.local_batch_size = {local} must be a multiple of it"
    return {"parallelism.pipeline_parallel_microbatches": local // v}


def _ep_overlap(v: Any, ctx: dict[str, Any]) -> _Result:
    if v is True and _int(ctx, "parallelism.expert_parallel_degree", 1) > 1 \
            and _int(ctx, "parallelism.pipeline_parallel_degree", 1) > 1:
        return {"parallelism.expert_parallel_comm_overlap": True}
    return None  # off, or on where it has no effect (no EP x PP); results are the same


def _map(key: str, table: dict[Any, Any], refuse: str) -> _Converter:
    return lambda v, ctx: {key: table[v]} if isinstance(v, str) and v in table else refuse


def _initial_load_in_hf(v: Any, ctx: dict[str, Any]) -> _Result:
    # torchtitan 0.2 reads the HF weights from model.hf_assets_path when initial_load_path is
    # unset; titanext reads them from initial_load_path only
    if v is True and "checkpoint.initial_load_path" not in ctx and "model.hf_assets_path" in ctx:
        return {"checkpoint.initial_load_in_hf": True,
                "checkpoint.initial_load_path": ctx["model.hf_assets_path"]}
    return {"checkpoint.initial_load_in_hf": v}


def _validation_steps(v: Any, ctx: dict[str, Any]) -> _Result:
    if v == -1:
        return (None if not ctx.get("validation.enable") else
                "-1 (the whole held-out set) has no titanext equivalent; give a number of batches")
    return {"validation.steps": v}


def _validation_seq_len(v: Any, ctx: dict[str, Any]) -> _Result:
    if v == ctx.get("training.seq_len", 2048) or not ctx.get("validation.enable"):
        return None
    return "titanext validates at training.seq_len; set both the same"


def _rename(target: str) -> Entry:
    return Entry("rename", target, None, "same meaning under another name")


def _same(why: str = "same name, same meaning", convert: _Converter | None = None) -> Entry:
    return Entry("same", None, convert, why)


def _ignore(why: str, convert: _Converter | None = None) -> Entry:
    return Entry("ignore", None, convert, why)


def _refuse(why: str) -> Entry:
    return Entry("refuse", None, None, why)


def _convert(target: str, convert: _Converter, why: str) -> Entry:
    return Entry("convert", target, convert, why)


_OFF = "off, which changes nothing (other values are refused)"
_NO_FT = "torchft fault tolerance is not in titanext; ignored while fault_tolerance.enable is off"

# -- the table ------------------------------------------------------------------------------------

_SAME = [
    "job.dump_folder", "job.description",
    "profiling.enable_profiling", "profiling.save_traces_folder", "profiling.profile_freq",
    "profiling.profiler_active", "profiling.profiler_warmup", "profiling.enable_memory_snapshot",
    "profiling.save_memory_snapshot_folder",
    "metrics.log_freq", "metrics.enable_tensorboard", "metrics.disable_color_printing",
    "metrics.save_tb_folder",
    "model.name",
    "optimizer.name", "optimizer.lr", "optimizer.beta1", "optimizer.beta2", "optimizer.eps",
    "optimizer.weight_decay", "optimizer.implementation",
    "lr_scheduler.warmup_steps", "lr_scheduler.decay_ratio", "lr_scheduler.decay_type",
    "lr_scheduler.min_lr_factor",
    "training.local_batch_size", "training.global_batch_size", "training.seq_len",
    "training.max_norm", "training.steps", "training.dataset_path",
    "training.mixed_precision_param", "training.mixed_precision_reduce", "training.seed",
    "training.deterministic",
    "parallelism.data_parallel_replicate_degree", "parallelism.data_parallel_shard_degree",
    "parallelism.fsdp_reshard_after_forward", "parallelism.tensor_parallel_degree",
    "parallelism.enable_async_tensor_parallel", "parallelism.pipeline_parallel_degree",
    "parallelism.pipeline_parallel_schedule",
    "parallelism.pipeline_parallel_first_stage_less_layers",
    "parallelism.pipeline_parallel_last_stage_less_layers", "parallelism.context_parallel_degree",
    "parallelism.expert_parallel_degree",
    "checkpoint.enable", "checkpoint.folder", "checkpoint.interval", "checkpoint.initial_load_path",
    "checkpoint.last_save_in_hf", "checkpoint.keep_latest_k",
    "activation_checkpoint.mode", "activation_checkpoint.selective_ac_option",
    "compile.enable", "compile.components", "compile.backend",
    "comm.init_timeout_seconds", "comm.train_timeout_seconds",
    "validation.enable", "validation.dataset_path", "validation.local_batch_size",
    "validation.freq",
]

TORCHTITAN_KEYS: dict[str, Entry] = {key: _same() for key in _SAME}
TORCHTITAN_KEYS.update({
    # [job]
    "job.print_args": _ignore("prints the config at start-up; titanext has --print-config",
                              _ignore_if(False, refuse="use --print-config to see the config")),
    "job.print_config": _ignore("prints the config at start-up; titanext has --print-config",
                                _ignore_if(False, refuse="use --print-config to see the config")),
    "job.use_for_integration_test": _ignore("marks torchtitan's CI configs; no effect on a run"),
    "job.config_file": _refuse("give the file with --config"),
    "job.save_config_file": _refuse("titanext writes no config copy; use --print-config > FILE"),
    "job.custom_config_module": _ignore("extends torchtitan's JobConfig class", _ignore_if(
        "", refuse="titanext's config has no extension modules")),
    # [metrics]
    "metrics.enable_wandb": _same(),
    "metrics.save_for_all_ranks": _ignore(_OFF, _ignore_if(
        False, refuse="titanext logs metrics from rank 0 only")),
    # [model]
    "model.flavor": _same("same name; 'debugmodel' is titanext's own small model (one line says "
                          "how it differs from torchtitan's)"),
    "model.tokenizer_path": _convert("model.hf_assets_path", _tokenizer_path,
                                     "a directory with tokenizer.json: read as hf_assets_path "
                                     "with tokenizer = 'hf'; a .model file is refused"),
    "model.hf_assets_path": _same("same name; torchtitan also reads its tokenizer there, so "
                                  "model.tokenizer = 'hf' unless the file sets it",
                                  _hf_assets_path),
    "model.converters": _convert("float8.enable", _converters,
                                 "'float8' (or 'quantize.linear.float8') is float8.enable = true; "
                                 "mx and grouped-mm converters are refused"),
    "model.print_after_conversion": _ignore("prints the converted model", _ignore_if(
        False, refuse="titanext does not print the model")),
    "model.norm_type": _ignore("titanext's llama uses RMSNorm, torchtitan's only choice left",
                               _ignore_if("rmsnorm", refuse="titanext's llama has RMSNorm only")),
    # [optimizer]
    "optimizer.early_step_in_backward": _ignore(_OFF, _ignore_if(
        False, refuse="titanext steps the optimizer after the backward")),
    # [lr_scheduler]
    "lr_scheduler.lr_min": _rename("lr_scheduler.min_lr_factor"),
    "lr_scheduler.total_steps": _refuse("titanext's schedule spans training.steps"),
    # [training]
    "training.batch_size": _rename("training.local_batch_size"),
    "training.compile": _convert("compile.enable", _compile,
                                 "true compiled the blocks and the loss: compile.enable = true, "
                                 "components = ['model', 'loss']"),
    "training.dataset": _same("same name; torchtitan's c4, c4_test are Hugging Face datasets: "
                              "refused with the fix", _dataset("training.dataset")),
    "training.enable_cpu_offload": _ignore(_OFF, _ignore_if(
        False, refuse="titanext has no FSDP CPU offload")),
    "training.dtype": _ignore("the parameter dtype without FSDP", _ignore_if(
        "float32", refuse="titanext keeps float32 parameters (mixed_precision_param casts)")),
    "training.debug_moe_force_load_balance": _ignore(_OFF, _ignore_if(
        False, refuse="titanext routes tokens by their router scores only")),
    "training.gc_freq": _same(),
    "training.gc_debug": _ignore(_OFF, _ignore_if(False, refuse="a torchtitan debugging aid")),
    "training.dataloader.num_workers": _ignore("data loader worker processes; same batches"),
    "training.dataloader.persistent_workers": _ignore("data loader workers; same batches"),
    "training.dataloader.pin_memory": _ignore("host memory pinning; same batches"),
    "training.dataloader.prefetch_factor": _ignore("data loader prefetching; same batches"),
    # [debug] (0.2)
    "debug.seed": _rename("training.seed"),
    "debug.deterministic": _rename("training.deterministic"),
    "debug.deterministic_warn_only": _ignore(_OFF, _ignore_if(
        False, refuse="titanext's deterministic mode has no warn-only variant")),
    "debug.moe_force_load_balance": _ignore(_OFF, _ignore_if(
        False, refuse="titanext routes tokens by their router scores only")),
    # [parallelism]
    "parallelism.disable_loss_parallel": _convert(
        "parallelism.enable_loss_parallel", lambda v, ctx: {
            "parallelism.enable_loss_parallel": not v} if isinstance(v, bool) else "not a bool",
        "the negation: enable_loss_parallel = not disable_loss_parallel"),
    "parallelism.enable_compiled_autograd": _ignore(_OFF, _ignore_if(
        False, refuse="titanext does not compile the backward separately")),
    "parallelism.pipeline_parallel_split_points": _ignore(_OFF, _ignore_if(
        [], refuse="use pipeline_parallel_layers_per_stage (blocks per stage)")),
    "parallelism.pipeline_parallel_layers_per_stage": _refuse(
        "torchtitan's is one int (layers of every stage, embedding and head counted); "
        "titanext's is a list of blocks per stage: write that list"),
    "parallelism.pipeline_parallel_schedule_csv": _ignore(_OFF, _ignore_if(
        "", refuse="titanext builds schedules by name (parallelism.pipeline_parallel_schedule)")),
    "parallelism.pipeline_parallel_microbatch_size": _convert(
        "parallelism.pipeline_parallel_microbatches", _microbatch_size,
        "sequences per micro-batch: microbatches = local_batch_size / it (ignored without PP)"),
    "parallelism.module_fqns_per_model_part": _refuse(
        "titanext splits stages by blocks (pipeline_parallel_layers_per_stage)"),
    "parallelism.pipeline_parallel_expert_parallel_overlap": _convert(
        "parallelism.expert_parallel_comm_overlap", _ep_overlap,
        "true with EP x PP is expert_parallel_comm_overlap; else it has no effect"),
    "parallelism.context_parallel_rotate_method": _convert(
        "parallelism.context_parallel_comm",
        _map("parallelism.context_parallel_comm", {"allgather": "allgather", "alltoall": "p2p"},
             "allowed: 'allgather', 'alltoall'"),
        "allgather is allgather; torchtitan's alltoall rotates KV shards between ranks, "
        "titanext's p2p (titanext's alltoall is Ulysses, another thing)"),
    "parallelism.context_parallel_load_balancer": _convert(
        "parallelism.context_parallel_load_balance",
        _map("parallelism.context_parallel_load_balance", {"headtail": "zigzag"},
             "titanext balances causal CP with zigzag (torchtitan's 'headtail') only"),
        "'headtail' (chunks r and 2W-1-r) is zigzag; 'ptrr' is refused"),
    "parallelism.expert_tensor_parallel_degree": _ignore(_OFF, _ignore_if(
        1, refuse="titanext's experts are not split by TP (expert_parallel_degree)")),
    "parallelism.expert_parallel_comm_backend": _ignore(_OFF, _ignore_if(
        "standard", refuse="titanext's EP all-to-alls use torch.distributed")),
    # [experimental]
    "experimental.custom_import": _ignore(_OFF, _ignore_if(
        "", refuse="titanext imports no modules named in a config")),
    "experimental.custom_args_module": _ignore(_OFF, _ignore_if(
        "", refuse="titanext's config has no extension modules")),
    # [checkpoint]
    "checkpoint.enable_checkpoint": _rename("checkpoint.enable"),
    "checkpoint.interval_type": _ignore("'steps' is titanext's only kind", _ignore_if(
        "steps", refuse="titanext saves every checkpoint.interval steps")),
    "checkpoint.initial_load_in_hf": _same(
        "same name; without initial_load_path torchtitan reads model.hf_assets_path, so that "
        "path becomes checkpoint.initial_load_path", _initial_load_in_hf),
    "checkpoint.load_step": _same("same name; torchtitan's -1 is 'latest'", lambda v, ctx: {
        "checkpoint.load_step": "latest" if v == -1 else v}),
    "checkpoint.initial_load_model_only": _ignore("titanext reads only the model from it",
                                                  _ignore_if(True, refuse="titanext reads only "
                                                             "the model from initial_load_path")),
    "checkpoint.initial_load_model_weights_only": _ignore(
        "titanext reads only the model from it",
        _ignore_if(True, refuse="titanext reads only the model from initial_load_path")),
    "checkpoint.initial_load_in_hf_quantized": _ignore(_OFF, _ignore_if(
        False, refuse="titanext reads unquantized HF weights only")),
    "checkpoint.model_weights_only": _same("same name; moot while checkpointing is off",
                                           _ignore_unless_checkpointing()),
    "checkpoint.last_save_model_weights_only": _convert(
        "checkpoint.model_weights_only", _ignore_unless_checkpointing(),
        "torchtitan 0.1's name of model_weights_only; moot while checkpointing is off"),
    "checkpoint.last_save_model_only": _convert(
        "checkpoint.model_weights_only", _ignore_unless_checkpointing(),
        "torchtitan 0.2's name of model_weights_only; moot while checkpointing is off"),
    "checkpoint.export_dtype": _same(),
    "checkpoint.async_mode": _same(),
    "checkpoint.create_seed_checkpoint": _ignore(_OFF, _ignore_if(
        False, refuse="titanext initialises from training.seed; no seed checkpoint is needed")),
    "checkpoint.exclude_from_loading": _ignore(_OFF, _ignore_if(
        [], refuse="titanext restores the whole state")),
    "checkpoint.enable_first_step_checkpoint": _ignore(_OFF, _ignore_if(
        False, refuse="titanext saves every checkpoint.interval steps")),
    "checkpoint.load_only": _ignore(_OFF, _ignore_if(
        False, refuse="titanext saves whenever checkpoint.enable is on")),
    "checkpoint.enable_ft_dataloader_checkpoints": _ignore(_NO_FT),
    # [activation_checkpoint] (0.2: the memory-budget mode and its options)
    "activation_checkpoint.per_op_sac_force_recompute_mm_shapes_by_fqns": _ignore(
        "which matmuls op-level SAC recomputes: memory only, same results"),
    "activation_checkpoint.early_stop": _ignore("stops a recompute early: memory only"),
    "activation_checkpoint.memory_budget": _ignore("used by mode = 'memory_budget' only"),
    "activation_checkpoint.visualize_memory_budget_pareto": _ignore(_OFF, _ignore_if(
        False, refuse="titanext has no memory-budget mode")),
    "activation_checkpoint.preserve_rng_state": _ignore(
        "the llama models use no randomness in the forward"),
    "activation_checkpoint.determinism_check": _ignore("a checkpoint debugging option"),
    "activation_checkpoint.debug": _ignore(_OFF, _ignore_if(
        False, refuse="a torch.utils.checkpoint debugging aid")),
    # [comm]
    "comm.trace_buf_size": _ignore("NCCL flight-recorder buffer (debugging); no effect on a run"),
    "comm.save_traces_folder": _ignore("NCCL flight-recorder dumps (debugging)"),
    "comm.save_traces_file_prefix": _ignore("NCCL flight-recorder dumps (debugging)"),
    "comm.mode": _same("same name, other values: 'default' is 'real'; 'fake_backend' is "
                       "titanext's dry run; 'local_tensor' is refused",
                       _map("comm.mode", {"default": "real", "real": "real",
                                          "fake_backend": "fake_backend"},
                            "titanext has 'real' and 'fake_backend' only")),
    # [memory_estimation], [fault_tolerance]
    "memory_estimation.enabled": _ignore(_OFF, _ignore_if(
        False, refuse="use titanext-plan or comm.mode = 'fake_backend' (docs/dry_run.md)")),
    "memory_estimation.enable": _ignore(_OFF, _ignore_if(
        False, refuse="use titanext-plan or comm.mode = 'fake_backend' (docs/dry_run.md)")),
    "memory_estimation.disable_fake_mode": _ignore("an option of memory_estimation"),
    "fault_tolerance.enable": _ignore(_OFF, _ignore_if(
        False, refuse="titanext has no torchft; it restarts from checkpoints "
                      "(docs/checkpoints_and_faults.md)")),
    # [validation]
    "validation.enabled": _rename("validation.enable"),
    "validation.dataset": _same("same name; torchtitan's c4_validation is refused with the fix "
                                "(ignored while validation is off)",
                                _dataset("validation.dataset")),
    "validation.steps": _same("same name; -1 (the whole set) is refused",
                              _validation_steps),
    "validation.seq_len": _ignore("titanext validates at training.seq_len; refused if it differs",
                                  _validation_seq_len),
})
for _k in ("replica_id", "group_size", "min_replica_size", "semi_sync_method", "sync_steps",
           "should_quantize", "fragment_sync_delay", "fragment_update_alpha", "process_group",
           "process_group_timeout_ms"):
    TORCHTITAN_KEYS[f"fault_tolerance.{_k}"] = _ignore(_NO_FT)
for _k in ("num_workers", "persistent_workers", "pin_memory", "prefetch_factor"):
    TORCHTITAN_KEYS[f"validation.dataloader.{_k}"] = _ignore("data loader workers; same batches")
# float8: [float8] (0.1), [quantize.dense.float8] and [quantize.linear.float8] (0.2)
for _s in ("float8", "quantize.dense.float8", "quantize.linear.float8"):
    TORCHTITAN_KEYS.update({
        f"{_s}.enable_fsdp_float8_all_gather": _rename("float8.enable_fsdp_float8_all_gather"),
        f"{_s}.precompute_float8_dynamic_scale_for_fsdp": _rename("float8.precompute_scale"),
        f"{_s}.filter_fqns": _convert("float8.filter_fqns", _float8_filter,
                                      "substring match: 'x' becomes the glob '*x*'; "
                                      "'auto_filter_small_kn' is float8.auto_filter"),
        f"{_s}.emulate": _rename("float8.emulate"),
        f"{_s}.recipe_name": _convert("float8.recipe", lambda v, ctx: {"float8.recipe": v},
                                      "the recipe (tensorwise, rowwise, rowwise_with_gw_hp)"),
        f"{_s}.force_recompute_fp8_weight_in_bwd": _ignore(_OFF, _ignore_if(
            False, refuse="memory option of torchao's float8 FSDP not in titanext")),
    })
TORCHTITAN_KEYS["float8.enable_float8_linear"] = _rename("float8.enable")
for _k in ("mx.use_fp8_dim1_cast_triton_kernel", "mx.recipe_name", "mx.filter_fqns",
           "quantize.linear.mx.mxfp8_dim1_cast_kernel_choice", "quantize.linear.mx.recipe_name",
           "quantize.linear.mx.filter_fqns", "quantize.grouped_mm.mx.recipe_name",
           "quantize.grouped_mm.mx.fqns", "quantize.grouped_mm.float8.fqns"):
    TORCHTITAN_KEYS[_k] = _ignore("used only by an mx or grouped-mm converter, which titanext "
                                  "refuses in model.converters")


#: Same-name keys whose value means something else in titanext, said in one line when read.
_SAME_NAME_DIFFERS: dict[str, Callable[[Any], Union[str, None]]] = {
    "model.flavor": lambda v: (
        "titanext's debugmodel (dim 256, 6 layers as torchtitan's, but 8 heads over 4 kv heads "
        "and a vocab of 512; torchtitan's: 16 heads, vocab 2048), so its losses are not "
        "torchtitan's" if v == "debugmodel" else None),
}


# -- applying it ----------------------------------------------------------------------------------

def _flatten(raw: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in raw.items():
        if isinstance(value, dict):
            out.update(_flatten(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def _titanext_key(key: str) -> bool:
    section, _, name = key.partition(".")
    return section in SECTIONS and name in {f.name for f in dataclasses.fields(SECTIONS[section])}


def is_torchtitan(raw: dict[str, Any]) -> bool:
    """Whether ``raw`` (TOML sections) holds a key only torchtitan has (not ``same`` in the
    table, and not a titanext key: titanext's [float8] shares names with torchtitan 0.1's)."""
    return any(TORCHTITAN_KEYS[k].kind != "same" and not _titanext_key(k)
               for k in _flatten(raw) if k in TORCHTITAN_KEYS)


def translate_torchtitan(raw: dict[str, Any]
                         ) -> tuple[dict[str, Any], list[str], list[str]]:
    """(sections with torchtitan's keys replaced by titanext's, INFO lines, problems).

    ``raw`` is returned unchanged when it holds no torchtitan-only key. A key both spelled the
    torchtitan way and the titanext way is a problem, and so is a refused key (one line each,
    naming it, its value and why). Keys the table does not know are left for the loader to
    report as unknown.
    """
    if not is_torchtitan(raw):
        return raw, [], []
    flat = _flatten(raw)
    out: dict[str, Any] = {}
    source: dict[str, str] = {}  # titanext key -> the torchtitan key that set it
    notes: list[str] = []
    problems: list[str] = []
    for key, value in flat.items():
        entry = TORCHTITAN_KEYS.get(key)
        if entry is None:
            result: _Result = {key: value}
        elif entry.convert is not None:
            result = entry.convert(value, flat)
        elif entry.kind == "refuse":
            result = entry.why
        elif entry.kind == "ignore":
            result = None
        else:
            result = {entry.target or key: value}
        differs = _SAME_NAME_DIFFERS.get(key, lambda v: None)(value)
        if isinstance(result, dict) and differs:
            notes.append(f"torchtitan's {key} = {_show(value)} is {differs}")
        if isinstance(result, str):
            problems.append(f"torchtitan's {key} = {_show(value)} is refused: {result}")
            continue
        if result is None:
            notes.append(f"torchtitan's {key} = {_show(value)} is ignored: "
                         f"{entry.why if entry else ''}")
            continue
        for target, new in result.items():
            if target in source and source[target] != key and out[target] != new:
                problems.append(f"torchtitan's {key} and {source[target]} both set {target}, to "
                                f"{_show(new)} and {_show(out[target])}; keep one")
                continue
            if target != key and target in flat:
                problems.append(f"{key} (torchtitan's spelling) and {target} are both given; "
                                f"keep {target}")
                continue
            out[target], source[target] = new, key
            if target != key or new != value:
                shown = "" if new == value else f" = {_show(new)}"
                verb = "is read as" if target == next(iter(result)) else "also sets"
                notes.append(f"torchtitan's {key} {verb} {target}{shown}")
    nested: dict[str, Any] = {}
    for key, value in out.items():
        section, _, name = key.partition(".")
        if name:
            nested.setdefault(section, {})[name] = value
        else:
            nested[section] = value
    return nested, notes, problems


_DOES = {"same": "same key", "rename": "read as `{}`", "convert": "converted to `{}`",
         "ignore": "ignored, one line", "refuse": "refused (exit 2)"}


def key_table_markdown() -> str:
    """:data:`TORCHTITAN_KEYS` as the markdown table of docs/torchtitan.md.

    >>> key_table_markdown().splitlines()[0]
    '| torchtitan key | what titanext does | why |'
    """
    rows = ["| torchtitan key | what titanext does | why |", "|---|---|---|"]
    for key, e in TORCHTITAN_KEYS.items():
        rows.append(f"| `{key}` | {_DOES[e.kind].format(e.target)} | "
                    f"{e.why.replace('|', '/')} |")
    return "\n".join(rows)
