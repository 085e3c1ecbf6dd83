"""The sync-free updates: torch.optim's SGD and Adam/AdamW arithmetic, op for op, on device tensors,
with every write selected against the old value by the scaler's found-inf flag (a skipped step
leaves parameters, moments and the step counter as they were, and nothing is read on the host)."""

from __future__ import annotations

import torch


def skip_flag(found_inf: torch.Tensor | None, optimizer: str) -> torch.Tensor | None:
    """``found_inf != 0`` as a 0-dim bool tensor (None when no flag was given), validated."""
    if found_inf is None:
        return None
    if not isinstance(found_inf, torch.Tensor) or found_inf.dim() != 0:
        shape = tuple(found_inf.shape) if isinstance(found_inf, torch.Tensor) else None
        raise ValueError(
            f"{optimizer}.step: found_inf must be a 0-dim tensor (the GradScaler's flag), got "
            f"{type(found_inf).__name__} of shape {shape}"
        )
    return found_inf != 0


def _keep_or_write(target: torch.Tensor, new: torch.Tensor, skip: torch.Tensor | None) -> None:
    target.copy_(new if skip is None else torch.where(skip, target, new))


def grads_of(group: dict, optimizer: str) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(param, grad) pairs of a param group's params that have a gradient."""
    pairs = []
    for param in group["params"]:
        if param.grad is None:
            continue
        if param.grad.is_sparse:
            raise RuntimeError(f"{optimizer} does not support sparse gradients")
        pairs.append((param, param.grad))
    return pairs


def next_step(state: dict, param: torch.Tensor, skip: torch.Tensor | None) -> torch.Tensor:
    """The step counter's value after this step (a float32 device tensor, as PyTorch/XLA keeps
    it), written to ``state['step']``; the number the update uses is the old one plus one. A
    counter loaded from a torch.optim state dict (a CPU tensor) moves to the device once."""
    step = state.get("step")
    if step is None:
        step = torch.zeros((), dtype=torch.float32, device=param.device)
    elif step.device != param.device:
        step = step.to(param.device, torch.float32)
    state["step"] = step
    advanced = step + 1
    _keep_or_write(step, advanced, skip)
    return advanced


def sgd_update(
    param: torch.Tensor,
    grad: torch.Tensor,
    state: dict,
    skip: torch.Tensor | None,
    *,
    lr: float,
    momentum: float,
    dampening: float,
    weight_decay: float,
    nesterov: bool,
    maximize: bool,
) -> None:
    """One parameter's SGD step, as torch.optim.SGD's single-tensor loop computes it."""
    buffer = state.get("momentum_buffer")
    if momentum != 0 and buffer is None:
        state["momentum_buffer"] = torch.zeros_like(param)
        state.pop("step", None)  # the buffer starts at the grad of the step counted 1
    elif buffer is not None and "step" not in state:  # a torch.optim.SGD state: already started
        state["step"] = torch.ones((), dtype=torch.float32, device=param.device)
    step = next_step(state, param, skip)
    direction = -grad if maximize else grad
    if weight_decay != 0:
        direction = direction.add(param, alpha=weight_decay)
    if momentum != 0:
        buf = state["momentum_buffer"]
        accumulated = buf.mul(momentum).add(direction, alpha=1 - dampening)
        new_buf = torch.where(step == 1, direction, accumulated)  # torch starts it at the grad
        _keep_or_write(buf, new_buf, skip)
        direction = direction.add(new_buf, alpha=momentum) if nesterov else new_buf
    _keep_or_write(param, param.add(direction, alpha=-lr), skip)


def adam_update(
    param: torch.Tensor,
    grad: torch.Tensor,
    state: dict,
    skip: torch.Tensor | None,
    *,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    amsgrad: bool,
    maximize: bool,
    decoupled: bool,
) -> None:
    """One parameter's Adam (``decoupled``: AdamW) step, as torch.optim.Adam's single-tensor loop
    computes it; the bias corrections in float64, as torch computes them in Python."""
    if "exp_avg" not in state:
        state["exp_avg"] = torch.zeros_like(param)
        state["exp_avg_sq"] = torch.zeros_like(param)
        if amsgrad:
            state["max_exp_avg_sq"] = torch.zeros_like(param)
    step = next_step(state, param, skip).double()
    grad = -grad if maximize else grad
    new_param = param
    if weight_decay != 0:
        if decoupled:
            new_param = param.mul(1 - lr * weight_decay)
        else:
            grad = grad.add(param, alpha=weight_decay)
    exp_avg, exp_avg_sq = state["exp_avg"], state["exp_avg_sq"]
    new_exp_avg = exp_avg.lerp(grad, 1 - beta1)
    new_exp_avg_sq = exp_avg_sq.mul(beta2).addcmul(grad, grad, value=1 - beta2)
    _keep_or_write(exp_avg, new_exp_avg, skip)
    _keep_or_write(exp_avg_sq, new_exp_avg_sq, skip)
    step_size = (lr / (1 - beta1**step)).to(param.dtype)
    bias_correction2_sqrt = (1 - beta2**step).sqrt().to(param.dtype)
    second_moment = new_exp_avg_sq
    if amsgrad:
        second_moment = torch.maximum(state["max_exp_avg_sq"], new_exp_avg_sq)
        _keep_or_write(state["max_exp_avg_sq"], second_moment, skip)
    denom = (second_moment.sqrt() / bias_correction2_sqrt).add(eps)
    _keep_or_write(param, new_param - step_size * (new_exp_avg / denom), skip)
