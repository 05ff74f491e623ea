"""Muon on every layout, with AdamW / Adam groups alongside: :class:`MuonWithAdamW`.

A Muon group's update is ``torch.optim.Muon``'s, computed so that each matrix is
orthogonalized once:

1. every rank updates the momentum of the pieces it holds (elementwise, so on shards):
   ``buf.lerp_(grad, 1 - momentum)``; ``update = grad.lerp(buf, momentum)`` with nesterov;
2. each matrix's update pieces go to its owner (:mod:`titanext.components.muon_plan`) in one
   ``all_to_all_single``, in the dtype the Newton-Schulz iteration starts by casting to
   (bfloat16, as torch.optim.Muon; ``ns_dtype``), so the owner sees exactly what one process
   would;
3. the owner runs :func:`newton_schulz` on the whole matrix and sends each holder its piece
   back in a second ``all_to_all_single``;
4. every holder applies ``p.mul_(1 - lr * wd)`` and ``p.add_(O, alpha=-adjusted_lr)``.

A fused projection named in ``splits`` (FQN -> ``(axis, sizes)``, :data:`~titanext.components.
muon_plan.Split`) is gathered whole on its owner as any matrix, then each logical matrix (``q``,
``k``, ``v``; ``gate``, ``up``) is orthogonalized on its own and takes its own shape's learning
rate: what torch.optim.Muon does on the separate matrices.

The momentum buffer is ``zeros_like(grad)``: a DTensor with the parameter's mesh and
placements, so DCP saves and reshards it as it does AdamW's moments. A 3-D expert weight
``[experts, out, in]`` is one matrix per expert. AdamW / Adam groups run torch's own classes on
the same ``param_groups`` and ``state``.

>>> import torch
>>> torch.manual_seed(0) and None
>>> w, b = torch.nn.Parameter(torch.randn(8, 4)), torch.nn.Parameter(torch.zeros(8))
>>> opt = MuonWithAdamW([{"params": [w], "optimizer": "Muon", "lr": 0.02},
...                      {"params": [b], "optimizer": "AdamW", "lr": 1e-3, "eps": 1e-8}])
>>> ref = torch.nn.Parameter(w.detach().clone())
>>> w.grad, b.grad, ref.grad = torch.ones(8, 4), torch.ones(8), torch.ones(8, 4)
>>> opt.step(); torch.optim.Muon([ref], lr=0.02).step()
>>> torch.equal(w, ref)
True
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from titanext._fake_backend import fake_mode_active, shard_of_rank
from titanext.components.muon_plan import OwnerPlan, Piece, Split, blocks, plan_owners

__all__ = ["MuonWithAdamW", "adjusted_lr", "newton_schulz"]

NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)  # torch.optim.Muon's quintic
_ADAM = {"AdamW": torch.optim.AdamW, "Adam": torch.optim.Adam}


def newton_schulz(update: torch.Tensor, coefficients=NS_COEFFICIENTS, steps: int = 5,
                  eps: float = 1e-7, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """The orthogonalized ``update`` (2-D), with torch.optim.Muon's operations in its order
    (so that in bfloat16, its dtype, the result is the same bits). float32 is for comparing
    layouts: bfloat16 rounding turns a 1e-7 difference in a gradient sum into a 1e-3 one."""
    a, b, c = coefficients
    x = update.to(dtype)
    tall = update.size(0) > update.size(1)
    if tall:
        x = x.T
    x.div_(x.norm().clamp(min=eps))
    for _ in range(steps):
        gram = x @ x.T
        x = torch.addmm(x, torch.addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return x.T if tall else x


def adjusted_lr(lr: float, fn: str | None, rows: int, cols: int) -> float:
    """torch.optim.Muon's per-shape learning rate: "original" sqrt(max(1, rows / cols)),
    "match_rms_adamw" 0.2 sqrt(max(rows, cols))."""
    if fn is None or fn == "original":
        return lr * math.sqrt(max(1, rows / cols))
    if fn == "match_rms_adamw":
        return lr * 0.2 * math.sqrt(max(rows, cols))
    raise ValueError(f"adjust_lr_fn = {fn!r}; allowed: original, match_rms_adamw")


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def _piece(fqn: str, p: torch.Tensor) -> Piece:
    """This rank's piece of ``p`` in ``[experts, rows, cols]`` coordinates."""
    if p.ndim not in (2, 3):
        raise ValueError(f"Muon updates 2-D matrices and 3-D expert weights; {fqn} has shape "
                         f"{tuple(p.shape)}: put it in an AdamW group")
    if isinstance(p, DTensor) and fake_mode_active():  # the chunk list reads fake values
        offsets, sizes = shard_of_rank(p, dist.get_rank())
    elif isinstance(p, DTensor):
        (chunk,) = p.__create_chunk_list__()  # DCP's own view of where this shard sits
        offsets, sizes = tuple(chunk.offsets), tuple(chunk.sizes)
    else:
        offsets, sizes = (0,) * p.ndim, tuple(p.shape)
    pad = (1,) if p.ndim == 2 else ()
    return Piece(fqn, pad + tuple(p.shape), (0,) * len(pad) + offsets, pad + sizes)


class MuonWithAdamW(torch.optim.Optimizer):
    """Muon groups (``"optimizer": "Muon"``, the default) and AdamW / Adam groups in one
    optimizer, on plain tensors or DTensors of any layout.

    ``param_names`` (``id(param) -> FQN``) names the parameters alike on every rank; it is
    needed when more than one process runs. ``process_group`` carries the owner exchange (all
    ranks by default: every rank calls :meth:`step`, those holding no Muon matrix included).
    ``adam_betas`` and ``adam_eps`` are the AdamW / Adam defaults. ``splits`` (FQN ->
    ``(axis, sizes)``) orthogonalizes those fused matrices per logical matrix (the module
    docstring).
    """

    def __init__(self, params: Iterable[Any], *, lr: float = 1e-3, weight_decay: float = 0.1,
                 momentum: float = 0.95, nesterov: bool = True,
                 ns_coefficients: tuple[float, float, float] = NS_COEFFICIENTS,
                 eps: float = 1e-7, ns_steps: int = 5, adjust_lr_fn: str | None = None,
                 adam_betas: tuple[float, float] = (0.9, 0.95), adam_eps: float = 1e-8,
                 ns_dtype: torch.dtype = torch.bfloat16,
                 foreach: bool | None = None, param_names: Mapping[int, str] | None = None,
                 process_group: dist.ProcessGroup | None = None,
                 splits: Mapping[str, Split] | None = None) -> None:
        # torch's own classes step the AdamW / Adam groups; built on a probe for their defaults,
        # then pointed at this optimizer's groups and state on every step
        self._inner = {kind: cls([torch.nn.Parameter(torch.zeros(1))], lr=lr, betas=adam_betas,
                                 eps=adam_eps, weight_decay=weight_decay, foreach=foreach)
                       for kind, cls in _ADAM.items()}
        self._adam_defaults = {kind: inner.defaults for kind, inner in self._inner.items()}
        self._names = dict(param_names or {})
        self._group = process_group
        self._splits = {fqn: (axis, tuple(sizes)) for fqn, (axis, sizes) in (splits or {}).items()}
        self._ns_dtype = ns_dtype  # also the dtype the pieces travel in: NS starts by casting
        self._plan: tuple[tuple, OwnerPlan] | None = None
        defaults = dict(lr=lr, weight_decay=weight_decay, momentum=momentum, nesterov=nesterov,
                        ns_coefficients=tuple(ns_coefficients), eps=eps, ns_steps=ns_steps,
                        adjust_lr_fn=adjust_lr_fn, optimizer="Muon")
        super().__init__(params, defaults)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        kind = param_group.setdefault("optimizer", "Muon")
        if kind in _ADAM:  # its own class's defaults first (eps differs from Muon's)
            for key, value in self._adam_defaults[kind].items():
                param_group.setdefault(key, value)
        elif kind != "Muon":
            raise ValueError(f"param group optimizer = {kind!r}; allowed: Muon, AdamW, Adam")
        super().add_param_group(param_group)

    @torch.no_grad()
    def step(self, closure=None):  # noqa: D102 (torch.optim.Optimizer.step)
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for kind in _ADAM:
            groups = [g for g in self.param_groups if g["optimizer"] == kind]
            if groups:  # torch's class over these very groups and this very state
                inner = self._inner[kind]
                inner.param_groups, inner.state = groups, self.state
                inner.step()
        self._muon_step()
        return loss

    # -- Muon ---------------------------------------------------------------------------------

    def _name(self, p: torch.Tensor, index: int) -> str:
        name = self._names.get(id(p))
        if name is None:
            if self._world() > 1:
                raise ValueError("MuonWithAdamW on several ranks needs param_names "
                                 "(id(param) -> FQN) to match each matrix's pieces")
            name = f"param{index}"
        return name

    def _device(self) -> torch.device:
        for group in self.param_groups:
            for p in group["params"]:
                return _local(p).device
        return torch.device("cpu")

    def _world(self) -> int:
        return dist.get_world_size(self._group) if dist.is_initialized() else 1

    def _muon_items(self) -> list[tuple[str, torch.Tensor, torch.Tensor, dict[str, Any]]]:
        """(fqn, param, local update, group) of every Muon parameter with a gradient."""
        items, index = [], 0
        for group in self.param_groups:
            if group["optimizer"] != "Muon":
                continue
            for p in group["params"]:
                index += 1
                if p.grad is None:
                    continue
                grad = p.grad
                if isinstance(p, DTensor) and grad.placements != p.placements:
                    grad = grad.redistribute(p.device_mesh, p.placements)
                state = self.state[p]
                if "momentum_buffer" not in state:
                    state["momentum_buffer"] = torch.zeros_like(grad)
                buf, g = _local(state["momentum_buffer"]), _local(grad)
                buf.lerp_(g, 1 - group["momentum"])
                update = g.lerp(buf, group["momentum"]) if group["nesterov"] else buf
                items.append((self._name(p, index), p, update, group))
        return items

    def _owner_plan(self, pieces: list[Piece], ns_steps: int) -> OwnerPlan:
        key = tuple(pieces)
        if self._plan is not None and self._plan[0] == key:
            return self._plan[1]
        if self._plan is not None and self._world() > 1:
            raise RuntimeError(
                "Muon: the parameters with a gradient changed between steps "
                f"({len(self._plan[0])} pieces planned, {len(pieces)} now); every Muon "
                "parameter must get a gradient (even zeros) on every step")
        everyone: list[Any] = [pieces]
        if self._world() > 1 and fake_mode_active():  # a dry run: no peer answers
            everyone = self._peers_pieces(pieces)
        elif self._world() > 1:
            everyone = [None] * self._world()
            dist.all_gather_object(everyone, pieces, group=self._group)
        self._plan = (key, plan_owners(everyone, ns_steps, self._splits))
        return self._plan[1]

    def _peers_pieces(self, pieces: list[Piece]) -> list[list[Piece]]:
        """Every rank's pieces of this rank's Muon parameters, worked out from each DTensor's
        mesh and placements (a dry run plays one rank; ranks of other pipeline stages hold
        none of these matrices). A plain tensor counts as held by this rank alone."""
        world, me = self._world(), dist.get_rank(self._group)
        params = {self._name(p, 0): p for g in self.param_groups if g["optimizer"] == "Muon"
                  for p in g["params"]}
        everyone: list[list[Piece]] = [[] for _ in range(world)]
        for piece in pieces:
            p = params[piece.fqn]
            if not isinstance(p, DTensor):
                everyone[me].append(piece)
                continue
            pad = (1,) if p.ndim == 2 else ()
            for rank in range(world):
                shard = shard_of_rank(p, rank if self._group is None
                                      else dist.get_global_rank(self._group, rank))
                if shard is not None:
                    everyone[rank].append(Piece(piece.fqn, piece.shape,
                                                (0,) * len(pad) + shard[0], pad + shard[1]))
        return everyone

    def _muon_step(self) -> None:
        items = self._muon_items()
        if not items and self._world() == 1:
            return
        steps = {g["ns_steps"] for *_, g in items} or {5}
        pieces = [_piece(fqn, p) for fqn, p, _, _ in items]
        plan = self._owner_plan(pieces, max(steps))
        rank = dist.get_rank(self._group) if self._world() > 1 else 0
        mine = {fqn: (piece, update) for (fqn, _, update, _), piece in zip(items, pieces)}
        groups = {fqn: g for fqn, _, _, g in items}
        # gather: the pieces this rank sources, per owner, in plan order
        send = [[] for _ in range(plan.world)]
        for m in plan.matrices:
            for c in m.chunks:
                if c.source == rank:
                    send[m.owner].append(self._slice(mine[m.fqn], m.expert, c, self._ns_dtype))
        # the updates and their send buffer are done with: free them before the owners work
        items = [(fqn, p, None, g) for fqn, p, _, g in items]
        del mine
        received = self._exchange(send, [plan.gather_numel(src, rank)
                                         for src in range(plan.world)])
        del send
        # orthogonalize the matrices this rank owns; send each holder its piece back
        back = [[] for _ in range(plan.world)]
        for m in plan.matrices:
            if m.owner != rank:
                continue
            full = torch.empty(m.shape, dtype=self._ns_dtype, device=received[0].device)
            for c in m.chunks:
                src = received[c.source]
                full[c.rows[0]:sum(c.rows), c.cols[0]:sum(c.cols)] = src[:c.numel].view(
                    c.rows[1], c.cols[1])
                received[c.source] = src[c.numel:]
            ortho = self._orthogonalize(full, m.split, groups[m.fqn])  # the owner holds it
            for c in m.chunks:
                piece = ortho[c.rows[0]:sum(c.rows), c.cols[0]:sum(c.cols)].reshape(-1)
                for h in c.holders:
                    back[h].append(piece)
        del received
        returned = self._exchange(back, [plan.scatter_numel(src, rank)
                                         for src in range(plan.world)])
        self._apply(plan, rank, items, pieces, returned)

    def _orthogonalize(self, full: torch.Tensor, split: Split | None, g: dict[str, Any]
                       ) -> torch.Tensor:
        """Newton-Schulz on the whole matrix, or on each logical matrix of a split one."""
        ns = (g["ns_coefficients"], g["ns_steps"], g["eps"], self._ns_dtype)
        if split is None:
            return newton_schulz(full, *ns)
        ortho = torch.empty_like(full)
        for r0, rows, c0, cols in blocks(tuple(full.shape), split):
            block = full[r0:r0 + rows, c0:c0 + cols].contiguous()  # as one process holds it
            ortho[r0:r0 + rows, c0:c0 + cols] = newton_schulz(block, *ns)
        return ortho

    @staticmethod
    def _slice(held: tuple[Piece, torch.Tensor], expert: int, c, dtype: torch.dtype
               ) -> torch.Tensor:
        piece, update = held
        local = update if update.ndim == 3 else update.unsqueeze(0)
        rows = slice(c.rows[0] - piece.offsets[1], c.rows[0] - piece.offsets[1] + c.rows[1])
        cols = slice(c.cols[0] - piece.offsets[2], c.cols[0] - piece.offsets[2] + c.cols[1])
        return local[expert - piece.offsets[0], rows, cols].to(dtype).reshape(-1)

    def _exchange(self, send: list[list[torch.Tensor]], recv_numel: list[int]
                  ) -> list[torch.Tensor]:
        """One all_to_all_single: ``send[dst]`` pieces go to rank dst; returns what each
        source rank sent here (flat, in the Newton-Schulz dtype)."""
        device = self._device()
        sizes = [sum(t.numel() for t in s) for s in send]
        pieces = [t.to(device) for s in send for t in s]  # one copy: the input buffer
        inp = torch.cat(pieces) if pieces else torch.empty(0, dtype=self._ns_dtype,
                                                           device=device)
        del pieces
        if len(send) == 1:
            return [inp]
        out = torch.empty(sum(recv_numel), dtype=self._ns_dtype, device=device)
        dist.all_to_all_single(out, inp, output_split_sizes=recv_numel,
                               input_split_sizes=sizes, group=self._group)
        return list(out.split(recv_numel))

    @staticmethod
    def _apply(plan: OwnerPlan, rank: int, items, pieces: list[Piece],
               returned: list[torch.Tensor]) -> None:
        """Weight decay, then the orthogonalized update at the adjusted learning rate."""
        by_fqn = {fqn: (p, g, piece) for (fqn, p, _, g), piece in zip(items, pieces)}
        for p, g, _ in by_fqn.values():
            _local(p).mul_(1 - g["lr"] * g["weight_decay"])
        for m in plan.matrices:
            for c in m.chunks:
                if rank not in c.holders:
                    continue
                src = returned[m.owner]
                piece, returned[m.owner] = src[:c.numel].view(c.rows[1], c.cols[1]), src[c.numel:]
                p, g, held = by_fqn[m.fqn]
                local = _local(p) if p.ndim == 3 else _local(p).unsqueeze(0)
                local = local[m.expert - held.offsets[0]]
                for b_r0, b_rows, b_c0, b_cols in blocks(m.shape, m.split):
                    # this chunk's overlap with each logical matrix, at that matrix's own lr
                    r0, r1 = max(c.rows[0], b_r0), min(sum(c.rows), b_r0 + b_rows)
                    c0, c1 = max(c.cols[0], b_c0), min(sum(c.cols), b_c0 + b_cols)
                    if r0 >= r1 or c0 >= c1:
                        continue
                    rows = slice(r0 - held.offsets[1], r1 - held.offsets[1])
                    cols = slice(c0 - held.offsets[2], c1 - held.offsets[2])
                    local[rows, cols].add_(
                        piece[r0 - c.rows[0]:r1 - c.rows[0], c0 - c.cols[0]:c1 - c.cols[0]],
                        alpha=-adjusted_lr(g["lr"], g["adjust_lr_fn"], b_rows, b_cols))
