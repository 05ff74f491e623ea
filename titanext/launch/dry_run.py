"""Dry run: ``[comm] mode = "fake_backend"`` (docs/dry_run.md).

One ordinary process becomes rank ``comm.fake_rank`` of ``comm.fake_world_size`` over torch's
fake process group, builds the real :class:`~titanext.trainer.Trainer` (mesh, meta model, every
plugin, pipeline split and schedule) under a fake-tensor mode, and runs one full training step
(forward, backward, optimizer) through :meth:`~titanext.trainer.Trainer.train_step`. Tensors
are fake (shapes, dtypes and devices only) and collectives return at once, so a 512-rank
layout of a 405B model is checked on a laptop:

    python -m titanext.train --config train_configs/llama3_8b.toml --comm.mode=fake_backend

It measures this rank's memory with torch's ``MemTracker`` (parameters, gradients, optimizer
state, activations including the pipeline's in-flight micro-batches, the peak of the step) and
every collective's bytes with a dispatch mode (torch's ``CommDebugMode`` fails in its module
hooks on the 8B config's activation-checkpointed blocks in torch 2.13, so calls and bytes are
counted here), prints a table and ends with one line::

    titanext: dry run: rank R of N, peak memory X.XX GiB (planner: Y.YY GiB), step comm Z.ZZ GB

Collective bytes are each call's largest buffer: the gathered output of an all-gather, the
input of a reduce-scatter, the tensor of an all-reduce, send or receive, the input of an
all-to-all (what the call moves through this rank's buffers, not wire bytes of a ring).
"""

from __future__ import annotations

import contextlib
import copy
import inspect
import math
import time
from collections import defaultdict

import torch
import torch.distributed as dist

from titanext._fake_backend import (
    TorchDispatchMode,
    fake_tensor_mode,
    host_float,
    init_fake_process_group,
    mem_tracker,
    tree_leaves,
)
from titanext._text import format_table
from titanext.config import JobConfig
from titanext.config.layout import fake_world_size, resolve_job_layout
from titanext.models.llama import sdpa_attention
from titanext.planning.estimate import plan_config
from titanext.planning.layout import resolve_layout
from titanext.planning.memory import memory_per_pp_rank
from titanext.plugins.expert_parallel._comm import count_comm
from titanext.plugins.recompute_modules import recompute_region
from titanext.schedules._torch_ir import around_stage_init, loopback_stage_metadata
from titanext.schedules.orders import Repetition, fewest_repeating_microbatches
from titanext.trainer import Trainer

__all__ = ["CommBytes", "DryRunResult", "dry_run", "dry_run_config", "fewer_microbatches",
           "host_float", "measure", "measure_real", "planner_peak_bytes", "use_fused_attention"]

GiB, GB = 2**30, 1e9
# Gradient-accumulation rounds a dry run runs: the first creates the gradients, the second is
# the steady state every later round repeats (same tensors, same collectives).
MEASURED_ROUNDS = 2
_COMM_NAMESPACES = ("c10d", "_c10d_functional", "c10d_functional")
_SKIP = ("wait", "barrier", "monitored_barrier")


class CommBytes(TorchDispatchMode):
    """Bytes and calls per collective op (``c10d`` and functional collectives) run inside."""

    def __init__(self):
        super().__init__()
        self.bytes: dict[str, int] = defaultdict(int)
        self.calls: dict[str, int] = defaultdict(int)
        # with :func:`_stepping_fewer`: each call's (schedule step, (stage, micro-batch) whose
        # chunk or send / receive made it, or None: the step's own)
        self.step, self.owner = -1, None
        self.log: list[tuple[int, tuple | None, str, int]] = []
        self.seen: dict[int, set[int]] = defaultdict(set)  # each stage's micro-batches
        self.posts: list[tuple[int, tuple, str, int]] = []  # sends / receives a stage posted

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if getattr(func, "namespace", "") not in _COMM_NAMESPACES:  # every op: the short way
            return func(*args, **kwargs)
        name = func.__name__.split(".")[0]
        if not any(s in name for s in _SKIP):
            size = max((sum(t.numel() * t.element_size() for t in tree_leaves(a)
                            if isinstance(t, torch.Tensor)) for a in (*args, *kwargs.values())),
                       default=0)
            key = name.strip("_").removesuffix("_coalesced").removesuffix("_base")
            self.bytes[key] += size
            self.calls[key] += 1
            self.log.append((self.step, self.owner, key, size))
        return func(*args, **kwargs)


class DryRunResult:
    """What :func:`dry_run` measured (bytes) and the planner's figure for the same rank."""

    def __init__(self, rank: int, world_size: int, memory: dict[str, int], peak: int,
                 planner: float, comm: dict[str, int], calls: dict[str, int], seconds: float):
        self.rank, self.world_size, self.memory, self.peak = rank, world_size, memory, peak
        self.planner, self.comm, self.calls, self.seconds = planner, comm, calls, seconds
        self.notes: list[str] = []  # what is estimated or changed rather than measured
        self.optimizer_peak = 0  # the optimizer step's own peak (bytes), and the planner's
        self.planner_optimizer = 0.0
        self.optimizer_at = ""  # " (at N of M micro-batches)" where fewer were stepped

    @property
    def comm_total(self) -> int:
        return sum(self.comm.values())

    def summary(self) -> str:
        return (f"titanext: dry run: rank {self.rank} of {self.world_size}, peak memory "
                f"{self.peak / GiB:.2f} GiB (planner: {self.planner / GiB:.2f} GiB), "
                f"step comm {self.comm_total / GB:.2f} GB")


def planner_peak_bytes(cfg: JobConfig, world_size: int, rank: int, moment: str = "peak"
                       ) -> float:
    """What :func:`titanext.planning.cli.plan_config` gives for ``rank``'s pipeline position;
    ``moment="optimizer step"``: the planner's memory inside the optimizer step."""
    pp = cfg.parallelism.pipeline_parallel_degree
    pp_rank = rank // (world_size // pp)  # pp is the mesh's outermost axis
    if moment != "peak":  # no activations then: the micro-batches in flight do not matter
        memories, _ = memory_per_pp_rank(resolve_layout(cfg, world_size), [1] * pp,
                                         moment=moment)
        return float(sum(memories[pp_rank].values()))
    plan = plan_config(cfg, world_size)
    return float(sum(plan.memory_per_pp_rank[pp_rank].values()))


def dry_run_config(cfg: JobConfig) -> tuple[JobConfig, list[str]]:
    """The config a dry run steps (and :func:`measure_real` compares with): the target cluster's.

    ``mixed_precision_param = "auto"`` becomes ``"bfloat16"``, what a CUDA run uses (the dry run
    itself runs on the CPU device, where "auto" would mean float32); float8's ``auto_filter =
    "auto"`` converts what it does on float8 GPUs (on the CPU, every linear); ``torch.compile``
    is off (dynamo does not trace under an outer fake mode). Returns the config and a note per
    change.
    """
    notes = []
    f8 = cfg.float8
    # float8 on the CPU is emulated, where "auto" converts every linear; on the float8 GPUs the
    # planner plans for, torchao's size rule keeps the small ones in bf16, and those defer
    # their weight gradients (what a split backward holds from I to W differs)
    f8_auto = f8.enable and f8.auto_filter == "auto" and f8.emulate == "auto"
    if cfg.training.mixed_precision_param == "auto" or cfg.compile.enable or f8_auto:
        cfg = copy.deepcopy(cfg)
    if cfg.training.mixed_precision_param == "auto":
        cfg.training.mixed_precision_param = "bfloat16"
        notes.append('mixed_precision_param = "auto" is bfloat16 here, as on a CUDA cluster')
    if f8_auto:
        cfg.float8.auto_filter = True
        notes.append('float8 auto_filter = "auto" converts here what it does on float8 GPUs: '
                     "linears too small to gain stay in bf16 (the float8 math is emulated)")
    if cfg.compile.enable:
        cfg.compile.enable = False
        notes.append("torch.compile is off in a dry run: eager activations (an upper bound)")
    return cfg, notes


def fewer_microbatches(cfg: JobConfig, world_size: int, rank: int
                       ) -> tuple[JobConfig, Repetition | None, str | None]:
    """The config a pipelined dry run of ``rank`` builds, whether it steps fewer micro-batches,
    and a note saying why (None without a pipeline or with ``comm.fake_microbatches = "all"``).

    With ``"fewest"``: the fewest micro-batches whose action list on this rank's pipeline
    position is the full one less repetitions of its steady state
    (:func:`titanext.schedules.orders.fewest_repeating_microbatches`), local and global batch
    scaled with them (micro-batches of the same size). Not on a rank holding the last stage:
    the loss each micro-batch returns stays until the step's end, so its peak grows with the
    micro-batch count (by 4 bytes each), and not where no fewer count repeats the lists."""
    p = cfg.parallelism
    pp, m = p.pipeline_parallel_degree, p.pipeline_parallel_microbatches
    if pp == 1 or cfg.comm.fake_microbatches == "all":
        return cfg, None, None
    plan, pp_rank = resolve_job_layout(cfg, world_size).pipeline, rank // (world_size // pp)
    every = f"pipeline: all {m} micro-batches stepped: "
    if plan.num_stages - 1 in plan.rank_stage_ids[pp_rank]:
        return cfg, None, every + ("this rank holds the last stage, whose micro-batches' losses "
                                   "stay to the step's end (a peak that grows with their count)")
    rep = fewest_repeating_microbatches(
        plan.name, pp=pp, rank=pp_rank, microbatches=m, stages_per_rank=plan.stages_per_rank,
        max_pending_weight_grads=plan.max_pending_weight_grads, overlap=plan.comm_overlap)
    if rep is None:
        return cfg, None, every + ("no fewer micro-batches run this rank's action list less "
                                   "repetitions of a steady state")
    reduced, t = copy.deepcopy(cfg), cfg.training
    reduced.parallelism.pipeline_parallel_microbatches = rep.fewer
    reduced.training.local_batch_size = t.local_batch_size // m * rep.fewer
    if t.global_batch_size > 0:  # else local x dp, scaled with the local batch
        reduced.training.global_batch_size = t.global_batch_size // m * rep.fewer
    return reduced, rep, (
        f"pipeline: {rep.fewer} of {m} micro-batches stepped (exact): this rank's action list "
        f"at {m} is the one at {rep.fewer} with {rep.period} steady-state action(s) repeated "
        f"{rep.repeats} more times, which end holding what they began with, so the step passes "
        "through the same memory and peaks at the same bytes; all micro-batches' inputs are "
        "built, and each stage's middle micro-batch's collectives are added once per "
        "micro-batch not run (comm.fake_microbatches = 'all' steps every one)")


def _full_batches(trainer, rep: Repetition) -> list[tuple]:
    """Each accumulation round's loader batch at the full micro-batch count (its rows from as
    many of the reduced trainer's batches as it takes): every micro-batch's inputs exist for
    the step, as in the full run."""
    rows = trainer.cfg.training.local_batch_size // rep.fewer * rep.microbatches
    parts = [trainer.next_microbatches() for _ in range(-(-rep.microbatches // rep.fewer))]
    # a copy of the rows: a view would keep the whole concatenation's storage (a tracked size)
    return [tuple(None if ts[0] is None else torch.cat(ts)[:rows].clone() for ts in zip(*batches))
            for batches in zip(*parts)]


@contextlib.contextmanager
def _stepping_fewer(schedule, stages, rows: int, full: int, comm: CommBytes):
    """Inside: ``schedule.step`` hands its stages the first ``rows`` rows of each batch tensor
    of ``full`` rows (views: the whole batch stays alive, as in the full run; every tensor the
    runner hands the schedule is batch-first), and ``comm`` logs, with each
    collective, the schedule step and the (stage, micro-batch) whose F, I, B or W chunk ran it,
    and in ``comm.posts`` each send and receive a stage posts, with its micro-batch."""
    step = schedule.step

    def first_rows(*args, **kwargs):
        def cut(t):
            return t[:rows] if isinstance(t, torch.Tensor) and t.dim() and len(t) == full else t
        comm.step, comm.owner = comm.step + 1, None
        return step(*map(cut, args), **{k: cut(v) for k, v in kwargs.items()})

    def chunk(fn, stage: int):
        def run(j, *args, **kwargs):
            outer, comm.owner = comm.owner, (stage, j)
            comm.seen[stage].add(j)
            try:
                return fn(j, *args, **kwargs)
            finally:
                comm.owner = outer
        return run

    def post(fn, stage: int):
        def run(j, *args, **kwargs):
            ops = fn(j, *args, **kwargs)
            for op in ops:  # torch's P2POp: isend or irecv of one tensor
                key = "send" if op.op in (dist.isend, dist.send) else "recv"
                comm.posts.append((comm.step, (stage, j), key,
                                   op.tensor.numel() * op.tensor.element_size()))
            return ops
        return run

    chunks = ("forward_one_chunk", "backward_one_chunk", "backward_weight_one_chunk")
    posts = ("get_fwd_recv_ops", "get_bwd_recv_ops", "get_fwd_send_ops", "get_bwd_send_ops")
    saved = [(st, n, st.__dict__.get(n)) for st in stages for n in chunks + posts]
    schedule.step = first_rows
    for st, n, _ in saved:
        setattr(st, n, (chunk if n in chunks else post)(getattr(st, n), st.stage_index))
    try:
        yield
    finally:
        del schedule.step
        for st, n, fn in saved:
            if fn is None:
                delattr(st, n)
            else:
                setattr(st, n, fn)


def _full_step_comm(comm: CommBytes, rep: Repetition) -> tuple[dict[str, int], dict[str, int]]:
    """The step's collectives at the full micro-batch count: what each stage's middle
    micro-batch called (its chunks' collectives, its sends and receives) once more for each
    micro-batch of the full count the stage did not run; every micro-batch but a stage's first
    and last calls the same."""
    nbytes, calls = defaultdict(int, comm.bytes), defaultdict(int, comm.calls)
    middle = {}
    for stage, ids in comm.seen.items():
        ids = sorted(ids)
        assert len(ids) >= 3, (stage, ids)  # a first, a last and one between
        middle[stage] = (ids[len(ids) // 2], len(ids) * rep.microbatches // rep.fewer - len(ids))
    # a chunk's own collectives, and the sends and receives posted for a micro-batch (torch
    # posts one micro-batch's send with another's receive)
    for _, owner, key, size in [e for e in comm.log if e[2] not in ("send", "recv")] + comm.posts:
        if owner is not None and owner[1] == middle[owner[0]][0]:
            nbytes[key] += middle[owner[0]][1] * size
            calls[key] += middle[owner[0]][1]
    return dict(nbytes), dict(calls)


def stage_activation(trainer) -> torch.Tensor:
    """An empty tensor like the activation between two pipeline stages of the trainer's
    decoder: ``[micro-batch, sequence / cp (/ tp under SP), dim]``, in the compute dtype (FSDP's
    param dtype, else float32), requiring grad."""
    t, dims, recipe = trainer.cfg.training, trainer.dims, trainer.layout.recipe
    mb = t.local_batch_size // trainer.layout.pipeline.microbatches
    seq = t.seq_len // dims.cp // (dims.tp if recipe.sequence_parallel_on(dims) else 1)
    dtype = getattr(torch, recipe.param_dtype_on("cuda")) if recipe.fsdp(dims) else torch.float32
    return torch.empty(mb, seq, trainer.model_args.dim, dtype=dtype, device=trainer.device,
                       requires_grad=True)


def _flash_shaped_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                            **kwargs) -> torch.Tensor:
    """:func:`~titanext.models.llama.sdpa_attention` with ``v`` zero-padded to the query's head
    dim and the output cut back (the same values)."""

    dv, pad = v.shape[-1], q.shape[-1] - v.shape[-1]
    if pad <= 0:
        return sdpa_attention(q, k, v, **kwargs)
    return sdpa_attention(q, k, torch.nn.functional.pad(v, (0, pad)), **kwargs)[..., :dv]


def use_fused_attention(model_parts) -> int:
    """Make attention whose value head dim differs from the query's (MLA: 128 vs 192) take a
    fused kernel, as on the target GPUs, and return how many modules changed.

    On CUDA, SDPA runs such shapes with its memory-efficient (or cuDNN) kernel, which keeps
    q, k, v, the output and the log-sum-exp; on the CPU device SDPA's fused (flash) kernel
    needs equal head dims and falls back to the math path, which keeps float32 copies and
    ``seq x seq`` scores per head (16 GiB more at the DeepSeek-V3 671B's pp rank 8). The dry
    run pads ``v`` with zeros so the CPU's flash kernel runs: the saved tensors are the fused
    kernels' (``v`` and the output a little wider)."""

    changed = 0
    for part in model_parts:
        for mod in part.modules():
            fn = getattr(mod, "attn_fn", None)
            inner = inspect.unwrap(fn) if fn is not None else None  # core_attn's region wraps it
            if inner is sdpa_attention and hasattr(mod, "v_head_dim"):
                mod.attn_fn = (_flash_shaped_attention if inner is fn
                               else recompute_region(_flash_shaped_attention))
                changed += 1
    return changed


def _create_optimizer_state(trainer) -> None:
    """An optimizer step on zero gradients, so that the measured step is a steady-state one:
    its peak holds the optimizer state next to the gradients and activations (a first step
    creates the state only at its end)."""
    for part in trainer.model_parts:
        for p in part.parameters():
            if p.requires_grad:
                p.grad = torch.zeros_like(p)
    trainer.optimizer.step()
    trainer.optimizer.zero_grad(set_to_none=True)


def _measure_step(trainer, batches, mode, comm: CommBytes | None = None
                  ) -> tuple[dict[str, int], int, CommBytes, int]:
    """One train step of ``trainer`` under MemTracker and the byte counter ``comm`` (a new one
    by default; inside ``mode``, a fake-tensor mode, or a null context on real tensors):
    (memory at the peak, peak, comm, the optimizer step's own peak)."""
    with mode:  # the optimizer state exists in every step but the first: create it
        _create_optimizer_state(trainer)
    tracker = mem_tracker()
    tracker.track_external(*trainer.model_parts, trainer.optimizer)
    # torch's first-step shape inference of a pipeline, untracked by module
    schedule = trainer.pipeline.schedule if trainer.pipeline is not None else None
    # the optimizer step's own peak (with Muon: the owners' gathered matrices and exchange
    # buffers), beside the step's
    phase: list[int] = []
    hooks = (trainer.optimizer.register_step_pre_hook(lambda *_: tracker.begin_phase()),
             trainer.optimizer.register_step_post_hook(
                 lambda *_: phase.append(tracker.end_phase())))
    with (mode, around_stage_init(schedule, tracker.module_hooks_paused), tracker,
          comm or CommBytes() as comm):
        trainer.train_step(batches)
    for hook in hooks:
        hook.remove()
    snap = next(iter(tracker.get_tracker_snapshot("peak").values()), {})
    memory = {str(getattr(k, "value", k)): int(v) for k, v in snap.items()}
    peak = memory.pop("Total", sum(memory.values()))
    return memory, peak, comm, max(phase, default=0)


def measure(cfg: JobConfig) -> DryRunResult:
    """Build the trainer on the fake backend and measure one training step."""

    world_size, rank = fake_world_size(cfg), cfg.comm.fake_rank
    start = time.time()
    cfg, notes = dry_run_config(cfg)
    stepped, rep, why = fewer_microbatches(cfg, world_size, rank)
    notes += [why] if why else []
    if not dist.is_initialized():
        init_fake_process_group(rank, world_size)
    mode = fake_tensor_mode()
    with mode:
        trainer = Trainer(stepped)
    if trainer.dims.ep_enabled:
        notes.append("EP dispatch assumes perfectly balanced routing (fake tensors carry no "
                     "token counts): expert activations and all-to-all bytes are estimated")
    if use_fused_attention(trainer.model_parts):
        notes.append("attention with a value head dim other than the query's runs SDPA with v "
                     "zero-padded (a fused kernel, as on CUDA; CPU SDPA would take its math path)")
    if trainer.pipeline is not None:
        with mode:
            loopback_stage_metadata(trainer.pipeline.schedule, stage_activation(trainer))
    # real tokens; they turn fake inside the step
    batches = trainer.next_microbatches() if rep is None else _full_batches(trainer, rep)
    rounds = len(batches)
    if rounds > MEASURED_ROUNDS:  # later rounds repeat the second one exactly
        batches = batches[:MEASURED_ROUNDS]
        notes.append(f"gradient accumulation: {MEASURED_ROUNDS} of {rounds} rounds run (the "
                     "peak is the second round's); step comm is scaled by "
                     f"{rounds}/{MEASURED_ROUNDS}")

    comm = CommBytes()
    fewer = contextlib.nullcontext() if rep is None else _stepping_fewer(
        trainer.pipeline.schedule, trainer.pipeline.stages,
        stepped.training.local_batch_size, cfg.training.local_batch_size, comm)
    with count_comm() as ep_comm, fewer:
        memory, peak, comm, step_peak = _measure_step(trainer, batches, mode, comm)
    if rep is None:
        comm_bytes, comm_calls = comm.bytes, comm.calls
    else:
        comm_bytes, comm_calls = _full_step_comm(comm, rep)
    scale = rounds / len(batches)
    if ep_comm.weight_all_to_alls:
        copied = ep_comm.weight_bytes_sent * scale / GB
        notes.append(f"EP expert copies (moe.replicate_hot_experts = "
                     f"{cfg.moe.replicate_hot_experts}): {copied:.3e} GB of the alltoall bytes "
                     f"in {ep_comm.weight_all_to_alls} calls, "
                     "every rank sending and hosting that many copies per layer and step "
                     "(the bound)")
    result = DryRunResult(rank, world_size, memory, peak,
                          planner_peak_bytes(cfg, world_size, rank),
                          {k: round(v * scale) for k, v in comm_bytes.items()},
                          {k: round(v * scale) for k, v in comm_calls.items()},
                          time.time() - start)
    result.notes = notes
    result.optimizer_peak = step_peak
    if rep is not None:  # what stays from each micro-batch past the pipeline's step can grow it
        result.optimizer_at = f" (at {rep.fewer} of {rep.microbatches} micro-batches)"
    result.planner_optimizer = planner_peak_bytes(cfg, world_size, rank, moment="optimizer step")
    return result


def measure_real(cfg: JobConfig, steps: int = 2) -> DryRunResult:
    """The same measurement on a real run: call on every rank of an initialised process group
    (gloo on CPU). Builds the trainer with real tensors from :func:`dry_run_config`'s config
    (the dry run's dtype) and measures ``steps`` training steps with the same tracker (with
    dense layers byte-identical; with experts they differ by the routing), keeping the one with
    the lowest peak; this is what a dry run's figures are checked against
    (tests/e2e/test_dry_run.py).

    Why the lowest of several: gloo runs a collective on a worker thread that lets go of the
    collective's tensors only after ``wait()`` has returned on the calling thread (about one
    call in ten on a 2-core machine). When that tensor was its last holder, the buffer stays
    alive for the next few ops and a step's peak can count it (+1.2 MB on the cp debug run,
    one rank in ~80). The delay only ever adds: the lowest of two steps is the program's own
    peak."""

    start = time.time()
    cfg, notes = dry_run_config(cfg)
    trainer = Trainer(cfg)
    memory, peak, comm, step_peak = min((_measure_step(trainer, trainer.next_microbatches(),
                                            contextlib.nullcontext()) for _ in range(steps)),
                             key=lambda step: step[1])
    world_size, rank = dist.get_world_size(), dist.get_rank()
    result = DryRunResult(rank, world_size, memory, peak,
                          planner_peak_bytes(cfg, world_size, rank), dict(comm.bytes),
                          dict(comm.calls), time.time() - start)
    result.notes = notes
    result.optimizer_peak = step_peak
    result.planner_optimizer = planner_peak_bytes(cfg, world_size, rank, moment="optimizer step")
    return result


def dry_run(cfg: JobConfig) -> int:
    """``python -m titanext.train`` in fake_backend mode: measure, print the table, return 0."""

    result = measure(cfg)
    rows = [{"memory": k, "GiB": v / GiB} for k, v in result.memory.items() if v]
    rows.append({"memory": "peak of the step", "GiB": result.peak / GiB})
    rows.append({"memory": "planner", "GiB": result.planner / GiB})
    rows.append({"memory": "peak in the optimizer step" + result.optimizer_at,
                 "GiB": result.optimizer_peak / GiB})
    rows.append({"memory": "planner (optimizer step)", "GiB": result.planner_optimizer / GiB})
    print(format_table(rows))
    comm_rows = [{"collective": k, "calls": result.calls[k], "GB": v / GB}
                 for k, v in sorted(result.comm.items())]
    print(format_table(comm_rows or [{"collective": "none"}]))
    for note in result.notes:
        print(f"titanext: dry run: note: {note}")
    ratio = result.peak / result.planner if result.planner else math.nan
    print(f"titanext: dry run: peak of the step = {result.peak} bytes")
    print(f"titanext: dry run: peak in the optimizer step = {result.optimizer_peak} bytes")
    print(f"titanext: dry run built and stepped in {result.seconds:.1f}s; measured / planner "
          f"peak = {ratio:.2f}")
    print(result.summary(), flush=True)
    return 0
