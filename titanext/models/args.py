"""Model hyper-parameters and the named flavors of the reference decoder."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from titanext.models.moe import MoEArgs


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
    (:mod:`titanext.hf_checkpoint` applies it when a checkpoint changes convention).
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
