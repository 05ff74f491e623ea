"""The model as the planner sees it: exact parameter counts by role, from the meta model.

The reference model is built on the meta device (no memory), so the counts are the real
model's, not a formula's; layer 0's linears carry their TP direction from the TP plan.

>>> from titanext.config import load_config
>>> shape = model_shape(load_config(None, ["--model.flavor=debugtiny"]))
>>> shape.n_layers, shape.total > 0
(2, True)
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import TYPE_CHECKING

from titanext.config import JobConfig, model_args
from titanext.planning.moe import MoEShape, moe_shape
from titanext.planning.roofline import Linear

if TYPE_CHECKING:
    from titanext.models import ModelArgs

__all__ = ["ModelShape", "float8_flags", "model_shape"]


@dataclass
class ModelShape:
    """Exact parameter counts of the model built on the meta device, by role."""

    dim: int
    n_layers: int
    n_heads: int
    kv_dim: int
    ffn: int
    vocab: int
    layer_sharded: int  # per layer: split by TP (attention and FFN matmuls)
    layer_replicated: int  # per layer: norms
    embedding: int
    output: int
    final_norm: int
    flops_per_token: float
    layer_tensors: int  # parameter tensors per layer (Adam keeps a step scalar for each)
    linears: tuple[Linear, ...] = ()  # one layer's matmuls (TP direction from the TP plan)
    moe: MoEShape | None = None  # the MoE blocks (the fields above describe the dense ones)
    #: features per token that attention's matmuls keep from I to W under a split backward
    #: (inputs and output gradients): (not split by tp, split by tp); 0s: GQA's 2 h, 2 h + 2 h_kv
    attn_wgrad: tuple[int, int] = (0, 0)
    #: multi-head latent attention: (q_lora_rank, kv_lora_rank, a head's non-rotary and rotary
    #: q/k features, its v features); 0s: not MLA
    mla: tuple[int, int, int, int, int] = (0, 0, 0, 0, 0)
    #: multi-token prediction: modules after the head (each one block), whether that block is
    #: a MoE block, and each module's parameters outside its block: the norms (enorm, hnorm,
    #: norm; replicated over tp) and eh_proj (column-wise over tp)
    mtp_layers: int = 0
    mtp_moe: bool = False
    mtp_extra: int = 0
    mtp_eh_proj: int = 0

    @property
    def n_moe_layers(self) -> int:
        return len(self.moe.layer_ids) if self.moe else 0

    @property
    def total(self) -> int:
        moe = self.n_moe_layers * (self.moe.sharded + self.moe.replicated + self.moe.experts
                                   ) if self.moe else 0
        return ((self.n_layers - self.n_moe_layers) * (self.layer_sharded + self.layer_replicated)
                + moe + self.embedding + self.output + self.final_norm)


def model_shape(cfg: JobConfig, args: ModelArgs | None = None) -> ModelShape:
    """The shape of the model ``cfg`` trains: ``args``, or :func:`titanext.config.model_args`,
    the one the trainer builds (``[model] num_mtp_layers`` and the ``[moe]`` overrides
    applied; a :class:`~titanext.config.JobLayout` holds it)."""
    return _model_shape(cfg.model.name, args or model_args(cfg), cfg.training.seq_len)


@functools.lru_cache(maxsize=8)
def _meta_model(name: str, args: ModelArgs):
    """Model ``name`` with ``args`` on the meta device."""
    # the planner loads without torch and the training runtime until it needs them
    from titanext.models import build_model

    return build_model(name, args, device="meta")


def _linears(layer) -> tuple[Linear, ...]:
    """A layer's nn.Linear modules; rowwise where the llama TP plan splits their input."""
    # the planner loads without torch and the training runtime until it needs them
    from torch import nn
    from torch.distributed.tensor.parallel import RowwiseParallel

    # the planner loads without torch and the training runtime until it needs them
    from titanext.plugins.tensor_parallel import llama_tp_plan

    plan = llama_tp_plan(layers_prefix="layer")
    return tuple(Linear(fqn, m.in_features, m.out_features,
                        rowwise=isinstance(plan.get(f"layer.{fqn}"), RowwiseParallel))
                 for fqn, m in layer.named_modules() if isinstance(m, nn.Linear))


@functools.lru_cache(maxsize=64)
def float8_flags(name: str, args: ModelArgs, recipe: str, filter_fqns: tuple[str, ...],
                 auto_filter: bool, force_fqns: tuple[str, ...] = ()
                 ) -> tuple[tuple[bool, ...], bool, tuple[tuple[str, bool], ...]]:
    """Which linears the float8 converter swaps: the first dense block's (in the order of
    ``ModelShape.linears``), the output head, and the first MoE block's by name (attention,
    router, shared experts: ``MoEShape.linears``' names; empty for a dense model)."""
    # the planner loads without torch and the training runtime until it needs them
    from torch import nn

    # the planner loads without torch and the training runtime until it needs them
    from titanext.plugins.float8 import float8_module_filter

    keep = float8_module_filter(recipe=recipe, filter_fqns=filter_fqns, auto_filter=auto_filter,
                                force_fqns=force_fqns)
    model = _meta_model(name, args)

    def flags(kind) -> tuple[tuple[str, bool], ...]:
        i, block = next(((i, b) for i, b in model.layers.items() if kind(b)), (None, None))
        return () if block is None else tuple(
            (fqn, keep(m, f"layers.{i}.{fqn}")) for fqn, m in block.named_modules()
            if isinstance(m, nn.Linear))

    dense = flags(lambda b: not hasattr(b, "moe")) or flags(lambda b: True)
    return (tuple(f for _, f in dense), keep(model.output, "output"),
            flags(lambda b: hasattr(b, "moe")))


@functools.lru_cache(maxsize=16)
def _model_shape(name: str, args: ModelArgs, seq_len: int) -> ModelShape:
    model = _meta_model(name, args)
    # a dense block describes the dense fields (a MoE-only model has none, they count 0 times)
    layer = next((blk for blk in model.layers.values() if not hasattr(blk, "moe")),
                 model.layers["0"])
    norms = sum(p.numel() for n, p in layer.named_parameters() if "norm" in n)
    linears = _linears(layer)
    return ModelShape(
        dim=args.dim, n_layers=args.n_layers, n_heads=args.n_heads,
        kv_dim=args.kv_heads * args.head_dim, ffn=args.ffn_hidden_dim, vocab=args.vocab_size,
        layer_sharded=sum(p.numel() for p in layer.parameters()) - norms, layer_replicated=norms,
        embedding=model.tok_embeddings.weight.numel(), output=model.output.weight.numel(),
        final_norm=model.norm.weight.numel(),
        flops_per_token=model.num_flops_per_token(seq_len),
        layer_tensors=len(list(layer.parameters())), linears=linears,
        moe=moe_shape(model, linears), attn_wgrad=_mla_wgrad(args) if args.mla else (0, 0),
        mla=((args.q_lora_rank, args.kv_lora_rank, args.qk_nope_head_dim, args.qk_rope_head_dim,
              args.v_head_dim) if args.mla else (0, 0, 0, 0, 0)),
        **_mtp_fields(model))


def _mtp_fields(model) -> dict:
    """The MTP modules' fields of :class:`ModelShape` (none without MTP)."""
    mtp = getattr(model, "mtp", None)
    if mtp is None:
        return {}
    first = next(iter(mtp.layers.values()))
    extra = sum(p.numel() for n, p in first.named_parameters()
                if not n.startswith(("block.", "eh_proj.")))
    return {"mtp_layers": len(mtp.layers), "mtp_moe": hasattr(first.block, "moe"),
            "mtp_extra": extra, "mtp_eh_proj": first.eh_proj.weight.numel()}


def _mla_wgrad(args) -> tuple[int, int]:
    """MLA's weight-gradient inputs per token: (replicated over tp, split by tp). Inputs: the
    normed x (shared by wq_a / wkv_a), the normed latents (wq_b's, wkv_b's) and the attention
    output (wo's); output gradients: the latents' (wq_a, wkv_a with the rotary key), the
    heads' q and k|v (wq_b or wq, wkv_b) and wo's."""
    h, n, q, kv = args.dim, args.n_heads, args.q_lora_rank, args.kv_lora_rank
    whole = h + 2 * q + kv + (kv + args.qk_rope_head_dim) + h
    split = n * args.head_dim + n * (args.qk_nope_head_dim + args.v_head_dim) + n * args.v_head_dim
    return whole, split
