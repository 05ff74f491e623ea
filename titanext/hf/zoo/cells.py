"""One zoo case: every plugin on one tiny architecture, on the ranks of the default process group
(2 gloo ranks), each against the same model in one process.

A cell is ``exact`` (loss and every gradient within :data:`TOL` of one process, relative), or
``refused`` (the plugin raised a ``ValueError`` / ``NotImplementedError``: a refusal names its
reason), or ``WRONG``: the numbers differ (the figures say by how much and where), a matmul module
is neither converted nor named, or the plugin crashed with an error that does not name its cause
(any other exception: a crash is not a refusal). ``n/a``: the plugin does not apply (EP on a
model without experts).

:func:`certify_rank` is the body a worker runs, ``certify_rank(rank, world_size, model_type,
plugins)``; every rank computes the same verdicts (the float8 / deferral accounting reads rank 0's
log, so take rank 0's result).
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard

from titanext.distributed.split import split_model
from titanext.hf._cp_checks import block_list_path
from titanext.hf.transformers import (
    apply_hf_context_parallel,
    apply_hf_expert_parallel,
    hf_pipeline_stage,
    hf_shard_batch,
    hf_tp_plan,
    stage_ends,
)
from titanext.hf.zoo.configs import SEQ, VARIANTS, VOCAB, build_tiny
from titanext.plugins._loud import matmul_kind
from titanext.plugins.activation_checkpoint import apply_activation_checkpointing
from titanext.plugins.float8 import apply_float8
from titanext.plugins.fsdp import apply_fsdp
from titanext.plugins.tensor_parallel import apply_tensor_parallel
from titanext.plugins.weight_grad import defer_weight_grads

__all__ = ["PLUGINS", "TOL", "block_path", "certify_rank", "certify_type", "matmul_modules",
           "verdict"]

#: the largest relative error (loss, and each parameter's gradient norm) of an exact cell
TOL = 1e-4
BATCH = 2
PLUGINS = ("fsdp", "tp", "cp", "pp_stage", "pp_split", "ep", "ac", "fp8_defer")


class Verdict(Exception):  # noqa: N818 - a cell's outcome raised from deep inside a case
    def __init__(self, kind: str, text: str = ""):
        super().__init__(text)
        self.kind, self.text = kind, text


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    t = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=g)
    return t[:, :-1], t[:, 1:]


def _logits(out) -> torch.Tensor:
    out = getattr(out, "logits", out)
    if isinstance(out, tuple | list):
        out = out[0]
    return out.full_tensor() if isinstance(out, DTensor) else out


def _ce(logits: torch.Tensor, labels: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), reduction=reduction)


def block_path(model: nn.Module) -> str:
    """The dotted path of the decoder block list: the first ``nn.ModuleList`` as long as the
    config's layer count (``model.layers``, ``transformer.h``, ``backbone.layers``, ...)."""
    path = block_list_path(model)
    if path is None:
        raise ValueError(f"{type(model).__name__}: no ModuleList of "
                         f"{model.config.num_hidden_layers} blocks")
    return path


#: a parameter's gradient error is relative to its own norm, or to this fraction of the whole
#: model's gradient norm where its own is smaller: some gradients are zero in exact arithmetic
#: (a key projection's bias: softmax ignores a shift shared by every key) and hold only
#: rounding, against which any other summation order is "100% off"
FLOOR = 1e-3


def _compare(loss: float, grads: dict[str, torch.Tensor], ref: tuple[float, dict]) -> None:
    """Raise the cell's Verdict: exact, or WRONG with the loss error and the worst gradients."""
    ref_loss, ref_grads = ref
    loss_err = abs(loss - ref_loss) / abs(ref_loss)
    total = torch.stack([g.norm() for g in ref_grads.values()]).norm().item() if ref_grads else 0
    errors = {}
    for n, g in ref_grads.items():
        scale = max(g.norm().item(), FLOOR * total)
        got = grads.get(n)
        if got is None:
            errors[n] = float("inf") if g.norm() > FLOOR * total else 0.0
        else:
            errors[n] = (got.float() - g).norm().item() / scale if scale > 0 else 0.0
    worst = sorted(errors.items(), key=lambda kv: -kv[1])[:2]
    if loss_err <= TOL and (not worst or worst[0][1] <= TOL):
        raise Verdict("exact", f"{max(loss_err, worst[0][1] if worst else 0):.0e}")
    figures = ", ".join(f"{n} {e:.2g}" for n, e in worst)
    raise Verdict("WRONG", f"loss {loss_err:.2g}, grads {figures}")


def _full_grads(model: nn.Module) -> dict[str, torch.Tensor]:
    out = {}
    for n, p in model.named_parameters():
        if p.grad is not None:
            g = p.grad
            out[n] = (g.full_tensor() if isinstance(g, DTensor) else g).detach().clone()
    return out


def _reference(model_type: str, variant: str) -> tuple[float, dict]:
    model = build_tiny(model_type, variant)
    x, y = _batch()
    loss = _ce(_logits(model(input_ids=x)), y)
    loss.backward()
    return loss.item(), {n: p.grad.detach().clone() for n, p in model.named_parameters()
                         if p.grad is not None}


def _mean_over_ranks(value: float) -> float:
    t = torch.tensor(value, dtype=torch.float64)
    dist.all_reduce(t)
    return t.item() / dist.get_world_size()


def _rows(x: torch.Tensor) -> torch.Tensor:
    rank, world = dist.get_rank(), dist.get_world_size()
    rows = x.shape[0] // world
    return x[rank * rows:(rank + 1) * rows]


# -- the plugins --------------------------------------------------------------------------------


def _fsdp(model, mesh, ref):

    apply_fsdp(model, mesh, blocks=block_path(model))
    x, y = _batch()
    loss = _ce(_logits(model(input_ids=_rows(x))), _rows(y))
    loss.backward()
    _compare(_mean_over_ranks(loss.item()), _full_grads(model), ref)


def _tp(model, mesh, ref):

    apply_tensor_parallel(model, mesh, plan=hf_tp_plan(model))
    x, y = _batch()
    loss = _ce(_logits(model(input_ids=x)), y)
    loss.backward()
    path = block_path(model) + "."
    split = [n for n, p in model.named_parameters() if n.startswith(path)
             and isinstance(p, DTensor) and any(isinstance(pl, Shard) for pl in p.placements)]
    try:
        _compare(loss.item(), _full_grads(model), ref)
    except Verdict as v:
        if v.kind == "exact" and not split:
            v.text += "; no block weight is split"
        raise


def _cp(model, mesh, ref):

    apply_hf_context_parallel(model, mesh)
    x, y = _batch()
    ids, labels, positions = hf_shard_batch(model, x, y)
    loss = _ce(_logits(model(input_ids=ids, position_ids=positions)), labels)
    loss.backward()
    grads = _full_grads(model)
    for g in grads.values():  # each rank's gradient of its own tokens' mean
        dist.all_reduce(g)
        g /= dist.get_world_size()
    _compare(_mean_over_ranks(loss.item()), grads, ref)


def _composed(stages: list[nn.Module], ref, *, by_keyword: bool) -> None:
    """The stages run one after the other on the whole batch, as a schedule runs them without
    the transport between ranks: what a stage computes (its factors, its layers' indices) is
    what the cell certifies. (Under torch's runtime a stage that crashes ends the process group
    through titanext's fail-safe, and a new group costs a minute on a loaded machine.)"""
    x, y = _batch()
    h = stages[0](input_ids=x) if by_keyword else stages[0](x)
    for stage in stages[1:]:
        h = stage(h, input_ids=x) if by_keyword else stage(h)
    loss = _ce(_logits(h), y)
    loss.backward()
    grads = {n: g for stage in stages for n, g in _full_grads(stage).items()}
    _compare(loss.item(), grads, ref)


def _pp_stage(model, mesh, ref):

    n = dist.get_world_size()
    path = block_path(model)
    blocks = None if path == "model.layers" else path  # the docs: blocks= for other layouts
    stages = [hf_pipeline_stage(model, [1] * n, i, blocks=blocks) for i in range(n)]
    _composed(stages, ref, by_keyword=blocks is not None)


def _pp_split(model, mesh, ref):

    n, path = dist.get_world_size(), block_path(model)
    first, last = stage_ends(model, path.split("."))
    stages = [split_model(model, [1] * n, i, blocks=path, first=first, last=last,
                          skip_missing=True) for i in range(n)]
    _composed(stages, ref, by_keyword=True)


def _has_experts(model: nn.Module) -> bool:
    return any(all(isinstance(getattr(m, a, None), nn.Parameter) and getattr(m, a).dim() == 3
                   for a in ("gate_up_proj", "down_proj")) for m in model.modules())


def _ep(model, mesh, ref):

    if not _has_experts(model):
        raise Verdict("n/a", "no 3-D experts")
    apply_hf_expert_parallel(model, mesh)
    x, y = _batch()
    loss = _ce(_logits(model(input_ids=_rows(x))), _rows(y))
    loss.backward()
    world = dist.get_world_size()
    grads = {}
    for n, p in model.named_parameters():
        if p.grad is None:
            continue
        if isinstance(p.grad, DTensor):  # an expert: every rank's tokens reached it
            grads[n] = p.grad.full_tensor() / world
        else:  # dense: replicated, so average over the ranks as data parallelism does
            g = p.grad.detach().clone()
            dist.all_reduce(g)
            grads[n] = g / world
    _compare(_mean_over_ranks(loss.item()), grads, ref)


def _ac(model, mesh, ref):

    apply_activation_checkpointing(model, mode="full", blocks=block_path(model))
    x, y = _batch()
    loss = _ce(_logits(model(input_ids=x)), y)
    loss.backward()
    _compare(loss.item(), _full_grads(model), ref)


_CONVS = (nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.ConvTranspose1d, nn.ConvTranspose2d,
          nn.ConvTranspose3d)


def matmul_modules(model: nn.Module) -> list[str]:
    """FQNs of the modules that multiply by a parameter of their own: what titanext's converters
    see (``matmul_kind``), plus modules holding a 3-D floating parameter (stacked experts) that
    is not a convolution's kernel (a [1, 1, H] mixing factor, as RWKV's, multiplies no matrix)."""

    out = []
    for fqn, m in model.named_modules():
        own = [p for p in m.parameters(recurse=False) if torch.is_floating_point(p)]
        conv = isinstance(m, _CONVS)
        if matmul_kind(m) in ("linear", "own_forward", "conv1d", "param_matmul", "kept") or (
                not conv and any(p.dim() == 3 and min(p.shape[1:]) > 1 for p in own)):
            out.append(fqn)
    return out


class _Capture(logging.Handler):
    def __init__(self):
        super().__init__(logging.DEBUG)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def _accounted(model: nn.Module, convert: Callable[[nn.Module], Sequence[str]]) -> tuple:
    """(converted, named, unnamed) matmul modules after ``convert(model)``."""
    wanted = matmul_modules(model)
    logger, capture = logging.getLogger("titanext"), _Capture()
    level = logger.level
    logger.addHandler(capture)
    logger.setLevel(logging.DEBUG)
    try:
        converted = set(convert(model))
    finally:
        logger.removeHandler(capture)
        logger.setLevel(level)
    text = "\n".join(capture.lines)
    named = [f for f in wanted if f not in converted
             and re.search(rf"(?<![\w.]){re.escape(f)}(?![\w])", text)]
    unnamed = [f for f in wanted if f not in converted and f not in named]
    return len(converted), len(named), unnamed


def _fp8_defer(model_type: str, variant: str):

    results = []
    for name, convert in (("float8", lambda m: apply_float8(m, emulate=True)),
                          ("defer", defer_weight_grads)):
        converted, named, unnamed = _accounted(build_tiny(model_type, variant), convert)
        if unnamed:
            more = f" (+{len(unnamed) - 3})" if len(unnamed) > 3 else ""
            raise Verdict("WRONG", f"{name}: neither converted nor named: "
                          f"{', '.join(unnamed[:3])}{more}")
        results.append(f"{name} {converted}+{named} named" if named else f"{name} {converted}")
    raise Verdict("exact", "; ".join(results))


_NUMERIC = {"fsdp": _fsdp, "tp": _tp, "cp": _cp, "pp_stage": _pp_stage, "pp_split": _pp_split,
            "ep": _ep, "ac": _ac}


def verdict(e: BaseException) -> tuple[str, str]:
    """A cell's (kind, text) from what its plugin raised."""
    if isinstance(e, Verdict):
        return e.kind, e.text
    line = _first_line(e)
    if isinstance(e, (ValueError, NotImplementedError)):
        return "refused", line
    return "WRONG", f"crash: {type(e).__name__}: {line}"


def _first_line(e: BaseException) -> str:
    lines = [s for s in str(e).strip().splitlines() if s.strip()]
    text = lines[0] if lines else ""
    return text if len(text) <= 200 else text[:197] + "..."


def certify_rank(rank: int, world_size: int, model_type: str,
                 plugins: Sequence[str] = PLUGINS, done: Sequence[tuple[str, str]] = ()) -> dict:
    """Every plugin in ``plugins`` on ``model_type``'s tiny copy, in each of :data:`VARIANTS`,
    except the (variant, plugin) cells in ``done``: ``{plugin: {variant: (kind, text)}}``, and
    ``"_build"`` with the error when the tiny copy cannot be built or run in one process. Runs on
    every rank of the default group. A cell whose failure ends the process group (the pipeline's
    fail-safe does, so that no rank waits on a dead peer) stops the case: the result then holds
    ``"_incomplete": True``, and :func:`certify_type` goes on in a new group."""

    home = dist.group.WORLD
    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("zoo",))
    out: dict = {}
    for variant in VARIANTS:
        try:
            ref = _reference(model_type, variant)
            block_path(build_tiny(model_type, variant))  # every plugin but fp8 needs the blocks
        except Exception as e:  # noqa: BLE001 - the architecture is excluded with the reason
            out["_build"] = f"{type(e).__name__}: {_first_line(e)}"
            return out
        for plugin in plugins:
            if (variant, plugin) in done:
                continue
            try:
                if plugin == "fp8_defer":
                    _fp8_defer(model_type, variant)
                else:
                    _NUMERIC[plugin](build_tiny(model_type, variant), mesh, ref)
                raise AssertionError(f"{plugin} gave no verdict")
            except Exception as e:  # noqa: BLE001 - every outcome is a cell
                out.setdefault(plugin, {})[variant] = verdict(e)
            if not (dist.is_initialized() and dist.group.WORLD is home):
                out["_incomplete"] = True
                return out
    return out


def certify_type(run: Callable[..., list[dict]], model_type: str,
                 plugins: Sequence[str] = PLUGINS) -> dict:
    """Rank 0's :func:`certify_rank` result for ``model_type``, all cells: ``run(model_type,
    plugins, done)`` runs it on every rank of a group (a new one after a case ended its group)
    and returns the per-rank results."""
    result: dict = {}
    done: list[tuple[str, str]] = []
    while True:
        part = run(model_type, tuple(plugins), tuple(done))[0]
        for key, value in part.items():
            if isinstance(value, dict):
                result.setdefault(key, {}).update(value)
                done += [(variant, key) for variant in value]
            elif key != "_incomplete":
                result[key] = value
        if not part.get("_incomplete"):
            return result
