"""The two runs of a parity check: the wired model on every rank, and one plain process.

Both return plain dicts of full tensors keyed by the original model's parameter names, so
:mod:`titanext.parity.report` compares them without knowing how the model was wired.
"""

from __future__ import annotations

import contextlib
import re
import traceback
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.pipelining import PipelineStage
from torch.distributed.tensor import DTensor

from titanext.distributed.failsafe import settle_failure
from titanext.parity.context import DATA_DIMS, ParityContext
from titanext.plugins import context_parallel as cp_plugin
from titanext.plugins import expert_parallel as ep_plugin
from titanext.plugins.replicated_grads import ReplicatedGradCheck

#: Wrapper components that change parameter names but not the model (AC, compile, DDP).
_WRAPPERS = re.compile(r"(^|\.)(_checkpoint_wrapped_module|_orig_mod|_fsdp_wrapped_module)(?=\.)")


def clean_name(name: str) -> str:
    """A parameter or module name without wrapper components (activation checkpointing,
    torch.compile)."""
    return _WRAPPERS.sub(r"\1", name).replace("..", ".").strip(".")


def make_batch(step: int, *, seed: int, batch: int, seq: int, vocab: int):
    """The global batch of ``step``: token ids and next-token labels, [batch, seq] each."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + step)
    tokens = torch.randint(0, vocab, (batch, seq + 1), generator=g)
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def make_optimizer(params, kind: str, lr: float) -> torch.optim.Optimizer:
    if kind == "adamw":
        return torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    return torch.optim.SGD(params, lr=lr)


# -- what the wiring returned ------------------------------------------------------------------

def modules_of(wired: Any) -> list[nn.Module]:
    """The modules holding this rank's parameters: the module itself, or the ``parts`` of a
    pipeline object (titanext's ``PipelineRunner`` and anything with a ``parts`` list)."""
    if isinstance(wired, nn.parallel.DistributedDataParallel):
        return [wired.module]  # its names without DDP's leading "module."
    if isinstance(wired, nn.Module):
        return [wired]
    parts = getattr(wired, "parts", None)
    if isinstance(parts, list | tuple) and all(isinstance(p, nn.Module) for p in parts):
        return list(parts)
    raise ValueError(f"the wiring returned a {type(wired).__name__}: return the nn.Module to "
                     "train, or an object whose .parts lists this rank's modules (a pipeline)")


def find_stages(wired: Any) -> list[PipelineStage]:
    """The ``PipelineStage`` objects reachable from ``wired`` (its attributes, their lists,
    and the attributes of a schedule it holds), two levels deep."""
    found: dict[int, PipelineStage] = {}

    def visit(obj, depth):
        if isinstance(obj, PipelineStage):
            found[id(obj)] = obj
        elif isinstance(obj, list | tuple):
            for x in obj:
                visit(x, depth)
        elif depth > 0 and hasattr(obj, "__dict__") and not isinstance(obj, nn.Module | type):
            for value in vars(obj).values():
                visit(value, depth - 1)

    visit(wired, 2)
    return list(found.values())


def _count_calls(stage: PipelineStage, counter: dict) -> None:
    forward = stage.forward_one_chunk

    def counted(*args, **kwargs):
        counter["stage_forwards"] += 1
        return forward(*args, **kwargs)

    stage.forward_one_chunk = counted


def applied(modules: list[nn.Module]) -> dict:
    """DTensor placements per mesh dim, and converted modules (float8, deferred dW), by the
    type names the converters give them."""
    placements, float8, deferred = {}, [], []
    for module in modules:
        for name, p in module.named_parameters():
            if isinstance(p, DTensor):
                dims = p.device_mesh.mesh_dim_names or tuple(range(p.device_mesh.ndim))
                placements[clean_name(name)] = {str(d): repr(pl)
                                                for d, pl in zip(dims, p.placements)}
        for fqn, m in module.named_modules():
            kind = type(m).__name__
            if "Float8" in kind:
                float8.append(clean_name(fqn))
            elif kind.startswith("Deferred"):
                deferred.append(clean_name(fqn))
    return {"placements": placements, "float8": float8, "deferred": deferred}


# -- full values by original name --------------------------------------------------------------

def _full(value: torch.Tensor, owner: nn.Module | None = None) -> torch.Tensor:
    """The whole value of a parameter or gradient (collective over a DTensor's mesh), in the
    original row order where the owner's TP style permuted it (FusedColwiseParallel)."""
    value = value.full_tensor() if isinstance(value, DTensor) else value
    to_original = getattr(owner, "titanext_to_original", None)
    if to_original is not None:
        value = to_original(value)
    return value.detach().float().clone()


def _named(modules: list[nn.Module]):
    """(clean name, parameter, owning module) of every parameter, once each: through
    ``named_parameters()``, never ``state_dict()`` (hooks may rename or split entries there, as
    torchtitan's fused qkv does)."""
    seen = set()
    for module in modules:
        owners = dict(module.named_modules())
        for name, p in module.named_parameters():
            if id(p) not in seen:
                seen.add(id(p))
                yield clean_name(name), p, owners.get(name.rpartition(".")[0])


def full_params(modules: list[nn.Module], names: set[str]) -> dict[str, torch.Tensor]:
    """Full values of the parameters in ``names`` (collective over DTensor meshes)."""
    return {name: _full(p, owner) for name, p, owner in _named(modules) if name in names}


def full_grads(modules: list[nn.Module], names: set[str]) -> tuple[dict, list[str]]:
    """Full gradients by original name, and the names of parameters without one."""
    grads, missing = {}, []
    with torch.no_grad():
        for name, p, owner in _named(modules):
            grad = p.grad
            if grad is None:
                missing.append(name)
                continue
            if isinstance(p, DTensor) and isinstance(grad, DTensor) and (
                    grad.placements != p.placements):
                grad = grad.redistribute(p.device_mesh, p.placements)
            if name in names:
                grads[name] = _full(grad, owner)
    return grads, sorted(missing)


_DROPOUTS = (nn.Dropout, nn.Dropout1d, nn.Dropout2d, nn.Dropout3d, nn.AlphaDropout,
             nn.FeatureAlphaDropout)


def switch_off_dropout(model: nn.Module) -> list[str]:
    """Set every train-mode dropout of ``model`` to 0: ``nn.Dropout`` modules (and the other
    dropout kinds) and float attributes named ``*dropout*`` / ``*_pdrop`` (functional
    dropout probabilities, as transformers' ``attention_dropout``); returns what was switched,
    as ``name (p=...)``. Both runs draw different random masks, so they could not agree."""
    found = []
    for fqn, m in model.named_modules():
        if isinstance(m, _DROPOUTS) and m.p > 0:
            found.append(f"{fqn or type(model).__name__} (p={m.p:g})")
            m.p = 0.0
            continue
        for attr, value in list(vars(m).items()):
            if (("dropout" in attr or attr.endswith("pdrop")) and isinstance(value, float)
                    and not isinstance(value, bool) and value > 0):
                found.append(f"{fqn + '.' if fqn else ''}{attr} (p={value:g})")
                setattr(m, attr, 0.0)
    return found


def _replicated_check(modules: list[nn.Module], mesh, names: tuple[str, ...]):
    """The replicated-gradient invariant over every mesh dim but pp (stages differ) and ep
    (experts differ); experts split by titanext's EP are checked over tp only."""
    dims = {n: mesh[n] for n in names if n not in ("pp", "ep") and mesh[n].size() > 1}
    experts = {f"{fqn}." for m in modules for fqn, sub in m.named_modules()
               if isinstance(sub, ep_plugin.ExpertParallelExperts)}

    def skip(param: str, dim: str) -> bool:
        return dim != "tp" and any(param.startswith(e) for e in experts)

    return ReplicatedGradCheck(modules, dims, skip=skip)


# -- one check on every rank ------------------------------------------------------------------

@dataclass
class RunSpec:
    """Everything a rank needs for one check (picklable: functions by reference)."""

    build: Any
    wiring: Any
    loss_fn: Any
    mesh_shape: tuple[int, ...]
    mesh_names: tuple[str, ...]
    data_dims: tuple[str, ...] | None
    steps: int
    batch: int
    seq: int
    vocab: int
    seed: int
    optimizer: str
    lr: float


def run_rank(rank: int, world_size: int, spec: RunSpec) -> dict:
    """Build, wire and train ``spec`` on this rank; returns what the report needs, or
    ``{"error": ...}`` if the wiring or a step raised."""
    torch.manual_seed(spec.seed)
    model = spec.build()
    dropout = switch_off_dropout(model)
    names = {clean_name(n) for n, _ in model.named_parameters()}
    mesh = init_device_mesh("cpu", spec.mesh_shape, mesh_dim_names=spec.mesh_names)
    data_dims = spec.data_dims if spec.data_dims is not None else tuple(
        n for n in spec.mesh_names if n in DATA_DIMS)
    ctx = ParityContext(rank=rank, world_size=world_size, mesh=mesh, batch_size=spec.batch,
                        seq_len=spec.seq, data_dims=data_dims,
                        cp_dim="cp" if "cp" in spec.mesh_names else None)
    stage = "wiring"
    try:
        wired = spec.wiring(model, ctx)
        wired = model if wired is None else wired
        modules = modules_of(wired)
        what = applied(modules)
        counts = {"stage_forwards": 0}
        stages = find_stages(wired)
        for st in stages:
            _count_calls(st, counts)
        params = list({id(p): p for m in modules for p in m.parameters()}.values())
        opt = make_optimizer(params, spec.optimizer, spec.lr)
        replicated = _replicated_check(modules, mesh, spec.mesh_names)
        losses, grads, no_grad, mismatches = [], {}, [], []
        stage = "training"
        with contextlib.ExitStack() as stack:
            ep = stack.enter_context(ep_plugin.count_comm())
            cp = stack.enter_context(cp_plugin.count_comm())
            work = stack.enter_context(cp_plugin.count_work())
            for step in range(spec.steps):
                inputs, labels = make_batch(step, seed=spec.seed, batch=spec.batch,
                                            seq=spec.seq, vocab=spec.vocab)
                with ctx.forward_context():
                    loss = spec.loss_fn(wired, inputs, labels, ctx)
                    if loss is not None and loss.requires_grad:
                        loss.backward()
                losses.append(_global_loss(loss))
                found = replicated.problems()
                if found and not mismatches:
                    mismatches = [f"step {step + 1}: {line}" for _, line in found]
                if step == 0:
                    grads, no_grad = full_grads(modules, names)
                opt.step()
                opt.zero_grad()
        stage = "gathering"
        final = full_params(modules, names)
    except Exception as e:  # reported, not raised: the check fails with the wiring's error
        # An error on some ranks only ends the process group (no rank waits out the timeout);
        # a rank stopped that way reports the error of the rank that failed first.
        peer = settle_failure(f"the parity check's {stage}", e)
        if peer is not None:
            return {"error": f"{stage} failed on rank {peer.rank} (in {peer.where}): "
                             f"{peer.error}", "traceback": traceback.format_exc(), "own": False}
        last = traceback.format_exception_only(type(e), e)[-1].strip()
        return {"error": f"{stage} failed on rank {rank}: {last}",
                "traceback": traceback.format_exc(), "own": True, "rank": rank}
    comm = {"ep_all_to_alls": ep.all_to_alls, "ep_rows_sent": ep.rows_sent,
            "cp_sends": cp.sends, "cp_collectives": sum(cp.collectives.values()),
            "cp_blocks": work.blocks, "pipeline_stages": len(stages),
            "replicated_checked": replicated.checked, **counts}
    return {"losses": losses, "grads": grads, "no_grad": no_grad, "params": final,
            "applied": what, "comm": comm, "names": sorted(names), "dropout": dropout,
            "replicated": mismatches}


def _global_loss(loss: torch.Tensor | None) -> float | None:
    """The mean of the ranks' returned losses (None from ranks that compute none, such as
    pipeline stages before the last)."""
    value = loss.full_tensor() if isinstance(loss, DTensor) else loss
    t = torch.tensor([0.0, 0.0], dtype=torch.float64)
    if value is not None:
        t[0], t[1] = float(value.detach()), 1.0
    dist.all_reduce(t)
    return float(t[0] / t[1]) if t[1] else None


def run_ranks(rank: int, world_size: int, specs: list[RunSpec]) -> list[dict]:
    """Every spec in turn on this rank (one process group for all: one spawn). A spec that
    failed on some ranks only ends the process group; the specs after it are marked
    ``"rerun"`` (``check_all`` runs them in new processes)."""
    torch.set_num_threads(1)
    out = []
    for spec in specs:
        if not dist.is_initialized():
            out.append({"error": "not run: the process group ended when an earlier check "
                                 "failed on some ranks only", "rerun": True})
            continue
        out.append(run_rank(rank, world_size, spec))
    return out


def run_reference(spec: RunSpec, reference_loss) -> dict:
    """The same steps in this process on the whole batch, unwired."""
    torch.manual_seed(spec.seed)
    model = spec.build()
    switch_off_dropout(model)
    params = dict(model.named_parameters())
    start = {n: p.detach().float().clone() for n, p in params.items()}
    opt = make_optimizer(list(params.values()), spec.optimizer, spec.lr)
    losses, grads = [], {}
    for step in range(spec.steps):
        inputs, labels = make_batch(step, seed=spec.seed, batch=spec.batch, seq=spec.seq,
                                    vocab=spec.vocab)
        loss = reference_loss(model, inputs, labels)
        loss.backward()
        losses.append(float(loss.detach()))
        if step == 0:
            grads = {clean_name(n): p.grad.detach().float().clone()
                     for n, p in params.items() if p.grad is not None}
        opt.step()
        opt.zero_grad()
    return {"losses": losses, "grads": grads,
            "start": {clean_name(n): v for n, v in start.items()},
            "params": {clean_name(n): p.detach().float().clone() for n, p in params.items()}}
