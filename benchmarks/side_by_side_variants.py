"""titanext's trainer against a plain PyTorch loop and torchtitan's trainer path, on one device:
the variants and the torchtitan loader behind ``benchmarks/side_by_side.py`` (harness code, so it
lives here and not in the titanext package).

Same model shape, batch and device; the variants are stepped in turns (A B C A B C ...) and each
reports the median step time after warm-up as tokens/s, MFU (against the device's bf16 peak) and
its own peak memory. Ratios: titanext / plain (target >= 0.98x: the plain loop is the floor of
what any framework adds) and titanext / torchtitan (target >= 1.0x).

- ``titanext``: :class:`titanext.trainer.Trainer` built from a config (compile + op-level
  selective AC, bf16 autocast on one device, fused AdamW).
- ``plain``: the same model code (:mod:`titanext.models.llama`), per-block ``torch.compile``,
  op-level selective AC written with ``torch.utils.checkpoint``, bf16 autocast, fused
  ``torch.optim.AdamW``, gradient clipping; no titanext plugin. It is fed the trainer's own
  batches (each stepped after the trainer's) from the trainer's initial weights, so its first
  loss equals the trainer's (a check row): the two compute the same thing.
- ``torchtitan``: torchtitan's own Llama 3 model (its ``Transformer`` at the same shape), its
  ``apply_ac`` (op-level SAC with its save list) and ``apply_compile``, bf16 autocast and fused
  AdamW, as its trainer does on one GPU. torchtitan and the pure-Python dependencies its
  imports need come as wheels in ``benchmarks/wheels/`` (or ``TITANEXT_TORCHTITAN_WHEELS``),
  unpacked into a temporary directory at run time; where it does not import (a missing
  dependency, the torch here) its row says exactly why instead of failing the run.

``quick`` (the CPU run) uses the debug flavor at 2x64 for a few steps, without compile.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import glob
import os
import statistics
import sys
import tempfile
import time
import zipfile
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from titanext.components.metrics import device_peak_flops
from titanext.gpucheck._common import Ctx, Row, rel_err

__all__ = ["OUT_ENV", "SHAPE", "TARGETS", "VARIANTS", "measure_side_by_side", "torchtitan_import",
           "trace_step"]

SECTION = "measure"
#: (flavor, local batch, seq_len, warm-up steps, timed rounds): on a GPU and quick (CPU)
SHAPE = {"gpu": ("1B", 2, 8192, 3, 8), "quick": ("debugmodel", 2, 64, 1, 2)}
#: below this much GPU memory (an 80 GB card) the three variants run at 2 x SMALL_GPU_SEQ
BIG_GPU_BYTES, SMALL_GPU_SEQ = 100 * 2**30, 4096
#: titanext's tokens/s over each other variant's, at least
TARGETS = {"plain": 0.98, "torchtitan": 1.0}
VARIANTS = ("titanext", "plain", "torchtitan")
#: where the torchtitan wheel is looked for (relative to the repository root)
WHEEL_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "wheels")
SAVE_OPS = ("mm", "addmm", "bmm", "_scaled_dot_product_flash_attention",
            "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention",
            "_scaled_dot_product_flash_attention_for_cpu")
LR, MAX_NORM, SEED = 3e-4, 1.0, 7
#: where the traced step and the memory snapshot go (unset: not taken)
OUT_ENV = "TITANEXT_GPUCHECK_OUT"


class _Variant:
    """One way of training, stepped on demand; keeps its step times, losses and own peak."""

    name = ""

    def __init__(self, ctx: Ctx):
        self.ctx, self.seconds, self.losses, self.peak = ctx, [], [], 0
        self.resident = 0  # bytes this variant keeps between steps (its weights, states)

    def _step(self) -> float:
        raise NotImplementedError

    def step(self) -> None:
        self.ctx.sync()
        if self.ctx.cuda:  # its own peak: the others' memory is constant during its step
            base = torch.cuda.memory_allocated(self.ctx.device)
            torch.cuda.reset_peak_memory_stats(self.ctx.device)
        t0 = time.perf_counter()
        loss = self._step()
        self.ctx.sync()
        self.seconds.append(time.perf_counter() - t0)
        self.losses.append(loss)
        if self.ctx.cuda:
            step_peak = torch.cuda.max_memory_allocated(self.ctx.device) - base
            self.peak = max(self.peak, self.resident + step_peak)


class _Titanext(_Variant):
    name = "titanext"

    def __init__(self, ctx: Ctx, flavor: str, batch: int, seq: int, steps: int):
        super().__init__(ctx)
        import io

        from titanext.config import load_config
        from titanext.gpucheck.training import trainer_overrides
        from titanext.trainer import Trainer

        cfg = load_config(None, trainer_overrides(
            flavor, batch, seq, steps, fp32=False, compile_=not ctx.quick, ac="selective",
            float8=None) + ["--optimizer.implementation=fused"], world_size=1)
        with contextlib.redirect_stdout(io.StringIO()):
            self.trainer = Trainer(cfg)
        self.model = self.trainer.model
        self.batches: list = []  # what it trained on, for the plain loop

    def _step(self) -> float:
        batches = self.trainer.next_microbatches()
        self.batches.append([(x, y) for x, y, *_ in batches])
        return self.trainer.train_step(batches)[0]


def _sac_context_fn(names=SAVE_OPS) -> Callable:
    from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

    ops = {getattr(torch.ops.aten, n).default for n in names if hasattr(torch.ops.aten, n)}

    def policy(ctx, op, *args, **kwargs):
        return CheckpointPolicy.MUST_SAVE if op in ops else CheckpointPolicy.PREFER_RECOMPUTE

    return functools.partial(create_selective_checkpoint_contexts, policy)


class _Loop(_Variant):
    """A model trained by the plainest loop: autocast forward, CE loss, backward, clip, AdamW."""

    def _finish(self, model: nn.Module, batches: Callable[[int], tuple]):
        self.model, self.batches = model, batches
        self.opt = torch.optim.AdamW(model.parameters(), lr=LR, fused=True)
        self.dtype = torch.bfloat16 if self.ctx.cuda else torch.float32

    def _step(self) -> float:
        x, y = (t.to(self.ctx.device, non_blocking=True) for t in self.batches(len(self.losses)))
        with torch.autocast(self.ctx.device.type, dtype=self.dtype,
                            enabled=self.dtype != torch.float32):
            logits = self.model(x)
        loss = F.cross_entropy(logits.flatten(0, 1).float(), y.flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), MAX_NORM, foreach=True)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        return loss.item()


class _Plain(_Loop):
    name = "plain"

    def __init__(self, ctx: Ctx, titanext: _Titanext):
        super().__init__(ctx)
        from torch.utils.checkpoint import checkpoint

        from titanext.models.llama import Transformer

        with torch.device(ctx.device):
            model = Transformer(titanext.model.args)
        model.load_state_dict(titanext.model.state_dict())  # the trainer's initial weights
        context_fn = _sac_context_fn()
        for block in model.layers.values():
            inner = block.forward
            block.forward = functools.partial(checkpoint, inner, use_reentrant=False,
                                              context_fn=context_fn)
            if not ctx.quick:
                block.compile(fullgraph=True)
        self._finish(model, lambda i: titanext.batches[i][0])


def _placeholder_datasets() -> list[str]:
    """torchtitan's data loading imports Hugging Face ``datasets`` at import time; this
    benchmark feeds synthetic tokens and never calls it. Where ``datasets`` is missing (the GPU
    machine), a placeholder that raises on use stands in while torchtitan imports."""
    import importlib.util
    import types

    if importlib.util.find_spec("datasets") is not None:
        return []

    def unavailable(*args, **kwargs):
        raise ImportError("Hugging Face datasets is not installed (placeholder for torchtitan)")

    top, dist = types.ModuleType("datasets"), types.ModuleType("datasets.distributed")
    top.Dataset, top.load_dataset, top.distributed = type("Dataset", (), {}), unavailable, dist
    top.IterableDataset = type("IterableDataset", (), {})
    dist.split_dataset_by_node = unavailable
    sys.modules.update({"datasets": top, "datasets.distributed": dist})
    return ["datasets", "datasets.distributed"]


def torchtitan_import(wheel_dir: str | None = None):
    """torchtitan's llama3 pieces from the wheels in ``wheel_dir`` (torchtitan and the pure-Python
    dependencies its imports need, unpacked into a temporary directory at the end of
    ``sys.path``: installed packages win) or an installed torchtitan: ``(namespace, version)``,
    or ``(None, reason)``."""
    wheel_dir = wheel_dir or os.environ.get("TITANEXT_TORCHTITAN_WHEELS", WHEEL_DIR)
    wheels = sorted(glob.glob(os.path.join(wheel_dir, "*.whl")))
    if wheels and wheel_dir not in _UNPACKED:
        _UNPACKED[wheel_dir] = target = tempfile.mkdtemp(prefix="titanext-tt-")
        for w in wheels:
            with zipfile.ZipFile(w) as z:
                z.extractall(target)
        sys.path.append(target)
    placeholders = _placeholder_datasets()
    try:
        import torchtitan.train  # noqa: F401 -- its trainer's imports: all it needs is here
        from torchtitan.config.job_config import ActivationCheckpoint, Compile
        from torchtitan.distributed.activation_checkpoint import apply_ac
        from torchtitan.models.llama3 import Transformer, TransformerModelArgs
        from torchtitan.models.llama3.infra import parallelize
    except Exception as e:  # noqa: BLE001 -- the reason becomes the row
        found = (f"{len(wheels)} wheels in {os.path.normpath(wheel_dir)}" if wheels
                 else "no wheel in " + os.path.normpath(wheel_dir))
        return None, (f"torchtitan ({found}) does not import with torch {torch.__version__}: "
                      f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")
    finally:
        for name in placeholders:  # torchtitan keeps its references; nothing else sees them
            sys.modules.pop(name, None)
    import importlib.metadata

    try:
        version = importlib.metadata.version("torchtitan")
    except importlib.metadata.PackageNotFoundError:
        version = "?"
    ns = dict(ActivationCheckpoint=ActivationCheckpoint, Compile=Compile, apply_ac=apply_ac,
              Transformer=Transformer, TransformerModelArgs=TransformerModelArgs,
              apply_compile=parallelize.apply_compile,
              save_list=getattr(parallelize, "_op_sac_save_list", None))
    return ns, version + (" (datasets: placeholder)" if placeholders else "")


_UNPACKED: dict[str, str] = {}


class _Torchtitan(_Loop):
    name = "torchtitan"

    def __init__(self, ctx: Ctx, tt: dict, titanext: _Titanext):
        super().__init__(ctx)
        a = titanext.model.args
        args = tt["TransformerModelArgs"](
            dim=a.dim, n_layers=a.n_layers, n_heads=a.n_heads, n_kv_heads=a.n_kv_heads,
            vocab_size=a.vocab_size, multiple_of=a.multiple_of,
            ffn_dim_multiplier=a.ffn_dim_multiplier, norm_eps=a.norm_eps,
            rope_theta=a.rope_theta, max_seq_len=titanext.trainer.cfg.training.seq_len)
        with torch.device(ctx.device), torch.no_grad():
            model = tt["Transformer"](args)
            model.init_weights(buffer_device=ctx.device)
        tt["apply_ac"](model, tt["ActivationCheckpoint"](mode="selective",
                                                         selective_ac_option="op"),
                       model_compile_enabled=not ctx.quick, op_sac_save_list=tt["save_list"])
        if not ctx.quick:
            tt["apply_compile"](model, tt["Compile"](enable=True))
        self._finish(model, lambda i: titanext.batches[i % len(titanext.batches)][0])


def measure_side_by_side(ctx: Ctx, shape: tuple | None = None,
                         wheel_dir: str | None = None) -> list[Row]:
    """The three variants in turns: a row each (tokens/s, MFU, peak memory; or why it did not
    run), the ratio rows against the targets, and the first-loss check of plain against
    titanext. ``shape``: (flavor, batch, seq_len, warm-up, rounds), default :data:`SHAPE`."""
    flavor, batch, seq, warmup, rounds = shape or SHAPE["quick" if ctx.quick else "gpu"]
    if shape is None and ctx.cuda and seq > SMALL_GPU_SEQ and torch.cuda.get_device_properties(
            ctx.device).total_memory < BIG_GPU_BYTES:  # the three at 2 x 8192 need ~100 GiB
        seq = SMALL_GPU_SEQ
    steps = warmup + rounds
    runs: dict[str, _Variant] = {}
    why: dict[str, str] = {}

    def build(name: str, make: Callable[[], _Variant]) -> None:
        before = torch.cuda.memory_allocated(ctx.device) if ctx.cuda else 0
        try:
            run = make()
            run.resident = (torch.cuda.memory_allocated(ctx.device) - before) if ctx.cuda else 0
            runs[name] = run
        except Exception as e:  # noqa: BLE001 -- the reason becomes the row
            why[name] = f"{type(e).__name__}: {(str(e).strip().splitlines() or [''])[0][:300]}"
            gc.collect()
            if ctx.cuda:
                torch.cuda.empty_cache()

    build("titanext", lambda: _Titanext(ctx, flavor, batch, seq, steps + 3))  # + traced
    if "titanext" not in runs:
        return [Row(SECTION, "side-by-side titanext", "FAIL", note=why["titanext"])]
    tx = runs["titanext"]
    build("plain", lambda: _Plain(ctx, tx))  # from the trainer's initial weights
    tt, tt_version = torchtitan_import(wheel_dir)
    if tt is None:
        why["torchtitan"] = f"not run: {tt_version}"
    else:
        build("torchtitan", lambda: _Torchtitan(ctx, tt, tx))
    def step(name: str) -> None:  # a variant that fails (out of memory, say) drops out alone
        try:
            runs[name].step()
        except Exception as e:  # noqa: BLE001 -- the reason becomes the row
            why[name] = (f"failed at step {len(runs[name].seconds) + 1}: {type(e).__name__}: "
                         f"{(str(e).strip().splitlines() or [''])[0][:300]}")
            del runs[name]
            gc.collect()
            if ctx.cuda:
                torch.cuda.empty_cache()

    for name in list(runs):  # warm-up (compiles)
        for _ in range(warmup):
            if name in runs:
                step(name)
    for _ in range(rounds):
        for name in list(runs):
            step(name)
    if "titanext" not in runs:
        return [Row(SECTION, "side-by-side titanext", "FAIL", note=why["titanext"])]
    peak_flops = device_peak_flops(ctx.device) if ctx.cuda else None
    flops_per_token = tx.model.num_flops_per_token(seq)
    tokens = batch * seq
    rows, tps = [], {}
    how = f"{flavor} {batch}x{seq}, {'compile + ' if not ctx.quick else ''}AC(op SAC), " + (
        "bf16 autocast" if ctx.cuda else "fp32") + f", median of {rounds} steps in turns"
    for name in VARIANTS:
        if name not in runs:
            skipped = name == "torchtitan" and why[name].startswith("not run")
            rows.append(Row(SECTION, f"side-by-side {name}", "skipped" if skipped else "FAIL",
                            note=why.get(name, "not built")))
            continue
        run = runs[name]
        step_s = statistics.median(run.seconds[warmup:])
        tps[name] = tokens / step_s
        mfu = 100 * flops_per_token * tps[name] / peak_flops if peak_flops else None
        value = f"{tps[name]:,.0f} tok/s" + (f", MFU {mfu:.1f}%" if mfu else "") + (
            f", peak {run.peak / 2**30:.1f} GiB" if ctx.cuda else "")
        note = how + (f"; torchtitan {tt_version}" if name == "torchtitan" else "")
        rows.append(Row(SECTION, f"side-by-side {name}", "measured", value=value, note=note,
                        data={"tokens_per_s": tps[name], "mfu_pct": mfu, "step_s": step_s,
                              "peak_bytes": run.peak if ctx.cuda else None,
                              "losses": list(run.losses)}))
    if "plain" in runs:  # the same model, weights and batch: the same first loss
        err = rel_err(torch.tensor(runs["plain"].losses[0]), torch.tensor(tx.losses[0]))
        tol = 1e-5 if not ctx.cuda else 2e-2
        rows.append(Row("check", "side-by-side plain first loss vs titanext",
                        "pass" if err <= tol else "FAIL", value=f"{err:.1e}",
                        target=f"<= {tol:g}", data={"rel_err": err}))
    for other, target in TARGETS.items():
        if other in tps:
            ratio = tps["titanext"] / tps[other]
            rows.append(Row(SECTION, f"side-by-side titanext / {other}", "measured",
                            value=f"{ratio:.3f}x", target=f">= {target}x",
                            data={"ratio": ratio, "target": target}))
    out_dir = os.environ.get(OUT_ENV)
    if out_dir:  # after the timed rounds: they stay untraced
        rows += trace_step(ctx, tx, out_dir)
    for run in runs.values():
        run.__dict__.clear()
    gc.collect()
    if ctx.cuda:
        torch.cuda.empty_cache()
    return rows


def trace_step(ctx: Ctx, run: _Variant, out_dir: str) -> list[Row]:
    """One more step of ``run`` under torch.profiler (a Chrome trace, where the step's time
    went by titanext's phases, and the 15 kernels that took longest) and one with the CUDA
    allocator's history recorded (a snapshot for https://pytorch.org/memory_viz), both written
    to ``out_dir``: the evidence for what to make faster and what holds the memory."""
    import json

    from torch.profiler import ProfilerActivity, profile, schedule

    from titanext.components.profiling import dump_cuda_history, record_cuda_history
    from titanext.components.step_table import step_breakdown

    os.makedirs(out_dir, exist_ok=True)
    trace_path = os.path.join(out_dir, f"{run.name}_step_trace.json")
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if ctx.cuda else [])
    sort = "cuda_time_total" if ctx.cuda else "cpu_time_total"
    tables: list[str] = []

    def ready(prof) -> None:  # the traced step's window closes: its trace and its top ops
        prof.export_chrome_trace(trace_path)
        tables.append(prof.key_averages().table(sort_by=sort, row_limit=15))

    with profile(activities=activities, on_trace_ready=ready,
                 schedule=schedule(wait=0, warmup=1, active=1, repeat=1)) as prof:
        for _ in range(2):  # the profiler's warm-up step, then the traced one
            run.step()
            prof.step()
    with open(trace_path, encoding="utf-8") as f:
        b = step_breakdown(json.load(f))
    kernels = tables[0]
    with open(os.path.join(out_dir, f"{run.name}_top_ops.txt"), "w", encoding="utf-8") as f:
        f.write(kernels)
    phases = ", ".join(f"{k} {v:.1f}" for k, v in b["phases"].items())
    rows = [Row(SECTION, f"side-by-side {run.name}: where a step went (ms)", "measured",
                value=f"step {b['step_ms']:.1f}", note=f"{phases}, unaccounted "
                f"{b['unaccounted_ms']:.1f}; trace {os.path.basename(trace_path)}",
                data={"breakdown": {k: v for k, v in b.items() if k != "steps"},
                      "top_ops": kernels})]
    if ctx.cuda:
        snapshot = os.path.join(out_dir, f"{run.name}_memory_snapshot.pickle")
        record_cuda_history(True)
        try:
            run.step()
            dump_cuda_history(snapshot)
        finally:
            record_cuda_history(False)
        rows.append(Row(SECTION, f"side-by-side {run.name}: memory snapshot", "measured",
                        value=f"peak {torch.cuda.max_memory_allocated(ctx.device) / 2**30:.1f} "
                              "GiB", note=os.path.basename(snapshot)))
    return rows
