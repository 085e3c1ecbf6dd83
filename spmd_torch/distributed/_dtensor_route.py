"""The name PyTorch's DTensor API imports for an ``xla`` DeviceMesh, answered at no import cost.

``torch.distributed.tensor.distribute_tensor``/``distribute_module`` run
``from torch_xla.distributed.spmd import xla_distribute_tensor`` for a ``DeviceMesh('xla', ...)``.
``import spmd_torch`` enters a stand-in module under that dotted name (only when no real
torch_xla is installed); the import finds it in ``sys.modules`` without importing its parents, so
``import torch_xla`` still fails, as libraries detecting a real PyTorch/XLA expect. Its first
attribute read loads our sharding package, which then takes the stand-in's place (``enter``, also
reached through ``spmd_torch.distributed.spmd.api.register_dtensor_route``).
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
import types

TORCH_XLA_SPMD = "torch_xla.distributed.spmd"


class _Route(types.ModuleType):
    def __getattr__(self, name: str):
        if name.startswith("__"):  # import machinery probing (__path__, __spec__, ...)
            raise AttributeError(name)
        enter(importlib.import_module("spmd_torch.distributed.spmd"))
        return getattr(sys.modules[TORCH_XLA_SPMD], name)


def enter(package: types.ModuleType) -> bool:
    """Make the sharding package what the DTensor API's import finds; False when a real
    torch_xla is installed (nothing entered then)."""
    if importlib.util.find_spec("torch_xla") is not None:
        return False
    sys.modules[TORCH_XLA_SPMD] = package
    return True


def register() -> None:
    """Enter the stand-in, unless a real torch_xla or an earlier entry is there."""
    if TORCH_XLA_SPMD not in sys.modules and importlib.util.find_spec("torch_xla") is None:
        sys.modules[TORCH_XLA_SPMD] = _Route(TORCH_XLA_SPMD)
