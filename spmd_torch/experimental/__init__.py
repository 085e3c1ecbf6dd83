"""torch_xla.experimental on JAX: APIs PyTorch/XLA still calls experimental (SPMD FSDP, eager mode...)."""

from __future__ import annotations

import warnings
from collections.abc import Callable

from spmd_torch import _regions

from . import callback
from .eager_mode import eager_mode, eager_mode_context, is_eager_mode

__all__ = ["callback", "compile", "eager_mode", "eager_mode_context", "is_eager_mode"]


def compile(func: Callable) -> Callable:
    """Deprecated in PyTorch/XLA too: :func:`spmd_torch.compile` under its older name.

    Example:
        >>> step = spmd_torch.experimental.compile(step_fn)
    """
    warnings.warn(
        "spmd_torch.experimental.compile is deprecated; use spmd_torch.compile",
        DeprecationWarning,
        stacklevel=2,
    )
    return _regions.compile(func)
