"""The one place that touches torch.distributed.pipelining's private schedule IR and runtime.

torch executes custom schedules given as per-rank lists of ``_Action`` (stage, kind,
micro-batch); it inserts the send/recv actions itself (``_add_send_recv``), validates lists
(``_validate_schedule``) and lets a schedule replace the handler of a computation kind
(``register_custom_function``). These names are private but present in torch 2.11-2.13; every
use goes through this module so a rename is fixed here only.

Two runtime subclasses live here:

- ``ListRuntime``: runs compute-only lists lowered by torch (loop and V placements).
- ``ChainRuntime``: runs lists whose stage chain we define (V with overlapped F&B chunks, and
  DualPipe, where a micro-batch's direction decides which rank holds a stage). It registers
  its own F, I, B, W and OVERLAP_F_B handlers; the overlapped handler issues the forward
  chunk's send before it computes the backward chunk, so the activation travels while the
  backward runs (and the backward's gradient receive, posted earlier, lands while the forward
  runs). With ``comm_overlap`` set (``[parallelism] expert_parallel_comm_overlap``), the two
  chunks run interleaved at their collectives instead
  (:func:`titanext.plugins._baton_threads.run_interleaved`): each chunk's expert-parallel
  all-to-alls travel while the other chunk computes.
"""

from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import Callable, Iterator
from types import SimpleNamespace

import torch
import torch.distributed as dist
from torch.distributed.pipelining import _utils as u
from torch.distributed.pipelining import schedules as _s

from titanext._profiler_ranges import PP_WAIT, phase
from titanext.plugins._baton_threads import run_interleaved

Action = _s._Action
Kind = _s._ComputationType
F, I, W, B = Kind.FORWARD, Kind.BACKWARD_INPUT, Kind.BACKWARD_WEIGHT, Kind.FULL_BACKWARD  # noqa: E741
OVERLAP = getattr(Kind, "OVERLAP_F_B", None)  # the custom-function seam of overlapped chunks
SEND_F, RECV_F, SEND_B, RECV_B = Kind.SEND_F, Kind.RECV_F, Kind.SEND_B, Kind.RECV_B
COMPUTE_KINDS = (F, I, W, B)
Runtime = _s._PipelineScheduleRuntime


def require_overlap_seam() -> None:
    """Raise RuntimeError if this torch's pipelining lacks the OVERLAP_F_B computation type and
    ``register_custom_function`` (overlapped forward/backward chunks need both)."""
    if OVERLAP is None or not hasattr(Runtime, "register_custom_function"):
        raise RuntimeError(f"torch {torch.__version__}: torch.distributed.pipelining has no "
                           "_ComputationType.OVERLAP_F_B / register_custom_function; overlapped "
                           "F&B chunks (DualPipe, DualPipeV, expert_parallel_comm_overlap) need "
                           "a torch that has them (2.11 to 2.14 do)")


def torch_schedule_class(name: str) -> type | None:
    """torch's schedule class ``name`` (e.g. ``"ScheduleZBVZeroBubble"``), None if this torch
    lacks it."""
    return getattr(_s, name, None)


def is_single_stage(cls: type) -> bool:
    """Whether schedule class ``cls`` runs one stage object per rank (GPipe, 1F1B)."""
    return issubclass(cls, _s.PipelineScheduleSingle)


def stages_of(schedule) -> list:
    """The ``PipelineStage`` objects a schedule instance runs on this rank."""
    return schedule._stages


def microbatch_count(schedule) -> int:
    """How many micro-batches one ``schedule.step`` splits the batch into."""
    return schedule._n_microbatches


def schedule_loss_fn(schedule):
    """The ``loss_fn`` a schedule instance was built with (None: no loss)."""
    return schedule._loss_fn


def set_pipeline_order(schedule, order: dict[int, list], stage_to_rank: dict[int, int]) -> None:
    """Make a runtime schedule run the compute-only per-rank lists ``order`` on stages placed by
    ``stage_to_rank``: torch lowers them (adds send/recv, unshard and reduce-grad actions) into
    ``schedule.pipeline_order_with_comms``."""
    for stage in schedule._stages:
        stage.stage_index_to_group_rank = stage_to_rank
    schedule.stage_index_to_group_rank = stage_to_rank
    schedule.pipeline_order = order
    schedule._prepare_schedule_with_comms(order)


def no_self_warmup(stages: list) -> None:
    """Keep a schedule's one-off link warm-up from messaging this rank itself.

    torch 2.11's ``_initialize_stages`` warms every stage's links with a send and a receive to
    each neighbour stage's rank (``_get_init_p2p_neighbors_ops``; 2.13 votes instead). Where two
    adjacent stages sit on one rank (V placement: stages 1 and 2 at pp=2, 3 and 4 at pp=4) that
    rank would message itself, which gloo refuses ("Pair is not connected") and NCCL does not
    need; such stages hand activations over locally. The ops to this rank are dropped (a no-op
    for a torch without the method)."""
    for stage in stages:
        ops = getattr(stage, "_get_init_p2p_neighbors_ops", None)
        if ops is None or getattr(ops, "_titanext", False):
            continue

        def peers_only(ops=ops):
            me = dist.get_rank()
            return [op for op in ops() if op.peer != me]

        peers_only._titanext = True
        stage._get_init_p2p_neighbors_ops = peers_only


def action(stage: int, kind: Kind, microbatch: int) -> Action:
    return Action(stage, kind, microbatch)


def overlapped(forward: Action, backward: Action) -> Action:
    """One OVERLAP_F_B action: ``forward``'s chunk computed alongside ``backward``'s."""
    return Action(forward.stage_index, OVERLAP, None, (forward, backward))


def leaves(a: Action) -> tuple[Action, ...]:
    """The compute actions inside ``a`` (its sub-actions for OVERLAP_F_B)."""
    return tuple(a.sub_actions) if a.sub_actions is not None else (a,)


def check_actions(compute: dict[int, list], pp: int, num_stages: int, microbatches: int) -> None:
    """torch's own check of a compute-only schedule (raises on an invalid one)."""
    _s._validate_schedule(compute, pp, num_stages, microbatches)


def format_order(order: dict[int, list]) -> str:
    """torch's table of a schedule (one column per rank)."""
    return _s._format_pipeline_order(order)


class _Runtime(Runtime):
    """torch's runtime, its one-off start-up kept from messaging this rank itself."""

    def _initialize_stages(self, *args, **kwargs):
        no_self_warmup(self._stages)
        return super()._initialize_stages(*args, **kwargs)


class ListRuntime(_Runtime):
    """torch's runtime with ``pipeline_order`` set from generated compute-only lists."""

    def _set_order(self, order: dict[int, list], mapping: dict[int, int]) -> None:
        set_pipeline_order(self, order, mapping)


class ChainRuntime(_Runtime):
    """Runs per-rank lists on a stage chain described by ``_chain``.

    ``_chain(stage, mb) -> (previous stage on this rank or None, next stage on this rank or
    None)`` and ``_seen(stage)`` (micro-batches through a stage) are supplied by the subclass.
    """

    #: run the two chunks of an OVERLAP_F_B action interleaved at their collectives
    comm_overlap = False

    def _install_handlers(self) -> None:
        require_overlap_seam()
        self.register_custom_function(F, lambda a, ctx: self._forward(a, ctx))
        self.register_custom_function(B, lambda a, ctx: self._backward(a, full=True))
        self.register_custom_function(I, lambda a, ctx: self._backward(a, full=False))
        self.register_custom_function(W, lambda a, ctx: self._weight(a))
        self.register_custom_function(OVERLAP, self._overlap)
        self._titan_losses: dict[int, torch.Tensor] = {}
        self._save_outputs = True
        self._early_sends: list[dist.Work] = []
        self._done_count: Counter[int] = Counter()

    def _set_lowered(self, compute: dict[int, list], with_comm: dict[int, list]) -> None:
        self.pipeline_order = compute
        self.pipeline_order_with_comms = {r: _drop_overlap_sends(a) for r, a in with_comm.items()}

    def _stage(self, index: int):
        return next(s for s in self._stages if s.stage_index == index)

    def _sync(self, stage) -> None:
        if hasattr(self, "_assert_unsharded") and stage.stage_index in self.unshard_ops:
            self._assert_unsharded(stage)

    def _forward(self, a: Action, ctx) -> None:
        stage, j = self._stage(a.stage_index), a.microbatch_index
        prev_local, next_local = self._chain(a.stage_index, j)
        self._sync(stage)
        if not stage.is_first and prev_local is None:
            _wait(self.fwd_recv_ops.pop((a.stage_index, j), None))  # None: waited already
        out = stage.forward_one_chunk(j, ctx.arg_mbs[j], ctx.kwarg_mbs[j],
                                      save_forward_output=self._save_outputs)
        if stage.is_last and self._loss_fn is not None:
            self._titan_losses[j] = self._compute_loss(out, ctx.target_mbs[j])
        if next_local is not None:
            self._stage(next_local).set_local_fwd_input(out, j)

    def _backward(self, a: Action, *, full: bool) -> None:
        stage, j = self._stage(a.stage_index), a.microbatch_index
        prev_local, next_local = self._chain(a.stage_index, j)
        self._sync(stage)
        if not stage.is_last and next_local is None:
            _wait(self.bwd_recv_ops.pop((a.stage_index, j), None))
        last = False
        if full:
            self._done_count[a.stage_index] += 1
            last = self._done_count[a.stage_index] == self._seen(a.stage_index)
        stage.backward_one_chunk(j, loss=self._titan_losses.get(j) if stage.is_last else None,
                                 full_backward=full, last_backward=last)
        if prev_local is not None:
            self._stage(prev_local).set_local_bwd_input(stage.get_local_bwd_output(j), j)

    def _weight(self, a: Action) -> None:
        stage = self._stage(a.stage_index)
        self._done_count[a.stage_index] += 1
        stage.backward_weight_one_chunk(
            a.microbatch_index,
            last_backward=self._done_count[a.stage_index] == self._seen(a.stage_index))

    def _overlap(self, a: Action, ctx) -> None:
        """Forward chunk, its send issued at once, then the backward chunk and its send."""
        fwd, bwd = a.sub_actions
        if self.comm_overlap and bwd.computation_type in (B, I):
            self._interleaved(fwd, bwd, ctx)
            return
        self._forward(fwd, ctx)
        stage = self._stage(fwd.stage_index)
        if not stage.is_last and self._chain(fwd.stage_index, fwd.microbatch_index)[1] is None:
            self._early_sends += _issue(stage.get_fwd_send_ops(fwd.microbatch_index))
        if bwd.computation_type == F:  # two forwards (DualPipe warm-up never does this)
            self._forward(bwd, ctx)
            return
        self._backward(bwd, full=bwd.computation_type == B)
        stage = self._stage(bwd.stage_index)
        if not stage.is_first and self._chain(bwd.stage_index, bwd.microbatch_index)[0] is None:
            self._early_sends += _issue(stage.get_bwd_send_ops(bwd.microbatch_index))

    def _interleaved(self, fwd: Action, bwd: Action, ctx) -> None:
        """Both chunks' receives waited first (as DeepSeek's DualPipe does), then forward and
        backward interleaved at their collectives; the forward's send goes as soon as its chunk
        is done, the backward's after both."""
        fs, bs = self._stage(fwd.stage_index), self._stage(bwd.stage_index)
        fj, bj = fwd.microbatch_index, bwd.microbatch_index
        if not fs.is_first and self._chain(fwd.stage_index, fj)[0] is None:
            _wait(self.fwd_recv_ops.pop((fwd.stage_index, fj)))
        if not bs.is_last and self._chain(bwd.stage_index, bj)[1] is None:
            _wait(self.bwd_recv_ops.pop((bwd.stage_index, bj)))

        def forward() -> None:
            self._forward(fwd, ctx)
            if not fs.is_last and self._chain(fwd.stage_index, fj)[1] is None:
                self._early_sends += _issue(fs.get_fwd_send_ops(fj))

        run_interleaved(forward, lambda: self._backward(bwd, full=bwd.computation_type == B))
        if not bs.is_first and self._chain(bwd.stage_index, bj)[0] is None:
            self._early_sends += _issue(bs.get_bwd_send_ops(bj))

    def step(self, *args, return_outputs: bool = True, **kwargs):
        # the custom F handler saves the last stage's outputs only when step returns them
        self._save_outputs = return_outputs
        return super().step(*args, return_outputs=return_outputs, **kwargs)

    def _step_microbatches(self, *args, **kwargs):
        self._titan_losses.clear()
        self._done_count.clear()
        try:
            return super()._step_microbatches(*args, **kwargs)
        finally:
            _wait(self._early_sends)
            self._early_sends = []

    def _update_losses(self, stages, losses) -> None:
        _wait(self._early_sends)
        self._early_sends = []
        merged = self._merge_losses(self._titan_losses)
        if losses is not None and merged:
            losses.clear()
            losses.extend(merged[j] for j in range(self._n_microbatches))
        self._internal_losses.clear()

    def _merge_losses(self, mine: dict[int, torch.Tensor]) -> dict[int, torch.Tensor]:
        return mine


def _drop_overlap_sends(acts: list) -> list:
    """Remove the SEND_F/SEND_B of overlapped chunks: their handler issues them itself."""
    early = set()
    for a in acts:
        if a is not None and a.computation_type == OVERLAP:
            fwd, bwd = a.sub_actions
            early.add((SEND_F, fwd.stage_index, fwd.microbatch_index))
            if bwd.computation_type in (B, I):
                early.add((SEND_B, bwd.stage_index, bwd.microbatch_index))
    return [a for a in acts if a is None
            or (a.computation_type, a.stage_index, a.microbatch_index) not in early]


def _issue(ops: list) -> list[dist.Work]:
    return list(dist.batch_isend_irecv(ops)) if ops else []


def _wait(works) -> None:
    if not works:
        return
    with phase(PP_WAIT):
        for w in works:
            w.wait()


def record_p2p_waits() -> None:
    """Make torch's own schedules' P2P wait points (``schedules._wait_batch_p2p``, which every
    built-in schedule and the runtime call before a chunk that needs a received tensor, and on
    their sends) open a ``titanext:pp_wait`` range while a profiler collects, as titanext's own
    runtimes do. Idempotent; without a profiler the range costs one C call. A torch without
    that function keeps its waits unmarked (the step table then shows no PP wait)."""
    original = getattr(_s, "_wait_batch_p2p", None)
    if original is None or getattr(original, "_titanext_pp_wait", False):
        return

    def wait_batch_p2p(work, *args, **kwargs):
        with phase(PP_WAIT):
            return original(work, *args, **kwargs)

    wait_batch_p2p._titanext_pp_wait = True
    _s._wait_batch_p2p = wait_batch_p2p


def add_comms(compute: dict[int, list], owner: Callable[[int, int], int], num_stages: int,
              microbatches_per_stage: int) -> dict[int, list]:
    """Insert send/recv actions for a chain where ``owner(stage, mb)`` gives the rank.

    Like torch's lowering, ranks are walked in lockstep and a receive is placed on the
    receiver the moment its sender's compute is placed, so every pair of ranks posts matching
    sends and receives in the same order. Also adds torch's REDUCE_GRAD / UNSHARD lowering
    where this torch has it.
    """
    todo = {r: list(acts) for r, acts in compute.items()}
    for r in todo:
        if hasattr(_s, "_add_unshard_reshard"):
            todo[r] = [a for a in _s._add_unshard_reshard(todo[r]) if a is not None]
        if hasattr(_s, "_add_reduce_grad"):
            todo[r] = [a for a in _s._add_reduce_grad(todo[r], microbatches_per_stage)
                       if a is not None]
    out: dict[int, list] = {r: [] for r in todo}
    seen: dict[int, set] = {r: set() for r in todo}

    def ready(r: int, a: Action) -> bool:
        s, j = a.stage_index, a.microbatch_index
        if a.computation_type == F and s > 0:
            return (s, RECV_F, j) in seen[r] or (s - 1, F, j) in seen[r]
        if a.computation_type in (I, B) and s < num_stages - 1:
            return ((s, RECV_B, j) in seen[r] or (s + 1, I, j) in seen[r]
                    or (s + 1, B, j) in seen[r])
        return True

    while any(todo.values()):
        progress = False
        for r in sorted(todo):
            if not todo[r]:
                continue
            a = todo[r][0]
            if not all(ready(r, x) for x in leaves(a)):
                continue
            out[r].append(a)
            for x in leaves(a):
                s, j, k = x.stage_index, x.microbatch_index, x.computation_type
                seen[r].add((s, k, j))
                if k == F and s < num_stages - 1 and owner(s + 1, j) != r:
                    out[r].append(Action(s, SEND_F, j))
                    peer = owner(s + 1, j)
                    out[peer].append(Action(s + 1, RECV_F, j))
                    seen[peer].add((s + 1, RECV_F, j))
                if k in (I, B) and s > 0 and owner(s - 1, j) != r:
                    out[r].append(Action(s, SEND_B, j))
                    peer = owner(s - 1, j)
                    out[peer].append(Action(s - 1, RECV_B, j))
                    seen[peer].add((s - 1, RECV_B, j))
            todo[r].pop(0)
            progress = True
        if not progress:
            raise ValueError("malformed schedule: no rank can place its next action: "
                             + str({r: str(a[0]) for r, a in todo.items() if a}))
    return out


def torch_pipeline_order(cls: type, pp: int, microbatches: int, stages_per_rank: int) -> dict:
    """The compute lists torch's multi-stage schedule ``cls`` builds, without processes.

    torch computes every rank's list in the constructor from the stages' metadata only, so
    stand-in stage objects carrying that metadata are enough.
    """

    n = pp * stages_per_rank
    stages = [SimpleNamespace(stage_index=i, num_stages=n, group_size=pp, group_rank=0,
                              group=None, is_first=i == 0, is_last=i == n - 1, submod=None)
              for i in range(stages_per_rank)]
    order = cls(stages, microbatches, loss_fn=lambda out, target: out).pipeline_order
    return {r: [a for a in acts if a is not None] for r, acts in order.items()}


def loopback_stage_metadata(schedule, hidden: torch.Tensor) -> None:
    """Dry run (torch's fake process group): answer a schedule's start-up exchanges locally.

    On its first step a schedule infers every stage's input and output shapes, receiving the
    previous stage's output metadata from its rank and sending its own on. A fake process group
    delivers nothing, so here every stage whose neighbour sits on another rank takes ``hidden``'s
    metadata, the activation that flows between any two stages of a decoder (``[micro-batch,
    local sequence, dim]``, its dtype, requires_grad), and its gradient's; sends do nothing.

    Two start-up protocols exist, told apart by their methods: torch 2.13+ votes over the pp
    ranks (``_warmup_p2p``, an ``.item()`` on a received tensor) and then exchanges
    ``_StageForwardMeta`` / ``_StageBackwardMeta`` (``_recv_meta`` / ``_send_meta``); torch 2.11
    runs ``_shape_inference`` per stage over ``recv_object_list`` / ``send_object_list``. Raises
    RuntimeError on a torch with neither (the dry run then cannot run pipelines)."""
    stages = getattr(schedule, "_stages", None) or [schedule._stage]
    if _has_meta_protocol(schedule, stages):
        _loopback_meta_protocol(schedule, stages, hidden)
    elif all(hasattr(s, "_shape_inference") and hasattr(s, "stage_index_to_group_rank")
             for s in stages):
        for stage in stages:
            _local_shape_inference(stage, hidden)
    else:
        raise RuntimeError("this torch's pipelining has neither the _warmup_p2p / _recv_meta "
                           "start-up protocol (torch 2.13+) nor per-stage _shape_inference "
                           "(torch 2.11): a dry run cannot run pipeline stages")


_META_NAMES = ("InferenceMode", "_StageForwardMeta", "_StageBackwardMeta", "_derive_grad_metas",
               "extract_tensor_metas")


def _has_meta_protocol(schedule, stages: list) -> bool:
    return (all(hasattr(u, n) for n in _META_NAMES) and hasattr(schedule, "_warmup_p2p")
            and all(hasattr(s, "_recv_meta") for s in stages))


def _loopback_meta_protocol(schedule, stages: list, hidden: torch.Tensor) -> None:
    """torch 2.13+: every stage infers its shapes (DYNAMIC) and receives ``hidden``'s metadata."""
    fwd = u._StageForwardMeta(forward_metas=u.extract_tensor_metas((hidden,)))
    bwd = u._StageBackwardMeta(backward_metas=u._derive_grad_metas(fwd.forward_metas))

    def warmup(stages, has_backward, p2p_done):
        for stage in stages:
            stage._inference_mode = u.InferenceMode.DYNAMIC

    schedule._warmup_p2p = warmup
    for stage in stages:
        stage._recv_meta = lambda src, stage=stage: fwd if src < stage.stage_index else bwd
        stage._send_meta = lambda meta, dst: None


def _local_shape_inference(stage, hidden: torch.Tensor) -> None:
    """torch 2.11: ``stage`` runs its shape inference as if both neighbour stages were on this
    rank (torch then passes shapes between them in memory, not over the process group): a
    stage whose previous stage is elsewhere gets ``(hidden,)`` as its input, and the output
    metadata of one whose next stage is elsewhere goes nowhere. The gradient buffers torch then
    derives from the output metadata."""
    infer = stage._shape_inference

    def local(args, kwargs=None):
        owners, me, i = stage.stage_index_to_group_rank, stage.group_rank, stage.stage_index
        remote_prev = not stage.is_first and owners[i - 1] != me
        remote_next = not stage.is_last and owners[i + 1] != me
        stage.stage_index_to_group_rank = {**owners, **{j: me for j in (i - 1, i + 1)
                                                       if j in owners}}
        try:
            out = infer((hidden,) if remote_prev else args, kwargs)
        finally:
            stage.stage_index_to_group_rank = owners
        return () if remote_next else out

    stage._shape_inference = local


@contextlib.contextmanager
def around_stage_init(schedule, context: Callable) -> Iterator[None]:
    """Inside the block, a schedule's one-off stage start-up (shape inference on its first
    step) runs inside ``context()``: the dry run's memory tracker pauses its module hooks there
    (they break the ``autograd.grad`` of torch's backward shape inference). torch calls the
    start-up at every step (a no-op once done), so the wrapper comes off on leaving the block:
    left on, a later step would re-enter the pause's ``finally`` of a tracker long gone and
    switch that tracker's global module hooks back on for good. ``schedule=None`` (no
    pipeline): nothing to wrap."""
    if schedule is None:
        yield
        return
    name = next((n for n in ("_initialize_stages", "_initialize_stage") if hasattr(schedule, n)),
                None)
    if name is None:
        raise RuntimeError("this torch's pipeline schedules have no _initialize_stage(s): a dry "
                           "run cannot measure pipeline stages (torch 2.13 has it)")
    init = getattr(schedule, name)

    def wrapped(*args, **kwargs):
        with context():
            return init(*args, **kwargs)

    setattr(schedule, name, wrapped)
    try:
        yield
    finally:
        delattr(schedule, name)  # the class's method again


# --- receive buffers that follow the micro-batches in flight ------------------------------

_RELEASED = "_titanext_recv_device"  # set on a released buffer's stand-in: where to reallocate
_FOLLOWING = "_titanext_follows_in_flight"  # set on a stage follow_in_flight has converted
_RECV_NAMES = ("args_recv_info", "grad_recv_info", "get_fwd_recv_ops", "get_bwd_recv_ops",
               "backward_one_chunk")


class _ReleasingDict(dict):
    """A stage's ``args_recv_info`` / ``grad_recv_info``: receive buffers stored into it are
    released at once, so a stage's start-up never holds one per micro-batch."""

    def __setitem__(self, mb, infos) -> None:
        _release(infos)
        super().__setitem__(mb, infos)


def _release(infos) -> None:
    """Replace each received buffer of ``infos`` (``_RecvInfo`` tuple) by a meta stand-in of its
    size, stride, dtype and requires_grad, marked with the device to reallocate on."""
    for info in infos or ():
        buf = getattr(info, "buffer", None)
        if (not isinstance(buf, torch.Tensor) or getattr(info, "is_root_arg", False)
                or getattr(buf, _RELEASED, None) is not None):
            continue
        stand_in = torch.empty_strided(buf.size(), buf.stride(), dtype=buf.dtype, device="meta")
        if buf.requires_grad:
            stand_in.requires_grad_(True)
        setattr(stand_in, _RELEASED, buf.device)
        info.buffer = stand_in


def _allocate(infos, only=None) -> None:
    """Give each released buffer of ``infos`` (those at the positions in ``only``, if given)
    fresh memory of its recorded layout."""
    for i, info in enumerate(infos or ()):
        device = getattr(getattr(info, "buffer", None), _RELEASED, None)
        if device is None or (only is not None and i not in only):
            continue
        stand_in = info.buffer
        fresh = torch.empty_strided(stand_in.size(), stand_in.stride(), dtype=stand_in.dtype,
                                    device=device)
        info.buffer = fresh.requires_grad_(True) if stand_in.requires_grad else fresh


def follow_in_flight(stage) -> bool:
    """Make ``stage`` (a ``PipelineStage``) hold receive buffers only for the micro-batches in
    flight; returns whether it could (False: this torch's stage lacks the names used, and it
    keeps torch's behaviour).

    torch's stage allocates, at start-up, one buffer per micro-batch for its input activation
    (``args_recv_info[j]``) and one for its output gradient (``grad_recv_info[j]``), and keeps
    all of them across steps: ``2 m`` boundary tensors per stage (28 GB per rank for
    DeepSeek-V3's 120 micro-batches under DualPipe), where a schedule has about pp in flight.
    Here a micro-batch's buffer is allocated when its receive is posted
    (``get_fwd_recv_ops`` / ``get_bwd_recv_ops``, or read) and let go once that micro-batch's
    backward (B, or I under a split backward) is done; what W still needs, torch's
    ``backward_state`` and autograd keep alive on their own, and free after W. Activations
    handed over between two stages of one rank (``set_local_fwd_input`` /
    ``set_local_bwd_input``) are let go at the same point, and a last stage's loss, which the
    schedule keeps to return, is detached in place after its full backward (its spent graph
    would keep the micro-batch's received input alive until the caller drops the losses).

    Always on (``titanext.distributed.pipeline.build_pipeline`` applies it): a received tensor
    overwrites all of its buffer, so values are bitwise those of torch's reused buffers
    (tests/multiprocess/test_recv_buffers.py), and on CUDA a fresh buffer is a caching
    allocator hit, not a ``cudaMalloc``. Works on the instance (its methods wrapped), for
    every schedule, torch's or titanext's, and on any backend."""
    if not all(hasattr(stage, n) for n in _RECV_NAMES) or getattr(stage, _FOLLOWING, False):
        return False
    for name in ("args_recv_info", "grad_recv_info"):
        table = getattr(stage, name)
        if isinstance(table, dict) and not isinstance(table, _ReleasingDict):
            setattr(stage, name, _ReleasingDict(table))
            for infos in table.values():
                _release(infos)

    def infos(name: str, mb: int):
        return getattr(stage, name, {}).get(mb, ())

    def allocating(meth: str, name: str):
        original = getattr(stage, meth)

        def run(mb, *args, **kwargs):
            _allocate(infos(name, mb))
            return original(mb, *args, **kwargs)

        return run

    stage.get_fwd_recv_ops = allocating("get_fwd_recv_ops", "args_recv_info")
    stage.get_bwd_recv_ops = allocating("get_bwd_recv_ops", "grad_recv_info")
    for meth, name in (("_retrieve_recv_activations", "args_recv_info"),
                       ("_retrieve_recv_grads", "grad_recv_info")):
        if hasattr(stage, meth):  # a receive never posted reads a buffer, as torch's would
            setattr(stage, meth, allocating(meth, name))
    if hasattr(stage, "set_local_bwd_input"):  # a None gradient zeroes the buffer in place
        set_bwd = stage.set_local_bwd_input

        def set_local_bwd_input(grads, mb, *args, **kwargs):
            _allocate(infos("grad_recv_info", mb),
                      only={i for i, g in enumerate(grads or ()) if g is None})
            return set_bwd(grads, mb, *args, **kwargs)

        stage.set_local_bwd_input = set_local_bwd_input
    backward = stage.backward_one_chunk

    def backward_one_chunk(mb, loss=None, full_backward=True, **kwargs):
        out = backward(mb, loss=loss, full_backward=full_backward, **kwargs)
        _release(infos("args_recv_info", mb))
        _release(infos("grad_recv_info", mb))
        if (full_backward and isinstance(loss, torch.Tensor) and loss.grad_fn is not None
                and not loss._is_view()):
            # the schedule keeps the loss to return it; its graph would keep this micro-batch's
            # received input alive until the caller drops it (one input per micro-batch)
            loss.detach_()
        return out

    stage.backward_one_chunk = backward_one_chunk
    setattr(stage, _FOLLOWING, True)
    return True
