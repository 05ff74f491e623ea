"""A Llama-3-style decoder: RMSNorm, RoPE with explicit position ids, GQA attention through
one swappable attention function, and a SwiGLU feed-forward.

It is built for the titanext flow: construct on the meta device, parallelize, then
``to_empty(device=...)`` and ``init_weights(seed)``. Layers live in a ``ModuleDict`` keyed by
their index, and ``tok_embeddings``, ``norm`` and ``output`` may be ``None`` so that a pipeline
stage keeps only its part.

>>> import torch
>>> from titanext.models import ModelArgs
>>> from titanext.models.llama import Transformer
>>> model = Transformer(ModelArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=258))
>>> model.init_weights(seed=0)
>>> model(torch.randint(0, 258, (2, 16))).shape
torch.Size([2, 16, 258])
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

from titanext.models.args import ModelArgs, YarnRopeScaling
from titanext.models.init import constant_, init_tensor_, normal_
from titanext.models.layers import FeedForward
from titanext.models.moe import MoE
from titanext.models.mtp import MultiTokenPrediction

# q: [batch, heads, seq, head_dim]; k, v: [batch, kv_heads, seq, head_dim]
# -> [batch, heads, seq, head_dim]
AttentionFn = Callable[..., torch.Tensor]


def sdpa_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool = True,
                   scale: float | None = None,
                   document_ids: torch.Tensor | None = None) -> torch.Tensor:
    """The default attention: ``F.scaled_dot_product_attention`` with GQA.

    ``document_ids`` ([batch, seq] integers) keep attention inside each packed document
    (causal within it): SDPA gets the boolean mask. A token always sees itself, so no row is
    fully masked.
    """
    if k.shape[1] != q.shape[1]:
        # Expanding here (rather than enable_gqa) keeps every SDPA backend and DTensor path usable.
        rep = q.shape[1] // k.shape[1]
        k = k.repeat_interleave(rep, dim=1)
        v = v.repeat_interleave(rep, dim=1)
    if document_ids is None:
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale)
    mask = document_ids[:, :, None] == document_ids[:, None, :]  # [batch, seq, seq]
    if causal:
        mask &= torch.ones(mask.shape[1:], dtype=torch.bool, device=mask.device).tril()
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask.unsqueeze(1), scale=scale)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in fp32 for stability, return in the input dtype.
        xf = x.float()
        out = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return out.type_as(x) * self.weight


def rope_cos_sin(
    position_ids: torch.Tensor, inv_freq: torch.Tensor, factor: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin of shape [batch or 1, seq, rope_dim // 2] for explicit positions, times
    ``factor`` (YaRN's :func:`rope_attention_factor`).

    Positions are explicit (not ``arange``) because context parallelism hands each rank a
    non-contiguous slice of the sequence.
    """
    if position_ids.dim() == 1:
        position_ids = position_ids.unsqueeze(0)
    angles = position_ids.to(torch.float32).unsqueeze(-1) * inv_freq.to(torch.float32)
    if factor == 1.0:
        return angles.cos(), angles.sin()
    return angles.cos() * factor, angles.sin() * factor


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
               layout: str = "interleaved") -> torch.Tensor:
    """Rotate feature pairs of ``x`` [batch, seq, heads, head_dim]: pairs (2i, 2i+1) for the
    ``"interleaved"`` layout (Meta's Llama), (i, i + head_dim/2) for ``"half"`` (HF's)."""
    xf = x.float()
    cos, sin = cos.unsqueeze(2), sin.unsqueeze(2)  # broadcast over heads
    if layout == "half":
        x0, x1 = xf.chunk(2, dim=-1)
        return torch.cat((x0 * cos - x1 * sin, x0 * sin + x1 * cos), dim=-1).type_as(x)
    xf = xf.unflatten(-1, (-1, 2))
    x0, x1 = xf[..., 0], xf[..., 1]
    out = torch.stack((x0 * cos - x1 * sin, x0 * sin + x1 * cos), dim=-1)
    return out.flatten(-2).type_as(x)


def rope_inv_freq(args: ModelArgs) -> torch.Tensor:
    """RoPE inverse frequencies [rope_dim // 2] (fp32), with Llama-3.1 or YaRN scaling if
    configured."""
    hd = args.rope_dim
    inv = 1.0 / (args.rope_theta ** (torch.arange(0, hd, 2, dtype=torch.float32) / hd))
    rs = args.rope_scaling
    if rs is None:
        return inv
    if isinstance(rs, YarnRopeScaling):
        return _yarn_inv_freq(inv, rs, args.rope_theta)
    low_wavelen = rs.original_max_seq_len / rs.low_freq_factor
    high_wavelen = rs.original_max_seq_len / rs.high_freq_factor
    wavelen = 2 * math.pi / inv
    smooth = ((rs.original_max_seq_len / wavelen - rs.low_freq_factor)
              / (rs.high_freq_factor - rs.low_freq_factor))
    interpolated = (1 - smooth) * inv / rs.factor + smooth * inv
    out = torch.where(wavelen > low_wavelen, inv / rs.factor, inv)
    between = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(between, interpolated, out)


def _yarn_inv_freq(inv: torch.Tensor, rs: YarnRopeScaling, theta: float) -> torch.Tensor:
    """YaRN: extrapolate the fast frequencies, interpolate the slow ones, ramp between (as HF's
    ``_compute_yarn_parameters`` and DeepSeek's ``precompute_freqs_cis``)."""
    dim = 2 * inv.numel()

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(rs.original_max_position_embeddings / (rotations * 2 * math.pi))
                / (2 * math.log(theta)))

    low, high = correction_dim(rs.beta_fast), correction_dim(rs.beta_slow)
    if rs.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    high = high + 0.001 if low == high else high  # no division by zero
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    return inv / rs.factor * ramp + inv * (1 - ramp)


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's attention temperature ``0.1 * mscale * ln(factor) + 1`` (1 for factor <= 1)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def rope_attention_factor(args: ModelArgs) -> float:
    """What YaRN multiplies cos and sin by (HF's ``attention_factor``); 1 without YaRN."""
    rs = args.rope_scaling
    if not isinstance(rs, YarnRopeScaling):
        return 1.0
    if rs.mscale and rs.mscale_all_dim:
        return yarn_mscale(rs.factor, rs.mscale) / yarn_mscale(rs.factor, rs.mscale_all_dim)
    return yarn_mscale(rs.factor)


def mla_softmax_scale(args: ModelArgs) -> float:
    """MLA's softmax scale: ``head_dim ** -0.5``, times ``mscale(factor, mscale_all_dim) ** 2``
    under YaRN with ``mscale_all_dim`` set (DeepSeek's longer-context temperature)."""
    scale = args.head_dim ** -0.5
    rs = args.rope_scaling
    if isinstance(rs, YarnRopeScaling) and rs.mscale_all_dim:
        scale *= yarn_mscale(rs.factor, rs.mscale_all_dim) ** 2
    return scale


class Attention(nn.Module):
    """GQA self-attention. ``attn_fn`` is the one seam plugins (CP) replace."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.head_dim = args.head_dim
        self.wq = nn.Linear(args.dim, args.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(args.dim, args.kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(args.dim, args.kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(args.n_heads * self.head_dim, args.dim, bias=False)
        self.attn_fn: AttentionFn = sdpa_attention
        self.rope_layout = args.rope_layout
        if args.qk_norm:  # per-head RMSNorm of q and k (Qwen3); weights shared by all heads
            self.q_norm = RMSNorm(self.head_dim, args.norm_eps)
            self.k_norm = RMSNorm(self.head_dim, args.norm_eps)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                document_ids: torch.Tensor | None = None) -> torch.Tensor:
        bsz, seqlen, _ = x.shape
        # -1 heads: under TP each rank holds n_heads / tp of them.
        q = self.wq(x).view(bsz, seqlen, -1, self.head_dim)
        k = self.wk(x).view(bsz, seqlen, -1, self.head_dim)
        v = self.wv(x).view(bsz, seqlen, -1, self.head_dim)
        if hasattr(self, "q_norm"):
            q, k = self.q_norm(q), self.k_norm(k)
        q = apply_rope(q, cos, sin, self.rope_layout)
        k = apply_rope(k, cos, sin, self.rope_layout)
        # document_ids only when given: an attn_fn without document masking keeps working
        docs = {} if document_ids is None else {"document_ids": document_ids}
        out = self.attn_fn(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), causal=True,
                           **docs)
        return self.wo(out.transpose(1, 2).reshape(bsz, seqlen, -1))


class MLAttention(nn.Module):
    """DeepSeek-V2/V3 multi-head latent attention.

    Queries come from ``wq`` or, with ``q_lora_rank > 0``, from ``wq_b(q_norm(wq_a(x)))``;
    keys and values from the latent ``kv_norm(c)`` of ``[c | k_rope] = wkv_a(x)`` through
    ``wkv_b``. Each head's q and k are ``[nope | rope]`` (``qk_nope_head_dim`` +
    ``qk_rope_head_dim`` features); RoPE rotates only the rope part, and the key's rope part
    ``k_rope`` is one for all heads. Values have ``v_head_dim`` features. ``attn_fn`` (the CP
    seam) gets q, k [B, H, S, qk] and v [B, H, S, v_head_dim] with an explicit ``scale``.
    Under TP the heads split (``wq``/``wq_b``, ``wkv_b`` column-wise, ``wo`` row-wise); the
    latents are replicated (see :func:`titanext.plugins.tensor_parallel.llama_tp_plan`).
    """

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.nope, self.rope = args.qk_nope_head_dim, args.qk_rope_head_dim
        self.v_head_dim, self.kv_lora_rank = args.v_head_dim, args.kv_lora_rank
        qk = args.n_heads * (self.nope + self.rope)
        if args.q_lora_rank == 0:
            self.wq = nn.Linear(args.dim, qk, bias=False)
        else:
            self.wq_a = nn.Linear(args.dim, args.q_lora_rank, bias=False)
            self.q_norm = RMSNorm(args.q_lora_rank, args.norm_eps)
            self.wq_b = nn.Linear(args.q_lora_rank, qk, bias=False)
        self.wkv_a = nn.Linear(args.dim, args.kv_lora_rank + self.rope, bias=False)
        self.kv_norm = RMSNorm(args.kv_lora_rank, args.norm_eps)
        self.wkv_b = nn.Linear(args.kv_lora_rank, args.n_heads * (self.nope + self.v_head_dim),
                               bias=False)
        self.wo = nn.Linear(args.n_heads * self.v_head_dim, args.dim, bias=False)
        self.attn_fn: AttentionFn = sdpa_attention
        self.rope_layout = args.rope_layout
        self.softmax_scale = mla_softmax_scale(args)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                document_ids: torch.Tensor | None = None) -> torch.Tensor:
        bsz, seqlen, _ = x.shape
        q = (self._rope_q(self.wq(x), cos, sin) if hasattr(self, "wq")
             else self.q_up(self.wq_a(x), cos, sin))
        kv = self.kv_up(self.wkv_a(x), cos, sin)  # [B, S, H, qk + v]: k then v
        k, v = kv.split([self.nope + self.rope, self.v_head_dim], dim=-1)
        docs = {} if document_ids is None else {"document_ids": document_ids}
        out = self.attn_fn(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), causal=True,
                           scale=self.softmax_scale, **docs)
        return self.wo(out.transpose(1, 2).reshape(bsz, seqlen, -1))

    # The up-projections with their norms, through RoPE: the seams recompute by module wraps
    # (recompute_modules = ["mla_up_proj"] keeps their inputs, the low-rank latents, and
    # recomputes q, k and v, which the attention core would otherwise keep).
    def q_up(self, q_latent: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """q [B, S, H, qk] from the query latent ``wq_a(x)``: wq_b(q_norm(.)), RoPE."""
        return self._rope_q(self.wq_b(self.q_norm(q_latent)), cos, sin)

    def kv_up(self, kv_a: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """[k | v] [B, S, H, qk + v] from ``wkv_a(x)`` = [latent | k_rope]: wkv_b(kv_norm(latent))
        gives each head's k_nope and v; RoPE rotates the one k_rope all heads share."""
        bsz, seqlen, _ = kv_a.shape
        latent, k_rope = kv_a.split([self.kv_lora_rank, self.rope], dim=-1)
        k_rope = apply_rope(k_rope.unsqueeze(2), cos, sin, self.rope_layout)
        kv = self.wkv_b(self.kv_norm(latent)).view(bsz, seqlen, -1, self.nope + self.v_head_dim)
        k_nope, v = kv.split([self.nope, self.v_head_dim], dim=-1)
        return torch.cat([k_nope, k_rope.expand(-1, -1, k_nope.shape[2], -1), v], dim=-1)

    def _rope_q(self, q: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        bsz, seqlen, _ = q.shape
        q_nope, q_rope = q.view(bsz, seqlen, -1, self.nope + self.rope).split(
            [self.nope, self.rope], dim=-1)
        return torch.cat([q_nope, apply_rope(q_rope, cos, sin, self.rope_layout)], dim=-1)


class TransformerBlock(nn.Module):
    """Attention + FFN block; a MoE block (``args.is_moe_layer``) has ``moe`` instead of
    ``feed_forward``."""

    def __init__(self, layer_id: int, args: ModelArgs):
        super().__init__()
        self.layer_id = layer_id
        self.attention_norm = RMSNorm(args.dim, args.norm_eps)
        self.attention = MLAttention(args) if args.mla else Attention(args)
        self.ffn_norm = RMSNorm(args.dim, args.norm_eps)
        if args.is_moe_layer(layer_id):
            self.moe = MoE(args.dim, args.moe)
        else:
            self.feed_forward = FeedForward(args.dim, args.ffn_hidden_dim)
        # Depth-scaled init of the output projections (as in torchtitan / GPT-2).
        self.out_init_std = 0.02 / math.sqrt(2 * (layer_id + 1))

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                document_ids: torch.Tensor | None = None) -> torch.Tensor:
        # document_ids by keyword: TP's PrepareModuleInput describes the positional (x, cos, sin)
        h = x + self.attention(self.attention_norm(x), cos, sin, document_ids=document_ids)
        ffn = self.moe if hasattr(self, "moe") else self.feed_forward
        return h + ffn(self.ffn_norm(h))

    def init_weights(self, prefix: str, seed: int) -> None:
        if hasattr(self, "moe"):
            self.moe.init_weights(seed, f"{prefix}moe.", init_std=0.02,
                                  out_init_std=self.out_init_std)
        for name, p in self.named_parameters():
            if name.startswith("moe."):
                continue
            if name.endswith("norm.weight"):
                fill = constant_(1.0)
            elif name.endswith(("wo.weight", "w2.weight", "w3.weight")):
                fill = normal_(self.out_init_std, truncate=2.0)
            else:
                fill = normal_(0.02, truncate=2.0)
            init_tensor_(p, f"{prefix}{name}", seed, fill)


class Transformer(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.tok_embeddings: nn.Embedding | None = nn.Embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleDict(
            {str(i): TransformerBlock(i, args) for i in range(args.n_layers)}
        )
        self.norm: RMSNorm | None = RMSNorm(args.dim, args.norm_eps)
        self.output: nn.Linear | None = nn.Linear(args.dim, args.vocab_size, bias=False)
        # DeepSeek-V3's multi-token prediction (titanext.models.mtp): after the head, on the
        # last pipeline stage, which then also holds a copy of tok_embeddings
        self.mtp: MultiTokenPrediction | None = None
        if args.num_mtp_layers:
            self.mtp = MultiTokenPrediction(
                args.dim, args.n_layers, args.num_mtp_layers,
                make_block=lambda i: TransformerBlock(i, args),
                make_norm=lambda: RMSNorm(args.dim, args.norm_eps))
        self.register_buffer("inv_freq", torch.empty(args.rope_dim // 2), persistent=False)
        self.tie_weights()
        if self.inv_freq.device.type != "meta":
            self.init_buffers()

    def tie_weights(self) -> None:
        """With ``args.tie_embeddings``, make ``output.weight`` the embedding's parameter again
        (``to_empty`` replaces parameters one module at a time, which unties them). A no-op for
        untied models and for pipeline stages that hold only one of the two."""
        if (self.args.tie_embeddings and self.tok_embeddings is not None
                and self.output is not None
                and self.output.weight is not self.tok_embeddings.weight):
            if isinstance(self.output.weight, DTensor):
                # TP gave each its own sharded parameter; tying them again would bypass the
                # plugins' bookkeeping (the config rejects tied embeddings under TP and PP).
                raise ValueError("tied embeddings were untied by parallelization (tensor "
                                 "parallelism); use untied embeddings with TP")
            self.output.weight = self.tok_embeddings.weight

    def init_buffers(self) -> None:
        with torch.no_grad():
            self.inv_freq.copy_(rope_inv_freq(self.args).to(self.inv_freq.device))

    @torch.no_grad()
    def init_weights(self, seed: int = 0) -> None:
        """Initialise buffers and parameters; identical values under any FSDP/TP layout."""
        self.tie_weights()
        self.init_buffers()
        if self.tok_embeddings is not None:
            init_tensor_(self.tok_embeddings.weight, "tok_embeddings.weight", seed, normal_(1.0))
        for key, layer in self.layers.items():
            layer.init_weights(f"layers.{key}.", seed)
        if self.norm is not None:
            init_tensor_(self.norm.weight, "norm.weight", seed, constant_(1.0))
        if self.output is not None and not self.args.tie_embeddings:
            std = self.args.dim**-0.5
            init_tensor_(self.output.weight, "output.weight", seed, normal_(std, truncate=3.0))
        if self.mtp is not None:
            self.mtp.init_weights("mtp.", seed)

    def forward(self, tokens: torch.Tensor, position_ids: torch.Tensor | None = None,
                document_ids: torch.Tensor | None = None,
                mtp_labels: torch.Tensor | None = None) -> torch.Tensor:
        """tokens: [batch, seq] ids (or [batch, seq, dim] hidden states on a later pipeline stage).

        ``position_ids`` ([seq] or [batch, seq]) feed RoPE; ``document_ids`` ([batch, seq]
        integers) restrict attention to tokens of the same packed document (pass positions that
        restart at each document with them, e.g. ``titanext.models.layers.document_positions``).
        ``mtp_labels`` (:func:`titanext.models.mtp.mtp_labels`) make the MTP modules, if any,
        compute their loss (its gradient flows back through the returned logits).
        Returns logits [batch, seq, vocab] (or hidden states if this part has no output head).
        """
        h, cos, sin = self._trunk(tokens, position_ids, document_ids)
        if self.output is None:
            return h
        logits = self.output(h)
        if self.mtp is not None and mtp_labels is not None:
            logits = self.mtp(logits, h, mtp_labels, self.tok_embeddings, self.output, cos, sin,
                              document_ids)
        return logits

    def _trunk(self, tokens: torch.Tensor, position_ids: torch.Tensor | None,
               document_ids: torch.Tensor | None):
        """(hidden state after the blocks and the final norm if held, cos, sin)."""
        if position_ids is None:
            # From the input, not from h: under sequence parallelism h holds a slice.
            position_ids = torch.arange(tokens.shape[1], device=tokens.device)
        # a later pipeline stage receives hidden states (the last one may hold the embedding:
        # MTP's copy)
        embed = self.tok_embeddings is not None and not tokens.is_floating_point()
        h = self.tok_embeddings(tokens) if embed else tokens
        cos, sin = rope_cos_sin(position_ids, self.inv_freq, rope_attention_factor(self.args))
        docs = {} if document_ids is None else {"document_ids": document_ids}
        for layer in self.layers.values():
            h = layer(h, cos, sin, **docs)
        if self.norm is not None:
            h = self.norm(h)
        return h, cos, sin

    def mtp_logits(self, tokens: torch.Tensor, mtp_tokens: torch.Tensor,
                   position_ids: torch.Tensor | None = None,
                   document_ids: torch.Tensor | None = None) -> list[torch.Tensor]:
        """The MTP modules' logits (one [batch, seq, vocab] per module) for ``tokens``;
        ``mtp_tokens`` [batch, seq, >= D]: module k embeds column k - 1 (the labels, then the
        labels shifted left by 1, ...; :func:`titanext.models.mtp.mtp_labels`). Whole model."""
        if self.mtp is None:
            raise ValueError("this model has no MTP modules (num_mtp_layers = 0)")
        h, cos, sin = self._trunk(tokens, position_ids, document_ids)
        return self.mtp.logits(h, mtp_tokens, self.tok_embeddings, self.output, cos, sin,
                               document_ids)

    def num_params(self, exclude_embedding: bool = False) -> int:
        n = sum(p.numel() for p in self.parameters())  # a tied weight counts once
        if exclude_embedding and self.tok_embeddings is not None and not self.args.tie_embeddings:
            n -= self.tok_embeddings.weight.numel()
        return n

    def num_active_params(self, exclude_embedding: bool = False) -> int:
        """Parameters one token uses: all but the routed experts it is not sent to (each MoE
        block runs top_k of its num_experts routed experts; shared experts always run)."""
        n = self.num_params(exclude_embedding)
        for moe in self.modules():  # the blocks' and the MTP modules'
            if isinstance(moe, MoE):
                m = moe.args
                n -= (m.num_experts - m.top_k) * 3 * moe.dim * m.hidden_dim
        return n

    def num_flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs per token: 6 x active non-embedding params (see
        :meth:`num_active_params`; equal to all of them for a dense model) + attention scores
        (causal ignored)."""
        a = self.args
        return (6.0 * self.num_active_params(exclude_embedding=True)
                + 6.0 * (a.n_layers + a.num_mtp_layers) * a.n_heads
                * (a.head_dim + a.value_head_dim) * seq_len)
