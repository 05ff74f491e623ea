"""FSDP2 float8 all-gather that also runs on gloo (private; imported lazily by float8.py).

torchao's ``WeightWithDynamicFloat8CastTensor`` hands FSDP2 a float8 tensor to all-gather.
When every parameter of an FSDP unit is such a weight, FSDP all-gathers in float8, and gloo
has no float8 collectives ("Invalid scalar type"). This subclass hands over a uint8 view of the
same bytes on gloo and views the gathered bytes back as float8, so the data, the scale and the
numerics are exactly torchao's. On NCCL it changes nothing.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torchao.float8.fsdp_utils import WeightWithDynamicFloat8CastTensor as _Base

from titanext._compat import pytree

__all__ = ["ByteAllGatherFloat8Weight"]


def _moves_bytes(mesh, data: torch.Tensor) -> bool:
    """gloo (the CPU backend) has no float8 all-gather; NCCL does, so it keeps float8."""
    if data.device.type == "cpu":
        return True
    try:
        return "gloo" in str(dist.get_backend(mesh.get_group(mesh.ndim - 1)))
    except (RuntimeError, ValueError, AttributeError):
        return False


class ByteAllGatherFloat8Weight(_Base):
    """torchao's float8-all-gather weight, with a uint8 all-gather where float8 has none."""

    @classmethod
    def __torch_dispatch__(cls, func, types, args, kwargs=None):
        out = _Base.__torch_dispatch__.__func__(cls, func, types, args, kwargs)
        # The base class re-wraps results into itself; keep this type through FSDP's
        # empty_like / slice / copy_ / detach so the hooks below stay in place.
        return pytree.tree_map_only(
            _Base,
            lambda t: t if type(t) is cls else cls(t._tensor, t._linear_mm_config, t._dtype),
            out,
        )

    @staticmethod
    def __tensor_unflatten__(inner_tensors, flatten_spec, outer_size, outer_stride):
        return ByteAllGatherFloat8Weight(inner_tensors["_tensor"], flatten_spec["mm_config"],
                                         flatten_spec["dtype"],
                                         inner_tensors.get("_precomputed_scale"))

    def fsdp_pre_all_gather(self, mesh):
        (data,), metadata = super().fsdp_pre_all_gather(mesh)
        if _moves_bytes(mesh, data):
            data = data.view(torch.uint8)
        return (data,), metadata

    def fsdp_post_all_gather(self, all_gather_outputs, metadata, param_dtype, *, out=None):
        (data,) = all_gather_outputs
        if data.dtype == torch.uint8:
            data = data.view(self._dtype)  # same storage, which FSDP frees and reallocates
        return super().fsdp_post_all_gather((data,), metadata, param_dtype, out=out)


torch.serialization.add_safe_globals([ByteAllGatherFloat8Weight])
