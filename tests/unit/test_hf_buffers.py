"""Non-persistent buffers after a meta-device build: :func:`titanext.hf.buffers.restore_buffers`
recomputes them with the model's own initializer and names any it cannot; a stage called with
the hidden state alone gets what it gets with the model's inputs (CTRL scales its
``inputs_embeds`` in place)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

pytest.importorskip("transformers")


def _gemma3(device: str | None = None):
    import transformers

    cfg = transformers.Gemma3TextConfig(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, tie_word_embeddings=False)
    with torch.device(device or "cpu"):
        return transformers.Gemma3ForCausalLM(cfg)


def test_a_meta_built_model_gets_every_non_persistent_buffer_back():
    from titanext.hf.buffers import non_persistent_buffers, restore_buffers

    ref = dict(_gemma3().named_buffers())
    model = _gemma3("meta")
    model.to_empty(device="cpu")
    names = restore_buffers(model)
    assert "model.embed_tokens.embed_scale" in names and any("inv_freq" in n for n in names)
    assert set(names) == set(non_persistent_buffers(model))
    for name in names:
        torch.testing.assert_close(model.get_buffer(name), ref[name], rtol=0, atol=0)
    assert float(model.get_buffer("model.embed_tokens.embed_scale")) == 8.0  # sqrt(64)


def test_what_cannot_be_recomputed_is_named():
    from titanext.hf.buffers import restore_buffers

    class Plain(nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("table", torch.zeros(3), persistent=False)

    with pytest.raises(ValueError, match=r"Plain has no _init_weights .*\(table\)"):
        restore_buffers(Plain())

    class Partial(Plain):  # an initializer that writes only part of its buffer
        def _init_weights(self, module):
            module.table[:2] = 1.0

    with pytest.raises(ValueError, match=r"Partial._init_weights does not \(fully\) write the "
                                         r"non-persistent buffers table"):
        restore_buffers(Partial())
    with torch.device("meta"):
        meta = Partial()
    with pytest.raises(ValueError, match="still on the meta device: table; call to_empty"):
        restore_buffers(meta)


def test_a_stage_called_with_the_hidden_state_alone_matches_the_model():
    import transformers

    from titanext.hf.transformers import hf_pipeline_stage

    cfg = transformers.CTRLConfig(vocab_size=128, n_embd=64, n_layer=2, n_head=4, dff=128,
                                  n_positions=64, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = transformers.CTRLLMHeadModel(cfg).eval()
    stages = [hf_pipeline_stage(model, [1, 1], i, blocks="transformer.h") for i in (0, 1)]
    tokens = torch.randint(0, 128, (2, 12))
    with torch.no_grad():
        torch.testing.assert_close(stages[1](stages[0](tokens)), model(input_ids=tokens).logits)
