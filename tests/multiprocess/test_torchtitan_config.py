"""torchtitan's llama3 debug config (0.1 and 0.2 releases; tests/unit/config/torchtitan/tt0*_debug
_model.toml, dataset and tokenizer paths changed) trains exactly like the same file written with
titanext's names (tx0*_debug_model.toml): the real Trainer on one pooled rank, a few short steps,
losses and every parameter bitwise equal. The key-by-key checks: tests/unit/config/
test_torchtitan_keys.py."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from tests.spawn import run_distributed

FIXTURES = Path(__file__).resolve().parents[1] / "unit" / "config" / "torchtitan"
# The same shortening for both files: a few steps of short sequences.
SHORT = ["--training.steps=3", "--training.seq_len=64", "--training.local_batch_size=2",
         "--metrics.log_freq=100"]


def _train_pairs(rank: int, world_size: int, folder: str, names: list[str]):
    from titanext.config import load_config
    from titanext.trainer import Trainer

    here = os.getcwd()
    os.chdir(folder)  # the fixtures name ./tokenizer and ./outputs
    try:
        out = {}
        for name in names:
            cfg = load_config(str(FIXTURES / f"{name}.toml"),
                              [*SHORT, f"--job.dump_folder=./outputs/{name}"],
                              world_size=world_size)
            trainer = Trainer(cfg)
            losses = trainer.train()
            out[name] = (losses, {n: p.detach().clone()
                                  for n, p in trainer.model.named_parameters()})
        return out
    finally:
        os.chdir(here)


@pytest.mark.parametrize("release", ["01", "02"])
def test_torchtitan_debug_config_trains_like_its_titanext_twin(tmp_path, release):
    from tests.hf_artifacts import make_bpe_tokenizer

    make_bpe_tokenizer(str(tmp_path / "tokenizer"))
    names = [f"tt{release}_debug_model", f"tx{release}_debug_model"]
    out = run_distributed(_train_pairs, 1, args=(str(tmp_path), names), timeout_s=120)[0]
    (theirs, p_theirs), (ours, p_ours) = out[names[0]], out[names[1]]
    assert len(theirs) == 3 and all(torch.isfinite(torch.tensor(theirs)))
    assert theirs == ours  # bitwise
    assert p_theirs.keys() == p_ours.keys()
    for n in p_theirs:
        assert torch.equal(p_theirs[n], p_ours[n]), n
