"""ParallelDims' named mesh views have the sizes and rank numbering they promise once the mesh
is built on gloo ranks: HSDP x TP on 8 ranks, EP borrowing its ranks from dp_shard x cp on 4,
and hybrid CP's cp = cp_ring x cp_ulysses on 4 (Ulysses innermost, the flattened cp view
numbered ring_rank x u + ulysses_rank). Degree resolution and validation, without a mesh:
tests/unit/test_parallel_dims.py.
"""

from __future__ import annotations

from tests.spawn import run_distributed
from titanext.distributed.parallel_dims import ParallelDims


def _mesh_views(rank, world_size, kw):
    d = ParallelDims(world_size=world_size, **kw)
    d.build_mesh("cpu")
    names = ("pp", "dp_replicate", "dp_shard", "cp", "tp", "dp", "dp_shard_cp", "dp_cp")
    out = {name: d.view(name).size() for name in names}
    out["fsdp_ndim"] = d.fsdp_mesh.ndim
    if d.ep > 1:
        out["ep"] = d.ep_mesh.size()
    return out


def test_mesh_views_hsdp_tp():
    sizes = dict(dp_replicate=2, dp_shard=-1, cp=1, tp=2, pp=1, ep=1)
    out = run_distributed(_mesh_views, 8, args=(sizes,))[0]
    assert out == {"pp": 1, "dp_replicate": 2, "dp_shard": 2, "cp": 1, "tp": 2, "dp": 4,
                   "dp_shard_cp": 2, "dp_cp": 4, "fsdp_ndim": 2}


def test_mesh_views_ep_borrows_from_dp_shard_and_cp():
    sizes = dict(dp_replicate=1, dp_shard=-1, cp=2, tp=1, pp=1, ep=4)
    out = run_distributed(_mesh_views, 4, args=(sizes,))[0]
    assert out["ep"] == 4 and out["dp_shard_cp"] == 4 and out["dp"] == 2 and out["fsdp_ndim"] == 1


def _cp_sub_axes(rank, world_size):
    d = ParallelDims(dp_replicate=1, dp_shard=1, cp=4, tp=1, pp=1, ep=1, world_size=world_size,
                     cp_ulysses=2)
    d.build_mesh("cpu")
    ring, ulysses, cp = (d.view(n) for n in ("cp_ring", "cp_ulysses", "cp"))
    return (ring.size(), ulysses.size(), cp.size(), ring.get_local_rank(),
            ulysses.get_local_rank(), cp.get_local_rank())


def test_hybrid_cp_splits_cp_into_ring_times_ulysses():
    """cp = cp_ring x cp_ulysses, Ulysses innermost (adjacent ranks), and cp, the flattened
    view that shards the batch, numbers rank c = ring_rank * u + ulysses_rank."""
    for rank, (r, u, cp, ring_rank, ulysses_rank, cp_rank) in enumerate(
            run_distributed(_cp_sub_axes, 4)):
        assert (r, u, cp) == (2, 2, 4)
        assert (ring_rank, ulysses_rank) == divmod(rank, 2)
        assert cp_rank == ring_rank * u + ulysses_rank == rank
