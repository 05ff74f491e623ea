"""The shipped Hugging Face TP plan on every family the README names, built tiny from
``transformers`` configs: ``hf_tp_plan(model)`` at tp = 2 gives one process's loss and gradients
(~1e-5) and gradients that agree over the tp ranks, or refuses by name (GPT-OSS's per-head
attention sinks). Removing the QK-norm rules makes the replicated-gradient check name ``q_norm``
at the first optimizer step. Every exact family also passes the wiring-time probe
(``titanext.distributed.probe.first_difference``: no module's output differs from one
process), which names Gemma 3's embedding when its own forward is replaced. Add a family to
FAMILIES to keep it so. One spawn for all."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

from tests.spawn import run_distributed

transformers = pytest.importorskip("transformers")

V, H = 128, 64
_COMMON = dict(vocab_size=V, hidden_size=H, num_hidden_layers=2, num_attention_heads=4,
               max_position_embeddings=64, attention_dropout=0.0)

#: family -> (config class name, model class name, config keywords)
FAMILIES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", dict(intermediate_size=128,
                                                      num_key_value_heads=2)),
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(intermediate_size=128,
                                                            num_key_value_heads=2)),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", dict(
        intermediate_size=64, num_key_value_heads=2, num_local_experts=4,
        num_experts_per_tok=2)),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(intermediate_size=128,
                                                      num_key_value_heads=2, head_dim=16)),
    "qwen3_tied": ("Qwen3Config", "Qwen3ForCausalLM", dict(
        intermediate_size=128, num_key_value_heads=2, head_dim=16, tie_word_embeddings=True)),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", dict(
        intermediate_size=128, moe_intermediate_size=32, num_key_value_heads=2, head_dim=16,
        num_experts=4, num_experts_per_tok=2, decoder_sparse_step=1)),
    "qwen2_bias": ("Qwen2Config", "Qwen2ForCausalLM", dict(intermediate_size=128,
                                                           num_key_value_heads=2)),
    "deepseek_v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM", dict(
        intermediate_size=128, moe_intermediate_size=32, num_key_value_heads=4,
        n_routed_experts=4, num_experts_per_tok=2, n_group=1, topk_group=1,
        first_k_dense_replace=1, n_shared_experts=1, q_lora_rank=32, kv_lora_rank=16,
        qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16)),
    "deepseek_v3_no_q_lora": ("DeepseekV3Config", "DeepseekV3ForCausalLM", dict(
        intermediate_size=128, moe_intermediate_size=32, num_key_value_heads=4,
        n_routed_experts=4, num_experts_per_tok=2, n_group=1, topk_group=1,
        first_k_dense_replace=1, n_shared_experts=1, q_lora_rank=None, kv_lora_rank=16,
        qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16)),
    # refused by name: per-head attention sinks are a parameter the plan has no rule for
    "gpt_oss": ("GptOssConfig", "GptOssForCausalLM", dict(
        intermediate_size=64, num_key_value_heads=2, head_dim=16, num_local_experts=4,
        num_experts_per_tok=2)),
    # Gemma 3: a scaled embedding (its own forward around the vocabulary-parallel lookup),
    # sliding windows shorter than the sequence, soft-capping, a tied head, pad_token_id set
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM", dict(
        intermediate_size=128, num_key_value_heads=2, head_dim=16, sliding_window=4,
        layer_types=["sliding_attention", "full_attention"], query_pre_attn_scalar=20,
        final_logit_softcapping=3.0, pad_token_id=0)),
    "gemma3_untied_no_pad": ("Gemma3TextConfig", "Gemma3ForCausalLM", dict(
        intermediate_size=128, num_key_value_heads=2, head_dim=16, sliding_window=4,
        layer_types=["full_attention", "sliding_attention"], query_pre_attn_scalar=20,
        final_logit_softcapping=3.0, pad_token_id=None, tie_word_embeddings=False)),
    # Granite MoE: every multiplier away from 1, an untied head, pad_token_id None
    "granitemoe": ("GraniteMoeConfig", "GraniteMoeForCausalLM", dict(
        intermediate_size=64, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2,
        embedding_multiplier=3.0, logits_scaling=5.0, residual_multiplier=0.7,
        attention_multiplier=0.2, tie_word_embeddings=False, pad_token_id=None)),
    # StableLM reshapes by self.num_heads: the plan gives it the local head counts
    "stablelm": ("StableLmConfig", "StableLmForCausalLM", dict(
        intermediate_size=128, num_key_value_heads=2, partial_rotary_factor=0.5)),
    # GPT-NeoX: fused qkv interleaved per head, viewed with -1 heads (a plain column split)
    "gpt_neox": ("GPTNeoXConfig", "GPTNeoXForCausalLM", dict(intermediate_size=128)),
    # refused by name: fused projections (Phi-3 also slices by the config's head count),
    # a plan that would split nothing but the head
    "phi3": ("Phi3Config", "Phi3ForCausalLM", dict(intermediate_size=128, num_key_value_heads=2,
                                                   pad_token_id=0, eos_token_id=1)),
    "falcon": ("FalconConfig", "FalconForCausalLM", dict(new_decoder_architecture=True,
                                                         num_kv_heads=2)),
    "mamba2": ("Mamba2Config", "Mamba2ForCausalLM", dict(num_heads=8, head_dim=16, expand=2,
                                                         n_groups=1, state_size=16)),
}
REFUSED = {"gpt_oss": "model.layers.0.self_attn.sinks",
           "phi3": "FusedColwiseParallel",
           "falcon": "transformer.h.0.self_attention.query_key_value",
           "mamba2": "would split only the embedding and the LM head"}


def _build(family: str):
    cfg_cls, model_cls, kw = FAMILIES[family]
    if not hasattr(transformers, model_cls):
        return None
    torch.manual_seed(0)
    return getattr(transformers, model_cls)(getattr(transformers, cfg_cls)(**_COMMON, **kw)).float()


def _batch():
    g = torch.Generator().manual_seed(1)
    t = torch.randint(0, V, (2, 17), generator=g)
    return t[:, :-1], t[:, 1:]


def _loss(model):
    x, y = _batch()
    return F.cross_entropy(model(input_ids=x).logits.flatten(0, 1).float(), y.flatten())


def _rel(a, b):
    d = b.norm().item()
    return (a - b).norm().item() / d if d > 0 else (a - b).norm().item()


def _family_case(family: str, tp_mesh) -> dict:
    from titanext.distributed.probe import first_difference
    from titanext.hf.transformers import hf_tp_plan
    from titanext.plugins.replicated_grads import replicated_grad_problems
    from titanext.plugins.tensor_parallel import apply_tensor_parallel

    ref = _build(family)
    if ref is None:
        return {"skipped": f"transformers {transformers.__version__} has no {FAMILIES[family][1]}"}
    ref_loss = _loss(ref)
    ref_loss.backward()
    ref_grads = {n: p.grad for n, p in ref.named_parameters() if p.grad is not None}
    model = _build(family)
    try:
        plan = hf_tp_plan(model)
    except ValueError as e:
        return {"refused": str(e)}
    apply_tensor_parallel(model, tp_mesh, plan=plan)
    probe = first_difference(_build(family), model, {"input_ids": _batch()[0]},
                             tp_mesh.get_group())
    loss = _loss(model)
    loss.backward()
    errors = {}
    for n, p in model.named_parameters():
        g = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
        errors[n] = _rel(g, ref_grads[n]) if g is not None else float("inf")
    return {"loss": (loss.item(), ref_loss.item()), "grad_errors": errors, "probe": probe,
            "sharded": sum(isinstance(p, DTensor) for p in model.parameters()),
            "replicated": replicated_grad_problems(model, {"tp": tp_mesh})}


def _qk_norm_rule_removed(tp_mesh) -> str:
    """Qwen3 with the QK-norm rules taken out of the plan: the check at the first step."""
    from titanext.hf.transformers import hf_tp_plan
    from titanext.plugins.replicated_grads import (
        ReplicatedGradientMismatch,
        install_replicated_grad_check,
    )
    from titanext.plugins.tensor_parallel import apply_tensor_parallel

    model = _build("qwen3")
    plan = {k: v for k, v in hf_tp_plan(model).items() if not k.endswith(("q_norm", "k_norm"))}
    apply_tensor_parallel(model, tp_mesh, plan=plan)
    install_replicated_grad_check(model, {"tp": tp_mesh}, steps=1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    _loss(model).backward()
    try:
        opt.step()
    except ReplicatedGradientMismatch as e:
        return str(e)
    return "no error"


def _stock_lookup_probed(tp_mesh) -> str | None:
    """The old VocabParallelEmbedding (its lookup in place of Gemma 3's own forward, dropping
    the sqrt(hidden) scale): the wiring-time probe names the embedding."""
    from titanext.distributed.probe import first_difference
    from titanext.hf.transformers import hf_tp_plan
    from titanext.plugins.tensor_parallel import (
        _vocab_parallel_embedding_forward,
        apply_tensor_parallel,
    )

    model = _build("gemma3_untied_no_pad")
    apply_tensor_parallel(model, tp_mesh, plan=hf_tp_plan(model))
    embed = model.model.embed_tokens
    embed.forward = _vocab_parallel_embedding_forward.__get__(embed)
    return first_difference(_build("gemma3_untied_no_pad"), model, {"input_ids": _batch()[0]},
                            tp_mesh.get_group())


def _body(rank, world_size):
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    out = {family: _family_case(family, mesh["tp"]) for family in FAMILIES}
    out["qk_norm_rule_removed"] = _qk_norm_rule_removed(mesh["tp"])
    out["stock_lookup_probed"] = _stock_lookup_probed(mesh["tp"])
    dist.barrier()
    return out


@pytest.fixture(scope="module")
def results():
    return run_distributed(_body, 2, timeout_s=120)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_hf_tp_plan_matches_one_process_or_refuses_by_name(results, family):
    for r in results:
        case = r[family]
        if "skipped" in case:
            pytest.skip(case["skipped"])
        if family in REFUSED:
            assert "refused" in case, f"{family} was not refused"
            assert REFUSED[family] in case["refused"], case["refused"]
            continue
        assert "refused" not in case, case.get("refused")
        got, ref = case["loss"]
        assert abs(got - ref) <= 1e-5 * abs(ref), (got, ref)
        bad = {n: e for n, e in case["grad_errors"].items() if not e <= 1e-5}
        assert not bad, bad
        assert case["sharded"] > 0
        assert case["replicated"] == [], case["replicated"]
        assert case["probe"] is None, case["probe"]  # the wiring-time probe: no module differs


def test_the_probe_names_an_embedding_that_lost_its_own_forward(results):
    for r in results:
        assert r["stock_lookup_probed"] == "model.embed_tokens", r["stock_lookup_probed"]


def test_removing_the_qk_norm_rule_is_named_at_the_first_step(results):
    for r in results:
        msg = r["qk_norm_rule_removed"]
        assert msg.startswith("step 1: model.layers."), msg
        assert "self_attn.q_norm.weight: gradients differ across tp ranks (rel" in msg, msg
        assert "needs a rule" in msg
