"""Sync-free SGD."""

from __future__ import annotations

from collections.abc import Callable

import torch

from ._functional import checked_flag, grads_of, sgd_step


class SGD(torch.optim.SGD):
    """``torch.optim.SGD`` (same arguments: lr, momentum, dampening, weight_decay, nesterov,
    maximize) whose ``step`` takes the GradScaler's ``found_inf`` flag and skips the update on the
    device when it is set, as ``torch_xla.amp.syncfree.SGD``.

    Example:
        >>> model = torch.nn.Linear(4, 1).to(spmd_torch.device())
        >>> optimizer = SGD(model.parameters(), lr=0.1, momentum=0.9)
        >>> model(torch.ones(2, 4, device=spmd_torch.device())).sum().backward()
        >>> optimizer.step(found_inf=torch.zeros((), device=spmd_torch.device()))  # steps
        >>> optimizer.step(found_inf=torch.ones((), device=spmd_torch.device()))  # skipped
    """

    @torch.no_grad()
    def step(self, closure: Callable | None = None, found_inf: torch.Tensor | None = None):
        """One step; with ``found_inf`` (a 0-dim tensor) nonzero, params and state stay as they
        were. The decision is made on the device: nothing is read back to the host."""
        found_inf = checked_flag(found_inf, "SGD")
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            pairs = grads_of(group, "SGD")
            if pairs:
                sgd_step(group, pairs, [self.state[p] for p, _ in pairs], found_inf)
        return loss
