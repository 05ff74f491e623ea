"""The planner knows Muon: the busiest owner's Newton-Schulz FLOPs are the runtime owner plan's,
split fused matrices included; the Newton-Schulz seconds and the owner exchange are step-time
terms; the memory row names the optimizer (titanext.planning.muon, estimate, memory)."""

from __future__ import annotations

import pytest

from titanext.components.muon_plan import Piece, plan_owners
from titanext.config import load_config
from titanext.planning.cli import DEVICES, plan_config
from titanext.planning.comm import comm_time
from titanext.planning.layout import resolve_layout
from titanext.planning.muon import (
    FP32_VECTOR_SLOWDOWN,
    busiest_owner_flops,
    muon_matrices,
    ns_seconds,
)

MUON = ["--optimizer.name=Muon"]
SPLIT = ["--optimizer.muon_split_params=layers.*.feed_forward.w1.weight = 512+256"]


def _runtime_busiest(lo, world: int, splits: dict) -> int:
    """max FLOPs of the runtime's plan_owners over FSDP row shards of the same matrices."""
    mats = muon_matrices(lo, lo.pipe.ranks[0])
    pieces = [[] for _ in range(world)]
    for fqn, _, (rows, cols), _ in {m[0]: m for m in mats}.values():
        for r in range(world):
            lo_row, hi_row = r * rows // world, (r + 1) * rows // world
            pieces[r].append(Piece(fqn, (1, rows, cols), (0, lo_row, 0),
                                   (1, hi_row - lo_row, cols)))
    return max(plan_owners(pieces, splits=splits).flops)


@pytest.mark.parametrize("extra,splits", [
    ([], {}), (SPLIT, {f"layers.{i}.feed_forward.w1.weight": (0, (512, 256)) for i in range(6)})])
def test_busiest_owner_is_the_runtime_owner_plans(extra, splits):
    lo = resolve_layout(load_config(None, [*MUON, *extra]), 4)
    planned = busiest_owner_flops(lo, lo.pipe.ranks[0])
    assert planned == _runtime_busiest(lo, 4, splits)
    assert round(busiest_owner_flops(resolve_layout(load_config(None, MUON), 4),
                                     lo.pipe.ranks[0]) / 1e9, 2) == 7.13  # benchmarks/muon.py


def test_muon_terms_are_in_the_step_time():
    device = DEVICES["h100"]
    plan = plan_config(load_config(None, MUON), 4, device=device, efficiency=0.5)
    lo = resolve_layout(load_config(None, MUON), 4)
    ns = busiest_owner_flops(lo, lo.pipe.ranks[0]) / (device.bf16_flops * 0.5)
    assert plan.time["muon_ns_s"] == pytest.approx(ns)
    (row,) = [c for c in plan.comm if c["parallelism"] == "Muon owners (gather + scatter)"]
    assert plan.time["muon_exchange_s"] == pytest.approx(comm_time(row, device))
    fp32 = resolve_layout(load_config(None, [*MUON, "--optimizer.muon_ns_dtype=float32"]), 4)
    assert ns_seconds(fp32, device, 0.5, fp32.pipe.ranks[0]) == pytest.approx(
        FP32_VECTOR_SLOWDOWN * ns)
    adamw = plan_config(load_config(None, []), 4, device=device, efficiency=0.5)
    assert "muon_ns_s" not in adamw.time
    # the step adds the owners' work and the exchange to what the same passes take
    assert plan.time["step_s"] - adamw.time["step_s"] == pytest.approx(
        plan.time["muon_ns_s"] + plan.time["muon_exchange_s"], rel=1e-6)


def test_memory_row_names_the_optimizer():
    assert "optimizer (Muon + AdamW)" in plan_config(load_config(None, MUON), 4).memory
    assert "optimizer (Adam)" in plan_config(load_config(None, []), 4).memory



def test_optimizer_step_moment_holds_the_owners_buffers():
    """The optimizer-step moment with Muon: AdamW's foreach temporary over the other parameters
    plus the busiest owner's buffers (step_bytes), whose return trip grows with the replicas
    (HSDP sends each holder its copy); tests/e2e/test_dry_run.py checks it against the dry run
    and a real run."""
    from titanext.planning.memory import _muon_elements, memory_per_pp_rank
    from titanext.planning.muon import step_bytes

    lo = resolve_layout(load_config(None, MUON), 4)
    rk = lo.pipe.ranks[0]
    local = _muon_elements(lo, rk, 0.0)
    owners = step_bytes(lo, rk, local)
    assert owners >= 4 * local + 2 * local  # the fp32 updates and their bf16 send buffer
    step = memory_per_pp_rank(lo, [1], moment="optimizer step")[0][0]["optimizer step"]
    assert owners < step < owners + 4 * lo.shape.total / 4
    hsdp = resolve_layout(load_config(
        None, [*MUON, "--parallelism.data_parallel_replicate_degree=2"]), 4)
    assert step_bytes(resolve_layout(load_config(None, []), 4), rk, local) == 0.0
    assert step_bytes(hsdp, hsdp.pipe.ranks[0], local) > 0
