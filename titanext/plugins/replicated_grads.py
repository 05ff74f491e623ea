"""The invariant "replicated gradients agree", checked at run time with one small collective.

After gradients are reduced and before the optimizer steps, every parameter that is
replicated over a mesh dim must hold the same gradient on every rank of that dim:

- a plain tensor (or an FSDP DTensor whose mesh does not span the dim) under tensor or context
  parallelism: the same weight on every tp / cp rank;
- a DTensor with ``Replicate()`` on a dim of its own mesh (HSDP's replicate dim, a TP rule's
  replicated weight).

A replicated weight inside a tensor-parallel region that no rule covers (Qwen3's ``q_norm``
under a plan without a QK-norm rule) gets, on each tp rank, the gradient of that rank's heads
only: the loss still matches one process, the gradients do not, and they differ from tp rank to
tp rank. This check finds that at the first step, on any model.

How: per parameter, three float64 checksums of its local gradient (sum, sum of squares and a
position-weighted sum) and a has-gradient flag; per mesh dim, ONE ``all_reduce(MAX)`` of
``[c, -c]`` over that dim's group gives the largest and smallest value of every checksum over
its ranks. A relative spread above ``tol`` names the parameter, the dim and the spread::

    q_norm.weight: gradients differ across tp ranks (rel 0.6): a replicated parameter inside a
    tensor-parallel region needs a rule ...

>>> check = ReplicatedGradCheck(model, {"tp": mesh["tp"]})  # in a process group  # doctest: +SKIP
>>> loss.backward(); check(); optimizer.step()  # your loop  # doctest: +SKIP

``install_replicated_grad_check(model, dims, steps=2)`` runs it before the first ``steps``
optimizer steps that touch ``model``'s parameters, through torch's global optimizer step
pre-hook, so a training loop needs no extra code (``parallelize(..., check_replicated_grads=)``
does this). Cost: docs/fsdp_tp.md#replicated-gradients-agree (benchmarks/replicated_grads.py).
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Callable, Iterable, Mapping

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate
from torch.optim.optimizer import (
    register_optimizer_step_post_hook,
    register_optimizer_step_pre_hook,
)

__all__ = ["ReplicatedGradCheck", "ReplicatedGradientMismatch", "install_replicated_grad_check",
           "replicated_grad_problems"]

#: What a mismatch over a dim usually means, by the dim's name.
HINTS = {
    "tp": "a replicated parameter inside a tensor-parallel region needs a rule (QK-norm: "
          "SequenceParallel(sequence_dim=2, use_local_output=True) on the head dim; a replicated "
          "projection feeding sharded heads: ReplicatedOverTP(grad_sum_last=n))",
    "cp": "a parameter whose gradient comes from this rank's sequence slice only must be reduced "
          "over cp (FSDP over dp_shard x cp, or an all-reduce)",
}
_DATA_HINT = ("its gradient was not reduced over the data-parallel ranks (FSDP / DDP, or an "
              "all-reduce divided by the ranks)")

#: sum, sum of squares, position-weighted sum, has-gradient flag
_K = 4


class ReplicatedGradientMismatch(RuntimeError):
    """Gradients of a replicated parameter differ between the ranks of a mesh dim."""


def _ranks(mesh: DeviceMesh) -> tuple[int, ...]:
    return tuple(int(r) for r in mesh.mesh.flatten().tolist())


#: elements per float64 chunk: the checksums never hold more than 128 MB of float64 at once
_CHUNK = 1 << 24
_PHI = 0.6180339887498949


def _steps(n: int, device: torch.device, cache: dict) -> torch.Tensor:
    """``i * phi`` for i < n (float64, cached per size and device)."""
    w = cache.get((n, device))
    if w is None:
        w = cache[(n, device)] = torch.arange(n, dtype=torch.float64, device=device) * _PHI
    return w


def _local_sums(grad: torch.Tensor, cache: dict) -> torch.Tensor:
    """[sum, sum of squares, position-weighted sum, 1] of a local gradient in float64, chunk by
    chunk. The weights ``frac(i * phi) - 0.5`` (a golden-ratio sequence in [-0.5, 0.5)) make a
    permuted gradient change the weighted sum even when its sum and sum of squares do not."""
    g = grad.detach().flatten()
    out = torch.zeros(_K, dtype=torch.float64, device=g.device)
    out[3] = 1.0
    for start in range(0, g.numel(), _CHUNK):
        c = g[start:start + _CHUNK].to(torch.float64)
        w = torch.remainder(_steps(c.numel(), c.device, cache) + start * _PHI, 1.0) - 0.5
        out[0] += c.sum()
        out[1] += c.square().sum()
        out[2] += (c * w).sum()
    return out


class ReplicatedGradCheck:
    """Checks, when called, that the gradients of ``model``'s parameters agree over the dims in
    which they are replicated.

    Args:
        model: the module (or modules, e.g. pipeline stages) whose parameters to check.
        dims: mesh dims over which a plain parameter is replicated, name -> 1D ``DeviceMesh``
            (``{"tp": mesh["tp"], "cp": mesh["cp"]}``). A DTensor parameter is checked over
            those of them its own mesh does not span, and over the dims of its own mesh where
            it is ``Replicate()``. Dims of one rank are left out.
        skip: ``skip(param_name, dim_name) -> True`` leaves that pair unchecked (e.g. experts
            split over ep, whose ranks may include cp ranks).
        tol: the largest relative spread of a checksum allowed (replicated computations are
            normally bitwise equal; rounding of a different reduction order is ~1e-7).

    Calling it runs one ``all_reduce`` per dim (a ``[params, 8]`` float64 tensor) and raises
    :class:`ReplicatedGradientMismatch` naming every mismatch, worst first; every rank of a
    mismatching dim raises the same error. :meth:`problems` returns the lines instead.
    """

    def __init__(self, model: nn.Module | Iterable[nn.Module], dims: Mapping[str, DeviceMesh],
                 *, skip: Callable[[str, str], bool] | None = None, tol: float = 1e-5):
        self.modules = [model] if isinstance(model, nn.Module) else list(model)
        self.dims = {name: mesh for name, mesh in dims.items() if mesh.size() > 1}
        self.skip, self.tol = skip, tol
        self._weights: dict[tuple, torch.Tensor] = {}
        self._plan: dict[tuple[str, tuple[int, ...]], tuple[dist.ProcessGroup, list]] | None = None
        self._plan_key: list[int] = []
        self.checked = 0  # (parameter, dim) pairs checked by the last call
        self.calls = 0  # checks run (steps checked)
        self._handles: list = []  # optimizer hooks (install_replicated_grad_check)

    def __deepcopy__(self, memo) -> ReplicatedGradCheck:
        return self  # a copied module shares its original's check (it keeps the check alive)

    def remove(self) -> None:
        """Remove the optimizer hooks :func:`install_replicated_grad_check` installed."""
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def _named_params(self) -> list[tuple[str, nn.Parameter]]:
        seen, out = set(), []
        for module in self.modules:
            for name, p in module.named_parameters():
                if id(p) not in seen and p.requires_grad:
                    seen.add(id(p))
                    out.append((name, p))
        return out

    def _groups(self) -> dict[tuple[str, tuple[int, ...]], tuple[dist.ProcessGroup, list]]:
        """(dim name, ranks) -> (its group, [(param name, param), ...]); built again only when
        the parameters are other objects (``to_empty`` or a reload after the last call)."""
        key = [id(p) for _, p in self._named_params()]
        if self._plan is not None and key == self._plan_key:
            return self._plan
        self._plan_key = key
        plan: dict = {}
        world = {name: (mesh.get_group(), _ranks(mesh)) for name, mesh in self.dims.items()}
        me = dist.get_rank()
        for pname, p in self._named_params():
            targets = []
            own = _ranks(p.device_mesh) if isinstance(p, DTensor) else (me,)
            for dim, (group, ranks) in world.items():
                if set(ranks) & set(own) == {me}:  # the dim is orthogonal to the param's mesh
                    targets.append((dim, group, ranks))
            if isinstance(p, DTensor):
                mesh, names = p.device_mesh, p.device_mesh.mesh_dim_names
                for i, placement in enumerate(p.placements):
                    if isinstance(placement, Replicate) and mesh.size(i) > 1:
                        sub = mesh[names[i]] if names else None
                        ranks = _ranks(sub) if sub is not None else ()
                        targets.append((names[i] if names else f"dim {i}", mesh.get_group(i),
                                        ranks))
            for dim, group, ranks in targets:
                if self.skip is not None and self.skip(pname, dim):
                    continue
                plan.setdefault((dim, ranks), (group, []))[1].append((pname, p))
        self._plan = dict(sorted(plan.items()))  # the same order on every rank
        return self._plan

    def _checksums(self, p: nn.Parameter, device: torch.device) -> torch.Tensor:
        """[K] float64 on ``device`` (computed where the gradient lives: no copy of it)."""
        grad = p.grad
        if grad is None:
            return torch.zeros(_K, dtype=torch.float64, device=device)
        if isinstance(grad, DTensor):
            grad = grad.to_local()
        return _local_sums(grad, self._weights).to(device)

    def problems(self) -> list[tuple[float, str]]:
        """(relative spread, line) per mismatching (parameter, dim), worst first; one
        collective per dim, on every rank of it."""
        found, self.checked = [], 0
        for _, p in self._named_params():  # a pending (Partial) DTensor gradient: reduce it
            g = p.grad
            if isinstance(p, DTensor) and isinstance(g, DTensor) and g.placements != p.placements:
                p.grad = g.redistribute(p.device_mesh, p.placements)
        for (dim, _), (group, params) in self._groups().items():
            # the collective's device: the parameters' (CUDA for NCCL), else CPU
            device = next((p.device for _, p in params if p.device.type != "meta"),
                          torch.device("cpu"))
            local = torch.stack([self._checksums(p, device) for _, p in params])  # [n, K]
            both = torch.cat([local, -local], dim=1)
            dist.all_reduce(both, op=dist.ReduceOp.MAX, group=group)
            both = both.cpu()
            hi, lo = both[:, :_K], -both[:, _K:]
            self.checked += len(params)
            for (name, p), h, lo_ in zip(params, hi, lo):
                rel = _spread(h, lo_, _local_numel(p.grad))
                if rel > self.tol:
                    found.append((rel, _line(name, dim, rel, h, lo_)))
        return sorted(found, key=lambda x: -x[0])

    def __call__(self, step: int | None = None) -> None:
        self.calls += 1
        found = self.problems()
        if found:
            where = f"step {step}: " if step is not None else ""
            lines = [line for _, line in found]
            more = f" (and {len(lines) - 5} more)" if len(lines) > 5 else ""
            raise ReplicatedGradientMismatch(where + "; ".join(lines[:5]) + more)


def _local_numel(grad: torch.Tensor | None) -> int:
    if grad is None:
        return 0
    return (grad.to_local() if isinstance(grad, DTensor) else grad).numel()


def _spread(hi: torch.Tensor, lo: torch.Tensor, numel: int) -> float:
    """The largest relative spread of the checksums over the ranks (inf: a gradient on some
    ranks only)."""
    if hi[3] != lo[3]:
        return math.inf
    if hi[3] == 0:
        return 0.0
    norm = math.sqrt(max(float(hi[1]), 0.0))
    if norm == 0.0:
        return 0.0 if float(lo[1]) == 0.0 else math.inf
    # |sum| <= sqrt(n) |g| and |sum w g| <= |w| |g| <= sqrt(n) |g| / 2: each spread as a
    # fraction of the largest value the checksum could take
    scale = math.sqrt(max(numel, 1)) * norm
    return max(float(hi[0] - lo[0]) / scale, float(hi[1] - lo[1]) / float(hi[1]),
               2.0 * float(hi[2] - lo[2]) / scale)


def _line(name: str, dim: str, rel: float, hi: torch.Tensor, lo: torch.Tensor) -> str:
    hint = HINTS.get(dim, _DATA_HINT)
    if math.isinf(rel) and hi[3] != lo[3]:
        return (f"{name}: has a gradient on some {dim} ranks and none on others: every rank of "
                f"a replicated parameter must use it; {hint}")
    return f"{name}: gradients differ across {dim} ranks (rel {rel:.2g}): {hint}"


def replicated_grad_problems(model: nn.Module | Iterable[nn.Module],
                             dims: Mapping[str, DeviceMesh], *,
                             skip: Callable[[str, str], bool] | None = None,
                             tol: float = 1e-5) -> list[str]:
    """The mismatch lines of one :class:`ReplicatedGradCheck` call (empty when the gradients
    agree); collective over each dim in ``dims``."""
    return [line for _, line in ReplicatedGradCheck(model, dims, skip=skip, tol=tol).problems()]


#: the module attribute that keeps a module's check alive (the hooks hold it weakly)
_CHECK_ATTR = "_titanext_replicated_grad_check"


def install_replicated_grad_check(model: nn.Module | Iterable[nn.Module],
                                  dims: Mapping[str, DeviceMesh], *, steps: int = 2,
                                  skip: Callable[[str, str], bool] | None = None,
                                  tol: float = 1e-5) -> ReplicatedGradCheck | None:
    """Run :class:`ReplicatedGradCheck` before each of the first ``steps`` optimizer steps whose
    parameters include ``model``'s, then remove itself; returns the check (``.remove()`` turns
    it off sooner), or None when ``steps`` is 0 or no dim has more than one rank.

    Uses torch's global optimizer step hooks (``torch.optim.optimizer.register_optimizer_step_
    pre_hook`` / ``_post_hook``; every ``torch.optim`` optimizer and subclass calls them):
    gradients are complete there (FSDP and DDP reduce them in backward; clipping scales them
    alike on every rank). An optimizer stepping inside another (ZeroRedundancyOptimizer's
    inner one) is not checked twice. A mismatch raises. After the last checked step (or a
    mismatch) the hooks do nothing; one of them stays registered (a hook cannot remove itself
    while torch iterates over its hooks), holding no reference to the model.
    """
    check = ReplicatedGradCheck(model, dims, skip=skip, tol=tol)
    if steps <= 0 or not check.dims:
        return None
    # The hooks are global and outlive a model whose training stops before the checked steps:
    # they hold the check weakly, and the check lives as long as its modules (an attribute of
    # each), so a finished or abandoned model takes its meshes and groups with it.
    for m in check.modules:
        m.__dict__[_CHECK_ATTR] = check
    ref = weakref.ref(check)
    state = {"done": 0, "depth": 0, "finished": False}

    def live(optimizer: torch.optim.Optimizer) -> ReplicatedGradCheck | None:
        c = ref()
        if state["finished"] or c is None:
            return None
        mine = {id(p) for m in c.modules for p in m.parameters()}
        ours = any(id(p) in mine for group in optimizer.param_groups for p in group["params"])
        return c if ours else None

    def finish(c: ReplicatedGradCheck) -> None:
        # A hook must not remove itself while torch iterates over its dict: the post hook
        # removes the pre hook; the post hook stays as a no-op holding nothing.
        state["finished"] = True
        pre_handle.remove()
        for m in c.modules:
            m.__dict__.pop(_CHECK_ATTR, None)
        c.modules, c.dims, c._plan, c._handles = [], {}, {}, [post_handle]

    def pre(optimizer, args, kwargs) -> None:
        c = live(optimizer)
        if c is None:
            return
        state["depth"] += 1
        if state["depth"] > 1 or state["done"] >= steps:
            return
        state["done"] += 1
        try:
            c(step=state["done"])
        except ReplicatedGradientMismatch:
            state["finished"] = True
            post_handle.remove()  # (the pre hook is a no-op from now on)
            c._handles = [pre_handle]
            raise

    def post(optimizer, args, kwargs) -> None:
        c = live(optimizer)
        if c is None:
            return
        state["depth"] -= 1
        if state["depth"] == 0 and state["done"] >= steps:
            finish(c)

    pre_handle = register_optimizer_step_pre_hook(pre)
    post_handle = register_optimizer_step_post_hook(post)
    check._handles = [pre_handle, post_handle]
    return check
