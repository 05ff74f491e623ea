"""The wiring-time probe of :func:`titanext.hf.transformers.hf_pipeline_stage`: the stage, fed
what its first block sees in the whole model, must give what its last block (on the last stage:
the model) gives there, module by module (:func:`titanext.hf.probe.first_difference`)."""

from __future__ import annotations

import inspect
from collections.abc import Sequence

import torch
from torch import nn

from titanext.hf.probe import first_difference

__all__ = ["probe_stage", "PROBE_SEQ"]

#: tokens in the probe batch (one sequence; longer than a tiny sliding window)
PROBE_SEQ = 16


def probe_stage(model: nn.Module, stage: nn.Module, counts: Sequence[int], stage_index: int,
                blocks: str) -> None:
    """Raise a ValueError naming the first module where ``stage`` and ``model`` differ on a
    probe batch of :data:`PROBE_SEQ` random tokens; nothing on a meta-device model (no values
    to compare: probe after materialising, or call ``first_difference`` yourself)."""
    params = list(model.parameters())
    if not params or any(p.is_meta for p in params):
        return
    if stage_index > 0 and "inputs_embeds" not in inspect.signature(type(model).forward).parameters:
        return  # a later stage needs the model's inputs by keyword: no probe call for it
    cfg = getattr(model, "config", None)
    vocab = getattr(cfg, "vocab_size", None)
    if not vocab:
        return
    seq = min(PROBE_SEQ, getattr(cfg, "max_position_embeddings", PROBE_SEQ) or PROBE_SEQ)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (1, seq), generator=g).to(params[0].device)
    start = sum(counts[:stage_index])

    def stage_input(ref: dict[str, torch.Tensor]):
        return ids if stage_index == 0 else (ref[f"{blocks}.{start - 1}"],)

    where = first_difference(model, stage, {"input_ids": ids}, rewritten_batch=stage_input,
                             from_module=f"{blocks}.{start}" if stage_index else None)
    if where is not None:
        raise ValueError(
            f"hf_pipeline_stage: stage {stage_index} of {type(model).__name__} (layer counts "
            f"{list(counts)}) computes something else than the whole model on a probe batch of "
            f"{seq} tokens; the first module that differs is {where}. The stage cannot run this "
            "model's own code there; report it, or pass probe=False to skip this check")
