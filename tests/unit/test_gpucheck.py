"""python -m titanext.gpucheck without a GPU: the torchao rows say "torchao missing" without it, a
wrong kernel fails, an error becomes a row, and the command line's exit codes. The full CPU run
and the trainer rows build a process group: tests/multiprocess/test_gpucheck.py."""

from __future__ import annotations

import json

import pytest
import torch

from titanext.gpucheck import ROWS, kernels, run_gpucheck
from titanext.gpucheck import __main__ as cli

CPU_GROUPS = ["ring", "deferred", "grouped", "float8", "split", "float8_speed", "throughput",
              "ranks"]


def test_every_group_is_known_and_ordered():
    # (the side-by-side benchmark has its own test: tests/multiprocess/test_side_by_side.py)
    assert set(CPU_GROUPS) | {"trainer"} == set(ROWS)


def test_float8_rows_say_torchao_missing(monkeypatch):
    monkeypatch.setattr(kernels, "torchao_available", lambda: False)
    rows = run_gpucheck("cpu", quick=True, only=["float8"])
    status = {r.name: (r.status, r.note) for r in rows}
    for recipe in ("tensorwise", "rowwise", "rowwise_with_gw_hp"):
        assert status[f"float8 {recipe}"] == (
            "skipped", "skipped: torchao missing (pip install torchao; docs/launching.md)")
    assert status["float8 blockwise"][0] == "pass"  # titanext's own: no torchao needed


def test_float8_experts_rows_pass_emulated_and_the_kernels_row_says_why_not():
    rows = {r.name: r for r in run_gpucheck("cpu", quick=True, only=["float8"])}
    for recipe in ("rowwise", "blockwise"):
        assert rows[f"float8 experts {recipe} emulated"].status == "pass"
    kernels_row = rows["float8 experts rowwise kernels"]
    assert kernels_row.status == "skipped" and "compute capability 9.0+" in kernels_row.note


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


def test_ranks_share_a_gpu_only_when_nccl_is_told(monkeypatch):
    from titanext.distributed import process_group as utils

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.delenv("NCCL_MULTI_RANK_GPU_ENABLE", raising=False)
    with pytest.raises(RuntimeError, match="LOCAL_RANK 1, but 1 GPU"):
        utils.local_cuda_index()
    monkeypatch.setenv("NCCL_MULTI_RANK_GPU_ENABLE", "1")
    assert utils.local_cuda_index() == 0
    monkeypatch.setenv("LOCAL_RANK", "0")
    assert utils.local_cuda_index() == 0
