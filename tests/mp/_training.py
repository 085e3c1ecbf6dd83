"""What the replica-training tests share: a small net, each replica's batches, the eager CPU
reference (training on the gradient averaged over the replicas' batches, which DDP, FSDP and
ZeRO-1 all compute) and one replica's training loop."""

from __future__ import annotations

import copy
from collections.abc import Callable

import torch
from torch import nn

import spmd_torch.core.xla_model as xm

STEPS, BATCH = 3, 4


def net() -> nn.Module:
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3))


def batch(step: int, index: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Replica ``index``'s batch at ``step``: every replica trains on different data."""
    generator = torch.Generator().manual_seed(1000 * step + index)
    return torch.randn(BATCH, 6, generator=generator), torch.randn(BATCH, 3, generator=generator)


def averaged_gradient_reference(
    initial: nn.Module, members, make_optimizer: Callable, clip: float | None = None
) -> tuple[torch.Tensor, dict]:
    """Eager CPU training on the gradient averaged over ``members``' batches (its norm clipped
    to ``clip``): (each step's per-member losses, the final state dict)."""
    model = copy.deepcopy(initial)
    optimizer = make_optimizer(model.parameters())
    losses = []
    for step in range(STEPS):
        optimizer.zero_grad()
        batches = (batch(step, i) for i in members)
        per_member = [nn.functional.mse_loss(model(x), y) for x, y in batches]
        torch.stack(per_member).mean().backward()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        optimizer.step()
        losses.append(torch.stack(per_member).detach())
    return torch.stack(losses), dict(model.state_dict())


def train_replica(
    model: nn.Module, optimizer, index: int, after_backward: Callable[[], None] | None = None
) -> torch.Tensor:
    """STEPS on replica ``index``'s batches, a barrier after each: the losses, on the CPU."""
    losses = []
    for step in range(STEPS):
        x, y = (t.to(xm.xla_device()) for t in batch(step, index))
        optimizer.zero_grad()
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        if after_backward is not None:
            after_backward()
        optimizer.step()
        xm.mark_step()
        losses.append(loss.detach())
    return torch.stack(losses).cpu()
