"""Model hyper-parameters and the named flavors of the reference decoder.

Plain frozen dataclasses with no torch import, so the config can check a flavor's shapes
without building anything.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

__all__ = ["LLAMA3_FLAVORS", "MOE_FLAVORS", "ModelArgs", "MoEArgs"]


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

    ``num_mtp_layers`` > 0 adds DeepSeek-V3's multi-token prediction modules after the last
    block (:mod:`titanext.models.mtp`); module k predicts the token k + 1 positions further.
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
    rope_scaling: RopeScaling | None = None
    attn_head_dim: int | None = None  # per-head size when it is not dim // n_heads (Qwen3)
    qk_norm: bool = False  # RMSNorm over each head of q and k before RoPE (Qwen3)
    num_mtp_layers: int = 0  # multi-token prediction modules after the last block (DeepSeek-V3)

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
        return self.attn_head_dim or self.dim // self.n_heads

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

# MoE flavors. Attention is our GQA attention (titanext has no multi-head latent attention, MLA),
# so the DeepSeek-V3-like shapes match the published FFN/MoE shapes (dims, experts, top_k, shared
# experts, first-k-dense layers, routing) but not DeepSeek's attention parameters.
MOE_FLAVORS: dict[str, ModelArgs] = {
    # ~0.3M parameters, CPU: 3 blocks (block 0 dense, then MoE), 8 experts (top-2, sigmoid
    # scores with DeepSeek-V3-style group-limited routing over 4 groups), 1 shared expert.
    "debugmoe": ModelArgs(
        dim=64, n_layers=3, n_heads=8, n_kv_heads=4, vocab_size=264, multiple_of=32,
        n_dense_layers=1,
        moe=MoEArgs(num_experts=8, top_k=2, hidden_dim=32, num_shared_experts=1,
                    score_func="sigmoid", route_norm=True, num_expert_groups=4,
                    num_limited_groups=2, load_balance_coeff=1e-3)),
    # DeepSeek-V2-Lite / DeepSeek-MoE-16B shapes (~16B total, ~2.5B active): 27 blocks, first
    # dense (FFN hidden 10944), 64 routed experts (hidden 1408) top-6 softmax, 2 shared.
    "deepseek_v3_16b": ModelArgs(
        dim=2048, n_layers=27, n_heads=16, n_kv_heads=8, vocab_size=102400, multiple_of=64,
        ffn_dim_multiplier=2.004, max_seq_len=4096, n_dense_layers=1,
        moe=MoEArgs(num_experts=64, top_k=6, hidden_dim=1408, num_shared_experts=2,
                    score_func="softmax", route_norm=False)),
    # DeepSeek-V3 671B shapes (~37B active): 61 blocks, first 3 dense (FFN hidden 18432), 256
    # routed experts (hidden 2048) top-8 sigmoid, route_norm, route_scale 2.5, 8 groups of which
    # 4 are kept, 1 shared expert, aux-loss-free balancing (rate 1e-3).
    "deepseek_v3_671b": ModelArgs(
        dim=7168, n_layers=61, n_heads=128, n_kv_heads=8, vocab_size=129280, multiple_of=1024,
        ffn_dim_multiplier=0.964, max_seq_len=4096, n_dense_layers=3,
        moe=MoEArgs(num_experts=256, top_k=8, hidden_dim=2048, num_shared_experts=1,
                    score_func="sigmoid", route_norm=True, route_scale=2.5, num_expert_groups=8,
                    num_limited_groups=4, load_balance_coeff=1e-3)),
}
