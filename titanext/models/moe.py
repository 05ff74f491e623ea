"""Mixture of Experts: a router, grouped SwiGLU experts, optional shared experts.

The layer works on its own in any model (see ``examples/moe_layer.py``):

>>> import torch
>>> from titanext.models.moe import MoE, MoEArgs
>>> moe = MoE(dim=64, args=MoEArgs(num_experts=8, top_k=2, hidden_dim=32, num_shared_experts=1))
>>> moe(torch.randn(2, 16, 64)).shape
torch.Size([2, 16, 64])

Flow of ``MoE.forward`` on T = batch x seq tokens: the router scores every token against every
expert in fp32 and picks ``top_k`` experts per token; optionally drops assignments over an
expert's capacity; sorts the T x top_k assignments by expert (stable); runs
``experts(x_sorted, counts_per_expert, row_weights)`` (the one seam expert parallelism wraps:
nothing else assumes the experts are local), which multiplies each row's routing weight into
its SwiGLU output before w2 (an experts module without ``takes_row_weights`` is called with two
arguments and its outputs are scaled instead); sums each token's rows; adds the shared experts.

Load balancing (both switchable, see docs/moe_ep.md):
- aux-loss-free: ``router.expert_bias`` is added to the scores for *selection only*; after each
  optimizer step :func:`update_expert_bias` moves it by ``rate * sign(mean load - load)`` from
  the counts in ``tokens_per_expert`` (all-reduced over the ranks that see different tokens).
- sequence-wise auxiliary loss (DeepSeek-V3): ``alpha * sum_i f_i * P_i`` per sequence. Its
  gradient is injected in backward (so it works under any trainer and under pipelining): the
  output behaves as if ``aux_loss_weight * sum over sequences of L_seq`` were added to the loss.
"""

from __future__ import annotations

import math
from typing import Literal

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

from titanext._compat import grouped_mm
from titanext._fake_backend import balanced_counts, is_fake
from titanext.models.args import MoEArgs
from titanext.models.init import init_tensor_, normal_
from titanext.models.layers import AddLossGradient, FeedForward, sum_rows

__all__ = ["GroupedExperts", "MoE", "MoEArgs", "Router", "RouterGate", "TokenRouting",
           "WeightedSwiGLU", "expert_load", "grouped_mm_supported", "set_aux_loss_weight",
           "update_expert_bias"]


def grouped_mm_supported(x: torch.Tensor, *weights: torch.Tensor) -> bool:
    """Whether ``torch._grouped_mm`` runs for these operands here (the ``"auto"`` choice).

    CPU (torch >= 2.9): fp32/bf16/fp16 in eager mode, bf16 under compile. CUDA: bf16 on sm90+.
    Every row stride and base pointer must be a multiple of 16 bytes (torch's alignment rule).
    """
    if (grouped_mm is None or any(w.dtype != x.dtype for w in weights)
            or x.device.type == "meta"):
        return False
    if torch.compiler.is_compiling() or x.device.type == "cuda":
        if x.dtype != torch.bfloat16:
            return False
        if x.device.type == "cuda" and torch.cuda.get_device_capability(x.device) < (9, 0):
            return False
    elif x.device.type != "cpu" or x.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        return False
    elif is_fake(x) and x.dtype != torch.bfloat16:  # a dry run: torch's fake kernel takes bf16
        return False
    # torch 2.9-2.13 CPU and CUDA kernels need 16-byte aligned strides and base pointers.
    return (all(s * x.element_size() % 16 == 0 for w in weights for s in w.shape[1:])
            and (torch.compiler.is_compiling()  # no data pointers while tracing
                 or all(_aligned(t) for t in (x, *weights))))


def _host_counts(num_tokens_per_expert: torch.Tensor, rows: int) -> list[int]:
    """The tokens of each expert, on the host; a dry run's fake counts have no values: there,
    perfectly balanced routing (an estimate, as the expert-parallel dispatch assumes)."""
    if is_fake(num_tokens_per_expert):
        return balanced_counts(rows, num_tokens_per_expert.numel())
    return num_tokens_per_expert.tolist()


def _aligned(t: torch.Tensor) -> bool:
    """Whether ``t`` starts on a 16-byte boundary. A dry run's fake tensor has no address
    (torch warns that reading one will become an error): its offset into a storage, which the
    allocator aligns, tells the same."""
    if is_fake(t):
        return t.storage_offset() * t.element_size() % 16 == 0
    return t.data_ptr() % 16 == 0


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


class GroupedExperts(nn.Module):
    """``num_experts`` SwiGLU FFNs stored as stacked weights.

    ``forward(x, num_tokens_per_expert)``: x is [T, dim] with rows grouped by expert in expert
    order, ``num_tokens_per_expert`` [local experts] the rows per expert (sums to T). The local
    expert count is ``w1.shape[0]`` of the local tensor (DTensor params use their local shard).

    ``float8_grouped_mm``: None (high precision), or a callable ``(x [T, in], w [E, out, in],
    offs [E] int32) -> [T, out]`` that runs the three grouped GEMMs instead (set by
    ``titanext.plugins.float8_experts.apply_float8_experts``).
    """

    float8_grouped_mm = None
    # ``forward(x, counts, row_weights)``: the routing weight of each row is applied inside, to
    # SwiGLU's output before w2 (:class:`WeightedSwiGLU`); the caller only sums the rows
    takes_row_weights = True

    def __init__(self, num_experts: int, dim: int, hidden_dim: int,
                 use_grouped_mm: bool | Literal["auto"] = "auto"):
        super().__init__()
        self.w1 = nn.Parameter(torch.empty(num_experts, hidden_dim, dim))
        self.w2 = nn.Parameter(torch.empty(num_experts, dim, hidden_dim))
        self.w3 = nn.Parameter(torch.empty(num_experts, hidden_dim, dim))
        self.use_grouped_mm = use_grouped_mm

    def forward(self, x: torch.Tensor, num_tokens_per_expert: torch.Tensor,
                row_weights: torch.Tensor | None = None) -> torch.Tensor:
        """``row_weights`` [T] (fp32, or None: unweighted): each row's routing weight,
        multiplied into SwiGLU's output before w2 (``w2(g act(h)) = g w2(act(h))``), so that
        no expert output is kept for the weights' gradient."""
        w1, w2, w3 = _local(self.w1), _local(self.w2), _local(self.w3)
        if self.float8_grouped_mm is not None:
            mm = self.float8_grouped_mm
            offs = torch.cumsum(num_tokens_per_expert, 0, dtype=torch.int32)
            return mm(self.act(mm(x, w1, offs), mm(x, w3, offs), row_weights), w2, offs)
        use = self.use_grouped_mm
        if use == "auto":
            use = grouped_mm_supported(x, w1, w2, w3)
        if use:
            offs = torch.cumsum(num_tokens_per_expert, 0, dtype=torch.int32)
            h = self.act(grouped_mm(x, w1.transpose(-2, -1), offs=offs),
                         grouped_mm(x, w3.transpose(-2, -1), offs=offs), row_weights)
            return grouped_mm(h, w2.transpose(-2, -1), offs=offs)
        # The loop needs the counts on the host: one device-to-host sync.
        counts = _host_counts(num_tokens_per_expert, x.shape[0])
        gs = torch.split(row_weights, counts) if row_weights is not None else [None] * len(counts)
        outs = [F.linear(self.act(F.linear(xe, w1[e]), F.linear(xe, w3[e]), ge), w2[e])
                for e, (xe, ge) in enumerate(zip(torch.split(x, counts), gs, strict=True))]
        return torch.cat(outs) if outs else x.new_zeros(0, w2.shape[1])

    def act(self, gate: torch.Tensor, up: torch.Tensor,
            row_weights: torch.Tensor | None = None) -> torch.Tensor:
        """SwiGLU's activation ``silu(gate) * up``, times each row's routing weight when given:
        the seam recompute by module wraps (``recompute_modules = ["moe_act"]`` keeps ``gate``,
        ``up`` and the weights, recomputes this)."""
        if row_weights is None:
            return F.silu(gate) * up
        return WeightedSwiGLU.apply(gate, up, row_weights)


class WeightedSwiGLU(torch.autograd.Function):
    """``(silu(gate) * up) * g`` per row, rounded once to ``gate``'s dtype (the product in
    ``gate``'s dtype, as the unweighted SwiGLU; the weight in fp32).

    It saves ``gate``, ``up`` and ``g`` only and recomputes ``silu(gate) * up`` in its backward:
    the weight's gradient ``sum(dout * silu(gate) * up)`` reads what SwiGLU keeps anyway, so the
    experts' outputs [rows, dim] need not be kept for it (weighting after w2 would). Megatron-Core
    weights its MoE SwiGLU the same way."""

    @staticmethod
    def forward(ctx, gate: torch.Tensor, up: torch.Tensor,  # type: ignore[override]
                g: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(gate, up, g)
        acc = torch.promote_types(gate.dtype, torch.float32)
        return ((F.silu(gate) * up).to(acc) * g.to(acc).unsqueeze(-1)).to(gate.dtype)

    @staticmethod
    def backward(ctx, dout: torch.Tensor):  # type: ignore[override]
        gate, up, g = ctx.saved_tensors
        acc = torch.promote_types(gate.dtype, torch.float32)
        gf, d = gate.to(acc), dout.to(acc)
        s = torch.sigmoid(gf)
        dg = (d * (F.silu(gate) * up).to(acc)).sum(-1).to(g.dtype)  # the forward's product
        dh = d * g.to(acc).unsqueeze(-1)  # d(silu(gate) * up)
        dup = (dh * gf * s).to(up.dtype)
        dgate = (dh * up.to(acc) * s * (1 + gf * (1 - s))).to(gate.dtype)
        return dgate, dup, dg


class TokenRouting:
    """Each token's experts ``ids`` [T, k] and routing ``weights`` [T, k] (fp32), handed whole to
    an experts module whose ``takes_routing`` attribute is set (two-level expert-parallel
    dispatch, which sends each token once per node and sums its weighted expert outputs there).
    A plain class on purpose: FSDP's mixed-precision cast of a module's inputs leaves the fp32
    weights inside it alone, as it does on the flat path, where they never enter the experts."""

    __slots__ = ("ids", "weights")

    def __init__(self, ids: torch.Tensor, weights: torch.Tensor):
        self.ids, self.weights = ids, weights


class RouterGate(nn.Linear):
    """The router's dim -> num_experts projection, computed in fp32 whatever the input and
    parameter dtypes. A subclass so that converters which take plain ``nn.Linear`` (float8)
    leave it alone."""

    titanext_convert = False  # float8 / deferral keep it as it is, on purpose (no warning)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _Fp32Linear.apply(x, self.weight)


class _Fp32Linear(torch.autograd.Function):
    """``F.linear(x.float(), w.float())`` that keeps ``x`` and ``w`` as they came (a 16-bit
    ``x`` is the MoE's input, which its experts keep anyway) instead of their fp32 copies, and
    casts them again in the backward: the same products, without an fp32 [tokens, dim] copy per
    MoE block."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        ctx.save_for_backward(x, w)
        return F.linear(x.float(), w.float())

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        x, w = ctx.saved_tensors
        dx = grad.matmul(w.float()).to(x.dtype) if ctx.needs_input_grad[0] else None
        dw = None
        if ctx.needs_input_grad[1]:
            dw = grad.reshape(-1, grad.shape[-1]).t().matmul(
                x.float().reshape(-1, x.shape[-1])).to(w.dtype)
        return dx, dw


class Router(nn.Module):
    """Top-k router with fp32 scores, optional group-limited selection and a selection bias."""

    def __init__(self, dim: int, args: MoEArgs):
        super().__init__()
        self.args = args
        self.gate = RouterGate(dim, args.num_experts, bias=False)
        # Selection-only bias of aux-loss-free balancing (persistent: it is training state).
        self.register_buffer("expert_bias", torch.zeros(args.num_experts))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [T, dim] -> (weights [T, k] fp32, expert ids [T, k], scores [T, E] fp32)."""
        a = self.args
        logits = self.gate(x)  # fp32
        scores = logits.softmax(-1) if a.score_func == "softmax" else logits.sigmoid()
        with torch.no_grad():  # selection only: no gradient reaches the ids, nothing is saved
            biased = scores + self.expert_bias.float() if a.load_balance_coeff else scores
            if a.num_limited_groups < a.num_expert_groups:
                biased = self._limit_groups(biased)
            ids = torch.topk(biased, a.top_k, dim=-1, sorted=False).indices
        weights = scores.gather(-1, ids)  # the bias never changes the weights
        if a.route_norm:
            weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
        return weights * a.route_scale, ids, scores

    def _limit_groups(self, biased: torch.Tensor) -> torch.Tensor:
        """Mask (-inf) the experts outside each token's best ``num_limited_groups`` groups.

        A group scores its best expert (softmax) or, as DeepSeek-V3 does with sigmoid scores,
        the sum of its top-2 biased scores.
        """
        a = self.args
        grouped = biased.unflatten(-1, (a.num_expert_groups, -1))  # [T, G, E/G]
        if a.score_func == "sigmoid" and grouped.shape[-1] >= 2:
            group_scores = grouped.topk(2, dim=-1).values.sum(-1)
        else:
            group_scores = grouped.amax(-1)
        best = group_scores.topk(a.num_limited_groups, dim=-1, sorted=False).indices  # [T, g]
        keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(-1, best, True)
        return grouped.masked_fill(~keep.unsqueeze(-1), float("-inf")).flatten(-2)


class MoE(nn.Module):
    """Routed + shared SwiGLU experts. ``forward(x [B, S, dim]) -> [B, S, dim]``.

    Buffers: ``router.expert_bias`` [E] and ``tokens_per_expert`` [E] (fp32 counts of routed
    assignments, before any capacity drop, accumulated since the last
    :func:`update_expert_bias`; activation checkpointing may count a recomputed forward twice,
    which neither the sign-based update nor the max/mean load metric notices).
    Attributes: ``aux_loss`` (detached mean sequence aux loss of the last forward, or None) and
    ``aux_loss_weight`` (gradient weight per sequence; None = 1 / sequences in the forward,
    i.e. the aux loss is averaged over the batch and added to a mean loss).
    """

    def __init__(self, dim: int, args: MoEArgs):
        super().__init__()
        self.dim, self.args = dim, args
        self.router = Router(dim, args)
        self.experts = GroupedExperts(args.num_experts, dim, args.hidden_dim, args.use_grouped_mm)
        self.shared_experts: nn.Module | None = None
        if args.num_shared_experts > 0:
            self.shared_experts = FeedForward(dim, args.num_shared_experts * args.hidden_dim)
        self.register_buffer("tokens_per_expert", torch.zeros(args.num_experts), persistent=False)
        self.aux_loss: torch.Tensor | None = None
        self.aux_loss_weight: float | None = None
        if self.experts.w1.device.type != "meta":
            self.init_weights()

    @torch.no_grad()
    def init_weights(self, seed: int = 0, prefix: str = "", init_std: float = 0.02,
                     out_init_std: float = 0.02) -> None:
        """Layout-invariant init (each parameter generated whole from a name-derived seed)."""
        self.router.expert_bias.zero_()
        self.tokens_per_expert.zero_()
        for name, p in self.named_parameters():
            is_out = name.endswith(("w2", "w3", "w2.weight", "w3.weight"))
            std = out_init_std if is_out else init_std
            init_tensor_(p, f"{prefix}{name}", seed, normal_(std, truncate=2.0))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bsz, seqlen, dim = x.shape
        a, n_exp = self.args, self.args.num_experts
        tokens = x.reshape(-1, dim)
        weights, ids, scores = self.router(tokens)  # [T, k], [T, k], [T, E]
        flat_ids = ids.reshape(-1)  # assignment j belongs to token j // top_k
        counts = torch.zeros(n_exp, dtype=torch.long, device=x.device).index_add_(
            0, flat_ids, torch.ones_like(flat_ids))
        with torch.no_grad():
            self.tokens_per_expert.add_(counts)
        if getattr(self.experts, "takes_routing", False):  # the weighted sum per token
            if a.capacity_factor is not None:
                raise ValueError("capacity_factor (token dropping) and two-level expert-parallel "
                                 "dispatch cannot be combined: use dispatch = 'flat' or a "
                                 "dropless MoE")
            out = self.experts(tokens, TokenRouting(ids, weights)).to(x.dtype)
        else:
            out = self._routed(tokens, weights, ids, counts, scores)
        if self.shared_experts is not None:
            out = out + self.shared_experts(tokens)
        if a.aux_loss_alpha > 0:
            aux = self._sequence_aux_loss(scores, flat_ids, bsz)
            self.aux_loss = aux.detach() / bsz
            if torch.is_grad_enabled() and aux.requires_grad:
                weight = 1.0 / bsz if self.aux_loss_weight is None else self.aux_loss_weight
                out = AddLossGradient.apply(out, aux, weight)
        return out.view(bsz, seqlen, dim)

    def _routed(self, tokens: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
                counts: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        """The routed experts' weighted sum per token, with the T x top_k assignments sorted by
        expert for ``experts(rows, counts)`` (dropping those over capacity, if any)."""
        a, flat_ids = self.args, ids.reshape(-1)
        if a.capacity_factor is None:
            order, kept_counts = torch.argsort(flat_ids, stable=True), counts
        else:
            order, kept_counts = self._capacity_order(flat_ids, counts,
                                                      scores.gather(-1, ids).reshape(-1))
        token_of = order // a.top_k
        row_weights = weights.reshape(-1)[order]
        if getattr(self.experts, "takes_row_weights", False):  # weighted before w2: no expert
            # output is kept for the weights' gradient
            y = self.experts(tokens[token_of], kept_counts, row_weights)
        else:  # [kept, dim] in expert order
            y = self.experts(tokens[token_of], kept_counts).float() * row_weights.unsqueeze(-1)
        return sum_rows(y, token_of, tokens.shape[0]).to(tokens.dtype)

    def _capacity_order(self, flat_ids: torch.Tensor, counts: torch.Tensor,
                        flat_scores: torch.Tensor):
        """Expert-ordered kept assignments and per-expert kept counts under the capacity.

        capacity = ceil(T * top_k / E * capacity_factor) per expert, on this forward's tokens.
        Within an expert the assignments with the highest router score are kept; ties go to the
        earlier token (and then the earlier of its top-k slots). Deterministic. Needs one
        device-to-host sync (the number of kept rows).
        """
        n_exp, n_assign = self.args.num_experts, flat_ids.numel()
        capacity = math.ceil(n_assign / n_exp * self.args.capacity_factor)
        by_score = torch.argsort(-flat_scores, stable=True)
        by_expert = by_score[torch.argsort(flat_ids[by_score], stable=True)]
        starts = torch.cumsum(counts, 0) - counts
        positions = torch.arange(n_assign, device=flat_ids.device)
        rank_in_expert = positions - starts[flat_ids[by_expert]]
        kept = by_expert[rank_in_expert < capacity]
        return kept, counts.clamp(max=capacity)

    def _sequence_aux_loss(self, scores: torch.Tensor, flat_ids: torch.Tensor,
                           bsz: int) -> torch.Tensor:
        """alpha * sum_i f_i * P_i summed over the sequences of this forward (DeepSeek-V3).

        f_i = E / (top_k * S) * (selections of expert i in the sequence) and
        P_i = mean over the sequence of s_i / sum_j s_j.
        """
        a = self.args
        probs = scores / scores.sum(-1, keepdim=True)
        probs = probs.view(bsz, -1, a.num_experts)  # [B, S, E]
        seqlen = probs.shape[1]
        sel = torch.zeros(bsz, a.num_experts, device=scores.device)
        seq_of = torch.arange(bsz, device=scores.device).repeat_interleave(seqlen * a.top_k)
        sel.index_add_(0, seq_of, torch.nn.functional.one_hot(flat_ids, a.num_experts).float())
        f = sel * (a.num_experts / (a.top_k * seqlen))
        return a.aux_loss_alpha * (f * probs.mean(1)).sum()


def _moe_modules(model: nn.Module) -> list[MoE]:
    return [m for m in model.modules() if isinstance(m, MoE)]


@torch.no_grad()
def update_expert_bias(model: nn.Module,
                       group: dist.ProcessGroup | None = None) -> torch.Tensor | None:
    """Aux-loss-free balancing step; call after ``optimizer.step()``. Returns the loads.

    For every MoE layer: load = ``tokens_per_expert`` summed over ``group`` (the ranks that see
    different tokens: dp x cp; None = this process only), then
    ``expert_bias += load_balance_coeff * sign(mean(load) - load)``, mean-centred, and the
    counts reset. Layers with ``load_balance_coeff`` None or 0 only reset. Returns the loads
    [layers, E] (one all-reduce for all layers) or None if the model has no MoE.

    >>> loads = update_expert_bias(model, group=None)  # after optimizer.step  # doctest: +SKIP
    """
    moes = _moe_modules(model)
    if not moes:
        return None
    loads = torch.stack([m.tokens_per_expert.float() for m in moes])
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(loads, group=group)
    for m, load in zip(moes, loads):
        if m.args.load_balance_coeff:
            bias = m.router.expert_bias
            bias.add_(m.args.load_balance_coeff * torch.sign(load.mean() - load).to(bias.dtype))
            bias.sub_(bias.mean())
        m.tokens_per_expert.zero_()
    return loads


def expert_load(loads: torch.Tensor) -> torch.Tensor:
    """max / mean load per layer for ``loads`` [layers, E] (1.0 = perfectly balanced)."""
    return loads.amax(-1) / loads.mean(-1).clamp(min=1e-20)


def set_aux_loss_weight(model: nn.Module, weight: float | None) -> None:
    """Set every MoE layer's per-sequence aux-loss gradient weight (None: mean over the forward)."""
    for m in _moe_modules(model):
        m.aux_loss_weight = weight
