"""What a split backward keeps of one block from its input-gradient pass (I) to its
weight-gradient pass (W), per token.

titanext's deferred split (:mod:`titanext.plugins.weight_grad`) queues ``dW = dY^T X`` of every
converted linear and of the routed experts at I, keeping X and dY until W. A float8 linear
(torchao's ``Float8Linear``) keeps its own backward: its dW is computed at I, so it keeps nothing
to W; so do float8 experts on torchao's grouped GEMM kernels. A block's bytes are
:func:`weight_grad_inputs` (every linear deferred) less :func:`float8_not_kept` (what its float8
linears would have kept, where no deferred linear shares the tensor).

>>> from titanext.planning.roofline import Linear
>>> lins = [Linear("feed_forward.w1", 8, 32, float8=True), Linear("feed_forward.w3", 8, 32),
...         Linear("feed_forward.w2", 32, 8, rowwise=True, float8=True)]
>>> float8_not_kept(lins, a=2, tp=1, cp=1)   # w1's dY, w2's X and dY (w3 keeps the input)
144.0
"""

from __future__ import annotations

from titanext.planning.roofline import Linear

__all__ = ["float8_not_kept", "weight_grad_inputs"]

#: linears that read one tensor (their inputs are kept once), by FQN within a block
_SHARED_INPUT = {"attention.wq": "attention", "attention.wk": "attention",
                 "attention.wv": "attention", "attention.wq_a": "attention",
                 "attention.wkv_a": "attention", "feed_forward.w1": "feed_forward",
                 "feed_forward.w3": "feed_forward", "moe.router.gate": "moe",
                 "moe.shared_experts.w1": "moe", "moe.shared_experts.w3": "moe"}


def weight_grad_inputs(lo, ffn: float) -> float:
    """Bytes per token of one block that a split backward keeps from I to W when every matmul
    defers: its input and output gradient. Under TP with SP the inputs of the column-wise matmuls
    and the output gradients of the row-wise ones are the gathered sequence (4 h); the rest is
    split by tp: a (4 h + (2 h + 2 h_kv + 3 f) / tp). MLA's attention part is
    ``shape.attn_wgrad`` instead (latents and their gradients). ``lo``: a
    :class:`titanext.planning.layout.Layout`."""
    h, hkv, tp = lo.shape.dim, lo.shape.kv_dim, lo.tp
    whole, split = lo.shape.attn_wgrad if any(lo.shape.attn_wgrad) else (2 * h, 2 * h + 2 * hkv)
    return lo.a * (whole + 2 * h + (split + 3 * ffn) / tp) / lo.cp


def float8_not_kept(linears: list[Linear], *, a: int, tp: int, cp: int) -> float:
    """Bytes per token that ``linears`` (one block's, routed experts aside: the caller counts
    them, by ``Layout.experts_defer``)
    do not keep from I to W because their float8 ones compute dW at I: each one's output
    gradient, and its input unless a deferred linear reads the same tensor. Split by tp as in
    :func:`weight_grad_inputs` (a column-wise input and a row-wise output gradient are whole)."""
    def split(lin: Linear, rowwise: bool) -> int:
        return tp if lin.tp_split and rowwise else 1

    deferred_inputs = {_SHARED_INPUT.get(lin.name, lin.name) for lin in linears
                       if not lin.float8 and not lin.name.startswith("moe.experts.")}
    saved, inputs = 0.0, set()
    for lin in linears:
        if not lin.float8 or lin.name.startswith("moe.experts."):
            continue
        saved += lin.out_features / split(lin, not lin.rowwise)
        key = _SHARED_INPUT.get(lin.name, lin.name)
        if key not in deferred_inputs and key not in inputs:
            inputs.add(key)
            saved += lin.in_features / split(lin, lin.rowwise)
    return a * saved / cp
