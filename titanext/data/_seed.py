"""Seeds for the data sources' random streams (torch-free, so config checks stay light)."""

from __future__ import annotations

__all__ = ["FILES", "SHUFFLE", "TABLE", "WINDOW", "mix_seed"]

# Domain tags for mix_seed, so the shuffles, the bigram table and the synthetic windows draw
# from unrelated streams even for equal (seed, index) pairs.
SHUFFLE, TABLE, WINDOW, FILES = 1, 2, 3, 4


def mix_seed(*values: int) -> int:
    """A 63-bit generator seed from several ints (splitmix64 folding).

    A linear formula like ``seed * K + epoch`` makes distinct pairs collide (seed 0, epoch K
    equals seed 1, epoch 0); hashing keeps every (seed, index) stream independent.
    """
    mask = (1 << 64) - 1
    h = 0x9E3779B97F4A7C15
    for v in values:
        h = (h ^ (v & mask)) & mask
        h = (h + 0x9E3779B97F4A7C15) & mask
        h = ((h ^ (h >> 30)) * 0xBF58476D1CE4E5B9) & mask
        h = ((h ^ (h >> 27)) * 0x94D049BB133111EB) & mask
        h ^= h >> 31
    return h >> 1  # torch.Generator.manual_seed takes any value, but stay clear of the sign bit
