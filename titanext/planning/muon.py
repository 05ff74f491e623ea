"""Muon in the planner's step time: the Newton-Schulz work of the busiest owner, and the owner
exchange (:mod:`titanext.components.muon`).

The matrices are the real ones: the Muon group (:func:`titanext.components.param_groups.
param_groups`, ``muon_params`` honoured) of one pp rank's parameters in the meta model, each
expert of a 3-D weight its own matrix, fused ones split by ``muon_split_params``. Their owners
come from the runtime's own greedy (:func:`titanext.components.muon_plan.assign_owners`,
largest first to the least loaded holder) over the pp stage's ranks: every rank of the stage
holds a piece (or a replica) of a dense matrix; an expert's matrix is held by the ``1 / ep`` of
them in its EP group. The busiest owner's FLOPs run at the matmul rate: bfloat16 at the
device's dense bf16 peak, float32 on the vector units at :data:`FP32_VECTOR_SLOWDOWN` times
less (torch's fp32 matmuls do not use TF32 unless asked), both times ``efficiency``.

>>> from titanext.config import load_config
>>> from titanext.planning.layout import resolve_layout
>>> lo = resolve_layout(load_config(None, ["--optimizer.name=Muon"]), 4)
>>> round(busiest_owner_flops(lo, lo.pipe.ranks[0]) / 1e9, 2)  # benchmarks/muon.py: 7.13
7.13
"""

from __future__ import annotations

from titanext.components.muon_plan import Split, assign_owners, matrix_flops
from titanext.components.param_groups import muon_splits, param_groups
from titanext.config import model_args
from titanext.config.muon_split import ns_dtype_on
from titanext.planning.hardware import Device
from titanext.planning.layout import Layout
from titanext.planning.shapes import _meta_model
from titanext.planning.stages import RankStages

__all__ = ["FP32_VECTOR_SLOWDOWN", "busiest_owner_flops", "muon_matrices", "ns_seconds",
           "step_bytes"]

#: dense bf16 tensor-core FLOP/s over plain fp32 FLOP/s: 989 / 67 on the H100 SXM, 312 / 19.5
#: on the A100 (datasheets); Newton-Schulz in float32 (``muon_ns_dtype``) runs at that rate
FP32_VECTOR_SLOWDOWN = 15.0


def _rank_shapes(lo: Layout, rank: RankStages) -> dict[str, tuple[int, ...]]:
    """FQN -> shape of the parameters pp rank ``rank`` holds (its blocks, embedding, head)."""
    model = _meta_model(lo.cfg.model.name, model_args(lo.cfg))
    mine = tuple(f"layers.{i}." for i in rank.layer_ids)
    ends = (("tok_embeddings.",) if rank.embedding else ()) + (
        ("norm.", "output.") if rank.head else ())
    return {n: tuple(p.shape) for n, p in model.named_parameters() if n.startswith(mine + ends)}


def muon_matrices(lo: Layout, rank: RankStages
                  ) -> list[tuple[str, int, tuple[int, int], Split | None]]:
    """(FQN, expert, shape, split or None) of each Muon matrix of pp rank ``rank``, in the owner
    plan's order: one entry per expert of a 3-D weight (expert 0 for a 2-D one)."""
    o = lo.cfg.optimizer
    shapes = _rank_shapes(lo, rank)
    groups = param_groups(shapes, name=o.name, muon_params=o.muon_params,
                          no_decay_params=o.no_decay_params)
    splits = muon_splits(shapes, o.muon_split_params)
    out = []
    for g in groups:
        if g.optimizer != "Muon":
            continue
        for n in g.names:
            shape = shapes[n]
            out += [(n, e, shape[-2:], splits.get(n))
                    for e in range(shape[0] if len(shape) == 3 else 1)]
    return sorted(out)


def _owners(lo: Layout, rank: RankStages) -> tuple[list, list[int], list[int]]:
    """(the Muon matrices of pp rank ``rank``, each one's owner among its stage's ranks, the
    Newton-Schulz FLOPs per rank)."""
    n = lo.rep * lo.shard * lo.cp * lo.tp  # the ranks of one pp stage
    ep = max(1, lo.ep)
    everyone = tuple(range(n))
    groups = [tuple(r for r in everyone if r % ep == g) for g in range(ep)]
    per_group = max(1, (lo.shape.moe.num_experts if lo.shape.moe else 1) // ep)
    costs, candidates = [], []
    steps = lo.cfg.optimizer.muon_ns_steps
    shapes = _rank_shapes(lo, rank)
    matrices = muon_matrices(lo, rank)
    for fqn, expert, shape, split in matrices:
        costs.append(matrix_flops(shape, split, steps))
        sharded = len(shapes[fqn]) == 3 and ep > 1  # expert e sits in EP group e // (E / ep)
        candidates.append(groups[(expert // per_group) % ep] if sharded else everyone)
    owners, flops = assign_owners(costs, candidates, n)
    return matrices, owners, flops


def busiest_owner_flops(lo: Layout, rank: RankStages) -> int:
    """Newton-Schulz FLOPs of the busiest owner among the ranks of pp rank ``rank``'s stage."""
    if lo.cfg.optimizer.name != "Muon":
        return 0
    return max(_owners(lo, rank)[2], default=0)


def step_bytes(lo: Layout, rank: RankStages, local: float) -> float:
    """Bytes Muon's step holds beside the parameters, gradients and state on the busiest
    owner of pp rank ``rank``, which holds ``local`` Muon elements, as
    :meth:`titanext.components.muon.MuonWithAdamW._muon_step` allocates them (``s`` bytes an
    element in the Newton-Schulz dtype, ``O`` the owner's matrices' elements): the larger of
    the gather (the fp32 updates, the send buffer, the received pieces: 4 local + s (local +
    O)), the work (the received pieces, the results, one matrix's iteration: s (2 O) + that)
    and the return trip (the results, the send buffer with a copy per replica, the returned
    pieces: s ((1 + replicas) O + local))."""
    if lo.cfg.optimizer.name != "Muon":
        return 0.0
    matrices, owners, flops = _owners(lo, rank)
    if not matrices:
        return 0.0
    busiest = max(range(len(flops)), key=lambda r: flops[r])
    mine = [shape for (_, _, shape, _), o in zip(matrices, owners) if o == busiest]
    owned = sum(rows * cols for rows, cols in mine)
    size = ns_element_bytes(lo)
    iteration = max((size * (3 * r * c + 2 * min(r, c) ** 2) for r, c in mine), default=0)
    replicas = lo.rep if lo.fsdp else 1
    return max(4 * local + size * (local + owned), size * 2 * owned + iteration,
               size * ((1 + replicas) * owned + local))


def ns_dtype(lo: Layout) -> str:
    """The Newton-Schulz dtype of the planned job, which runs on CUDA ('auto': bfloat16)."""
    return ns_dtype_on(lo.cfg.optimizer.muon_ns_dtype, "cuda")


def ns_element_bytes(lo: Layout) -> int:
    """Bytes of one element in the Newton-Schulz dtype: the owners' pieces travel in it."""
    return 2 if ns_dtype(lo) == "bfloat16" else 4


def ns_seconds(lo: Layout, device: Device, efficiency: float, rank: RankStages) -> float:
    """Seconds of the busiest owner's Newton-Schulz iterations in one optimizer step."""
    rate = device.bf16_flops * efficiency
    if ns_dtype(lo) == "float32":
        rate /= FP32_VECTOR_SLOWDOWN
    return busiest_owner_flops(lo, rank) / rate
