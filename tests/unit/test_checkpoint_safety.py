"""A checkpoint never runs code: a resume folder whose files carry a pickled payload (a
``__reduce__`` that would create a marker folder) is refused with ``CheckpointUnsafe`` naming the
file and what it asked for, and the payload never runs, in each file a resume reads
(``trainer_state.pt``, ``rng-<rank>.pt``, DCP's ``.metadata``). State that is not plain data is
refused when saving, naming the object; plain state from before the rule loads unchanged."""

from __future__ import annotations

import json
import os
import pickle

import pytest
import torch

from tests.unit.test_checkpoint import _fake_step, _single_process
from titanext._safe_load import plain_state
from titanext.errors import CheckpointUnsafe


class Payload:
    """Unpickling this creates ``marker``: proof that code from the checkpoint ran."""

    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return (os.makedirs, (self.marker,))


def _saved(tmp_path):
    model, opt, sched, loader, ckpt = _single_process(tmp_path / "ckpt")
    _fake_step(model, opt, sched, loader)
    ckpt.save(1)
    return tmp_path / "ckpt" / "step-1"


def _plant(step, name: str, write) -> None:
    """Rewrite ``name`` in the step folder and its size in the manifest (as an attacker would)."""
    write(step / name)
    manifest = json.loads((step / "manifest.json").read_text())
    manifest["files"][name] = os.path.getsize(step / name)
    (step / "manifest.json").write_text(json.dumps(manifest))


def _resume(tmp_path):
    return _single_process(tmp_path / "ckpt")[-1].load()


@pytest.mark.parametrize("name", ["trainer_state.pt", "rng-0.pt", ".metadata"])
def test_a_planted_payload_is_refused_by_name_and_never_runs(tmp_path, name):
    step, marker = _saved(tmp_path), str(tmp_path / "payload-ran")

    def write(path):
        if name == ".metadata":  # a plain pickle, read by DCP with pickle.load
            path.write_bytes(pickle.dumps(Payload(marker)))
            return
        state = torch.load(path, weights_only=True)
        state.setdefault("extra", {})["planted"] = Payload(marker)
        torch.save(state, path)

    _plant(step, name, write)
    with pytest.raises(CheckpointUnsafe, match=rf"{name}.*needs code to load.*makedirs.*"
                                               r"never runs code from a checkpoint"):
        _resume(tmp_path)
    assert not os.path.exists(marker)


def test_plain_state_written_before_the_rule_loads_and_resumes_bitwise(tmp_path):
    step = _saved(tmp_path)
    # as the old code wrote it: torch.save of the state dicts as they came
    _plant(step, "trainer_state.pt",
           lambda p: torch.save(torch.load(p, weights_only=True), p))
    model, opt, sched, loader, ckpt = _single_process(tmp_path / "ckpt", seed=1)
    assert ckpt.load() == 1 and loader.position == 8 and sched.last_epoch == 1


class Opaque:
    pass


class HoldsAnObject:
    def state_dict(self):
        return {"ok": [1, 2.0, "x", torch.ones(2)], "cache": {"thing": Opaque()}}

    def load_state_dict(self, state):
        pass


def test_state_that_is_not_plain_data_is_refused_when_saving(tmp_path):
    model, opt, sched, loader, ckpt = _single_process(
        tmp_path / "ckpt", extra_states={"mine": HoldsAnObject()})
    with pytest.raises(CheckpointUnsafe, match=r"extra_states\['mine'\].state_dict\(\)"
                                               r"\['cache'\]\['thing'\] holds a .*Opaque"):
        ckpt.save(1)
    assert not (tmp_path / "ckpt" / "step-1").exists()
    np = pytest.importorskip("numpy")
    assert plain_state({"n": np.int64(3), "a": np.ones(2)}, "x")["n"] == 3
