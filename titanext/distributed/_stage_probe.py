"""The wiring-time probe of a pipeline stage that runs a model's own forward
(:func:`titanext.distributed.split.split_model` with ``skip_missing=True``, and
:func:`titanext.hf.transformers.hf_pipeline_stage` through it): the stage, fed
what its first block sees in the whole model, must give what its last block (on the last stage:
the model) gives there, module by module (:func:`titanext.distributed.probe.first_difference`)."""

from __future__ import annotations

import inspect
from collections.abc import Sequence

import torch
from torch import nn

from titanext.distributed.probe import Call, first_difference

__all__ = ["probe_stage", "PROBE_SEQ"]

#: tokens in the probe batch (one sequence; longer than a tiny sliding window)
PROBE_SEQ = 16


def probe_stage(model: nn.Module, stage: nn.Module, counts: Sequence[int], stage_index: int,
                blocks: str, *, who: str = "hf_pipeline_stage") -> None:
    """Raise a ValueError naming the first module where ``stage`` and ``model`` differ on a
    probe batch of :data:`PROBE_SEQ` random tokens; nothing on a meta-device model (no values
    to compare: probe after materialising, or call ``first_difference`` yourself), nor on a
    model without ``config.vocab_size`` (no token batch to make). A stage that crashes on the
    probe batch (the model's forward reaches into a part another stage holds: a skipped block's
    attributes, a tied weight, a layer that reads an earlier layer's cache) is refused the same
    way, naming the error: it would crash, or train wrong, on the first step. ``who`` names the
    caller in the message."""
    params = list(model.parameters())
    if not params or any(p.is_meta for p in params):
        return
    takes_ids = "input_ids" in inspect.signature(type(model).forward).parameters
    if not takes_ids:
        return  # not a token model's forward: no probe batch to make for it
    cfg = getattr(model, "config", None)
    vocab = getattr(cfg, "vocab_size", None)
    if not vocab:
        return
    seq = min(PROBE_SEQ, getattr(cfg, "max_position_embeddings", PROBE_SEQ) or PROBE_SEQ)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (1, seq), generator=g).to(params[0].device)
    start = sum(counts[:stage_index])

    # a later stage is fed the hidden state it receives, with the model's inputs by keyword
    # and, where the stage takes the hidden state alone (hf_pipeline_stage), without them
    forms = {"": True}
    if stage_index and getattr(stage, "_titanext_stage", {}).get("hidden_as"):
        forms[" called as stage(hidden) alone"] = False
    what = (f"{who}: stage {stage_index} of {type(model).__name__} (layer counts {list(counts)})")
    for form, by_keyword in forms.items():
        def stage_input(ref: dict[str, torch.Tensor], by_keyword=by_keyword):
            if not stage_index:
                return ids
            hidden = ref[f"{blocks}.{start - 1}"]
            return Call(hidden, input_ids=ids) if by_keyword else Call(hidden)

        try:
            where = first_difference(model, stage, {"input_ids": ids},
                                     rewritten_batch=stage_input,
                                     from_module=f"{blocks}.{start}" if stage_index else None)
        except Exception as e:  # any crash of the stage on the probe batch is a refusal by name
            raise ValueError(
                f"{what}{form} fails on a probe batch of {seq} tokens ({type(e).__name__}: "
                f"{str(e).splitlines()[0][:200] if str(e) else ''}): the model's own forward "
                "needs parts of the model that another stage holds, so this split cannot run "
                "it; pass probe=False to skip this check") from e
        if where is not None:
            raise ValueError(
                f"{what}{form} computes something else than the whole model on a probe batch "
                f"of {seq} tokens; the first module that differs is {where}. The stage cannot "
                "run this model's own code there; report it, or pass probe=False to skip this "
                "check")
