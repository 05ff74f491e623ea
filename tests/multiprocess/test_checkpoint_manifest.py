"""A damaged or mismatched checkpoint raises the same named error on every one of 2 gloo ranks,
without waiting: the shapes of another model (CheckpointMismatch) and an emptied shard
(CheckpointCorrupt). If one rank raised and the other waited in a collective, the spawn would
hang. The checkpoints come from the single-process helpers of
tests/unit/test_checkpoint_manifest.py.
"""

from __future__ import annotations

import torch

from tests.spawn import run_distributed
from tests.unit.test_checkpoint_manifest import SMALL, WIDER, _save_steps, _shard
from titanext.components.checkpoint import CheckpointManager
from titanext.errors import CheckpointCorrupt, CheckpointMismatch
from titanext.models.llama import Transformer


def _both_ranks_fail_alike(rank, world_size, folder, case):
    model = Transformer(WIDER if case == "shape" else SMALL)
    model.init_weights(seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ckpt = CheckpointManager(folder=folder, interval=1, keep_latest_k=0, load_step="latest",
                             last_save=True, enable=True, model_parts=[model], optimizer=opt,
                             lr_scheduler=None, dataloader=None)
    try:
        ckpt.load()
    except (CheckpointCorrupt, CheckpointMismatch) as e:
        return type(e).__name__
    return "loaded"


def test_every_rank_raises_the_same_error_without_waiting(tmp_path):
    _save_steps(tmp_path / "shape", steps=(1,))
    _save_steps(tmp_path / "corrupt", steps=(1,))
    (tmp_path / "corrupt" / "step-1" / _shard(tmp_path / "corrupt" / "step-1")).write_bytes(b"")
    for case, expected in (("shape", "CheckpointMismatch"), ("corrupt", "CheckpointCorrupt")):
        out = run_distributed(_both_ranks_fail_alike, 2, args=(str(tmp_path / case), case),
                              timeout_s=20)
        assert out == [expected, expected]

