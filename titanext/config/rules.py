"""Every cross-field rule of the config, one owner per rule.

The layout arithmetic (degree product, EP layout, batch and gradient accumulation, pipeline
micro-batches) is plain-int functions in :mod:`titanext.config.degrees`, re-exported here, so
the runtime calls the same rule the config checks at load:
:class:`titanext.distributed.parallel_dims.ParallelDims` validates its degrees with
:func:`degree_problems`, the planner counts gradient accumulation with
:func:`accumulation_steps` and pipeline micro-batches with :func:`resolve_microbatches`.
:func:`collect_problems` runs every rule over a :class:`~titanext.config.schema.JobConfig` and
returns one line per problem; :func:`check_config` raises them as one :class:`ConfigError`.

>>> check_config(JobConfig(), world_size=4)

Imports of the model registry, the schedules and the pipeline helpers are local to the rules
that need them, so that ``import titanext.config`` stays light (no torch).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
from typing import TYPE_CHECKING, Any

from titanext._hints import did_you_mean as _did_you_mean
from titanext.config.degrees import (
    accumulation_steps,
    batch_problem,
    degree_problems,
    ep_layout_problem,
    layers_per_stage,
    resolve_dp_shard,
    resolve_microbatches,
)
from titanext.config.mtp_rules import mtp_problems
from titanext.config.profiling_rules import profiling_problems
from titanext.config.replication_rules import MOE_RUNTIME_KEYS, replication_problems
from titanext.config.schema import JobConfig, MoEConfig, field_problems
from titanext.errors import ConfigError
from titanext.plugins.ep_dispatch_rules import dispatch_problems
from titanext.plugins.options import FLOAT8_ALL_GATHER_RECIPES

if TYPE_CHECKING:
    from titanext.models import ModelArgs

__all__ = ["accumulation_steps", "batch_problem", "collect_problems", "degree_problems",
           "ep_layout_problem", "fake_world_size", "gradient_accumulation_steps", "model_args",
           "pipeline_config_problems", "resolve_dp_shard", "resolve_microbatches",
           "resolved_dp_shard", "check_config", "validate"]


# -- parallel degrees ---------------------------------------------------------------------------

def _resolve_shard(p: Any, world_size: int | None) -> tuple[int, str | None]:
    """(dp_shard with -1 resolved, the problem if the degrees do not fit ``world_size``)."""
    try:
        shard = resolve_dp_shard(
            dp_replicate=p.data_parallel_replicate_degree, dp_shard=p.data_parallel_shard_degree,
            cp=p.context_parallel_degree, tp=p.tensor_parallel_degree,
            pp=p.pipeline_parallel_degree, world_size=world_size)
    except ConfigError as e:
        fallback = 1 if p.data_parallel_shard_degree == -1 else p.data_parallel_shard_degree
        return fallback, e.problems[0]
    return shard, None



# -- pipeline -------------------------------------------------------------------------------------

def pipeline_config_problems(cfg: JobConfig) -> list[str]:
    """Config-load rules for pipeline parallelism (one line per problem; with pp > 1).

    The schedule's own rules (micro-batch counts, stage counts, compile) are
    :func:`titanext.schedules.schedule_problems`; this adds what involves other sections.
    """
    from titanext.models import MODEL_FLAVORS, get_model_args
    from titanext.schedules import (
        get_schedule_class,
        num_stages_for,
        resolved_stages_per_rank,
        schedule_problems,
        stage_owners,
    )

    p, t, m = cfg.parallelism, cfg.training, cfg.model
    pp, name = p.pipeline_parallel_degree, p.pipeline_parallel_schedule
    key = "parallelism.pipeline_parallel_"
    try:
        n_per_rank = resolved_stages_per_rank(name, p.pipeline_parallel_stages_per_rank)
    except ValueError as e:
        return [f"{key}stages_per_rank = {p.pipeline_parallel_stages_per_rank}: {e}"]
    mb = resolve_microbatches(pp, p.pipeline_parallel_microbatches, t.local_batch_size)
    cls = get_schedule_class(name)
    # DualPipe: two copies of a pp-stage model, the others pp x stages_per_rank stages
    n_stages = num_stages_for(cls.placement, pp, n_per_rank)
    compiled = cfg.compile.enable and "model" in cfg.compile.components
    # torch's split walks the autograd graph (not on compiled stages); deferral needs no walk
    autograd_split = getattr(p, "pipeline_parallel_split_backward", "deferred") == "autograd"
    problems = list(schedule_problems(
        name, pp=pp, microbatches=mb, compiled=compiled and autograd_split,
        stages_per_rank=n_per_rank,
        max_pending_weight_grads=getattr(p, "pipeline_parallel_max_pending_weight_grads", 0)))
    if compiled and cls.placement == "v" and not hasattr(cls, "generate") \
            and not any("compile" in q for q in problems):
        problems.append(f"{key}schedule = {name!r} (torch's) refuses torch.compile'd stages; use "
                        "'ZBV' or set compile.enable = false")
    if p.zero_stage == 1:
        problems.append(f"parallelism.zero_stage = 1 with {key}degree = {pp} is not supported (the "
                        "stages are not wrapped in DDP, so gradients would not be reduced over "
                        "data parallel ranks); use zero_stage 2 or 3")
    if cls.placement == "dualpipe" and p.tensor_parallel_degree > 1:
        problems.append(f"{key}schedule = {name!r} with parallelism.tensor_parallel_degree = "
                        f"{p.tensor_parallel_degree} is not supported yet (the mirrored-copy "
                        "gradient sum is untested under TP); use 'DualPipeV' or tp = 1")
    if t.local_batch_size % mb:
        problems.append(f"training.local_batch_size = {t.local_batch_size} must be divisible by "
                        f"{key}microbatches = {mb} (each micro-batch is a slice of the batch)")
    if m.name in MODEL_FLAVORS and m.flavor in MODEL_FLAVORS[m.name]:
        n_layers = get_model_args(m.name, m.flavor).n_layers
        try:
            layers_per_stage(n_layers, n_stages,
                             first_stage_less_layers=p.pipeline_parallel_first_stage_less_layers,
                             last_stage_less_layers=p.pipeline_parallel_last_stage_less_layers,
                             explicit=p.pipeline_parallel_layers_per_stage,
                             stage_ranks=stage_owners(cls.placement, pp, n_per_rank))
        except ValueError as e:
            problems.append(f"{key}degree = {pp} x stages_per_rank = {n_per_rank}: {n_stages} "
                            f"stages: {e}")
    return problems


def _pipeline_composition_problems(cfg: JobConfig, skip: set[str]) -> list[str]:
    """Features that cannot run inside pipeline stages (checked only with pp > 1).

    Everything else composes with PP: FSDP/HSDP, TP/SP with loss parallel, CP (the stages get
    the CP-sharded position ids), float8, full and layer-level AC
    (tests/multiprocess/test_composition.py).
    ZeRO-1 and DualPipe x TP are rejected by :func:`pipeline_config_problems`.
    """
    p, ac = cfg.parallelism, cfg.activation_checkpoint
    pp = p.pipeline_parallel_degree
    if pp == 1:
        return []
    from titanext.schedules import get_schedule_class

    problems = []
    try:
        cls = get_schedule_class(p.pipeline_parallel_schedule)
        splits = getattr(cls, "splits_backward", False)
    except ValueError:  # an unknown schedule is reported by its own check
        splits = False
    ac_keys = {"activation_checkpoint.mode", "activation_checkpoint.selective_ac_option"}
    # deferred weight gradients run one backward per micro-batch (W never touches the graph)
    splits = splits and p.pipeline_parallel_split_backward == "autograd"
    if splits and ac.mode == "selective" and ac.selective_ac_option == "op" \
            and not skip & ac_keys:
        problems.append("activation_checkpoint.mode = 'selective' with selective_ac_option = 'op' "
                        f"cannot run under parallelism.pipeline_parallel_schedule = "
                        f"{p.pipeline_parallel_schedule!r} with pipeline_parallel_split_backward "
                        "= 'autograd', which splits the backward into input and weight gradients "
                        "(torch's op-level checkpoint allows one backward); use "
                        "pipeline_parallel_split_backward = 'deferred', mode = 'full', a "
                        "layer-level selective_ac_option such as '2', or a schedule without split "
                        "backward (1F1B, Interleaved1F1B, GPipe)")
    return problems


# -- model, MoE, expert parallelism, float8 -------------------------------------------------------

def _tokenizer_vocab(name: str) -> int:
    from titanext.components.tokenizer import build_tokenizer

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
        hint = _did_you_mean(m.flavor, flavors, fallback=False)
        return [f"model.flavor = {m.flavor!r} is not a flavor of model {m.name!r}; choose one "
                f"of {', '.join(map(repr, flavors))} or 'hf' (shapes from "
                f"model.hf_assets_path){hint}"]
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
    if degrees_ok and "model.num_mtp_layers" not in skip:
        problems += mtp_problems(cfg, flavor_depth=args.num_mtp_layers)
    if degrees_ok and tp > 1:
        n_kv_heads = args.n_kv_heads or args.n_heads  # None means multi-head, not grouped
        heads = [("n_heads", args.n_heads)]
        if not args.mla:  # MLA: one key and value per head, split with the heads
            heads.append(("n_kv_heads", n_kv_heads))
        for attr, value in (*heads, ("vocab_size", args.vocab_size)):
            if value % tp:
                problems.append(f"parallelism.tensor_parallel_degree = {tp} must divide the "
                                f"model's {attr} = {value} ({which}); choose a divisor of {value}")
    u = ulysses_degree(p)
    if degrees_ok and u > 1 and "parallelism.context_parallel_ulysses_degree" not in skip:
        problems += _ulysses_head_problems(p, args, which)
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


def ulysses_degree(p: Any) -> int:
    """The Ulysses degree CP runs with: context_parallel_degree for comm = 'alltoall' (pure
    Ulysses), else context_parallel_ulysses_degree (1 = ring only)."""
    if p.context_parallel_comm == "alltoall":
        return p.context_parallel_degree
    return p.context_parallel_ulysses_degree


def _ulysses_key(p: Any) -> str:
    if p.context_parallel_comm == "alltoall":
        return (f"parallelism.context_parallel_comm = 'alltoall' (Ulysses over "
                f"context_parallel_degree = {p.context_parallel_degree})")
    return f"parallelism.context_parallel_ulysses_degree = {p.context_parallel_ulysses_degree}"


def _ulysses_degree_problems(p: Any) -> list[str]:
    """The Ulysses degree against cp (the head rules need the model: _ulysses_head_problems)."""
    cp, u = p.context_parallel_degree, p.context_parallel_ulysses_degree
    if p.context_parallel_comm == "alltoall" and u not in (1, cp):
        return [f"parallelism.context_parallel_ulysses_degree = {u} contradicts "
                f"context_parallel_comm = 'alltoall' (pure Ulysses over all context_parallel_degree"
                f" = {cp} ranks); set it to {cp} (or 1), or use context_parallel_comm = 'p2p' for "
                f"hybrid Ulysses x ring"]
    if cp % u:
        return [f"parallelism.context_parallel_ulysses_degree = {u} must divide "
                f"context_parallel_degree = {cp} (cp = Ulysses x ring); choose a divisor of {cp}"]
    return []


def _ulysses_head_problems(p: Any, args: Any, which: str) -> list[str]:
    """Ulysses splits each TP rank's heads over its u ranks (kv heads may be replicated)."""
    u, tp = ulysses_degree(p), p.tensor_parallel_degree
    if p.context_parallel_degree % u:
        return []  # reported by _ulysses_degree_problems
    heads, kv_heads = args.n_heads, args.n_kv_heads or args.n_heads
    if heads % tp or kv_heads % tp:
        return []  # reported by the TP rule
    per_tp = " / tensor_parallel_degree" if tp > 1 else ""
    problems = []
    if (heads // tp) % u:
        problems.append(f"{_ulysses_key(p)} must divide the model's n_heads{per_tp} = "
                        f"{heads // tp} ({which}): Ulysses splits the heads over its ranks; "
                        "choose a smaller Ulysses degree")
    kv = kv_heads // tp
    if not args.mla and ((kv % u) if kv >= u else (u % kv)):  # MLA: kv heads are the heads
        problems.append(f"{_ulysses_key(p)} must divide the model's n_kv_heads{per_tp} = {kv} "
                        f"({which}) or be a multiple of it (kv heads are then replicated); "
                        "choose another Ulysses degree")
    return problems


def _hf_rule_problems(cfg: JobConfig, skip: set[str]) -> list[str]:
    """The HF path (docs/hf_checkpoints.md): hf_assets_path files, tokenizer vocab against the
    model, tied embeddings against TP / PP, initial_load_path against the model, HF export."""
    from titanext.config.hf_rules import hf_problems
    from titanext.models import get_model_args
    from titanext.models.hf import hf_config_from_model_args

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
        model_args=named, num_mtp_layers=m.num_mtp_layers)
    problems.extend(found)
    if c.last_save_in_hf and not found:
        try:
            hf_config_from_model_args(model_args(cfg))
        except ValueError as e:
            problems.append(f"checkpoint.last_save_in_hf = true: {e}")
    return problems


def _moe_overrides(cfg: JobConfig) -> dict[str, Any]:
    return {f.name: getattr(cfg.moe, f.name) for f in dataclasses.fields(MoEConfig)
            if getattr(cfg.moe, f.name) is not None and f.name not in MOE_RUNTIME_KEYS}


def model_args(cfg: JobConfig) -> ModelArgs:
    """The :class:`~titanext.models.ModelArgs` the job trains: the flavor's, with the [moe]
    overrides applied (call on a validated config).

    >>> from titanext.config import load_config
    >>> model_args(load_config("train_configs/debug_moe.toml", ["--moe.top_k=1"])).moe.top_k
    1
    """
    from titanext.models import get_model_args, with_moe_overrides
    from titanext.models.hf import model_args_from_hf

    if cfg.model.flavor == "hf":
        base = model_args_from_hf(cfg.model.hf_assets_path)
    else:
        base = get_model_args(cfg.model.name, cfg.model.flavor)
    if cfg.model.num_mtp_layers >= 0:
        base = dataclasses.replace(base, num_mtp_layers=cfg.model.num_mtp_layers)
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
        problems.append(f"moe.num_limited_groups = {lg} must be <= num_expert_groups = {g} "
                        f"({which})")
    elif k <= e and k > lg * (e // g):
        problems.append(f"moe.top_k = {k} does not fit in the limited groups: num_limited_groups "
                        f"({lg}) x experts per group ({e // g}) = {lg * e // g} ({which})")
    if v["n_dense_layers"] >= args.n_layers:  # the first MoE block is block n_dense_layers
        problems.append(f"moe.n_dense_layers = {v['n_dense_layers']} leaves no MoE block among "
                        f"the model's {args.n_layers} blocks ({which})")
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
    layout = None if shard is None else ep_layout_problem(ep=ep, cp=cp, dp_shard=shard)
    if layout:
        problems.append(layout)
    if p.zero_stage == 1:
        problems.append(f"{key} needs FSDP (zero_stage 2 or 3): parallelism.zero_stage = 1 "
                        "replicates every parameter with DDP, experts included")
    ac = cfg.activation_checkpoint
    if ac.mode == "selective" and ac.selective_ac_option == "op" \
            and "activation_checkpoint.selective_ac_option" not in skip:
        problems.append(f"{key} cannot run with activation_checkpoint.mode = 'selective' and "
                        "selective_ac_option = 'op': with the all-to-alls and the experts' FSDP "
                        "unit inside the block, the recomputation runs other profiler ops than "
                        "the forward, which op-level checkpointing refuses; use mode = 'full' or "
                        "a layer-level selective_ac_option such as '2'")
    return problems


def ep_overlap_problems(cfg: JobConfig) -> list[str]:
    """``expert_parallel_comm_overlap``: expert parallelism, and a pipeline schedule whose
    paired forward/backward chunks can run (:func:`titanext.schedules.overlap.overlap_problems`)."""
    p = cfg.parallelism
    if not p.expert_parallel_comm_overlap:
        return []
    key = "parallelism.expert_parallel_comm_overlap = true"
    if p.expert_parallel_degree == 1:
        return [f"{key} needs expert parallelism, but parallelism.expert_parallel_degree = 1; "
                "set expert_parallel_degree > 1 or the overlap false"]
    pp, name = p.pipeline_parallel_degree, p.pipeline_parallel_schedule
    if pp == 1:
        return [f"{key} overlaps the paired forward/backward chunks of a pipeline schedule, but "
                "parallelism.pipeline_parallel_degree = 1 has none; use pp > 1 with DualPipeV, "
                "DualPipe, 1F1B or Interleaved1F1B, or set it false"]
    from titanext.schedules import get_schedule_class, resolved_stages_per_rank
    from titanext.schedules.overlap import overlap_problems

    try:
        canonical = get_schedule_class(name).__name__
        spr = resolved_stages_per_rank(name, p.pipeline_parallel_stages_per_rank)
    except ValueError:  # reported by the pipeline rules
        return []
    if name.lower() == "torchdualpipev":
        canonical = "TorchDualPipeV"
    mb = resolve_microbatches(pp, p.pipeline_parallel_microbatches, cfg.training.local_batch_size)
    return overlap_problems(canonical, pp=pp, microbatches=mb, stages_per_rank=spr)


def _float8_problems(cfg: JobConfig, skip: set[str]) -> list[str]:
    """[float8] combinations that cannot work (checked only with float8.enable)."""
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
    if f.recipe != "blockwise" and importlib.util.find_spec("torchao") is None:
        problems.append(f"float8.recipe = {f.recipe!r} needs torchao >= 0.17, which is not "
                        "installed here (pip install torchao); recipe = 'blockwise' runs "
                        "without it")
    if f.recipe == "blockwise" and p.tensor_parallel_degree > 1:
        problems.append(f"float8.recipe = 'blockwise' does not support tensor parallelism "
                        f"(tensor_parallel_degree = {p.tensor_parallel_degree}); use 'tensorwise' "
                        "or 'rowwise' with TP")
    return problems


# -- all rules -------------------------------------------------------------------------------------

def collect_problems(cfg: JobConfig, world_size: int | None = None,
             skip: set[str] | frozenset[str] = frozenset()) -> list[str]:
    """Every problem of ``cfg``, per field and across fields, one line each.

    Keys in ``skip`` are known bad (the loader could not type-check them) and left out of the
    rules.

    >>> collect_problems(JobConfig(), world_size=3)
    []
    """
    skip = set(skip)
    found = field_problems(cfg, skip)
    found += _cross_field_problems(cfg, world_size, skip)
    return found


def _cross_field_problems(cfg: JobConfig, world_size: int | None, skip: set[str]) -> list[str]:
    problems: list[str] = []
    if world_size is not None and (isinstance(world_size, bool) or not isinstance(world_size, int)
                                   or world_size < 1):
        problems.append(f"world size {world_size!r} must be a positive integer")
        world_size = None

    def ok(*keys: str) -> bool:
        """True when none of ``keys`` failed its own check (bare names are parallelism keys)."""
        return not skip.intersection(k if "." in k else f"parallelism.{k}" for k in keys)

    p, t = cfg.parallelism, cfg.training
    if cfg.comm.mode == "fake_backend" and ok("comm.fake_world_size", "comm.fake_rank"):
        # A dry run's world is the fake one, whatever launched the process.
        world_size = fake_world_size(cfg)
        if cfg.comm.fake_rank >= world_size:
            problems.append(f"comm.fake_rank = {cfg.comm.fake_rank} must be below the dry run's "
                            f"world size {world_size}")
    degrees_ok = ok("data_parallel_replicate_degree", "data_parallel_shard_degree",
                    "context_parallel_degree", "tensor_parallel_degree",
                    "pipeline_parallel_degree")
    rep, cp = p.data_parallel_replicate_degree, p.context_parallel_degree
    tp = p.tensor_parallel_degree

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

    if degrees_ok and ok("context_parallel_ulysses_degree", "context_parallel_comm"):
        problems += _ulysses_degree_problems(p)
    problems += _model_problems(cfg, skip, degrees_ok)
    if degrees_ok and p.pipeline_parallel_degree > 1 and ok("pipeline_parallel_schedule"):
        problems += pipeline_config_problems(cfg)
    problems += _float8_problems(cfg, skip)
    problems += _moe_problems(cfg, skip)
    problems += _ep_problems(cfg, skip, shard if degrees_ok else None)
    problems += replication_problems(cfg, skip, model_args)
    problems += dispatch_problems(cfg, skip, model_args)
    if degrees_ok and ok("expert_parallel_degree", "pipeline_parallel_schedule"):
        problems += ep_overlap_problems(cfg)
    if degrees_ok:
        problems += _pipeline_composition_problems(cfg, skip)

    if shard is not None and ok("training.local_batch_size", "training.global_batch_size"):
        problem = batch_problem(global_batch_size=t.global_batch_size,
                                local_batch_size=t.local_batch_size, dp_replicate=rep,
                                dp_shard=shard)
        if problem:
            problems.append(problem)

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

    problems += _data_problems(cfg, skip)
    problems += profiling_problems(cfg, skip)
    return problems


def _data_problems(cfg: JobConfig, skip: set[str]) -> list[str]:
    """training's and (when enabled) validation's dataset and files: the path exists, parquet
    and jsonl files have the text field, token shards' dtype holds the tokenizer's ids
    (titanext.data.checks; file headers only)."""
    from titanext.data.checks import check_dataset

    problems: list[str] = []
    sections = [("training", cfg.training)]
    if cfg.validation.enable:
        sections.append(("validation", cfg.validation))
    vocab: tuple[int | None, int | None] | None = None
    for name, sec in sections:
        if {f"{name}.dataset", f"{name}.dataset_path", "training.dataset_text_field"} & skip:
            continue
        if sec.dataset in ("text", "tokens"):
            if not sec.dataset_path:
                what = (".txt, .jsonl, .parquet or .arrow file, or a folder of them"
                        if sec.dataset == "text"
                        else "folder of .npy shards from python -m titanext.data tokenize")
                problems.append(f"{name}.dataset = {sec.dataset!r} needs {name}.dataset_path (a "
                                f"{what}), which is unset")
                continue
            if not os.path.exists(sec.dataset_path):
                problems.append(f"{name}.dataset_path = {sec.dataset_path!r} does not exist "
                                f"(relative paths start at {os.getcwd()!r})")
                continue
            if sec.dataset == "tokens" and vocab is None:
                vocab = _tokenizer_ids(cfg)
            problems += check_dataset(sec.dataset, sec.dataset_path,
                                      text_field=cfg.training.dataset_text_field,
                                      vocab_size=vocab[0] if vocab else None,
                                      eos_id=vocab[1] if vocab else None, section=name)
        elif sec.dataset_path:
            problems.append(f"{name}.dataset_path = {sec.dataset_path!r} is only read with "
                            f"dataset = 'text' or 'tokens', but {name}.dataset = "
                            f"{sec.dataset!r}; set dataset = 'text' or dataset_path = \"\"")
    return problems


def _tokenizer_ids(cfg: JobConfig) -> tuple[int | None, int | None]:
    """(vocab size, EOS id) of the configured tokenizer, or Nones when it cannot be built (its
    own rule reports why)."""
    from titanext.components.tokenizer import build_tokenizer

    try:
        tok = build_tokenizer(cfg.model.tokenizer, cfg.model.hf_assets_path)
    except (ConfigError, ValueError):
        return None, None
    return tok.vocab_size, tok.eos_id


def fake_world_size(cfg: JobConfig) -> int:
    """The world size of a ``comm.mode = "fake_backend"`` dry run: ``comm.fake_world_size``, or
    the product of the parallel degrees (data_parallel_shard_degree = -1 counting 1)."""
    if cfg.comm.fake_world_size:
        return cfg.comm.fake_world_size
    p = cfg.parallelism
    return (p.data_parallel_replicate_degree * max(p.data_parallel_shard_degree, 1)
            * p.context_parallel_degree * p.tensor_parallel_degree * p.pipeline_parallel_degree)


def check_config(cfg: JobConfig, world_size: int | None = None) -> None:
    """Check every field and every cross-field rule; raise :class:`ConfigError` listing all.

    Works on any :class:`JobConfig`, including one built or modified in Python. With
    ``world_size`` the degrees must multiply to it (``data_parallel_shard_degree = -1`` takes the
    rest); without it only what does not depend on it is checked, with -1 counted as 1.

    >>> check_config(JobConfig(), world_size=4)
    """
    found = collect_problems(cfg, world_size)
    if found:
        raise ConfigError(found)


#: The old name of :func:`check_config` (``titanext.config.validate`` keeps working).
validate = check_config


def resolved_dp_shard(cfg: JobConfig, world_size: int | None) -> int:
    """``data_parallel_shard_degree`` with -1 resolved to the rest of the world (1 without one).

    Raises :class:`ConfigError` when the degrees cannot fit ``world_size``.

    >>> from titanext.config import load_config
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

    >>> from titanext.config import load_config
    >>> gradient_accumulation_steps(load_config(None, ["--training.global_batch_size=64"]), 4)
    2
    """
    t, p = cfg.training, cfg.parallelism
    return accumulation_steps(global_batch_size=t.global_batch_size,
                              local_batch_size=t.local_batch_size,
                              dp_replicate=p.data_parallel_replicate_degree,
                              dp_shard=resolved_dp_shard(cfg, world_size))
