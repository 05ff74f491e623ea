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
    for family in ZOO:  # the same spawn: models with their own factors and layer types
        out.update(_zoo_stages(rank, family))
    return out


#: family -> (config class, model class, config keywords): every factor away from neutral,
#: untied heads (a pipeline cannot split a tied one), pad_token_id set and None
ZOO = {
    # Granite MoE: embedding_multiplier / logits_scaling in the model's own forward
    "granitemoe": ("GraniteMoeConfig", "GraniteMoeForCausalLM", dict(
        intermediate_size=64, num_local_experts=4, num_experts_per_tok=2, embedding_multiplier=3.0,
        logits_scaling=5.0, residual_multiplier=0.7, attention_multiplier=0.2, pad_token_id=None)),
    # Gemma 3: stage 1's block is a sliding layer (window 4 < 12 tokens) at global index 1, so a
    # stage that renumbers it from 0 runs it as the full layer 0; scaled embedding, soft-caps
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM", dict(
        intermediate_size=128, head_dim=16, sliding_window=4, query_pre_attn_scalar=20,
        layer_types=["full_attention", "sliding_attention"], final_logit_softcapping=3.0,
        attn_logit_softcapping=20.0, pad_token_id=0)),
}


def _zoo_model(family: str):
    import transformers

    cfg_cls, model_cls, kw = ZOO[family]
    cfg = getattr(transformers, cfg_cls)(
        vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, attention_dropout=0.0,
        tie_word_embeddings=False, eos_token_id=1, bos_token_id=2, **kw)
    torch.manual_seed(0)
    return getattr(transformers, model_cls)(cfg).float()


def _zoo_stages(rank: int, family: str) -> dict:
    """``family`` over pp = 2 (one block per stage) under 1F1B, through ``hf_pipeline_stage``
    (tokens to the first stage) and ``split_model(skip_missing=True)`` (inputs by keyword)."""
    from titanext.distributed.pipeline import build_pipeline, split_model
    from titanext.hf.transformers import hf_pipeline_stage

    g = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, 128, (4, 13), generator=g)
    inputs, labels = tokens[:, :-1], tokens[:, 1:]
    model = _zoo_model(family)
    ref_loss = F.cross_entropy(model(input_ids=inputs).logits.flatten(0, 1), labels.flatten())
    ref_loss.backward()
    ref = {n: p.grad.clone() for n, p in model.named_parameters()}

    def loss_fn(logits, target):
        return F.cross_entropy(logits.flatten(0, 1), target.flatten(), reduction="sum") / (
            labels.numel())

    out = {}
    for way in ("hf_pipeline_stage", "split_model"):
        model = _zoo_model(family)
        if way == "hf_pipeline_stage":
            stage = hf_pipeline_stage(model, [1, 1], rank)
            first, kwargs = (inputs,) if rank == 0 else (), {}
        else:
            stage = split_model(model, [1, 1], rank, blocks="model.layers",
                                first=["model.embed_tokens"], last=["model.norm", "lm_head"],
                                skip_missing=True)
            first, kwargs = (), {"input_ids": inputs}
        _, schedule = build_pipeline([stage], [rank], num_stages=2, pp_group=dist.group.WORLD,
                                     device=torch.device("cpu"), schedule="1F1B",
                                     microbatches=2, loss_fn=loss_fn)
        losses: list[torch.Tensor] = []
        last = {"target": labels, "losses": losses} if rank == 1 else {}
        schedule.step(*first, return_outputs=False, **kwargs, **last)
        out[f"{family}/{way}"] = _errors([stage], sum(x.item() for x in losses), ref_loss.item(),
                                         ref)
    return out


@pytest.mark.parametrize("way", [f"{f}/{w}" for f in ZOO
                                 for w in ("hf_pipeline_stage", "split_model")])
def test_stages_keep_the_models_own_factors_and_global_layer_indices(three_ways, way):
    r0, r1 = three_ways
    assert r0[way]["loss_err"] < 1e-5, (way, r0[way]["loss_err"])
    family = way.split("/")[0]
    assert set(r0[way]["grad_errs"]) | set(r1[way]["grad_errs"]) == {
        n for n, _ in _zoo_model(family).named_parameters()}
    for res in (r0, r1):
        worst = max(res[way]["grad_errs"], key=res[way]["grad_errs"].get)
        assert res[way]["grad_errs"][worst] < 1e-5, (way, worst, res[way]["grad_errs"][worst])


@pytest.fixture(scope="module")
def three_ways():
    return run_distributed(_three_ways, 2, timeout_s=60)


def test_gpt2_stages_train_like_one_process_three_ways(three_ways):
    r0, r1 = three_ways
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


#: family -> (config class, model class, block list, its non-persistent buffers besides rotary)
META = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", "model.layers", []),
    # embed_scale = sqrt(hidden) = 8: a stage left with to_empty's memory there trains wrong
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM", "model.layers",
               ["model.embed_tokens.embed_scale"]),
    # a sinusoid position table on the inner model, a stage's first part
    "ctrl": ("CTRLConfig", "CTRLLMHeadModel", "transformer.h", ["transformer.pos_encoding"]),
}


@pytest.mark.parametrize("family", list(META))
def test_stages_cut_from_a_meta_model_match_after_loading(family):
    """The documented recipe: build on meta, cut, ``to_empty``, ``reset_buffers()``, load. Every
    non-persistent buffer (in no checkpoint) is recomputed by the model's own initializer; the
    same stages with those buffers left as ``to_empty`` gave them (zeros here) differ."""
    import transformers

    from titanext.hf.buffers import non_persistent_buffers
    from titanext.hf.transformers import hf_pipeline_stage

    cfg_cls, model_cls, blocks, extra = META[family]
    cfg = getattr(transformers, cfg_cls)(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False,
        **({"n_embd": 64, "n_layer": 2, "n_head": 4, "dff": 128, "n_positions": 64}
           if family == "ctrl" else {}))
    torch.manual_seed(0)
    ref = getattr(transformers, model_cls)(cfg).eval()
    with torch.device("meta"):
        meta = getattr(transformers, model_cls)(cfg)
    tokens = torch.randint(0, 128, (2, 12))
    stages = [hf_pipeline_stage(meta, [1, 1], i, blocks=blocks) for i in (0, 1)]
    for stage in stages:
        stage.to_empty(device="cpu")
        stage.load_state_dict(ref.state_dict(), strict=False)
        stage.eval()
    names = {n for stage in stages for n in non_persistent_buffers(stage)}
    assert set(extra) <= names, names
    with torch.no_grad():
        expected = ref(input_ids=tokens).logits
        for stage in stages:
            for owner, b in non_persistent_buffers(stage).values():
                owner._buffers[b].zero_()
        assert not torch.allclose(stages[1](stages[0](tokens)), expected)
        for stage in stages:
            stage.reset_buffers()
        torch.testing.assert_close(stages[1](stages[0](tokens)), expected)
