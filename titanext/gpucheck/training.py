"""The trainer on one device: a few steps of the debug and 1B flavors with compile, activation
checkpointing and float8 against fp32 eager; tokens/s, MFU and peak memory against the planner."""

from __future__ import annotations

import contextlib
import gc
import io
import logging
import time

import torch

from titanext.components.metrics import device_peak_flops
from titanext.config import load_config
from titanext.gpucheck._common import Ctx, Row, rel_err
from titanext.gpucheck.kernels import torchao_available

__all__ = ["FLAVORS", "check_trainer", "measure_trainer", "trainer_overrides"]

SECTION_CHECK, SECTION_MEASURE = "check", "measure"

#: flavor: (local batch, seq_len, steps) on a GPU; the CPU run (quick) uses the debug flavor only
FLAVORS = {"debugmodel": (8, 256, 5), "1B": (2, 2048, 3)}


def trainer_overrides(flavor: str, batch: int, seq: int, steps: int, *, fp32: bool,
                      compile_: bool, ac: str, float8: str | None) -> list[str]:
    """Command-line overrides of one single-device run on synthetic tokens."""
    return [
        f"--model.flavor={flavor}", "--training.dataset=synthetic",
        f"--training.local_batch_size={batch}", f"--training.seq_len={seq}",
        f"--training.steps={steps}", "--training.seed=7", "--optimizer.lr=3e-4",
        "--lr_scheduler.warmup_steps=1", "--metrics.enable_tensorboard=false",
        "--metrics.log_freq=1000", "--training.max_norm=1.0",
        f"--training.mixed_precision_param={'float32' if fp32 else 'auto'}",
        f"--compile.enable={str(compile_).lower()}", f"--activation_checkpoint.mode={ac}",
        *(["--float8.enable=true", f"--float8.recipe={float8}", "--float8.filter_fqns=output",
           "--float8.emulate=auto"] if float8 else []),
    ]


def _run(overrides: list[str], steps: int, ctx: Ctx) -> dict:
    """Build a Trainer, run ``steps`` steps; losses, per-step seconds, peak memory, MFU inputs."""
    from titanext.trainer import Trainer

    cfg = load_config(None, overrides, world_size=1)
    if ctx.cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    with contextlib.redirect_stdout(io.StringIO()):
        trainer = Trainer(cfg)
    losses, seconds = [], []
    for _ in range(steps):
        batches = trainer.next_microbatches()
        ctx.sync()
        t0 = time.perf_counter()
        loss, _ = trainer.train_step(batches)
        ctx.sync()
        seconds.append(time.perf_counter() - t0)
        losses.append(loss)
    t = cfg.training
    out = {"cfg": cfg, "losses": losses, "seconds": seconds,
           "tokens_per_step": t.local_batch_size * t.seq_len,
           "flops_per_token": trainer.model.num_flops_per_token(t.seq_len),
           "peak_bytes": torch.cuda.max_memory_allocated() if ctx.cuda else None}
    del trainer
    gc.collect()
    return out


def _float8_recipe(ctx: Ctx) -> str | None:
    if torchao_available():
        return "tensorwise"
    return "blockwise" if ctx.cuda else None  # blockwise runs without torchao


def check_trainer(ctx: Ctx) -> list[Row]:
    """Per flavor: fp32 eager against fp32 with compile + selective AC + float8, step by step."""
    rows = []
    logging.getLogger("titanext").setLevel(logging.ERROR)
    for flavor in (("debugmodel",) if ctx.quick else FLAVORS):
        batch, seq, steps = (4, 64, 3) if ctx.quick else FLAVORS[flavor]
        recipe = _float8_recipe(ctx)
        ref = _run(trainer_overrides(flavor, batch, seq, steps, fp32=True, compile_=False,
                                     ac="none", float8=None), steps, ctx)
        # (CPU-sized runs leave compile out: it is the slow part there, and the suite tests it)
        variants = {("AC(selective)" if ctx.quick else "compile + AC(selective)"):
                    dict(compile_=not ctx.quick, ac="selective", float8=None),
                    "AC(full) + float8": dict(compile_=False, ac="full", float8=recipe)}
        for what, kw in variants.items():
            if kw["float8"] is None and "float8" in what:
                rows.append(Row(SECTION_CHECK, f"trainer {flavor}: {what}", "skipped",
                                note="skipped: torchao missing (pip install torchao)"))
                continue
            got = _run(trainer_overrides(flavor, batch, seq, steps, fp32=True, **kw), steps, ctx)
            err = rel_err(torch.tensor(got["losses"]), torch.tensor(ref["losses"]))
            tol = 2e-2 if kw["float8"] else 1e-4
            rows.append(Row(
                SECTION_CHECK, f"trainer {flavor}: {what}", "pass" if err <= tol else "FAIL",
                value=f"{err:.1e}", target=f"<= {tol:g} (losses vs fp32 eager)",
                note=f"{steps} steps {batch}x{seq}; losses "
                     + " ".join(f"{x:.4f}" for x in got["losses"])
                     + (f"; float8 {kw['float8']}" if kw["float8"] else ""),
                data={"losses": got["losses"], "reference": ref["losses"]}))
    return rows


def measure_trainer(ctx: Ctx) -> list[Row]:
    """The 1B flavor in bf16 (autocast on one device) with compile and selective AC: tokens/s,
    MFU against the device's bf16 peak, and peak memory against the planner's estimate."""
    from titanext.planning.estimate import plan_config
    from titanext.planning.hardware import DEVICES

    ctx.need_cuda("tokens/s and memory of the 1B flavor")
    batch, seq, _ = FLAVORS["1B"]
    steps = 12
    rows = []
    f8 = _float8_recipe(ctx)
    for recipe in (None, *([f8] if f8 else [])):
        label = f"float8 {recipe}" if recipe else "bf16"
        run = _run(trainer_overrides("1B", batch, seq, steps, fp32=False, compile_=True,
                                     ac="selective", float8=recipe), steps, ctx)
        step_s = sorted(run["seconds"][3:])[len(run["seconds"][3:]) // 2]
        tps = run["tokens_per_step"] / step_s
        peak = device_peak_flops(ctx.device)
        mfu = 100 * run["flops_per_token"] * tps / peak if peak else None
        rows.append(Row(SECTION_MEASURE, f"1B trainer {label}: tokens/s, MFU", "measured",
                        value=f"{tps:,.0f} tok/s, MFU {mfu:.1f}%" if mfu else f"{tps:,.0f} tok/s",
                        note=f"median of steps 4-{steps}, {batch}x{seq}, compile + AC(selective)",
                        data={"tokens_per_s": tps, "mfu_pct": mfu, "step_s": step_s}))
        if recipe is None:
            name = torch.cuda.get_device_name(ctx.device)
            dev = DEVICES["h200"] if "H200" in name else DEVICES["h100"]
            plan = plan_config(run["cfg"], 1, device=dev)
            ratio = plan.memory_total / run["peak_bytes"]
            rows.append(Row(
                SECTION_MEASURE, "1B planner memory vs max_memory_allocated", "measured",
                value=f"plan {plan.memory_total / 2**30:.1f} GiB / measured "
                      f"{run['peak_bytes'] / 2**30:.1f} GiB = {ratio:.2f}",
                target="within 15%",
                note=", ".join(f"{k} {v / 2**30:.1f}" for k, v in plan.memory.items()),
                data={"plan_bytes": plan.memory_total, "measured_bytes": run["peak_bytes"],
                      "plan": plan.memory}))
    return rows
