"""ParallelDims: degree resolution and validation, and where the trainer autocasts. The named
mesh views, built on gloo ranks: tests/multiprocess/test_parallel_dims.py."""

from __future__ import annotations

import pytest
import torch

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
    from titanext.config import load_config, recipe_from_config
    from titanext.trainer import Trainer

    cfg = load_config(None, args, world_size=world)
    p = cfg.parallelism
    dims = ParallelDims(dp_replicate=1, dp_shard=-1, cp=1, tp=1, pp=p.pipeline_parallel_degree,
                        ep=1, world_size=world)
    ctx = Trainer._autocast_context(recipe_from_config(cfg), dims, torch.device("cpu"))()
    with ctx:
        got = torch.get_autocast_dtype("cpu") if torch.is_autocast_enabled("cpu") else None
    assert got == expect
