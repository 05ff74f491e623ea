"""The config rules of expert parallelism: dispatch (``[parallelism] expert_parallel_dispatch``,
``expert_parallel_ranks_per_node``, ``expert_parallel_float8_dispatch``) and hot-expert
replication (``[moe] replicate_hot_experts``), with the option values both accept.

Torch-free, beside the plugin whose run-time checks they mirror
(:func:`titanext.plugins.expert_parallel.apply_expert_parallel`, which calls the same bounds);
the config calls :func:`dispatch_problems` and :func:`replication_problems` while loading a file,
one line per problem.

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

__all__ = ["EP_DISPATCH_MODES", "REPLICATION_SLACK", "dispatch_problems", "max_replicas",
           "max_replicas_within", "replication_problems"]

#: Hot-expert replication makes no new copy while the busiest ep rank is within this fraction
#: of the mean rows (a copy would cost more than the rows it moves).
REPLICATION_SLACK = 0.05

#: ``[parallelism] expert_parallel_dispatch`` and ``apply_expert_parallel(dispatch=...)``: every
#: (token, expert) row sent on its own, or each token once per destination node, then fanned
#: out inside it (:mod:`titanext.plugins.expert_parallel._dispatch`).
EP_DISPATCH_MODES = ("flat", "two_level")


def max_replicas(num_experts: int, ep: int) -> int:
    """The largest useful ``replicate_hot_experts``: the experts a rank does not hold."""
    return num_experts - num_experts // ep


def max_replicas_within(num_experts: int, ep: int, copies_within: int = 0) -> int:
    """:func:`max_replicas` where a copy can only go to ``copies_within`` ranks (two-level
    dispatch keeps copies inside a node of that many ep ranks; 0: any of the ``ep``): the experts
    of those ranks that a rank does not hold, ``num_experts / nodes - num_experts / ep``.

    >>> max_replicas_within(64, 8), max_replicas_within(64, 8, copies_within=4)
    (56, 24)
    """
    homes = copies_within or ep
    return max_replicas(num_experts * homes // ep, homes)


def replication_problems(cfg: Any, skip: set[str], model_args: Callable[[Any], Any]
                         ) -> list[str]:
    """One line per problem of ``[moe] replicate_hot_experts`` (its sign is a field check): it
    needs expert parallelism, and at most :func:`max_replicas` copies, the bound
    ``apply_expert_parallel`` enforces at run time. ``model_args(cfg)`` gives the job's model.

    >>> from titanext.config import ConfigError, load_config
    >>> try:
    ...     load_config(None, ["--model.flavor=debugmoe", "--moe.replicate_hot_experts=2"])
    ... except ConfigError as e:
    ...     print(e.problems[0][:64])
    moe.replicate_hot_experts = 2 needs expert parallelism: parallel
    """
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
    most = max_replicas(args.moe.num_experts, ep)
    if n > most:
        return [f"{key} is more than the experts there are to copy: at most num_experts - "
                f"num_experts / expert_parallel_degree = {args.moe.num_experts} - "
                f"{args.moe.num_experts // ep} = {most} (the experts a rank does not hold)"]
    return []

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
