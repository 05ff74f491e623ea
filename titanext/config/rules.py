"""The cross-cutting rules of the config, and the collecting of every problem into one report.

:func:`collect_problems` runs every rule over a :class:`~titanext.config.schema.JobConfig` and
returns one line per problem; :func:`check_config` raises them as one :class:`ConfigError`.
Rules about one package's own options live in that package and are called from here (see
:mod:`titanext.config`); the layout arithmetic is :mod:`titanext.config.degrees`, and the
pipeline is checked on the :class:`~titanext.config.layout.PipelinePlan` that
:func:`~titanext.config.layout.pipeline_plan` resolves, the one the trainer and the planner run.

>>> check_config(JobConfig(), world_size=4)

Imports of the model registry, the schedules and the pipeline helpers are local to the rules
that need them, so that ``import titanext.config`` stays light (no torch).
"""

from __future__ import annotations

import dataclasses
import importlib.util
from typing import Any

from titanext._text import did_you_mean as _did_you_mean
from titanext.config.degrees import batch_problem, ep_layout_problem
from titanext.config.hf_rules import hf_problems
from titanext.config.layout import (
    PipelinePlan,
    PipelinePlanError,
    _moe_overrides,
    _resolve_shard,
    config_pipeline_plan,
    fake_world_size,
    model_args,
    ulysses_degree,
)
from titanext.config.mtp_rules import mtp_problems
from titanext.config.profiling_rules import profiling_problems
from titanext.config.schema import JobConfig, field_problems
from titanext.data.rules import data_problems
from titanext.data.tokenizer import build_tokenizer
from titanext.errors import ConfigError
from titanext.models import MODEL_FLAVORS, get_model_args
from titanext.models.hf_configs import hf_config_from_model_args, model_args_from_hf
from titanext.plugins.expert_parallel.rules import dispatch_problems, replication_problems
from titanext.plugins.rules import (
    float8_experts_problems,
    float8_problems,
    keep_all_to_all_problem,
    recompute_problems,
)

__all__ = ["check_config", "collect_problems", "ep_overlap_problems", "pipeline_config_problems"]


# -- pipeline -------------------------------------------------------------------------------------

def pipeline_config_problems(cfg: JobConfig) -> list[str]:
    """Config-load rules for pipeline parallelism (one line per problem; with pp > 1).

    The schedule's own rules (micro-batch counts, stage counts, compile) are
    :func:`titanext.schedules.schedule_problems`; this adds what involves other sections.
    """
    return _pipeline_problems(cfg)[0]


def _pipeline_problems(cfg: JobConfig) -> tuple[list[str], PipelinePlan | None]:
    """(the pipeline's problems, its :class:`~titanext.config.layout.PipelinePlan` where one can
    be resolved), through the one resolution the trainer and the planner run."""
    from titanext.schedules import schedule_problems  # the config loads without torch

    p, t, m = cfg.parallelism, cfg.training, cfg.model
    pp, name = p.pipeline_parallel_degree, p.pipeline_parallel_schedule
    key = "parallelism.pipeline_parallel_"
    n_layers = (get_model_args(m.name, m.flavor).n_layers
                if m.name in MODEL_FLAVORS and m.flavor in MODEL_FLAVORS[m.name] else None)
    layer_problem, cap = None, p.pipeline_parallel_max_pending_weight_grads
    plan = None
    while plan is None:
        try:
            plan = config_pipeline_plan(cfg, n_layers, max_pending_weight_grads=cap)
        except PipelinePlanError as e:
            if e.key == "stages_per_rank":
                return [f"{key}stages_per_rank = {p.pipeline_parallel_stages_per_rank}: {e}"], None
            if e.key == "layers":  # reported below; the rest of the plan still holds
                layer_problem = (f"{key}degree = {pp} x stages_per_rank = {e.stages_per_rank}: "
                                 f"{e.num_stages} stages: {e}")
                n_layers = None
            else:  # a cap the schedule cannot take: schedule_problems names it
                cap = 0
    cls, mb = plan.schedule, plan.microbatches
    compiled = cfg.compile.enable and "model" in cfg.compile.components
    # torch's split walks the autograd graph (not on compiled stages); deferral needs no walk
    autograd_split = p.pipeline_parallel_split_backward == "autograd"
    problems = list(schedule_problems(
        name, pp=pp, microbatches=mb, compiled=compiled and autograd_split,
        stages_per_rank=plan.stages_per_rank,
        max_pending_weight_grads=p.pipeline_parallel_max_pending_weight_grads))
    if compiled and plan.placement == "v" and not hasattr(cls, "generate") \
            and not any("compile" in q for q in problems):
        problems.append(f"{key}schedule = {name!r} (torch's) refuses torch.compile'd stages; use "
                        "'ZBV' or set compile.enable = false")
    if p.zero_stage == 1:
        problems.append(f"parallelism.zero_stage = 1 with {key}degree = {pp} is not supported (the "
                        "stages are not wrapped in DDP, so gradients would not be reduced over "
                        "data parallel ranks); use zero_stage 2 or 3")
    if plan.mirrored and p.tensor_parallel_degree > 1:
        problems.append(f"{key}schedule = {name!r} with parallelism.tensor_parallel_degree = "
                        f"{p.tensor_parallel_degree} is not supported yet (the mirrored-copy "
                        "gradient sum is untested under TP); use 'DualPipeV' or tp = 1")
    if t.local_batch_size % mb:
        problems.append(f"training.local_batch_size = {t.local_batch_size} must be divisible by "
                        f"{key}microbatches = {mb} (each micro-batch is a slice of the batch)")
    if layer_problem:
        problems.append(layer_problem)
    return problems, plan


def _pipeline_composition_problems(cfg: JobConfig, skip: set[str],
                                   plan: PipelinePlan | None) -> list[str]:
    """Features that cannot run inside pipeline stages (checked only with pp > 1).

    Everything else composes with PP: FSDP/HSDP, TP/SP with loss parallel, CP (the stages get
    the CP-sharded position ids), float8, full and layer-level AC
    (tests/multiprocess/test_composition.py).
    ZeRO-1 and DualPipe x TP are rejected by :func:`pipeline_config_problems`.
    """
    p, ac = cfg.parallelism, cfg.activation_checkpoint
    if plan is None:  # no pipeline, or one whose own rules failed
        return []
    problems = []
    splits = getattr(plan.schedule, "splits_backward", False)
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

def _model_problems(cfg: JobConfig, skip: set[str], degrees_ok: bool) -> list[str]:
    """Name and flavor against the registry, then the rules that need the model's shape."""

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

        vocab = build_tokenizer(m.tokenizer).vocab_size
        if args.vocab_size < vocab:
            problems.append(f"model.tokenizer = {m.tokenizer!r} produces {vocab} token ids but "
                            f"the model's vocab_size = {args.vocab_size} ({which}); pick a flavor "
                            f"with vocab_size >= {vocab}")
    return problems


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

    m, c, p = cfg.model, cfg.checkpoint, cfg.parallelism
    problems = []
    if c.initial_load_in_hf and not c.initial_load_path:
        problems.append("checkpoint.initial_load_in_hf = true needs checkpoint.initial_load_path "
                        "(a Hugging Face model directory)")
    problems += _checkpoint_export_problems(c)
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


def _checkpoint_export_problems(c: Any) -> list[str]:
    """The weights-only last save (as torchtitan's checkpoint options; there export_dtype
    without model_weights_only is ignored silently, here it is refused)."""
    problems = []
    if c.export_dtype != "float32" and not c.model_weights_only:
        problems.append(f"checkpoint.export_dtype = {c.export_dtype!r} applies only to the "
                        "weights-only last save: set checkpoint.model_weights_only = true, or "
                        "leave export_dtype = 'float32' (full checkpoints keep the training dtype)")
    if c.model_weights_only and not (c.enable and c.last_save):
        problems.append("checkpoint.model_weights_only = true needs checkpoint.enable = true and "
                        "checkpoint.last_save = true (it shapes the save after the last step)")
    return problems


def _moe_problems(cfg: JobConfig, skip: set[str]) -> list[str]:
    """[moe] against the flavor: only for MoE flavors, and the merged values must fit together."""

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
                        "the forward, which op-level checkpointing refuses; use mode = 'full' "
                        "with keep_all_to_all = true (recompute without re-dispatch) or a "
                        "layer-level selective_ac_option such as '2'")
    return problems


def ep_overlap_problems(cfg: JobConfig, plan: PipelinePlan | None) -> list[str]:
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
    from titanext.schedules.overlap import overlap_problems  # the config loads without torch

    if plan is None:  # reported by the pipeline rules
        return []
    # torch's DualPipeV class is named like titanext's: tell them apart by the config's name
    canonical = "TorchDualPipeV" if name.lower() == "torchdualpipev" else plan.schedule.__name__
    return overlap_problems(canonical, pp=pp, microbatches=plan.microbatches,
                            stages_per_rank=plan.stages_per_rank)


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


def _full_blocks_problems(cfg: JobConfig, plan: PipelinePlan | None, skip: set[str]
                          ) -> list[str]:
    """``[activation_checkpoint] full_blocks`` as a list: one count per pipeline stage."""
    full, key = cfg.activation_checkpoint.full_blocks, "activation_checkpoint.full_blocks"
    if not isinstance(full, list) or key in skip:
        return []
    pp = cfg.parallelism.pipeline_parallel_degree
    stages = plan.num_stages if plan is not None else 1 if pp == 1 else None
    if stages is None or len(full) == stages:
        return []
    return [f"{key} = {full!r} has {len(full)} entries, but the job has {stages} pipeline "
            f"stage{'s' if stages > 1 else ''}; give one count per stage, or one integer for all"]


def _ok(skip: set[str], *keys: str) -> bool:
    """True when none of ``keys`` failed its own check (bare names are parallelism keys)."""
    return not skip.intersection(k if "." in k else f"parallelism.{k}" for k in keys)


def _cross_field_problems(cfg: JobConfig, world_size: int | None, skip: set[str]) -> list[str]:
    """Every rule that involves several keys, in report order: the layout, then the features
    on it, then batch and ZeRO, then data and outputs."""
    problems, shard, degrees_ok = _layout_problems(cfg, world_size, skip)
    ac = cfg.activation_checkpoint
    keep = ac.keep_all_to_all and _ok(skip, "activation_checkpoint.mode",
                                      "activation_checkpoint.selective_ac_option")
    problem = keep and keep_all_to_all_problem(ac.mode, ac.selective_ac_option, ac.full_blocks)
    if problem:
        problems.append(problem)
    problems += _model_problems(cfg, skip, degrees_ok)
    plan = None  # the pipeline as the trainer would run it (pp > 1 and its own rules pass)
    if degrees_ok and cfg.parallelism.pipeline_parallel_degree > 1 and _ok(
            skip, "pipeline_parallel_schedule"):
        found, plan = _pipeline_problems(cfg)
        problems += found
    problems += float8_problems(cfg.float8, cfg.parallelism, skip)
    problems += float8_experts_problems(cfg, skip, model_args)
    problems += recompute_problems(cfg, skip, model_args)
    problems += _full_blocks_problems(cfg, plan, skip)
    problems += _moe_problems(cfg, skip)
    problems += _ep_problems(cfg, skip, shard if degrees_ok else None)
    problems += replication_problems(cfg, skip, model_args)
    problems += dispatch_problems(cfg, skip, model_args)
    if degrees_ok and _ok(skip, "expert_parallel_degree", "pipeline_parallel_schedule"):
        problems += ep_overlap_problems(cfg, plan)
    if degrees_ok:
        problems += _pipeline_composition_problems(cfg, skip, plan)
    problems += _batch_and_zero_problems(cfg, skip, shard)
    problems += _data_and_output_problems(cfg, skip)
    problems += _optimizer_problems(cfg.optimizer, skip)
    return problems


def _optimizer_problems(o: Any, skip: set[str]) -> list[str]:
    """Muon keys set while another optimizer runs would change nothing, and Muon keeps no Adam
    moments for state_dtype to lower: errors, not no-ops. (The groups' globs are checked
    against the model itself when the trainer builds it:
    titanext.components.param_groups.group_problems.)"""
    if "optimizer.name" in skip:
        return []
    problems = []
    if o.name != "Muon" and o.muon_params is not None:
        problems.append(f"optimizer.muon_params = {o.muon_params!r} is only read with "
                        f"optimizer.name = 'Muon', but optimizer.name = {o.name!r}; set name = "
                        "'Muon' or unset muon_params")
    if o.name != "Muon" and o.muon_split_params is not None:
        problems.append(f"optimizer.muon_split_params = {o.muon_split_params!r} is only read "
                        f"with optimizer.name = 'Muon', but optimizer.name = {o.name!r}; set "
                        "name = 'Muon' or unset muon_split_params")
    if o.name == "Muon" and o.state_dtype != "float32" and "optimizer.state_dtype" not in skip:
        problems.append(f"optimizer.state_dtype = {o.state_dtype!r} lowers AdamW / Adam moments; "
                        "with optimizer.name = 'Muon' only 'float32' is allowed")
    return problems


def _layout_problems(cfg: JobConfig, world_size: int | None, skip: set[str]
                     ) -> tuple[list[str], int | None, bool]:
    """The world size, the degrees against it and the sequence split: (problems, the resolved
    dp_shard degree or None, whether the degrees passed their own checks)."""
    problems: list[str] = []
    if world_size is not None and (isinstance(world_size, bool) or not isinstance(world_size, int)
                                   or world_size < 1):
        problems.append(f"world size {world_size!r} must be a positive integer")
        world_size = None

    def ok(*keys: str) -> bool:
        return _ok(skip, *keys)

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
    cp, tp = p.context_parallel_degree, p.tensor_parallel_degree

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
    return problems, shard, degrees_ok


def _batch_and_zero_problems(cfg: JobConfig, skip: set[str], shard: int | None) -> list[str]:
    """The batch against the data-parallel degrees, and ZeRO against the layout."""
    problems: list[str] = []
    p, t = cfg.parallelism, cfg.training
    rep, tp = p.data_parallel_replicate_degree, p.tensor_parallel_degree
    if shard is not None and _ok(skip, "training.local_batch_size", "training.global_batch_size"):
        problem = batch_problem(global_batch_size=t.global_batch_size,
                                local_batch_size=t.local_batch_size, dp_replicate=rep,
                                dp_shard=shard)
        if problem:
            problems.append(problem)

    if _ok(skip, "zero_stage", "tensor_parallel_degree", "data_parallel_replicate_degree") \
            and p.zero_stage == 1 and (tp > 1 or rep > 1):
        problems.append(
            f"parallelism.zero_stage = 1 (DDP + sharded optimizer state over replicated "
            f"parameters) needs tensor_parallel_degree = 1 and data_parallel_replicate_degree = 1,"
            f" got {tp} and {rep}; use zero_stage 2 or 3")
    if _ok(skip, "zero_stage", "fsdp_reshard_after_forward") and p.zero_stage == 2 \
            and p.fsdp_reshard_after_forward != "default":
        problems.append(
            f"parallelism.fsdp_reshard_after_forward = {p.fsdp_reshard_after_forward!r} conflicts "
            "with zero_stage = 2, which never reshards after forward; leave it 'default' or use "
            "zero_stage = 3")
    return problems


def _data_and_output_problems(cfg: JobConfig, skip: set[str]) -> list[str]:
    """The datasets, and what a run writes out (profiling, wandb)."""
    sections = [("training", cfg.training)] + ([("validation", cfg.validation)]
                                               if cfg.validation.enable else [])
    problems = list(data_problems(
        [(name, sec.dataset, sec.dataset_path) for name, sec in sections
         if not {f"{name}.dataset", f"{name}.dataset_path", "training.dataset_text_field"} & skip],
        text_field=cfg.training.dataset_text_field, tokenizer=cfg.model.tokenizer,
        hf_assets_path=cfg.model.hf_assets_path))
    hf_used = cfg.training.dataset == "hf" or (cfg.validation.enable
                                                and cfg.validation.dataset == "hf")
    if cfg.training.dataset_name and not hf_used and not {
            "training.dataset", "validation.dataset", "validation.enable"} & skip:
        problems.append(f"training.dataset_name = {cfg.training.dataset_name!r} is only read "
                        f"with dataset = 'hf', but training.dataset = {cfg.training.dataset!r}; "
                        "set dataset = 'hf' or dataset_name = \"\"")
    problems += profiling_problems(cfg, skip)
    if cfg.metrics.enable_wandb and "metrics.enable_wandb" not in skip \
            and importlib.util.find_spec("wandb") is None:
        problems.append("metrics.enable_wandb = True needs the wandb package, which is not "
                        "installed; pip install 'titanext[wandb]' or set enable_wandb = false")
    return problems


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
