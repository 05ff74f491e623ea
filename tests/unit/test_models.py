"""The reference decoder: shapes, flavors, meta-device build, layout-invariant init, RoPE."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from titanext.models import MODEL_FLAVORS, ModelArgs, build_model, get_model_args
from titanext.models.llama import Transformer, apply_rope, rope_cos_sin, sdpa_attention

TINY = ModelArgs(dim=64, n_layers=2, n_heads=8, n_kv_heads=2, vocab_size=264, multiple_of=32)


def test_flavor_parameter_counts_match_llama3():
    counts = {f: build_model("llama3", get_model_args("llama3", f)).num_params()
              for f in ("8B", "70B", "405B")}
    assert round(counts["8B"] / 1e9, 2) == 8.03
    assert round(counts["70B"] / 1e9, 1) == 70.6
    assert round(counts["405B"] / 1e9, 0) == 406


def test_debugmodel_is_small_and_gqa():
    args = get_model_args("llama3", "debugmodel")
    assert args.n_heads % args.kv_heads == 0 and args.kv_heads < args.n_heads
    assert 1e6 < build_model("llama3", args).num_params() < 1e7


def test_unknown_flavor_lists_choices():
    with pytest.raises(KeyError, match="did you mean 'debugmodel'"):
        get_model_args("llama3", "debugmodle")
    with pytest.raises(KeyError, match="llama3"):
        get_model_args("gpt", "debugmodel")


def test_meta_build_then_init_is_deterministic():
    m = build_model("llama3", TINY)
    assert all(p.device.type == "meta" for p in m.parameters())
    m.to_empty(device="cpu")
    m.init_weights(seed=3)
    ref = Transformer(TINY)
    ref.init_weights(seed=3)
    for (n, a), (_, b) in zip(m.named_parameters(), ref.named_parameters()):
        assert torch.equal(a, b), n
    other = Transformer(TINY)
    other.init_weights(seed=4)
    assert not torch.equal(other.layers["0"].attention.wq.weight,
                           ref.layers["0"].attention.wq.weight)


def test_forward_shape_and_causality():
    torch.manual_seed(0)
    m = Transformer(TINY)
    m.init_weights(0)
    x = torch.randint(0, TINY.vocab_size, (2, 12))
    out = m(x)
    assert out.shape == (2, 12, TINY.vocab_size)
    x2 = x.clone()
    x2[:, 8:] = (x2[:, 8:] + 1) % TINY.vocab_size  # changing the future must not change the past
    torch.testing.assert_close(m(x2)[:, :8], out[:, :8])


def test_explicit_position_ids_equal_default():
    m = Transformer(TINY)
    m.init_weights(0)
    x = torch.randint(0, TINY.vocab_size, (2, 10))
    torch.testing.assert_close(m(x, position_ids=torch.arange(10)), m(x))


def test_rope_is_relative():
    """q.k after RoPE depends only on the position difference."""
    torch.manual_seed(0)
    inv = 1.0 / (10000 ** (torch.arange(0, 16, 2).float() / 16))
    q, k = torch.randn(1, 1, 1, 16), torch.randn(1, 1, 1, 16)

    def score(pq, pk):
        cq, sq = rope_cos_sin(torch.tensor([pq]), inv)
        ck, sk = rope_cos_sin(torch.tensor([pk]), inv)
        return (apply_rope(q, cq, sq) * apply_rope(k, ck, sk)).sum()

    torch.testing.assert_close(score(5, 2), score(103, 100), rtol=1e-4, atol=1e-5)


def test_gqa_attention_equals_expanded_heads():
    torch.manual_seed(0)
    q, k, v = torch.randn(2, 8, 6, 4), torch.randn(2, 2, 6, 4), torch.randn(2, 2, 6, 4)
    ref = F.scaled_dot_product_attention(q, k.repeat_interleave(4, 1), v.repeat_interleave(4, 1),
                                         is_causal=True)
    torch.testing.assert_close(sdpa_attention(q, k, v), ref)


def test_attention_function_is_swappable():
    m = Transformer(TINY)
    m.init_weights(0)
    calls = []

    def spy(q, k, v, *, causal=True, scale=None):
        calls.append((q.shape, k.shape))
        return sdpa_attention(q, k, v, causal=causal, scale=scale)

    for layer in m.layers.values():
        layer.attention.attn_fn = spy
    m(torch.randint(0, 264, (1, 4)))
    assert calls == [((1, 8, 4, 8), (1, 2, 4, 8))] * TINY.n_layers


def test_stage_without_embedding_and_head_passes_hidden_states():
    m = Transformer(TINY)
    m.init_weights(0)
    m.tok_embeddings = None
    m.output = None
    m.norm = None
    h = torch.randn(2, 5, TINY.dim)
    assert m(h).shape == h.shape


def test_every_flavor_builds_on_meta():
    for name, flavors in MODEL_FLAVORS.items():
        for flavor, args in flavors.items():
            model = build_model(name, args)
            active = model.num_active_params(exclude_embedding=True)
            assert model.num_flops_per_token(128) > 6 * active - 1, flavor
            if args.moe is None:  # a dense model uses every parameter for every token
                assert active == model.num_params(exclude_embedding=True), flavor
