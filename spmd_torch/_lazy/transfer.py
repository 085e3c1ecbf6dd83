"""Moving data between CPU torch tensors and device arrays, timed and counted as PyTorch/XLA does."""

from __future__ import annotations

import weakref
from typing import NamedTuple

import jax
import ml_dtypes
import numpy as np
import torch
from jax.experimental import multihost_utils

from . import counters
from .engine import current, refuse_in_bad_fork
from .layout import crop, padded
from .lowering.dtypes import to_jax_dtype


def to_device_array(t: torch.Tensor, sharding=None) -> jax.Array:
    """Upload a CPU tensor as the device dtype (bf16 switches applied), padded if ``sharding``
    is uneven; by default where placement says new data lands."""
    return upload(host_copy(t), sharding)


def upload_part(t: torch.Tensor, sharding) -> jax.Array:
    """This host's part of a global batch, as its devices' shards of the global array laid out
    with ``sharding``: every host passes its own part, and the parts lie side by side along the
    dimensions split across hosts (``jax.make_array_from_process_local_data``)."""
    host = host_copy(t)
    refuse_in_bad_fork("an upload to the xla device")
    with counters.timed("TransferToDeviceTime"):
        array = jax.make_array_from_process_local_data(sharding, host)
    counters.bump("TransferToDevice")
    counters.record("OutboundData", host.nbytes)
    return array


def host_copy(t: torch.Tensor) -> np.ndarray:
    """A CPU tensor's values in the device dtype, in memory we own (JAX's CPU backend may alias
    host memory, which the tensor may mutate)."""
    return _to_numpy(t.detach()).astype(to_jax_dtype(t.dtype), copy=True)


def host_array(t: torch.Tensor) -> np.ndarray:
    """A CPU tensor's values in its own dtype (no bf16 switch), in memory we own."""
    return np.array(_to_numpy(t.detach()), copy=True)


def upload(host: np.ndarray, sharding=None) -> jax.Array:
    """A host array on the device, laid out with ``sharding`` (padded if uneven; stacked on a
    replica's device for ``OnReplica``); by default where the engine puts new data."""
    with counters.timed("TransferToDeviceTime"):
        array = _placed(host, sharding)
    counters.bump("TransferToDevice")
    counters.record("OutboundData", host.nbytes)
    return array


def constant(aval, value, sharding=None) -> jax.Array:
    """A tensor of ``aval``'s shape and dtype holding ``value`` everywhere, made on the host and
    placed as an upload is: a first step's fills (AdamW's moments) cost a copy each, where a
    program of a few hundred fills took longer to compile than their bytes take to copy. Counted
    apart from transfers: the user's program moved no data."""
    dtype = to_jax_dtype(aval.dtype)
    host = np.zeros(aval.shape, dtype) if value == 0 else np.full(aval.shape, value, dtype)
    counters.bump("ConstantFilledOnHost")
    return _placed(host, sharding)


def _placed(host: np.ndarray, sharding) -> jax.Array:
    refuse_in_bad_fork("an upload to the xla device")
    sharding = sharding or landing()
    if type(sharding) is OnReplica:
        return jax.device_put(host[None], sharding.device)
    if sharding is None:
        return jax.device_put(host)
    host = padded(host, sharding)
    if sharding.is_fully_addressable:
        return jax.device_put(host, sharding)
    # other hosts hold the same value and upload their devices' shards of it
    return jax.make_array_from_callback(host.shape, sharding, host.__getitem__)


def landing(device: int = 0):
    """Where the calling thread's engine puts new data on xla:``device`` (its mode says): a
    replica's device, replicated over the SPMD devices, or (None) JAX's default device."""
    return current().mode.landing_on(device)


class OnReplica(NamedTuple):
    """A replica's device: its arrays are stacked, with a leading axis of 1, so that the replicas'
    arrays together form one array over the replicas' mesh (replicas.py)."""

    device: jax.Device


class ReplicaShard:
    """Replica ``position``'s block of an array stacked over a mesh of replicas: a program output
    read lazily, so that the next program takes the stacked array back whole."""

    __slots__ = ("stacked", "position", "__weakref__")

    def __init__(self, stacked: jax.Array, position: int):
        self.stacked = stacked
        self.position = position

    def local(self) -> jax.Array:
        """The block on the replica's own device, shape (1, *logical shape)."""
        return self.stacked.addressable_data(self.position)

    def block_until_ready(self) -> ReplicaShard:
        self.stacked.block_until_ready()
        return self

    def is_deleted(self) -> bool:
        return self.stacked.is_deleted()

    def is_ready(self) -> bool:
        return self.stacked.is_ready()


# Nodes of host-held SPMD data that the first op reading them uploads (replicated), as PyTorch/XLA's
# virtual device does: filled under the ``torch_xla`` face only. spmd_torch's own data waits for
# the program or a ``mark_sharding`` (which then uploads only each device's shard).
UPLOAD_WHEN_READ: weakref.WeakSet = weakref.WeakSet()


def upload_read(sources: list) -> None:
    """Upload the host-held data among an op's ``sources`` that waits for its first read."""
    for node, index in sources:
        if node in UPLOAD_WHEN_READ:
            UPLOAD_WHEN_READ.discard(node)
            data = node.arrays[index]
            if type(data) is HostData:
                node.arrays[index] = upload(data.host, data.sharding)


class HostData:
    """Data moved to the device in SPMD mode, still on the host: the first program uploads it
    replicated (``sharding``), or ``mark_sharding`` uploads it straight into its layout (no full
    copy per device)."""

    __slots__ = ("host", "sharding")

    def __init__(self, host: np.ndarray, sharding):
        self.host = host
        self.sharding = sharding

    def __array__(self, dtype=None, copy=None) -> np.ndarray:
        return self.host


# The data of the live placeholder tensors: while any lives, a read checks that it needs none.
PLACEHOLDERS: weakref.WeakSet = weakref.WeakSet()


class Placeholder:
    """The data of a placeholder tensor (``xla_builder.create_placeholder_tensor``): a shape and a
    dtype, no device buffer. Graphs are traced on it and lowered (their HLO staged out), never
    run; like a donated buffer it reads as deleted (``_XLAC._is_placecholder``)."""

    __slots__ = ("shape", "dtype", "sharding", "logical", "__weakref__")

    def __init__(self, shape: tuple, dtype: np.dtype, sharding=None, logical: tuple = ()):
        self.shape = shape  # as the device would hold it: padded to an uneven sharding's
        self.dtype = dtype
        self.sharding = sharding  # a mark_sharding's: the staged-out graph's input layout
        self.logical = logical or shape
        PLACEHOLDERS.add(self)

    def is_deleted(self) -> bool:
        return True

    def __array__(self, dtype=None, copy=None) -> np.ndarray:
        raise RuntimeError(self.unreadable())

    def unreadable(self) -> str:
        """Why no program can read it."""
        return (
            f"a placeholder tensor of shape {list(self.logical)} and dtype {self.dtype} holds no "
            "data (xla_builder.create_placeholder_tensor): trace with it and read the graph's "
            "HLO (_get_xla_tensors_hlo, LoweringContext), but no program can read its value"
        )


def fetch(array: jax.Array) -> np.ndarray:
    """The array's values on this host (waits for them); an array spanning other hosts' devices
    is gathered from them, so every host must read it, as in PyTorch/XLA."""
    sharding = getattr(array, "sharding", None)  # a host array (a read checkpoint's) has none
    if sharding is not None:
        refuse_in_bad_fork("a read of an xla tensor")
    if sharding is not None and not sharding.is_fully_replicated:
        counters.bump("ReplicateShardedData")  # its shards assembled into one value, as PyTorch/XLA
    if getattr(array, "is_fully_addressable", True) or array.is_fully_replicated:
        return np.asarray(array)
    return np.asarray(multihost_utils.process_allgather(array, tiled=True))


def to_torch(array: jax.Array, dtype: torch.dtype, shape: tuple | None = None) -> torch.Tensor:
    """Download an array as a CPU tensor of PyTorch ``dtype`` (waits for it to be computed);
    ``shape`` is the logical shape of an array stored padded."""
    with counters.timed("TransferFromDeviceTime"):
        try:
            host = fetch(array)
        except RuntimeError as error:
            raise_if_given_up(error)
            raise
        counters.record("InboundData", host.nbytes)  # bytes, as PyTorch/XLA counts them
        if shape is not None:
            host = crop(host, shape)
        bits = _AS_BITS.get(dtype)
        if bits is not None:  # numpy has no such dtype: its bits travel as unsigned ints
            unsigned, ml_type = bits
            out = torch.from_numpy(host.astype(ml_type).view(np.dtype(unsigned)).copy())
            out = out.view(dtype)
        else:
            if host.dtype.type in _ML_DTYPES:
                host = host.astype(np.float32)
            out = torch.from_numpy(np.array(host, copy=True)).to(dtype)
    counters.bump("TransferFromDevice")
    return out


def raise_if_given_up(error: RuntimeError) -> None:
    """Raise JAX's error for an array whose buffer a program took again, with the reason (any
    other error: return): a live tensor's data is given up only when its user donates it (the
    engine donates only values no tensor holds)."""
    if "has been deleted" in str(error):
        raise RuntimeError(
            f"{error} A tensor's device buffer went to an earlier program, donated with "
            "_XLAC._set_buffer_donation: the tensor holds no data any more (_is_placecholder)"
        ) from error


# PyTorch's floating dtypes numpy lacks -> (their bits' unsigned int, ml_dtypes' type)
_AS_BITS = {
    torch.bfloat16: (np.uint16, ml_dtypes.bfloat16),
    torch.float8_e5m2: (np.uint8, ml_dtypes.float8_e5m2),
    torch.float8_e4m3fn: (np.uint8, ml_dtypes.float8_e4m3fn),
}
_TORCH_UNSIGNED = {np.uint16: torch.uint16, np.uint8: torch.uint8}
_ML_DTYPES = {np.dtype(ml_type).type for _, ml_type in _AS_BITS.values()}


def _to_numpy(t: torch.Tensor) -> np.ndarray:
    bits = _AS_BITS.get(t.dtype)
    if bits is not None:
        unsigned, ml_type = bits
        return t.contiguous().view(_TORCH_UNSIGNED[unsigned]).numpy().view(ml_type)
    return t.contiguous().numpy()
