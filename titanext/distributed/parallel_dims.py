"""ParallelDims: one source of truth for parallel degrees, and the DeviceMesh built from them.

The world mesh has named axes ``pp, dp_replicate, dp_shard, cp, tp`` (outer to inner, so TP
stays inside a node). Derived views are flattened from them:

===============  ===================================  =====================================
view             axes                                 used for
===============  ===================================  =====================================
``dp``           dp_replicate x dp_shard              data loading (ranks that see different
                                                      samples)
``dp_shard_cp``  dp_shard x cp                        FSDP sharding / gradient reduction
``dp_cp``        dp_replicate x dp_shard x cp         loss and token-count reduction
``ep``           (dp_shard x cp) slice of size ep     expert parallelism (borrows ranks)
===============  ===================================  =====================================

With ``cp_ulysses = u > 1`` (hybrid or pure Ulysses context parallelism) the cp axis is split
into ``cp_ring x cp_ulysses`` (r = cp / u outer, u inner, so a Ulysses group is adjacent ranks);
``cp`` stays as their flattened view, so cp rank = ring_rank * u + ulysses_rank and the batch
is sharded over ``cp`` exactly as without the split. :attr:`ParallelDims.cp_attention_mesh` is
what :func:`~titanext.plugins.context_parallel.apply_context_parallel` takes.

When ``ep > 1`` the dp_shard axis is split into ``dp_shard_mod_ep x dp_shard_in_ep`` with
``dp_shard_in_ep x cp = ep``, so experts are spread first over the CP ranks and then over part
of the data-parallel shard ranks.

>>> dims = ParallelDims(dp_replicate=1, dp_shard=-1, cp=1, tp=2, pp=1, ep=1, world_size=4)
>>> dims.dp_shard
2
>>> # mesh = dims.build_mesh()            # inside an initialised process group
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from titanext._fake_backend import real_tensors
from titanext.config.degrees import degree_problems, mesh_dims, resolve_dp_shard
from titanext.distributed.process_group import device_type
from titanext.errors import ConfigError

if TYPE_CHECKING:
    from titanext.config.layout import JobLayout

__all__ = ["ParallelDims", "resolve_dp_shard"]


def _flatten(mesh: DeviceMesh, dims: tuple[str, ...], name: str) -> DeviceMesh:
    # DeviceMesh has no public flatten in every torch we support; keep the private call here.
    return mesh[dims]._flatten(mesh_dim_name=name)


@dataclass
class ParallelDims:
    """Parallel degrees; ``dp_shard = -1`` means "whatever is left of the world"."""

    dp_replicate: int
    dp_shard: int
    cp: int
    tp: int
    pp: int
    ep: int
    world_size: int
    cp_ulysses: int = 1
    """Ulysses ranks inside cp (hybrid CP splits cp into cp_ring x cp_ulysses); 1 = ring only."""
    _mesh: DeviceMesh | None = field(default=None, init=False, repr=False)
    _views: dict[str, DeviceMesh] = field(default_factory=dict, init=False, repr=False)

    @classmethod
    def from_layout(cls, layout: JobLayout) -> ParallelDims:
        """The degrees of a resolved :class:`~titanext.config.layout.JobLayout` (the trainer's
        way in: the job's degrees are worked out once, there)."""
        return cls(dp_replicate=layout.dp_replicate, dp_shard=layout.dp_shard, cp=layout.cp,
                   tp=layout.tp, pp=layout.pp, ep=layout.ep, world_size=layout.world_size,
                   cp_ulysses=layout.cp_ulysses)

    def __post_init__(self) -> None:
        self._validate()

    def _validate(self) -> None:
        # The config checks the same rules at load (titanext.config.degrees owns them).
        self.dp_shard, problems = degree_problems(
            dp_replicate=self.dp_replicate, dp_shard=self.dp_shard, cp=self.cp, tp=self.tp,
            pp=self.pp, ep=self.ep, world_size=self.world_size)
        if self.cp_ulysses < 1 or self.cp % self.cp_ulysses:
            problems.append(f"parallelism.context_parallel_ulysses_degree = {self.cp_ulysses} "
                            f"must divide context_parallel_degree = {self.cp}")
        if problems:
            raise ConfigError(problems)

    # -- derived degrees -------------------------------------------------------------------
    @property
    def dp(self) -> int:
        return self.dp_replicate * self.dp_shard

    @property
    def fsdp_enabled(self) -> bool:
        return self.dp_shard * self.cp > 1

    @property
    def dp_enabled(self) -> bool:
        return self.dp > 1

    @property
    def tp_enabled(self) -> bool:
        return self.tp > 1

    @property
    def cp_enabled(self) -> bool:
        return self.cp > 1

    @property
    def pp_enabled(self) -> bool:
        return self.pp > 1

    @property
    def ep_enabled(self) -> bool:
        return self.ep > 1

    @property
    def gradient_reduction_size(self) -> int:
        """Ranks whose gradients are averaged by FSDP/DDP: dp_replicate x dp_shard x cp."""
        return self.dp_replicate * self.dp_shard * self.cp

    # -- mesh -------------------------------------------------------------------------------
    def build_mesh(self, device: str | None = None) -> DeviceMesh:
        """Create the world mesh (all named axes, size-1 ones included) and its views."""
        with real_tensors():  # the mesh's rank tables are host data, also in a dry run
            return self._build_mesh(device or device_type())

    def _build_mesh(self, device: str) -> DeviceMesh:
        split_cp = self.cp_ulysses > 1
        cp_names = ["cp_ring", "cp_ulysses"] if split_cp else ["cp"]
        dims = mesh_dims(pp=self.pp, dp_replicate=self.dp_replicate, dp_shard=self.dp_shard,
                         cp=self.cp, tp=self.tp, ep=self.ep, cp_ulysses=self.cp_ulysses)
        names, sizes = zip(*dims)
        mesh = init_device_mesh(device, tuple(sizes), mesh_dim_names=tuple(names))
        shard = ("dp_shard_mod_ep", "dp_shard_in_ep") if self.ep > 1 else ("dp_shard",)
        cp = tuple(cp_names)
        # Keep the flattened views: slicing them back out of the root mesh is deprecated.
        views = {name: mesh[name] for name in ("pp", "dp_replicate", *cp_names, "tp")}
        if split_cp:
            views["cp"] = _flatten(mesh, cp, "cp")
        if self.ep > 1:
            views["dp_shard"] = _flatten(mesh, shard, "dp_shard")
            views["ep"] = _flatten(mesh, ("dp_shard_in_ep", *cp), "ep")
        else:
            views["dp_shard"] = mesh["dp_shard"]
        views["dp"] = _flatten(mesh, ("dp_replicate", *shard), "dp")
        views["dp_shard_cp"] = _flatten(mesh, (*shard, *cp), "dp_shard_cp")
        views["dp_cp"] = _flatten(mesh, ("dp_replicate", *shard, *cp), "dp_cp")
        self._views = views
        self._mesh = mesh
        return mesh

    def view(self, name: str) -> DeviceMesh:
        """A named 1D view: pp, dp_replicate, dp_shard, cp, tp, dp, dp_shard_cp, dp_cp, ep."""
        self.world_mesh  # noqa: B018  (raises if the mesh is not built)
        if name not in self._views:
            raise KeyError(f"no mesh view {name!r}; available: {', '.join(self._views)}")
        return self._views[name]

    @property
    def world_mesh(self) -> DeviceMesh:
        if self._mesh is None:
            raise RuntimeError("call ParallelDims.build_mesh() first")
        return self._mesh

    @property
    def fsdp_mesh(self) -> DeviceMesh:
        """1D (dp_shard_cp) for FSDP, 2D (dp_replicate, dp_shard_cp) for HSDP."""
        if self.dp_replicate > 1:
            return self.world_mesh["dp_replicate", "dp_shard_cp"]
        return self.view("dp_shard_cp")

    @property
    def expert_fsdp_mesh(self) -> DeviceMesh:
        """Where FSDP shards expert weights under EP: the data-parallel ranks ep leaves over,
        ``dp_shard_mod_ep`` (2D with dp_replicate for HSDP); :attr:`fsdp_mesh` when ep = 1."""
        if self.ep == 1:
            return self.fsdp_mesh
        if self.dp_replicate > 1:
            return self.world_mesh["dp_replicate", "dp_shard_mod_ep"]
        return self.world_mesh["dp_shard_mod_ep"]

    @property
    def dp_mesh(self) -> DeviceMesh:
        return self.view("dp")

    @property
    def tp_mesh(self) -> DeviceMesh:
        return self.view("tp")

    @property
    def cp_mesh(self) -> DeviceMesh:
        """All CP ranks as one 1D view (flattened cp_ring x cp_ulysses when split): shard the
        batch over this."""
        return self.view("cp")

    @property
    def cp_attention_mesh(self) -> DeviceMesh:
        """What CP attention runs on: the 1D cp view (ring, or pure Ulysses), or the 2D
        (cp_ring, cp_ulysses) mesh for hybrid Ulysses x ring."""
        if self.cp_ulysses > 1 and self.cp_ulysses < self.cp:
            return self.world_mesh["cp_ring", "cp_ulysses"]
        return self.cp_mesh

    @property
    def pp_mesh(self) -> DeviceMesh:
        return self.view("pp")

    @property
    def loss_mesh(self) -> DeviceMesh:
        return self.view("dp_cp")

    @property
    def ep_mesh(self) -> DeviceMesh:
        if self.ep == 1:
            raise RuntimeError("expert parallelism is off (ep = 1): there is no ep mesh")
        return self.view("ep")
