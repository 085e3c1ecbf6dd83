"""Sync-free AdamW."""

from __future__ import annotations

import torch

from .adam import Adam


class AdamW(torch.optim.AdamW):
    """``torch.optim.AdamW`` (same arguments: lr, betas, eps, weight_decay, amsgrad, maximize)
    whose ``step`` takes the GradScaler's ``found_inf`` flag and skips the update on the device
    when it is set, as ``torch_xla.amp.syncfree.AdamW``.

    Example:
        >>> model = torch.nn.Linear(4, 1).to(spmd_torch.device())
        >>> optimizer = AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
        >>> model(torch.ones(2, 4, device=spmd_torch.device())).sum().backward()
        >>> optimizer.step(found_inf=torch.zeros((), device=spmd_torch.device()))
    """

    step = Adam.step  # the same device update: AdamW's decoupled decay is in its param groups
