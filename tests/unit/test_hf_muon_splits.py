"""hf_muon_splits reads a transformers model's fused projections into Muon's logical matrices,
checked against the forward that slices them, and refuses what it cannot check
(titanext.hf.fused)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from transformers import (  # noqa: E402
    GPT2Config,
    GPT2LMHeadModel,
    GPTNeoXConfig,
    GPTNeoXForCausalLM,
    Phi3Config,
    Phi3ForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
)

from titanext.hf.fused import hf_muon_splits  # noqa: E402


def test_phi3_qkv_and_gate_up_split_as_its_forward_slices_them():
    cfg = Phi3Config(hidden_size=32, intermediate_size=40, num_hidden_layers=1,
                     num_attention_heads=4, num_key_value_heads=2, vocab_size=64,
                     pad_token_id=0)
    model = Phi3ForCausalLM(cfg)
    assert hf_muon_splits(model) == {
        "model.layers.0.self_attn.qkv_proj.weight": (0, (32, 16, 16)),
        "model.layers.0.mlp.gate_up_proj.weight": (0, (40, 40))}
    # the parts are the forward's: q, k, v from the rows in that order
    attn = model.model.layers[0].self_attn
    x = torch.randn(2, 32)
    q, k, v = attn.qkv_proj.weight.split([32, 16, 16], 0)
    assert torch.equal(attn.qkv_proj(x)[..., 32:48], x @ k.T)


def test_gpt2_c_attn_splits_its_columns():
    model = GPT2LMHeadModel(GPT2Config(n_embd=24, n_head=4, n_layer=1, vocab_size=64))
    assert hf_muon_splits(model) == {"transformer.h.0.attn.c_attn.weight": (1, (24, 24, 24))}


def test_stacked_expert_gate_up_splits_per_expert():
    cfg = Qwen3MoeConfig(hidden_size=16, intermediate_size=24, moe_intermediate_size=12,
                         num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                         num_experts=4, num_experts_per_tok=2, vocab_size=64, head_dim=8)
    splits = hf_muon_splits(Qwen3MoeForCausalLM(cfg))
    assert splits == {"model.layers.0.mlp.experts.gate_up_proj": (0, (12, 12))}


def test_interleaved_qkv_is_refused_by_name_unless_left_whole():
    model = GPTNeoXForCausalLM(GPTNeoXConfig(hidden_size=16, num_attention_heads=2,
                                             num_hidden_layers=1, intermediate_size=32,
                                             vocab_size=64))
    with pytest.raises(ValueError, match=r"gpt_neox\.layers\.0\.attention\.query_key_value"
                                         r"\.weight .*leave_whole"):
        hf_muon_splits(model)
    assert hf_muon_splits(model, leave_whole=["gpt_neox.layers."]) == {}
