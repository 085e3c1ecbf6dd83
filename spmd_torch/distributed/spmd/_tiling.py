"""How a jax Sharding tiles a tensor, in PyTorch/XLA's terms (XLA's HloSharding).

From the sharding of a rank-n value come the tile grid (tiles per tensor dimension), the size of
the replicated last tile dimension, and the flat tile assignment (device ids, in the order XLA
prints them). The sharding string, the sharding type and each device's replica id follow. Device
ids index ``jax.devices()``; the list is written out in full, never XLA's iota form ``<=[8]``.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from enum import IntEnum

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec, SingleDeviceSharding


class ShardingType(IntEnum):
    """PyTorch/XLA's sharding kinds; the values are those of ``xla::OpSharding::Type``.

    Example:
        >>> xs.mark_sharding(t, mesh, (0, None)).sharding_type
        <ShardingType.TILED: 3>
    """

    REPLICATED = 0
    MAXIMAL = 1
    TUPLE = 2
    TILED = 3
    MANUAL = 4
    PARTIAL = 5
    UNKNOWN = 6


@dataclass(frozen=True)
class Tiling:
    """A tensor's tiling: ``devices`` fills the grid ``tiles + (replicas,)`` row-major."""

    type: ShardingType
    tiles: tuple[int, ...]
    replicas: int
    devices: tuple[int, ...]

    def text(self) -> str:
        """The string XLA's ``HloSharding::ToString`` prints, with explicit device ids."""
        if self.type is ShardingType.REPLICATED:
            return "{replicated}"
        if self.type is ShardingType.MAXIMAL:
            return f"{{maximal device={self.devices[0]}}}"
        ids = ",".join(map(str, self.devices))
        if self.type is ShardingType.PARTIAL:
            dims = ",".join(map(str, self.tiles + (self.replicas,)))
            return f"{{devices=[{dims}]{ids} last_tile_dim_replicate}}"
        return f"{{devices=[{','.join(map(str, self.tiles))}]{ids}}}"

    def replica_id(self, device: int) -> int:
        """The device's index within its replication group (0 for a tiled sharding)."""
        return self.devices.index(device) % self.replicas


def device_index() -> dict[int, int]:
    """jax device id -> position in ``jax.devices()`` (our device id)."""
    return _device_index(tuple(d.id for d in jax.devices()))


@functools.lru_cache(maxsize=8)
def _device_index(ids: tuple) -> dict[int, int]:
    return {device_id: k for k, device_id in enumerate(ids)}


@functools.lru_cache(maxsize=4096)
def tiling_of(sharding: jax.sharding.Sharding, ndim: int) -> Tiling:
    """The tiling ``sharding`` gives a rank-``ndim`` value (cached: shardings are hashable)."""
    index = device_index()
    if isinstance(sharding, SingleDeviceSharding):
        (device,) = sharding.device_set
        return Tiling(ShardingType.MAXIMAL, (1,) * ndim, 1, (index[device.id],))
    if isinstance(sharding, NamedSharding):
        return _named_tiling(sharding, ndim, index)
    return _hlo_tiling(sharding, ndim, index)


def _named_tiling(sharding: NamedSharding, ndim: int, index: dict) -> Tiling:
    """PyTorch/XLA's tile assignment: the logical mesh transposed so the axes sharding tensor
    dimensions come first (in dimension order) and the unused axes last, in mesh order."""
    mesh = sharding.mesh
    names = list(mesh.axis_names)
    sizes = mesh.devices.shape
    entries = list(sharding.spec)[:ndim] + [None] * max(0, ndim - len(sharding.spec))
    dim_axes = []
    for entry in entries:
        if entry is None or entry is PartitionSpec.UNCONSTRAINED:
            dim_axes.append(())
        else:
            axes = (entry,) if isinstance(entry, str) else tuple(entry)
            dim_axes.append(tuple(names.index(a) for a in axes))
    used = [a for axes in dim_axes for a in axes]
    unused = [a for a in range(len(names)) if a not in used]
    ids = np.vectorize(lambda d: index[d.id], otypes=[np.int64])(mesh.devices)
    devices = tuple(int(i) for i in ids.transpose(used + unused).reshape(-1))
    tiles = tuple(math.prod(sizes[a] for a in axes) for axes in dim_axes)
    return _classify(tiles, math.prod(sizes[a] for a in unused), devices)


def _hlo_tiling(sharding: jax.sharding.Sharding, ndim: int, index: dict) -> Tiling:
    """Any other sharding, read from its HloSharding (device numbers index its assignment)."""
    hlo = sharding._to_xla_hlo_sharding(ndim)
    assignment = [index[d.id] for d in sharding._device_assignment]
    if hlo.is_replicated():
        return Tiling(ShardingType.REPLICATED, (1,) * ndim, len(assignment), tuple(assignment))
    if hlo.is_maximal():
        device = assignment[hlo.tile_assignment_devices()[0]]
        return Tiling(ShardingType.MAXIMAL, (1,) * ndim, 1, (device,))
    dims = tuple(hlo.tile_assignment_dimensions())
    devices = tuple(assignment[k] for k in hlo.tile_assignment_devices())
    if hlo.replicate_on_last_tile_dim():
        return _classify(dims[:-1], dims[-1], devices)
    return _classify(dims[:ndim], math.prod(dims[ndim:]), devices)


def _classify(tiles: tuple, replicas: int, devices: tuple) -> Tiling:
    """XLA's normal form: no tiling is replicated; no replication is plainly tiled."""
    if math.prod(tiles) == 1:
        return Tiling(ShardingType.REPLICATED, tiles, replicas, devices)
    kind = ShardingType.TILED if replicas == 1 else ShardingType.PARTIAL
    return Tiling(kind, tiles, replicas, devices)
