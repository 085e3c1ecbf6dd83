"""torch_xla._internal.jax_workarounds: importing JAX next to the runtime.

PyTorch/XLA runs its own PJRT client, so JAX must not claim the TPU first; these helpers start
that client before JAX is imported. Here JAX is the runtime itself: there is no second client to
start, so the guard has nothing to do, and code written for PyTorch/XLA (its tests, libraries
calling ``xb.call_jax``) runs unchanged.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
from collections.abc import Callable, Iterator
from types import ModuleType
from typing import Any

import jax

__all__ = [
    "jax_env_context",
    "jax_import_guard",
    "maybe_get_jax",
    "maybe_get_torchax",
    "requires_jax",
]


def jax_import_guard() -> None:
    """Nothing to start: JAX is spmd_torch's runtime."""


def requires_jax(func: Callable) -> Callable:
    """``func`` itself (JAX is always importable here), wrapped so its name and docs stay."""

    @functools.wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        return func(*args, **kwargs)

    return wrapper


@contextlib.contextmanager
def jax_env_context() -> Iterator[None]:
    """No variables to set around JAX's import (PyTorch/XLA's are for its MegaScale client)."""
    yield


def maybe_get_jax(log: bool = True) -> ModuleType:
    """The ``jax`` module (a dependency of spmd_torch, so never missing)."""
    return jax


def maybe_get_torchax() -> ModuleType | None:
    """The ``torchax`` package when it is installed, else None."""
    try:
        return importlib.import_module("torchax")
    except ImportError:
        return None
