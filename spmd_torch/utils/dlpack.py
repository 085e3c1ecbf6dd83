"""torch_xla.utils.dlpack: xla tensors to and from DLPack, through JAX's own DLPack support.

``to_dlpack`` computes the tensor and hands out its device buffer (no copy); ``from_dlpack``
takes any DLPack producer (a CPU or CUDA torch tensor, a NumPy or CuPy array, a capsule) on a
device JAX addresses and makes it an xla tensor. Unlike PyTorch/XLA, CUDA producers are accepted
when JAX runs on that GPU. As with any DLPack import, the xla tensor reads the producer's memory
(where JAX can alias it) until the tensor is first written; writes to it never reach the producer.

Example:
    >>> t = xdlpack.from_dlpack(torch.arange(4))   # an xla tensor
    >>> back = torch.utils.dlpack.from_dlpack(xdlpack.to_dlpack(t))   # a CPU tensor on CPU JAX
"""

from __future__ import annotations

from typing import Any

import jax
import torch

from spmd_torch._lazy import execute, placement, transfer
from spmd_torch._lazy.lowering.dtypes import to_torch_dtype
from spmd_torch._lazy.tensor import on_xla

__all__ = ["from_dlpack", "to_dlpack"]


def to_dlpack(xla_tensor: torch.Tensor) -> Any:
    """A DLPack capsule of ``xla_tensor``'s value (computed first), on its one device.

    Raises:
        ValueError: the tensor is not on the xla device, or is laid out over several devices
            (a DLPack tensor is one buffer on one device).

    Example:
        >>> capsule = xdlpack.to_dlpack(torch.ones(3, device='xla'))
    """
    on_xla(xla_tensor, "to_dlpack")
    array = placement.logical(execute.materialize([xla_tensor])[0], tuple(xla_tensor.shape))
    devices = array.sharding.device_set
    if len(devices) != 1:
        raise ValueError(
            f"to_dlpack: the tensor of shape {tuple(xla_tensor.shape)} is laid out over "
            f"{len(devices)} devices; DLPack describes one buffer on one device (gather it first)"
        )
    return array.__dlpack__()


def from_dlpack(ext_tensor: Any) -> torch.Tensor:
    """An xla tensor holding a DLPack producer's value (an object with ``__dlpack__``, or a
    capsule from ``to_dlpack``/``torch.utils.dlpack.to_dlpack``).

    Example:
        >>> t = xdlpack.from_dlpack(np.arange(6.0).reshape(2, 3))
    """
    if not hasattr(ext_tensor, "__dlpack__"):  # a bare capsule: torch reads it, JAX takes that
        ext_tensor = torch.utils.dlpack.from_dlpack(ext_tensor)
    array = jax.dlpack.from_dlpack(ext_tensor)
    landing = transfer.landing()
    if landing is not None and array.sharding != landing:
        array = jax.device_put(array, landing)
    return placement.adopt(array, tuple(array.shape), to_torch_dtype(array.dtype))
