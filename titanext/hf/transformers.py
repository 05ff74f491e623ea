"""Adapters that let titanext plugins run inside Hugging Face ``transformers`` models.

The plugins themselves know nothing about ``transformers``; everything model-library-specific
lives here: where the decoder blocks are, a TP plan for the Llama family's module names, and
the hook that routes the library's attention to ring attention. ``transformers`` is an optional
dependency (the ``dev`` extra); nothing else in titanext imports this module.

Covered (tested in tests/multiprocess/test_adapters_hf.py against the unparallelized model):

- FSDP2: ``apply_fsdp(model, mesh, blocks=hf_blocks(model))``.
- TP: ``apply_tensor_parallel(model, tp_mesh, plan=hf_tp_plan(model))`` (Llama, Mistral,
  Mixtral, Qwen3, Qwen3-MoE, DeepSeek-V3; tests/multiprocess/test_hf_tp_families.py), or the
  fixed ``hf_llama_tp_plan()`` for the Llama family's module names (QK-norm included).
- CP: ``apply_hf_context_parallel(model, cp_mesh)`` registers a ``transformers`` attention
  function that calls :func:`titanext.plugins.context_parallel.ring_attention` and records the
  layout on the model; shard the batch with ``hf_shard_batch(model, input_ids, labels)`` (the
  recorded layout) and pass its ``position_ids``. Every forward checks them: missing positions,
  or positions of another layout (a batch sharded with ``shard_batch(..., layout=other)``),
  raise a ValueError instead of silently wrong gradients.
- PP: ``hf_pipeline_stage(model, counts, stage_index)`` cuts one stage out of a causal LM that
  runs the model's own forward (its embedding factors on the first stage, its norm, head,
  scaling and soft-capping on the last; each block at its global index), probed against the
  whole model on a materialised one (:mod:`titanext.distributed.probe`), to hand to
  :func:`titanext.distributed.pipeline.build_pipeline` with any titanext schedule.
- EP: ``apply_hf_expert_parallel(model, ep_mesh)`` replaces the library's experts modules
  (Qwen3-MoE, Mixtral: ``gate_up_proj`` [E, 2I, H] and ``down_proj`` [E, H, I], called as
  ``experts(tokens, top_k_index, top_k_weights)``) by one that splits the experts over
  ``ep_mesh`` and moves tokens with titanext's ``dispatch_tokens`` / ``combine_tokens``.
- float8: ``apply_float8(model, filter_fqns=["lm_head"])`` needs no adapter.

>>> from transformers import LlamaConfig, LlamaForCausalLM
>>> model = LlamaForCausalLM(LlamaConfig(hidden_size=64, ...))  # your config  # doctest: +SKIP
>>> apply_tensor_parallel(model, mesh["tp"], plan=hf_llama_tp_plan())  # torchrun  # doctest: +SKIP
"""

from __future__ import annotations

import functools
import inspect
import itertools
import weakref
from collections.abc import Sequence

import torch
from torch import nn
from torch.distributed.tensor import Replicate
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    RowwiseParallel,
    SequenceParallel,
)

from titanext.distributed._stage_probe import probe_stage
from titanext.distributed.split import pass_on, run_own_forward, split_model
from titanext.hf._cp_checks import AttentionCallCheck, check_cp_model, layer_window
from titanext.hf._tp_checks import interleaved_qkv_rules, local_head_counts, tp_plan_problems
from titanext.hf.buffers import restore_buffers
from titanext.plugins._blocks import block_container
from titanext.plugins.context_parallel import (
    LAYOUTS,
    cp_attention_fn,
    cp_world_size,
    shard_batch,
    shard_sequence,
)
from titanext.plugins.expert_parallel import (
    ExpertParallelExperts,
    StackedExperts,
    apply_expert_parallel,
    detect_experts_layout,
)
from titanext.plugins.tensor_parallel import ReplicatedOverTP, VocabParallelEmbedding
from titanext.plugins.tp_coverage import fqn_matches, unruled_parameters

__all__ = ["hf_blocks", "hf_llama_tp_plan", "hf_tp_plan", "apply_hf_context_parallel",
           "hf_shard_batch", "HFCausalLMStage", "hf_pipeline_stage", "HFExpertParallel",
           "apply_hf_expert_parallel"]

_ids = itertools.count()


def hf_blocks(model: nn.Module) -> list[nn.Module]:
    """The decoder blocks of a ``transformers`` causal LM (``model.model.layers``), in order."""
    inner = getattr(model, "model", model)
    layers = getattr(inner, "layers", None)
    if not isinstance(layers, nn.ModuleList):
        raise ValueError(f"{type(model).__name__} has no decoder block list at model.layers; pass "
                         "blocks= explicitly to the plugin")
    return list(layers)


def hf_llama_tp_plan() -> dict[str, ParallelStyle]:
    """Megatron-style TP for the Llama family's module names (no sequence parallelism).

    Attention heads and the SwiGLU hidden dimension are split (column-parallel in,
    row-parallel out); the embedding is split over the vocabulary (its gradient too:
    :class:`~titanext.plugins.tensor_parallel.VocabParallelEmbedding`) and the LM head's logits are
    gathered, so ``transformers``' own loss sees full logits. The attention code reshapes with
    ``-1`` heads, so each rank runs its local heads unchanged. QK-norm (Qwen3, Qwen3-MoE)
    normalises each rank's own heads (``SequenceParallel`` on dim 2 of [b, s, heads, hd]: the
    weight stays replicated and its gradient is summed over tp); these two rules match nothing on
    Llama or Mistral. Needs heads, KV heads, intermediate size and vocabulary divisible by the TP
    degree. :func:`hf_tp_plan` builds the plan for a given model (MLA too) and refuses a weight
    it has no rule for.
    """
    return {
        "model.embed_tokens": VocabParallelEmbedding(input_layouts=Replicate()),
        **_gqa_rules(qk_norm=True),
        **_mlp_rules("model.layers.*.mlp"),
        "lm_head": ColwiseParallel(output_layouts=Replicate()),
    }


def _gqa_rules(qk_norm: bool) -> dict[str, ParallelStyle]:
    a = "model.layers.*.self_attn"
    rules = {f"{a}.q_proj": ColwiseParallel(), f"{a}.k_proj": ColwiseParallel(),
             f"{a}.v_proj": ColwiseParallel(), f"{a}.o_proj": RowwiseParallel()}
    if qk_norm:  # q / k viewed as [b, s, local heads, hd] before the norm
        for name in ("q_norm", "k_norm"):
            rules[f"{a}.{name}"] = SequenceParallel(sequence_dim=2, use_local_output=True)
    return rules


def _mla_rules(rope_dim: int, q_lora: bool) -> dict[str, ParallelStyle]:
    """DeepSeek-V3's multi-head latent attention: heads split (q_b_proj / q_proj and kv_b_proj
    column-wise, o_proj row-wise); the latents are computed replicated from the full input. The
    RoPE key (the last ``rope_dim`` outputs of kv_a_proj_with_mqa) is shared by every head and
    meets only the rank's heads, so its gradient is summed over tp."""
    a = "model.layers.*.self_attn"
    rules: dict[str, ParallelStyle] = {
        f"{a}.kv_a_proj_with_mqa": ReplicatedOverTP(grad_sum_last=rope_dim),
        f"{a}.kv_a_layernorm": ReplicatedOverTP(),
        f"{a}.kv_b_proj": ColwiseParallel(),
        f"{a}.o_proj": RowwiseParallel(),
    }
    if q_lora:
        rules.update({f"{a}.q_a_proj": ReplicatedOverTP(), f"{a}.q_a_layernorm": ReplicatedOverTP(),
                      f"{a}.q_b_proj": ColwiseParallel()})
    else:
        rules[f"{a}.q_proj"] = ColwiseParallel()
    return rules


def _mlp_rules(prefix: str) -> dict[str, ParallelStyle]:
    return {f"{prefix}.gate_proj": ColwiseParallel(), f"{prefix}.up_proj": ColwiseParallel(),
            f"{prefix}.down_proj": RowwiseParallel()}


def hf_tp_plan(model: nn.Module) -> dict[str, ParallelStyle]:
    """The TP plan for a ``transformers`` decoder-only causal LM, built from its modules; checked
    on Llama, Mistral, Mixtral, Qwen3, Qwen3-MoE and DeepSeek-V3 (tests/multiprocess/
    test_hf_tp_families.py, against one process).

    - Attention: GQA (``q_proj`` ... ``o_proj``, plus QK-norm rules where the model has
      ``q_norm`` / ``k_norm``) or DeepSeek's MLA (``kv_a_proj_with_mqa`` ...), heads split.
    - Dense MLPs and DeepSeek's shared experts: SwiGLU hidden dim split.
    - Routed experts and their router stay replicated over tp (every tp rank runs the same
      tokens through them; their gradients are complete on every rank); split them with
      expert parallelism (:func:`apply_hf_expert_parallel`).
    - The embedding split over the vocabulary, the LM head's logits gathered; a tied
      embedding and LM head stay tied (both split over the vocabulary).

    Loud or correct: a parameter inside a split attention or MLP that no rule covers (a family
    with a new per-head weight, say) raises a ValueError naming it, instead of training with a
    per-rank partial gradient. Needs heads, KV heads, intermediate sizes and the vocabulary
    divisible by the TP degree.

    >>> plan = hf_tp_plan(model)  # your model  # doctest: +SKIP
    >>> apply_tensor_parallel(model, mesh["tp"], plan=plan)  # torchrun  # doctest: +SKIP
    """
    names = {n for n, _ in model.named_modules()}

    def has(suffix: str) -> bool:
        return any(n.endswith(suffix) for n in names)

    plan: dict[str, ParallelStyle] = {
        "model.embed_tokens": VocabParallelEmbedding(input_layouts=Replicate())}
    if has("self_attn.kv_a_proj_with_mqa"):
        cfg = model.config
        try:
            rope = cfg.qk_rope_head_dim
        except Exception as e:  # a per-layer config: transformers refuses one global value
            raise ValueError(f"hf_tp_plan: {type(model).__name__}'s config gives no one "
                             f"qk_rope_head_dim ({type(e).__name__}); the MLA rules split every "
                             "layer by one rope dim") from e
        plan.update(_mla_rules(rope, getattr(cfg, "q_lora_rank", None) is not None))
    else:
        plan.update(_gqa_rules(qk_norm=has("self_attn.q_norm")))
    plan.update(_mlp_rules("model.layers.*.mlp"))
    if has("mlp.shared_experts.down_proj"):
        plan.update(_mlp_rules("model.layers.*.mlp.shared_experts"))
    plan.update(interleaved_qkv_rules(model))  # GPT-NeoX: per-head [q; k; v] rows
    plan["gpt_neox.embed_in"] = VocabParallelEmbedding(input_layouts=Replicate())
    plan["lm_head"] = ColwiseParallel(output_layouts=Replicate())
    plan = {k: v for k, v in plan.items() if _any_match(k, names)}
    problems = tp_plan_problems(model, plan)
    if problems:
        raise ValueError("hf_tp_plan: " + "; ".join(problems))
    unruled = unruled_parameters(model, plan)
    if unruled:
        raise ValueError(
            f"hf_tp_plan: {type(model).__name__} has parameter(s) inside a tensor-parallel "
            f"attention or MLP that the plan has no rule for: {', '.join(unruled[:4])}"
            f"{f' (+{len(unruled) - 4})' if len(unruled) > 4 else ''}. Kept replicated there, "
            "each rank would get the gradient of its own heads only. Fix: add a rule for them "
            "(a per-head norm: SequenceParallel(sequence_dim=2, use_local_output=True); a "
            "replicated weight before the split: ReplicatedOverTP()) to the returned plan and "
            "pass it yourself, or leave tp = 1 for this model")
    local_head_counts(model, plan)  # attention that reshapes by self.num_heads (StableLM)
    return plan


def _any_match(pattern: str, names: set[str]) -> bool:
    return any(fqn_matches(pattern, n) for n in names)


def apply_hf_context_parallel(model: nn.Module, cp_mesh, *, layout: str = "zigzag",
                              comm: str = "p2p", kernel: str = "auto",
                              ulysses_degree: int | None = None) -> str:
    """Make a ``transformers`` model's attention run as CP attention over ``cp_mesh``.

    The options are :func:`titanext.plugins.context_parallel.apply_context_parallel`'s: a 1D
    ``cp_mesh`` runs the ring (``comm`` "p2p" / "allgather") or Ulysses (``comm="alltoall"``),
    a 2D (ring, Ulysses) mesh runs hybrid. A ``document_ids=`` keyword of the model call
    ([batch, local_seq], sharded like the inputs) reaches the attention and masks documents.

    First it checks what CP relies on (titanext/hf/_cp_checks.py) and refuses, naming each
    module or config entry and the reason, before changing anything: every sequence mixer must
    be attention through transformers' attention interface (state-space, convolution,
    linear-attention and recurrent mixers, and attention that bypasses the interface, are
    refused), and every layer's mask must be causal, optionally with the layer's sliding window
    (``config.layer_types`` / ``config.sliding_window``, as transformers' masks define them).
    Per-head attention sinks (GPT-OSS) are supported. While running, a decoder block that
    returns without having called the CP attention raises.

    Registers an attention function with ``transformers.AttentionInterface`` (the library's own
    hook for custom kernels) and switches ``model`` to it; returns the registered name. Inputs
    must be sharded with :func:`hf_shard_batch` (or ``shard_batch`` with the same ``layout``)
    and the returned positions passed as ``model(input_ids, position_ids=position_ids)``, so
    RoPE uses the global positions. Causal attention without padding only: an explicit
    padding mask cannot be split across ranks, so a non-causal mask raises.

    The layout is recorded on the model (``model.titanext_cp_layout``) and every forward checks
    that ``position_ids`` are present and are this rank's positions in that layout, so a batch
    sharded in another layout or a forgotten ``position_ids`` raises a ValueError (it would
    otherwise train on silently wrong gradients). The check compares ``local_seq`` integers.
    """
    # transformers is optional (the dev extra): imported only on a transformers model
    from transformers import AttentionInterface

    check_cp_model(model)
    ring = cp_attention_fn(cp_mesh, layout=layout, comm=comm, kernel=kernel,
                           ulysses_degree=ulysses_degree)
    calls = AttentionCallCheck(model)
    config = model.config.get_text_config()

    def attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
        # query [B, H, S, D], key/value [B, KVH, S, D] (un-expanded), as the ring wants them.
        calls.called()
        if dropout:
            raise ValueError(f"context parallelism: attention dropout = {dropout} is not "
                             "supported; set the model's attention_dropout to 0")
        if attention_mask is not None and not getattr(module, "is_causal", True):
            raise ValueError("context parallelism supports causal attention without a padding "
                             "mask; got a non-causal attention mask")
        if kwargs.get("softcap") is not None:
            raise ValueError(f"context parallelism: {type(module).__name__} asks for attention "
                             f"logit soft-capping (softcap = {kwargs['softcap']}), which the CP "
                             "kernels do not apply")
        causal = getattr(module, "is_causal", True)
        window = layer_window(getattr(module, "config", config), module,
                              kwargs.get("sliding_window"))
        out = ring(query, key, value, causal=causal, scale=scaling,
                   document_ids=kwargs.get("document_ids"), window=window,
                   sinks=kwargs.get("s_aux"))
        return out.transpose(1, 2).contiguous(), None  # [B, S, H, D], no attention weights

    name = f"titanext_ring_{next(_ids)}"
    AttentionInterface.register(name, attention)
    model.set_attn_implementation(name)
    model.titanext_cp_layout = layout
    model.titanext_cp_group = cp_mesh
    model.register_forward_pre_hook(_PositionCheck(model, cp_mesh, layout), with_kwargs=True)
    return name


def hf_shard_batch(model: nn.Module, input_ids: torch.Tensor, labels: torch.Tensor | None
                   ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """This CP rank's slice of a batch in the layout ``model`` was set up with.

    Returns (input_ids, labels, position_ids [1, local_seq]); pass the positions to the model.

    >>> ids, labels, position_ids = hf_shard_batch(model, ids, labels)  # torchrun  # doctest: +SKIP
    >>> model(input_ids=ids, position_ids=position_ids).logits  # torchrun  # doctest: +SKIP
    """
    layout = getattr(model, "titanext_cp_layout", None)
    if layout is None:
        raise ValueError(f"{type(model).__name__} has no context parallelism: call "
                         "apply_hf_context_parallel(model, cp_mesh) first")
    ids, labels, positions = shard_batch(input_ids, labels, model.titanext_cp_group, layout=layout)
    return ids, labels, positions[None]


class _PositionCheck:
    """Forward pre-hook: ``position_ids`` must be this rank's global positions in ``layout``."""

    def __init__(self, model: nn.Module, group, layout: str):
        self.group, self.layout = group, layout
        self.signature = inspect.signature(model.forward)
        self._expected: dict[tuple[int, str, torch.device], torch.Tensor] = {}

    def positions(self, local_seq: int, layout: str, device: torch.device) -> torch.Tensor:
        key = (local_seq, layout, device)
        if key not in self._expected:
            world = cp_world_size(self.group)
            full = torch.arange(local_seq * world, device=device)
            self._expected[key] = shard_sequence(full, 0, self.group, layout)
        return self._expected[key]

    def __call__(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        bound = self.signature.bind_partial(*args, **kwargs).arguments
        position_ids = bound.get("position_ids")
        hint = ("shard the batch with hf_shard_batch(model, input_ids, labels) and pass its "
                "position_ids")
        if position_ids is None:
            raise ValueError("context parallelism: position_ids is missing; each rank holds a "
                             "slice of every sequence, so RoPE needs the global positions: "
                             f"{hint}")
        if kwargs.get("document_ids") is not None:
            return  # packed documents: positions restart at each document start
        local = position_ids.shape[-1]
        if bool((position_ids == self.positions(local, self.layout, position_ids.device)).all()):
            return
        for other in LAYOUTS:
            if other != self.layout and bool(
                    (position_ids == self.positions(local, other, position_ids.device)).all()):
                raise ValueError(
                    f"context parallelism: the batch was sharded with layout = {other!r}, but "
                    f"apply_hf_context_parallel set up the attention with layout = "
                    f"{self.layout!r}; {hint} (it uses the model's layout)")
        raise ValueError(f"context parallelism: position_ids are not this rank's global "
                         f"positions in layout {self.layout!r}; {hint}")


class HFCausalLMStage(nn.Module):
    """A hand-written pipeline stage of a ``transformers`` decoder-only causal LM (Llama family
    layout; it runs no model-specific factor, so :func:`hf_pipeline_stage` does not use it:
    ``model.embed_tokens``, ``model.layers``, ``model.norm``, ``model.rotary_emb``, ``lm_head``).

    ``forward(x, position_ids=None)`` takes token ids on the first stage and hidden states
    [batch, seq, hidden] elsewhere; it returns logits on the last stage and hidden states
    elsewhere. Every stage computes the rotary embeddings itself from ``position_ids``
    ([seq] or [batch, seq]; default ``arange(seq)``), so no tuple of tensors crosses a stage
    boundary. Under CP hand each stage the sharded positions once with
    :func:`titanext.distributed.pipeline.pass_position_ids`. Parameter names are the library's own
    (``model.layers.5.mlp.up_proj.weight``), so a stage loads its slice of a full state dict
    with ``load_state_dict(sd, strict=False)`` and :func:`hf_llama_tp_plan` applies unchanged.
    """

    def __init__(self, model: nn.Module, layer_ids: Sequence[int], *, first: bool, last: bool):
        super().__init__()
        inner = model.model
        self.config = model.config
        self.model = nn.Module()  # keeps the library's "model." prefix in parameter names
        self.model.embed_tokens = inner.embed_tokens if first else None
        self.model.layers = nn.ModuleDict({str(i): inner.layers[i] for i in layer_ids})
        self.model.norm = inner.norm if last else None
        self.model.rotary_emb = inner.rotary_emb
        self.lm_head = model.lm_head if last else None

    def reset_rotary_embedding(self, device: torch.device | str) -> None:
        """Rebuild the rotary module on ``device``: its ``inv_freq`` is a non-persistent buffer,
        so after a meta-device build and ``to_empty`` no checkpoint restores it."""
        self.model.rotary_emb = _fresh_rotary(self.model.rotary_emb, self.config, device)

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor | None = None) -> torch.Tensor:
        # transformers is optional (the dev extra): imported only on a transformers model
        from transformers.masking_utils import create_causal_mask

        m = self.model
        h = m.embed_tokens(x) if m.embed_tokens is not None else x  # [batch, seq, hidden]
        if position_ids is None:
            position_ids = torch.arange(h.shape[1], device=h.device)
        if position_ids.dim() == 1:
            position_ids = position_ids.unsqueeze(0)
        # As the library's own decoder does: None for SDPA's is_causal path, a mask otherwise.
        mask = create_causal_mask(config=self.config, inputs_embeds=h, attention_mask=None,
                                  past_key_values=None, position_ids=position_ids)
        cos_sin = m.rotary_emb(h, position_ids=position_ids)
        for name, layer in m.layers.items():  # a tuple output (older transformers): its hidden
            h = pass_on(layer(h, attention_mask=mask, position_embeddings=cos_sin,
                              position_ids=position_ids), f"model.layers.{name}", last=False)
        if m.norm is not None:
            h = m.norm(h)
        return self.lm_head(h) if self.lm_head is not None else h


def hf_pipeline_stage(model: nn.Module, counts: Sequence[int], stage_index: int, *,
                      blocks: str | None = None, probe: bool = True) -> nn.Module:
    """Stage ``stage_index`` of ``model`` split into ``len(counts)`` stages holding ``counts``
    decoder layers each (see :func:`titanext.distributed.pipeline.layers_per_stage`).

    The stage is :func:`titanext.distributed.split.split_model`'s with ``skip_missing=True``: it
    runs the model's own ``forward``, so the model's own code runs before the first block and
    after the last (Granite's ``embedding_multiplier`` and ``logits_scaling``, Gemma 3's scaled
    embedding and soft-capping, the final norm), and every block keeps its global index
    (``config.layer_types[i]`` means the same layer as in the whole model). The blocks are
    ``model.layers`` for the Llama family's layout (``model.embed_tokens``, ``model.norm``,
    ``model.rotary_emb``, ``lm_head``); any other causal LM needs ``blocks=``, the dotted path
    of its block list (``"transformer.h"`` for GPT-2). The parts holding parameters that the
    model registers before the blocks stay on the first stage, those after them on the last;
    parameter-free parts (dropout, a rotary embedding) run on every stage. Call the first stage
    with the tokens, a later one with the hidden state alone (``stage(hidden)``: the model gets
    it as ``inputs_embeds`` too, for its masks) or with the model's inputs by keyword after it
    (``schedule.step(input_ids=tokens, ...)`` on every stage). The last stage passes on the
    logits, the others their last block's hidden state.

    ``probe`` (default True): on a materialised model, compare the stage with the whole model
    on 16 random tokens (:func:`titanext.distributed.probe.first_difference`) and raise a ValueError
    naming the first module that differs; nothing runs on a meta-device model.

    The stage holds a copy of its part (free on the meta device): build the model on meta, cut
    this rank's stages, then ``to_empty``, ``stage.reset_buffers()`` and load or initialise the
    weights. ``reset_buffers`` recomputes every non-persistent buffer (in no checkpoint: rotary
    ``inv_freq``, Gemma's ``embed_scale``, sinusoid tables, causal masks) with the model's own
    ``_init_weights`` and raises naming any it cannot (:func:`titanext.hf.buffers.
    restore_buffers`); keep the model until then. ``reset_rotary_embedding(device)``, its old
    name, does the same. Tied input and output embeddings cannot live on two stages; untie
    them (``tie_word_embeddings=False``). Tested in tests/multiprocess/test_adapters_hf.py and
    test_pipeline_hf_outputs.py (Granite MoE, Gemma 3, GPT-2) against one process.

    >>> counts = layers_per_stage(model.config.num_hidden_layers, 2)  # your model  # doctest: +SKIP
    >>> ids = pipeline_stage_ids("ZBH1", pp_rank=rank, pp=2)  # in a process group  # doctest: +SKIP
    >>> stages = [hf_pipeline_stage(model, counts, i) for i in ids]  # torchrun  # doctest: +SKIP
    >>> _, schedule = build_pipeline(stages, ids, num_stages=2, ...)  # torchrun  # doctest: +SKIP
    """
    counts = list(counts)
    if blocks is None:
        if not _llama_layout(model):
            raise ValueError(f"{type(model).__name__} does not have the Llama family's layout "
                             "(model.layers, model.embed_tokens, model.norm, model.rotary_emb, "
                             "lm_head); pass blocks= as the dotted path of its block list, e.g. "
                             "blocks='transformer.h'")
        blocks = "model.layers"
    n_layers = len(block_container(model, blocks))
    if sum(counts) != n_layers or min(counts) < 1:
        raise ValueError(f"layer counts {counts} must be >= 1 each and sum to the model's "
                         f"{n_layers} decoder layers")
    if not 0 <= stage_index < len(counts):
        raise ValueError(f"stage_index = {stage_index} is not in 0..{len(counts) - 1}")
    if len(counts) > 1 and getattr(getattr(model, "config", None), "tie_word_embeddings", False):
        raise ValueError("tie_word_embeddings = True shares one weight between the first and the "
                         "last stage; build the model with tie_word_embeddings=False for PP")
    stage = _own_forward_stage(model, counts, stage_index, blocks)
    if probe:
        probe_stage(model, stage, counts, stage_index, blocks)
    return stage


def _llama_layout(model: nn.Module) -> bool:
    inner = getattr(model, "model", None)
    return isinstance(getattr(inner, "layers", None), nn.ModuleList) and hasattr(
        model, "lm_head") and all(hasattr(inner, a) for a in ("embed_tokens", "norm", "rotary_emb"))


def stage_ends(module: nn.Module, path: list[str], prefix: str = ""
               ) -> tuple[list[str], list[str]]:
    """The parameter-holding parts registered before and after the block list at ``path``
    (its dotted path, split): what stays on the first and on the last pipeline stage."""
    before: list[str] = []
    after: list[str] = []
    seen = False
    for name, child in module.named_children():
        if name == path[0]:
            if len(path) > 1:
                inner_before, inner_after = stage_ends(child, path[1:], f"{prefix}{name}.")
                before, after = before + inner_before, after + inner_after
            seen = True
        elif any(True for _ in child.parameters()):
            (after if seen else before).append(prefix + name)
    if not seen:
        raise ValueError(f"{type(module).__name__} has no submodule {path[0]!r}; pass blocks= as "
                         "the dotted path of the block list")
    return before, after


def _own_forward_stage(model: nn.Module, counts: list[int], stage_index: int,
                       blocks: str) -> nn.Module:
    first, last = stage_ends(model, blocks.split("."))
    stage = split_model(model, counts, stage_index, blocks=blocks, first=first, last=last,
                        skip_missing=True, probe=False)  # probed whole below
    params = inspect.signature(type(model).forward).parameters
    if "inputs_embeds" in params:  # stage(hidden) alone: the model's forward gets its shapes
        run_own_forward(stage, blocks, is_first=stage_index == 0,
                        is_last=stage_index == len(counts) - 1, hidden_as="inputs_embeds",
                        inputs=("input_ids",))
    stage.reset_buffers = functools.partial(_reset_buffers, stage, weakref.ref(model))
    stage.reset_rotary_embedding = lambda device=None: stage.reset_buffers()  # the old name
    return stage


def _reset_buffers(stage: nn.Module, model_ref: weakref.ref) -> list[str]:
    """Recompute every non-persistent buffer of ``stage`` (rotary ``inv_freq``, Gemma's
    ``embed_scale``, ...) with the model's own initializer: :func:`titanext.hf.buffers.
    restore_buffers`."""
    model = model_ref()
    if model is None:
        raise ValueError("reset_buffers() recomputes the stage's non-persistent buffers with the "
                         "model it was cut from (its _init_weights); keep that model (on meta "
                         "it costs nothing) until the stage's buffers are reset")
    return restore_buffers(stage, model)


def _fresh_rotary(module: nn.Module, config, device: torch.device | str) -> nn.Module:
    """A new rotary module of ``module``'s class built on ``device`` (some take ``device=``,
    some build on the default device)."""
    with torch.device(device):
        return type(module)(config=config)


class HFExpertParallel(ExpertParallelExperts):
    """A ``transformers`` experts module with its experts split over a 1D ``ep_mesh``: titanext's
    :class:`~titanext.plugins.expert_parallel.ExpertParallelExperts` with the library's fused
    layout (``gate_up_proj`` [E, 2I, H], ``down_proj`` [E, H, I], or [E, in, out] with
    ``is_transposed``; its ``act_fn``), keeping the parameter names and the library's call
    ``forward(tokens [T, H], top_k_index [T, k], top_k_weights [T, k])``."""

    def __init__(self, experts: nn.Module, ep_mesh):
        layout = detect_experts_layout("experts", experts)
        if not isinstance(layout, StackedExperts) or layout.gate != "gate_up_proj":
            raise ValueError(f"{type(experts).__name__} has no 3-D gate_up_proj / down_proj "
                             "expert weights")
        super().__init__(experts, layout, ep_mesh)


def _is_hf_experts(fqn: str, m: nn.Module) -> bool:
    return all(hasattr(m, a) for a in ("gate_up_proj", "down_proj", "act_fn", "num_experts"))


def apply_hf_expert_parallel(model: nn.Module, ep_mesh) -> list[str]:
    """Replace every experts module of a ``transformers`` MoE model (a module with
    ``gate_up_proj``, ``down_proj``, ``act_fn`` and ``num_experts``, as Qwen3-MoE and Mixtral
    have) by :class:`HFExpertParallel` over the 1D ``ep_mesh``; returns their FQNs.

    Each ep rank feeds its own tokens (data parallel over the ep ranks); dense parameters stay
    replicated, so reduce their gradients over the ep ranks as data parallelism does (FSDP over
    the same ranks, or an all-reduce), while each expert's gradient is already complete on the
    rank that holds it. Tested in tests/multiprocess/test_adapters_hf.py against the unsplit model.

    >>> apply_hf_expert_parallel(model, mesh["ep"])  # in a process group  # doctest: +SKIP
    ['model.layers.0.mlp.experts', 'model.layers.1.mlp.experts']
    """
    found = [(fqn, m) for fqn, m in model.named_modules() if _is_hf_experts(fqn, m)]
    if not found:
        raise ValueError(f"{type(model).__name__} has no experts module with gate_up_proj / "
                         "down_proj; expert parallelism needs an MoE model")
    problems = [p for fqn, m in found if (p := _hf_experts_problem(fqn, m))]
    if problems:
        raise ValueError("apply_hf_expert_parallel: " + "; ".join(problems) + " (nothing was "
                         "changed)")
    return apply_expert_parallel(model, ep_mesh, filter_fn=_is_hf_experts)


def _positional(fn) -> list[str]:
    """The positional parameters of ``fn`` without a default (``self`` left out)."""
    return [p.name for p in inspect.signature(fn).parameters.values() if p.name != "self"
            and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) and p.default is p.empty]


def _hf_experts_problem(fqn: str, m: nn.Module) -> str | None:
    """Why :class:`HFExpertParallel` cannot stand in for ``m``, or None: it is called as
    transformers' MoE blocks call their experts, ``experts(tokens, top_k_index,
    top_k_weights)``, and applies ``act_fn(gate) * up``, so it checks both on the model."""
    call = _positional(type(m).forward)
    if len(call) != 3:
        return (f"{fqn} ({type(m).__name__}) is called as forward({', '.join(call)}), not as "
                "experts(hidden_states, top_k_index, top_k_weights), the call EP replaces")
    act = m.act_fn
    act_in = _positional(type(act).forward if isinstance(act, nn.Module) else act)
    if len(act_in) != 1:
        return (f"{fqn}.act_fn ({type(act).__name__}) takes {len(act_in)} inputs "
                f"({', '.join(act_in)}); EP's experts apply act_fn(gate) * up")
    return None
