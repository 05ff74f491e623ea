"""Every private torch name the dry run (``[comm] mode = "fake_backend"``) uses, in one place.

Private in torch 2.11 and 2.13 alike (checked against both): ``FakeStore`` (the store of
torch's ``"fake"`` process-group backend; ``HashStore`` where it is missing),
``FakeTensorMode`` / ``FakeTensor`` / ``unset_fake_temporarily`` (fake tensors), ``MemTracker``
and its private hooks and state (per-category memory of a step; a clear error names any that
is missing), ``mod_tracker.register_multi_grad_hook`` (the module tracker's backward hooks,
run in mode "any"), ``ShardingPropagator._propagate_tensor_meta_non_cached`` (DTensor's shape
propagation, kept out of the memory count), ``TorchDispatchMode`` and ``tree_leaves`` (the
collective byte counter), ``_compute_local_shape_and_global_offset`` (another rank's shard of a
DTensor: the Muon owner plan of a dry run, where no peer answers).
Nothing else in titanext imports them; a torch that moves one breaks only this module.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import logging
import math

import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode, unset_fake_temporarily
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

__all__ = ["TorchDispatchMode", "balanced_counts", "fake_tensor_mode", "host_float",
           "init_fake_process_group", "is_fake", "mem_tracker", "real_tensors", "shard_of_rank",
           "to_empty", "tree_leaves"]


def init_fake_process_group(rank: int, world_size: int) -> None:
    """Make this process rank ``rank`` of ``world_size`` over torch's fake backend: every
    collective returns at once without moving data."""
    try:  # an empty store class; torch's fake backend accepts any store (HashStore too)
        # private torch module: loaded only for a dry run
        from torch.testing._internal.distributed.fake_pg import FakeStore as Store
    except ImportError:
        Store = dist.HashStore
    dist.init_process_group("fake", store=Store(), rank=rank, world_size=world_size)


def fake_tensor_mode() -> FakeTensorMode:
    """The mode a dry run builds and steps in (real inputs, such as data batches, turn fake)."""
    # FakeTensorMode asks its logger for the effective level on every op, which walks the
    # logger hierarchy unless the logger has a level of its own (7% of a 70B dry run)
    log = logging.getLogger(FakeTensorMode.__module__)
    if log.level == logging.NOTSET:
        log.setLevel(log.getEffectiveLevel())
    return FakeTensorMode(allow_non_fake_inputs=True)


def is_fake(t: object) -> bool:
    return isinstance(t, FakeTensor)


def balanced_counts(total: int, n: int) -> list[int]:
    """``total`` split over ``n`` as evenly as whole numbers go (the first ones one more): a dry
    run's stand-in for routing counts, which fake tensors do not carry.

    >>> balanced_counts(10, 4)
    [3, 3, 2, 2]
    """
    return [total // n + (i < total % n) for i in range(n)]


def real_tensors() -> contextlib.AbstractContextManager:
    """Host-side setup (mesh ranks) on real tensors while a fake mode is active; a no-op
    otherwise."""
    return unset_fake_temporarily()


def to_empty(module: torch.nn.Module, device: torch.device | str) -> None:
    """``module.to_empty(device=device)``; under a dry run's fake mode a model without DTensor
    parameters gets new fake parameters and buffers instead (torch cannot swap a parameter the
    fake-tensor converter holds a weak reference to; FSDP's and TP's DTensors swap fine)."""

    if not fake_mode_active() or any(isinstance(p, DTensor) for p in module.parameters()):
        module.to_empty(device=device)
        return
    new: dict[int, torch.Tensor] = {}  # shared (tied) tensors stay shared
    for m in module.modules():
        for store, make in ((m._parameters, _new_param), (m._buffers, _new_buffer)):
            for name, t in store.items():
                if t is not None:
                    store[name] = new.setdefault(id(t), make(t, device))


def _new_param(p: torch.Tensor, device) -> torch.nn.Parameter:
    return torch.nn.Parameter(torch.empty_like(p, device=device), requires_grad=p.requires_grad)


def _new_buffer(b: torch.Tensor, device) -> torch.Tensor:
    return torch.empty_like(b, device=device)


def fake_mode_active() -> bool:
    """Whether this thread runs under a dry run's fake mode."""
    return isinstance(torch._guards.active_fake_mode(), FakeTensorMode)


def shard_of_rank(t: DTensor, rank: int) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
    """(global offsets, sizes) of the shard of DTensor ``t`` that global ``rank`` holds, or None
    where ``rank`` is not in ``t``'s mesh: what that rank's ``__create_chunk_list__`` says.

    A dry run plays one rank, so it works out the others' shards instead of asking them (its
    mesh tensor is fake too: the ranks come from the mesh's groups)."""
    coordinate = _mesh_coordinates(t.device_mesh).get(rank)
    if coordinate is None:
        return None
    with unset_fake_temporarily():  # it indexes real offset tensors
        sizes, offsets = _compute_local_shape_and_global_offset(
            tuple(t.shape), tuple(t.device_mesh.shape), list(coordinate), t.placements)
    return tuple(offsets), tuple(sizes)


@functools.lru_cache(maxsize=64)
def _mesh_coordinates(mesh) -> dict[int, tuple[int, ...]]:
    """Global rank -> coordinate in ``mesh``, from this rank's group along each mesh dim (a
    mesh of ``init_device_mesh`` and its slices: rank = base + sum(coordinate x stride))."""
    me, mine = dist.get_rank(), mesh.get_coordinate()
    strides = []
    for dim in range(mesh.ndim):
        ranks = dist.get_process_group_ranks(mesh.get_group(dim))
        stride = ranks[1] - ranks[0] if len(ranks) > 1 else 0
        if ranks != [ranks[0] + k * stride for k in range(len(ranks))]:
            raise ValueError(f"mesh dim {dim} has ranks {ranks}, not evenly spaced: the dry "
                             "run cannot place the other ranks' shards")
        strides.append(stride)
    base = me - sum(c * s for c, s in zip(mine, strides))
    return {base + sum(c * s for c, s in zip(coord, strides)): coord
            for coord in itertools.product(*(range(n) for n in mesh.shape))}


def host_float(t: torch.Tensor | float, fake_value: float = math.nan) -> float:
    """``t.item()`` as a float; a fake tensor (a dry run) has no value and gives ``fake_value``."""
    if isinstance(t, torch.Tensor):
        return fake_value if is_fake(t) else float(t.item())
    return float(t)



def mem_tracker():
    """torch's ``MemTracker``: per-category (parameter, gradient, optimizer state, activation,
    temporary) memory, current and peak, of the tensors it tracks; works on fake tensors.

    Gradient accumulation calls the root module once per micro-batch, which MemTracker takes
    for a second iteration; here a root's second forward drops only its per-module stats (the
    step's totals and peak are kept)."""
    # private torch module: loaded only for a dry run
    from torch.distributed._tools import mem_tracker as tracker_module

    MemTracker = tracker_module.MemTracker

    class StepTracker(MemTracker):
        _propagating = 0  # inside DTensor's sharding propagation (global-shape fake tensors)

        def __enter__(self):
            _patch_sharding_propagation()
            _TRACKERS.append(self)
            self._hooks = contextlib.ExitStack()
            self._hooks.enter_context(_hooks_without_graph_cycles())
            self._hooks.enter_context(_flat_outputs_mapped_directly(tracker_module))
            return super().__enter__()

        def __exit__(self, *args):
            _TRACKERS.remove(self)
            try:
                return super().__exit__(*args)
            finally:
                self._hooks.close()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if self._propagating:  # metadata only: no memory on any device
                return func(*args, **(kwargs or {}))
            return super().__torch_dispatch__(func, types, args, kwargs)

        def _pre_fw_hook(self, module, inputs):  # private hook of MemTracker
            tracker = self._mod_tracker
            if (module in self.memory_tracking and not tracker.is_bw
                    and set(tracker.parents) - {tracker.get_known_fqn(module)} == {"Global"}):
                del self.memory_tracking[module]
            return super()._pre_fw_hook(module, inputs)

        def _update_peak_stats(self, peak_state):  # the step's peak only: O(1) per op, not
            for dev, snap in self._curr_mem_snap.items():  # O(tracked modules)
                if self._peak_mem.get(dev, 0) < snap["Total"]:
                    self._peak_mem[dev] = snap["Total"]
                    self._peak_mem_snap[dev] = dict(snap)

        def begin_phase(self) -> None:
            """Start a phase's own peak (the optimizer step's): the step's peak so far is
            kept aside and restored, if higher, by :meth:`end_phase`."""
            self._outer = (dict(self._peak_mem), {d: dict(v) for d, v in
                                                  self._peak_mem_snap.items()})
            for dev, snap in self._curr_mem_snap.items():
                self._peak_mem[dev], self._peak_mem_snap[dev] = snap["Total"], dict(snap)

        def end_phase(self) -> int:
            """The phase's peak bytes (all devices but meta, whose tensors hold no memory: the
            pipeline's released receive buffers are meta stand-ins, 2 per micro-batch and
            stage); the step's peak goes on."""
            phase = sum(v for dev, v in self._peak_mem.items() if torch.device(dev).type != "meta")
            peaks, snaps = self._outer
            for dev, peak in peaks.items():
                if peak >= self._peak_mem.get(dev, 0):
                    self._peak_mem[dev], self._peak_mem_snap[dev] = peak, snaps[dev]
            return phase

        @contextlib.contextmanager
        def module_hooks_paused(self):
            """No per-module tracking inside (tensors are still counted)."""
            self._mod_tracker.__exit__(None, None, None)
            try:
                yield
            finally:
                self._mod_tracker.__enter__()

    tracker = StepTracker()
    missing = [n for n in _MEM_TRACKER_NAMES if not hasattr(tracker, n)]
    if missing:
        raise RuntimeError(f"titanext dry run: this torch's MemTracker lacks {missing}, which the "
                           "dry run's tracker uses (torch 2.11 and 2.13 have them)")
    return tracker


@contextlib.contextmanager
def _hooks_without_graph_cycles():
    """MemTracker's module tracker with its backward hooks in mode "any".

    Its forward pre-hook registers a multi-grad hook on each module's inputs in mode "all",
    whose closure keeps the inputs' grad_fn nodes (a leaf's gradient accumulator) to count the
    calls; stored on those nodes, it forms a cycle that kept every micro-batch's graph, and the
    stage's received input at its root, alive and counted until the step ended, where a real
    run frees them after the micro-batch's backward (DualPipe's peak grew by one boundary
    tensor per micro-batch; issue 45). In mode "any" the hook keeps no node and fires at the
    first input gradient: only the per-module attribution of backward memory can move, not the
    step's totals or peak."""
    # private torch module: loaded only for a dry run
    from torch.distributed._tools import mod_tracker

    original = getattr(mod_tracker, "register_multi_grad_hook", None)
    if original is None:  # a torch whose tracker registers them otherwise: left as it is
        yield
        return

    def register(tensors, fn, *args, **kwargs):
        return original(tensors, fn, mode="any")

    mod_tracker.register_multi_grad_hook = register
    try:
        yield
    finally:
        mod_tracker.register_multi_grad_hook = original


@contextlib.contextmanager
def _flat_outputs_mapped_directly(module):
    """MemTracker's ``tree_map_only`` over each op's outputs, the same map done directly for a
    tensor or a plain tuple / list of tensors, numbers and None (nearly every op's outputs, all
    pytree leaves): pytree's flatten and rebuild took 13% of a dry run's step (cProfile, a
    debug DeepSeek pipeline). Any other tree goes to pytree as before. ``module``: torch's
    mem_tracker module."""
    original = getattr(module, "tree_map_only", None)
    if original is None:  # a torch whose tracker maps otherwise: left as it is
        yield
        return

    def tree_map_only(cls, fn, tree):
        if cls is torch.Tensor:
            if isinstance(tree, torch.Tensor):
                return fn(tree)
            if type(tree) in (tuple, list) and all(
                    x is None or isinstance(x, (torch.Tensor, int, float, bool)) for x in tree):
                return type(tree)(fn(x) if isinstance(x, torch.Tensor) else x for x in tree)
        return original(cls, fn, tree)

    module.tree_map_only = tree_map_only
    try:
        yield
    finally:
        module.tree_map_only = original


# MemTracker's private names the step tracker reads or overrides
_MEM_TRACKER_NAMES = ("_pre_fw_hook", "_update_peak_stats", "_curr_mem_snap", "_peak_mem",
                      "_peak_mem_snap", "_mod_tracker", "memory_tracking")


_TRACKERS: list = []  # the StepTrackers inside their context


def _patch_sharding_propagation() -> None:
    """Make the active :func:`mem_tracker` ignore DTensor's sharding propagation.

    DTensor derives an op's output shape by running the op on fake tensors of the *global*
    shape, in the active fake mode if there is one. MemTracker tells those tensors from the
    local computation by the fake mode (torch 2.13): a real run's propagation makes a fresh
    mode and is skipped, but in a dry run the active mode is the dry run's own, so every
    uncached propagation was counted as memory: the 405B's first-stage peak held a float32
    and a bfloat16 copy of the whole ``[vocabulary, dim]`` embedding gradient (11.7 GiB) that
    no run allocates. Patched once per process, a no-op outside a tracker.
    """
    # private torch module: loaded only for a dry run
    from torch.distributed.tensor._sharding_prop import ShardingPropagator

    name = "_propagate_tensor_meta_non_cached"
    orig = getattr(ShardingPropagator, name, None)
    if orig is None:
        raise RuntimeError(f"titanext dry run: this torch has no ShardingPropagator.{name}; "
                           "the dry run's memory tracker needs it (torch 2.11 and 2.13 have it)")
    if getattr(orig, "_titanext", False):
        return

    def propagate(self, op_schema):
        for tracker in _TRACKERS:
            tracker._propagating += 1
        try:
            return orig(self, op_schema)
        finally:
            for tracker in _TRACKERS:
                tracker._propagating -= 1

    propagate._titanext = True
    setattr(ShardingPropagator, name, propagate)

