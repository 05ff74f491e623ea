"""The Ultra-Scale Playbook's closed forms the planner is checked against
(:mod:`titanext.planning.memory` counts titanext's own tensors instead): model-state bytes per
rank under ZeRO, and Korthikanti et al.'s GPT layer activations.

>>> zero_bytes_per_rank(1e9, 8, 3) / 1e9       # ZeRO-3: 16 Psi / N
2.0
"""

from __future__ import annotations

__all__ = ["gpt_activation_bytes", "zero_bytes_per_rank"]


def zero_bytes_per_rank(psi: float, n: int, stage: int, *,
                        fp32_grad_accum: bool = False) -> float:
    """Model-state bytes per rank under ZeRO-``stage`` (0 = plain DP) with bf16 mixed precision."""
    params, grads, rest = 2 * psi, (6 if fp32_grad_accum else 2) * psi, 12 * psi
    if stage >= 1:
        rest /= n
    if stage >= 2:
        grads /= n
    if stage >= 3:
        params /= n
    return params + grads + rest


def gpt_activation_bytes(s: int, b: int, h: int, heads: int) -> float:
    """Korthikanti et al.'s GPT layer without recomputation: 34 s b h + 5 a s^2 b (16-bit)."""
    return 34 * s * b * h + 5 * heads * s * s * b
