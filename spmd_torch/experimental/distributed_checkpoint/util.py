"""torch_xla.experimental.distributed_checkpoint.util: ``prime_optimizer``, kept for old scripts."""

from __future__ import annotations

import torch

from spmd_torch import _barrier
from spmd_torch._lazy import placement
from spmd_torch._lazy.tensor import LazyTensor


def prime_optimizer(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """Create ``optimizer``'s state by one step on zero gradients, as PyTorch/XLA requires
    before restoring into it.

    Never needed here: restoring creates missing optimizer state itself. Kept so that scripts
    calling it run unchanged. Like PyTorch/XLA's, it calls ``optimizer.step()``, which may
    change the parameters (weight decay): use it only right before a restore.

    Args:
        optimizer: The optimizer whose state to create.

    Returns:
        ``optimizer``.

    Example:
        >>> prime_optimizer(optim)
        >>> chkpt_mgr.restore(step, {'optim': optim.state_dict()})
    """
    _barrier.barrier()
    for group in optimizer.param_groups:
        for param in group["params"]:
            if param.requires_grad:
                param.grad = torch.zeros_like(param)
                layout = placement.sharding_of(param) if isinstance(param, LazyTensor) else None
                if layout is not None:
                    placement.mark(param.grad, layout)
    optimizer.step()
    _barrier.barrier(wait=True)
    return optimizer
