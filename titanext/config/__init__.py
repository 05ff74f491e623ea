"""Typed job configuration: TOML files + CLI overrides -> :class:`JobConfig`.

The package has four parts, each with one job:

- :mod:`~titanext.config.schema`: one documented dataclass per TOML section; every key's
  attribute docstring is its ``--help`` text, and its own constraints sit next to it.
- :mod:`~titanext.config.loader`: TOML reading with ``[job] extends``, command-line overrides,
  ``--help`` (:func:`config_help`) and ``--print-config`` (:func:`to_toml`).
- :mod:`~titanext.config.layout`: the job resolved once (:func:`resolve_job_layout`: degrees,
  mesh dims, accumulation, the pipeline's :class:`PipelinePlan`, EP, recompute), the one object
  the trainer, the pipeline, the planner and the dry run read.
- :mod:`~titanext.config.rules`: the cross-cutting rules, and the collecting of every problem
  into one report (:func:`collect_problems`, :func:`check_config`).

Where a rule lives: a rule about one package's own options sits in that package, torch-free,
taking plain values, in a module named ``rules`` (``*_rules`` where a package has rules on several
topics), and the config calls it: ``plugins/rules.py`` (float8, activation checkpointing),
``plugins/expert_parallel/rules.py`` (dispatch, hot-expert replication, whose bound is the
plugin's own :func:`~titanext.plugins.expert_parallel.rules.max_replicas`),
``schedules`` (:func:`~titanext.schedules.schedule_problems`, overlap), ``data/rules.py``
(datasets, token shards), ``config/degrees.py`` (the plain-int layout arithmetic). The HF path's
rules (``hf_rules.py``: HF assets, vocab, initial load) sit here, since ``hf`` is above the
config; they read the HF pieces that live below it (``models.hf_configs``, ``models.hf_names``,
``data.hf_tokenizer``). What stays here involves several sections at once (degrees,
batch, pipeline composition, MTP against the layout: ``mtp_rules.py``) or guards code that sits
above the config and so cannot hold it (``[profiling]``: ``profiling_rules.py``).

Importing the package does not import torch.

>>> cfg = load_config("train_configs/debug_model.toml", ["--training.steps=10"], world_size=4)
>>> cfg.training.steps
10
>>> resolved_dp_shard(cfg, 4), gradient_accumulation_steps(cfg, 4)
(4, 1)
"""

from __future__ import annotations

from titanext.config.layout import (
    JobLayout,
    PipelinePlan,
    Recipe,
    gradient_accumulation_steps,
    model_args,
    pipeline_plan,
    recipe_from_config,
    resolve_job_layout,
    resolved_dp_shard,
    ulysses_degree,
)
from titanext.config.loader import config_help, field_docs, load_config, parse_cli, to_toml
from titanext.config.rules import check_config
from titanext.config.schema import (
    SECTIONS,
    Checkpoint,
    Comm,
    Job,
    JobConfig,
    LRSchedulerConfig,
    Metrics,
    Model,
    OptimizerConfig,
    Profiling,
    Training,
)
from titanext.config.schema_parallel import (
    ActivationCheckpoint,
    Compile,
    Float8,
    MoEConfig,
    Parallelism,
)
from titanext.errors import ConfigError

__all__ = [
    "SECTIONS",
    "ActivationCheckpoint",
    "Checkpoint",
    "Comm",
    "Compile",
    "ConfigError",
    "Float8",
    "Job",
    "JobConfig",
    "JobLayout",
    "LRSchedulerConfig",
    "Metrics",
    "MoEConfig",
    "Model",
    "OptimizerConfig",
    "Parallelism",
    "PipelinePlan",
    "Profiling",
    "Recipe",
    "Training",
    "config_help",
    "field_docs",
    "gradient_accumulation_steps",
    "load_config",
    "model_args",
    "parse_cli",
    "pipeline_plan",
    "recipe_from_config",
    "resolve_job_layout",
    "resolved_dp_shard",
    "to_toml",
    "ulysses_degree",
    "check_config",
]
