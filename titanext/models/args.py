"""Model hyper-parameters and the named flavors of the reference decoder."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ModelArgs:
    """Shapes of a Llama-3-style decoder.

    ``ffn_hidden_dim`` follows Llama 3: 2/3 of 4*dim, scaled by ``ffn_dim_multiplier`` and
    rounded up to ``multiple_of``.
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

    @property
    def kv_heads(self) -> int:
        return self.n_kv_heads or self.n_heads

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    @property
    def ffn_hidden_dim(self) -> int:
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
