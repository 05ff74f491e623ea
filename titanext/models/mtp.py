"""Multi-token prediction (MTP), as DeepSeek-V3 trains it (report section 2.2).

``num_mtp_layers`` = D modules follow the last block. Module k (1..D) combines, at every
position i, the hidden state h^{k-1}_i (h^0: the main model's final-normed hidden state, the
one its output head reads) with the embedding of token t_{i+k}:

    h'_i = eh_proj([enorm(Emb(t_{i+k})); hnorm(h^{k-1}_i)])
    h^k  = norm(Block_k(h'))                     (causal attention over the sequence, as usual)
    P^k  = OutHead(h^k)                          (predicts t_{i+k+1})

The embedding and the output head are the main model's (shared). This is the layout of
DeepSeek-V3's checkpoints (``model.layers.{num_hidden_layers + k - 1}.{enorm, hnorm, eh_proj,
shared_head.norm}``) and of ``transformers``' ``MtpModel``; :mod:`titanext.hf.checkpoint`
maps them.

The loss: with N the main loss's token count and CE_k the summed cross-entropy of module k,
``loss = L_main + mtp_loss_weight / D * sum_k CE_k / N`` (the report divides by the sequence
length T too). The model computes the MTP cross-entropy in its forward when it is given
:func:`mtp_labels`, and its gradient enters in backward with the weight
:attr:`MultiTokenPrediction.grad_weight` (as the MoE auxiliary loss does), so the model's
output stays the main logits and every trainer, pipeline schedule and loss function works
unchanged. The summed CE_k of each forward accumulate in ``loss_sum`` (detached) for logging.

>>> import torch
>>> mtp_labels(torch.tensor([[5, 6, 7, 8]]), depth=2)[0].tolist()
[[5, 6, 7], [6, 7, 8], [7, 8, -100], [8, -100, -100]]
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

from titanext.models.init import constant_, init_tensor_, normal_
from titanext.models.layers import AddLossGradient

__all__ = ["IGNORE_INDEX", "MTPLayer", "MultiTokenPrediction", "mtp_labels", "mtp_loss_sums",
           "reset_mtp_loss", "set_mtp_grad_weight"]

IGNORE_INDEX = -100


def mtp_labels(labels: torch.Tensor, depth: int) -> torch.Tensor:
    """[batch, seq] labels -> [batch, seq, depth + 1]: column j holds the labels shifted left
    by j (``IGNORE_INDEX`` past the end). Module k embeds column k - 1 and predicts column k.

    Build them on the whole sequence, before context parallelism shards it (the shift crosses
    shard boundaries), then shard them along dim 1 like the labels.
    """
    cols = [labels]
    for j in range(1, depth + 1):
        shifted = torch.full_like(labels, IGNORE_INDEX)
        if j < labels.shape[1]:
            shifted[:, :-j] = labels[:, j:]
        cols.append(shifted)
    return torch.stack(cols, dim=-1)


class MTPLayer(nn.Module):
    """One MTP module: ``enorm``, ``hnorm``, ``eh_proj``, a transformer ``block`` and the
    ``norm`` before the shared head. ``forward(h, emb, cos, sin, document_ids=None)``
    returns h^k (normed)."""

    def __init__(self, dim: int, block: nn.Module, make_norm: Callable[[], nn.Module]):
        super().__init__()
        self.enorm, self.hnorm = make_norm(), make_norm()
        self.eh_proj = nn.Linear(2 * dim, dim, bias=False)
        self.block = block
        self.norm = make_norm()

    def forward(self, h: torch.Tensor, emb: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                document_ids: torch.Tensor | None = None) -> torch.Tensor:
        x = self.eh_proj(torch.cat([self.enorm(emb), self.hnorm(h)], dim=-1))
        docs = {} if document_ids is None else {"document_ids": document_ids}
        return self.norm(self.block(x, cos, sin, **docs))


class MultiTokenPrediction(nn.Module):
    """The ``num_mtp_layers`` MTP modules of a model (``layers``, keyed "0", "1", ...).

    ``make_block(layer_id)`` builds module k's transformer block (layer id
    ``n_layers + k``: DeepSeek-V3's MTP block is a MoE block), ``make_norm()`` an RMSNorm.

    Attributes: ``grad_weight``, the gradient weight of every summed CE_k (None: the mean over
    this forward's tokens and the D modules, i.e. weight 1 / (D x tokens)); ``loss_sum`` [D],
    the summed CE_k of the forwards since :func:`reset_mtp_loss`.
    """

    def __init__(self, dim: int, n_layers: int, depth: int,
                 make_block: Callable[[int], nn.Module], make_norm: Callable[[], nn.Module]):
        super().__init__()
        self.layers = nn.ModuleDict({str(k): MTPLayer(dim, make_block(n_layers + k), make_norm)
                                     for k in range(depth)})
        self.grad_weight: float | None = None
        self.register_buffer("loss_sum", torch.zeros(depth), persistent=False)

    def logits(self, h: torch.Tensor, labels: torch.Tensor, embed: nn.Module, head: nn.Module,
               cos: torch.Tensor, sin: torch.Tensor, document_ids: torch.Tensor | None = None
               ) -> list[torch.Tensor]:
        """Each module's logits [batch, seq, vocab] from the main model's normed hidden state
        ``h`` and ``labels`` ([batch, seq, >= D] tokens: module k embeds column k - 1)."""
        out = []
        for k, layer in enumerate(self.layers.values()):
            h = layer(h, embed(labels[..., k].clamp(min=0)), cos, sin, document_ids)
            out.append(head(h))
        return out

    def forward(self, logits: torch.Tensor, h: torch.Tensor, labels: torch.Tensor,
                embed: nn.Module, head: nn.Module, cos: torch.Tensor, sin: torch.Tensor,
                document_ids: torch.Tensor | None = None) -> torch.Tensor:
        """The main ``logits``, unchanged, carrying the MTP loss's gradient in backward.
        ``labels`` is :func:`mtp_labels` [batch, seq, D + 1]."""
        depth = len(self.layers)
        if labels.shape[-1] != depth + 1:
            raise ValueError(f"mtp_labels has {labels.shape[-1]} columns; this model's "
                             f"{depth} MTP module(s) need {depth + 1} (titanext.models.mtp."
                             f"mtp_labels(labels, {depth}))")
        sums = []
        for k, mtp_logits in enumerate(self.logits(h, labels, embed, head, cos, sin,
                                                   document_ids), start=1):
            ce = F.cross_entropy(mtp_logits.flatten(0, 1).float(), labels[..., k].flatten(),
                                 reduction="sum", ignore_index=IGNORE_INDEX)
            # under tensor parallelism with loss parallelism (the caller's loss_parallel()
            # context) the logits are vocabulary-sharded and the sum is a DTensor
            sums.append(ce.full_tensor() if isinstance(ce, DTensor) else ce)
        total = torch.stack(sums)
        with torch.no_grad():
            self.loss_sum.add_(total.detach().to(self.loss_sum.dtype))
        if torch.is_grad_enabled() and total.requires_grad:
            weight = self.grad_weight
            if weight is None:
                weight = 1.0 / (depth * labels[..., 0].numel())
            logits = AddLossGradient.apply(logits, total.sum(), weight)
        return logits

    @torch.no_grad()
    def init_weights(self, prefix: str, seed: int) -> None:
        """Norms to 1, ``eh_proj`` normal(0.02), each block by its own ``init_weights``."""
        self.loss_sum.zero_()
        for key, layer in self.layers.items():
            p = f"{prefix}layers.{key}."
            for name in ("enorm", "hnorm", "norm"):
                init_tensor_(getattr(layer, name).weight, f"{p}{name}.weight", seed,
                             constant_(1.0))
            init_tensor_(layer.eh_proj.weight, f"{p}eh_proj.weight", seed,
                         normal_(0.02, truncate=2.0))
            layer.block.init_weights(f"{p}block.", seed)


def _mtps(parts: Sequence[nn.Module]) -> list[MultiTokenPrediction]:
    return [m for part in parts for m in part.modules() if isinstance(m, MultiTokenPrediction)]


def set_mtp_grad_weight(parts: Sequence[nn.Module], weight: float | None) -> None:
    """Set :attr:`MultiTokenPrediction.grad_weight` of every MTP container in ``parts``."""
    for m in _mtps(parts):
        m.grad_weight = weight


def reset_mtp_loss(module: nn.Module) -> None:
    """Zero the accumulated MTP loss sums of ``module``'s MTP containers."""
    for m in _mtps([module]):
        m.loss_sum.zero_()


def mtp_loss_sums(parts: Sequence[nn.Module], depth: int, device: torch.device | str
                  ) -> torch.Tensor:
    """The summed CE_k [depth] (float64) accumulated by the MTP containers in ``parts`` since
    the last reset (zeros where this process holds none), then reset."""
    total = torch.zeros(depth, dtype=torch.float64, device=device)
    for m in _mtps(parts):
        total += m.loss_sum.to(torch.float64)
        m.loss_sum.zero_()
    return total
