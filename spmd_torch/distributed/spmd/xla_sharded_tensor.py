"""XLAShard and XLAShardedTensor: a sharded tensor's global view and its per-device shards.

Design: as in PyTorch/XLA 2.9, ``XLAShardedTensor`` is a ``torch.Tensor`` wrapper subclass of
``torch.distributed.tensor.DTensor`` around ``global_tensor``, so ``isinstance(x, torch.Tensor)``
and ``isinstance(x, DTensor)`` hold and ``nn.Parameter`` and torch APIs take it. The sharding
lives on the wrapped xla tensor itself (its storage, see ``_lazy/placement.py``), so
``xs.mark_sharding(t, ...)`` may drop the return value and keep using ``t``. Every torch
function on a wrapper (methods, operators, attributes such as ``.grad``) runs in
``__torch_function__`` on the wrapped tensors, and each tensor it returns comes back wrapped (an
in-place op gives back its own wrapper). That happens above autograd: the wrapper itself never
joins an autograd graph, the wrapped tensors do, so gradients reach ``global_tensor`` (PyTorch/XLA
unwraps below autograd, in ``__torch_dispatch__``; here that is only the path of an aten op that
reaches a wrapper while torch functions are disabled). Other attributes are the wrapped
tensor's (``__getattr__``).

Of PyTorch/XLA 2.9's DTensor face it keeps what scripts use: ``placements``, ``device_mesh``,
``_spec`` (a ``DTensorSpec``, cached until the sharding changes), ``mesh_shape``,
``partition_spec``, ``redistribute``, ``to_local``, ``full_tensor`` and the constructor's
``mesh_shape``, ``partition_spec`` and ``requires_grad``. They are read from the tensor's sharding
itself (device ids and axis names included), not from metadata stored on the wrapper, so they also
answer for a tensor wrapped after the fact and never disagree with ``sharding_spec``: where
PyTorch/XLA only records a mesh shape and a spec given to the wrapper, the tensor is laid out so.
An op's result has no sharding until a program computes it, so its ``_spec`` raises ValueError
until then, as PyTorch/XLA's does for such an "auto-wrapped" tensor.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from dataclasses import dataclass
from types import EllipsisType

import numpy as np
import torch
import torch.utils._pytree as pytree
from jax.sharding import NamedSharding, PartitionSpec
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
from torch.distributed.tensor.placement_types import Partial, Placement

from spmd_torch import runtime
from spmd_torch._lazy import execute, modes, placement, transfer
from spmd_torch._lazy.layout import canonical
from spmd_torch._lazy.tensor import on_xla
from spmd_torch._lazy.transfer import to_torch

from . import _dtensor, validate
from ._tiling import ShardingType, Tiling, device_index, tiling_of
from .mesh import Mesh, PartitionSpecLike, check_mesh, get_global_mesh, named_sharding


@dataclass
class XLAShard:
    """One device's shard of a sharded tensor, copied to the host.

    Attributes:
        data: The shard's values as a CPU tensor, as the device holds them: an uneven sharding
            pads the last shards with zeros to the shape every shard has (PyTorch/XLA's
            ``data``); ``unpadded_data`` is the part inside the tensor (empty on a device holding
            only padding).
        indices: Where the shard lies in the global tensor: a list of slices (step 1), one per
            dimension, or ``Ellipsis`` when the tensor is replicated, as PyTorch/XLA gives them
            (index a tensor with ``t[tuple(shard.indices)]``: PyTorch deprecates indexing with a
            list of slices).
        shard_device: The device holding it, e.g. ``'CPU:3'`` (``'<device_type>:<id>'``).
        replica_id: Replica within the shard's replication group: 0 for a tiled sharding, the
            position in the group for a partially replicated one, and the device id for a
            replicated one (PyTorch/XLA's convention).

    Example:
        >>> shard = xs.mark_sharding(t, mesh, (0, None)).local_shards[0]
        >>> shard.indices
        [slice(0, 1, 1), slice(0, 4, 1)]
    """

    data: torch.Tensor
    indices: list[slice] | EllipsisType
    shard_device: str
    replica_id: int

    @property
    def unpadded_data(self) -> torch.Tensor:
        """``data`` without its padding: the values ``indices`` name in the global tensor."""
        if self.indices is Ellipsis:
            return self.data
        return self.data[tuple(slice(0, s.stop - s.start) for s in self.indices)]

    @unpadded_data.setter
    def unpadded_data(self, values: torch.Tensor) -> None:
        self.unpadded_data.copy_(values)


def _unwrap(x):
    return x.global_tensor if isinstance(x, XLAShardedTensor) else x


def _wrap(tensor: torch.Tensor) -> XLAShardedTensor:
    """A fresh wrapper around ``tensor`` (an op's result): no copy, no layout work."""
    wrapper = torch.Tensor._make_wrapper_subclass(
        XLAShardedTensor,
        tensor.shape,
        strides=tensor.stride() if tensor.layout == torch.strided else None,
        dtype=tensor.dtype,
        layout=tensor.layout,
        device=tensor.device,
    )
    wrapper.global_tensor = tensor
    wrapper._declared = None
    wrapper._cached_spec = wrapper._cached_for = None
    return wrapper


_GETSET = type(torch._C.TensorBase.data)


class _Absent:
    """A class attribute that reads as missing: ``hasattr(cls, name)`` is False."""

    def __get__(self, obj, owner):
        raise AttributeError("XLAShardedTensor is no traceable wrapper subclass")


def _call_unwrapped(func, args: tuple, kwargs: dict):
    """``func`` on the wrapped tensors; tensor results wrapped again. A result that is an
    argument's own tensor (an in-place op, a no-op ``.to``) gives back that argument's wrapper."""
    given: dict[int, XLAShardedTensor] = {}

    def unwrap(x: XLAShardedTensor) -> torch.Tensor:
        given[id(x.global_tensor)] = x
        return x.global_tensor

    args, kwargs = pytree.tree_map_only(XLAShardedTensor, unwrap, (args, kwargs))
    descriptor = getattr(func, "__self__", None)
    if type(descriptor) is _GETSET:  # an attribute (.grad, .data = t): as the tensor's class has it
        name, tensor = descriptor.__name__, args[0]
        if func.__name__ == "__set__":
            return setattr(tensor, name, args[1])
        out = getattr(tensor, name) if func.__name__ == "__get__" else delattr(tensor, name)
    else:
        out = func(*args, **kwargs)

    def wrap(t: torch.Tensor) -> XLAShardedTensor:
        if isinstance(t, XLAShardedTensor):
            return t
        wrapper = given.get(id(t))
        return _wrap(t) if wrapper is None else wrapper

    if isinstance(out, torch.Tensor):
        return wrap(out)
    if isinstance(out, (list, tuple, dict)) and not isinstance(out, torch.Size):
        return pytree.tree_map_only(torch.Tensor, wrap, out)
    return out  # a Size, a scalar, a dtype... as it is (pytree would make a Size a tuple)


class XLAShardedTensor(DTensor):
    """A global tensor viewed with its sharding: ``local_shards``, ``sharding_spec``...

    Returned by ``mark_sharding``; wrapping never copies data. A ``torch.Tensor`` (a ``DTensor``
    subclass, as in PyTorch/XLA 2.9) whose ops run on ``global_tensor``; see the module
    docstring.

    Args:
        global_tensor: A tensor (on the xla device for anything about its sharding), or another
            XLAShardedTensor.
        mesh_shape: With ``partition_spec``, the layout to give the tensor, as PyTorch/XLA's
            ``wrap_as_sharded_tensor`` records it: the tensor is laid out so (over the mesh it is
            already sharded over if that has this shape, else the global mesh if it does, else
            the devices in order). Either one alone keeps the other from the current layout.
        partition_spec: One entry per dimension (see ``mark_sharding``).
        requires_grad: Make the wrapper a leaf that requires grad: ``global_tensor`` becomes a
            detached alias of the tensor (same data and sharding) whose ``.grad`` the wrapper
            shows, as PyTorch/XLA's wrapper subclass does.

    Example:
        >>> xt = xs.mark_sharding(torch.arange(8.0, device=dev), xs.get_1d_mesh(), (0,))
        >>> xt.sharding_spec
        '{devices=[8]0,1,2,3,4,5,6,7}'
        >>> type(xt * 2).__name__, (xt * 2).sum().item()
        ('XLAShardedTensor', 56.0)
        >>> xt.mesh_shape, xt.partition_spec, xt.placements
        ((8,), (0,), (Shard(dim=0),))
    """

    global_tensor: torch.Tensor

    @staticmethod
    def __new__(
        cls,
        global_tensor: torch.Tensor | XLAShardedTensor,
        mesh_shape: Sequence[int] | None = None,
        partition_spec: PartitionSpecLike | None = None,
        *,
        requires_grad: bool = False,
    ) -> XLAShardedTensor:
        if not isinstance(global_tensor, torch.Tensor):
            raise TypeError(
                f"XLAShardedTensor wraps a tensor, got a {type(global_tensor).__name__}"
            )
        tensor = _unwrap(global_tensor)
        if requires_grad:
            tensor = tensor.detach().requires_grad_(True)
        wrapper = _wrap(tensor)
        if isinstance(global_tensor, XLAShardedTensor):
            wrapper._declared = global_tensor._declared
        if mesh_shape is not None or partition_spec is not None:
            wrapper._lay_out(mesh_shape, partition_spec, "XLAShardedTensor")
        return wrapper

    def __init__(self, *args, **kwargs) -> None:
        pass  # __new__ did the work

    @classmethod
    def _marked(cls, t: torch.Tensor | XLAShardedTensor, mesh: Mesh, spec: tuple):
        """``t`` (itself when already wrapped) remembering the (mesh, spec) it was just marked
        with, so ``partition_spec`` gives the spec as the caller wrote it."""
        wrapped = t if isinstance(t, XLAShardedTensor) else cls(t)
        wrapped._declared = (mesh, _as_tuple(spec))
        return wrapped

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        """Every torch function (method, operator, attribute such as ``.grad``) runs on the
        wrapped tensors above autograd, so gradients reach ``global_tensor``."""
        return _call_unwrapped(func, args, kwargs or {})

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        """An aten op reaching the wrapper itself (torch functions disabled) runs the same way."""
        return _call_unwrapped(func, args, kwargs or {})

    def __getattr__(self, name: str):
        """The wrapped tensor's own attributes (an xla tensor's engine state, for code that takes
        any tensor on the xla device)."""
        tensor = self.__dict__.get("global_tensor")
        if tensor is None or name.startswith("__"):
            raise AttributeError(f"'XLAShardedTensor' object has no attribute '{name}'")
        return getattr(tensor, name)

    def __repr__(self, *, tensor_contents=None) -> str:
        return f"XLAShardedTensor({self.global_tensor!r})"

    def __reduce_ex__(self, protocol):
        return (XLAShardedTensor, (self.global_tensor,))

    def __deepcopy__(self, memo: dict) -> XLAShardedTensor:
        return XLAShardedTensor(copy.deepcopy(self.global_tensor, memo))

    __hash__ = object.__hash__  # like torch.Tensor: identity, while == is elementwise

    # Not a traceable wrapper subclass, though DTensor is: ``Module.to`` would swap a parameter's
    # DTensor slots (``_spec`` is a property here), and no compiled graph takes it (a graph gets
    # ``global_tensor``).
    __tensor_flatten__ = __tensor_unflatten__ = _Absent()

    @property
    def mesh_shape(self) -> tuple[int, ...] | None:
        """The shape of the mesh the tensor is sharded over; None without a mesh sharding.

        Setting it lays the tensor out over a mesh of that shape, keeping ``partition_spec``
        (as ``wrap_as_sharded_tensor(t, mesh_shape=...)``).

        Example:
            >>> xs.mark_sharding(t, xs.Mesh(np.arange(8), (4, 2)), (0, None)).mesh_shape
            (4, 2)
        """
        sharding = _mesh_sharding(self.global_tensor)
        return None if sharding is None else tuple(sharding.mesh.devices.shape)

    @mesh_shape.setter
    def mesh_shape(self, shape: Sequence[int]) -> None:
        self._lay_out(shape, None, "mesh_shape")

    @property
    def partition_spec(self) -> tuple | None:
        """Per tensor dimension, the mesh axes splitting it (None: not split); None without a
        mesh sharding. The spec as given to ``mark_sharding``/``redistribute`` while it still
        describes the tensor's layout; otherwise read from the layout (axis names for a named
        mesh, indices for an unnamed one).

        Setting it lays the tensor out so over its current mesh.

        Example:
            >>> xs.mark_sharding(t, xs.Mesh(np.arange(8), (4, 2)), (None, 1)).partition_spec
            (None, 1)
        """
        tensor = self.global_tensor
        sharding = _mesh_sharding(tensor)
        if sharding is None:
            return None
        if self._declared is not None and _sharding_of(*self._declared) == sharding:
            return self._declared[1]
        return _spec_of(sharding, tensor.dim(), named=True)

    @partition_spec.setter
    def partition_spec(self, spec: PartitionSpecLike) -> None:
        self._lay_out(None, spec, "partition_spec")

    def _lay_out(self, mesh_shape, spec, api: str) -> None:
        """Lay the tensor out over a mesh of ``mesh_shape`` as ``spec`` says, either one defaulting
        to the current layout's; nothing moves when it is laid out so already."""
        tensor = self.global_tensor
        on_xla(tensor, api)
        current = _mesh_sharding(tensor)
        mesh = _mesh_for(mesh_shape, current, api)
        if spec is None:
            if current is None:
                raise ValueError(
                    f"{api}: the tensor of shape {tuple(tensor.shape)} has no sharding to keep "
                    f"the partition spec of; give partition_spec along with mesh_shape"
                )
            spec = _spec_of(current, tensor.dim(), named=False)
        spec = _as_tuple(spec)
        if _sharding_of(mesh, spec) != current:
            lay_out(tensor, mesh, spec, api)
        self._declared = (mesh, spec)

    @property
    def _spec(self) -> DTensorSpec:
        """The layout as DTensor describes it: a ``DTensorSpec`` of the tensor's ``DeviceMesh``,
        placements and metadata; cached (``_cached_spec``) until the sharding changes or
        :meth:`invalidate_spec_cache`. Raises ValueError for a tensor without a mesh sharding.

        Example:
            >>> xt = distribute_tensor(torch.randn(8, 4), DeviceMesh('xla', range(8)), [Shard(0)])
            >>> xt._spec.placements
            (Shard(dim=0),)
        """
        return self._dtensor_spec("_spec")

    def _dtensor_spec(self, api: str) -> DTensorSpec:
        tensor = self.global_tensor
        sharding = _own_sharding(tensor, api)
        cached = self._cached_spec
        if cached is not None and self._cached_for == (sharding, tensor.shape):
            return cached
        mesh, placements = _dtensor.to_dtensor_layout(sharding, tensor.dim())
        meta = TensorMeta(shape=tensor.shape, stride=tensor.stride(), dtype=tensor.dtype)
        spec = DTensorSpec(mesh=mesh, placements=placements, tensor_meta=meta)
        self._cached_spec, self._cached_for = spec, (sharding, tensor.shape)
        return spec

    def invalidate_spec_cache(self) -> None:
        """Forget the cached ``_spec`` (it is also rebuilt by itself once the sharding changes).

        Example:
            >>> xt.invalidate_spec_cache()
            >>> xt._cached_spec is None
            True
        """
        self._cached_spec = self._cached_for = None

    @property
    def local_shards(self) -> list[XLAShard]:
        """Each device's shard, copied to the host, in device order (computes pending values).

        Example:
            >>> [s.shard_device for s in xt.local_shards][:2]
            ['CPU:0', 'CPU:1']
        """
        return _local_shards(self.global_tensor)

    @property
    def sharding_spec(self) -> str:
        """The sharding as XLA prints it, e.g. ``'{devices=[8,1]0,1,2,3,4,5,6,7}'``.

        Example:
            >>> xs.mark_sharding(t, mesh, (None, None)).sharding_spec
            '{replicated}'
        """
        tiling = annotated_tiling(self.global_tensor, "sharding_spec")
        return "" if tiling is None else tiling.text()

    @property
    def sharding_type(self) -> ShardingType | None:
        """The kind of sharding (TILED, PARTIAL, REPLICATED...); None when unsharded.

        Example:
            >>> xs.mark_sharding(t, mesh, (0, None)).sharding_type
            <ShardingType.TILED: 3>
        """
        tiling = annotated_tiling(self.global_tensor, "sharding_type")
        return None if tiling is None else tiling.type

    def load_local_shards_(self, shards: list[XLAShard]) -> None:
        """Write the given shards (one per device, as :attr:`local_shards` lays them out) into the
        tensor on the devices; its sharding is kept.

        Raises RuntimeError, as PyTorch/XLA does, when a device's shard is missing or of the
        wrong shape, or when the tensor is replicated.

        Args:
            shards: One XLAShard per device, e.g. ``local_shards`` with edited ``data``.

        Example:
            >>> shards = xt.local_shards
            >>> for s in shards:
            ...     s.data *= -1
            >>> xt.load_local_shards_(shards)  # xt is negated
        """
        _load_shards(self.global_tensor, shards)

    @property
    def device_mesh(self) -> DeviceMesh:
        """The tensor's mesh as a ``torch.distributed.DeviceMesh('xla', ...)`` (DTensor's view).

        Device ids and axis names are those of the mesh the tensor was sharded over.

        Example:
            >>> xt = xs.mark_sharding(t, xs.Mesh(np.arange(8), (4, 2), ('x', 'y')), ('x', None))
            >>> xt.device_mesh
            DeviceMesh((x=4, y=2), 'xla', stride=(2, 1))
        """
        return self._dtensor_spec("device_mesh").mesh

    @property
    def placements(self) -> tuple[Placement, ...]:
        """DTensor's description of the sharding: per mesh dimension, ``Shard(d)`` or
        ``Replicate()``. Raises ValueError for a tensor without a sharding of its own.

        Example:
            >>> xt = xs.mark_sharding(t, xs.Mesh(np.arange(8), (4, 2), ('x', 'y')), (None, 'x'))
            >>> xt.placements
            (Shard(dim=1), Replicate())
        """
        try:
            return self._dtensor_spec("placements").placements
        except Unsharded as error:  # PyTorch/XLA's words; ours, naming the tensor, as the cause
            raise ValueError(
                "Placements not available: XLAShardedTensor requires mesh_shape and "
                "partition_spec to be set. Use mark_sharding() to properly initialize sharding "
                "information."
            ) from error

    def redistribute(
        self,
        device_mesh: DeviceMesh | Mesh,
        placements: Sequence[Placement],
        *,
        async_op: bool = False,
    ) -> XLAShardedTensor:
        """Lay the tensor out anew as ``placements`` over ``device_mesh`` say; values unchanged.

        As in PyTorch/XLA 2.9, the tensor itself takes the new sharding (data already on the
        devices moves at once, a pending value is constrained in the graph); with
        ``async_op=True`` a copy of it does and the tensor keeps its own.

        Args:
            device_mesh: A ``DeviceMesh('xla', ...)`` or an ``xs.Mesh`` spanning every device.
            placements: One ``Shard(dim)`` or ``Replicate()`` per mesh dimension.
            async_op: Redistribute a copy, leaving this tensor's sharding as it is.

        Example:
            >>> mesh = DeviceMesh('xla', np.arange(8))
            >>> rows = xt.redistribute(mesh, [Shard(0)])
            >>> rows.sharding_spec
            '{devices=[8,1]0,1,2,3,4,5,6,7}'
        """
        if any(isinstance(p, Partial) for p in placements):
            raise NotImplementedError(
                f"redistribute: Partial placements are not supported ({tuple(placements)}); "
                "use Shard and Replicate"
            )
        mesh = _dtensor.to_xla_mesh(device_mesh, "redistribute")
        tensor = self.global_tensor
        on_xla(tensor, "redistribute")
        _dtensor.check_placement_count(placements, mesh, "redistribute")
        spec = _dtensor.to_partition_spec(tensor.dim(), placements, "redistribute")
        if async_op:
            tensor = tensor.clone()
        modes.ensure_spmd()
        placement.mark(tensor, named_sharding(mesh, spec))
        return XLAShardedTensor._marked(tensor, mesh, spec)

    def full_tensor(self, *, grad_placements=None) -> torch.Tensor:
        """The tensor itself, whole: the global tensor (DTensor's would gather it by
        redistributing this tensor to replicated, which lays it out anew here)."""
        return self.global_tensor

    def to_local(self) -> torch.Tensor:
        """The tensor itself: in the SPMD model a program sees the global tensor, not a shard.

        PyTorch/XLA 2.9 inherits DTensor's ``to_local``, which fails on an XLAShardedTensor; the
        global tensor is what scripts written for it mean (use :attr:`local_shards` for the
        per-device blocks). Gradients flow through it.

        Example:
            >>> xs.mark_sharding(t, mesh, (0, None)).to_local() is t
            True
        """
        return self.global_tensor


# A pickled wrapper (a state dict holding one) is rebuilt by calling the class on its tensor, which
# torch.load's default weights_only unpickler allows for the names registered here.
torch.serialization.add_safe_globals([XLAShardedTensor])


def _local_shards(tensor: torch.Tensor) -> list[XLAShard]:
    """The shards of ``tensor``'s device array as the devices hold them (padding included)."""
    kind = runtime.device_type()
    shards = []
    for device, jax_shard, indices, replica_id in _shard_layout(tensor, "local_shards"):
        shape = tuple(tensor.shape) if indices is Ellipsis else None
        data = to_torch(jax_shard.data, tensor.dtype, shape)
        shards.append(XLAShard(data.contiguous(), indices, f"{kind}:{device}", replica_id))
    return shards


def _shard_layout(tensor: torch.Tensor, api: str) -> list[tuple]:
    """(device, jax shard, indices, replica id) of each device's shard, in device order; indices
    as PyTorch/XLA gives them (Ellipsis when replicated), clipped to the logical shape."""
    on_xla(tensor, api)
    array = execute.global_array(tensor)
    shape = tuple(tensor.shape)
    tiling = tiling_of(array.sharding, len(shape))
    index = device_index()
    replicated = tiling.type in (ShardingType.REPLICATED, ShardingType.MAXIMAL)
    layout = []
    for jax_shard in sorted(array.addressable_shards, key=lambda s: index[s.device.id]):
        device = index[jax_shard.device.id]
        if replicated:
            replica_id = device if tiling.type is ShardingType.REPLICATED else 0
            layout.append((device, jax_shard, Ellipsis, replica_id))
        else:
            indices = [_clipped(s, n, p) for s, n, p in zip(jax_shard.index, shape, array.shape)]
            layout.append((device, jax_shard, indices, tiling.replica_id(device)))
    return layout


def _clipped(s: slice, size: int, padded_size: int) -> slice:
    """A shard's slice of the padded array, clipped to the logical size (empty: all padding)."""
    start = 0 if s.start is None else s.start
    stop = padded_size if s.stop is None else s.stop
    return slice(min(start, size), min(stop, size), 1)


def _load_shards(tensor: torch.Tensor, shards: list[XLAShard]) -> None:
    """Write each device's shard back into ``tensor``; its sharding stays as it is."""
    layout = _shard_layout(tensor, "load_local_shards_")
    if layout[0][2] is Ellipsis:
        raise RuntimeError(
            f"load_local_shards_: the tensor of shape {tuple(tensor.shape)} is replicated; "
            "only a sharded tensor loads shards"
        )
    kind = runtime.device_type()
    expected = {f"{kind}:{device}": indices for device, _, indices, _ in layout}
    given = [s.shard_device for s in shards]
    if sorted(given) != sorted(expected):
        raise RuntimeError(
            f"load_local_shards_ needs one shard per device {sorted(expected)}, got {given}"
        )
    full = torch.empty(tuple(tensor.shape), dtype=tensor.dtype)
    padded = tuple(layout[0][1].data.shape)  # every device's shard, padding included
    for shard in shards:
        indices = expected[shard.shard_device]
        shape = tuple(s.stop - s.start for s in indices)
        if tuple(shard.data.shape) not in (padded, shape):  # with its padding or without
            raise RuntimeError(
                f"load_local_shards_: the shard for {shard.shard_device} has shape "
                f"{tuple(shard.data.shape)}, but that device holds {indices} of a tensor of shape "
                f"{tuple(tensor.shape)}: {padded} with padding, {shape} without"
            )
        full[tuple(indices)] = shard.data[tuple(slice(0, n) for n in shape)]
    with torch.no_grad():
        tensor.copy_(full)


def annotated_tiling(tensor: torch.Tensor, api: str) -> Tiling | None:
    """The tiling of the tensor's sharding; None when it has none of its own.

    As PyTorch/XLA reports them: data that sits on one device, or an upload replicated over
    the devices that no program has written since, has none; a program's output has its layout
    (``{replicated}`` too), and so has a mark or a loader's placement.
    """
    on_xla(tensor, api)
    sharding = placement.sharding_of(tensor)
    if sharding is None or sharding.num_devices == 1 and not isinstance(sharding, NamedSharding):
        return None
    # An upload (or a view, reading data it does not own) lands replicated: a layout, no spec.
    landed = tensor._view is not None or tensor._storage.from_host
    if landed and sharding == transfer.landing():
        return None
    return tiling_of(sharding, tensor.dim())


def lay_out(tensor: torch.Tensor, mesh: Mesh, partition_spec: PartitionSpecLike, api: str) -> None:
    """``mark_sharding``'s work: check the arguments, turn SPMD on if needed, mark the tensor."""
    on_xla(tensor, api)
    check_mesh(mesh)
    validate._check_spec_container(partition_spec)
    validate._check_spec_rank(tuple(tensor.shape), tuple(partition_spec))
    sharding = named_sharding(mesh, partition_spec)
    modes.ensure_spmd()
    placement.mark(tensor, sharding)


def _as_tuple(spec: PartitionSpecLike) -> tuple:
    validate._check_spec_container(spec)
    return tuple(tuple(e) if isinstance(e, list) else e for e in spec)


def _sharding_of(mesh: Mesh, spec: tuple) -> NamedSharding:
    """The sharding ``placement.mark`` would store for (mesh, spec)."""
    return canonical(named_sharding(mesh, spec))


def _mesh_sharding(tensor) -> NamedSharding | None:
    """The tensor's own mesh sharding; None for none, for a sharding without a mesh, or for a
    tensor off the xla device."""
    if not isinstance(tensor, torch.Tensor) or tensor.device.type != "xla":
        return None
    sharding = placement.sharding_of(tensor)
    if not isinstance(sharding, NamedSharding) or sharding == transfer.landing():
        return None
    return sharding


def _xla_mesh(sharding: NamedSharding) -> Mesh:
    """The ``xs.Mesh`` behind a sharding: same device ids, shape and names."""
    jax_mesh = sharding.mesh
    index = device_index()
    ids = [index[d.id] for d in jax_mesh.devices.flat]
    names = tuple(jax_mesh.axis_names)
    unnamed = names == tuple(str(k) for k in range(len(names)))  # Mesh.get_jax_mesh's names
    return Mesh(ids, tuple(jax_mesh.devices.shape), None if unnamed else names)


def _mesh_for(mesh_shape, current: NamedSharding | None, api: str) -> Mesh:
    """The mesh a declared ``mesh_shape`` means: the tensor's own mesh, else the global mesh,
    if of that shape (any shape when None); else the devices in order."""
    candidates = [_xla_mesh(current)] if current is not None else []
    if get_global_mesh() is not None:
        candidates.append(get_global_mesh())
    for mesh in candidates:
        if mesh_shape is None or tuple(mesh.mesh_shape) == tuple(mesh_shape):
            return mesh
    if mesh_shape is None:
        raise ValueError(
            f"{api}: no mesh_shape given, and the tensor has no mesh sharding and no global mesh "
            "is set to take one from"
        )
    return Mesh(np.arange(runtime.global_runtime_device_count()), tuple(mesh_shape))


def _spec_of(sharding: NamedSharding, ndim: int, named: bool) -> tuple:
    """The partition spec of a mesh sharding, one entry per dimension: mesh axis names (when
    ``named`` and the mesh has names) or indices."""
    names = list(sharding.mesh.axis_names)
    unnamed = names == [str(k) for k in range(len(names))]

    def axis(name: str):
        return name if named and not unnamed else names.index(name)

    entries = list(sharding.spec)[:ndim] + [None] * max(0, ndim - len(sharding.spec))
    spec = []
    for entry in entries:
        if entry is None or entry is PartitionSpec.UNCONSTRAINED:
            spec.append(None)
        elif isinstance(entry, str):
            spec.append(axis(entry))
        else:
            axes = tuple(axis(a) for a in entry)
            spec.append(axes[0] if len(axes) == 1 else axes)
    return tuple(spec)


class Unsharded(ValueError):
    """The tensor has no sharding to describe: it is not on the xla device, or not sharded."""


def _own_sharding(tensor: torch.Tensor, api: str) -> NamedSharding:
    """The mesh sharding ``tensor`` was given (marked, distributed, or propagated onto it)."""
    try:
        on_xla(tensor, api)
    except ValueError as error:
        raise Unsharded(str(error)) from None
    sharding = placement.sharding_of(tensor)
    if sharding is None or sharding == transfer.landing():
        raise Unsharded(
            f"{api}: the tensor of shape {tuple(tensor.shape)} has no sharding of its own; "
            "shard it first (xs.mark_sharding or torch.distributed.tensor.distribute_tensor)"
        )
    if not isinstance(sharding, NamedSharding):
        raise ValueError(
            f"{api}: the tensor of shape {tuple(tensor.shape)} has a sharding the partitioner "
            f"chose without a mesh ({sharding}); mark it to give it placements"
        )
    return sharding
