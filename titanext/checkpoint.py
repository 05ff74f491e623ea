"""Distributed checkpoints with torch.distributed.checkpoint (DCP): atomic, prunable, reshardable.

Layout: ``<folder>/step-<N>/`` holds the DCP shards of the model and optimizer (whatever mix of
FSDP/TP DTensors and plain tensors they are), ``trainer_state.pt`` (step, LR scheduler, data
loader position, extra states, world size) and ``rng-<rank>.pt``. A save is written into
``step-<N>.tmp/`` and renamed once every rank has finished, so an interrupted save never
looks like a checkpoint. Because DCP stores global tensors by name, a checkpoint saved under
one layout loads under another (FSDP 4 -> FSDP 2 x TP 2, say).

>>> ckpt = CheckpointManager(folder="outputs/ckpt", interval=100, keep_latest_k=2,
...                          load_step="latest", last_save=True, enable=True,
...                          model_parts=[model], optimizer=opt, lr_scheduler=sched,
...                          dataloader=loader)                          # doctest: +SKIP
>>> step = ckpt.load()                    # 0 when there is nothing to resume  # doctest: +SKIP
>>> ckpt.maybe_save(step)                                                # doctest: +SKIP
"""

from __future__ import annotations

import logging
import os
import re
import shutil
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

__all__ = ["CheckpointManager"]

logger = logging.getLogger("titanext")
_STEP_DIR = re.compile(r"^step-(\d+)$")


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def _is_zero1(optimizer: torch.optim.Optimizer) -> bool:
    from torch.distributed.optim import ZeroRedundancyOptimizer

    return isinstance(optimizer, ZeroRedundancyOptimizer)


class CheckpointManager:
    """Save every ``interval`` steps (and after the last with ``last_save``); resume on load.

    ``load_step``: "latest" (or -1), "none", or a step number. ``keep_latest_k > 0`` keeps
    only the newest k complete checkpoints. With ``enable=False`` every call is a no-op.
    One model part and one optimizer over it; a ZeroRedundancyOptimizer (ZeRO-1) is saved
    consolidated, so it too loads under another data-parallel size.
    """

    def __init__(self, *, folder: str, interval: int, keep_latest_k: int, load_step: int | str,
                 last_save: bool, enable: bool, model_parts: list[nn.Module],
                 optimizer: torch.optim.Optimizer, lr_scheduler: Any, dataloader: Any,
                 extra_states: dict[str, Any] | None = None):
        if enable and len(model_parts) != 1:
            raise ValueError(f"CheckpointManager takes one model part, got {len(model_parts)}")
        self.folder, self.interval, self.keep_latest_k = folder, interval, keep_latest_k
        self.load_step, self.last_save, self.enable = load_step, last_save, enable
        self.model = model_parts[0] if model_parts else None
        self.optimizer, self.lr_scheduler, self.dataloader = optimizer, lr_scheduler, dataloader
        self.extra_states = extra_states or {}

    # -- discovery -----------------------------------------------------------------------------
    def complete_steps(self) -> list[int]:
        """Steps with a complete (committed) checkpoint, ascending."""
        if not os.path.isdir(self.folder):
            return []
        steps = []
        for name in os.listdir(self.folder):
            m = _STEP_DIR.match(name)
            path = os.path.join(self.folder, name)
            if m and os.path.exists(os.path.join(path, "trainer_state.pt")) and os.path.exists(
                    os.path.join(path, ".metadata")):
                steps.append(int(m.group(1)))
        return sorted(steps)

    def latest_step(self) -> int | None:
        steps = self.complete_steps()
        return steps[-1] if steps else None

    def _path(self, step: int) -> str:
        return os.path.join(self.folder, f"step-{step}")

    # -- state ---------------------------------------------------------------------------------
    def _tensor_state(self) -> dict[str, Any]:
        state = {"model": get_model_state_dict(self.model)}
        if not _is_zero1(self.optimizer):
            state["optimizer"] = get_optimizer_state_dict(self.model, self.optimizer)
        return state

    def _trainer_state(self, step: int) -> dict[str, Any]:
        state = {
            "step": step,
            "world_size": dist.get_world_size() if dist.is_initialized() else 1,
            "lr_scheduler": self.lr_scheduler.state_dict() if self.lr_scheduler is not None else None,
            "dataloader": self.dataloader.state_dict() if self.dataloader is not None else None,
        }
        state["extra"] = {k: v.state_dict() for k, v in self.extra_states.items()}
        return state

    # -- save ----------------------------------------------------------------------------------
    def maybe_save(self, step: int, *, last: bool = False) -> bool:
        if not self.enable:
            return False
        if step % self.interval == 0 or (last and self.last_save):
            self.save(step)
            return True
        return False

    def save(self, step: int) -> None:
        """Write step ``step`` atomically (collective: every rank calls it)."""
        final, tmp = self._path(step), self._path(step) + ".tmp"
        if _rank() == 0:
            os.makedirs(self.folder, exist_ok=True)
            for name in os.listdir(self.folder):  # leftovers of interrupted saves
                if name.endswith(".tmp"):
                    shutil.rmtree(os.path.join(self.folder, name), ignore_errors=True)
        _barrier()
        dcp.save(self._tensor_state(), checkpoint_id=tmp)
        if _is_zero1(self.optimizer):
            self.optimizer.consolidate_state_dict(to=0)  # collective
            if _rank() == 0:
                torch.save(self.optimizer.state_dict(), os.path.join(tmp, "zero1_optimizer.pt"))
        rng = {"cpu": torch.get_rng_state()}
        if torch.cuda.is_available():
            rng["cuda"] = torch.cuda.get_rng_state()
        torch.save(rng, os.path.join(tmp, f"rng-{_rank()}.pt"))
        if _rank() == 0:
            torch.save(self._trainer_state(step), os.path.join(tmp, "trainer_state.pt"))
        _barrier()  # every rank's files are in tmp
        if _rank() == 0:
            if os.path.exists(final):  # re-saving a step: move the old one out of the way first
                old = final + ".old"
                shutil.rmtree(old, ignore_errors=True)
                os.replace(final, old)
                os.replace(tmp, final)
                shutil.rmtree(old, ignore_errors=True)
            else:
                os.replace(tmp, final)
            self._prune()
            logger.info("saved checkpoint %s", final)
        _barrier()

    def _prune(self) -> None:
        if self.keep_latest_k <= 0:
            return
        for step in self.complete_steps()[: -self.keep_latest_k]:
            shutil.rmtree(self._path(step), ignore_errors=True)

    # -- load ----------------------------------------------------------------------------------
    def _resolve_load_step(self) -> int | None:
        ls = self.load_step
        if ls == "none":
            return None
        steps = self.complete_steps()
        if ls in ("latest", -1):
            return steps[-1] if steps else None
        step = int(ls)
        if step not in steps:
            raise ValueError(f"checkpoint.load_step = {step}: no complete checkpoint step-{step} in "
                             f"{self.folder!r}; available steps: {steps or 'none'}")
        return step

    def load(self) -> int:
        """Restore the chosen checkpoint; returns its step (0 when nothing was loaded)."""
        if not self.enable:
            return 0
        step = self._resolve_load_step()
        if step is None:
            return 0
        path = self._path(step)
        state = self._tensor_state()
        dcp.load(state, checkpoint_id=path)
        set_model_state_dict(self.model, state["model"])
        if _is_zero1(self.optimizer):
            self.optimizer.load_state_dict(torch.load(os.path.join(path, "zero1_optimizer.pt"),
                                                      weights_only=False))
        else:
            set_optimizer_state_dict(self.model, self.optimizer, state["optimizer"])
        trainer = torch.load(os.path.join(path, "trainer_state.pt"), weights_only=False)
        if self.lr_scheduler is not None and trainer["lr_scheduler"] is not None:
            self.lr_scheduler.load_state_dict(trainer["lr_scheduler"])
        if self.dataloader is not None and trainer["dataloader"] is not None:
            self.dataloader.load_state_dict(trainer["dataloader"])
        for key, obj in self.extra_states.items():
            if key in trainer["extra"]:
                obj.load_state_dict(trainer["extra"][key])
        world = dist.get_world_size() if dist.is_initialized() else 1
        rng_file = os.path.join(path, f"rng-{_rank()}.pt")
        if trainer["world_size"] == world and os.path.exists(rng_file):
            rng = torch.load(rng_file, weights_only=False)
            torch.set_rng_state(rng["cpu"])
            if "cuda" in rng and torch.cuda.is_available():
                torch.cuda.set_rng_state(rng["cuda"])
        elif _rank() == 0:
            logger.warning("checkpoint %s was saved by %s ranks, this run has %s: RNG state is not "
                           "restored (model, optimizer and data position are)", path,
                           trainer["world_size"], world)
        if _rank() == 0:
            print(f"titanext: resumed from {path} (step {step})", flush=True)
        return trainer["step"]
