"""Deferred weight gradients: a linear's backward computes dX now and queues dW = dY^T X.

Zero-bubble pipeline schedules split a backward into I (input gradient, on the critical path)
and W (weight gradient, fills bubbles). Autograd has no such split, and torch's
``stage_backward_input`` / ``stage_backward_weight`` emulate it by walking the stage's graph in
Python twice and keeping all of it alive until W. Here the split happens inside the GEMMs that
matter, as the zero-bubble authors and DualPipe do: :func:`defer_weight_grads` converts a model's
``nn.Linear`` layers (and MoE :class:`~titanext.models.moe.GroupedExperts`); inside
:func:`weight_grad_deferral` their backward returns dX and the bias gradient at once and appends
one weight-GEMM closure to a :class:`WeightGradQueue`, which holds only X and dY. Everything
else (norms, embeddings, the router) gets its gradient during I as usual. Running the queue adds
dW to ``param.grad`` as autograd would (the first write creates it, later ones add).

>>> import torch
>>> from torch import nn
>>> model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
>>> defer_weight_grads(model)
['0', '2']
>>> queue = WeightGradQueue()
>>> with weight_grad_deferral(queue):
...     model(torch.randn(3, 8)).sum().backward()  # I: dX, biases
>>> model[0].weight.grad is None, model[0].bias.grad is not None, len(queue)
(True, True, 2)
>>> queue.run()                                    # W: dW = dY^T X per linear
>>> model[0].weight.grad.shape, len(queue)
(torch.Size([16, 8]), 0)

Rules:

- The choice is made at forward time: a converted module run outside any deferral context is
  exactly ``nn.Linear`` (same class hierarchy, parameters, FQNs, state dict and bitwise
  numerics). Inside a context (with or without a queue) it records a custom autograd function;
  its backward queues dW if a queue is active *when the backward runs*, else computes dW at once.
  So run the forward and the backward of a micro-batch inside contexts (activation
  checkpointing recomputes the forward during backward: it must see the same mode).
- Pipeline stages: build :class:`DeferredPipelineStage` instead of torch's ``PipelineStage``
  (same arguments). Its forward and backward chunks run inside the deferral context, and it
  passes torch's public ``dw_builder`` hook, so the input-gradient step runs one plain autograd
  backward (no graph walk, no retain_graph) and that micro-batch's closures go to torch's W
  step; a full backward runs them at once. Any schedule runs it, torch's included.
  ``titanext.distributed.pipeline`` does this when
  ``pipeline_parallel_split_backward = "deferred"``.
- Inside a context with a queue, every backward queues dW, even a ``torch.autograd.grad`` that
  asks only for inputs (torch's stage shape inference does that on the first step): keep such
  calls outside (the stage class does).
- FSDP2: forward sees the unsharded parameters, so dW accumulates on them (FSDP2 keeps the same
  unsharded ``nn.Parameter`` across reshard/unshard; W does not need the weight's values). The
  reduce-scatter must come after the last W: in a pipeline, torch's REDUCE_GRAD action does it
  after each stage's last W/B. Outside a pipeline, run the earlier micro-batches' queues before
  the last backward and give that one no queue (its dW is then computed inside autograd, before
  FSDP's post-backward hook reduce-scatters).
  With a reduce dtype other than the parameters' (bf16 parameters, fp32 reduction), a stage's
  W adds each dW to FSDP2's fp32 accumulator at once (:class:`ReduceDtypeFolds`), as FSDP2's
  post-backward hook does with a backward's gradient: no bf16 gradient is left beside it, and
  consecutive W's sum in fp32.
- TP/SP: DTensor weights and activations go through DTensor ops (dX is Partial where autograd's
  would be), and dW is redistributed to the parameter's placements if they differ.
- EP: grouped experts compute on the local expert shard; dW is wrapped back into the DTensor.
- torch.compile: the deferring function is run eagerly (``torch.compiler.disable``), so each
  converted linear is a graph break inside a compiled block while deferral is on.
- float8: torchao's ``Float8Linear`` keeps its own backward (its dW is computed during I), and
  so do float8 experts on torchao's grouped GEMM kernels (one autograd function for dx and dW:
  ``Float8GroupedMM.own_backward``); one log line says how many. Emulated float8 experts defer
  their recipe's dW half.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.pipelining import PipelineStage
from torch.distributed.tensor import DTensor

from titanext._compat import fold_into_reduce_dtype, fsdp_reduce_dtype_accumulators, grouped_mm
from titanext.models.moe import GroupedExperts, grouped_mm_supported
from titanext.plugins._baton_threads import register_side_state
from titanext.plugins._loud import (
    log_rank0,
    matmul_kind,
    own_forward_line,
    stacked_experts,
    stacked_experts_line,
    unconverted_line,
)

__all__ = ["AutogradSplitStage", "DeferredPipelineStage", "WeightGradQueue", "defer_weight_grads",
           "deferral_active", "has_deferred_modules", "weight_grad_deferral"]

logger = logging.getLogger("titanext")

ModuleFilter = Callable[[nn.Module, str], bool]


class _State:
    """Process-wide (not thread-local: on GPU, autograd runs backward on its own threads)."""

    recording = False
    queue: WeightGradQueue | None = None


_STATE = _State()


def _put_state(saved: tuple) -> None:
    _STATE.recording, _STATE.queue = saved


# an overlapped forward/backward pair (titanext.plugins._baton_threads) keeps one switch per side
register_side_state(lambda: (_STATE.recording, _STATE.queue), _put_state)


def deferral_active() -> bool:
    """Whether converted modules run their forward in deferring mode now."""
    return _STATE.recording


@contextlib.contextmanager
def weight_grad_deferral(queue: WeightGradQueue | None = None) -> Iterator[WeightGradQueue | None]:
    """Forwards inside record deferrable linears; backwards inside queue their dW into ``queue``
    (``None``: compute dW at once, inside autograd). Contexts nest; the innermost wins."""
    saved = _STATE.recording, _STATE.queue
    _STATE.recording, _STATE.queue = True, queue
    try:
        yield queue
    finally:
        _STATE.recording, _STATE.queue = saved


class WeightGradQueue:
    """Pending weight-gradient GEMMs, each holding (parameter, X, dY).

    ``run()`` (or calling the queue) computes them in order and empties it. ``take()`` moves the
    pending entries into a new queue and returns it: the ``dw_builder`` of a ``PipelineStage``.
    """

    def __init__(self) -> None:
        self._items: list[tuple[Callable, nn.Parameter, torch.Tensor, torch.Tensor, object]] = []
        #: called with each parameter once its last queued GEMM of a ``run`` has been added
        #: (set on the queue a stage was built with; queues ``take()`` made from it see it too)
        self.after_each: Callable[[torch.Tensor], None] | None = None
        #: called like ``after_each``, after it: moves the gradient where its owner accumulates
        #: it (:class:`ReduceDtypeFolds` under FSDP2 mixed precision)
        self.fold: Callable[[torch.Tensor], None] | None = None
        self._source: WeightGradQueue | None = None

    def __len__(self) -> int:
        return len(self._items)

    def append(self, fn: Callable, param: torch.Tensor, x: torch.Tensor, dy: torch.Tensor,
               extra: object = None) -> None:
        self._items.append((fn, param, x, dy, extra))

    def take(self) -> WeightGradQueue:
        taken = WeightGradQueue()
        taken._items, self._items = self._items, []
        taken._source = self
        return taken

    def tensors(self) -> list[torch.Tensor]:
        """The tensors the queue keeps alive (X and dY of each entry)."""
        return [t for _, _, x, dy, _ in self._items for t in (x, dy)]

    def clear(self) -> None:
        self._items = []

    @torch.no_grad()
    def run(self) -> None:
        items, self._items = self._items, []
        source = self._source if self._source is not None else self
        hook, fold = self.after_each or source.after_each, self.fold or source.fold
        last = ({id(item[1]): k for k, item in enumerate(items)}
                if hook is not None or fold is not None else {})
        for k, (fn, param, x, dy, extra) in enumerate(items):
            into, grad = getattr(fn, "into", None), param.grad
            if (into is not None and grad is not None and not _is_dtensor(grad)
                    and grad.dtype == x.dtype == dy.dtype and grad.is_contiguous()):
                into(grad, x, dy)  # the GEMM adds into the gradient: no temporary, no add pass
            else:
                _accumulate(param, fn(x, dy, param, extra))
            if last and last[id(param)] == k:
                if hook is not None:
                    hook(param)
                if fold is not None:
                    fold(param)

    __call__ = run


def _is_dtensor(t) -> bool:

    return isinstance(t, DTensor)


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if _is_dtensor(t) else t


def _accumulate(param: torch.Tensor, grad: torch.Tensor) -> None:
    """param.grad += grad, creating it on the first write (AccumulateGrad's contract)."""
    if _is_dtensor(param) and tuple(grad.placements) != tuple(param.placements):
        grad = grad.redistribute(param.device_mesh, param.placements)
    if grad.dtype != param.dtype:
        grad = grad.to(param.dtype)
    if param.grad is None:
        param.grad = grad if grad.is_contiguous() else grad.contiguous()
    else:
        param.grad += grad


# -- nn.Linear -------------------------------------------------------------------------------

def _linear_weight_grad(x: torch.Tensor, dy: torch.Tensor, param, extra) -> torch.Tensor:
    # dW = dY^T X over all leading dims: [out, T] @ [T, in]
    return dy.reshape(-1, dy.shape[-1]).t().mm(x.reshape(-1, x.shape[-1]))


def _linear_weight_grad_into(grad: torch.Tensor, x: torch.Tensor, dy: torch.Tensor) -> None:
    """grad += dY^T X in one GEMM (beta = 1), as Megatron's gradient-accumulation fusion:
    no [out, in] temporary and no separate add over it (at 64 rows x 512 -> 2048 on one CPU
    thread: 1.6 ms instead of 2.6 ms)."""
    grad.addmm_(dy.reshape(-1, dy.shape[-1]).t(), x.reshape(-1, x.shape[-1]))


_linear_weight_grad.into = _linear_weight_grad_into


class _DeferredLinearFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias):
        ctx.save_for_backward(x, weight)
        ctx.param = weight  # the leaf to accumulate into (saved tensors may come back as aliases)
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, dy):
        return _deferring_backward(ctx, dy, dy.matmul, _linear_weight_grad)


def _deferring_backward(ctx, dy, input_grad, weight_grad):
    """(dX, dW, db) of a matmul module: dX = ``input_grad(weight)`` and db now, and dW =
    ``weight_grad(x, dy, ...)`` queued when a queue is active (else computed now)."""
    x, weight = ctx.saved_tensors
    need_x, need_w, need_b = ctx.needs_input_grad
    dx = input_grad(weight) if need_x else None
    db = dy.reshape(-1, dy.shape[-1]).sum(0) if need_b else None
    dw = None
    if need_w:
        queue = _STATE.queue
        if queue is None or not ctx.param.is_leaf:
            dw = weight_grad(x, dy, ctx.param, None)
        else:
            queue.append(weight_grad, ctx.param, x, dy)
    return dx, dw, db


@torch.compiler.disable
def _deferred_linear(x, weight, bias):
    return _DeferredLinearFn.apply(x, weight, bias)


class DeferredLinear(nn.Linear):
    """``nn.Linear`` whose weight gradient can be deferred (see the module docstring)."""

    titanext_convert = False  # already converted

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        if _STATE.recording and torch.is_grad_enabled() and (
                input.requires_grad or self.weight.requires_grad):
            return _deferred_linear(input, self.weight, self.bias)
        return F.linear(input, self.weight, self.bias)


# -- transformers' Conv1D: weight [in, out], y = x @ W + b ----------------------------------------

def _conv1d_weight_grad(x: torch.Tensor, dy: torch.Tensor, param, extra) -> torch.Tensor:
    # dW = X^T dY over all leading dims: [in, T] @ [T, out]
    return x.reshape(-1, x.shape[-1]).t().mm(dy.reshape(-1, dy.shape[-1]))


def _conv1d_weight_grad_into(grad: torch.Tensor, x: torch.Tensor, dy: torch.Tensor) -> None:
    grad.addmm_(x.reshape(-1, x.shape[-1]).t(), dy.reshape(-1, dy.shape[-1]))


_conv1d_weight_grad.into = _conv1d_weight_grad_into


def _conv1d(x, weight, bias):
    """transformers' Conv1D forward: ``addmm`` over the flattened tokens."""
    x2 = x.reshape(-1, x.shape[-1])
    y = torch.addmm(bias, x2, weight) if bias is not None else x2.mm(weight)
    return y.view(*x.shape[:-1], weight.shape[-1])


class _DeferredConv1DFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias):
        ctx.save_for_backward(x, weight)
        ctx.param = weight
        return _conv1d(x, weight, bias)

    @staticmethod
    def backward(ctx, dy):
        return _deferring_backward(ctx, dy, lambda w: dy.matmul(w.t()), _conv1d_weight_grad)


@torch.compiler.disable
def _deferred_conv1d(x, weight, bias):
    return _DeferredConv1DFn.apply(x, weight, bias)


class DeferredConv1DMixin(nn.Module):
    """The forward of a converted transformers ``Conv1D``: outside a deferral context its own;
    inside, dX now and dW = X^T dY queued."""

    titanext_convert = False  # already converted

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if _STATE.recording and torch.is_grad_enabled() and (
                x.requires_grad or self.weight.requires_grad):
            return _deferred_conv1d(x, self.weight, self.bias)
        return super().forward(x)


# -- MoE grouped experts ----------------------------------------------------------------------

def _grouped_linear(x, w, offs, counts, mm=None):
    """x [T, in] rows grouped by expert, w [E, out, in] -> [T, out] (``mm``: float8 experts)."""
    if mm is not None:
        return mm.forward(x, w, offs)
    if offs is not None:
        return grouped_mm(x, w.transpose(-2, -1), offs=offs)
    outs = [F.linear(xe, w[e]) for e, xe in enumerate(torch.split(x, counts))]
    return torch.cat(outs) if outs else x.new_zeros(0, w.shape[1])


def _grouped_input_grad(dy, w, offs, counts, mm=None):
    if mm is not None:
        return mm.input_grad(dy, w, offs).to(dy.dtype)
    if offs is not None:
        return grouped_mm(dy, w, offs=offs)
    outs = [dye.mm(w[e]) for e, dye in enumerate(torch.split(dy, counts))]
    return torch.cat(outs) if outs else dy.new_zeros(0, w.shape[2])


def _grouped_weight_grad(x, dy, param, extra) -> torch.Tensor:
    offs, counts, mm = extra
    local = _local(param)
    if mm is not None:  # the float8 recipe's dW, at the W step too
        dw = mm.weight_grad(x, dy, offs)
    elif offs is not None:
        dw = grouped_mm(dy.t(), x, offs=offs)  # [E, out, in]
    else:
        dw = torch.zeros_like(local)
        for e, (xe, dye) in enumerate(zip(torch.split(x, counts), torch.split(dy, counts),
                                          strict=True)):
            dw[e] = dye.t().mm(xe)
    if _is_dtensor(param):

        dw = DTensor.from_local(dw.to(local.dtype), param.device_mesh, param.placements,
                                run_check=False, shape=param.shape, stride=param.stride())
    return dw.to(local.dtype)


class _DeferredGroupedFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, offs, counts, mm=None):
        ctx.save_for_backward(x)
        ctx.param, ctx.extra = weight, (offs, counts, mm)
        return _grouped_linear(x, _local(weight), offs, counts, mm)

    @staticmethod
    def backward(ctx, dy):
        (x,) = ctx.saved_tensors
        dy = dy.contiguous()
        offs, counts, mm = ctx.extra
        dx = _grouped_input_grad(dy, _local(ctx.param), offs, counts, mm) \
            if ctx.needs_input_grad[0] else None
        dw = None
        if ctx.needs_input_grad[1]:
            if _STATE.queue is None or not ctx.param.is_leaf:
                dw = _grouped_weight_grad(x, dy, ctx.param, ctx.extra)
            else:
                _STATE.queue.append(_grouped_weight_grad, ctx.param, x, dy, ctx.extra)
        return dx, dw, None, None, None


@torch.compiler.disable
def _deferred_experts(module: GroupedExperts, x, num_tokens_per_expert, row_weights=None):
    w1, w2, w3 = _local(module.w1), _local(module.w2), _local(module.w3)
    mm = module.float8_grouped_mm  # emulated float8 experts: their recipe's I and W halves
    use = mm is not None or module.use_grouped_mm
    if use == "auto":
        use = grouped_mm_supported(x, w1, w2, w3)
    offs, counts = None, None
    if use:
        offs = torch.cumsum(num_tokens_per_expert, 0, dtype=torch.int32)
    else:
        counts = num_tokens_per_expert.tolist()
    h = module.act(_DeferredGroupedFn.apply(x, module.w1, offs, counts, mm),
                   _DeferredGroupedFn.apply(x, module.w3, offs, counts, mm), row_weights)
    return _DeferredGroupedFn.apply(h, module.w2, offs, counts, mm)


class DeferredGroupedExperts(GroupedExperts):
    """:class:`GroupedExperts` whose three weight gradients can be deferred."""

    def forward(self, x: torch.Tensor, num_tokens_per_expert: torch.Tensor,
                row_weights: torch.Tensor | None = None) -> torch.Tensor:
        if _STATE.recording and torch.is_grad_enabled():
            return _deferred_experts(self, x, num_tokens_per_expert, row_weights)
        return super().forward(x, num_tokens_per_expert, row_weights)


# -- the converter ----------------------------------------------------------------------------

_LINEAR_CLASSES: dict[type, type] = {nn.Linear: DeferredLinear}


def _deferred_class(cls: type, mixin: type = DeferredLinear) -> type:
    """``mixin``'s forward on top of ``cls`` (an ``nn.Linear`` subclass, or a Conv1D with
    :class:`DeferredConv1DMixin`): isinstance checks against ``cls`` and its attributes stay."""
    if cls not in _LINEAR_CLASSES:
        _LINEAR_CLASSES[cls] = type(f"Deferred{cls.__name__}", (mixin, cls),
                                    {"__module__": cls.__module__})
    return _LINEAR_CLASSES[cls]


_CONVERTED = (DeferredLinear, DeferredGroupedExperts, DeferredConv1DMixin)


def defer_weight_grads(model: nn.Module, *, module_filter_fn: ModuleFilter | None = None
                       ) -> list[str]:
    """Convert ``model``'s linears and ``GroupedExperts`` modules, in place, so their weight
    gradients can be deferred; returns the converted FQNs.

    Matmul modules are picked by behaviour (as :func:`titanext.plugins.float8.apply_float8`
    does): ``nn.Linear`` and subclasses that keep ``nn.Linear.forward`` convert (the class becomes
    a subclass of both, so ``isinstance`` checks, TP plans and FSDP apply as before), and so does
    transformers' ``Conv1D`` (weight ``[in, out]``: its dW = X^T dY is queued); subclasses
    with their own forward are listed in one WARNING line and convert only when
    ``module_filter_fn(module, fqn)`` returns True for them (their forward is then a plain
    linear's); modules that multiply by their own 2-D parameter (``F.linear(x, self.w)``) are
    named in one WARNING line (nothing can split their backward from outside); any other
    module ``module_filter_fn`` returns False for stays unconverted. Classes with
    ``titanext_convert = False`` (the MoE router gate, torchao's ``Float8Linear``) keep their
    own backward. Run converters such as float8 first. Idempotent.

    Raises ``ValueError`` when the model has nothing to convert (naming its class and the fix).
    """
    converted, float8, already = [], 0, 0
    own: list[tuple[str, nn.Module]] = []
    outside: list[tuple[str, nn.Module]] = []
    for fqn, module in model.named_modules():
        kind = matmul_kind(module)
        # torchao's float8 kernels (Float8Linear, the experts' grouped GEMM function) compute dW
        # in their own backward: nothing to defer
        experts = type(module) is GroupedExperts and not _own_backward(module)
        float8 += (kind == "kept" and type(module).__name__.startswith("Float8")) or (
            type(module) is GroupedExperts and not experts)
        already += isinstance(module, _CONVERTED)
        candidate = kind in ("linear", "own_forward", "conv1d") or experts
        wanted = module_filter_fn(module, fqn) if module_filter_fn and candidate else None
        target = DeferredGroupedExperts if experts else None
        if kind == "linear" or (kind == "own_forward" and wanted):
            target = _deferred_class(type(module))
        elif kind == "conv1d":
            target = _deferred_class(type(module), DeferredConv1DMixin)
        if kind == "own_forward":
            own.append((fqn, module))
        if kind == "param_matmul":
            outside.append((fqn, module))
        if target is None or wanted is False:
            continue
        module.__class__ = target
        converted.append(fqn)
    experts = stacked_experts(model, (GroupedExperts,))
    for line in (own_forward_line("weight_grad", own, set(converted)),
                 unconverted_line("weight_grad", outside),
                 stacked_experts_line("weight_grad", experts, _EXPERTS_FIX)):
        if line:
            log_rank0(logging.WARNING, "%s", line)
    if float8:
        log_rank0(logging.WARNING if not converted else logging.INFO,
                  "weight_grad: %d float8 module(s) keep their own backward: their weight "
                  "gradients are computed in the input-gradient step, not deferred", float8)
    if not converted and not float8 and not already:
        found = [f"{fqn or '<root>'} ({type(m).__name__}, {why})"
                 for group, why in ((own, "overrides forward"),
                                    (outside, "multiplies by its own 2-D parameter"),
                                    (experts, "stacked 3-D expert weights"))
                 for fqn, m in group]
        fixes = []
        if own:
            fixes.append("return True from module_filter_fn for the nn.Linear subclasses that "
                         "override forward (their forward becomes nn.Linear's)")
        if outside:
            fixes.append("hold the weights multiplied outside nn.Linear in nn.Linear modules")
        if module_filter_fn:
            fixes.append("let module_filter_fn accept the linears it excluded")
        raise ValueError(
            f"defer_weight_grads: nothing of {type(model).__name__} converts. Looked for "
            "nn.Linear modules (subclasses that keep nn.Linear.forward, or that module_filter_fn "
            "returns True for), transformers Conv1D and titanext GroupedExperts; found "
            + ("; ".join(found) if found else "no matmul module") + ". Fix: "
            + ", ".join([*fixes, "or use split_backward = 'autograd' for this model "
                         "(docs/pipeline.md)"]))
    return converted


_EXPERTS_FIX = ("Only titanext's GroupedExperts defer their grouped GEMMs' weight gradients; these "
                "compute theirs in the input-gradient step (correct, not deferred)")


def _own_backward(experts: GroupedExperts) -> bool:
    """Whether float8 experts run torchao's kernels (or stand for them in a dry run): one
    autograd function computes their dx and dW together (float8_experts.Float8GroupedMM)."""
    return getattr(experts.float8_grouped_mm, "own_backward", False)


def has_deferred_modules(model: nn.Module) -> bool:
    """Whether ``model`` holds modules converted by :func:`defer_weight_grads` (their forward
    inside a deferral context is a graph break: compile such blocks without ``fullgraph``)."""
    return any(isinstance(m, _CONVERTED) for m in model.modules())


# -- pipeline stages ----------------------------------------------------------------------------

class ReduceDtypeFolds:
    """A :class:`WeightGradQueue`'s ``fold`` for FSDP2 with a reduce dtype other than the
    parameters' (bf16 parameters, fp32 gradient reduction): each weight gradient a W writes
    joins FSDP2's fp32 accumulator at once, as a backward's gradient does in FSDP2's
    post-backward hook. Without it the param-dtype gradient would stay next to the accumulator
    until that module's next backward (2 more bytes a parameter) and consecutive W's would sum
    in bf16. Parameters FSDP2 does not manage, or without a separate reduce dtype, are left
    alone. The map is built at the first W (FSDP2 makes the unsharded parameters at its first
    forward and keeps them)."""

    def __init__(self) -> None:
        self.modules: list[nn.Module] = []
        self._accumulators: dict[int, object] | None = None

    def _owners(self) -> dict[int, object]:
        if self._accumulators is None:
            self._accumulators = {k: v for m in self.modules
                                  for k, v in fsdp_reduce_dtype_accumulators(m).items()}
        return self._accumulators

    def __call__(self, param: torch.Tensor) -> None:
        owner = self._owners().get(id(param))
        if owner is not None:
            fold_into_reduce_dtype(owner)

    def fold_all(self) -> None:
        """Fold every managed parameter's param-dtype gradient (none: nothing to do)."""
        for owner in self._owners().values():
            fold_into_reduce_dtype(owner)


class DeferredPipelineStage(PipelineStage):
    """torch's ``PipelineStage`` (same arguments, plus an optional shared
    ``weight_grad_queue``) whose converted modules defer weight gradients: its F and I/B chunks
    run inside :func:`weight_grad_deferral` and torch's W step runs the micro-batch's queue
    (``dw_builder``). torch's shape inference on the first step stays in plain mode.

    >>> stage = DeferredPipelineStage(module, stage_index=i, num_stages=n, device=device,
    ...                               group=pp_group)  # in a process group  # doctest: +SKIP
    """

    def __init__(self, *args, weight_grad_queue: WeightGradQueue | None = None, **kwargs):
        queue = weight_grad_queue if weight_grad_queue is not None else WeightGradQueue()
        super().__init__(*args, dw_builder=queue.take, **kwargs)
        self.weight_grad_queue = queue
        if not isinstance(queue.fold, ReduceDtypeFolds):  # one per queue: a rank's stages share it
            queue.fold = ReduceDtypeFolds()
        queue.fold.modules.append(self.submod)

    def forward_one_chunk(self, *args, **kwargs):
        with weight_grad_deferral():
            return super().forward_one_chunk(*args, **kwargs)

    def backward_one_chunk(self, *args, **kwargs):
        with weight_grad_deferral(self.weight_grad_queue):
            return super().backward_one_chunk(*args, **kwargs)


class AutogradSplitStage(PipelineStage):
    """torch's ``PipelineStage`` for ``split_backward = "autograd"``: torch's W
    (``stage_backward_weight``) writes each weight gradient after FSDP2's post-backward hook
    has run for that micro-batch, so under FSDP2 mixed precision it would stay in bf16 and the
    next W would add to it in bf16. Each W's gradients join FSDP2's fp32 accumulator at once
    (:class:`ReduceDtypeFolds`), as a deferred W's do. Same arguments as ``PipelineStage``."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._folds = ReduceDtypeFolds()
        self._folds.modules.append(self.submod)

    def backward_weight_one_chunk(self, *args, **kwargs):
        out = super().backward_weight_one_chunk(*args, **kwargs)
        self._folds.fold_all()
        return out
