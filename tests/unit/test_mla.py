"""Multi-head latent attention (DeepSeek-V2/V3) and YaRN: against transformers' DeepseekV3
attention, the flavors' shapes, the bad-args rules, document masks, and the ring kernels with a
value head dim different from the query/key one (one process)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from titanext.models import MODEL_FLAVORS, ModelArgs, build_model, get_model_args
from titanext.models.args import ModelArgsError, YarnRopeScaling
from titanext.models.layers import document_positions
from titanext.models.llama import (
    MLAttention,
    Transformer,
    mla_softmax_scale,
    rope_attention_factor,
    rope_cos_sin,
    rope_inv_freq,
    sdpa_attention,
)

DEBUG = get_model_args("llama3", "debugdeepseek")
# HF DeepseekV3Attention's module names -> titanext's
_HF_NAMES = {"q_proj": "wq", "q_a_proj": "wq_a", "q_a_layernorm": "q_norm", "q_b_proj": "wq_b",
             "kv_a_proj_with_mqa": "wkv_a", "kv_a_layernorm": "kv_norm", "kv_b_proj": "wkv_b",
             "o_proj": "wo"}


def _hf_config(a: ModelArgs):
    transformers = pytest.importorskip("transformers")
    rs = a.rope_scaling
    cfg = transformers.DeepseekV3Config(
        hidden_size=a.dim, num_attention_heads=a.n_heads, num_key_value_heads=a.n_heads,
        q_lora_rank=a.q_lora_rank or None, kv_lora_rank=a.kv_lora_rank,
        qk_nope_head_dim=a.qk_nope_head_dim, qk_rope_head_dim=a.qk_rope_head_dim,
        v_head_dim=a.v_head_dim, rms_norm_eps=a.norm_eps, max_position_embeddings=a.max_seq_len,
        rope_interleave=True, attention_bias=False,
        rope_scaling={"rope_type": "yarn", "factor": rs.factor, "rope_theta": a.rope_theta,
                      "original_max_position_embeddings": rs.original_max_position_embeddings,
                      "beta_fast": rs.beta_fast, "beta_slow": rs.beta_slow, "mscale": rs.mscale,
                      "mscale_all_dim": rs.mscale_all_dim})
    cfg._attn_implementation = "eager"
    return cfg


@pytest.mark.parametrize("q_lora_rank", [32, 0])
def test_mla_matches_transformers_deepseek_v3_attention(q_lora_rank):
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import (
        DeepseekV3Attention,
        DeepseekV3RotaryEmbedding,
    )

    torch.manual_seed(0)
    a = dataclasses.replace(DEBUG, q_lora_rank=q_lora_rank)
    cfg = _hf_config(a)
    hf = DeepseekV3Attention(cfg, 0).double()
    for p in hf.parameters():
        torch.nn.init.normal_(p, 0, 0.1) if p.dim() > 1 else torch.nn.init.uniform_(p, 0.5, 1.5)
    ours = MLAttention(a).double()
    ours.load_state_dict({f"{_HF_NAMES[k.split('.')[0]]}.{k.split('.', 1)[1]}": v
                          for k, v in hf.state_dict().items()})
    x, pos = torch.randn(2, 40, a.dim, dtype=torch.float64), torch.arange(40)[None]
    rotary = DeepseekV3RotaryEmbedding(cfg)
    cos, sin = (t.double() for t in rotary(x, pos))
    mask = torch.full((40, 40), float("-inf"), dtype=torch.float64).triu(1)[None, None]
    want = hf(x, (cos, sin), attention_mask=mask)[0]
    torch.testing.assert_close(rope_inv_freq(a), rotary.inv_freq, rtol=0, atol=0)
    assert rope_attention_factor(a) == pytest.approx(rotary.attention_scaling)
    assert mla_softmax_scale(a) == pytest.approx(hf.scaling)
    cos, sin = rope_cos_sin(pos, rope_inv_freq(a), rope_attention_factor(a))
    got = ours(x, cos.double(), sin.double())
    assert (got - want).abs().max() / want.abs().max() < 1e-6


@pytest.mark.parametrize("mscale,mscale_all_dim", [(0.707, 0.707), (1.0, 0.0), (1.0, 0.5)])
def test_yarn_matches_transformers(mscale, mscale_all_dim):
    """DeepSeek-V3's YaRN (factor 40 over 4K) with each way HF derives its factors."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    a = dataclasses.replace(get_model_args("llama3", "deepseek_v3_671b"), rope_scaling=(
        YarnRopeScaling(mscale=mscale, mscale_all_dim=mscale_all_dim)))
    cfg = _hf_config(a)
    cfg.head_dim = a.qk_rope_head_dim  # as DeepseekV3Config sets it
    inv, factor = ROPE_INIT_FUNCTIONS["yarn"](cfg, "cpu")
    torch.testing.assert_close(rope_inv_freq(a), inv, rtol=1e-6, atol=0)
    assert rope_attention_factor(a) == pytest.approx(factor)


def test_deepseek_flavors_are_the_published_sizes():
    """DeepSeek-V3: 671B parameters, 37B active (without MTP); the 16B: 15.7B."""
    big = build_model("llama3", get_model_args("llama3", "deepseek_v3_671b"))
    assert round(big.num_params() / 1e9) == 671 and round(big.num_active_params() / 1e9) == 38
    attn = big.layers["0"].attention
    assert tuple(attn.wq_a.weight.shape) == (1536, 7168)
    assert tuple(attn.wkv_a.weight.shape) == (512 + 64, 7168)
    assert tuple(attn.wkv_b.weight.shape) == (128 * (128 + 128), 512)
    small = build_model("llama3", get_model_args("llama3", "deepseek_v3_16b"))
    assert round(small.num_params() / 1e9, 1) == 15.7
    assert hasattr(small.layers["0"].attention, "wq") and not hasattr(
        small.layers["0"].attention, "wq_a")


def test_debugdeepseek_trains_one_step_and_is_causal():
    torch.manual_seed(0)
    m = Transformer(DEBUG)
    m.init_weights(0)
    names = {n for n, _ in m.layers["0"].attention.named_parameters()}
    assert names == {"wq_a.weight", "q_norm.weight", "wq_b.weight", "wkv_a.weight",
                     "kv_norm.weight", "wkv_b.weight", "wo.weight"}
    x = torch.randint(0, DEBUG.vocab_size, (2, 16))
    out = m(x)
    out.float().logsumexp(-1).mean().backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in m.parameters())
    x2 = x.clone()
    x2[:, 10:] = (x2[:, 10:] + 1) % DEBUG.vocab_size
    torch.testing.assert_close(m(x2)[:, :10], out[:, :10])


def test_mla_document_mask_equals_separate_documents():
    torch.manual_seed(0)
    m = Transformer(DEBUG).double()
    m.init_weights(0)
    x = torch.randint(0, DEBUG.vocab_size, (1, 14))
    docs = torch.tensor([[0] * 5 + [1] * 9])
    packed = m(x, position_ids=document_positions(docs), document_ids=docs)
    torch.testing.assert_close(packed[:, :5], m(x[:, :5]))
    torch.testing.assert_close(packed[:, 5:], m(x[:, 5:]))


@pytest.mark.parametrize("change,needle", [
    (dict(kv_lora_rank=-1), "kv_lora_rank = -1 is negative; allowed: 0 (off) or a positive"),
    (dict(q_lora_rank=-4), "q_lora_rank = -4 is negative"),
    (dict(kv_lora_rank=0), "q_lora_rank = 32 needs multi-head latent attention; allowed: "
                           "kv_lora_rank > 0"),
    (dict(qk_rope_head_dim=7), "qk_rope_head_dim = 7 with MLA; allowed: a positive even"),
    (dict(qk_nope_head_dim=0), "qk_nope_head_dim = 0 with MLA (kv_lora_rank = 16); allowed: a "
                               "positive integer"),
    (dict(v_head_dim=-2), "v_head_dim = -2 with MLA"),
    (dict(n_kv_heads=2), "n_kv_heads = 2 with MLA (every head has its own key and value); "
                         "allowed: None or n_heads = 4"),
    (dict(attn_head_dim=16), "attn_head_dim = 16 with MLA; allowed: None"),
    (dict(qk_norm=True), "qk_norm = True with MLA; allowed: False"),
    (dict(rope_scaling=YarnRopeScaling(factor=0.0)), "needs factor > 0"),
])
def test_inconsistent_mla_args_name_field_value_and_allowed(change, needle):
    with pytest.raises(ModelArgsError) as e:
        dataclasses.replace(DEBUG, **change)
    assert len(e.value.problems) == 1 and needle in e.value.problems[0], e.value.problems


def test_every_deepseek_flavor_builds_with_mla():
    for name in ("debugdeepseek", "deepseek_v3_16b", "deepseek_v3_671b"):
        args = MODEL_FLAVORS["llama3"][name]
        assert args.mla and args.moe is not None and args.moe.score_func == "sigmoid"
        assert args.moe.num_expert_groups > 1 and args.v_head_dim == 128 or name.startswith("debug")
    assert DEBUG.qk_nope_head_dim != DEBUG.v_head_dim != DEBUG.head_dim


def test_sdpa_attention_takes_a_different_value_head_dim():
    q, k = torch.randn(2, 4, 10, 24), torch.randn(2, 4, 10, 24)
    v = torch.randn(2, 4, 10, 12)
    out = sdpa_attention(q, k, v, scale=0.3)
    s = (q @ k.transpose(-1, -2) * 0.3).masked_fill(torch.ones(10, 10).triu(1).bool(), -1e30)
    torch.testing.assert_close(out, s.softmax(-1) @ v)


@pytest.mark.parametrize("kernel", ["math", "flash_cpu"])
@pytest.mark.parametrize("dv", [12, 40])
def test_ring_kernels_take_a_value_head_dim_other_than_qk(kernel, dv):
    """One-rank ring attention (every block kernel path: causal, full, document-masked tiles)
    against SDPA, forward and gradients, with v's head dim smaller and larger than q/k's."""
    from titanext.plugins.context_parallel import ring_attention

    torch.manual_seed(0)
    q = torch.randn(2, 4, 16, 24, dtype=torch.float64, requires_grad=True)
    k = torch.randn(2, 2, 16, 24, dtype=torch.float64, requires_grad=True)
    v = torch.randn(2, 2, 16, dv, dtype=torch.float64, requires_grad=True)
    docs = torch.tensor([[0] * 6 + [1] * 10, [0] * 16])
    for ids in (None, docs):
        got = ring_attention(q, k, v, None, scale=0.3, kernel=kernel, document_ids=ids)
        want = sdpa_attention(q, k, v, scale=0.3, document_ids=ids)
        assert got.shape == (2, 4, 16, dv)
        g = torch.randn_like(want)
        grads = torch.autograd.grad(got, (q, k, v), g)
        for a, b in zip(grads, torch.autograd.grad(want, (q, k, v), g)):
            torch.testing.assert_close(a, b)
        torch.testing.assert_close(got, want)


def test_mla_compiles_fullgraph_and_converts_to_float8():
    """Every MLA linear with dims divisible by 16 converts to float8 (debugdeepseek's wkv_a, 64
    -> 24, stays high precision); the MLA block traces as one graph (fullgraph) and matches
    eager (the eager backend: Dynamo's tracing is what MLA could break, and it is the cheap
    part)."""
    from titanext.plugins.float8 import apply_float8

    model = build_model("llama3", DEBUG)
    converted = apply_float8(model, emulate=True)
    attn = {c.removeprefix("layers.0.attention.") for c in converted
            if c.startswith("layers.0.attention.")}
    assert attn == {"wq_a", "wq_b", "wkv_b", "wo"}
    big = build_model("llama3", get_model_args("llama3", "deepseek_v3_671b"))
    layer0 = {c for c in apply_float8(big, emulate=True) if c.startswith("layers.0.attention.")}
    assert len(layer0) == 5  # wq_a, wq_b, wkv_a, wkv_b, wo

    torch.manual_seed(0)
    eager = Transformer(DEBUG)
    eager.init_weights(0)
    compiled = Transformer(DEBUG)
    compiled.load_state_dict(eager.state_dict())
    compiled.init_buffers()
    compiled.layers["0"].compile(backend="eager", fullgraph=True)  # the dense MLA block
    x = torch.randint(0, DEBUG.vocab_size, (2, 16))
    for m in (eager, compiled):
        m(x).float().logsumexp(-1).mean().backward()
    torch.testing.assert_close(compiled(x), eager(x))
    for (n, a), (_, b) in zip(eager.named_parameters(), compiled.named_parameters()):
        torch.testing.assert_close(b.grad, a.grad, msg=n)
