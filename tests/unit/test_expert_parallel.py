"""Expert parallelism in one process: indivisible experts are refused, and every config rule on
expert_parallel_degree is named before anything starts. The multi-rank tests (dispatch and
combine exactness, token conservation, EP layers and the trainer against one process) are in
tests/multiprocess/test_expert_parallel.py, which routes through the modules defined here.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.distributed.tensor import DTensor


class ScaleExperts(nn.Module):
    """A protocol-following experts module: row i of expert e is multiplied by scale[e]."""

    def __init__(self, num_experts: int, dim: int):
        super().__init__()
        self.scale = nn.Parameter(torch.ones(num_experts, dim))

    def forward(self, x: torch.Tensor, num_tokens_per_expert: torch.Tensor) -> torch.Tensor:
        scale = self.scale.to_local() if isinstance(self.scale, DTensor) else self.scale
        expert = torch.repeat_interleave(torch.arange(scale.shape[0]), num_tokens_per_expert,
                                         output_size=x.shape[0])
        return x * scale[expert]


class TinyMoE(nn.Module):
    """Routing given from outside (ids [T, k], weights [T, k]); the MoE seam as in MoE.forward."""

    def __init__(self, num_experts: int, dim: int):
        super().__init__()
        self.experts = ScaleExperts(num_experts, dim)
        self.num_experts = num_experts

    def forward(self, x, ids, weights):
        flat = ids.reshape(-1)
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=self.num_experts)
        token_of = order // ids.shape[1]
        y = self.experts(x[token_of], counts)
        y = y * weights.reshape(-1)[order].unsqueeze(-1)
        return torch.zeros_like(x).index_add_(0, token_of, y)


def test_apply_rejects_indivisible_experts():
    from titanext.plugins.expert_parallel import apply_expert_parallel

    class FakeMesh:
        ndim = 1

        def size(self):
            return 4

        def get_group(self):
            return None

    moe = TinyMoE(6, 4)
    with pytest.raises(ValueError, match="6 experts cannot be split over ep = 4"):
        apply_expert_parallel(moe, FakeMesh(), filter_fn=lambda n, m: isinstance(m, ScaleExperts))


# -- validation ------------------------------------------------------------------------------------


@pytest.mark.parametrize("overrides,world_size,problem", [
    (["--parallelism.expert_parallel_degree=3"], 3,
     "parallelism.expert_parallel_degree = 3 must divide moe.num_experts = 8 (each ep rank holds "
     "the same number of experts)"),
    (["--parallelism.expert_parallel_degree=4"], 2,
     "parallelism.expert_parallel_degree = 4 must divide data_parallel_shard_degree(2) x "
     "context_parallel_degree(1) = 2 and be a multiple of context_parallel_degree (1): ep borrows "
     "its ranks from dp_shard x cp"),
    (["--parallelism.expert_parallel_degree=2", "--parallelism.context_parallel_degree=4"], 4,
     "parallelism.expert_parallel_degree = 2 must divide data_parallel_shard_degree(1) x "
     "context_parallel_degree(4) = 4 and be a multiple of context_parallel_degree (4): ep borrows "
     "its ranks from dp_shard x cp"),
    (["--parallelism.expert_parallel_degree=2", "--parallelism.zero_stage=1"], 2,
     "parallelism.expert_parallel_degree = 2 needs FSDP (zero_stage 2 or 3): "
     "parallelism.zero_stage = 1 replicates every parameter with DDP, experts included"),
    (["--parallelism.expert_parallel_degree=2", "--activation_checkpoint.mode=selective"], 2,
     "parallelism.expert_parallel_degree = 2 cannot run with activation_checkpoint.mode = "
     "'selective' and selective_ac_option = 'op': with the all-to-alls and the experts' FSDP unit "
     "inside the block, the recomputation runs other profiler ops than the forward, which op-level "
     "checkpointing refuses; use mode = 'full' with keep_all_to_all = true (recompute without "
     "re-dispatch) or a layer-level selective_ac_option such as '2'"),
    (["--parallelism.expert_parallel_degree=2", "--model.flavor=debugtiny"], 2,
     "parallelism.expert_parallel_degree = 2 needs a MoE model, but model.flavor = 'debugtiny' has "
     "no MoE blocks; use a MoE flavor (e.g. 'debugmoe') or set it to 1"),
])
def test_ep_config_problems(overrides, world_size, problem):
    from titanext.config import ConfigError, load_config

    with pytest.raises(ConfigError) as e:
        load_config(None, ["--model.flavor=debugmoe", *overrides], world_size=world_size)
    assert problem in e.value.problems


def test_ep_config_ok_and_top_k_rule():
    from titanext.config import ConfigError, load_config

    load_config("train_configs/debug_moe.toml", ["--parallelism.expert_parallel_degree=2"],
                world_size=2)
    load_config(None, ["--model.flavor=debugmoe", "--parallelism.expert_parallel_degree=4",
                       "--parallelism.context_parallel_degree=2"], world_size=4)
    with pytest.raises(ConfigError, match="top_k"):
        load_config(None, ["--model.flavor=debugmoe", "--moe.top_k=9",
                           "--parallelism.expert_parallel_degree=2"], world_size=2)


def test_bad_ep_config_exits_2_before_anything_starts(capsys):
    from titanext.train import main

    code = main(["--config", "train_configs/debug_moe.toml",
                 "--parallelism.expert_parallel_degree=3"])
    assert code == 2
    assert "expert_parallel_degree = 3 must divide moe.num_experts = 8" in capsys.readouterr().err
