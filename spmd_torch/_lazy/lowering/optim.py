"""The fused optimizer steps of ``torch.optim`` (``fused=True``: Adam, AdamW, SGD, Adagrad), which
transformers' ``Trainer`` picks by default, as recorded ops: the step stays in the program instead
of leaving for the CPU. Each follows ATen's CPU kernel (ATen/native/cpu/Fused*Kernel.cpp): the
step's scalars (bias corrections, the decayed rate) in float64 as the kernel's doubles, the
element math in the parameter's opmath type. A ``found_inf`` from the gradient scaler keeps every
tensor as it was (the kernel returns early), decided on the device: nothing is read on the host.
"""

from __future__ import annotations

import torch

aten = torch.ops.aten


def _opmath(t: torch.Tensor) -> torch.Tensor:
    return t.float() if t.dtype in (torch.float16, torch.bfloat16) else t


def _host_scalar(lr):
    """A CPU ``lr`` tensor is read as the kernel reads it; a device one stays a device value."""
    return lr.item() if isinstance(lr, torch.Tensor) and lr.device.type == "cpu" else lr


def _write(updates: list, found_inf: torch.Tensor | None) -> None:
    """Copy each new value into its tensor, unless the gradient scaler found an inf or nan."""
    skip = None if found_inf is None else found_inf.reshape(()) != 0
    for target, value in updates:
        target.copy_(value if skip is None else torch.where(skip, target, value.to(target.dtype)))


def _unscaled(grad: torch.Tensor, grad_scale, maximize: bool, updates: list) -> torch.Tensor:
    """The gradient divided by the scale (written back, as the kernels do) and negated for
    ``maximize``."""
    g = _opmath(grad)
    if grad_scale is not None:
        g = g / grad_scale
        updates.append((grad, g))
    return -g if maximize else g


def _adam(
    params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, state_steps, *, lr, beta1, beta2,
    weight_decay, eps, amsgrad, maximize, grad_scale=None, found_inf=None, decoupled,
) -> None:  # fmt: skip
    lr = _host_scalar(lr)
    for i, (param, grad, exp_avg, exp_avg_sq) in enumerate(
        zip(params, grads, exp_avgs, exp_avg_sqs)
    ):
        updates = []
        g = _unscaled(grad, grad_scale, maximize, updates)
        p = _opmath(param)
        step = state_steps[i].to(torch.float64)
        step_size = (lr / (1 - torch.pow(beta1, step))).to(p.dtype)
        bias2_sqrt = torch.sqrt(1 - torch.pow(beta2, step)).to(p.dtype)
        if weight_decay != 0 and decoupled:
            p = p - (lr * weight_decay) * p
        elif weight_decay != 0:
            g = g + p * weight_decay
        m = torch.lerp(_opmath(exp_avg), g, 1 - beta1)
        v = _opmath(exp_avg_sq) * beta2 + (1 - beta2) * g * g
        updates += [(exp_avg, m), (exp_avg_sq, v)]
        if amsgrad:
            v = torch.maximum(_opmath(max_exp_avg_sqs[i]), v)
            updates.append((max_exp_avg_sqs[i], v))
        updates.append((param, p - step_size * m / (v.sqrt() / bias2_sqrt + eps)))
        _write(updates, found_inf)


def _adam_(*args, **kwargs) -> None:
    _adam(*args, **kwargs, decoupled=False)


def _adamw_(*args, **kwargs) -> None:
    _adam(*args, **kwargs, decoupled=True)


def _sgd_(
    params, grads, momentum_buffer_list, *, weight_decay, momentum, lr, dampening, nesterov,
    maximize, is_first_step, grad_scale=None, found_inf=None,
) -> None:  # fmt: skip
    lr = _host_scalar(lr)
    for i, (param, grad) in enumerate(zip(params, grads)):
        updates = []
        g = _unscaled(grad, grad_scale, maximize, updates)
        p = _opmath(param)
        if weight_decay != 0:
            g = g + p * weight_decay
        if momentum != 0:
            buf = momentum_buffer_list[i]
            new_buf = g if is_first_step else _opmath(buf) * momentum + (1 - dampening) * g
            updates.append((buf, new_buf))
            g = g + momentum * new_buf if nesterov else new_buf
        updates.append((param, p - lr * g))
        _write(updates, found_inf)


def _adagrad_(
    params, grads, state_sums, state_steps, *, lr, lr_decay, weight_decay, eps, maximize,
    grad_scale=None, found_inf=None,
) -> None:  # fmt: skip
    lr = _host_scalar(lr)
    for i, (param, grad, state_sum) in enumerate(zip(params, grads, state_sums)):
        updates = []
        g = _unscaled(grad, grad_scale, maximize, updates)
        p = _opmath(param)
        step = state_steps[i].to(torch.float64)
        decayed_lr = (lr / (1 + (step - 1) * lr_decay)).to(p.dtype)
        if weight_decay != 0:
            g = g + p * weight_decay
        total = _opmath(state_sum) + g * g
        updates += [(state_sum, total), (param, p - decayed_lr * g / (total.sqrt() + eps))]
        _write(updates, found_inf)


DECOMPOSITIONS = {
    aten._fused_adam_.default: _adam_,
    aten._fused_adam_.tensor_lr: _adam_,
    aten._fused_adamw_.default: _adamw_,
    aten._fused_adamw_.tensor_lr: _adamw_,
    aten._fused_sgd_.default: _sgd_,
    aten._fused_sgd_.tensor_lr: _sgd_,
    aten._fused_adagrad_.default: _adagrad_,
    aten._fused_adagrad_.tensor_lr: _adagrad_,
}
