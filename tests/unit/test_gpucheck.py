"""python -m titanext.gpucheck without a GPU: every row's logic runs at CPU sizes, the rows that
need CUDA say so, the torchao rows say "torchao missing" without it, and a wrong kernel fails."""

from __future__ import annotations

import json

import pytest
import torch

from titanext.gpucheck import ROWS, kernels, run_gpucheck
from titanext.gpucheck import __main__ as cli

CPU_GROUPS = ["ring", "deferred", "grouped", "float8", "split", "float8_speed", "throughput"]


@pytest.fixture(scope="module")
def cpu_rows():
    return run_gpucheck("cpu", quick=True, only=CPU_GROUPS)


def test_every_group_is_known_and_ordered():
    assert set(CPU_GROUPS) | {"trainer"} == set(ROWS)


def test_cpu_run_passes_and_skips_only_cuda_rows(cpu_rows):  # (and torchao is installed)
    by = {r.name: r for r in cpu_rows}
    failed = [(r.name, r.note) for r in cpu_rows if r.status == "FAIL"]
    assert not failed, failed
    assert by["float8_speed"].status == "skipped" and "needs CUDA" in by["float8_speed"].note
    for label in ("bf16", "float8 tensorwise"):  # stepped in turns; no MFU without a GPU
        row = by[f"debugmodel trainer {label}: tokens/s, MFU"]
        assert row.status == "measured" and row.data["tokens_per_s"] > 0
    planner = by["debugmodel planner memory vs max_memory_allocated"]
    assert planner.data["plan_bytes"] > 0 and planner.data["measured_bytes"] is None
    ring = [r for r in cpu_rows if r.name.startswith("ring kernels")]
    assert {r.name.split(": ", 1)[1] for r in ring} == set(kernels.RING_CASES)
    assert all(r.status == "pass" for r in ring if "v head dim" not in r.name)
    for name in ("deferred weight grads: linears fp32", "grouped GEMM float32 vs fp32 loop"):
        assert by[name].status == "pass", by[name]
    split = by["deferred split (I+W)/B, one block"]
    assert split.status == "measured" and split.data["B_ms"] > 0


def test_float8_rows_say_torchao_missing(monkeypatch):
    monkeypatch.setattr(kernels, "torchao_available", lambda: False)
    rows = run_gpucheck("cpu", quick=True, only=["float8"])
    status = {r.name: (r.status, r.note) for r in rows}
    for recipe in ("tensorwise", "rowwise", "rowwise_with_gw_hp"):
        assert status[f"float8 {recipe}"] == (
            "skipped", "skipped: torchao missing (pip install torchao; docs/launching.md)")
    assert status["float8 blockwise"][0] == "pass"  # titanext's own: no torchao needed


def test_a_wrong_merge_fails_the_ring_rows(monkeypatch):
    def no_rescale(out, lse, o_blk, lse_blk):  # forgets to reweigh by the log-sum-exps
        out.add_(o_blk.float())
        lse.copy_(torch.logaddexp(lse, lse_blk.float()))

    monkeypatch.setattr(kernels, "_merge", no_rescale)
    rows = run_gpucheck("cpu", quick=True, only=["ring"])
    assert all(r.status == "FAIL" for r in rows if r.status != "skipped"), rows


def test_an_error_becomes_a_fail_row_and_the_run_goes_on(monkeypatch):
    def broken(ctx):
        raise RuntimeError("planted")

    monkeypatch.setattr(kernels, "check_grouped_gemm", broken)
    rows = run_gpucheck("cpu", quick=True, only=["grouped", "deferred"])
    assert [(r.name, r.status) for r in rows][-1] == ("grouped", "FAIL")
    assert rows[-1].note == "RuntimeError: planted" and "planted" in rows[-1].data["traceback"]
    assert all(r.status == "pass" for r in rows[:-1])


def test_trainer_rows_on_cpu():
    rows = run_gpucheck("cpu", quick=True, only=["trainer"])
    assert [r.status for r in rows] == ["pass", "pass"], [(r.name, r.value, r.note) for r in rows]
    assert all(len(r.data["losses"]) == len(r.data["reference"]) == 3 for r in rows)


def test_cli_writes_json_and_exit_codes(tmp_path, capsys):
    out = tmp_path / "check.json"
    assert cli.main(["--only", "grouped", "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    assert data["torch"] == torch.__version__ and data["device"] == "CPU"
    assert [r["status"] for r in data["rows"]] == ["pass"]
    assert "1 rows: 1 passed, 0 failed" in capsys.readouterr().out
    with pytest.raises(SystemExit) as bad:
        cli.main(["--only", "nosuchgroup"])
    assert bad.value.code == 2
    if not torch.cuda.is_available():
        assert cli.main(["--device", "cuda"]) == 2
