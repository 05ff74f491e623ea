"""benchmarks/side_by_side.py (its variants: benchmarks/side_by_side_variants.py) at CPU sizes on
one pooled rank: every variant that can run here runs, the plain loop computes what the trainer
computes (same first loss), torchtitan's row says why it did not run, and the JSON holds the
figures. No timing is asserted (CPU)."""

from __future__ import annotations

import importlib.util
import json
import os

import pytest

from tests.spawn import run_distributed

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _load(name: str, file: str):
    spec = importlib.util.spec_from_file_location(name, os.path.join(ROOT, "benchmarks", file))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _load_cli():
    return _load("side_by_side_cli", "side_by_side.py")


def _cli(rank: int, world_size: int, path: str, wheels: str, out_dir: str) -> dict:
    OUT_ENV = _load("side_by_side_variants", "side_by_side_variants.py").OUT_ENV

    os.environ[OUT_ENV] = out_dir  # the traced step's files (the pool restores the environment)
    code = _load_cli().main(["--tiny", "--rounds", "1", "--json", path, "--wheels", wheels])
    with open(path, encoding="utf-8") as f:
        return {"code": code, **json.load(f)}


@pytest.mark.parametrize("args,key", [
    (["--rounds", "0"], "--rounds"), (["--batch", "x"], "--batch"),
    (["--warmup", "-1"], "--warmup"), (["--flavor", "3B"], "--flavor")])
def test_bad_input_exits_2_naming_the_key_before_any_work(args, key, capsys):
    """A zero-round run ended in a StatisticsError traceback after building every variant."""
    with pytest.raises(SystemExit) as exit_:
        _load_cli().main(args)
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert exit_.value.code == 2 and f"argument {key}:" in err and args[1] in err, err


def test_tiny_side_by_side(tmp_path):
    empty = tmp_path / "no-wheels"
    empty.mkdir()
    out = run_distributed(_cli, 1, args=(str(tmp_path / "sbs.json"), str(empty),
                                         str(tmp_path / "out")), timeout_s=120)[0]
    by = {r["name"]: r for r in out["rows"]}
    assert out["code"] == 0, [(r["name"], r["note"]) for r in out["rows"]]
    for name in ("titanext", "plain"):
        row = by[f"side-by-side {name}"]
        assert row["status"] == "measured" and row["data"]["tokens_per_s"] > 0, row
        assert len(row["data"]["losses"]) == 2  # one warm-up step, one round
    # the same weights and batch, fp32 on CPU: the same first loss
    check = by["side-by-side plain first loss vs titanext"]
    assert check["status"] == "pass" and check["data"]["rel_err"] <= 1e-5, check
    tt = by["side-by-side torchtitan"]
    assert tt["status"] == "skipped" and tt["note"].startswith("not run: torchtitan"), tt
    assert "no wheel in" in tt["note"] and "ModuleNotFoundError" in tt["note"], tt
    assert by["side-by-side titanext / plain"]["data"]["target"] == 0.98
    assert "side-by-side titanext / torchtitan" not in by
    # one more titanext step, traced after the timed rounds: its phases from the Chrome trace
    traced = by["side-by-side titanext: where a step went (ms)"]
    breakdown = traced["data"]["breakdown"]
    assert breakdown["step_ms"] > 0 and {"forward", "backward", "optimizer"} <= set(
        breakdown["phases"]), breakdown
    assert (tmp_path / "out" / "titanext_step_trace.json").stat().st_size > 0
    assert "Self CPU" in (tmp_path / "out" / "titanext_top_ops.txt").read_text()


def _plain_fails_at_step_2(rank: int, world_size: int, wheels: str) -> list:
    import torch

    from titanext.gpucheck._common import Ctx

    side_by_side = _load("side_by_side_variants", "side_by_side_variants.py")

    real = side_by_side._Plain._step

    def step(self):
        if len(self.losses) == 1:
            raise RuntimeError("CUDA out of memory (simulated)")
        return real(self)

    side_by_side._Plain._step = step
    try:
        return side_by_side.measure_side_by_side(Ctx(torch.device("cpu"), True),
                                                 ("debugmodel", 2, 32, 1, 2), wheels)
    finally:
        side_by_side._Plain._step = real


def test_a_variant_failing_at_a_step_drops_out_alone(tmp_path):
    rows = run_distributed(_plain_fails_at_step_2, 1, args=(str(tmp_path),), timeout_s=120)[0]
    by = {r.name: r for r in rows}
    assert by["side-by-side titanext"].status == "measured"
    assert len(by["side-by-side titanext"].data["losses"]) == 3
    plain = by["side-by-side plain"]
    assert plain.status == "FAIL" and plain.note == (
        "failed at step 2: RuntimeError: CUDA out of memory (simulated)"), plain
    assert "side-by-side titanext / plain" not in by
