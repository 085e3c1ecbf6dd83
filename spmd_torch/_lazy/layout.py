"""Layouts without state: an uneven sharding's padded shape, padding to it and cropping back.

JAX arrays cannot be sharded unevenly, so a dimension that does not divide among its mesh axes is
stored padded at its end, as PyTorch/XLA does; the graph keeps the logical shape. ``pad_to`` and
``crop`` work on NumPy arrays (uploads, downloads) and on JAX values (inside programs) alike.
"""

from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec


def padded_shape(shape: tuple, sharding) -> tuple:
    """``shape`` rounded up so each dimension divides evenly among its mesh axes."""
    spec = getattr(sharding, "spec", None)
    if not spec:
        return tuple(shape)
    sizes = sharding.mesh.shape
    out = []
    for dim, n in enumerate(shape):
        entry = spec[dim] if dim < len(spec) else None
        names = () if entry is None else (entry,) if isinstance(entry, str) else entry
        ways = math.prod(sizes[name] for name in names)
        out.append(-(-n // ways) * ways)
    return tuple(out)


def even_part(sharding, shape: tuple):
    """``sharding`` with the mesh axes of each dimension they do not divide dropped: the closest
    layout a JAX array of logical ``shape`` can have (uneven dimensions replicated)."""
    spec = getattr(sharding, "spec", None)
    if not spec or padded_shape(shape, sharding) == tuple(shape):
        return sharding
    padded_dims = padded_shape(shape, sharding)
    entries = [
        spec[dim] if dim < len(spec) and padded_dims[dim] == shape[dim] else None
        for dim in range(len(shape))
    ]
    return canonical(
        NamedSharding(sharding.mesh, PartitionSpec(*entries), memory_kind=sharding.memory_kind)
    )


def pad_to(x, shape: tuple):
    """``x`` zero-padded at the end of each dimension to ``shape`` (itself when already there)."""
    if tuple(x.shape) == tuple(shape):
        return x
    widths = [(0, t - n) for t, n in zip(shape, x.shape)]
    return np.pad(x, widths) if isinstance(x, np.ndarray) else jnp.pad(x, widths)


def padded(x, sharding):
    """``x`` padded to ``sharding``'s even shape."""
    return pad_to(x, padded_shape(x.shape, sharding))


def crop(x, shape: tuple):
    """``x`` back at its logical ``shape``: the leading corner of an array stored padded, or the
    one block of a replica's array (stacked with a leading axis of 1, see transfer.OnReplica)."""
    if tuple(x.shape) == tuple(shape):
        return x
    if len(x.shape) == len(shape) + 1:
        return x.reshape(shape)
    return x[tuple(slice(0, n) for n in shape)]


def canonical(sharding: NamedSharding) -> NamedSharding:
    """The form program outputs report (no trailing ``None``), so step N+1 keys equal step N's."""
    entries = list(sharding.spec)
    while entries and entries[-1] is None:
        entries.pop()
    if len(entries) == len(sharding.spec):
        return sharding
    return NamedSharding(sharding.mesh, PartitionSpec(*entries), memory_kind=sharding.memory_kind)
