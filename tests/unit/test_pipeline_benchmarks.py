"""benchmarks/pipeline_trainer.py, pipeline_trace.py and pipeline_replay.py: argument handling
and table rows, without running a step (speed stays out of the tests)."""

from __future__ import annotations

import importlib.util
import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _load(name: str):
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))  # pipeline_trace imports its sibling
    try:
        spec = importlib.util.spec_from_file_location(
            f"{name}_cli", os.path.join(ROOT, "benchmarks", f"{name}.py"))
        cli = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(cli)
        return cli
    finally:
        sys.path.remove(os.path.join(ROOT, "benchmarks"))


@pytest.mark.parametrize("args,words", [
    (["--against", "no-such-revision-47"], ["--against no-such-revision-47", "not a revision"]),
    (["--against=--output=x"], ["--against --output=x", "not a revision"]),  # no git option
    (["--rounds", "0"], ["--rounds 0", ">= 1"]),
    (["--warmup", "0"], ["--warmup 0", ">= 1"]),
    (["--schedules", "ZBV,1F1B"], ["--schedules ZBV,1F1B", "1F1B first"]),
    (["--schedules", "1F1B,ZBX"], ["--schedules 1F1B,ZBX", "ZBV"]),
    (["--against", "HEAD", "--profile"], ["--against", "without --profile"]),
])
def test_bad_input_exits_2_with_one_line_before_any_work(args, words, capsys):
    code = _load("pipeline_trainer").main(args)
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1, err
    assert all(w in err[0] for w in words), err


@pytest.mark.parametrize("args,words", [
    (["--steps", "4", "--measured", "4"], ["--measured 4", "= 3"]),
    (["--steps", "1"], ["--steps 1", ">= 2"]),
    (["--schedules", "1F1B,ZB"], ["--schedules 1F1B,ZB", "ZBV"])])
def test_trace_bad_input_exits_2_with_one_line(args, words, capsys):
    assert _load("pipeline_trace").main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and all(w in err[0] for w in words), err


def test_against_rows_pair_runs_by_turn():
    """Ratios to 1F1B are per run, then the median and min-max over runs; the step against the
    other tree pairs the runs of one turn."""
    cli = _load("pipeline_trainer")
    runs = {"this tree": [{"1F1B": 2.0, "ZBV": 1.8}, {"1F1B": 3.0, "ZBV": 2.4}],
            "abc1234": [{"1F1B": 2.0, "ZBV": 2.0}, {"1F1B": 2.5, "ZBV": 2.5}]}
    rows = cli.against_rows(runs, ["1F1B", "ZBV"])
    assert [(r["schedule"], r["tree"]) for r in rows] == [
        ("1F1B", "this tree"), ("1F1B", "abc1234"), ("ZBV", "this tree"), ("ZBV", "abc1234")]
    zbv_here, zbv_there = rows[2], rows[3]
    assert zbv_here["vs 1F1B"] == "0.850x" and zbv_here["spread over runs"] == "0.800-0.900x"
    assert zbv_there["vs 1F1B"] == "1.000x" and zbv_there["spread over runs"] == "1.000-1.000x"
    assert zbv_here["step vs abc1234"] == "0.930x (0.900-0.960)"  # 1.8/2.0, 2.4/2.5
    assert rows[0]["step vs abc1234"] == "1.100x (1.000-1.200)"
    assert zbv_there["step vs abc1234"] == ""
    assert zbv_here["step (s)"] == "2.100" and zbv_here["tokens/s"] == f"{16 * 512 / 2.1:,.0f}"


def test_trace_rows_add_up():
    """Chunks + waits + runtime between chunks = the pipeline; idle = 1 - chunks / pipeline."""
    cli = _load("pipeline_trace")
    rank = {"step": [1.0, 1.2], "faults": 3000.0, "sim": 0.05,
            "wall": {"pipeline": 1.8, "F": 0.6, "I": 0.5, "W": 0.3, "wait": 0.2,
                     "queue run in W": 0.28, "gc": 0.01},
            "cpu": {"F": 0.5, "I": 0.5, "W": 0.3}, "count": {"gc": 2}}
    rows = {r["ms per step"].strip(): r["rank 0"] for r in cli.trace_rows([rank], 2)}
    assert rows["step (slowest rank)"] == "1,100.0" and rows["pipeline"] == "900.0"
    assert rows["outside the pipeline"] == "200.0"
    assert rows["F chunks"] == "300.0" and rows["off-CPU in chunks"] == "50.0"
    assert rows["W: queue run"] == "140.0" and rows["W: torch's W step around it"] == "10.0"
    assert rows["waits on send / recv"] == "100.0" and rows["runtime between chunks"] == "100.0"
    assert rows["idle % measured"] == "22.2" and rows["idle % simulated"] == "5.0"
    assert rows["gc passes / step"] == "1.0" and rows["page faults / step (x1000)"] == "3.0"
    assert rows["pipeline simulated"] == "736.8"  # 700 ms of chunks / (1 - 0.05)


def test_trace_summary_splits_the_lead_into_order_and_compute():
    """The side-by-side table: measured, simulated (each schedule's own chunk costs replayed)
    and compute ratios to 1F1B, from every rank's raw figures."""
    cli = _load("pipeline_trace")

    def rank(step, pipeline, chunks, sim):
        return {"step": [step, step], "sim": sim, "wall": {"pipeline": pipeline, "F": chunks}}

    one = [rank(2.0, 3.6, 3.0, 0.1), rank(2.0, 3.6, 2.8, 0.2)]
    zbv = [rank(1.9, 3.4, 3.2, 0.0), rank(1.9, 3.4, 3.0, 0.05)]
    figs = {"1F1B": cli._figures(one, 2), "ZBV": cli._figures(zbv, 2)}
    # the slowest rank's replay (rank 1: 1,400 ms / 0.8) plus the time outside (2,000 - 1,800)
    assert figs["1F1B"]["sim"] == 1750 + 200 and figs["ZBV"]["sim"] == 1600 + 200
    rows = {r["schedule"]: r for r in cli.summary_rows(figs)}
    assert rows["1F1B"]["vs 1F1B"] == "1.000x" and rows["ZBV"]["vs 1F1B"] == "0.950x"
    assert rows["ZBV"]["simulated vs 1F1B"] == f"{1800 / 1950:.3f}x"
    assert rows["ZBV"]["compute vs 1F1B"] == f"{3100 / 2900:.3f}x"


@pytest.mark.parametrize("args,words", [
    (["--schedules", "ZBV,1F1B"], ["--schedules ZBV,1F1B", "1F1B first"]),
    (["--rank", "2"], ["--rank 2", "0 to 1"]),
    (["--rounds", "0"], ["--rounds 0", ">= 1"]),
])
def test_replay_bad_input_exits_2_with_one_line(args, words, capsys):
    assert _load("pipeline_replay").main(args) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and all(w in err for w in words), err


def test_replay_runs_each_rank_its_own_list():
    replay = _load("pipeline_replay")
    zbh1 = replay.rank_actions("ZBH1", 1)
    assert zbh1[:5] == [("F", 1, 0), ("I", 1, 0), ("F", 1, 1), ("I", 1, 1), ("W", 1, 0)]
    for rank in (0, 1):  # every micro-batch once per kind and stage: F, then I, then W
        acts = replay.rank_actions("ZBV", rank)
        for s in {s for _, s, _ in acts}:
            for mb in range(replay.MICROBATCHES):
                assert [k for k, st, m in acts if (st, m) == (s, mb)] == ["F", "I", "W"]
    with pytest.raises(ValueError, match="DualPipe: rank 0 runs"):
        replay.rank_actions("DualPipe", 0)
