"""The trainer on one device: a few steps of the debug and 1B flavors with compile, activation
checkpointing and float8 against fp32 eager; tokens/s, MFU and peak memory against the planner."""

from __future__ import annotations

import contextlib
import functools
import gc
import io
import logging
import statistics
import time

import torch

from titanext.components.metrics import device_peak_flops
from titanext.config import load_config
from titanext.gpucheck._common import Ctx, Row, guarded, rel_err
from titanext.gpucheck.kernels import torchao_available
from titanext.planning.estimate import plan_config
from titanext.planning.hardware import DEVICES
from titanext.trainer import Trainer

__all__ = ["FLAVORS", "check_trainer", "measure_trainer", "trainer_overrides"]

SECTION_CHECK, SECTION_MEASURE = "check", "measure"

#: flavor: (local batch, seq_len, steps) on a GPU; the CPU run (quick) uses the debug flavor only
FLAVORS = {"debugmodel": (8, 256, 5), "debugdeepseek": (8, 256, 5), "1B": (2, 2048, 3)}
#: what a flavor's check runs with besides its name: debugdeepseek is MLA + MoE, here with MTP
FLAVOR_OVERRIDES = {"debugdeepseek": ["--model.num_mtp_layers=1"]}


def trainer_overrides(flavor: str, batch: int, seq: int, steps: int, *, fp32: bool,
                      compile_: bool, ac: str, float8: str | None) -> list[str]:
    """Command-line overrides of one single-device run on synthetic tokens."""
    return [
        f"--model.flavor={flavor}", *FLAVOR_OVERRIDES.get(flavor, []),
        "--training.dataset=synthetic",
        f"--training.local_batch_size={batch}", f"--training.seq_len={seq}",
        f"--training.steps={steps}", "--training.seed=7", "--optimizer.lr=3e-4",
        "--lr_scheduler.warmup_steps=1", "--metrics.enable_tensorboard=false",
        "--metrics.log_freq=1000", "--training.max_norm=1.0",
        f"--training.mixed_precision_param={'float32' if fp32 else 'auto'}",
        f"--compile.enable={str(compile_).lower()}", f"--activation_checkpoint.mode={ac}",
        *(["--float8.enable=true", f"--float8.recipe={float8}", "--float8.filter_fqns=output",
           "--float8.emulate=auto"] if float8 else []),
    ]


class _Run:
    """One single-device Trainer built from overrides, stepped on demand (timed, synced)."""

    def __init__(self, overrides: list[str], ctx: Ctx):

        self.ctx, self.cfg = ctx, load_config(None, overrides, world_size=1)
        with contextlib.redirect_stdout(io.StringIO()):
            self.trainer = Trainer(self.cfg)
        t = self.cfg.training
        self.tokens_per_step = t.local_batch_size * t.seq_len
        self.flops_per_token = self.trainer.model.num_flops_per_token(t.seq_len)
        self.losses: list[float] = []
        self.seconds: list[float] = []

    def step(self) -> None:
        batches = self.trainer.next_microbatches()
        self.ctx.sync()
        t0 = time.perf_counter()
        loss, _ = self.trainer.train_step(batches)
        self.ctx.sync()
        self.seconds.append(time.perf_counter() - t0)
        self.losses.append(loss)

    def close(self) -> None:
        del self.trainer
        gc.collect()
        if self.ctx.cuda:
            torch.cuda.empty_cache()


def _run(overrides: list[str], steps: int, ctx: Ctx) -> _Run:
    """Build a Trainer and run ``steps`` steps; its losses and step times stay on the result."""
    run = _Run(overrides, ctx)
    for _ in range(steps):
        run.step()
    run.close()
    return run


def _float8_recipe(ctx: Ctx) -> str | None:
    if torchao_available():
        return "tensorwise"
    return "blockwise" if ctx.cuda else None  # blockwise runs without torchao


def check_trainer(ctx: Ctx) -> list[Row]:
    """Per flavor (debug, debugdeepseek with MTP, 1B): fp32 eager against fp32 with compile +
    selective AC, full AC + float8, and bf16 autocast (the one-device mixed-precision path),
    step by step."""
    rows = []
    logging.getLogger("titanext").setLevel(logging.ERROR)
    for flavor in (("debugmodel", "debugdeepseek") if ctx.quick else FLAVORS):
        batch, seq, steps = (4, 64, 3) if ctx.quick else FLAVORS[flavor]
        recipe = _float8_recipe(ctx)
        ref = _run(trainer_overrides(flavor, batch, seq, steps, fp32=True, compile_=False,
                                     ac="none", float8=None), steps, ctx)
        # (CPU-sized runs leave compile out: it is the slow part there, and the suite tests it)
        variants = {("AC(selective)" if ctx.quick else "compile + AC(selective)"):
                    dict(compile_=not ctx.quick, ac="selective", float8=None),
                    "AC(full) + float8": dict(compile_=False, ac="full", float8=recipe),
                    "bf16 autocast": dict(compile_=False, ac="none", float8=None, fp32=False)}
        for what, kw in variants.items():
            if kw["float8"] is None and "float8" in what:
                rows.append(Row(SECTION_CHECK, f"trainer {flavor}: {what}", "skipped",
                                note="skipped: torchao missing (pip install torchao)"))
                continue
            name = f"trainer {flavor}: {what}"  # one failing row never hides the others
            overrides = trainer_overrides(flavor, batch, seq, steps, **{"fp32": True, **kw})
            rows += guarded(SECTION_CHECK, name, functools.partial(
                _against_eager, ctx, name, ref, overrides, kw["float8"],
                low=bool(kw["float8"]) or kw.get("fp32") is False))  # their rounding
    return rows


def _against_eager(ctx: Ctx, name: str, ref: _Run, overrides: list[str], float8: str | None,
                   *, low: bool) -> Row:
    """One variant's losses against fp32 eager's. Float8 converts every linear but the
    output here (auto_filter off: the small flavors' linears are below its sizes, and the
    check is about numerics, not speed)."""
    steps = len(ref.losses)
    got = _run(overrides + (["--float8.auto_filter=false"] if float8 else []), steps, ctx)
    err = rel_err(torch.tensor(got.losses), torch.tensor(ref.losses))
    tol = 2e-2 if low else 1e-4
    batch, seq = got.cfg.training.local_batch_size, got.cfg.training.seq_len
    return Row(SECTION_CHECK, name, "pass" if err <= tol else "FAIL", value=f"{err:.1e}",
               target=f"<= {tol:g} (losses vs fp32 eager)",
               note=f"{steps} steps {batch}x{seq}; losses "
                    + " ".join(f"{x:.4f}" for x in got.losses)
                    + (f"; float8 {float8}" if float8 else ""),
               data={"losses": got.losses, "reference": ref.losses})


def measure_trainer(ctx: Ctx) -> list[Row]:
    """The 1B flavor (the debug flavor at CPU sizes) with compile and selective AC, bf16
    (autocast on one device) and float8 stepped in turns: tokens/s, MFU against the device's
    bf16 peak; the bf16 run's peak memory (measured before the float8 trainer exists) against
    the planner's estimate."""
    flavor, (batch, seq, _) = ("debugmodel", (2, 64, 0)) if ctx.quick else ("1B", FLAVORS["1B"])
    warmup, rounds = (1, 2) if ctx.quick else (3, 8)
    f8 = _float8_recipe(ctx)
    runs: dict[str, _Run] = {}
    rows: list[Row] = []
    for recipe in (None, *([f8] if f8 else [])):
        if ctx.cuda:
            torch.cuda.reset_peak_memory_stats()
        run = runs[f"float8 {recipe}" if recipe else "bf16"] = _Run(trainer_overrides(
            flavor, batch, seq, warmup + rounds, fp32=False, compile_=not ctx.quick,
            ac="selective", float8=recipe), ctx)
        for _ in range(warmup):  # compiles
            run.step()
        if recipe is None:
            rows.append(_planner_row(ctx, flavor, run))
    for _ in range(rounds):
        for run in runs.values():
            run.step()
    peak = device_peak_flops(ctx.device) if ctx.cuda else None
    for label, run in runs.items():
        step_s = statistics.median(run.seconds[warmup:])
        tps = run.tokens_per_step / step_s
        mfu = 100 * run.flops_per_token * tps / peak if peak else None
        rows.insert(-1 if label == "bf16" else len(rows), Row(
            SECTION_MEASURE, f"{flavor} trainer {label}: tokens/s, MFU", "measured",
            value=f"{tps:,.0f} tok/s" + (f", MFU {mfu:.1f}%" if mfu else ""),
            note=f"median of {rounds} steps in turns, {batch}x{seq}, "
                 f"{'compile + ' if not ctx.quick else ''}AC(selective)",
            data={"tokens_per_s": tps, "mfu_pct": mfu, "step_s": step_s}))
        if ctx.cuda:
            rows.append(_planner_step_row(ctx, flavor, label, run, step_s))
        run.close()
    return rows


def _plan(ctx: Ctx, run: _Run):

    name = torch.cuda.get_device_name(ctx.device) if ctx.cuda else ""
    return plan_config(run.cfg, 1, device=DEVICES["h200" if "H200" in name else "h100"])


def _planner_step_row(ctx: Ctx, flavor: str, label: str, run: _Run, step_s: float) -> Row:
    """The planner's step time of the run against its measured median step."""
    plan = _plan(ctx, run)
    ratio = plan.time["step_s"] / step_s
    return Row(SECTION_MEASURE, f"{flavor} planner step vs measured, {label}", "measured",
               value=f"plan {1e3 * plan.time['step_s']:.1f} ms / measured {1e3 * step_s:.1f} ms"
                     f" = {ratio:.2f}", target="within 15%",
               data={"plan_s": plan.time["step_s"], "measured_s": step_s, "ratio": ratio,
                     "plan_time": {k: v for k, v in plan.time.items()
                                   if isinstance(v, (int, float))}})


def _planner_row(ctx: Ctx, flavor: str, run: _Run) -> Row:
    plan = _plan(ctx, run)
    measured = torch.cuda.max_memory_allocated(ctx.device) if ctx.cuda else None
    value = f"plan {plan.memory_total / 2**30:.2f} GiB"
    if measured:
        value += f" / measured {measured / 2**30:.2f} GiB = {plan.memory_total / measured:.2f}"
    return Row(SECTION_MEASURE, f"{flavor} planner memory vs max_memory_allocated", "measured",
               value=value, target="within 15%",
               note=", ".join(f"{k} {v / 2**30:.2f}" for k, v in plan.memory.items())
               + ("" if measured else "; no CUDA: nothing measured to compare"),
               data={"plan_bytes": plan.memory_total, "measured_bytes": measured,
                     "plan": plan.memory})
