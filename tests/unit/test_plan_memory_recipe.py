"""The planner's terms for issue 45's memory recipe, one process: bf16 optimizer moments
([optimizer] state_dtype), the SMs charged to communication (titanext-plan --comm-sms) and
recompute by module ([activation_checkpoint] mode = "modules"). Their agreement with the dry run
is in tests/e2e/test_dry_run.py (test_memory_recipe_dry_run_is_where_the_planner_says)."""

from __future__ import annotations

import pytest

from titanext.config import load_config
from titanext.planning.advice import advise
from titanext.planning.cli import main
from titanext.planning.estimate import plan_config
from titanext.planning.hardware import DEVICES
from titanext.planning.layout import resolve_layout
from titanext.planning.memory import optimizer_step_bytes
from titanext.planning.recompute import drop_bytes

BASE = ["--model.flavor=debugdeepseek", "--training.seq_len=512", "--training.local_batch_size=2",
        "--training.mixed_precision_param=bfloat16"]


def _plan(*over: str, world: int = 2, **kw):
    return plan_config(load_config(None, [*BASE, *over], world_size=world), world, **kw)


def test_bf16_moments_halve_the_optimizer_state_and_add_the_step_copies():
    fp32 = _plan("--optimizer.implementation=fused")
    bf16 = _plan("--optimizer.implementation=fused", "--optimizer.state_dtype=bfloat16")
    tensors = fp32.memory["optimizer (Adam)"] - 2 * (fp32.memory["optimizer (Adam)"]
                                                     - bf16.memory["optimizer (Adam)"])
    assert 0 < tensors < 4 * 100  # what is left: the 4-byte step counters
    # fused fp32 moments allocate nothing more in the step; bf16 ones copy the largest tensor
    step = {}
    for dtype in ("float32", "bfloat16"):
        cfg = load_config(None, [*BASE, "--optimizer.implementation=fused",
                                 f"--optimizer.state_dtype={dtype}"], world_size=2)
        step[dtype] = optimizer_step_bytes(resolve_layout(cfg, 2), 0.0, 0.0)
    embedding = 264 * 64 / 2  # the largest tensor, sharded over 2 ranks
    assert step == {"float32": 0.0, "bfloat16": 12 * embedding}
    # 120 bytes per element against the fused step's 40
    assert bf16.time["optimizer_s"] == pytest.approx(3 * fp32.time["optimizer_s"])


def test_comm_sms_slow_only_the_overlapped_stages():
    path = "train_configs/deepseek_v3_671b.toml"
    cfg = load_config(path, [], world_size=2048)
    free = plan_config(cfg, 2048, device=DEVICES["h800"], comm_sms=0)
    charged = plan_config(cfg, 2048, device=DEVICES["h800"], comm_sms=20)
    # every stage holds a MoE block except the first (3 dense blocks): 132 / 112 as long
    ratio = [c[0] / f[0] for c, f in zip(charged.time["stage_f_i_w_s"],
                                        free.time["stage_f_i_w_s"], strict=True)]
    assert ratio[0] == pytest.approx(1.0) and ratio[1:] == pytest.approx([132 / 112] * 15)
    assert 1.05 < charged.time["step_s"] / free.time["step_s"] < 132 / 112
    off = load_config(path, ["--parallelism.expert_parallel_comm_overlap=false"], world_size=2048)
    assert (plan_config(off, 2048, comm_sms=20).time["step_s"]
            == plan_config(off, 2048, comm_sms=0).time["step_s"])  # nothing overlaps


def test_bad_comm_sms_is_one_line_and_exit_2(capsys):
    assert main(["--world-size", "8", "--device", "h800", "--comm-sms", "132"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["titanext-plan: error: --comm-sms = 132 must be in [0, 132) (H800 SXM has 132 "
                   "SMs)"]


def test_recompute_by_module_drops_what_each_choice_stops_saving():
    none = _plan("--activation_checkpoint.mode=none").memory["activations"]
    layernorm = _plan("--activation_checkpoint.mode=modules",
                      "--activation_checkpoint.recompute_modules=layernorm")
    # 3 blocks of debugdeepseek (dim 64), 2 norms each: (4 + 2) 64 + 4 bytes a token, 1024 tokens
    assert none - layernorm.memory["activations"] == pytest.approx(3 * 2 * 388 * 1024)
    assert drop_bytes(("moe_act",), h=7168, a=2, mla=(1536, 512, 128, 64, 128), heads=128,
                      ffn=0, moe=(8, 2048, 2048)) == 2 * 8 * 2048  # w2's weighted input
    # the rerun lengthens the backward's input-gradient pass only
    base, rerun = _plan().time["stage_f_i_w_s"][0], layernorm.time["stage_f_i_w_s"][0]
    assert rerun[0] == base[0] and rerun[2] == base[2] and rerun[1] > base[1]


def test_float8_storage_keeps_one_byte_and_an_exponent_per_128_values():
    none = _plan().memory["activations"]
    stored = _plan("--activation_checkpoint.float8_storage=attention_out_input,"
                   "expert_up_proj_input").memory["activations"]
    # debugdeepseek: wo's input 4 heads x 12 = 48 values in 3 blocks, 2 routed rows of 64 in 2
    row = lambda d: 2 * d - (d + -(-d // 128))  # noqa: E731
    assert none - stored == pytest.approx(1024 * (3 * row(48) + 2 * 2 * row(64)))


def test_the_advice_tries_recompute_by_module():
    """The advice's search has six recompute levels: full, selective, modules (the config's
    ``recompute_modules``, unset: DeepSeek-V3's default) with 2, 1 or 0 ``full_blocks`` a
    stage, and none. On debugdeepseek "modules" layouts are advised (also with full_blocks),
    each validating with its overrides; from a config that sets
    ``recompute_modules`` and ``float8_storage``, the other levels clear those lists (a full
    recompute with them set is a config error). Shown failing without "modules" in the levels:
    no modules layout advised."""
    base = ["--model.flavor=debugdeepseek", "--activation_checkpoint.mode=modules",
            "--activation_checkpoint.recompute_modules=layernorm,moe_act",
            "--activation_checkpoint.float8_storage=attention_out_input"]
    plans = advise("train_configs/debug_moe.toml", base, 8, top=60)
    modes = {(p.layout["ac"], p.layout["full_blocks"]) for p in plans}
    assert {("full", 0), ("modules", 0), ("modules", 1), ("none", 0)} <= modes, modes
    for plan in plans:
        cfg = load_config("train_configs/debug_moe.toml", [*base, *plan.layout["overrides"]],
                          world_size=8)
        ckpt = cfg.activation_checkpoint
        assert (ckpt.mode, ckpt.full_blocks) == (plan.layout["ac"], plan.layout["full_blocks"])
        assert ckpt.recompute_modules == (["layernorm", "moe_act"] if ckpt.mode == "modules"
                                          else [])


def test_dualpipe_holds_pp_plus_one_micro_batches_at_most():
    """DualPipe's published table gives each device PP + 1 micro-batches' activations of one
    stage; the action lists the trainer runs (and the planner replays) hold 16 or 17 at
    pp = 16 (17 on the two middle ranks), whatever the count and the cap on deferred W's."""
    from titanext.schedules import forwards_in_flight

    for m in (32, 120):
        for cap in (0, 2):
            held = forwards_in_flight("DualPipe", pp=16, microbatches=m,
                                      max_pending_weight_grads=cap)
            assert max(held) == 17 and min(held) == 16 and held[7] == held[8] == 17, held
