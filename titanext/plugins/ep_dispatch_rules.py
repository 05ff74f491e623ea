"""The config rules of expert-parallel dispatch: ``[parallelism] expert_parallel_dispatch``,
``expert_parallel_ranks_per_node`` and ``expert_parallel_float8_dispatch``.

Torch-free, beside the plugin whose run-time checks they mirror
(:func:`titanext.plugins.expert_parallel.apply_expert_parallel`); the config calls
:func:`dispatch_problems` while loading a file, one line per problem.

>>> from titanext.config import ConfigError, load_config
>>> try:
...     load_config(None, ["--model.flavor=debugmoe", "--training.local_batch_size=4",
...                        "--parallelism.expert_parallel_degree=4",
...                        "--parallelism.expert_parallel_dispatch=two_level"], world_size=4)
... except ConfigError as e:
...     print(e.problems[0][:74])
parallelism.expert_parallel_dispatch = 'two_level' needs expert_parallel_r
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from titanext.plugins.options import EP_DISPATCH_MODES, max_replicas_within

__all__ = ["EP_DISPATCH_MODES", "dispatch_problems"]

_P = "parallelism."


def dispatch_problems(cfg: Any, skip: set[str], model_args: Callable[[Any], Any]) -> list[str]:
    """One line per problem of the dispatch keys (their choices and signs are field checks)."""
    p = cfg.parallelism
    keys = {_P + k for k in ("expert_parallel_dispatch", "expert_parallel_ranks_per_node",
                             "expert_parallel_degree")}
    if skip & keys:
        return []
    ep, rpn, mode = p.expert_parallel_degree, p.expert_parallel_ranks_per_node, \
        p.expert_parallel_dispatch
    two = f"{_P}expert_parallel_dispatch = 'two_level'"
    problems = []
    if ep == 1:
        if mode == "two_level":
            problems.append(f"{two} needs expert parallelism: {_P}expert_parallel_degree = 1; "
                            "set it > 1 or expert_parallel_dispatch = 'flat'")
        if p.expert_parallel_float8_dispatch:
            problems.append(f"{_P}expert_parallel_float8_dispatch = true needs expert "
                            f"parallelism: {_P}expert_parallel_degree = 1; set it > 1 or false")
        return problems
    if mode == "two_level" and rpn == 0:
        return [f"{two} needs expert_parallel_ranks_per_node (the ep ranks of one node), 0 now; "
                f"allowed: a divisor of expert_parallel_degree = {ep} below it"]
    if rpn and (ep % rpn or (mode == "two_level" and rpn == ep)):
        problems.append(f"{_P}expert_parallel_ranks_per_node = {rpn}: allowed: a divisor of "
                        f"expert_parallel_degree = {ep}"
                        + (" below it (two-level dispatch needs two nodes or more)"
                           if mode == "two_level" else ""))
        return problems
    if mode != "two_level":
        return problems
    try:
        args = model_args(cfg)
    except (KeyError, ValueError):  # a bad name, flavor or [moe] value: reported elsewhere
        return problems
    if args.moe is None or args.moe.num_experts % ep:
        return problems  # reported by the expert-parallel rules
    if args.moe.capacity_factor is not None:
        problems.append(f"{two} and moe.capacity_factor = {args.moe.capacity_factor} cannot be "
                        "combined (two-level dispatch is dropless); unset capacity_factor or use "
                        "'flat'")
    n = cfg.moe.replicate_hot_experts
    nodes, e = ep // rpn, args.moe.num_experts
    most = max_replicas_within(e, ep, copies_within=rpn)  # apply_expert_parallel's own bound
    if n > most:
        problems.append(f"moe.replicate_hot_experts = {n} with {two}: copies stay inside a node; "
                        f"allowed: at most num_experts / nodes - num_experts / ep = {e // nodes} "
                        f"- {e // ep} = {most}")
    return problems
