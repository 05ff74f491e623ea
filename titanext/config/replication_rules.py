"""The rules of ``[moe] replicate_hot_experts`` (hot-expert replication under expert parallelism).

Called by :func:`titanext.config.rules.collect_problems`; the bound is the one
``apply_expert_parallel`` enforces at run time
(:func:`titanext.plugins.expert_replication.max_replicas`: a rank can host as copies only the
experts it does not hold).

>>> from titanext.config import ConfigError, load_config
>>> try:
...     load_config(None, ["--model.flavor=debugmoe", "--moe.replicate_hot_experts=2"])
... except ConfigError as e:
...     print(e.problems[0][:64])
moe.replicate_hot_experts = 2 needs expert parallelism: parallel
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

__all__ = ["MOE_RUNTIME_KEYS", "replication_problems"]

# [moe] keys that are not model hyper-parameters (not passed to the flavor's MoEArgs)
MOE_RUNTIME_KEYS = frozenset({"replicate_hot_experts"})


def replication_problems(cfg: Any, skip: set[str], model_args: Callable[[Any], Any]
                         ) -> list[str]:
    """One line per problem of ``moe.replicate_hot_experts`` (its sign is a field check)."""
    n = cfg.moe.replicate_hot_experts
    if not n or n < 0 or skip & {"moe.replicate_hot_experts", "model.name", "model.flavor",
                                 "parallelism.expert_parallel_degree"}:
        return []
    key = f"moe.replicate_hot_experts = {n}"
    ep = cfg.parallelism.expert_parallel_degree
    if ep == 1:
        return [f"{key} needs expert parallelism: parallelism.expert_parallel_degree = 1 (copies "
                "go from one ep rank to another); set expert_parallel_degree > 1 or "
                "replicate_hot_experts = 0"]
    try:
        args = model_args(cfg)
    except (KeyError, ValueError):  # a bad name, flavor or [moe] value: reported elsewhere
        return []
    if args.moe is None or args.moe.num_experts % ep:
        return []  # reported by the expert-parallel rules
    most = args.moe.num_experts - args.moe.num_experts // ep
    if n > most:
        return [f"{key} is more than the experts there are to copy: at most num_experts - "
                f"num_experts / expert_parallel_degree = {args.moe.num_experts} - "
                f"{args.moe.num_experts // ep} = {most} (the experts a rank does not hold)"]
    return []
