"""spmd_torch: PyTorch/XLA programs on any accelerator JAX reaches, traced lazily, sharding-first."""

from __future__ import annotations

import torch

from . import runtime as _runtime
from ._lazy import device as _device
from ._lazy import execute as _execute
from ._lazy import rng as _rng
from ._lazy.tensor import DEVICE as _DEVICE

_device.register()
if _runtime.is_spmd():  # XLA_USE_SPMD=1 in the environment
    _runtime.use_spmd()

__version__ = "0.1.0"


def device(index: int | None = None) -> torch.device:
    """The xla device (``torch.device('xla:0')``); tensors moved there are traced lazily.

    Example:
        >>> dev = spmd_torch.device()
        >>> x = torch.ones(2, 2, device=dev) * 3
    """
    return torch.device(_DEVICE.type, index or 0)


def devices() -> list[torch.device]:
    """The devices a program addresses: one logical device per process in the SPMD model."""
    return [device()]


def device_count() -> int:
    return 1


def sync(wait: bool = False) -> None:
    """The barrier: compile (once) and dispatch every pending computation; same as mark_step()."""
    _execute.sync(wait=wait)


def manual_seed(seed: int) -> None:
    """Seed the device RNG (``torch.manual_seed`` does this too)."""
    _rng.manual_seed(seed)
