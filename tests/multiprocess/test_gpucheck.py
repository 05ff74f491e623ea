"""python -m titanext.gpucheck without a GPU, the parts that train (they build a gloo group, so
they run on one pooled rank): every row's logic runs at CPU sizes, the rows that need CUDA say
so, and the trainer rows follow their one-process reference. The rest:
tests/unit/test_gpucheck.py."""

from __future__ import annotations

import pytest

from tests.spawn import run_distributed
from tests.unit.test_gpucheck import CPU_GROUPS
from titanext.gpucheck import kernels


def _rows(rank: int, world_size: int, only: list[str]) -> list:
    from titanext.gpucheck import run_gpucheck

    return run_gpucheck("cpu", quick=True, only=only)


@pytest.fixture(scope="module")
def cpu_rows():
    return run_distributed(_rows, 1, args=(CPU_GROUPS,), timeout_s=120)[0]


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
    ranks = [r for r in cpu_rows if r.name.startswith("2 ranks on one GPU")]
    assert len(ranks) == 5 and all("needs CUDA" in r.note for r in ranks)
    for name in ("deferred weight grads: linears fp32", "grouped GEMM float32 vs fp32 loop"):
        assert by[name].status == "pass", by[name]
    split = by["deferred split (I+W)/B, one block"]
    assert split.status == "measured" and split.data["B_ms"] > 0


def test_trainer_rows_on_cpu():
    rows = run_distributed(_rows, 1, args=(["trainer"],), timeout_s=120)[0]
    assert [r.status for r in rows] == ["pass"] * 6, [(r.name, r.value, r.note) for r in rows]
    assert [r.name.split(": ")[0] for r in rows] == ["trainer debugmodel"] * 3 + [
        "trainer debugdeepseek"] * 3
    assert all(len(r.data["losses"]) == len(r.data["reference"]) == 3 for r in rows)


def _layouts(rank: int, world_size: int, names: list[str], folder: str) -> dict:
    from titanext.gpucheck.ranks import layout_losses

    return {n: layout_losses(rank, world_size, n, f"{folder}/{n}") for n in names}


@pytest.mark.slow
def test_the_multi_rank_layouts_match_one_process_on_gloo(tmp_path):
    """What each rank of the ``ranks`` group runs on the GPU's NCCL, here on 2 gloo ranks: the
    layouts whose NCCL paths are the most particular (the EP all-to-all, the pipeline's p2p)
    follow one process within the row's tolerance."""
    from titanext.gpucheck.ranks import TOLERANCE

    names = ["EP 2 all-to-all", "PP 2 1F1B"]
    ref = run_distributed(_layouts, 1, args=(names, str(tmp_path / "ref")), timeout_s=120)[0]
    got = run_distributed(_layouts, 2, args=(names, str(tmp_path / "two")), timeout_s=120)
    for name in names:
        assert got[0][name] == got[1][name]
        err = max(abs(a - b) / abs(b) for a, b in zip(got[0][name], ref[name], strict=True))
        assert err <= TOLERANCE, (name, got[0][name], ref[name])
