"""Adapters that let titanext plugins run inside Hugging Face ``transformers`` models.

The plugins themselves know nothing about ``transformers``; everything model-library-specific
lives here: where the decoder blocks are, a TP plan for the Llama family's module names, and
the hook that routes the library's attention to ring attention. ``transformers`` is an optional
dependency (the ``dev`` extra); nothing else in titanext imports this module.

Covered (tested in tests/test_adapters_hf.py against the unparallelized model):

- FSDP2: ``apply_fsdp(model, mesh, blocks=hf_blocks(model))``.
- TP: ``apply_tensor_parallel(model, tp_mesh, plan=hf_llama_tp_plan())`` (Llama, Mistral,
  Qwen2 and other models with the same module names).
- CP: ``apply_hf_context_parallel(model, cp_mesh)`` registers a ``transformers`` attention
  function that calls :func:`titanext.plugins.context_parallel.ring_attention`; shard the
  batch with ``shard_batch`` and pass its ``position_ids`` to the model.
- float8: ``apply_float8(model, filter_fqns=["lm_head"])`` needs no adapter.

>>> from transformers import LlamaConfig, LlamaForCausalLM           # doctest: +SKIP
>>> model = LlamaForCausalLM(LlamaConfig(hidden_size=64, num_hidden_layers=2, ...))  # doctest: +SKIP
>>> apply_tensor_parallel(model, mesh["tp"], plan=hf_llama_tp_plan())  # doctest: +SKIP
"""

from __future__ import annotations

import itertools

from torch import nn
from torch.distributed.tensor import Replicate
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel

from titanext.plugins.context_parallel import RingAttentionFn, check_options

__all__ = ["hf_blocks", "hf_llama_tp_plan", "apply_hf_context_parallel"]

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
    row-parallel out); the embedding is split over the vocabulary and the LM head's logits are
    gathered, so ``transformers``' own loss sees full logits. The attention code reshapes with
    ``-1`` heads, so each rank runs its local heads unchanged. Needs heads, KV heads,
    intermediate size and vocabulary divisible by the TP degree.
    """
    return {
        "model.embed_tokens": RowwiseParallel(input_layouts=Replicate()),
        "model.layers.*.self_attn.q_proj": ColwiseParallel(),
        "model.layers.*.self_attn.k_proj": ColwiseParallel(),
        "model.layers.*.self_attn.v_proj": ColwiseParallel(),
        "model.layers.*.self_attn.o_proj": RowwiseParallel(),
        "model.layers.*.mlp.gate_proj": ColwiseParallel(),
        "model.layers.*.mlp.up_proj": ColwiseParallel(),
        "model.layers.*.mlp.down_proj": RowwiseParallel(),
        "lm_head": ColwiseParallel(output_layouts=Replicate()),
    }


def apply_hf_context_parallel(model: nn.Module, cp_mesh, *, layout: str = "zigzag",
                              comm: str = "p2p", kernel: str = "auto") -> str:
    """Make a ``transformers`` model's attention run as ring attention over ``cp_mesh``.

    Registers an attention function with ``transformers.AttentionInterface`` (the library's own
    hook for custom kernels) and switches ``model`` to it; returns the registered name. Inputs
    must be sharded with ``shard_batch(input_ids, labels, cp_mesh, layout=layout)`` and the
    returned ``position_ids`` passed as ``model(input_ids, position_ids=position_ids[None])``,
    so RoPE uses the global positions. Causal attention without padding only: an explicit
    padding mask cannot be split across ranks, so a non-causal mask raises.
    """
    from transformers import AttentionInterface

    check_options(layout, comm, kernel)
    ring = RingAttentionFn(cp_mesh, layout, comm, kernel)

    def attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
        # query [B, H, S, D], key/value [B, KVH, S, D] (un-expanded), as the ring wants them.
        if dropout:
            raise ValueError(f"context parallelism: attention dropout = {dropout} is not supported; "
                             "set the model's attention_dropout to 0")
        if attention_mask is not None and not getattr(module, "is_causal", True):
            raise ValueError("context parallelism supports causal attention without a padding "
                             "mask; got a non-causal attention mask")
        out = ring(query, key, value, causal=getattr(module, "is_causal", True), scale=scaling)
        return out.transpose(1, 2).contiguous(), None  # [B, S, H, D], no attention weights

    name = f"titanext_ring_{next(_ids)}"
    AttentionInterface.register(name, attention)
    model.set_attn_implementation(name)
    return name
