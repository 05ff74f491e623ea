"""Pipeline parallelism: split a model into stages, place them on ranks, build the schedule.

Three small steps, each usable on a user's own model:

1. :func:`layers_per_stage` decides how many blocks each of ``pp x stages_per_rank`` stages
   holds (the first and last stages may take fewer, since they also hold the embedding and
   the output head).
2. :func:`pipeline_stage_ids` says which stages a pp rank holds, from the schedule class's
   declared placement ("loop" or "v"); nothing here looks at a schedule's name.
3. :func:`split_model` cuts one stage out of a (meta) model; :func:`build_pipeline` wraps the
   stage modules in ``PipelineStage`` objects and builds the schedule.

Between 3's two calls the caller applies TP / AC / compile / FSDP to each stage module exactly
as to a whole model (:func:`titanext.distributed.parallelize.parallelize`).
:class:`PipelineRunner` does all of it for a model and runs the training step (the trainer's
pipeline path).

>>> import torch
>>> from titanext.models import build_model, get_model_args
>>> model = build_model("llama3", get_model_args("llama3", "debugtiny"), device="meta")
>>> n = len(model.layers)
>>> counts = layers_per_stage(n, 2)
>>> stage0 = split_model(model, counts, 0)
>>> stage0.output is None and stage0.tok_embeddings is not None
True
>>> pipeline_stage_ids("ZBV", pp_rank=0, pp=2)
[0, 3]
"""

from __future__ import annotations

import inspect
import time
from collections import defaultdict
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from titanext._profiler_ranges import PP_WAIT, phase, pp_chunk
from titanext.config.degrees import layers_per_stage  # re-exported
from titanext.config.layout import SPLIT_BACKWARD, PipelinePlan
from titanext.distributed.failsafe import guarded
from titanext.distributed.grad_clip import clip_grad_norm_, clip_mirrored_grads
from titanext.distributed.parallelize import parallelize
from titanext.distributed.split import StageModuleList, run_own_forward, split_model
from titanext.plugins._blocks import block_container
from titanext.plugins.weight_grad import (
    AutogradSplitStage,
    DeferredPipelineStage,
    WeightGradQueue,
    defer_weight_grads,
)
from titanext.schedules import (  # pipeline_stage_ids is re-exported
    build_schedule,
    follow_in_flight,
    pipeline_stage_ids,
)
from titanext.schedules.dualpipe import sum_mirrored_grads
from titanext.schedules.overlap import overlap_schedule_class

__all__ = ["SPLIT_BACKWARD", "layers_per_stage", "pipeline_stage_ids", "split_model", "stage_parts",
           "StageModuleList",
           "run_own_forward", "build_pipeline",
           "pass_position_ids", "ignore_shape_inference_forward",
           "StageTimer", "PipelineRunner"]


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def stage_parts(model: nn.Module, stage_index: int, num_stages: int) -> dict:
    """:func:`split_model`'s ``first`` / ``last`` for titanext's model: with MTP modules
    (``model.mtp``) they go to the last stage, and the last stage keeps ``tok_embeddings`` too
    (MTP embeds the next tokens there; :meth:`PipelineRunner.sum_shared_embedding_grads`
    sums the two copies' gradients). ``{}`` (the defaults) without MTP."""
    if getattr(model, "mtp", None) is None:
        return {}
    keep_embedding = stage_index == num_stages - 1
    return {"first": () if keep_embedding else ("tok_embeddings",),
            "last": ("norm", "output", "mtp")}


def pass_position_ids(stage_module: nn.Module, position_ids: torch.Tensor | None, *,
                      kwarg: str = "position_ids") -> None:
    """Call ``stage_module`` with ``position_ids`` from now on (``None`` stops it).

    A pipeline schedule feeds a stage only what the previous stage sent, but every stage runs
    RoPE and needs the global positions of the tokens its rank holds (a slice of them under
    context parallelism; hidden states under sequence parallelism are shorter than the
    sequence, so a stage cannot derive them). Positions are the same for every micro-batch, so
    they are attached once, as a forward pre-hook that adds ``kwarg=position_ids`` to each call
    that does not pass that keyword itself (per-micro-batch positions, e.g. restarted at each
    packed document, come through the schedule instead: :meth:`PipelineRunner.step`). The
    module's ``forward`` must accept that keyword.

    >>> from titanext.models import build_model, get_model_args
    >>> m = build_model("llama3", get_model_args("llama3", "debugtiny"), device="cpu")
    >>> pass_position_ids(m, torch.arange(8))
    >>> m(torch.zeros(1, 8, dtype=torch.long)).shape[1]
    8
    """
    old = getattr(stage_module, "_titanext_positions_hook", None)
    if old is not None:
        old.remove()
        stage_module._titanext_positions_hook = None
    if position_ids is None:
        return

    def add_positions(module, args, kwargs):
        return args, {kwarg: position_ids, **kwargs}

    stage_module._titanext_positions_hook = stage_module.register_forward_pre_hook(
        add_positions, with_kwargs=True)


@guarded  # an error on one rank ends every rank (titanext.distributed.failsafe)
def build_pipeline(stage_modules: Sequence[nn.Module], stage_indices: Sequence[int], *,
                   num_stages: int, pp_group: dist.ProcessGroup, device: torch.device,
                   schedule: str | type, microbatches: int, loss_fn: Callable,
                   costs: dict[str, float | tuple[float, ...]] | None = None,
                   schedule_kwargs: dict | None = None, weight_grad_queue=None,
                   recv_buffers_in_flight: bool = True):
    """``PipelineStage`` objects for this rank's stage modules and the schedule that runs them.

    ``loss_fn(output, target)`` must return what to backpropagate for one micro-batch; the
    schedule does not rescale gradients (``scale_grads=False``), so normalise in ``loss_fn``.
    ``costs`` (f, b, w: one figure, or each stage's by stage index; comm) go to schedules that
    use them (Auto); ``schedule_kwargs`` to the schedule's constructor (e.g. DualPipe's
    ``sum_mirrored_grads=False``). With a
    ``weight_grad_queue`` (:class:`titanext.plugins.weight_grad.WeightGradQueue`, the modules
    converted by ``defer_weight_grads``) the stages are
    :class:`~titanext.plugins.weight_grad.DeferredPipelineStage`: they defer weight gradients.
    The stages hold receive buffers only for the micro-batches in flight
    (:func:`titanext.schedules.follow_in_flight`; ``recv_buffers_in_flight=False`` keeps
    torch's one per micro-batch, for comparison). Returns (stages, schedule). The schedule's
    ``step`` is guarded like this function: an exception on one rank ends every rank within
    seconds, and the others raise
    :class:`~titanext.distributed.failsafe.PeerFailed` naming it
    (:mod:`titanext.distributed.failsafe`).

    Example (2 ranks under torchrun, ``model`` on meta as in the module docstring)::

        ids = pipeline_stage_ids("ZBH2", pp_rank=rank, pp=2)
        counts = layers_per_stage(len(model.layers), 2)
        mods = [split_model(model, counts, i) for i in ids]
        for m in mods:
            m.to_empty(device="cpu"); m.init_weights(seed=0)
        stages, sched = build_pipeline(mods, ids, num_stages=2, pp_group=dist.group.WORLD,
                                       device=torch.device("cpu"), schedule="ZBH2",
                                       microbatches=4, loss_fn=my_loss)
        sched.step(tokens, target=labels, losses=[])   # first / last rank pass what they own
    """
    # Deferred weight gradients: the stage runs one plain backward for I and hands that
    # micro-batch's queued weight GEMMs to W (PipelineStage's public dw_builder hook)
    kind, extra = AutogradSplitStage, {}  # torch's split: its W folds as a deferred W does
    if weight_grad_queue is not None:
        kind, extra = DeferredPipelineStage, {"weight_grad_queue": weight_grad_queue}
    stages = [kind(mod, stage_index=i, num_stages=num_stages, device=device, group=pp_group,
                   **extra)
              for mod, i in zip(stage_modules, stage_indices, strict=True)]
    for stage in stages if recv_buffers_in_flight else ():
        follow_in_flight(stage)
    built = build_schedule(schedule, stages, microbatches, loss_fn, costs=costs,
                           scale_grads=False, **(schedule_kwargs or {}))
    built.step = guarded(built.step, f"{type(built).__name__}.step")  # no rank left waiting
    return stages, built


def ignore_shape_inference_forward(stage_modules: Sequence[nn.Module],
                                   reset: Callable[[nn.Module], None]) -> None:
    """Call ``reset(module)`` just before each stage module's *second* forward call.

    A ``PipelineStage`` built without ``input_args`` learns its shapes on the first
    ``schedule.step`` by calling its module once before the first micro-batch (torch 2.13: on
    micro-batch 0 for the first stage and on uninitialised tensors for the others; older
    torch: on meta tensors). State that forwards accumulate (e.g. the MoE routing counts the
    expert-bias update uses) must not keep that call: ``reset`` clears it. Call this right
    after every :func:`build_pipeline` (new stages infer again).

    >>> from titanext.models.moe import MoE
    >>> ignore_shape_inference_forward(parts, lambda m: [x.tokens_per_expert.zero_()
    ...     for x in m.modules() if isinstance(x, MoE)])  # stages built  # doctest: +SKIP
    """
    for module in stage_modules:
        state: dict = {"calls": 0}

        def pre_hook(mod: nn.Module, args, state=state) -> None:
            state["calls"] += 1
            if state["calls"] == 2:
                reset(mod)
                state["handle"].remove()

        state["handle"] = module.register_forward_pre_hook(pre_hook)


def label_chunks(stages: Sequence) -> None:
    """Open a profiler range (:func:`titanext._profiler_ranges.pp_chunk`) around each stage's
    F, I, W and full-B chunk (torch's PipelineStage methods; a null context without a profiler):
    the step table's per-stage costs and pipeline busy time come from them."""
    for st in stages:
        for meth in ("forward_one_chunk", "backward_one_chunk", "backward_weight_one_chunk"):
            setattr(st, meth, _labelled(getattr(st, meth), meth, st.stage_index))


def _labelled(fn, meth: str, stage: int):
    kind = {"forward_one_chunk": "F", "backward_weight_one_chunk": "W"}.get(meth)
    names = {k: pp_chunk(k, stage) for k in "FIWB"}

    def run(*args, **kwargs):
        k = kind or ("B" if kwargs.get("full_backward", args[2] if len(args) > 2 else True)
                     else "I")
        with phase(names[k]):
            return fn(*args, **kwargs)
    return run


class StageTimer:
    """Times each stage's F, I (input grad), W (weight grad) and full B per micro-batch.

    Wraps the stage objects' chunk methods (public methods of torch's PipelineStage) for as
    long as it is attached; ``costs(group, num_stages)`` returns every stage's mean times (a
    full B is split as I = W = B / 2), gathered over ``group``, as the per-stage ``f``, ``b``,
    ``w`` of the Auto schedule: a model's stages are not alike (the debug model's 6 blocks make
    V stages of 2, 2, 1 and 1 blocks; the ends hold the embedding, head and loss).
    """

    def __init__(self, stages: Sequence):
        self.times: dict[tuple[str, int], list[float]] = defaultdict(list)
        self._orig = []
        for st in stages:
            for meth, key in (("forward_one_chunk", "f"), ("backward_one_chunk", None),
                              ("backward_weight_one_chunk", "w")):
                fn = getattr(st, meth)
                self._orig.append((st, meth, fn))
                setattr(st, meth, self._wrap(fn, key, st.stage_index))

    def _wrap(self, fn, key, stage: int):
        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            out = fn(*args, **kwargs)
            k = key or ("full" if kwargs.get("full_backward", args[2] if len(args) > 2 else True)
                        else "b")
            self.times[(k, stage)].append(time.perf_counter() - t0)
            return out
        return timed

    def detach(self) -> None:
        for st, meth, fn in self._orig:
            setattr(st, meth, fn)
        self._orig = []

    def costs(self, group: dist.ProcessGroup | None, num_stages: int,
              device: torch.device | str = "cpu") -> dict[str, tuple[float, ...]]:
        """Every stage's mean F, I, W seconds per micro-batch, relative to the stages' mean F:
        each stage timed by the ranks that hold it, the slowest of them over ``group`` (None:
        this rank's figures only). Give the group of every rank that runs the schedule: the
        lists are searched from these figures, and data-parallel replicas that searched from
        their own would run their stages' FSDP collectives in different orders. ``device``:
        where the group's backend reduces (the stages' device: NCCL reduces CUDA tensors)."""
        def mean(xs): return sum(xs) / len(xs) if xs else 0.0
        t = torch.zeros(3, num_stages, dtype=torch.float64)
        for s in {s for _, s in self.times}:
            f, b, w = (mean(self.times[(k, s)]) for k in ("f", "b", "w"))
            if not self.times[("b", s)]:
                b = w = mean(self.times[("full", s)]) / 2
            t[:, s] = torch.tensor([f, b, w], dtype=torch.float64)
        if group is not None:  # a rank holds zeros for the stages it does not hold
            t = t.to(device)
            dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
            t = t.cpu()
        t = t.clamp_min(1e-9) / max(float(t[0].mean()), 1e-9)
        f, b, w = (tuple(float(x) for x in row) for row in t)
        return {"f": f, "b": b, "w": w}


def _first_input_name(model: nn.Module) -> str:
    """The name of the first argument of ``model.forward`` (``input_ids``, ``idx``, ...)."""
    params = [p for p in inspect.signature(model.forward).parameters.values()
              if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    if not params or params[0].kind is params[0].POSITIONAL_ONLY:
        raise ValueError(f"skip_missing=True: {type(model).__name__}.forward must take its "
                         "inputs as a named first argument (every stage gets them by keyword)")
    return params[0].name


def _default_parallelize_stage(dims, device: torch.device, blocks: str
                               ) -> Callable[[nn.Module], nn.Module]:
    """:func:`~titanext.distributed.parallelize.parallelize` with the default recipe, then the
    stage's ``init_weights()``."""
    def parallelize_stage(m: nn.Module) -> nn.Module:
        return parallelize(m, dims, device=device, blocks=blocks,
                           init_weights=lambda s: s.init_weights())

    return parallelize_stage


class PipelineRunner:
    """This rank's pipeline stages of a model and the schedule that trains them.

    Built once from the whole (meta) model and a :class:`~titanext.config.PipelinePlan` (a
    job's ``resolve_job_layout(cfg, n).pipeline``, or ``titanext.config.pipeline_plan(...)``
    from keywords: the schedule class, the stages per rank and their owners, the blocks per
    stage, the micro-batches, ``split_backward``, ``comm_overlap``), it owns the pipeline's
    whole life:

    - the split (:func:`split_model`) of the plan's stages this rank holds;
    - each stage module shaped by ``parallelize_stage`` (default:
      :func:`titanext.distributed.parallelize.parallelize` with the defaults, then
      ``init_weights()``) and handed ``position_ids``;
    - the schedule (:func:`build_pipeline`); a schedule that ``measures_costs`` (Auto) is timed
      on the first :meth:`step` (:class:`StageTimer`) and rebuilt for the measured costs;
    - the loss: ``loss_fn(output, target)`` returns a micro-batch's token-loss *sum*; the
      runner multiplies it by :meth:`step`'s ``loss_scale`` for the backward and sums the
      unscaled values it records;
    - gradients of mirrored stage copies (DualPipe) and clipping (:meth:`clip_grad_norm`).
    - deferred weight gradients (``split_backward="deferred"``, schedules with I and W
      actions): the stage modules' linears are converted by
      :func:`titanext.plugins.weight_grad.defer_weight_grads`, I runs one plain backward that
      queues their dW GEMMs, and W runs that micro-batch's queue; ``"autograd"`` keeps torch's
      ``stage_backward_input`` / ``stage_backward_weight`` split.
    - ``comm_overlap``: the paired forward and backward chunks of DualPipe, DualPipeV, 1F1B and
      Interleaved1F1B run interleaved at their expert-parallel all-to-alls
      (:mod:`titanext.schedules.overlap`).

    - a model of another layout, as :func:`split_model` takes it: ``blocks`` (a dotted path),
      ``first`` / ``last`` (the parts only the first / last stage holds) and ``skip_missing``
      (each stage runs the model's own ``forward``, and every stage is handed the inputs by
      the name of that forward's first argument).

    The caller sees only :meth:`step` and :meth:`clip_grad_norm`, plus :attr:`parts` (the
    stage modules, for the optimizer and checkpoints). ``titanext.train`` uses it like this::

        plan = pipeline_plan("ZBH1", pp=dims.pp, microbatches=4, n_layers=len(model.layers))
        runner = PipelineRunner(model, dims, plan, loss_fn=token_loss_sum, device=device,
                                parallelize_stage=lambda m: parallelize(m, dims, recipe, ...))
        optimizer = build_optimizer([p for part in runner.parts for p in part.parameters()])
        loss_sum = runner.step(batches, loss_scale=dp_size / global_tokens)
        grad_norm = runner.clip_grad_norm(max_norm)
        optimizer.step()

    Tested against one process in tests/multiprocess/test_pipeline.py (every schedule, through
    the trainer).
    """

    def __init__(self, model: nn.Module, dims, plan: PipelinePlan, *,
                 loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
                 device: torch.device, position_ids: torch.Tensor | None = None,
                 parallelize_stage: Callable[[nn.Module], nn.Module] | None = None,
                 reset_stage_state: Callable[[nn.Module], None] | None = None,
                 loss_context: Callable[[], AbstractContextManager] = nullcontext,
                 blocks: str = "layers", skip_missing: bool = False,
                 first: Sequence[str] | None = None, last: Sequence[str] | None = None):
        # split_model's protocol: blocks at a dotted path; skip_missing runs the model's own
        # forward on every stage, which then takes the inputs by keyword (see step)
        n_blocks = len(block_container(model, blocks))
        if plan.pp != dims.pp or sum(plan.layers_per_stage or ()) != n_blocks:
            raise ValueError(f"plan for pp = {plan.pp} and {sum(plan.layers_per_stage or ())} "
                             f"blocks does not fit pp = {dims.pp} and a model of "
                             f"{n_blocks} blocks at {blocks!r}")
        self.plan = plan
        cls = plan.schedule
        if plan.comm_overlap:  # paired F&B chunks interleaved at their EP all-to-alls
            cls = overlap_schedule_class(cls)
        self.schedule_class, self.device, self.microbatches = cls, device, plan.microbatches
        self.pp_group, pp_rank = dims.pp_mesh.get_group(), dims.pp_mesh.get_local_rank()
        # DualPipe runs two mirrored copies of a pp-stage model: rank r holds stage r of the
        # down copy and stage pp-1-r of the up copy, both initialised alike (FQN-keyed init)
        self.mirrored = plan.mirrored
        self._mirror_summed = False  # step() summed them (clip_grad_norm must not again)
        self.num_stages = plan.num_stages
        # ranks that hold the last stage report every micro-batch's loss (2 under DualPipe)
        self._loss_copies = plan.loss_copies
        self._input_kwarg = _first_input_name(model) if skip_missing else None
        self.stage_ids = list(plan.stage_ids(pp_rank))
        self._embedding_peer = self._mtp_embedding_peer(model, pp_rank)
        if parallelize_stage is None:
            parallelize_stage = _default_parallelize_stage(dims, device, blocks)
        parts = self._split(model, blocks, skip_missing, first, last)
        self.parts = [parallelize_stage(part) for part in parts]
        # Every stage runs RoPE but only the first sees the tokens: each is handed the positions
        # its rank's slice of the sequence holds (the same for every micro-batch and step).
        for part in self.parts if position_ids is not None else ():
            pass_position_ids(part, position_ids)
        self._token_loss, self._loss_context, self._reset = loss_fn, loss_context, reset_stage_state
        self._scale = 1.0
        self._loss_sum = torch.zeros((), dtype=torch.float64, device=device)
        #: Auto's measured f, b, w: each stage's, by stage index
        self.costs: dict[str, tuple[float, ...]] | None = None
        self._build()
        # Auto: time F, I and W on the first step, then switch to the schedule made for them.
        self._timer = StageTimer(self.stages) if getattr(cls, "measures_costs", False) else None

    def _mtp_embedding_peer(self, model: nn.Module, pp_rank: int) -> int | None:
        """MTP (titanext.models.mtp): the last stage holds a copy of the embedding, whose
        gradient is summed with the first stage's; the global rank of the other holder, where
        this rank holds one of them and the other is on another rank."""
        owners = self.plan.stage_owners
        if getattr(model, "mtp", None) is None or self.mirrored or owners[0] == owners[-1] \
                or pp_rank not in (owners[0], owners[-1]):
            return None
        peer = owners[-1] if pp_rank == owners[0] else owners[0]
        return dist.get_global_rank(self.pp_group, peer)

    def _split(self, model: nn.Module, blocks: str, skip_missing: bool,
               first: Sequence[str] | None, last: Sequence[str] | None) -> list[nn.Module]:
        """This rank's stage modules, cut from the (meta) model. Deferred weight gradients
        (schedules with I and W only): the linears' dW GEMMs are queued during I and run at W
        (a converter: before TP / FSDP); "autograd" keeps torch's stage_backward_input/_weight."""
        self.weight_grad_queue = None
        ends = {k: v for k, v in (("first", first), ("last", last)) if v is not None}
        parts = [split_model(model, self.plan.layers_per_stage, i, blocks=blocks,
                             skip_missing=skip_missing,
                             **{**stage_parts(model, i, self.num_stages), **ends})
                 for i in self.stage_ids]
        if self.plan.split_backward == "deferred" and self.schedule_class.splits_backward:
            self.weight_grad_queue = WeightGradQueue()
            for part in parts:
                defer_weight_grads(part)
        return parts

    def _build(self) -> None:
        self.stages, self.schedule = build_pipeline(
            self.parts, self.stage_ids, num_stages=self.num_stages, pp_group=self.pp_group,
            device=self.device, schedule=self.schedule_class, microbatches=self.microbatches,
            loss_fn=self._scaled_loss, costs=self.costs, weight_grad_queue=self.weight_grad_queue,
            # mirrored gradients are summed once per optimizer step (after accumulation)
            schedule_kwargs={"sum_mirrored_grads": False} if self.mirrored else None)
        if self._reset is not None:
            ignore_shape_inference_forward(self.parts, self._reset)
        label_chunks(self.stages)

    def stage_microbatches(self, batches: int) -> int:
        """The micro-batches each of this rank's stages runs in one :meth:`step` of ``batches``
        batches (a DualPipe stage copy runs one direction's half)."""
        return batches * (self.microbatches // 2 if self.mirrored else self.microbatches)

    def _scaled_loss(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """Per micro-batch on the last stage, inside ``schedule.step`` (already in the loss
        context: a nested one would switch loss parallel off before the backward)."""
        return self._token_loss(output, target) * self._scale

    def step(self, batches: Sequence[tuple[torch.Tensor, ...]], *,
             loss_scale: float) -> torch.Tensor:
        """One ``schedule.step`` per batch (gradient accumulation), with every micro-batch's
        loss multiplied by ``loss_scale`` for the backward. A batch is (inputs, labels) or
        (inputs, labels, position_ids, document_ids) as :func:`titanext.plugins.context_parallel.
        prepare_batch` returns it: [batch, seq] document ids and their positions are split into
        micro-batches with the inputs and handed to *every* stage's forward (each stage's
        attention masks its micro-batch's documents; RoPE restarts per document), for every
        schedule. Returns the unscaled loss sum (float64) of this rank's data-parallel share,
        summed over the pp ranks and counted once; sum it over the data-parallel ranks
        yourself. One call per optimizer step: under DualPipe the last batch's schedule step
        also sums the mirrored copies' gradients (overlapped with its last chunks)."""
        self._scale = loss_scale
        self._loss_sum.zero_()
        first, last = 0 in self.stage_ids, self.num_stages - 1 in self.stage_ids
        for i, (inputs, labels, *extra) in enumerate(batches):
            if self.mirrored:  # DualPipe sums the copies' gradients in the last step, early
                self.schedule.sum_mirrored_grads = self._mirror_summed = i == len(batches) - 1
            args = (inputs.to(self.device),) if first and self._input_kwarg is None else ()
            losses: list[torch.Tensor] = []
            kwargs = {"target": labels.to(self.device), "losses": losses} if last else {}
            if self._input_kwarg is not None:  # skip_missing: every stage takes the inputs
                kwargs[self._input_kwarg] = inputs.to(self.device)
            # torch splits step's keyword tensors along dim 0 like the inputs and passes
            # micro-batch j's slice to every stage's forward of j (first or not)
            kwargs.update(self.stage_kwargs(*extra))
            # return_outputs=False: the last stage keeps no logits of finished micro-batches
            # (torch's default holds all of them, then concatenates them: 2 x 2 GiB on the
            # 70B config's last stage)
            with self._loss_context():  # loss parallel: its backward runs inside step too
                self.schedule.step(*args, return_outputs=False, **kwargs)
            for loss in losses:  # the schedule's record of what each micro-batch returned
                loss = loss.full_tensor() if isinstance(loss, DTensor) else loss
                self._loss_sum += loss.detach().to(torch.float64) / self._scale
        if self._timer is not None:  # Auto's measuring step is done: switch schedules
            # every rank the same figures (all of them run this step): one set of lists
            self.costs = self._timer.costs(dist.group.WORLD, self.num_stages, self.device)
            self._timer.detach()
            self._timer = None
            self._build()
        self.sum_shared_embedding_grads()
        loss_sum = self._loss_sum.clone()
        dist.all_reduce(loss_sum, group=self.pp_group)  # only the last stage saw the loss
        return loss_sum / self._loss_copies

    def stage_kwargs(self, position_ids: torch.Tensor | None = None,
                     document_ids: torch.Tensor | None = None,
                     mtp_labels: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        """The per-micro-batch keywords of every stage's forward: document ids and their
        [batch, seq] positions (positions shared by all rows stay in the position hook), and
        the MTP labels (:func:`titanext.models.mtp.mtp_labels`; the last stage uses them)."""
        out = {}
        if mtp_labels is not None:
            out["mtp_labels"] = mtp_labels.to(self.device)
        if document_ids is not None:
            out["document_ids"] = document_ids.to(self.device)
        if position_ids is not None and position_ids.dim() == 2:
            out["position_ids"] = position_ids.to(self.device)
        return out

    def _embedding_copies(self) -> tuple[nn.Parameter | None, nn.Parameter | None]:
        """(this rank's first-stage embedding, its last stage's MTP copy), None where absent."""
        first = last = None
        for i, part in zip(self.stage_ids, self.parts, strict=True):
            if getattr(part, "mtp", None) is None or getattr(part, "tok_embeddings", None) is None:
                continue
            if i == self.num_stages - 1:
                last = part.tok_embeddings.weight
        if last is not None or self._embedding_peer is not None:
            first = next((p.tok_embeddings.weight for i, p in zip(self.stage_ids, self.parts)
                          if i == 0), None)
        return first, last

    def sum_shared_embedding_grads(self) -> None:
        """MTP: give the first stage's embedding and the last stage's copy the sum of their
        gradients, exactly as for one shared parameter (a + b on both sides: bitwise equal
        copies, and so equal optimizer updates). On one rank (ZBV, DualPipe after its mirrored
        sum) it adds locally; across ranks it swaps the (FSDP-local) gradients with the peer
        over the pp group. A no-op without MTP."""
        first, last = self._embedding_copies()
        if last is None and self._embedding_peer is None:
            return
        if first is not None and last is not None:
            if first.grad is None or last.grad is None:
                return
            total = _local(first.grad) + _local(last.grad)  # the same order on every rank
            _local(first.grad).copy_(total)
            _local(last.grad).copy_(total)
            return
        mine = first if first is not None else last
        grad = _local(mine.grad) if mine.grad is not None else torch.zeros_like(_local(mine))
        theirs = torch.empty_like(grad)
        reqs = dist.batch_isend_irecv(
            [dist.P2POp(dist.isend, grad.contiguous(), self._embedding_peer, self.pp_group),
             dist.P2POp(dist.irecv, theirs, self._embedding_peer, self.pp_group)])
        with phase(PP_WAIT):
            for req in reqs:
                req.wait()
        total = grad + theirs if first is not None else theirs + grad  # first + last
        if mine.grad is None:
            mine.grad = total  # (plain tensors only: FSDP always holds a gradient)
        else:
            _local(mine.grad).copy_(total)

    def clip_grad_norm(self, max_norm: float) -> torch.Tensor:
        """Clip every stage's gradients by their global norm over the pp group; returns the
        norm. Mirrored copies (DualPipe) first get their summed gradient (bitwise equal on
        both) and count once in the norm; so does the MTP's copy of the embedding."""
        _, copy = self._embedding_copies()
        if self.mirrored:
            if not self._mirror_summed:
                sum_mirrored_grads(self.stages)
            self._mirror_summed = False
            down = [q for q in self.parts[0].parameters() if q is not copy]
            up = list(self.parts[1].parameters())
            if copy is not None and not any(q is copy for q in up):
                up.append(copy)  # the down copy's last stage: counted by stage 0's embedding
            return clip_mirrored_grads(down, up, max_norm, pp_group=self.pp_group)
        params = [q for part in self.parts for q in part.parameters()]
        if copy is None:
            return clip_grad_norm_(params, max_norm, pp_group=self.pp_group)
        return clip_mirrored_grads([q for q in params if q is not copy], [copy], max_norm,
                                   pp_group=self.pp_group)

