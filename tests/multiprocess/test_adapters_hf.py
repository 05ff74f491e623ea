"""titanext plugins inside a Hugging Face ``transformers`` Llama, against the plain model.

The model comes from a small config (no download). Each parallel run computes the loss and
the full gradients and compares them with one process running the unparallelized model on
the whole batch.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

from tests.spawn import run_distributed

transformers = pytest.importorskip("transformers")

IGNORE = -100


def _model():
    cfg = transformers.LlamaConfig(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=128,
        attention_dropout=0.0)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(cfg).float()


def _batch(batch=4, seq=32):
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, 128, (batch, seq), generator=g)
    labels = tokens.roll(-1, dims=1)
    labels[:, -1] = IGNORE  # shifted once, globally: shards need no further shifting
    return tokens, labels


def _loss_sum(model, tokens, labels, position_ids=None):
    logits = model(input_ids=tokens, position_ids=position_ids).logits
    return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), reduction="sum",
                           ignore_index=IGNORE)


def _reference():
    model = _model()
    tokens, labels = _batch()
    count = (labels != IGNORE).sum()
    loss = _loss_sum(model, tokens, labels) / count
    loss.backward()
    return loss.item(), {n: p.grad.clone() for n, p in model.named_parameters()}


def _full(grad):
    return grad.full_tensor() if isinstance(grad, DTensor) else grad


def _rel_errors(grads, ref):
    return {n: ((grads[n] - r).norm() / r.norm()).item() for n, r in ref.items()}


def _fsdp_tp_body(rank, world_size):
    from torch.distributed.device_mesh import init_device_mesh

    from titanext.hf.transformers import hf_blocks, hf_llama_tp_plan
    from titanext.plugins.fsdp import apply_fsdp
    from titanext.plugins.tensor_parallel import apply_tensor_parallel

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    model = _model()
    apply_tensor_parallel(model, mesh["tp"], plan=hf_llama_tp_plan())
    apply_fsdp(model, mesh["dp"], blocks=hf_blocks(model))
    tokens, labels = _batch()
    count = (labels != IGNORE).sum()
    dp = mesh["dp"].get_local_rank()
    mine = slice(2 * dp, 2 * dp + 2)  # each dp rank takes half the sequences
    # FSDP averages gradients over dp, so scale the local sum by dp / global count.
    loss = _loss_sum(model, tokens[mine], labels[mine])
    (loss * 2 / count).backward()
    total = loss.detach().clone()
    dist.all_reduce(total, group=mesh["dp"].get_group())
    grads = {n: _full(p.grad) for n, p in model.named_parameters()}
    # The same 4 ranks as CP through the HF hook: hybrid 2 x 2 (Ulysses inside pairs, ring
    # across them), and Ulysses over all 4 (the model's 2 kv heads replicated to 4 ranks).
    cp = init_device_mesh("cpu", (2, 2), mesh_dim_names=("cp_ring", "cp_ulysses"))
    return [((total / count).item(), grads), _cp_run(cp, "zigzag", "p2p"),
            _cp_run(dist.group.WORLD, "zigzag", "alltoall")]


def _cp_body(rank, world_size, layout, comm):
    return _cp_run(dist.group.WORLD, layout, comm)


def _cp_run(cp, layout, comm):
    """Loss and full gradients with CP attention through the HF hook over ``cp`` (a group,
    or a 2D (ring, Ulysses) mesh: hybrid)."""
    from titanext.hf.transformers import apply_hf_context_parallel, hf_shard_batch
    from titanext.plugins.context_parallel import shard_batch

    model = _model()
    apply_hf_context_parallel(model, cp, layout=layout, comm=comm)
    tokens, labels = _batch()
    count = (labels != IGNORE).sum()
    if layout == "zigzag":  # the model's recorded layout
        tokens, labels, position_ids = hf_shard_batch(model, tokens, labels)
    else:
        tokens, labels, positions = shard_batch(tokens, labels, cp, layout=layout)
        position_ids = positions[None]
    loss = _loss_sum(model, tokens, labels, position_ids)
    loss.backward()
    dist.all_reduce(loss)
    grads = {}
    for n, p in model.named_parameters():  # what FSDP/DDP over the CP ranks does
        dist.all_reduce(p.grad)
        grads[n] = p.grad / count
    return (loss / count).item(), grads


@pytest.fixture(scope="module")
def reference():
    return _reference()


def test_fsdp2_x_tp2_hybrid_and_ulysses4_on_hf_llama_match_the_plain_model(reference):
    ref_loss, ref_grads = reference
    for runs in run_distributed(_fsdp_tp_body, 4, timeout_s=60):
        for label, (loss, grads) in zip(("fsdp2 x tp2", "hybrid 2x2", "Ulysses 4"), runs):
            assert abs(loss - ref_loss) < 1e-5 * ref_loss, label
            errs = _rel_errors(grads, ref_grads)
            worst = max(errs, key=errs.get)
            assert errs[worst] < 1e-5, f"{label}: {worst}: {errs[worst]:.2e}"


@pytest.mark.parametrize("layout,comm", [("zigzag", "p2p"), ("contiguous", "allgather")])
def test_ring_attention_through_the_hf_attention_hook(reference, layout, comm):
    ref_loss, ref_grads = reference
    for loss, grads in run_distributed(_cp_body, 2, args=(layout, comm), timeout_s=60):
        assert abs(loss - ref_loss) < 1e-5 * ref_loss
        errs = _rel_errors(grads, ref_grads)
        worst = max(errs, key=errs.get)
        assert errs[worst] < 1e-5, f"{worst}: {errs[worst]:.2e}"


def _cp_mistakes_body(rank, world_size):
    from titanext.hf.transformers import apply_hf_context_parallel
    from titanext.plugins.context_parallel import shard_batch

    model = _model()
    apply_hf_context_parallel(model, dist.group.WORLD, layout="zigzag")
    tokens, labels = _batch()
    errors = []
    # A batch sharded in the other layout (silently 0.66 relative gradient error before), and a
    # forgotten position_ids.
    ids, lab, positions = shard_batch(tokens, labels, dist.group.WORLD, layout="contiguous")
    for position_ids in (positions[None], None):
        try:
            _loss_sum(model, ids, lab, position_ids)
            errors.append(None)
        except ValueError as e:
            errors.append(str(e))
    return errors


def test_hf_cp_rejects_a_batch_of_another_layout_and_missing_positions():
    for mismatch, missing in run_distributed(_cp_mistakes_body, 2, timeout_s=60):
        assert mismatch is not None and "sharded with layout = 'contiguous'" in mismatch
        assert "layout = 'zigzag'" in mismatch and "hf_shard_batch" in mismatch
        assert missing is not None and "position_ids is missing" in missing


def test_float8_converts_the_hf_linears_and_trains_close_to_high_precision(reference):
    from titanext.plugins.float8 import apply_float8

    model = _model()
    converted = apply_float8(model, recipe="tensorwise", filter_fqns=["lm_head"])
    names = [f"model.layers.{i}.{m}" for i in range(2) for m in (
        "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
        "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")]
    assert sorted(converted) == sorted(names)
    tokens, labels = _batch()
    loss = _loss_sum(model, tokens, labels) / (labels != IGNORE).sum()
    loss.backward()
    assert abs(loss.item() - reference[0]) < 0.02 * reference[0]
    assert all(p.grad is not None for p in model.parameters())


# -- pipeline parallelism: decoder layers split into stages, a titanext schedule ----------------
PP_LAYERS = 4


def _pp_model():
    cfg = transformers.LlamaConfig(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=PP_LAYERS,
        num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=128,
        attention_dropout=0.0, tie_word_embeddings=False)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(cfg).float()


def _pp_reference():
    model = _pp_model()
    tokens, labels = _batch()
    loss = _loss_sum(model, tokens, labels) / (labels != IGNORE).sum()
    loss.backward()
    return loss.item(), {n: p.grad.clone() for n, p in model.named_parameters()}


def _pp_body(rank, world_size, schedules):
    from titanext.distributed.pipeline import build_pipeline, layers_per_stage, pipeline_stage_ids
    from titanext.hf.transformers import hf_pipeline_stage
    from titanext.schedules import get_schedule_class

    tokens, labels = _batch()
    count = (labels != IGNORE).sum()

    def loss_fn(logits, target):  # per micro-batch: token-loss sum over the global count
        return F.cross_entropy(logits.flatten(0, 1).float(), target.flatten(), reduction="sum",
                               ignore_index=IGNORE) / count

    out = []
    for name in schedules:
        model = _pp_model()  # every rank builds it whole here; a real run builds it on meta
        n_stages = world_size * get_schedule_class(name).stages_per_rank
        ids = pipeline_stage_ids(name, pp_rank=rank, pp=world_size)
        counts = layers_per_stage(PP_LAYERS, n_stages)
        stages = [hf_pipeline_stage(model, counts, i) for i in ids]
        _, schedule = build_pipeline(stages, ids, num_stages=n_stages, pp_group=dist.group.WORLD,
                                     device=torch.device("cpu"), schedule=name, microbatches=4,
                                     loss_fn=loss_fn)
        losses = []
        kwargs = {"target": labels, "losses": losses} if n_stages - 1 in ids else {}
        schedule.step(*((tokens,) if 0 in ids else ()), **kwargs)
        total = torch.stack(losses).sum() if losses else torch.zeros(())
        dist.all_reduce(total)  # only the last stage's rank holds the losses
        grads = {n: p.grad.clone() for st in stages for n, p in st.named_parameters()}
        out.append((total.item(), grads))
    return out


def test_pipeline_stages_of_hf_llama_match_the_plain_model():
    ref_loss, ref_grads = _pp_reference()
    schedules = ["ZBH1", "ZBV"]  # one stage per rank; two per rank in a V
    results = run_distributed(_pp_body, 2, args=(schedules,), timeout_s=60)
    for i, name in enumerate(schedules):
        loss = results[0][i][0]
        grads = {n: g for rank_out in results for n, g in rank_out[i][1].items()}
        assert abs(loss - ref_loss) < 1e-5 * ref_loss, name
        assert grads.keys() == ref_grads.keys(), name  # the library's own parameter names
        errs = _rel_errors(grads, ref_grads)
        worst = max(errs, key=errs.get)
        assert errs[worst] < 1e-5, f"{name}: {worst}: {errs[worst]:.2e}"


def test_pipeline_stage_rejects_tied_embeddings_and_bad_counts():
    from titanext.hf.transformers import hf_pipeline_stage

    model = _pp_model()
    with pytest.raises(ValueError, match="sum to the model's 4 decoder layers"):
        hf_pipeline_stage(model, [1, 2], 0)
    model.config.tie_word_embeddings = True
    with pytest.raises(ValueError, match="tie_word_embeddings"):
        hf_pipeline_stage(model, [2, 2], 0)
    whole = hf_pipeline_stage(model, [4], 0)  # one stage = the model itself
    tokens, _ = _batch()
    torch.testing.assert_close(whole(tokens), model(input_ids=tokens).logits)


# -- expert parallelism on the library's MoE family (Qwen3-MoE) ---------------------------------
def _moe_model():
    cfg = transformers.Qwen3MoeConfig(
        vocab_size=128, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        num_experts=4, num_experts_per_tok=2, norm_topk_prob=True, max_position_embeddings=128,
        attention_dropout=0.0)
    torch.manual_seed(0)
    return transformers.Qwen3MoeForCausalLM(cfg).float()


def _moe_reference():
    model = _moe_model()
    tokens, labels = _batch()
    loss = _loss_sum(model, tokens, labels) / (labels != IGNORE).sum()
    loss.backward()
    return loss.item(), {n: p.grad.clone() for n, p in model.named_parameters()}


def _ep_body(rank, world_size):
    from torch.distributed.device_mesh import init_device_mesh

    from titanext.hf.transformers import apply_hf_expert_parallel

    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("ep",))
    model = _moe_model()
    converted = apply_hf_expert_parallel(model, mesh["ep"])
    tokens, labels = _batch()
    count = (labels != IGNORE).sum()
    mine = slice(2 * rank, 2 * rank + 2)  # each ep rank feeds its own half of the batch
    loss = _loss_sum(model, tokens[mine], labels[mine]) / count
    loss.backward()
    total = loss.detach().clone()
    dist.all_reduce(total)
    grads = {}
    for n, p in model.named_parameters():
        if isinstance(p.grad, DTensor):  # an expert: complete on the rank that holds it
            grads[n] = p.grad.full_tensor()
        else:  # dense: what data parallelism over the ep ranks sums
            dist.all_reduce(p.grad)
            grads[n] = p.grad
    return converted, total.item(), grads


def test_expert_parallel_on_hf_qwen3_moe_matches_the_plain_model():
    ref_loss, ref_grads = _moe_reference()
    for converted, loss, grads in run_distributed(_ep_body, 2, timeout_s=60):
        assert converted == ["model.layers.0.mlp.experts", "model.layers.1.mlp.experts"]
        assert abs(loss - ref_loss) < 1e-5 * ref_loss
        assert grads.keys() == ref_grads.keys()  # the library's parameter names
        errs = _rel_errors(grads, ref_grads)
        worst = max(errs, key=errs.get)
        assert errs[worst] < 1e-5, f"{worst}: {errs[worst]:.2e}"


def _cp_documents_body(rank, world_size):
    """Packed documents through the HF attention hook (ring and Ulysses): the logits each
    document gets when the plain model runs it alone."""
    from titanext.data import document_positions
    from titanext.hf.transformers import apply_hf_context_parallel
    from titanext.plugins.context_parallel import shard_sequence

    tokens, _ = _batch()
    lengths = [1, 7, 12, 4, 8]  # 32 tokens, a one-token document first
    docs = torch.repeat_interleave(torch.arange(5), torch.tensor(lengths)).expand(4, 32)
    plain = _model()
    with torch.no_grad():
        alone = torch.cat([plain(input_ids=tokens[:, docs[0] == d]).logits for d in range(5)], 1)
    g = dist.group.WORLD
    errs = {}
    for comm in ("p2p", "alltoall"):
        model = _model()
        apply_hf_context_parallel(model, g, comm=comm)
        ids, pos, ref = (shard_sequence(t, 1, g) for t in (docs, document_positions(docs), alone))
        with torch.no_grad():
            out = model(input_ids=shard_sequence(tokens, 1, g), position_ids=pos,
                        document_ids=ids).logits
        errs[comm] = ((out - ref).abs().max() / ref.abs().max()).item()
    return errs


def test_packed_documents_through_the_hf_attention_hook():
    for errs in run_distributed(_cp_documents_body, 2, timeout_s=60):
        assert max(errs.values()) < 1e-5, errs


# -- issue 44: sliding-window families under CP, and what CP refuses -----------------------------

def _sliding_model(family):
    """Tiny random models whose sliding windows (5 or 6) are shorter than a CP chunk (8 tokens
    of 32 on 2 zigzag ranks) and than the sequence: Gemma 3 (sliding + global layers), Mistral
    (one window for every layer), GPT-OSS (sliding + global, attention sinks, experts)."""
    common = dict(vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=128, attention_dropout=0.0)
    torch.manual_seed(0)
    if family == "gemma3":
        cfg = transformers.Gemma3TextConfig(
            **common, intermediate_size=128, head_dim=16, sliding_window=5,
            layer_types=["sliding_attention", "full_attention"], query_pre_attn_scalar=24)
        return transformers.Gemma3ForCausalLM(cfg).float()
    if family == "mistral":
        cfg = transformers.MistralConfig(**common, intermediate_size=128, sliding_window=6)
        return transformers.MistralForCausalLM(cfg).float()
    cfg = transformers.GptOssConfig(
        **common, intermediate_size=64, head_dim=16, sliding_window=6,
        layer_types=["sliding_attention", "full_attention"], num_local_experts=4,
        num_experts_per_tok=2)
    model = transformers.GptOssForCausalLM(cfg).float()
    with torch.no_grad():  # sinks away from zero, one per head
        for layer in model.model.layers:
            layer.self_attn.sinks.copy_(torch.linspace(-1.0, 1.5, 4))
    return model


def _sliding_reference(family):
    model = _sliding_model(family)
    tokens, labels = _batch()
    loss = _loss_sum(model, tokens, labels) / (labels != IGNORE).sum()
    loss.backward()
    return loss.item(), {n: p.grad.clone() for n, p in model.named_parameters()}


def _sliding_body(rank, world_size):
    """Per family and CP flavour: (relative loss error, worst relative gradient error)."""
    from titanext.hf.transformers import apply_hf_context_parallel, hf_shard_batch

    out = {}
    for family in ("gemma3", "mistral", "gptoss"):
        ref_loss, ref_grads = _sliding_reference(family)
        for layout, comm in (("zigzag", "p2p"), ("contiguous", "p2p"), ("zigzag", "alltoall"),
                             ("contiguous", "allgather")):
            model = _sliding_model(family)
            apply_hf_context_parallel(model, dist.group.WORLD, layout=layout, comm=comm)
            tokens, labels = _batch()
            count = (labels != IGNORE).sum()
            tokens, labels, position_ids = hf_shard_batch(model, tokens, labels)
            loss = _loss_sum(model, tokens, labels, position_ids)
            loss.backward()
            dist.all_reduce(loss)
            errs = {}
            for n, p in model.named_parameters():
                dist.all_reduce(p.grad)
                errs[n] = ((p.grad / count - ref_grads[n]).norm() / ref_grads[n].norm()).item()
            worst = max(errs, key=errs.get)
            out[family, layout, comm] = (abs((loss / count).item() - ref_loss) / ref_loss,
                                         worst, errs[worst])
    return out


def test_sliding_window_families_under_cp_match_one_process():
    """Issue 44, case 1: Gemma 3's sliding layers ran full causal attention under CP (gradients
    1.4 off). Now Gemma 3, Mistral and GPT-OSS (with sinks) match one process."""
    for per_rank in run_distributed(_sliding_body, 2, timeout_s=60):
        assert len(per_rank) == 12
        for key, (loss_err, worst, grad_err) in per_rank.items():
            assert loss_err < 1e-5 and grad_err < 1e-5, (key, loss_err, worst, grad_err)


def _refused_models():
    """Tiny random hybrids and a model whose attention bypasses the interface."""
    small = dict(vocab_size=128, hidden_size=64, num_hidden_layers=2)
    heads = dict(intermediate_size=128, num_attention_heads=4, num_key_value_heads=2)
    mamba = dict(mamba_n_heads=4, mamba_d_head=32, mamba_n_groups=1, mamba_d_state=16)
    return {
        "Bamba": transformers.BambaForCausalLM(transformers.BambaConfig(
            **small, **heads, **mamba, attn_layer_indices=[1])),
        "Mamba2": transformers.Mamba2ForCausalLM(transformers.Mamba2Config(
            **small, num_heads=4, head_dim=32, n_groups=1, state_size=16)),
        "Jamba": transformers.JambaForCausalLM(transformers.JambaConfig(**small, **heads)),
        "FalconH1": transformers.FalconH1ForCausalLM(transformers.FalconH1Config(
            **small, **heads, **mamba, mamba_d_ssm=128, head_dim=16)),
        "Falcon": transformers.FalconForCausalLM(transformers.FalconConfig(
            **small, num_attention_heads=4)),
        "Gemma2": transformers.Gemma2ForCausalLM(transformers.Gemma2Config(
            **small, **heads, head_dim=16)),
    }


def test_cp_refuses_state_space_hybrids_and_bypassing_attention_by_name():
    """Issue 44, cases 2 and 3, and the Mamba2 message: refused before anything is rewritten,
    naming the module path (or config key) and the reason; no word of RoPE on Mamba2."""
    from titanext.hf.transformers import apply_hf_context_parallel

    expected = {
        "Bamba": ("model.layers.0.mamba (BambaMixer): a state-space (Mamba) mixer",),
        "Mamba2": ("backbone.layers.0.mixer (Mamba2Mixer)", "backbone.layers.1.mixer"),
        "Jamba": ("model.layers.0 (JambaMambaDecoderLayer): a state-space",),
        "FalconH1": ("model.layers.1.mamba (FalconH1Mixer)",),
        "Falcon": ("FalconForCausalLM: its attention does not go through transformers' "
                   "attention interface",),
        "Gemma2": ("config.attn_logit_softcapping = 50.0",),
    }
    for name, model in _refused_models().items():
        before = model.config._attn_implementation
        with pytest.raises(ValueError) as err:
            apply_hf_context_parallel(model, None)
        text = str(err.value)
        assert "cannot run under context parallelism" in text, name
        for part in expected[name]:
            assert part in text, (name, text)
        assert "RoPE" not in text and "position_ids" not in text, (name, text)
        assert model.config._attn_implementation == before, name  # nothing was changed


def _bypass_body(rank, world_size):
    """Attention that bypasses the interface after wiring (each attention module given its own
    config that names SDPA, as a model with its own attention code would behave): each rank
    would attend to its own chunk only. The first forward raises, naming the block."""
    import copy

    from titanext.hf.transformers import apply_hf_context_parallel, hf_shard_batch

    model = _model()
    apply_hf_context_parallel(model, dist.group.WORLD)
    for layer in model.model.layers:
        layer.self_attn.config = copy.copy(model.config)
        layer.self_attn.config._attn_implementation = "sdpa"
    tokens, labels = _batch()
    tokens, labels, position_ids = hf_shard_batch(model, tokens, labels)
    try:
        _loss_sum(model, tokens, labels, position_ids)
    except ValueError as e:
        return str(e)
    return None


def test_cp_refuses_a_block_that_never_called_the_attention_function():
    """Issue 44, case 3 at run time (Falcon itself is refused up front, by its flag)."""
    for message in run_distributed(_bypass_body, 2, timeout_s=60):
        assert message is not None and "block model.layers.0 (LlamaDecoderLayer) ran without " \
            "calling transformers' attention interface" in message, message
