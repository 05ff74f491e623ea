"""Process-group plumbing shared by the trainer, the pipeline and the schedules.

- :func:`init_distributed`: the default process group from torchrun's environment (NCCL on
  CUDA, gloo on CPU), or a one-process group outside torchrun; under a torchrun restart it uses
  :func:`elastic_store`, so an attempt never reads a dead attempt's addresses.
- :func:`set_determinism`, :func:`set_process_group_timeout`.
- :func:`clip_grad_norm_`: global gradient-norm clipping over FSDP / TP / PP shards, and
  :func:`clip_mirrored_grads` for DualPipe's two copies of each stage.

>>> device_type() in ("cpu", "cuda")
True
"""

from __future__ import annotations

import datetime
import math
import os
from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate

from titanext._compat import foreach_mul_, set_pg_timeout

__all__ = ["clip_grad_norm_", "clip_mirrored_grads", "device_type", "elastic_store",
           "init_distributed", "local_cuda_index", "set_determinism", "set_process_group_timeout"]


def device_type() -> str:
    """``cuda`` when a GPU is visible, else ``cpu``."""
    return "cuda" if torch.cuda.is_available() else "cpu"


def init_distributed(timeout_s: float = 300.0) -> torch.device:
    """Initialise the default process group from torchrun's environment.

    Backend is chosen from the device: NCCL on CUDA, gloo on CPU. Returns this rank's device.
    Outside torchrun (no WORLD_SIZE) a 1-process group is created on a free local port.
    """
    dev = device_type()
    if dev == "cuda":
        device = torch.device("cuda", local_cuda_index())
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    if not dist.is_initialized():
        if "WORLD_SIZE" not in os.environ:
            os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1")
            os.environ.setdefault("MASTER_PORT", str(_free_port()))
        timeout = datetime.timedelta(seconds=timeout_s)
        store = elastic_store(timeout)  # a torchrun restart: this attempt's own keys
        dist.init_process_group(
            backend="nccl" if dev == "cuda" else "gloo", timeout=timeout,
            device_id=device if dev == "cuda" else None,
            **({} if store is None else {"store": store, "rank": int(os.environ["RANK"]),
                                         "world_size": int(os.environ["WORLD_SIZE"])}),
        )
    return device


def local_cuda_index() -> int:
    """This rank's GPU: ``LOCAL_RANK``, or with ``NCCL_MULTI_RANK_GPU_ENABLE=1`` (NCCL 2.28+:
    several ranks of one communicator on one GPU) ``LOCAL_RANK`` modulo the GPUs visible."""
    local_rank, count = int(os.environ.get("LOCAL_RANK", 0)), torch.cuda.device_count()
    if local_rank < count:
        return local_rank
    if os.environ.get("NCCL_MULTI_RANK_GPU_ENABLE") == "1":
        return local_rank % count
    raise RuntimeError(
        f"LOCAL_RANK {local_rank}, but {count} GPU(s) are visible: start at most {count} "
        "processes per node (torchrun --nproc_per_node), or set NCCL_MULTI_RANK_GPU_ENABLE=1 "
        "to let ranks share a GPU (NCCL 2.28 or newer)")


def elastic_store(timeout: datetime.timedelta):
    """The store for ``init_process_group`` in a torchrun restart, or None (use the default).

    torchrun's workers share the agent's TCPStore, and its keys outlive a failed attempt: a
    restarted rank could read a dead peer's gloo address from the previous attempt and fail in
    ``connectFullMesh`` ("Connection refused"). A prefix per attempt
    (``TORCHELASTIC_RESTART_COUNT``) keeps every attempt's keys apart.
    """
    restart = os.environ.get("TORCHELASTIC_RESTART_COUNT")
    if restart is None or os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                          int(os.environ["WORLD_SIZE"]), is_master=False, timeout=timeout)
    return dist.PrefixStore(f"titanext/attempt-{restart}", store)


def set_determinism(seed: int, deterministic: bool = False) -> None:
    """Seed torch's RNG; ``deterministic`` also asks for deterministic kernels (slower)."""
    torch.manual_seed(seed)
    if deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True)
        torch.backends.cudnn.benchmark = False


def set_process_group_timeout(seconds: float) -> None:
    """Shorten the collective timeout once start-up (which may compile or load) is done."""
    try:  # private in every torch we support; losing it only keeps the init timeout.
        set_pg_timeout(seconds)
    except (AttributeError, RuntimeError):
        pass


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@torch.no_grad()
def clip_grad_norm_(
    parameters: Iterable[torch.Tensor],
    max_norm: float,
    *,
    norm_type: float = 2.0,
    pp_group: dist.ProcessGroup | None = None,
) -> torch.Tensor:
    """Global gradient-norm clipping for any mix of plain tensors and DTensors.

    Gradients are bucketed by (mesh, sharded mesh dims); each bucket's local ``|g|^p`` is summed
    and reduced once per sharded dim, so parameters sharded by FSDP, TP or both, on different
    meshes, mix freely at a few collectives per step. With ``pp_group`` the total also sums over
    pipeline stages, which hold different parameters. ``max_norm <= 0`` only measures.
    Returns the total norm as a plain fp32 tensor.
    """
    params = [p for p in parameters if p.grad is not None]
    if not params:
        return torch.tensor(0.0)
    is_inf = math.isinf(norm_type)
    buckets: dict[tuple, list[torch.Tensor]] = {}
    for p in params:
        g = p.grad
        if isinstance(g, DTensor) and any(pl.is_partial() for pl in g.placements):
            # e.g. SP norm weights: each TP rank holds a partial sum. Reduce it now (the
            # optimizer would do the same), so the norm sees the real gradient.
            g = p.grad = g.redistribute(
                g.device_mesh, [Replicate() if pl.is_partial() else pl for pl in g.placements]
            )
        if isinstance(g, DTensor):
            dims = tuple(i for i, pl in enumerate(g.placements) if not pl.is_replicate())
            key, local = (g.device_mesh, dims), g.to_local()
        else:
            key, local = (None, ()), g
        n = torch.linalg.vector_norm(local.float(), norm_type)
        buckets.setdefault(key, []).append(n if is_inf else n.pow(norm_type))
    device = params[0].grad.device
    total = torch.zeros((), dtype=torch.float32, device=device)
    op = dist.ReduceOp.MAX if is_inf else dist.ReduceOp.SUM
    for (mesh, dims), parts in buckets.items():
        acc = torch.stack(parts).max() if is_inf else torch.stack(parts).sum()
        for d in dims:
            dist.all_reduce(acc, op=op, group=mesh.get_group(d))
        total = torch.maximum(total, acc) if is_inf else total + acc
    if pp_group is not None:
        dist.all_reduce(total, op=op, group=pp_group)
    if not is_inf:
        total = total.pow(1.0 / norm_type)
    if max_norm > 0:
        coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        # Scale the local shards in place (under no_grad, to_local() is the DTensor's storage):
        # one foreach kernel, whatever meshes the gradients live on.
        local = [p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad for p in params]
        foreach_mul_(local, coef.to(local[0].device))
    return total


def clip_mirrored_grads(down: list, up: list, max_norm: float, *, pp_group=None) -> torch.Tensor:
    """Global-norm clipping for DualPipe's two copies: the norm counts every stage once (the
    ``down`` copies' parameters, summed over ``pp_group``) and both copies take the same factor,
    so mirrored copies stay bitwise equal. Call after
    :func:`titanext.schedules.dualpipe.sum_mirrored_grads`; returns the norm. The pipeline runner
    does this; the factor is :func:`clip_grad_norm_`'s."""
    total = clip_grad_norm_(down, 0.0, pp_group=pp_group)  # measure only
    if max_norm > 0:
        coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        grads = [p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
                 for p in (*down, *up) if p.grad is not None]
        if grads:
            foreach_mul_(grads, coef.to(grads[0].device))
    return total
