"""The planner's EP all-to-all follows the dispatch that runs (issue 34): flat or two-level,
bf16 or float8 rows, and the H800 in the hardware table.

Per MoE block and micro-batch under full AC a rank runs six all-to-alls: the dispatch and the
combine forward, again in the recompute, and their two backwards. Two-level dispatch sends each
token once per destination node over the network (with 8 k bytes of routing beside a dispatch's
rows, and its gradient back) and fans it out on NVLink; float8 dispatch makes the two forward
dispatches' rows dim + dim / 128 bytes.
"""

from __future__ import annotations

import pytest

from titanext.config import load_config
from titanext.planning.cli import plan_config
from titanext.planning.hardware import DEVICES
from titanext.planning.moe import destination_nodes
from titanext.planning.shapes import model_shape

P = "--parallelism."
BASE = ["--model.flavor=deepseek_v3_16b", "--training.seq_len=4096",
        "--training.local_batch_size=1", "--training.global_batch_size=64",
        "--activation_checkpoint.mode=full", "--compile.enable=false",
        P + "expert_parallel_degree=16"]  # 2 nodes of 8 GPUs
TWO = [P + "expert_parallel_dispatch=two_level", P + "expert_parallel_ranks_per_node=8"]
F8 = [P + "expert_parallel_float8_dispatch=true"]


def _ep_rows(extra: list[str]):
    cfg = load_config(None, [*BASE, *extra], world_size=64)
    rows = {c["parallelism"]: c for c in plan_config(cfg, 64).comm
            if c["parallelism"].startswith("EP all-to-all")}
    return rows, plan_config(cfg, 64).time, model_shape(cfg)


def test_two_level_and_float8_dispatch_bytes_follow_the_formulas():
    flat, flat_time, shape = _ep_rows([])
    moe, t, h = shape.moe, 4096, shape.dim
    n_moe, k = len(moe.layer_ids), moe.top_k
    assert flat["EP all-to-all"]["bytes"] == pytest.approx(6 * n_moe * t * k * 15 / 16 * h * 2)
    d = destination_nodes(moe, 2)
    assert d == 2  # no group limit in this flavor: every token may reach both nodes
    far = d * (2 - 1) / 2  # rows per token that cross the network
    for extra, disp_row in (([], 2 * h), (F8, h + -(-h // 128))):
        rows, time, _ = _ep_rows([*TWO, *extra])
        inter, intra = rows["EP all-to-all"], rows["EP all-to-all intra-node"]
        assert (inter["level"], intra["level"]) == ("inter-node", "intra-node")
        # forward + recompute dispatches (with routing), the dispatch's backward (bf16 rows and
        # the routing's gradient), three combines (bf16)
        want = n_moe * t * far * (2 * (disp_row + 8 * k) + (2 * h + 8 * k) + 3 * 2 * h)
        assert inter["bytes"] == pytest.approx(want)
        assert intra["bytes"] == pytest.approx(n_moe * t * k * 7 / 8 * (2 * disp_row + 4 * 2 * h))
        assert inter["bytes"] < flat["EP all-to-all"]["bytes"] / 2
        assert time["step_s"] < flat_time["step_s"]
    flat8, _, _ = _ep_rows(F8)  # flat float8: the two forward dispatches' rows shrink
    per = t * k * 15 / 16
    assert flat8["EP all-to-all"]["bytes"] == pytest.approx(
        n_moe * per * (2 * (h + -(-h // 128)) + 4 * 2 * h))


def test_node_limited_routing_bounds_the_destination_nodes():
    cfg = load_config(None, ["--model.flavor=deepseek_v3_671b"], world_size=2048)
    moe = model_shape(cfg).moe
    assert (moe.groups, moe.limited, moe.top_k) == (8, 4, 8)
    assert destination_nodes(moe, 8) == 4  # one group per node: M = 4
    assert destination_nodes(moe, 16) == 8  # a group spans two nodes: top_k bounds it
    assert destination_nodes(moe, 2) == 2


def test_h800_computes_as_the_h100_with_a_slower_nvlink():
    h100, h800 = DEVICES["h100"], DEVICES["h800"]
    assert (h800.bf16_flops, h800.fp8_flops, h800.hbm_bytes) == (
        h100.bf16_flops, h100.fp8_flops, h100.hbm_bytes)
    assert (h800.intra_bw, h800.inter_bw) == (200e9, 50e9)  # 400 GB/s both ways together


def test_keep_all_to_all_drops_the_recomputed_all_to_alls_and_keeps_their_rows():
    """[activation_checkpoint] keep_all_to_all under full AC: the recompute replays what the
    forward received, so the EP all-to-alls per MoE block and micro-batch go from 6 to 4 (plus
    their count exchanges: 2 -> 1), and each token keeps top_k dispatched rows and top_k expert
    outputs (the dry run measures the same 16 -> 10 calls and +0.0156 GiB on this config)."""
    from titanext.planning.layout import resolve_layout

    base = ["--parallelism.expert_parallel_degree=4", "--activation_checkpoint.mode=full",
            "--training.local_batch_size=8", "--training.seq_len=2048"]
    plans, layouts = {}, {}
    for keep in (False, True):
        cfg = load_config("train_configs/debug_moe.toml",
                          [*base, f"--activation_checkpoint.keep_all_to_all={str(keep).lower()}"],
                          world_size=8)
        plans[keep] = plan_config(cfg, 8, device=DEVICES["h100"])
        layouts[keep] = resolve_layout(cfg, 8)
    rows = {k: next(c for c in p.comm if c["parallelism"] == "EP all-to-all")
            for k, p in plans.items()}
    assert (rows[False]["collectives"], rows[True]["collectives"]) == (16, 10)
    assert rows[True]["bytes"] == pytest.approx(rows[False]["bytes"] * 2 / 3)
    lo = layouts[True]
    shape = lo.shape
    kept = shape.moe.top_k * 2 * shape.dim * lo.a
    assert lo.kept_all_to_all_per_token == kept and layouts[False].kept_all_to_all_per_token == 0
    grew = plans[True].memory_total - plans[False].memory_total
    assert grew == pytest.approx(kept * lo.tokens * shape.n_moe_layers)
