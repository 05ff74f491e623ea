"""The config rules of multi-token prediction (``[model] num_mtp_layers``,
``[training] mtp_loss_weight``; docs/deepseek_v3.md), torch-free.

:func:`mtp_problems` names the layouts MTP does not run under, one line each with the key,
the value and what is allowed; :mod:`titanext.config.rules` calls it with the model's shape.

>>> from titanext.config.schema import JobConfig
>>> cfg = JobConfig()
>>> cfg.parallelism.pipeline_parallel_degree = 2
>>> cfg.parallelism.pipeline_parallel_split_backward = "autograd"
>>> mtp_problems(cfg, flavor_depth=1)[0][:56]
"parallelism.pipeline_parallel_split_backward = 'autograd"
"""

from __future__ import annotations

from titanext.config.schema import JobConfig

__all__ = ["mtp_depth", "mtp_problems"]


def mtp_depth(cfg: JobConfig, flavor_depth: int) -> int:
    """The MTP modules the job trains: ``[model] num_mtp_layers``, or the flavor's if -1."""
    return flavor_depth if cfg.model.num_mtp_layers < 0 else cfg.model.num_mtp_layers


def mtp_problems(cfg: JobConfig, *, flavor_depth: int) -> list[str]:
    """MTP against the layout (a model with ``flavor_depth`` MTP modules unless overridden).

    MTP runs under FSDP / HSDP, TP / SP (its modules planned as the blocks,
    ``titanext.plugins.tensor_parallel``), CP (ring, Ulysses, hybrid), EP and every pipeline
    schedule (its modules on the last stage) with titanext's deferred weight gradients;
    torch's autograd split of the backward (kept for comparison) is not tested with MTP's
    embedding copy.
    """
    depth = mtp_depth(cfg, flavor_depth)
    if depth == 0:
        return []
    p, problems = cfg.parallelism, []
    what = (f"multi-token prediction (model.num_mtp_layers = {depth}"
            + (", the flavor's" if cfg.model.num_mtp_layers < 0 else "") + ")")
    if p.pipeline_parallel_degree > 1 and p.pipeline_parallel_split_backward != "deferred":
        problems.append(f"parallelism.pipeline_parallel_split_backward = "
                        f"{p.pipeline_parallel_split_backward!r}: {what} runs with titanext's "
                        "split of the backward; allowed: 'deferred', or model.num_mtp_layers = 0")
    return problems
