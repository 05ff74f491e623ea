"""Asynchronous checkpoint saves and weights-only exports, for
:class:`~titanext.components.checkpoint.CheckpointManager`.

``[checkpoint] async_mode``:

- ``"disabled"``: ``dcp.save``; the step that saves waits for every file.
- ``"async"``: ``dcp.async_save``: the state is copied to CPU memory during the saving step,
  a thread writes it while training goes on.
- ``"async_with_pinned_mem"``: the copy goes to pinned, shared memory (non-blocking on a GPU)
  and a separate checkpoint process writes it (torch's ``AsyncCheckpointerType.PROCESS``:
  no GIL contention with the training loop, more host memory). On a CPU-only machine the
  staging is a plain copy; without a process group (one process), or in a daemonic process
  (which may not start children), a thread writes.

Either async mode waits for the previous save's future before the next save, a resume, or the
end of :meth:`~titanext.trainer.Trainer.train`; only then, with every rank's write finished,
rank 0 writes the manifest and renames ``step-<N>.tmp`` to ``step-<N>``. A job killed while
a save is in flight therefore leaves only a ``.tmp`` folder, which a resume skips (and says so).

DCP's writers run collectives (the save plan, the final metadata) from their thread or
process: they get a gloo group of their own, created once per manager (collectively, by every
rank of the world), so they never interleave with the training loop's collectives on NCCL or
gloo. ``async_save`` needs a CPU backend for them anyway.
"""

from __future__ import annotations

import multiprocessing
from concurrent.futures import Future
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.tensor import DTensor

from titanext import _compat

__all__ = ["ASYNC_MODES", "EXPORT_DTYPES", "AsyncSaver", "cast_for_export"]

ASYNC_MODES = ("disabled", "async", "async_with_pinned_mem")
EXPORT_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16,
                 "float16": torch.float16}


def cast_for_export(state: dict[str, Any], dtype: str) -> dict[str, Any]:
    """Floating-point tensors of a model state dict in ``dtype`` (DTensors stay sharded);
    the rest unchanged. float32 returns ``state`` itself (the weights are fp32 already)."""
    target = EXPORT_DTYPES[dtype]
    if target == torch.float32:
        return state
    return {name: t.to(target) if isinstance(t, (torch.Tensor, DTensor))
            and t.is_floating_point() else t for name, t in state.items()}


class AsyncSaver:
    """One manager's async saves: the writers' gloo group, the staging options, the pending
    future. Collective to build (``dist.new_group``) when a process group is up."""

    def __init__(self, mode: str, process_group: dist.ProcessGroup | None) -> None:
        if mode not in ASYNC_MODES[1:]:
            raise ValueError(f"checkpoint.async_mode = {mode!r}; it must be one of "
                             f"{', '.join(map(repr, ASYNC_MODES))}")
        self.mode = mode
        self.group = None
        if dist.is_available() and dist.is_initialized():
            ranks = None if process_group is None else dist.get_process_group_ranks(process_group)
            self.group = dist.new_group(ranks=ranks, backend="gloo")
        self.options = _compat.pinned_async_save_options() if mode != "async" else {}
        # torch's checkpoint process joins the job's process group, and a daemonic process
        # (a worker of a multiprocessing pool) may not start one: a thread writes there.
        if self.group is None or multiprocessing.current_process().daemon:
            self.options.pop("async_checkpointer_type", None)
        self.future: Future | None = None

    def start(self, state: dict[str, Any], path: str) -> None:
        """Stage ``state`` (a copy: training may change the tensors from now on) and start
        writing it to ``path``; the write's future is :attr:`future`."""
        result = dcp.async_save(state, checkpoint_id=path, process_group=self.group,
                                **self.options)
        if hasattr(result, "upload_completion"):  # staged in the background: wait for the copy
            result.staging_completion.result()
            result = result.upload_completion
        self.future = result

    def finish(self) -> str | None:
        """Wait for the pending write; its error as one line (None when it succeeded)."""
        future, self.future = self.future, None
        if future is None:
            return None
        try:
            future.result()
        except Exception as e:  # noqa: BLE001 - reported on every rank by the manager
            return f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"
        return None

    def close(self) -> None:
        """Release the stager and the writers' group (after :meth:`finish`)."""
        stager = self.options.pop("async_stager", None)
        if stager is not None:
            stager.close()
        if self.group is not None:
            dist.destroy_process_group(self.group)
            self.group = None
