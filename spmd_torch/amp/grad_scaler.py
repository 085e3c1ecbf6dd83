"""``GradScaler`` for the xla device: loss scaling whose inf/nan check and scale update run on the
device, and which lets a sync-free optimizer skip a step there instead of on the host."""

from __future__ import annotations

import inspect
from typing import Any

import torch

from spmd_torch import _barrier


class GradScaler(torch.amp.GradScaler):
    """``torch.amp.GradScaler('xla')`` that keeps a training step free of host reads, as
    ``torch_xla.amp.GradScaler``.

    ``scale``, ``unscale_`` and ``update`` record device ops only (the inf/nan check of the
    gradients and the growth/backoff of the scale are graph nodes). ``step`` hands the found-inf
    flag to an optimizer whose ``step`` takes ``found_inf`` (``spmd_torch.amp.syncfree``), which
    skips the update on the device; with ``use_zero_grad`` any other optimizer steps with zeroed
    gradients instead of skipping; otherwise the step syncs and reads the flag on the host, as
    ``torch.amp.GradScaler`` does.

    Args:
        init_scale: the initial scale factor.
        growth_factor: multiplies the scale after ``growth_interval`` steps without inf/nan.
        backoff_factor: multiplies the scale after a step with inf/nan gradients.
        growth_interval: clean steps between two growths.
        enabled: ``False`` makes every method a pass-through.
        use_zero_grad: step non-sync-free optimizers with gradients zeroed (and nan/inf replaced)
            on overflow instead of reading the flag on the host. Note that a zero gradient still
            moves parameters under weight decay or momentum.

    Example:
        >>> from spmd_torch.amp import GradScaler, autocast, syncfree
        >>> device = spmd_torch.device()
        >>> model = torch.nn.Linear(8, 2).to(device)
        >>> optimizer = syncfree.SGD(model.parameters(), lr=0.1)
        >>> scaler = GradScaler()
        >>> with autocast(device, dtype=torch.float16):
        ...     loss = model(torch.randn(4, 8, device=device)).float().pow(2).mean()
        >>> scaler.scale(loss).backward()
        >>> scaler.step(optimizer)
        >>> scaler.update()
        >>> spmd_torch.sync()
    """

    def __init__(
        self,
        init_scale: float = 2.0**16,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 2000,
        enabled: bool = True,
        use_zero_grad: bool = False,
    ):
        super().__init__(
            "xla",
            init_scale=init_scale,
            growth_factor=growth_factor,
            backoff_factor=backoff_factor,
            growth_interval=growth_interval,
            enabled=enabled,
        )
        self.use_zero_grad = use_zero_grad

    def _maybe_opt_step(
        self, optimizer: torch.optim.Optimizer, optimizer_state: dict, *args: Any, **kwargs: Any
    ) -> Any:
        found_inf_per_device = optimizer_state["found_inf_per_device"]
        if "found_inf" in inspect.signature(optimizer.step).parameters:
            found_inf = torch.stack(tuple(found_inf_per_device.values())).sum()
            return optimizer.step(*args, found_inf=found_inf, **kwargs)
        if self.use_zero_grad:
            found_inf = torch.stack(tuple(found_inf_per_device.values())).sum()
            keep = (found_inf == 0).to(found_inf.dtype)
            for group in optimizer.param_groups:
                for param in group["params"]:
                    if param.grad is not None:
                        param.grad.nan_to_num_().mul_(keep.to(param.grad.dtype))
            return optimizer.step(*args, **kwargs)
        _barrier.barrier()
        if not sum(v.item() for v in found_inf_per_device.values()):
            return optimizer.step(*args, **kwargs)
        return None
