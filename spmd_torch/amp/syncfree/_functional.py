"""The sync-free updates: torch.optim's SGD and Adam/AdamW steps as their fused kernels (one node
per param group), with every write selected against the old value by the scaler's found-inf flag
(a skipped step leaves parameters, moments and the step counter as they were, and nothing is read
on the host)."""

from __future__ import annotations

import torch


def checked_flag(found_inf: torch.Tensor | None, optimizer: str) -> torch.Tensor | None:
    """The GradScaler's flag (None when none was given), validated: a 0-dim tensor."""
    if found_inf is None:
        return None
    if not isinstance(found_inf, torch.Tensor) or found_inf.dim() != 0:
        shape = tuple(found_inf.shape) if isinstance(found_inf, torch.Tensor) else None
        raise ValueError(
            f"{optimizer}.step: found_inf must be a 0-dim tensor (the GradScaler's flag), got "
            f"{type(found_inf).__name__} of shape {shape}"
        )
    return found_inf


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


def _steps(states: list, params: list, started: bool) -> list[torch.Tensor]:
    """Each parameter's step counter, a float32 device tensor as PyTorch/XLA keeps it (one loaded
    from a torch.optim state dict, a CPU tensor, moves to the device once; ``started``: a
    torch.optim.SGD state with a momentum buffer has taken its first step)."""
    steps = []
    for state, param in zip(states, params):
        step = state.get("step")
        if step is None:
            step = torch.full((), float(started), dtype=torch.float32, device=param.device)
        elif step.device != param.device:
            step = step.to(param.device, torch.float32)
        state["step"] = step
        steps.append(step)
    return steps


def _uncounted(steps: list, found_inf: torch.Tensor | None) -> None:
    """Take a skipped step's count back, on the device (torch.optim's fused path does too)."""
    if found_inf is not None:
        torch._foreach_sub_(steps, [found_inf.to(torch.float32)] * len(steps))


def sgd_step(group: dict, pairs: list, states: list, found_inf: torch.Tensor | None) -> None:
    """One param group's SGD step as torch.optim.SGD computes it: one fused node for every
    parameter (``_fused_sgd_``), the counters two foreach nodes. A momentum buffer starts at the
    first step's gradient; a skipped first step starts it from the next one's, as torch.optim's
    fused SGD with a GradScaler does (equal to the unfused start unless dampening is set)."""
    params, grads = [p for p, _ in pairs], [g for _, g in pairs]
    momentum = group["momentum"]
    first = momentum != 0 and any("momentum_buffer" not in state for state in states)
    for state, param in zip(states, params):
        if momentum != 0 and "momentum_buffer" not in state:
            state["momentum_buffer"] = torch.zeros_like(param)
    steps = _steps(states, params, started=not first and momentum != 0)
    torch._foreach_add_(steps, 1)  # the fused step reads them advanced, as torch.optim's does
    torch._fused_sgd_(
        params,
        grads,
        [state["momentum_buffer"] for state in states] if momentum != 0 else [],
        weight_decay=group["weight_decay"],
        momentum=momentum,
        lr=group["lr"],
        dampening=group["dampening"],
        nesterov=group["nesterov"],
        maximize=group["maximize"],
        is_first_step=first,
        found_inf=found_inf,
    )
    _uncounted(steps, found_inf)


def adam_step(group: dict, pairs: list, states: list, found_inf: torch.Tensor | None) -> None:
    """One param group's Adam (AdamW with decoupled weight decay) step as torch.optim computes
    it: one fused node for every parameter (``_fused_adam_``/``_fused_adamw_``), the counters two
    foreach nodes; the bias corrections in float64."""
    params, grads = [p for p, _ in pairs], [g for _, g in pairs]
    amsgrad = group["amsgrad"]
    for state, param in zip(states, params):
        if "exp_avg" not in state:
            state["exp_avg"] = torch.zeros_like(param)
            state["exp_avg_sq"] = torch.zeros_like(param)
            if amsgrad:
                state["max_exp_avg_sq"] = torch.zeros_like(param)
    steps = _steps(states, params, started=False)
    torch._foreach_add_(steps, 1)
    beta1, beta2 = group["betas"]
    fused = torch._fused_adamw_ if group.get("decoupled_weight_decay") else torch._fused_adam_
    fused(
        params,
        grads,
        [state["exp_avg"] for state in states],
        [state["exp_avg_sq"] for state in states],
        [state["max_exp_avg_sq"] for state in states] if amsgrad else [],
        steps,
        lr=group["lr"],
        beta1=beta1,
        beta2=beta2,
        weight_decay=group["weight_decay"],
        eps=group["eps"],
        amsgrad=amsgrad,
        maximize=group["maximize"],
        found_inf=found_inf,
    )
    _uncounted(steps, found_inf)
