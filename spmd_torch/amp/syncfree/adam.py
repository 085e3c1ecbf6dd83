"""Sync-free Adam."""

from __future__ import annotations

from collections.abc import Callable

import torch

from ._functional import adam_step, checked_flag, grads_of


def _adam_step(optimizer: torch.optim.Optimizer, found_inf: torch.Tensor | None) -> None:
    """Every param group's Adam/AdamW update, skipped on the device where ``found_inf`` is set."""
    name = type(optimizer).__name__
    found_inf = checked_flag(found_inf, name)
    for group in optimizer.param_groups:
        pairs = grads_of(group, name)
        if pairs:
            adam_step(group, pairs, [optimizer.state[p] for p, _ in pairs], found_inf)


class Adam(torch.optim.Adam):
    """``torch.optim.Adam`` (same arguments: lr, betas, eps, weight_decay, amsgrad, maximize,
    decoupled_weight_decay) whose ``step`` takes the GradScaler's ``found_inf`` flag and skips the
    update on the device when it is set, as ``torch_xla.amp.syncfree.Adam``.

    Example:
        >>> model = torch.nn.Linear(4, 1).to(spmd_torch.device())
        >>> optimizer = Adam(model.parameters(), lr=1e-3)
        >>> model(torch.ones(2, 4, device=spmd_torch.device())).sum().backward()
        >>> optimizer.step(found_inf=torch.zeros((), device=spmd_torch.device()))
    """

    @torch.no_grad()
    def step(self, closure: Callable | None = None, found_inf: torch.Tensor | None = None):
        """One step; with ``found_inf`` (a 0-dim tensor) nonzero, params and state stay as they
        were. The decision is made on the device: nothing is read back to the host."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        _adam_step(self, found_inf)
        return loss
