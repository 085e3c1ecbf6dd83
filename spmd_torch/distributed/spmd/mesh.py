"""Mesh, HybridMesh and the global mesh: PyTorch/XLA's logical device topology, on JAX devices.

A ``Mesh`` is a frozen value, hashable and compared by content, because it enters cache keys. It
maps once, through a cache, to a ``jax.sharding.Mesh``; with a partition spec it maps once to a
``jax.sharding.NamedSharding``, the only sharding object the engine (``_lazy``) ever sees.

Device ids are indices into ``jax.devices()``, as PyTorch/XLA's ids index its runtime devices.
Unnamed mesh axes are called ``'0'``, ``'1'``... on the JAX side, as PyTorch/XLA's
``Mesh.get_jax_mesh`` names them.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import math
from collections import OrderedDict
from collections.abc import Sequence

import jax
import numpy as np
from jax.experimental import mesh_utils
from jax.sharding import NamedSharding, PartitionSpec

from spmd_torch import runtime
from spmd_torch._lazy import counters, engine

from . import validate

PartitionSpecLike = tuple
"""One entry per tensor dimension: a mesh axis index, an axis name, a tuple of them, or None."""


class Mesh:
    """The logical device topology: device ids laid out in ``mesh_shape``, with optional names.

    Frozen: meshes are hashable and equal when their ids, shape and names are equal, so they can
    key caches; each maps once to a ``jax.sharding.Mesh`` (:meth:`get_jax_mesh`).

    Args:
        device_ids: A flat list (or 1-D array) of device ids in the order they fill the mesh,
            row-major. Each id indexes ``jax.devices()``; the mesh must use every device once.
        mesh_shape: The number of devices along each mesh axis; its product is
            ``len(device_ids)``.
        axis_names: Optional distinct names, one per mesh axis, usable in partition specs.

    Example:
        >>> mesh = Mesh(np.arange(8), (4, 2), ('x', 'y'))
        >>> mesh.get_logical_mesh()
        array([[0, 1],
               [2, 3],
               [4, 5],
               [6, 7]])
        >>> mesh.shape()
        OrderedDict([('x', 4), ('y', 2)])
    """

    __slots__ = ("device_ids", "mesh_shape", "axis_names", "_key", "_hash", "_shardings")

    device_ids: np.ndarray
    mesh_shape: tuple[int, ...]
    axis_names: tuple[str, ...] | None

    def __init__(
        self,
        device_ids: np.ndarray | Sequence[int],
        mesh_shape: Sequence[int],
        axis_names: Sequence[str] | None = None,
    ) -> None:
        ids = np.array(device_ids)
        if ids.size == 0:
            ids = ids.astype(np.int64)
        shape = tuple(mesh_shape)
        names = None if axis_names is None else tuple(axis_names)
        validate._check_axis_names(names, shape)
        validate._check_device_ids(ids, jax.device_count())
        validate._check_mesh_shape(shape, ids.size)
        validate._check_mesh_size(ids.size, shape, jax.device_count())
        ids = ids.astype(np.int64)
        ids.flags.writeable = False
        shape = tuple(int(d) for d in shape)
        object.__setattr__(self, "device_ids", ids)
        object.__setattr__(self, "mesh_shape", shape)
        object.__setattr__(self, "axis_names", names)
        object.__setattr__(self, "_key", (tuple(ids.tolist()), shape, names))
        object.__setattr__(self, "_hash", hash(self._key))  # meshes key every sharding lookup
        object.__setattr__(self, "_shardings", {})  # translated spec -> NamedSharding

    def __setattr__(self, name: str, value) -> None:
        raise AttributeError(f"{type(self).__name__} is immutable: cannot set {name!r}")

    def __delattr__(self, name: str) -> None:
        raise AttributeError(f"{type(self).__name__} is immutable: cannot delete {name!r}")

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Mesh):
            return NotImplemented
        return self._key == other._key

    def __hash__(self) -> int:
        return self._hash

    def __repr__(self) -> str:
        ids, shape, names = self._key
        return (
            f"{type(self).__name__}(device_ids={list(ids)}, mesh_shape={shape}, axis_names={names})"
        )

    def __str__(self) -> str:
        """PyTorch/XLA's text form, read back by :meth:`from_str`."""
        return (
            f"{{'device_ids': {self.device_ids.tolist()}, 'mesh_shape': {self.mesh_shape}, "
            f"'axis_names': {self.axis_names}}}"
        )

    def __reduce__(self):
        return (Mesh, (self.device_ids.tolist(), self.mesh_shape, self.axis_names))

    @classmethod
    def from_str(cls, mesh_str: str) -> Mesh | None:
        """A mesh from its ``str()`` form; None when the text is not one.

        Args:
            mesh_str: Text as ``str(mesh)`` writes it.

        Example:
            >>> Mesh.from_str(str(mesh)) == mesh
            True
        """
        try:
            fields = ast.literal_eval(mesh_str.replace("Mesh", ""))
            return cls(fields["device_ids"], fields["mesh_shape"], fields["axis_names"])
        except (ValueError, SyntaxError, KeyError, TypeError):
            return None

    def size(self) -> int:
        """The number of devices in the mesh.

        Example:
            >>> Mesh(np.arange(8), (4, 2)).size()
            8
        """
        return math.prod(self.mesh_shape)

    def shape(self) -> OrderedDict:
        """Axis name (or axis index, for an unnamed mesh) to its size, in mesh order.

        Example:
            >>> Mesh(np.arange(8), (4, 2), ('x', 'y')).shape()
            OrderedDict([('x', 4), ('y', 2)])
        """
        keys = self.axis_names if self.axis_names is not None else range(len(self.mesh_shape))
        return OrderedDict(zip(keys, self.mesh_shape))

    def get_logical_mesh(self) -> np.ndarray:
        """The device ids laid out in ``mesh_shape`` (a read-only array).

        Example:
            >>> Mesh([0, 2, 1, 3, 4, 6, 5, 7], (2, 4)).get_logical_mesh()[0]
            array([0, 2, 1, 3])
        """
        return self.device_ids.reshape(self.mesh_shape)

    def get_axis_name_idx(self, name: str) -> int | None:
        """The index of the axis called ``name``; None when no axis has that name.

        Args:
            name: An axis name.

        Example:
            >>> Mesh(np.arange(8), (4, 2), ('x', 'y')).get_axis_name_idx('y')
            1
        """
        if self.axis_names is None or name not in self.axis_names:
            return None
        return self.axis_names.index(name)

    def get_jax_mesh(self) -> jax.sharding.Mesh:
        """The same mesh as a ``jax.sharding.Mesh`` (cached; Auto axes).

        Unnamed axes are named ``'0'``, ``'1'``... as PyTorch/XLA names them.

        Example:
            >>> Mesh(np.arange(8), (4, 2), ('x', 'y')).get_jax_mesh().shape
            OrderedDict([('x', 4), ('y', 2)])
        """
        return _jax_mesh(self)

    def get_named_sharding(self, partition_spec: PartitionSpecLike) -> NamedSharding:
        """The ``jax.sharding.NamedSharding`` of ``partition_spec`` over this mesh (cached).

        Args:
            partition_spec: One entry per tensor dimension: an axis index, an axis name, a tuple
                of them (the dimension is sharded over all of them, major to minor), or None
                (replicated along the dimension).

        Example:
            >>> Mesh(np.arange(8), (4, 2), ('x', 'y')).get_named_sharding((0, None)).spec
            PartitionSpec('x', None)
        """
        return named_sharding(self, partition_spec)

    def get_op_sharding(self, partition_spec: PartitionSpecLike) -> NamedSharding:
        """The sharding of ``partition_spec`` over this mesh, to hand to ``_XLAC``'s calls that
        take one: PyTorch/XLA's is an ``xla::OpSharding``, here the ``NamedSharding`` itself.

        Example:
            >>> xlac._global_tensor_from_cpu_shards(shards, mesh.get_op_sharding((0,)))
        """
        return named_sharding(self, partition_spec)


class HybridMesh(Mesh):
    """A mesh over devices joined by a fast network (ICI) within a host and a slow one (DCN) across.

    Each mesh axis has size ``ici_mesh_shape[i] * dcn_mesh_shape[i]``; a coordinate along it is
    ``dcn_index * ici_mesh_shape[i] + ici_index``, so the DCN part of every axis is its major part.
    The devices are read from ``runtime.global_runtime_device_attributes()``, as PyTorch/XLA reads
    them, and laid out by ``jax.experimental.mesh_utils.create_hybrid_device_mesh``: one DCN
    coordinate per slice (the attributes' ``slice_index``), else per process, else (one process)
    per contiguous block of ``prod(ici_mesh_shape)`` devices; within it, TPUs (attributes with
    ``coords``) follow their physical torus and other devices their ids. Order axes by increasing
    network intensity.

    Args:
        ici_mesh_shape: The logical mesh within a host (or slice).
        dcn_mesh_shape: The logical mesh of hosts, same length; default all ones.
        axis_names: Optional names of the mesh axes.

    Example:
        >>> mesh = HybridMesh(ici_mesh_shape=(1, 4), dcn_mesh_shape=(2, 1), axis_names=('dp', 'fsdp'))
        >>> mesh.shape()
        OrderedDict([('dp', 2), ('fsdp', 4)])
    """

    __slots__ = ("ici_mesh_shape", "dcn_mesh_shape")

    def __init__(
        self,
        ici_mesh_shape: Sequence[int],
        dcn_mesh_shape: Sequence[int] | None = None,
        axis_names: Sequence[str] | None = None,
    ) -> None:
        ici = tuple(ici_mesh_shape)
        dcn = tuple(dcn_mesh_shape) if dcn_mesh_shape is not None else (1,) * len(ici)
        validate._check_hybrid_shapes(ici, dcn)
        validate._check_mesh_shape(ici, math.prod(ici))
        validate._check_mesh_shape(dcn, math.prod(dcn))
        mesh_shape = tuple(int(i) * int(d) for i, d in zip(ici, dcn))
        devices = _devices_from_attributes(runtime.global_runtime_device_attributes(), ici)
        validate._check_mesh_size(math.prod(mesh_shape), mesh_shape, len(devices))
        validate._check_granules(len({d.slice_index for d in devices}), dcn)
        laid_out = mesh_utils.create_hybrid_device_mesh(
            ici, dcn, devices, allow_split_physical_axes=True
        )
        ids = np.vectorize(lambda d: d.id, otypes=[np.int64])(laid_out)
        super().__init__(ids.reshape(-1), mesh_shape, axis_names)
        object.__setattr__(self, "ici_mesh_shape", tuple(int(i) for i in ici))
        object.__setattr__(self, "dcn_mesh_shape", tuple(int(d) for d in dcn))

    def __reduce__(self):
        return (HybridMesh, (self.ici_mesh_shape, self.dcn_mesh_shape, self.axis_names))


@dataclasses.dataclass(frozen=True)
class _DeviceStandIn:
    """A device as JAX's ``mesh_utils`` reads one, built from PyTorch/XLA's device attributes
    (which user code and tests may give for devices this process does not have)."""

    id: int
    platform: str
    device_kind: str
    slice_index: int  # the DCN granule: a slice, else a process, else a block of devices
    coords: tuple[int, ...] = ()
    core_on_chip: int = 0


def _devices_from_attributes(attributes: list[dict], ici: tuple) -> list[_DeviceStandIn]:
    """One stand-in per device, its id its position by ordinal (``'TPU:2'`` -> 2), as
    PyTorch/XLA's HybridMesh numbers them."""
    ordered = sorted(attributes, key=lambda a: int(str(a["name"]).rsplit(":", 1)[1]))
    block = math.prod(ici)
    return [
        _DeviceStandIn(
            id=k,
            platform=str(a.get("platform", str(a["name"]).split(":")[0])).lower(),
            device_kind=str(a.get("device_kind", "")),
            slice_index=_granule(a, k, block),
            coords=tuple(a.get("coords", ())),
            core_on_chip=int(a.get("core_on_chip", 0)),
        )
        for k, a in enumerate(ordered)
    ]


def _granule(attributes: dict, position: int, block: int) -> int:
    """The DCN coordinate a device belongs to: its slice, else its process when the job has
    several, else its block of ``block`` devices in id order (one process emulating hosts)."""
    if "slice_index" in attributes:
        return int(attributes["slice_index"])
    if jax.process_count() > 1:
        return int(attributes["process_index"])
    return position // block


def get_1d_mesh(axis_name: str | None = None) -> Mesh:
    """A mesh with every device along one axis, in ``jax.devices()`` order.

    Args:
        axis_name: Optional name of the single axis.

    Returns:
        ``Mesh(range(n), (n,), (axis_name,))`` for the ``n`` devices of the program.

    Example:
        >>> mesh = get_1d_mesh('data')
        >>> mesh.mesh_shape, mesh.axis_names
        ((8,), ('data',))
    """
    n = jax.device_count()
    return Mesh(np.arange(n), (n,), None if axis_name is None else (axis_name,))


def check_mesh(mesh) -> None:
    """APIs taking a mesh take our ``Mesh`` (HybridMesh included)."""
    if not isinstance(mesh, Mesh):
        raise ValueError(
            f"expected a spmd_torch.distributed.spmd.Mesh, got {type(mesh).__name__}: {mesh!r}"
        )


def set_global_mesh(mesh: Mesh | None) -> None:
    """Set the mesh APIs use when none is passed (``None`` clears it).

    Args:
        mesh: The program's mesh (the engine keeps it; ``runtime.reset()`` forgets it).

    Example:
        >>> set_global_mesh(get_1d_mesh('data'))
    """
    if mesh is not None:
        check_mesh(mesh)
    engine.current().global_mesh = mesh


def get_global_mesh() -> Mesh | None:
    """The mesh set by :func:`set_global_mesh`, or None.

    Example:
        >>> get_global_mesh() is None
        True
    """
    return engine.current().global_mesh


def translate_spec(mesh: Mesh, partition_spec: PartitionSpecLike) -> tuple:
    """``partition_spec`` validated against ``mesh``: per dimension None or a tuple of axis indices."""
    validate._check_spec_container(partition_spec)
    spec = tuple(tuple(e) if isinstance(e, list) else e for e in partition_spec)
    try:
        return _translate(mesh, spec)
    except TypeError:  # an unhashable entry: let the entry check name it
        for entry in spec:
            validate._check_spec_entry(entry, spec)
        raise


@functools.lru_cache(maxsize=4096)
def _translate(mesh: Mesh, spec: tuple) -> tuple:
    out = []
    for entry in spec:
        validate._check_spec_entry(entry, spec)
        if entry is None or (isinstance(entry, tuple) and not entry):
            out.append(None)
            continue
        indices = []
        for axis in entry if isinstance(entry, tuple) else (entry,):
            if isinstance(axis, str):
                validate._check_axis_name(axis, mesh.axis_names, spec)
                indices.append(mesh.axis_names.index(axis))
            else:
                validate._check_axis_index(int(axis), mesh.mesh_shape, spec)
                indices.append(int(axis))
        out.append(tuple(indices))
    validate._check_unique_axes(out, spec, mesh.axis_names)
    return tuple(out)


def named_sharding(mesh: Mesh, partition_spec: PartitionSpecLike) -> NamedSharding:
    """The ``NamedSharding`` of ``partition_spec`` over ``mesh``, built once per ``Mesh`` object
    and spec, as PyTorch/XLA caches its ``OpSharding`` (an equal mesh built anew builds its own,
    equal, sharding; the cache goes with the mesh)."""
    indices = translate_spec(mesh, partition_spec)
    sharding = mesh._shardings.get(indices)
    if sharding is None:
        sharding = mesh._shardings[indices] = _new_named_sharding(mesh, indices)
    return sharding


def _new_named_sharding(mesh: Mesh, indices: tuple) -> NamedSharding:
    counters.bump("CreateOpSharding")  # PyTorch/XLA's count of shardings built (cache misses)
    jax_mesh = _jax_mesh(mesh)
    names = jax_mesh.axis_names
    entries = []
    for axes in indices:
        if axes is None:
            entries.append(None)
        elif len(axes) == 1:
            entries.append(names[axes[0]])
        else:
            entries.append(tuple(names[a] for a in axes))
    return NamedSharding(jax_mesh, PartitionSpec(*entries))


@functools.lru_cache(maxsize=256)
def _jax_mesh(mesh: Mesh) -> jax.sharding.Mesh:
    # A plain jax Mesh (not jax.make_mesh): its axes are Auto, so GSPMD propagates through them.
    devices = jax.devices()
    array = np.empty(mesh.mesh_shape, dtype=object)
    for position, device_id in np.ndenumerate(mesh.get_logical_mesh()):
        array[position] = devices[device_id]
    names = mesh.axis_names or tuple(str(i) for i in range(len(mesh.mesh_shape)))
    return jax.sharding.Mesh(array, names)
