"""Who orthogonalizes which matrix: the owner plan of distributed Muon (torch-free).

Muon's Newton-Schulz iteration needs a whole matrix, while a rank holds a slice of it (FSDP2,
HSDP, TP, EP, a ZeRO-1 partition) or all of it. Each rank describes the pieces it holds (a
:class:`Piece`: parameter FQN, global shape ``[experts, rows, cols]`` with ``experts = 1`` for a
2-D parameter, and the piece's offsets and sizes in that shape, as DCP's chunk list gives
them). :func:`plan_owners` turns every rank's pieces into one plan that every rank computes
alike:

- a matrix is ``(fqn, expert)``: each expert of a 3-D expert weight is its own matrix;
- its distinct chunks must tile it exactly (else ValueError naming it: loud, not wrong);
- its owner is one of the ranks holding a chunk of it, chosen greedily by Newton-Schulz
  FLOPs, largest matrix first, to the least loaded rank (replicas count: under HSDP or
  ZeRO-1 every data-parallel rank takes a share);
- each chunk is sent to the owner by one holder (the owner itself where it holds it), and the
  orthogonalized chunk goes back to every holder (all replicas);
- a fused projection (``[q; k; v]``, ``[gate; up]``) with a :data:`Split` is still gathered
  whole on its owner, which orthogonalizes each logical matrix (:func:`blocks`) on its own.

>>> a = [Piece("w", (1, 4, 2), (0, 0, 0), (1, 2, 2))]   # rank 0: rows 0-1
>>> b = [Piece("w", (1, 4, 2), (0, 2, 0), (1, 2, 2))]   # rank 1: rows 2-3
>>> plan = plan_owners([a, b])
>>> plan.matrices[0].owner, [c.source for c in plan.matrices[0].chunks]
(0, [0, 1])
>>> plan.gather_numel(0, 1), plan.gather_numel(1, 0)   # rank 1 sends its 4 elements to 0
(0, 4)
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

__all__ = ["Chunk", "Matrix", "OwnerPlan", "Piece", "Split", "assign_owners", "blocks",
           "matrix_flops", "ns_flops", "plan_owners"]

#: how a fused matrix splits into its logical matrices: (axis, sizes), axis 0 splitting the
#: rows (an nn.Linear weight's output features), 1 the columns (a Conv1D weight's)
Split = tuple[int, tuple[int, ...]]


@dataclass(frozen=True)
class Piece:
    """What one rank holds of one Muon parameter, in ``[experts, rows, cols]`` coordinates."""

    fqn: str
    shape: tuple[int, int, int]
    offsets: tuple[int, int, int]
    sizes: tuple[int, int, int]


@dataclass
class Chunk:
    """A distinct rectangle of one matrix: ``rows`` and ``cols`` are (start, length)."""

    rows: tuple[int, int]
    cols: tuple[int, int]
    holders: list[int]
    source: int = -1

    @property
    def numel(self) -> int:
        return self.rows[1] * self.cols[1]


@dataclass
class Matrix:
    fqn: str
    expert: int
    shape: tuple[int, int]
    chunks: list[Chunk]
    owner: int = -1
    split: Split | None = None


def ns_flops(rows: int, cols: int, steps: int = 5) -> int:
    """Multiply-add FLOPs (x2) of ``steps`` quintic Newton-Schulz iterations on one matrix
    (on the short side m: X X^T, then the m x m product, then the update times X).

    >>> ns_flops(4, 8, steps=1)
    640
    """
    m, n = min(rows, cols), max(rows, cols)
    return steps * (4 * m * m * n + 2 * m ** 3)


def blocks(shape: tuple[int, int], split: Split | None) -> list[tuple[int, int, int, int]]:
    """The logical matrices of a matrix of ``shape`` as ``(row0, rows, col0, cols)``: the whole
    matrix without a split.

    >>> blocks((6, 4), (0, (4, 2))), blocks((6, 4), (1, (1, 3)))
    ([(0, 4, 0, 4), (4, 2, 0, 4)], [(0, 6, 0, 1), (0, 6, 1, 3)])
    """
    if split is None:
        return [(0, shape[0], 0, shape[1])]
    axis, sizes = split
    if sum(sizes) != shape[axis] or min(sizes) < 1:
        raise ValueError(f"Muon: split sizes {list(sizes)} do not tile dimension {axis} of a "
                         f"{shape} matrix")
    starts = [sum(sizes[:i]) for i in range(len(sizes))]
    if axis == 0:
        return [(s, n, 0, shape[1]) for s, n in zip(starts, sizes)]
    return [(0, shape[0], s, n) for s, n in zip(starts, sizes)]


def matrix_flops(shape: tuple[int, int], split: Split | None = None, steps: int = 5) -> int:
    """Newton-Schulz FLOPs of one matrix: the sum over its logical matrices.

    >>> matrix_flops((8, 4), steps=1), matrix_flops((8, 4), (0, (4, 4)), steps=1)
    (640, 768)
    """
    return sum(ns_flops(rows, cols, steps) for _, rows, _, cols in blocks(shape, split))


@dataclass
class OwnerPlan:
    """The matrices in one global order with their owners; :meth:`gather_numel` and
    :meth:`scatter_numel` give the elements one rank sends another in each phase."""

    world: int
    matrices: list[Matrix]
    flops: list[int] = field(default_factory=list)  # Newton-Schulz FLOPs per rank

    def gather_numel(self, src: int, dst: int) -> int:
        return sum(c.numel for m in self.matrices if m.owner == dst
                   for c in m.chunks if c.source == src)

    def scatter_numel(self, src: int, dst: int) -> int:
        return sum(c.numel for m in self.matrices if m.owner == src
                   for c in m.chunks for h in c.holders if h == dst)

    def bytes_moved(self, element_size: int = 2) -> int:
        """Bytes that cross between ranks per step, both phases (a rank's copy to itself
        excluded)."""
        total = 0
        for m in self.matrices:
            for c in m.chunks:
                total += c.numel * ((c.source != m.owner) + sum(h != m.owner for h in c.holders))
        return total * element_size


def _chunks_of(fqn: str, expert: int, shape: tuple[int, int],
               held: list[tuple[int, Piece]]) -> list[Chunk]:
    by_rect: dict[tuple, Chunk] = {}
    for rank, p in held:
        rect = ((p.offsets[1], p.sizes[1]), (p.offsets[2], p.sizes[2]))
        by_rect.setdefault(rect, Chunk(rect[0], rect[1], [])).holders.append(rank)
    chunks = sorted(by_rect.values(), key=lambda c: (c.rows, c.cols))
    area = sum(c.numel for c in chunks)
    if all(c.cols == (0, shape[1]) for c in chunks):  # row shards (FSDP): contiguous rows
        starts = [c.rows[0] for c in chunks]
        ends = [0] + [sum(c.rows) for c in chunks[:-1]]
        overlap = starts != ends
    else:  # any other rectangles: pairwise (a handful of pieces)
        overlap = any(a.rows[0] < b.rows[0] + b.rows[1] and b.rows[0] < a.rows[0] + a.rows[1]
                      and a.cols[0] < b.cols[0] + b.cols[1] and b.cols[0] < a.cols[0] + a.cols[1]
                      for i, a in enumerate(chunks) for b in chunks[i + 1:])
    if area != shape[0] * shape[1] or overlap:
        where = f"{fqn}[{expert}]" if expert else fqn
        raise ValueError(
            f"Muon: the ranks' pieces of {where} (shape {shape}) do not tile it exactly "
            f"(pieces {[(c.rows, c.cols) for c in chunks]}); each element must be held by "
            "exactly one distinct shard")
    return chunks


def assign_owners(costs: Sequence[int], candidates: Sequence[Sequence[int]], world: int
                  ) -> tuple[list[int], list[int]]:
    """(owner of each matrix, Newton-Schulz FLOPs per rank): largest ``costs`` first, each to
    the least loaded of its ``candidates`` (the ranks holding a piece of it; LPT), ties to the
    lower rank. The planner runs it too (:mod:`titanext.planning.muon`).

    >>> assign_owners([5, 3, 3, 1], [[0, 1]] * 4, 2)
    ([0, 1, 1, 0], [6, 6])
    """
    owners, flops = [-1] * len(costs), [0] * world
    for i in sorted(range(len(costs)), key=lambda i: -costs[i]):
        owners[i] = min(candidates[i], key=lambda r: (flops[r], r))
        flops[owners[i]] += costs[i]
    return owners, flops


def plan_owners(pieces_per_rank: Sequence[Sequence[Piece]], ns_steps: int = 5,
                splits: Mapping[str, Split] | None = None) -> OwnerPlan:
    """The owner plan for every rank's pieces (``pieces_per_rank[r]`` is rank r's); ``splits``
    (FQN -> :data:`Split`) names the fused matrices orthogonalized per logical matrix."""
    splits = splits or {}
    world = len(pieces_per_rank)
    held: dict[tuple[str, int], list[tuple[int, Piece]]] = {}
    shapes: dict[str, tuple[int, int, int]] = {}
    for rank, pieces in enumerate(pieces_per_rank):
        for p in pieces:
            if shapes.setdefault(p.fqn, p.shape) != p.shape:
                raise ValueError(f"Muon: ranks disagree on the shape of {p.fqn}: "
                                 f"{shapes[p.fqn]} vs {p.shape}")
            if 0 in p.sizes:
                continue  # an empty shard (uneven sharding on more ranks than rows)
            for e in range(p.offsets[0], p.offsets[0] + p.sizes[0]):
                held.setdefault((p.fqn, e), []).append((rank, p))
    matrices = [Matrix(fqn, e, shapes[fqn][1:], _chunks_of(fqn, e, shapes[fqn][1:], h),
                       split=splits.get(fqn)) for (fqn, e), h in sorted(held.items())]
    cost = [matrix_flops(m.shape, m.split, ns_steps) for m in matrices]
    owners, flops = assign_owners(
        cost, [sorted({h for c in m.chunks for h in c.holders}) for m in matrices], world)
    sent = [0] * world
    for i in sorted(range(len(matrices)), key=lambda i: -cost[i]):  # the owners' order
        m = matrices[i]
        m.owner = owners[i]
        for c in m.chunks:
            c.source = m.owner if m.owner in c.holders else min(
                c.holders, key=lambda r: (sent[r], r))
            sent[c.source] += c.numel * (c.source != m.owner)
    return OwnerPlan(world, matrices, flops)
