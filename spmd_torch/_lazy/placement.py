"""Where device data lives: one device, or (in SPMD mode) the devices of the mesh, sharded as marked.

Outside SPMD mode every array sits on JAX's default device. ``enable_spmd`` makes uploads land
replicated over all devices and moves any array still on one device onto them the first time a
program uses it (PyTorch/XLA's one-time replication when SPMD starts).

A tensor's sharding belongs to its storage: ``mark`` places data or constrains a pending value,
and the barrier constrains every later value written to that storage the same way, so in-place
updates (parameters, optimizer state) keep their layout and a training loop compiles once. An
output the partitioner sharded on its own keeps that sharding the same way from then on.

Uneven shardings (a dimension not divisible by its mesh axes) are stored padded at the end of each
dimension, as PyTorch/XLA does, because JAX arrays cannot be uneven: the graph keeps the logical
shape, programs slice padded inputs and pad outputs back.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from . import rng, transfer
from .graph import MANUAL_ENTER, MANUAL_EXIT, Aval, Node, linearize
from .tensor import LazyTensor, Storage, wrap, wrap_data

_replicated: NamedSharding | None = None  # over every SPMD device; None outside SPMD mode


def enable_spmd(devices: Sequence[jax.Device]) -> None:
    """Run every later program over ``devices``; new data is replicated over them."""
    global _replicated
    mesh = jax.sharding.Mesh(np.array(list(devices)), ("devices",))
    _replicated = NamedSharding(mesh, PartitionSpec())


def disable_spmd() -> None:
    """Back to one device; the device PRNG key (global state) comes back with it."""
    global _replicated
    words = rng.get_words()
    _replicated = None
    rng.set_words(*words)


def spmd_enabled() -> bool:
    return _replicated is not None


def default_sharding() -> NamedSharding | None:
    """Where uploads land: replicated over the SPMD devices, or JAX's default device."""
    return _replicated


def onto_spmd_devices(leaves: list, arrays: list) -> list:
    """Program inputs with host-held data uploaded and every single-device array replicated
    onto the SPMD devices, once."""
    n = _replicated.num_devices
    for k, array in enumerate(arrays):
        if type(array) is transfer.HostData or array.sharding.num_devices != n:
            node, index = leaves[k]
            arrays[k] = node.arrays[index] = _replicate(array)
    return arrays


def resolve(node: Node, index: int) -> jax.Array:
    """A leaf's device array: host-held data is uploaded (replicated) first."""
    array = node.arrays[index]
    if type(array) is transfer.HostData:
        array = node.arrays[index] = _replicate(array)
    return array


def _replicate(array) -> jax.Array:
    if type(array) is transfer.HostData:
        return transfer.upload(array.host, _replicated)
    return jax.device_put(array, _replicated)


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


def host_padded(host: np.ndarray, sharding) -> np.ndarray:
    """A host array zero-padded to ``sharding``'s even shape (itself when already even)."""
    target = padded_shape(host.shape, sharding)
    if target == host.shape:
        return host
    return np.pad(host, [(0, t - n) for t, n in zip(target, host.shape)])


def output_sharding(storage: Storage, aval: Aval):
    """The sharding the barrier gives ``storage``'s new value (None: the partitioner decides)."""
    sharding = storage.sharding
    if sharding is not None and len(getattr(sharding, "spec", ())) > len(aval.shape):
        return None  # the storage changed rank since it was marked (resize_, set_)
    return sharding


def remember(storage: Storage, array: jax.Array) -> None:
    """Keep the layout the partitioner chose for an output, so the next step reuses it."""
    if storage.sharding is None and array.sharding.num_devices > 1:
        storage.sharding = key_of(array.sharding)


def key_of(sharding):
    """``sharding`` as compile keys see it: replicated over every device is one layout, whichever
    mesh object it names (uploads use ours, program outputs the user's)."""
    if _replicated is not None and sharding.num_devices > 1 and sharding.is_fully_replicated:
        return _replicated
    return sharding


def canonical(sharding: NamedSharding) -> NamedSharding:
    """The form program outputs report (no trailing ``None``), so step N+1 keys equal step N's."""
    entries = list(sharding.spec)
    while entries and entries[-1] is None:
        entries.pop()
    if len(entries) == len(sharding.spec):
        return sharding
    return NamedSharding(sharding.mesh, PartitionSpec(*entries), memory_kind=sharding.memory_kind)


def mark(t: LazyTensor, sharding: NamedSharding) -> None:
    """Give ``t`` this sharding: data moves onto the mesh, a pending value gets a constraint."""
    sharding = canonical(sharding)
    _check_device(t, "mark_sharding")
    node, index = t._ref()
    if t._view is not None and not node.is_leaf(index):
        _constrain(node, index, sharding)  # a pending view: this value only, as in PyTorch/XLA
        return
    storage = t._storage  # its own value, or an identity view (detach) of one: mark the storage
    storage.sharding = sharding
    node, index = storage.ref
    aval = node.avals[index]
    if node.is_leaf(index):
        storage.set((Node.data(_place(node.arrays[index], aval, sharding), aval), 0))
        return
    _constrain(node, index, sharding)


def _constrain(node: Node, index: int, sharding: NamedSharding) -> None:
    shardings = list(node.shardings or (None,) * len(node.avals))
    shardings[index] = sharding
    node.shardings = tuple(shardings)


def clear(t: LazyTensor) -> None:
    """Forget ``t``'s sharding: later values are laid out by the partitioner."""
    _own_storage(t, "clear_sharding").sharding = None


def sharding_of(t: LazyTensor):
    """``t``'s sharding: marked, remembered from its last program, or its upload's; None once
    cleared or while unmarked and pending (a view reports its data's, if it has data)."""
    if t._view is None:
        return t._storage.sharding
    node, index = t._ref()
    return node.arrays[index].sharding if node.is_leaf(index) else None


def global_array(t: LazyTensor) -> jax.Array:
    """``t``'s device array, computed if pending; padded at the end when its sharding is uneven."""
    from .execute import materialize

    (array,) = materialize([t])
    return array


def adopt(array: jax.Array, shape: tuple, dtype, sharding=None) -> LazyTensor:
    """A tensor of logical ``shape`` holding an array ``transfer.to_device_array`` uploaded (a
    loader's prefetch thread may upload; this part touches engine state: main thread only)."""
    t = wrap_data(array, Aval(tuple(shape), dtype))
    if sharding is None:
        remember(t._storage, array)
    else:
        t._storage.sharding = canonical(sharding)
    return t


def enter_manual(t: LazyTensor, sharding: NamedSharding) -> LazyTensor:
    """``t``'s per-device shard under ``sharding``: ops on it run on each device on its own."""
    from . import manual

    manual.USED = True
    aval = Aval(_shard_shape(tuple(t.shape), sharding, "enable_manual_sharding"), t.dtype)
    return wrap((Node(MANUAL_ENTER, (t._ref(),), (sharding,), {}, (aval,)), 0), aval)


def exit_manual(t: LazyTensor, sharding: NamedSharding, full_shape: tuple) -> LazyTensor:
    """The full tensor of ``full_shape`` whose shards are each device's ``t``, laid out so."""
    from . import manual

    ref = t._ref()
    if id(ref[0]) not in manual.local_nodes(linearize([ref])):
        raise manual.ManualShardingError(
            f"disable_manual_sharding on a tensor of shape {tuple(t.shape)} that is not a "
            "per-device shard: call enable_manual_sharding on it first"
        )
    local = _shard_shape(full_shape, sharding, "disable_manual_sharding")
    if tuple(t.shape) != local:
        raise ValueError(
            f"disable_manual_sharding: a shard of full shape {full_shape} under "
            f"{sharding.spec} is {local}, but the tensor has shape {tuple(t.shape)}"
        )
    aval = Aval(tuple(full_shape), t.dtype)
    out = wrap((Node(MANUAL_EXIT, (ref,), (sharding,), {}, (aval,)), 0), aval)
    out._storage.sharding = canonical(sharding)
    return out


def _shard_shape(shape: tuple, sharding: NamedSharding, api: str) -> tuple:
    """Each device's block of ``shape``; manual shards must be even (no padding to hide)."""
    if padded_shape(shape, sharding) != shape:
        raise ValueError(
            f"{api}: shape {shape} does not divide evenly under {sharding.spec} over mesh "
            f"{dict(sharding.mesh.shape)}; manual sharding needs even shards"
        )
    return sharding.shard_shape(shape)


def _check_device(t, api: str) -> None:
    if not isinstance(t, LazyTensor):
        device = getattr(t, "device", type(t).__name__)
        raise ValueError(f"{api} needs a tensor on the xla device, got one on {device}")


def _own_storage(t: LazyTensor, api: str) -> Storage:
    _check_device(t, api)
    if t._view is not None:
        raise ValueError(
            f"{api}: the tensor of shape {tuple(t.shape)} is a view of another tensor; "
            "mark the tensor it views (or a .clone() of the view)"
        )
    return t._storage


def _place(array: jax.Array, aval: Aval, sharding: NamedSharding) -> jax.Array:
    """``array`` laid out with ``sharding``; through the host when the layout needs padding."""
    if type(array) is transfer.HostData:  # never uploaded: each device receives its shard only
        return transfer.upload(array.host, sharding)
    target = padded_shape(aval.shape, sharding)
    if target == array.shape:
        return jax.device_put(array, sharding)
    host = np.asarray(array)[tuple(slice(0, n) for n in aval.shape)]
    return jax.device_put(host_padded(host, sharding), sharding)
