"""The process group a plugin's collectives run on, from a 1D ``DeviceMesh`` or a group.

>>> one_dim_group(None, "{ndim}D {names}") is None
True
"""

from __future__ import annotations

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

__all__ = ["one_dim_group"]


def one_dim_group(group: DeviceMesh | dist.ProcessGroup | None, refusal: str
                  ) -> dist.ProcessGroup | None:
    """``group``'s process group (a group or None as it is); a mesh of more than one dim raises
    ValueError with ``refusal`` formatted with its ``ndim`` and ``names`` (what the plugin
    needs and how to pass it)."""
    if isinstance(group, DeviceMesh):
        if group.ndim != 1:
            raise ValueError(refusal.format(ndim=group.ndim, names=group.mesh_dim_names))
        return group.get_group()
    return group
