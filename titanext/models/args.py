"""Model hyper-parameters and the named flavors of the reference decoder.

Plain frozen dataclasses with no torch import, so the config can check a flavor's shapes
without building anything.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

__all__ = ["DEEPSEEK_FLAVORS", "LLAMA3_FLAVORS", "MOE_FLAVORS", "ModelArgs", "ModelArgsError",
           "MoEArgs", "RopeScaling", "YarnRopeScaling"]


@dataclass(frozen=True)
class MoEArgs:
    """Hyper-parameters of one MoE layer."""

    num_experts: int = 8
    top_k: int = 2
    hidden_dim: int = 256            # hidden size of each routed (and each shared) SwiGLU expert
    num_shared_experts: int = 0      # shared experts: one SwiGLU of num_shared_experts * hidden_dim
    score_func: Literal["softmax", "sigmoid"] = "softmax"
    route_norm: bool = False         # renormalise the top-k weights of a token to sum to 1
    route_scale: float = 1.0         # multiply the routed weights by this
    num_expert_groups: int = 1       # group-limited routing: experts split in this many groups
    num_limited_groups: int = 1      # ... and each token picks experts inside its best groups
    load_balance_coeff: float | None = 1e-3  # aux-loss-free bias rate; None or 0 = off
    aux_loss_alpha: float = 0.0      # sequence-wise auxiliary loss weight; 0 = off
    capacity_factor: float | None = None     # None = dropless
    use_grouped_mm: bool | Literal["auto"] = "auto"

    def __post_init__(self) -> None:
        problems = []
        if not 1 <= self.top_k <= self.num_experts:
            problems.append(f"top_k={self.top_k} must be in [1, num_experts={self.num_experts}]")
        if self.score_func not in ("softmax", "sigmoid"):
            problems.append(f"score_func={self.score_func!r}; allowed: 'softmax', 'sigmoid'")
        if self.num_expert_groups < 1 or self.num_experts % self.num_expert_groups:
            problems.append(f"num_experts={self.num_experts} must be divisible by "
                            f"num_expert_groups={self.num_expert_groups}")
        elif not 1 <= self.num_limited_groups <= self.num_expert_groups:
            problems.append(f"num_limited_groups={self.num_limited_groups} must be in "
                            f"[1, num_expert_groups={self.num_expert_groups}]")
        elif self.top_k > self.num_limited_groups * (self.num_experts // self.num_expert_groups):
            problems.append(f"top_k={self.top_k} exceeds the experts in the limited groups "
                            f"({self.num_limited_groups} x "
                            f"{self.num_experts // self.num_expert_groups})")
        if self.capacity_factor is not None and not self.capacity_factor > 0:
            problems.append(f"capacity_factor={self.capacity_factor} must be > 0 "
                            "(or None: dropless)")
        if self.use_grouped_mm not in (True, False, "auto"):
            problems.append(f"use_grouped_mm={self.use_grouped_mm!r}; allowed: 'auto', True, False")
        if problems:
            raise ValueError("MoEArgs: " + "; ".join(problems))



@dataclass(frozen=True)
class RopeScaling:
    """Llama-3.1-style RoPE frequency scaling (Hugging Face ``rope_type = "llama3"``).

    Wavelengths shorter than ``original_max_seq_len / high_freq_factor`` keep their frequency,
    those longer than ``original_max_seq_len / low_freq_factor`` are divided by ``factor``, and
    the band between is interpolated smoothly.
    """

    factor: float = 8.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_seq_len: int = 8192


@dataclass(frozen=True)
class YarnRopeScaling:
    """YaRN RoPE scaling as DeepSeek-V2/V3 use it (Hugging Face ``rope_type = "yarn"``; the
    field names are HF's ``rope_scaling`` keys).

    Frequencies whose wavelength fits ``original_max_position_embeddings`` more than
    ``beta_fast`` times keep their value, those fitting fewer than ``beta_slow`` times are
    divided by ``factor``, with a linear ramp between. cos/sin are multiplied by
    ``mscale(factor, mscale) / mscale(factor, mscale_all_dim)`` (``mscale(factor)`` when either
    is 0), where ``mscale(f, m) = 0.1 m ln f + 1``, and MLA's softmax scale by
    ``mscale(factor, mscale_all_dim) ** 2`` when ``mscale_all_dim`` is set: as HF's
    ``DeepseekV3Attention`` does.
    """

    factor: float = 40.0
    original_max_position_embeddings: int = 4096
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 1.0
    mscale_all_dim: float = 0.0
    truncate: bool = True  # floor/ceil the correction range (HF's default)


class ModelArgsError(ValueError):
    """Invalid :class:`ModelArgs`; ``problems`` holds one line per problem, each naming the
    field, the value given and what is allowed."""

    def __init__(self, problems: list[str]):
        super().__init__("ModelArgs: " + "; ".join(problems))
        self.problems = list(problems)


@dataclass(frozen=True)
class ModelArgs:
    """Shapes of a Llama-3-style decoder.

    ``ffn_hidden_dim`` follows Llama 3: 2/3 of 4*dim, scaled by ``ffn_dim_multiplier`` and
    rounded up to ``multiple_of``.

    With ``moe`` set, the blocks for which :meth:`is_moe_layer` holds get a ``moe``
    (:class:`titanext.models.moe.MoE`) instead of ``feed_forward``: the first
    ``n_dense_layers`` stay dense (DeepSeek's first-k-dense), then every
    ``moe_layer_interval``-th block is MoE.

    ``rope_layout`` says how RoPE pairs the features of a head: ``"interleaved"`` rotates
    (0, 1), (2, 3), ... (Meta's Llama checkpoints, titanext's named flavors); ``"half"`` rotates
    (i, i + head_dim/2) (Hugging Face's ``rotate_half``; the ``hf`` flavor). The two differ only
    by a fixed permutation of the rows of ``wq`` and ``wk`` inside each head
    (:mod:`titanext.hf.checkpoint` applies it when a checkpoint changes convention).

    ``kv_lora_rank > 0`` switches attention to DeepSeek's multi-head latent attention (MLA,
    :class:`titanext.models.llama.MLAttention`): keys and values come from a compressed
    latent of ``kv_lora_rank`` features, queries from one of ``q_lora_rank`` (0: a full-rank
    ``wq``), each head's q/k is ``qk_nope_head_dim`` features without RoPE plus
    ``qk_rope_head_dim`` with it (the rotated key shared by all heads), and its value has
    ``v_head_dim`` features. ``n_kv_heads`` and ``attn_head_dim`` do not apply then.
    Inconsistent values raise :class:`ModelArgsError`.
    """

    dim: int = 256
    n_layers: int = 6
    n_heads: int = 8
    n_kv_heads: int | None = None
    vocab_size: int = 512
    multiple_of: int = 256
    ffn_dim_multiplier: float | None = None
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    max_seq_len: int = 2048
    moe: MoEArgs | None = None
    n_dense_layers: int = 0
    moe_layer_interval: int = 1
    ffn_hidden_size: int | None = None  # explicit SwiGLU hidden size (HF intermediate_size)
    tie_embeddings: bool = False  # output.weight is tok_embeddings.weight
    rope_layout: Literal["interleaved", "half"] = "interleaved"
    rope_scaling: RopeScaling | YarnRopeScaling | None = None
    attn_head_dim: int | None = None  # per-head size when it is not dim // n_heads (Qwen3)
    qk_norm: bool = False  # RMSNorm over each head of q and k before RoPE (Qwen3)
    # Multi-head latent attention (DeepSeek-V2/V3); kv_lora_rank = 0 keeps GQA attention.
    q_lora_rank: int = 0  # rank of the query compression (0: full-rank wq)
    kv_lora_rank: int = 0  # rank of the key-value compression (0: MLA off)
    qk_nope_head_dim: int = 128  # per-head q/k features without RoPE
    qk_rope_head_dim: int = 64  # per-head q/k features with RoPE (the key's shared by all heads)
    v_head_dim: int = 128  # per-head value features

    def __post_init__(self) -> None:
        problems = self.problems()
        if problems:
            raise ModelArgsError(problems)

    def problems(self) -> list[str]:
        """What is inconsistent in these args (MLA and YaRN fields), one line per problem."""
        problems = []
        for key in ("kv_lora_rank", "q_lora_rank"):
            if getattr(self, key) < 0:
                problems.append(f"{key} = {getattr(self, key)} is negative; allowed: 0 (off) or a "
                                "positive rank")
        if self.q_lora_rank > 0 and self.kv_lora_rank == 0:
            problems.append(f"q_lora_rank = {self.q_lora_rank} needs multi-head latent attention; "
                            "allowed: kv_lora_rank > 0, or q_lora_rank = 0")
        if self.mla:
            problems += self._mla_problems()
        if isinstance(self.rope_scaling, YarnRopeScaling):
            rs = self.rope_scaling
            if not rs.factor > 0 or rs.original_max_position_embeddings < 1:
                problems.append(f"rope_scaling = {rs} needs factor > 0 and "
                                "original_max_position_embeddings >= 1")
        return problems

    def _mla_problems(self) -> list[str]:
        problems = [f"{key} = {getattr(self, key)} with MLA (kv_lora_rank = {self.kv_lora_rank});"
                    " allowed: a positive integer"
                    for key in ("qk_nope_head_dim", "v_head_dim") if getattr(self, key) < 1]
        if self.qk_rope_head_dim < 2 or self.qk_rope_head_dim % 2:
            problems.append(f"qk_rope_head_dim = {self.qk_rope_head_dim} with MLA; allowed: a "
                            "positive even integer (RoPE rotates pairs of features)")
        if self.n_kv_heads not in (None, self.n_heads):
            problems.append(f"n_kv_heads = {self.n_kv_heads} with MLA (every head has its own key "
                            f"and value); allowed: None or n_heads = {self.n_heads}")
        if self.attn_head_dim is not None:
            problems.append(f"attn_head_dim = {self.attn_head_dim} with MLA; allowed: None (MLA's "
                            "head sizes are qk_nope_head_dim + qk_rope_head_dim and v_head_dim)")
        if self.qk_norm:
            problems.append("qk_norm = True with MLA; allowed: False (MLA normalises its "
                            "latents with q_norm and kv_norm)")
        return problems

    @property
    def mla(self) -> bool:
        """Whether attention is multi-head latent attention (``kv_lora_rank > 0``)."""
        return self.kv_lora_rank > 0

    @property
    def rope_dim(self) -> int:
        """Features of a head that RoPE rotates."""
        return self.qk_rope_head_dim if self.mla else self.head_dim

    def is_moe_layer(self, layer_id: int) -> bool:
        """Whether block ``layer_id`` is a MoE block."""
        if self.moe is None or layer_id < self.n_dense_layers:
            return False
        return (layer_id - self.n_dense_layers) % self.moe_layer_interval == 0

    @property
    def num_moe_layers(self) -> int:
        return sum(self.is_moe_layer(i) for i in range(self.n_layers))

    @property
    def kv_heads(self) -> int:
        return self.n_kv_heads or self.n_heads

    @property
    def head_dim(self) -> int:
        """Per-head size of q and k (with MLA: qk_nope_head_dim + qk_rope_head_dim)."""
        if self.mla:
            return self.qk_nope_head_dim + self.qk_rope_head_dim
        return self.attn_head_dim or self.dim // self.n_heads

    @property
    def value_head_dim(self) -> int:
        """Per-head size of v (and of the attention output)."""
        return self.v_head_dim if self.mla else self.head_dim

    @property
    def ffn_hidden_dim(self) -> int:
        if self.ffn_hidden_size is not None:
            return self.ffn_hidden_size
        hidden = int(2 * 4 * self.dim / 3)
        if self.ffn_dim_multiplier is not None:
            hidden = int(self.ffn_dim_multiplier * hidden)
        return self.multiple_of * ((hidden + self.multiple_of - 1) // self.multiple_of)


_LLAMA3_BIG = dict(vocab_size=128256, rope_theta=500000.0, max_seq_len=131072, n_kv_heads=8)

LLAMA3_FLAVORS: dict[str, ModelArgs] = {
    # ~0.1M parameters: for tests and quick experiments (TP up to 4: 8 heads over 4 kv heads).
    "debugtiny": ModelArgs(dim=64, n_layers=2, n_heads=8, n_kv_heads=4, vocab_size=264,
                           multiple_of=32),
    # ~4.9M parameters: trains in seconds on CPU, GQA (8 heads over 4 kv heads) so TP=2/4 works.
    "debugmodel": ModelArgs(dim=256, n_layers=6, n_heads=8, n_kv_heads=4, vocab_size=512),
    "1B": ModelArgs(dim=2048, n_layers=16, n_heads=32, ffn_dim_multiplier=1.5, multiple_of=256,
                    **_LLAMA3_BIG),
    "8B": ModelArgs(dim=4096, n_layers=32, n_heads=32, ffn_dim_multiplier=1.3, multiple_of=1024,
                    **_LLAMA3_BIG),
    "70B": ModelArgs(dim=8192, n_layers=80, n_heads=64, ffn_dim_multiplier=1.3, multiple_of=4096,
                     **_LLAMA3_BIG),
    "405B": ModelArgs(dim=16384, n_layers=126, n_heads=128, ffn_dim_multiplier=1.2,
                      multiple_of=4096, **_LLAMA3_BIG),
}

# MoE flavors with titanext's GQA attention.
MOE_FLAVORS: dict[str, ModelArgs] = {
    # ~0.3M parameters, CPU: 3 blocks (block 0 dense, then MoE), 8 experts (top-2, sigmoid
    # scores with DeepSeek-V3-style group-limited routing over 4 groups), 1 shared expert.
    "debugmoe": ModelArgs(
        dim=64, n_layers=3, n_heads=8, n_kv_heads=4, vocab_size=264, multiple_of=32,
        n_dense_layers=1,
        moe=MoEArgs(num_experts=8, top_k=2, hidden_dim=32, num_shared_experts=1,
                    score_func="sigmoid", route_norm=True, num_expert_groups=4,
                    num_limited_groups=2, load_balance_coeff=1e-3)),
}

# DeepSeek's YaRN settings: a 4K pretraining context stretched 40x.
_YARN = dict(factor=40.0, original_max_position_embeddings=4096, beta_fast=32.0, beta_slow=1.0)

# DeepSeek-V3 architectures: multi-head latent attention, first-k-dense, sigmoid-scored experts
# with group-limited routing and aux-loss-free balancing (docs/deepseek_v3.md).
DEEPSEEK_FLAVORS: dict[str, ModelArgs] = {
    # ~0.3M parameters, CPU tests: MLA with a low-rank query, qk_nope_head_dim (16) !=
    # v_head_dim (12), YaRN with the softmax rescale; block 0 dense, then MoE as debugmoe.
    "debugdeepseek": ModelArgs(
        dim=64, n_layers=3, n_heads=4, vocab_size=264, multiple_of=32, norm_eps=1e-6,
        max_seq_len=1024, q_lora_rank=32, kv_lora_rank=16, qk_nope_head_dim=16,
        qk_rope_head_dim=8, v_head_dim=12, n_dense_layers=1,
        rope_scaling=YarnRopeScaling(factor=4.0, original_max_position_embeddings=256,
                                     mscale=1.0, mscale_all_dim=1.0),
        moe=MoEArgs(num_experts=8, top_k=2, hidden_dim=32, num_shared_experts=1,
                    score_func="sigmoid", route_norm=True, num_expert_groups=4,
                    num_limited_groups=2, load_balance_coeff=1e-3)),
    # DeepSeek-V2-Lite shapes (~15.7B total, ~2.4B active): 27 blocks, first dense (FFN 10944),
    # MLA (16 heads, kv_lora_rank 512, full-rank query), 64 routed experts (hidden 1408) top-6
    # and 2 shared, with DeepSeek-V3's routing (sigmoid, 8 groups of which 4 kept).
    "deepseek_v3_16b": ModelArgs(
        dim=2048, n_layers=27, n_heads=16, vocab_size=102400, ffn_hidden_size=10944,
        norm_eps=1e-6, max_seq_len=163840, n_dense_layers=1, q_lora_rank=0, kv_lora_rank=512,
        qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
        rope_scaling=YarnRopeScaling(**_YARN, mscale=0.707, mscale_all_dim=0.707),
        moe=MoEArgs(num_experts=64, top_k=6, hidden_dim=1408, num_shared_experts=2,
                    score_func="sigmoid", route_norm=True, num_expert_groups=8,
                    num_limited_groups=4, load_balance_coeff=1e-3)),
    # DeepSeek-V3 (671B total, ~37B active; the report's Table and its config.json): 61
    # blocks, first 3 dense (FFN 18432), MLA (128 heads, q_lora_rank 1536, kv_lora_rank 512,
    # qk 128 + 64, v 128), 256 routed experts (hidden 2048) top-8 sigmoid, route_norm,
    # route_scale 2.5, 8 groups of which 4 are kept, 1 shared expert, aux-loss-free balancing.
    "deepseek_v3_671b": ModelArgs(
        dim=7168, n_layers=61, n_heads=128, vocab_size=129280, ffn_hidden_size=18432,
        norm_eps=1e-6, max_seq_len=163840, n_dense_layers=3, q_lora_rank=1536,
        kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
        rope_scaling=YarnRopeScaling(**_YARN, mscale=1.0, mscale_all_dim=1.0),
        moe=MoEArgs(num_experts=256, top_k=8, hidden_dim=2048, num_shared_experts=1,
                    score_func="sigmoid", route_norm=True, route_scale=2.5, num_expert_groups=8,
                    num_limited_groups=4, load_balance_coeff=1e-3)),
}
