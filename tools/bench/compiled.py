"""spmd_compile: the spmd_torch implementation with its training step under ``torch.compile``.

The step (forward, loss, backward, optimizer step) is ``torch.compile(step,
backend='spmd_torch')`` on the xla device, as PyTorch/XLA's dynamo guide writes it; Dynamo breaks
the graph at ``backward()`` and around ``optimizer.step()``, so a step calls three compiled graphs,
and ``spmd_torch.sync()`` after it runs them as one program. It is opt-in: it runs only where ``--impls`` names it (e.g.
``--impls eager,jax,spmd_torch,spmd_compile``), while the backend is new. Where no backend of
that name is registered, its child fails before its first step, naming the backend, and the
parent reports that child's error like any other. ``--compile-backend NAME`` selects another
registered name: ``openxla``, PyTorch/XLA's, is torch's own entry, which imports ``torch_xla``
(found only under spmd_torch's torch_xla shim).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from torch import nn

from . import harness
from .harness import Trainer
from .models import (
    gpt_data,
    gpt_loss,
    mlp_data,
    mlp_loss,
    new_adamw,
    new_gpt,
    new_mlp,
    new_sgd,
)
from .training import spmd_trainer

BACKEND = "spmd_torch"


def check_backend(backend: str) -> None:
    """Refuse up front (one clear error line for the parent) a backend name that is not
    registered once spmd_torch is imported."""
    import torch._dynamo

    import spmd_torch  # noqa: F401  (registers spmd_torch's backends before the lookup)

    if backend not in torch._dynamo.list_backends(exclude_tags=()):
        raise RuntimeError(
            f"spmd_compile: no torch.compile backend {backend!r} registered after importing "
            f"spmd_torch (registered: {', '.join(torch._dynamo.list_backends())}, and debug ones)"
        )


def trainer(
    model: nn.Module,
    opt_fn: Callable,
    loss_fn: Callable,
    data: tuple[np.ndarray, ...],
    backend: str,
    autocast_dtype: torch.dtype | None = None,
) -> Trainer:
    """spmd_trainer with its step compiled by `backend`."""
    check_backend(backend)
    return spmd_trainer(
        model, opt_fn, loss_fn, data, autocast_dtype=autocast_dtype, compile_backend=backend
    )


def run(
    warmup: int,
    steps: int,
    check: bool,
    model: nn.Module,
    opt_fn: Callable,
    loss_fn: Callable,
    data: tuple[np.ndarray, ...],
    backend: str,
    autocast_dtype: torch.dtype | None = None,
) -> dict[str, Any]:
    """One spmd_compile run, with the CPU fallbacks of its steps counted."""
    import spmd_torch

    tr = trainer(model, opt_fn, loss_fn, data, backend, autocast_dtype)
    result = harness.run_counting_fallbacks(tr, warmup, steps, check)
    return {**result, "device": str(spmd_torch.device()), "compile_backend": backend}


def w2_spmd_compile(
    warmup: int, steps: int, check: bool, gpu: bool, backend: str = BACKEND
) -> dict[str, Any]:
    return run(warmup, steps, check, new_mlp(), new_sgd, mlp_loss, mlp_data(), backend)


def w3_spmd_compile(
    warmup: int, steps: int, check: bool, gpu: bool, backend: str = BACKEND
) -> dict[str, Any]:
    return run(warmup, steps, check, new_gpt(), new_adamw, gpt_loss, gpt_data(), backend)
