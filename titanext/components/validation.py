"""Validation: the mean token loss and perplexity of the model on a held-out source.

Every ``[validation] freq`` steps the trainer calls :meth:`Validator.maybe_run`: the model
runs forward only (``torch.no_grad``) over the first ``steps`` batches of
``[validation] dataset`` (read unshuffled, from the start, every time, so values are comparable
across steps), and the mean token loss and ``exp(loss)`` go to the console and to TensorBoard
(``validation/loss``, ``validation/perplexity``).

The batches are split like training batches: over the data-parallel ranks by the loader's
global order, over context-parallel ranks by the trainer's CP layout; tensor and expert
parallelism are inside the model. The loss is summed per rank and all-reduced with the token
count over the ranks that see different tokens, so the value equals one process on the whole
batch. Under pipeline parallelism the stages run forward only, one after the other
(:func:`pipeline_forward`): no schedule, no backward, whatever schedule trains them. MoE routing
counts that a validation forward adds are restored, so the expert-bias update never sees them.

>>> from titanext.config import load_config
>>> cfg = load_config(None, ["--validation.enable=true", "--validation.dataset=shakespeare",
...                          "--validation.freq=50"])
>>> (cfg.validation.freq, cfg.validation.steps, cfg.validation.local_batch_size)
(50, 10, 8)

Tested against one process under FSDP, PP (1F1B, ZBV), CP x TP and EP in
tests/multiprocess/test_validation.py.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from titanext.data import dataloader_from_config
from titanext.plugins.context_parallel import prepare_batch

__all__ = ["Validator", "pipeline_forward"]

IGNORE_INDEX = -100
# dtypes a pipeline activation may have, by index (the header of a send carries the index)
_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64, torch.int32)
_HEADER = 8  # [ndim, up to 6 sizes, dtype index]


def _send(tensor: torch.Tensor, dst: int, group: dist.ProcessGroup) -> None:
    """Send ``tensor`` of any shape to global rank ``dst``: a fixed-size header, then data."""
    header = torch.zeros(_HEADER, dtype=torch.int64, device=tensor.device)
    header[0] = tensor.dim()
    header[1 : 1 + tensor.dim()] = torch.tensor(tensor.shape)
    header[-1] = _DTYPES.index(tensor.dtype)
    dist.send(header, dst, group=group)
    dist.send(tensor.contiguous(), dst, group=group)


def _recv(src: int, group: dist.ProcessGroup, device: torch.device) -> torch.Tensor:
    header = torch.empty(_HEADER, dtype=torch.int64, device=device)
    dist.recv(header, src, group=group)
    shape = header[1 : 1 + int(header[0])].tolist()
    tensor = torch.empty(shape, dtype=_DTYPES[int(header[-1])], device=device)
    dist.recv(tensor, src, group=group)
    return tensor


def pipeline_forward(parts: Sequence[nn.Module], stage_ids: Sequence[int], num_stages: int,
                     pp_group: dist.ProcessGroup, inputs: torch.Tensor,
                     device: torch.device, **stage_kwargs: torch.Tensor) -> torch.Tensor | None:
    """Run the stages forward only, in stage order; returns the last stage's output on the rank
    that holds it (the lowest pp rank holding it, when copies are mirrored), else None.

    Every pp rank of ``pp_group`` calls it with its own ``parts`` (holding ``stage_ids``); the
    activation between two stages on different ranks travels by send/recv. ``stage_kwargs``
    (e.g. ``document_ids`` and per-row ``position_ids``) go to every stage's forward.
    """
    pp_rank, pp = dist.get_rank(pp_group), dist.get_world_size(pp_group)
    held: list[list[int]] = [[] for _ in range(pp)]
    dist.all_gather_object(held, list(stage_ids), group=pp_group)
    owner = {s: min(r for r in range(pp) if s in held[r]) for s in range(num_stages)}
    part_of = {s: parts[list(stage_ids).index(s)] for s in range(num_stages)
               if owner[s] == pp_rank}
    h: torch.Tensor | None = None
    for s in range(num_stages):
        if owner[s] != pp_rank:
            continue
        if s == 0:
            h = inputs
        elif owner[s - 1] != pp_rank:
            h = _recv(dist.get_global_rank(pp_group, owner[s - 1]), pp_group, device)
        h = part_of[s](h, **stage_kwargs)
        if s < num_stages - 1 and owner[s + 1] != pp_rank:
            out = h.full_tensor() if isinstance(h, DTensor) else h
            _send(out, dist.get_global_rank(pp_group, owner[s + 1]), pp_group)
    return h if owner[num_stages - 1] == pp_rank else None


def _moe_counts(parts: Sequence[nn.Module]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [(m.tokens_per_expert, m.tokens_per_expert.clone()) for part in parts
            for m in part.modules() if isinstance(getattr(m, "tokens_per_expert", None),
                                                  torch.Tensor)]


class Validator:
    """Forward-only evaluation for a :class:`titanext.trainer.Trainer` (module docstring).

    Reads from the trainer: ``cfg`` (``validation``, ``training``), ``dims``, ``device``,
    ``tokenizer``, ``train_module`` / ``model_parts``, ``pipeline`` (a PipelineRunner or None),
    ``compute_loss``, ``_loss_context`` and ``cp_layout``.
    """

    def __init__(self, trainer: Any):
        self.trainer = trainer
        self.cfg = trainer.cfg.validation
        self.enabled = bool(self.cfg.enable)

    def maybe_run(self, step: int, metrics: Any = None) -> dict[str, float] | None:
        """Validate if enabled and ``step`` is a multiple of ``freq``; log to ``metrics``."""
        if not self.enabled or step % self.cfg.freq:
            return None
        start = time.perf_counter()
        result = self.run()
        if metrics is not None:
            metrics.log_validation(step, loss=result["loss"], perplexity=result["perplexity"],
                                   tokens=int(result["tokens"]),
                                   seconds=time.perf_counter() - start)
        return result

    def _batches(self):
        tr = self.trainer  # a fresh loader each time: the same first `steps` batches
        loader = dataloader_from_config(tr.cfg.training, tr.tokenizer,
                                        tr.dims.dp_mesh.get_local_rank(), tr.dims.dp,
                                        validation=self.cfg,
                                        document_masking=tr.cfg.training.document_masking)
        for _ in range(self.cfg.steps):
            yield loader.next_batch()  # (inputs, labels[, document_ids])

    @torch.no_grad()
    def run(self) -> dict[str, float]:
        """The mean token loss over ``steps`` batches on every rank: ``{"loss", "perplexity",
        "tokens"}``."""
        tr, dims = self.trainer, self.trainer.dims
        runner = tr.pipeline
        parts = tr.model_parts
        saved = _moe_counts(parts)
        loss_sum = torch.zeros((), dtype=torch.float64, device=tr.device)
        tokens = torch.zeros((), dtype=torch.float64, device=tr.device)

        for batch in self._batches():  # as in training: CP shards, document positions and ids
            inputs, labels, positions, docs = prepare_batch(
                *batch, group=dims.cp_mesh if dims.cp_enabled else None, layout=tr.cp_layout,
                device=tr.device)
            tokens += int((labels != IGNORE_INDEX).sum())
            with tr._loss_context():
                if runner is None:
                    logits = tr.train_module(inputs, positions, document_ids=docs)
                else:  # positions shared by all rows are in the stages' position hook
                    logits = pipeline_forward(runner.parts, runner.stage_ids, runner.num_stages,
                                              runner.pp_group, inputs, tr.device,
                                              **runner.stage_kwargs(positions, docs))
                if logits is not None:
                    loss = tr.compute_loss(logits, labels)
                    loss = loss.full_tensor() if isinstance(loss, DTensor) else loss
                    loss_sum += loss.to(torch.float64)
        for counts, before in saved:
            counts.copy_(before)
        if runner is not None:  # only the last stage's rank has the loss
            dist.all_reduce(loss_sum, group=runner.pp_group)
        totals = torch.stack([loss_sum, tokens])
        dist.all_reduce(totals, group=dims.loss_mesh.get_group())
        mean = (totals[0] / totals[1].clamp(min=1)).item()
        return {"loss": mean, "perplexity": math.exp(min(mean, 700.0)),
                "tokens": totals[1].item()}
