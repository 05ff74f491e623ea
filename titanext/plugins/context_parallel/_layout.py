"""Sequence layouts: which global positions each CP rank holds, and sharding helpers."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from titanext.models.layers import document_positions
from titanext.plugins.context_parallel._comm import Group, as_group

LAYOUTS = ("zigzag", "contiguous")


def _chunks_for(layout: str, rank: int, world: int) -> tuple[int, int, list[int]]:
    """(number of chunks, chunks per rank, this rank's chunk ids)."""
    if layout == "zigzag":
        return 2 * world, 2, [rank, 2 * world - 1 - rank]
    if layout == "contiguous":
        return world, 1, [rank]
    raise ValueError(f"layout = {layout!r} is not one of {LAYOUTS}")


def layout_positions(layout: str, rank: int, world: int, local_seq: int,
                     device: torch.device | str | None = None) -> torch.Tensor:
    """Global positions ([local_seq], int64, ascending) of the tokens rank ``rank`` of ``world``
    holds in ``layout``. With world = 1 every layout is the plain order."""
    n, per_rank, mine = _chunks_for(layout, rank, world)
    size = local_seq // per_rank
    return torch.cat([torch.arange(c * size, (c + 1) * size, device=device) for c in mine])


def _is_2d(group: Group) -> bool:
    return isinstance(group, DeviceMesh) and group.ndim == 2


def cp_world_size(group: Group) -> int:
    """Ranks of a CP group, 1D or a 2D (ring, Ulysses) mesh."""
    return group.size() if isinstance(group, DeviceMesh) else dist.get_world_size(group)


def cp_rank(group: Group) -> int:
    """This rank's index in a CP group; on a 2D (ring, Ulysses) mesh ring_rank * u + ulysses_rank,
    the order in which hybrid attention expects the shards."""
    if _is_2d(group):
        return group.get_local_rank(0) * group.size(1) + group.get_local_rank(1)
    return dist.get_rank(as_group(group))


def shard_sequence(x: torch.Tensor, dim: int, group: Group, layout: str = "zigzag") -> torch.Tensor:
    """This rank's part of ``x`` along ``dim`` in ``layout`` order (differentiable slicing).
    ``group`` is the CP group, or a 2D (ring, Ulysses) mesh for hybrid attention."""
    world, rank = cp_world_size(group), cp_rank(group)
    n, _, mine = _chunks_for(layout, rank, world)
    if x.shape[dim] % n:
        raise ValueError(f"cannot shard a length-{x.shape[dim]} dimension {dim} into {n} equal "
                         f"{layout} chunks for {world} CP ranks; make it a multiple of {n}")
    chunks = x.chunk(n, dim)
    return torch.cat([chunks[i] for i in mine], dim)


def unshard_sequence(x: torch.Tensor, dim: int, group: Group,
                     layout: str = "zigzag") -> torch.Tensor:
    """Inverse of :func:`shard_sequence`: all-gather the shards and restore the order.
    Not differentiable (for outputs, checks and logging)."""
    world = cp_world_size(group)
    n, per_rank, _ = _chunks_for(layout, 0, world)
    parts = _gather(x.contiguous(), group)
    ordered: list[torch.Tensor | None] = [None] * n
    for rank, part in enumerate(parts):
        ids = _chunks_for(layout, rank, world)[2]
        for i, piece in zip(ids, part.chunk(per_rank, dim)):
            ordered[i] = piece
    return torch.cat(ordered, dim)


def _gather(x: torch.Tensor, group: Group) -> list[torch.Tensor]:
    """Every CP rank's ``x`` in CP-rank order; a 2D mesh gathers Ulysses-axis first, then ring."""
    if _is_2d(group):
        inner = torch.stack(_gather(x, group[group.mesh_dim_names[1]]))
        return [part for block in _gather(inner, group[group.mesh_dim_names[0]]) for part in block]
    pg = as_group(group)
    parts = [torch.empty_like(x) for _ in range(dist.get_world_size(pg))]
    dist.all_gather(parts, x, group=pg)
    return parts


def zigzag_shard(x: torch.Tensor, dim: int, group: Group) -> torch.Tensor:
    """Rank r of W keeps chunks r and 2W-1-r of the 2W equal chunks of ``x`` along ``dim``.

    With W = 2 and ``x = [c0 c1 c2 c3]``, rank 0 keeps ``[c0 c3]`` and rank 1 ``[c1 c2]``.
    """
    return shard_sequence(x, dim, group, "zigzag")


def zigzag_unshard(x: torch.Tensor, dim: int, group: Group) -> torch.Tensor:
    """The full tensor back from every rank's :func:`zigzag_shard` part (all-gather)."""
    return unshard_sequence(x, dim, group, "zigzag")


#: ``shard_batch(positions_shape=...)``: [local_seq], [1, local_seq] or [batch, local_seq].
POSITIONS_SHAPES = ("seq", "row", "batch")


def shard_batch(inputs: torch.Tensor, labels: torch.Tensor | None, group: Group, *,
                layout: str = "zigzag", seq_dim: int = 1, positions_shape: str = "seq"
                ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """Shard a batch for CP: (inputs, labels, position_ids), all in the same order.

    ``position_ids`` (int64) are the global positions of the kept tokens, so RoPE rotates each
    token by its true position. Pass them to the model's forward, in the shape it takes
    (``positions_shape``): ``"seq"`` gives [local_seq], ``"row"`` [1, local_seq] (Llama-style
    models, Hugging Face's ``position_ids``), ``"batch"`` [batch, local_seq] (a copy per row). A
    model whose rotary tables take no positions argument must index its cos/sin by them
    instead (docs/context_parallel.md, "Models whose rotary takes no positions"): without the
    global positions CP trains silently wrong. With document masking, shard the document ids
    and the per-document positions the same way (``shard_sequence(t, 1, group, layout)``) and
    pass those instead.

    >>> import torch.distributed as dist
    >>> x = torch.arange(8).view(1, 8)
    >>> shard_batch(x, x, dist.group.WORLD, positions_shape="row")[2]  # torchrun  # doctest: +SKIP
    tensor([[0, 1, 6, 7]])
    """
    if positions_shape not in POSITIONS_SHAPES:
        raise ValueError(f"positions_shape = {positions_shape!r} is not one of "
                         f"{', '.join(map(repr, POSITIONS_SHAPES))}")
    positions = torch.arange(inputs.shape[seq_dim], device=inputs.device)
    shard = [shard_sequence(t, seq_dim if t is not positions else 0, group, layout)
             if t is not None else None for t in (inputs, labels, positions)]
    pos = shard[2]
    if positions_shape == "row":
        pos = pos.unsqueeze(0)
    elif positions_shape == "batch":
        pos = pos.unsqueeze(0).expand(inputs.shape[0], -1).contiguous()
    return shard[0], shard[1], pos


def prepare_batch(inputs: torch.Tensor, labels: torch.Tensor | None,
                  document_ids: torch.Tensor | None = None, *, group: Group | None = None,
                  layout: str = "zigzag", device: torch.device | str | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None,
                             torch.Tensor | None]:
    """This rank's (inputs, labels, position_ids, document_ids) of a [batch, seq] batch.

    Without CP (``group=None``) position_ids are None (the model counts 0..seq-1), or with
    ``document_ids`` the positions within each document (restarting at 0 at every start).
    Under CP every tensor is sharded in ``layout`` over the CP ranks (a 1D group, or the 2D
    (ring, Ulysses) mesh), and position_ids are the kept tokens' global positions ([local_seq])
    or their positions within their documents ([batch, local_seq]). The trainer's batches go
    through here; pass the results as ``model(inputs, position_ids, document_ids=...)``.
    """
    positions = None if document_ids is None else document_positions(document_ids)
    if group is not None:
        if positions is None:
            positions = torch.arange(inputs.shape[1], device=inputs.device)
        inputs, labels, document_ids = (None if t is None else shard_sequence(t, 1, group, layout)
                                        for t in (inputs, labels, document_ids))
        positions = shard_sequence(positions, positions.dim() - 1, group, layout)
    out = (inputs, labels, positions, document_ids)
    if device is None:
        return out
    return tuple(None if t is None else t.to(device) for t in out)
