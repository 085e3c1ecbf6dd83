"""Checks on meshes and partition specs: each raises one ValueError that names the culprit.

Kept apart from the classes so the rules are read (and tested) in one place, as jax keeps
``_check_unique_resources`` and ``_check_mesh_resource_axis`` next to ``NamedSharding``.
A bad mesh raises :class:`MeshError`, a ValueError that is also the AssertionError
PyTorch/XLA's ``Mesh.__init__`` raises, its message holding PyTorch/XLA's wording too.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
from jax.sharding import PartitionSpec


class MeshError(ValueError, AssertionError):
    """A bad mesh: our ValueError, and the AssertionError PyTorch/XLA's ``Mesh`` asserts."""


def _check_axis_names(axis_names: tuple | None, mesh_shape: tuple) -> None:
    """Axis names are optional, but when given there is one distinct string per mesh dimension."""
    if axis_names is None:
        return
    bad = [name for name in axis_names if not isinstance(name, str)]
    if bad:
        raise MeshError(f"Axis names must be strings, got {bad[0]!r} in {axis_names}")
    if len(axis_names) != len(mesh_shape):
        raise MeshError(
            f"Number of axis names ({len(axis_names)}) must match mesh dimensions "
            f"({len(mesh_shape)}): Mesh has {len(mesh_shape)} dimensions (mesh_shape={mesh_shape}) "
            f"but {len(axis_names)} axis names {axis_names}"
        )
    repeated = sorted({name for name in axis_names if axis_names.count(name) > 1})
    if repeated:
        raise MeshError(f"Axis names must be unique: {repeated} repeated in {axis_names}")


def _check_mesh_shape(mesh_shape: tuple, num_ids: int) -> None:
    """Every mesh dimension is a positive int, and together they hold exactly the ids given."""
    bad = [d for d in mesh_shape if isinstance(d, bool) or not isinstance(d, (int, np.integer))]
    if bad:
        raise MeshError(f"mesh_shape entries must be ints, got {bad[0]!r} in {mesh_shape}")
    if any(d < 1 for d in mesh_shape):
        raise MeshError(f"mesh_shape entries must be positive, got {mesh_shape}")
    if math.prod(mesh_shape) != num_ids:
        raise MeshError(
            f"Number of device IDs ({num_ids}) must match mesh size ({math.prod(mesh_shape)}): "
            f"mesh_shape {mesh_shape} holds {math.prod(mesh_shape)} devices but {num_ids} device "
            "ids were given"
        )


def _check_device_ids(device_ids: np.ndarray, device_count: int) -> None:
    """Ids index ``jax.devices()``: integers in range, each used once."""
    if device_ids.ndim != 1:
        raise MeshError(f"device_ids must be a flat list, got an array of shape {device_ids.shape}")
    if device_ids.size and not np.issubdtype(device_ids.dtype, np.integer):
        raise MeshError(f"device_ids must be integers, got dtype {device_ids.dtype}")
    out_of_range = [int(d) for d in device_ids if not 0 <= d < device_count]
    if out_of_range:
        raise MeshError(
            f"Device IDs must be less than mesh size and not negative: device ids {out_of_range} "
            f"are out of range: ids index the {device_count} devices of jax.devices() that a "
            f"mesh spans, so they must lie in [0, {device_count})"
        )
    values, counts = np.unique(device_ids, return_counts=True)
    repeated = [int(v) for v, c in zip(values, counts) if c > 1]
    if repeated:
        raise MeshError(f"Device IDs must be unique: {repeated} repeated in {device_ids.tolist()}")


def _check_mesh_size(mesh_size: int, mesh_shape: tuple, device_count: int) -> None:
    """A mesh spans every device: SPMD programs run over all of them (as in PyTorch/XLA)."""
    if mesh_size != device_count:
        raise MeshError(
            f"Number of device IDs ({mesh_size}) must match the global number of devices "
            f"({device_count}): Mesh of shape {mesh_shape} has {mesh_size} devices but the "
            f"program runs on {device_count} (jax.device_count()); a mesh must span every device"
        )


def _check_hybrid_shapes(ici_mesh_shape: tuple, dcn_mesh_shape: tuple) -> None:
    """ICI and DCN shapes describe the same logical axes, so they have the same length."""
    if len(ici_mesh_shape) != len(dcn_mesh_shape):
        raise MeshError(
            f"ici_mesh_shape {ici_mesh_shape} and dcn_mesh_shape {dcn_mesh_shape} must have the "
            "same number of dimensions"
        )


def _check_granules(num_granules: int, dcn_mesh_shape: tuple) -> None:
    """Each DCN coordinate is one slice (or process, or block of devices on one process)."""
    if math.prod(dcn_mesh_shape) != num_granules:
        raise MeshError(
            f"dcn_mesh_shape {dcn_mesh_shape} spans {math.prod(dcn_mesh_shape)} slices or hosts "
            f"but the devices form {num_granules} (their slice_index, else their processes)"
        )


def _check_spec_container(partition_spec) -> None:
    """A partition spec is a tuple (or list, or jax PartitionSpec) of per-dimension entries."""
    if not isinstance(partition_spec, (tuple, list, PartitionSpec)):
        raise ValueError(
            f"partition_spec must be a tuple with one entry per tensor dimension, got "
            f"{partition_spec!r} of type {type(partition_spec).__name__}"
        )


def _check_spec_entry(entry, partition_spec: tuple) -> None:
    """An entry is None, a mesh axis (index or name), or a flat tuple of mesh axes."""
    if entry is None:
        return
    axes = entry if isinstance(entry, tuple) else (entry,)
    for axis in axes:
        if isinstance(axis, tuple):
            raise ValueError(
                f"partition_spec {partition_spec} nests tuples in entry {entry!r}: an entry is "
                "an axis index, an axis name, a flat tuple of them, or None"
            )
        if isinstance(axis, bool) or not isinstance(axis, (int, np.integer, str)):
            raise ValueError(
                f"partition_spec {partition_spec} has entry {axis!r} of type "
                f"{type(axis).__name__}: an entry is an axis index, an axis name, a tuple of them, "
                "or None"
            )


def _check_axis_name(name: str, axis_names: tuple | None, partition_spec: tuple) -> None:
    """A named entry must name an axis of the mesh."""
    if axis_names is None or name not in axis_names:
        raise ValueError(
            f"Axis name {name!r} in partition_spec {partition_spec} is not an axis of the mesh, "
            f"whose axes are {axis_names if axis_names is not None else 'unnamed'}"
        )


def _check_axis_index(index: int, mesh_shape: tuple, partition_spec: tuple) -> None:
    """An index entry must point into ``mesh_shape``."""
    if not 0 <= index < len(mesh_shape):
        raise ValueError(
            f"Axis index {index} in partition_spec {partition_spec} is out of range for a mesh "
            f"of shape {mesh_shape} (valid: 0..{len(mesh_shape) - 1})"
        )


def _check_unique_axes(indices: Sequence, partition_spec: tuple, axis_names: tuple | None) -> None:
    """A mesh axis shards at most one tensor dimension, once."""
    flat = [i for entry in indices if entry is not None for i in entry]
    repeated = sorted({i for i in flat if flat.count(i) > 1})
    if repeated:
        names = [axis_names[i] if axis_names else i for i in repeated]
        raise ValueError(
            f"Mesh axis {names[0]!r} is used more than once in partition_spec {partition_spec}; "
            "each mesh axis may shard at most one tensor dimension"
        )


def _check_spec_rank(shape: tuple, partition_spec: tuple) -> None:
    """Specs are fully specified: one entry per tensor dimension (PyTorch/XLA's rule)."""
    if len(shape) != len(partition_spec):
        raise ValueError(
            f"partition_spec {partition_spec} has {len(partition_spec)} entries but the tensor of "
            f"shape {shape} has rank {len(shape)}: give one entry (None to replicate) per dimension"
        )
