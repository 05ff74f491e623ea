"""Hugging Face's stacked 3-D experts (OLMoE, Granite MoE, DeepSeek-V2: ``gate_up_proj`` /
``down_proj`` parameters of an experts module) under float8 and weight-gradient deferral: named,
never silently skipped. ``apply_float8`` and ``defer_weight_grads`` keep them in high precision /
undeferred and say so in one WARNING line each; ``apply_float8_experts``, asked to convert every
expert, refuses naming them."""

from __future__ import annotations

import logging

import pytest
import torch

transformers = pytest.importorskip("transformers")

FAMILIES = {
    "olmoe": ("OlmoeConfig", "OlmoeForCausalLM", dict(num_experts=4, num_experts_per_tok=2)),
    "granitemoe": ("GraniteMoeConfig", "GraniteMoeForCausalLM", dict(
        num_local_experts=4, num_experts_per_tok=2, embedding_multiplier=3.0)),
    "deepseek_v2": ("DeepseekV2Config", "DeepseekV2ForCausalLM", dict(
        n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, n_shared_experts=1,
        first_k_dense_replace=1, kv_lora_rank=16, q_lora_rank=None, qk_nope_head_dim=16,
        qk_rope_head_dim=8, v_head_dim=16, n_group=1, topk_group=1)),
}


def _model(family: str):
    cfg_cls, model_cls, kw = FAMILIES[family]
    if not hasattr(transformers, model_cls):
        pytest.skip(f"transformers {transformers.__version__} has no {model_cls}")
    cfg = getattr(transformers, cfg_cls)(vocab_size=128, hidden_size=64, intermediate_size=64,
                                         num_hidden_layers=2, num_attention_heads=4,
                                         num_key_value_heads=4, pad_token_id=None,
                                         eos_token_id=1, bos_token_id=0, **kw)
    torch.manual_seed(0)
    return getattr(transformers, model_cls)(cfg)


def _experts(model) -> list[str]:
    return [n for n, m in model.named_modules()
            if any(p.dim() == 3 for p in m.parameters(recurse=False))]


@pytest.mark.parametrize("family", list(FAMILIES))
def test_float8_and_deferral_name_hf_stacked_experts(family, caplog):
    from titanext.plugins.float8 import apply_float8
    from titanext.plugins.float8_experts import apply_float8_experts
    from titanext.plugins.weight_grad import defer_weight_grads

    experts = _experts(_model(family))
    assert experts, "the tiny model has no stacked experts"
    with caplog.at_level(logging.WARNING, logger="titanext"):
        apply_float8(_model(family), filter_fqns=["lm_head"], emulate=True)
        defer_weight_grads(_model(family))
    for plugin in ("float8", "weight_grad"):
        lines = [m for m in (r.getMessage() for r in caplog.records)
                 if m.startswith(f"{plugin}: ") and "stacked 3-D expert" in m]
        assert len(lines) == 1, (plugin, [r.getMessage() for r in caplog.records])
        assert all(f"{fqn} (" in lines[0] for fqn in experts), lines[0]
        assert "gate_up_proj" in lines[0] or "w1" in lines[0], lines[0]
    with pytest.raises(ValueError, match=f"{experts[0]} .*Turn float8 moe_experts off"):
        apply_float8_experts(_model(family))


def test_titanext_grouped_experts_are_not_named():
    from titanext.models.moe import GroupedExperts
    from titanext.plugins._loud import stacked_experts

    holder = torch.nn.Module()
    holder.experts = GroupedExperts(dim=16, hidden_dim=32, num_experts=2)
    assert stacked_experts(holder, (GroupedExperts,)) == []
