"""DTensor's layout terms and ours: (DeviceMesh, placements) against (Mesh, partition spec).

A DTensor placement says, per *mesh* dimension, which tensor dimension it splits (``Shard(d)``)
or that it replicates (``Replicate()``); a partition spec says, per *tensor* dimension, which mesh
axes split it. Several mesh dimensions sharding one tensor dimension split it in mesh order (the
first one major), as a tuple entry of a partition spec does. ``Partial`` (pending reductions) has
no counterpart in an SPMD annotation.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import torch
from jax.sharding import NamedSharding, PartitionSpec
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor.placement_types import Placement, Replicate, Shard

from ._tiling import device_index
from .mesh import Mesh


class DTensorLayoutError(AssertionError, ValueError):
    """A DeviceMesh or placements that have no XLA sharding (PyTorch/XLA asserts here)."""


def to_xla_mesh(device_mesh: DeviceMesh | Mesh, api: str) -> Mesh:
    """``device_mesh`` as our Mesh: same device ids, shape and dimension names."""
    if isinstance(device_mesh, Mesh):
        return device_mesh
    if not isinstance(device_mesh, DeviceMesh):
        raise TypeError(f"{api} expects a DeviceMesh or a Mesh, got {type(device_mesh).__name__}")
    if device_mesh.device_type != "xla":
        raise DTensorLayoutError(
            f"{api}: the DeviceMesh is of device type {device_mesh.device_type!r}; "
            "XLA sharding needs DeviceMesh('xla', ...)"
        )
    if device_mesh.size() != jax.device_count():
        raise DTensorLayoutError(
            f"{api}: the DeviceMesh holds {device_mesh.size()} devices but the program runs on "
            f"{jax.device_count()}; an SPMD mesh spans every device"
        )
    ids = device_mesh.mesh
    return Mesh(ids.flatten().tolist(), tuple(ids.shape), device_mesh.mesh_dim_names)


def check_placement_count(placements: Sequence[Placement], mesh: Mesh, api: str) -> None:
    """One placement per mesh dimension."""
    if len(placements) != len(mesh.mesh_shape):
        raise DTensorLayoutError(
            f"{api}: {len(placements)} placements {tuple(placements)} for a mesh of "
            f"{len(mesh.mesh_shape)} dimensions {mesh.mesh_shape}: give one per mesh dimension"
        )


def to_partition_spec(ndim: int, placements: Sequence[Placement], api: str) -> tuple:
    """The partition spec (mesh axis indices per tensor dimension) ``placements`` describe."""
    axes_of_dim: list[list[int]] = [[] for _ in range(ndim)]
    for mesh_dim, placement in enumerate(placements):
        if isinstance(placement, Shard):
            dim = placement.dim + ndim if placement.dim < 0 else placement.dim
            if not 0 <= dim < ndim:
                raise IndexError(
                    f"{api}: {placement!r} is out of range for a tensor of {ndim} dimensions"
                )
            axes_of_dim[dim].append(mesh_dim)
        elif not isinstance(placement, Replicate):
            raise ValueError(
                f"{api}: unsupported placement type {type(placement).__name__} ({placement!r}); "
                "XLA sharding takes Shard and Replicate"
            )
    return tuple(
        None if not axes else axes[0] if len(axes) == 1 else tuple(axes) for axes in axes_of_dim
    )


def to_dtensor_layout(sharding: NamedSharding, ndim: int) -> tuple[DeviceMesh, tuple]:
    """The DeviceMesh and placements of a tensor laid out with ``sharding``."""
    jax_mesh = sharding.mesh
    names = tuple(jax_mesh.axis_names)
    index = device_index()
    ids = torch.tensor([index[d.id] for d in jax_mesh.devices.flat]).reshape(jax_mesh.devices.shape)
    unnamed = names == tuple(str(k) for k in range(len(names)))  # as Mesh.get_jax_mesh names them
    device_mesh = DeviceMesh("xla", ids, mesh_dim_names=None if unnamed else names)
    placements: list[Placement] = [Replicate()] * len(names)
    entries = tuple(sharding.spec) + (None,) * (ndim - len(sharding.spec))
    for dim, entry in enumerate(entries):
        if entry is None:
            continue
        if entry is PartitionSpec.UNCONSTRAINED:
            raise ValueError(f"dimension {dim} of {sharding.spec} is unconstrained: no placement")
        axes = [names.index(a) for a in ((entry,) if isinstance(entry, str) else entry)]
        if axes != sorted(axes):
            raise ValueError(
                f"dimension {dim} of {sharding.spec} is split over mesh axes {entry} against the "
                f"mesh order {names}; DTensor placements split a dimension in mesh order only"
            )
        for axis in axes:
            placements[axis] = Shard(dim)
    return device_mesh, tuple(placements)
