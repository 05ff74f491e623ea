"""Pipeline stages of a model whose forward returns a ``ModelOutput``: a tiny transformers GPT-2
(Conv1D projections, ``CausalLMOutputWithCrossAttentions``) over pp = 2 under 1F1B trains like
one process (loss and every gradient within 1e-5) through each of the three ways in:
``split_model(..., skip_missing=True)`` (the docs' recipe), ``hf_pipeline_stage(...,
blocks="transformer.h")`` and ``PipelineRunner(..., blocks=..., skip_missing=True)``. What
cannot be passed on is refused with the fix, and so is a tied weight split across stages."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from tests.multiprocess.test_failsafe import SPLIT, VOCAB, _batch, _pipeline, gpt2
from tests.spawn import run_distributed

pytest.importorskip("transformers")


def _reference():
    model = gpt2()
    inputs, labels = _batch()
    loss = F.cross_entropy(model(inputs).logits.flatten(0, 1), labels.flatten())
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    return model, loss.item(), grads


def _errors(parts, loss: float, ref_loss: float, ref: dict) -> dict:
    total = torch.tensor(float(loss), dtype=torch.float64)
    dist.all_reduce(total)
    return {"loss_err": abs(total.item() - ref_loss) / ref_loss,
            "grad_errs": {n: ((p.grad - ref[n]).norm() / ref[n].norm()).item()
                          for part in parts for n, p in part.named_parameters()}}


def _three_ways(rank: int, world_size: int) -> dict:
    from titanext.config import pipeline_plan
    from titanext.distributed.parallel_dims import ParallelDims
    from titanext.distributed.pipeline import PipelineRunner, build_pipeline
    from titanext.hf.transformers import hf_pipeline_stage

    inputs, labels = _batch()
    out = {}
    model, ref_loss, ref = _reference()
    stage, losses = _pipeline(rank, model)  # split_model, the docs' recipe
    out["split_model"] = _errors([stage], sum(x.item() for x in losses), ref_loss, ref)

    model, ref_loss, ref = _reference()
    stage = hf_pipeline_stage(model, [2, 2], rank, blocks="transformer.h")

    def loss_fn(logits, target):
        return F.cross_entropy(logits.flatten(0, 1), target.flatten(), reduction="sum") / (
            labels.numel())

    _, schedule = build_pipeline([stage], [rank], num_stages=2, pp_group=dist.group.WORLD,
                                 device=torch.device("cpu"), schedule="1F1B", microbatches=2,
                                 loss_fn=loss_fn)
    losses: list[torch.Tensor] = []
    last = {"target": labels, "losses": losses} if rank == 1 else {}
    schedule.step(input_ids=inputs, return_outputs=False, **last)
    out["hf_pipeline_stage"] = _errors([stage], sum(x.item() for x in losses), ref_loss, ref)

    model, ref_loss, ref = _reference()
    dims = ParallelDims(dp_replicate=1, dp_shard=1, cp=1, tp=1, pp=2, ep=1, world_size=2)
    dims.build_mesh("cpu")
    plan = pipeline_plan("1F1B", pp=2, microbatches=2,
                         n_layers=len(model.get_submodule(SPLIT["blocks"])))
    runner = PipelineRunner(
        model, dims, plan, device=torch.device("cpu"),
        loss_fn=lambda logits, t: F.cross_entropy(logits.flatten(0, 1), t.flatten(),
                                                  reduction="sum"),
        parallelize_stage=lambda m: m, blocks=SPLIT["blocks"], first=SPLIT["first"],
        last=SPLIT["last"], skip_missing=True)
    loss_sum = runner.step([(inputs, labels)], loss_scale=1.0 / labels.numel())
    out["PipelineRunner"] = _errors(runner.parts, loss_sum.item() / labels.numel() / 2,
                                    ref_loss, ref)  # (each rank returns the summed loss)
    return out


def test_gpt2_stages_train_like_one_process_three_ways():
    r0, r1 = run_distributed(_three_ways, 2, timeout_s=60)
    for way in ("split_model", "hf_pipeline_stage", "PipelineRunner"):
        assert r0[way]["loss_err"] < 1e-5, (way, r0[way]["loss_err"])
        assert "transformer.h.0.attn.c_attn.weight" in r0[way]["grad_errs"]  # a Conv1D
        assert "lm_head.weight" in r1[way]["grad_errs"]
        assert set(r0[way]["grad_errs"]) | set(r1[way]["grad_errs"]) == set(
            n for n, _ in gpt2().named_parameters())
        for res in (r0, r1):
            worst = max(res[way]["grad_errs"], key=res[way]["grad_errs"].get)
            assert res[way]["grad_errs"][worst] < 1e-5, (way, worst, res[way]["grad_errs"][worst])


def test_what_a_stage_cannot_pass_on_is_refused_with_the_fix():
    from titanext.distributed.split import pass_on, split_model
    from titanext.hf.transformers import hf_pipeline_stage

    hidden, logits = torch.ones(2, 3, 4), torch.ones(2, 3, VOCAB)
    assert pass_on((hidden, None), "block", last=False) is hidden
    assert pass_on({"logits": logits, "hidden": hidden}, "model", last=True) is logits
    with pytest.raises(ValueError, match=r"returned a tuple holding \[0\] \(2, 3, 4\), "
                                         r"\[1\] \(2, 3, 4\).*one tensor.*next stage"):
        pass_on((hidden, hidden), "the last block", last=False)
    tied = gpt2()
    tied.lm_head.weight = tied.transformer.wte.weight
    with pytest.raises(ValueError, match=r"transformer.wte.weight \(stage 0\), lm_head.weight "
                                         r"\(stage 1\) are one tied parameter.*untie"):
        split_model(tied, [2, 2], 0, **SPLIT)
    with pytest.raises(ValueError, match="pass blocks= as the dotted path"):
        hf_pipeline_stage(gpt2(), [2, 2], 0)
    stage = hf_pipeline_stage(gpt2(), [2, 2], 1, blocks="transformer.h")
    assert {n.split(".")[0] for n, _ in stage.named_parameters()} == {"transformer", "lm_head"}
    assert not any(n.startswith("transformer.wte") for n, _ in stage.named_parameters())
