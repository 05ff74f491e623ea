"""Process-group set-up, shared by the trainer, the pipeline and the schedules.

- :func:`init_distributed`: the default process group from torchrun's environment (NCCL on
  CUDA, gloo on CPU), or a one-process group outside torchrun; under a torchrun restart it uses
  :func:`elastic_store`, so an attempt never reads a dead attempt's addresses.
- :func:`set_process_group_timeout`, :func:`device_type`, :func:`local_cuda_index`.

Seeding is :mod:`titanext.distributed.determinism`; gradient clipping is
:mod:`titanext.distributed.grad_clip`.

>>> device_type() in ("cpu", "cuda")
True
"""

from __future__ import annotations

import datetime
import os
import socket

import torch
import torch.distributed as dist

from titanext._compat import set_pg_timeout

__all__ = ["device_type", "elastic_store", "free_port", "init_distributed", "local_cuda_index",
           "set_process_group_timeout"]


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now (a local group's rendezvous)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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


def set_process_group_timeout(seconds: float) -> None:
    """Shorten the collective timeout once start-up (which may compile or load) is done."""
    try:  # private in every torch we support; losing it only keeps the init timeout.
        set_pg_timeout(seconds)
    except (AttributeError, RuntimeError):
        pass


def _free_port() -> int:

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
