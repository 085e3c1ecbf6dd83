"""XLAShard and XLAShardedTensor: a sharded tensor's global view and its per-device shards.

Design: PyTorch/XLA's ``XLAShardedTensor`` is a ``torch.Tensor`` wrapper subclass whose ops are
re-dispatched to the wrapped tensor. Here it is a light wrapper, *not* a tensor subclass: the
sharding lives on the wrapped xla tensor itself (its storage, see ``_lazy/placement.py``), so
``xs.mark_sharding(t, ...)`` may drop the return value and keep using ``t``. The wrapper forwards
everything to ``global_tensor``: torch functions through ``__torch_function__`` (arguments are
unwrapped, results are plain tensors), operators through forwarding dunders, and attributes
through ``__getattr__``. Autograd therefore sees the wrapped tensor and gradients reach it.
``isinstance(x, torch.Tensor)`` is False for the wrapper; pass ``x.global_tensor`` where a real
tensor is required (``nn.Parameter``, ``torch.save``).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from types import EllipsisType

import torch
import torch.utils._pytree as pytree

from spmd_torch import runtime
from spmd_torch._lazy import execute
from spmd_torch._lazy.transfer import to_torch

from . import validate
from ._tiling import ShardingType, device_index, tiling_of


@dataclass
class XLAShard:
    """One device's shard of a sharded tensor, copied to the host.

    Attributes:
        data: The shard's values as a CPU tensor, without padding (an uneven sharding pads the
            last shards on device; here they are cut back to the logical shape, so a device
            holding only padding has an empty shard).
        indices: Where the shard lies in the global tensor: a tuple of slices, one per
            dimension, or ``Ellipsis`` when the tensor is replicated (as in PyTorch/XLA).
        shard_device: The device holding it, e.g. ``'CPU:3'`` (``'<device_type>:<id>'``).
        replica_id: Replica within the shard's replication group: 0 for a tiled sharding, the
            position in the group for a partially replicated one, and the device id for a
            replicated one (PyTorch/XLA's convention).

    Example:
        >>> shard = xs.mark_sharding(t, mesh, (0, None)).local_shards[0]
        >>> shard.indices
        (slice(0, 1, None), slice(0, 4, None))
    """

    data: torch.Tensor
    indices: tuple[slice, ...] | EllipsisType
    shard_device: str
    replica_id: int

    @property
    def unpadded_data(self) -> torch.Tensor:
        """``data``: already without padding (PyTorch/XLA's ``data`` keeps the padding)."""
        return self.data


def _unwrap(x):
    return x.global_tensor if isinstance(x, XLAShardedTensor) else x


class XLAShardedTensor:
    """A global xla tensor viewed with its sharding: ``local_shards``, ``sharding_spec``...

    Returned by ``mark_sharding``; wrapping never copies or moves data. It behaves like
    ``global_tensor`` (a light wrapper, not a ``torch.Tensor`` subclass; see the module
    docstring).

    Args:
        global_tensor: A tensor on the xla device (or another XLAShardedTensor).

    Example:
        >>> xt = xs.mark_sharding(torch.arange(8.0, device=dev), xs.get_1d_mesh(), (0,))
        >>> xt.sharding_spec
        '{devices=[8]0,1,2,3,4,5,6,7}'
        >>> (xt * 2).sum().item()
        56.0
    """

    __slots__ = ("global_tensor",)

    global_tensor: torch.Tensor

    def __init__(self, global_tensor: torch.Tensor) -> None:
        object.__setattr__(self, "global_tensor", _unwrap(global_tensor))

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        args, kwargs = pytree.tree_map_only(XLAShardedTensor, _unwrap, (args, kwargs or {}))
        return func(*args, **kwargs)

    def __getattr__(self, name: str):
        if name == "global_tensor":  # not set yet (copy/unpickle): no forwarding loop
            raise AttributeError(name)
        return getattr(self.global_tensor, name)

    def __setattr__(self, name: str, value) -> None:
        if name == "global_tensor":
            object.__setattr__(self, name, _unwrap(value))
        else:
            setattr(self.global_tensor, name, value)

    def __repr__(self) -> str:
        return f"XLAShardedTensor({self.global_tensor!r})"

    def __reduce__(self):
        return (XLAShardedTensor, (self.global_tensor,))

    def __deepcopy__(self, memo: dict) -> XLAShardedTensor:
        return XLAShardedTensor(copy.deepcopy(self.global_tensor, memo))

    __hash__ = object.__hash__  # like torch.Tensor: identity, while == is elementwise

    def __setitem__(self, key, value) -> None:
        self.global_tensor[_unwrap(key)] = _unwrap(value)

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
        from .xla_sharding import get_xla_sharding_spec

        return get_xla_sharding_spec(self.global_tensor)

    @property
    def sharding_type(self) -> ShardingType | None:
        """The kind of sharding (TILED, PARTIAL, REPLICATED...); None when unsharded.

        Example:
            >>> xs.mark_sharding(t, mesh, (0, None)).sharding_type
            <ShardingType.TILED: 3>
        """
        from .xla_sharding import _annotated_tiling

        tiling = _annotated_tiling(self.global_tensor, "sharding_type")
        return None if tiling is None else tiling.type


def _forward(name: str):
    def method(self, *args, **kwargs):
        return getattr(self.global_tensor, name)(*map(_unwrap, args), **kwargs)

    method.__name__ = name
    return method


def _forward_in_place(name: str):
    def method(self, other):
        getattr(self.global_tensor, name)(_unwrap(other))
        return self  # `xt += 1` keeps the wrapper

    method.__name__ = name
    return method


_OPERATORS = (
    "add sub mul matmul truediv floordiv mod pow and or xor lshift rshift "
    "radd rsub rmul rmatmul rtruediv rfloordiv rmod rpow rand ror rxor rlshift rrshift "
    "eq ne lt le gt ge neg pos abs invert getitem len iter bool float int index complex "
    "contains array dlpack dlpack_device format reversed"
).split()
_IN_PLACE = "iadd isub imul imatmul itruediv ifloordiv imod ipow iand ior ixor ilshift irshift"

for _name in (f"__{n}__" for n in _OPERATORS):
    if hasattr(torch.Tensor, _name):
        setattr(XLAShardedTensor, _name, _forward(_name))
for _name in (f"__{n}__" for n in _IN_PLACE.split()):
    if hasattr(torch.Tensor, _name):
        setattr(XLAShardedTensor, _name, _forward_in_place(_name))
del _name


def _local_shards(tensor: torch.Tensor) -> list[XLAShard]:
    """The shards of ``tensor``'s device array, cut back to its logical (unpadded) shape."""
    validate._check_xla_tensor(tensor, "local_shards")
    array = execute.global_array(tensor)
    shape = tuple(tensor.shape)
    tiling = tiling_of(array.sharding, len(shape))
    index = device_index()
    kind = runtime.device_type()
    replicated = tiling.type in (ShardingType.REPLICATED, ShardingType.MAXIMAL)
    shards = []
    for shard in sorted(array.addressable_shards, key=lambda s: index[s.device.id]):
        device = index[shard.device.id]
        if replicated:
            indices = Ellipsis
            data = to_torch(shard.data, tensor.dtype, shape)
            replica_id = device if tiling.type is ShardingType.REPLICATED else 0
        else:
            indices = tuple(
                _clipped(s, n, padded) for s, n, padded in zip(shard.index, shape, array.shape)
            )
            logical = tuple(s.stop - s.start for s in indices)  # the shard without padding
            data = to_torch(shard.data, tensor.dtype, logical)
            replica_id = tiling.replica_id(device)
        shards.append(XLAShard(data.contiguous(), indices, f"{kind}:{device}", replica_id))
    return shards


def _clipped(s: slice, size: int, padded_size: int) -> slice:
    """A shard's slice of the padded array, clipped to the logical size (empty: all padding)."""
    start = 0 if s.start is None else s.start
    stop = padded_size if s.stop is None else s.stop
    return slice(min(start, size), min(stop, size))
