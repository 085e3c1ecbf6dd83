"""The ``xla`` device: PyTorch's PrivateUse1 backend renamed, with a Python device guard.

We do the steps of ``torch.utils.backend_registration._setup_privateuseone_for_python_backend``
ourselves, skipping its generated ``Tensor.is_xla``-style methods (that name is PyTorch's own).
Factory calls (``torch.empty(..., device='xla')``) reach the PrivateUse1 key with no tensor
argument; one fallback kernel sends them to the same dispatcher as every other op.
"""

from __future__ import annotations

import torch

from . import rng
from .tensor import DEVICE


class _BackendModule:
    """What ``torch.xla`` answers: one logical device; seeding reaches the device PRNG."""

    @staticmethod
    def is_available() -> bool:
        return True

    @staticmethod
    def is_initialized() -> bool:
        return True

    @staticmethod
    def current_device() -> int:
        return 0

    @staticmethod
    def device_count() -> int:
        return 1

    @staticmethod
    def _is_in_bad_fork() -> bool:
        return False

    @staticmethod
    def manual_seed_all(seed: int) -> None:
        rng.manual_seed(seed)

    manual_seed = manual_seed_all


class _Hooks(torch._C._acc.PrivateUse1Hooks):
    def is_available(self) -> bool:
        return True

    def has_primary_context(self, device_index) -> bool:
        return True

    def is_built(self) -> bool:
        return True


class _DeviceGuard(torch._C._acc.DeviceGuard):
    def type_(self):
        return torch._C._autograd.DeviceType.PrivateUse1


def _factory_kernel(op, *args, **kwargs):
    from .dispatch import dispatch

    return dispatch(op, args, kwargs)


_registered: list = []


def register() -> None:
    """Make ``torch.device('xla')`` our lazy device; idempotent."""
    if _registered:
        return
    if torch._C._get_privateuse1_backend_name() != DEVICE.type:
        torch.utils.rename_privateuse1_backend(DEVICE.type)
    torch._register_device_module(DEVICE.type, _BackendModule())
    torch._C._acc.register_python_privateuseone_hook(_Hooks())
    torch._C._acc.register_python_privateuseone_device_guard(_DeviceGuard())
    library = torch.library.Library("_", "IMPL")
    library.fallback(_factory_kernel, "PrivateUse1")
    _registered.append(library)
