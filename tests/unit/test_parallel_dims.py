"""ParallelDims: degree resolution, validation, and the named mesh views."""

from __future__ import annotations

import pytest
import torch

from tests.spawn import run_distributed
from titanext.config import ConfigError
from titanext.distributed.parallel_dims import ParallelDims


def dims(**kw):
    base = dict(dp_replicate=1, dp_shard=-1, cp=1, tp=1, pp=1, ep=1, world_size=8)
    base.update(kw)
    return ParallelDims(**base)


def test_dp_shard_minus_one_takes_the_rest():
    assert dims(tp=2, pp=2).dp_shard == 2
    assert dims(dp_replicate=2).dp_shard == 4
    assert dims().gradient_reduction_size == 8


def test_product_must_equal_world_size():
    with pytest.raises(ConfigError, match="multiply to 4, not the world size 8"):
        dims(dp_shard=2, tp=2)


def test_rest_must_divide():
    with pytest.raises(ConfigError, match="cannot fill the rest of the world size 8: "
                                          "it is not divisible by .* = 3"):
        dims(tp=3)


def test_bad_degrees_named():
    with pytest.raises(ConfigError, match="tensor_parallel_degree = 0"):
        dims(tp=0)
    with pytest.raises(ConfigError, match="data_parallel_shard_degree = -2"):
        dims(dp_shard=-2)


def test_ep_must_fit_dp_shard_times_cp():
    with pytest.raises(ConfigError, match="expert_parallel_degree = 3"):
        dims(ep=3)
    assert dims(ep=4).ep == 4


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


@pytest.mark.parametrize("args, world, expect", [
    (["--training.mixed_precision_param=bfloat16"], 1, torch.bfloat16),  # one rank: autocast
    (["--training.mixed_precision_param=bfloat16", "--parallelism.zero_stage=1"], 2,
     torch.bfloat16),  # ZeRO-1's DDP does not cast either
    (["--training.mixed_precision_param=bfloat16"], 2, None),  # FSDP casts the parameters
    (["--training.mixed_precision_param=float32"], 1, None),
    (["--training.mixed_precision_param=bfloat16", "--parallelism.pipeline_parallel_degree=2",
      "--parallelism.pipeline_parallel_schedule=1F1B"], 2, None),  # stages keep float32
])
def test_trainer_autocasts_where_fsdp_does_not_cast(args, world, expect):
    from titanext.config import load_config
    from titanext.trainer import Trainer

    cfg = load_config(None, args, world_size=world)
    p = cfg.parallelism
    dims = ParallelDims(dp_replicate=1, dp_shard=-1, cp=1, tp=1, pp=p.pipeline_parallel_degree,
                        ep=1, world_size=world)
    ctx = Trainer._autocast_context(cfg, dims, torch.device("cpu"))()
    with ctx:
        got = torch.get_autocast_dtype("cpu") if torch.is_autocast_enabled("cpu") else None
    assert got == expect
