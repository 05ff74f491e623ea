"""benchmarks/side_by_side.py (and gpucheck's side_by_side group) at CPU sizes on one pooled
rank: every variant that can run here runs, the plain loop computes what the trainer computes
(same first loss), torchtitan's row says why it did not run, and the JSON holds the figures.
No timing is asserted (CPU)."""

from __future__ import annotations

import importlib.util
import json
import os

from tests.spawn import run_distributed

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _cli(rank: int, world_size: int, path: str, wheels: str) -> dict:
    spec = importlib.util.spec_from_file_location(
        "side_by_side_cli", os.path.join(ROOT, "benchmarks", "side_by_side.py"))
    cli = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(cli)
    code = cli.main(["--tiny", "--rounds", "1", "--json", path, "--wheels", wheels])
    with open(path, encoding="utf-8") as f:
        return {"code": code, **json.load(f)}


def test_tiny_side_by_side(tmp_path):
    empty = tmp_path / "no-wheels"
    empty.mkdir()
    out = run_distributed(_cli, 1, args=(str(tmp_path / "sbs.json"), str(empty)),
                          timeout_s=120)[0]
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
