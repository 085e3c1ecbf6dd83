"""Lowerings: the fused optimizer steps of ``torch.optim`` (``fused=True``: Adam, AdamW, SGD,
Adagrad; transformers' default AdamW, and spmd_torch's syncfree optimizers), each step one node
over all its parameters.

The functional overloads (``_fused_adamw`` returns the new parameters, gradients and moments) are
lowered here; the engine records the in-place ones through them and writes the results back. Each
follows ATen's CPU kernel (ATen/native/cpu/Fused*Kernel.cpp): the step's scalars (bias
corrections, the decayed rate) in float64 as the kernel's doubles, the element math in the
parameter's opmath type. A ``found_inf`` from the gradient scaler keeps every tensor as it was (the
kernel returns early), decided on the device: nothing is read on the host. Hyper-parameters may
arrive as lifted (traced) scalars, so a zero weight decay is selected, not branched on.
"""

from __future__ import annotations

import jax.numpy as jnp
import torch

from ._helpers import opmath
from .registry import LOWERINGS, lowers, meta_kernel

aten = torch.ops.aten


def _unscaled(grad, grad_scale, maximize: bool) -> tuple:
    """(the gradient as the update reads it, the gradient as written back): divided by the scale
    (the kernels write the unscaled gradient back) and negated for ``maximize``."""
    g = grad.astype(opmath(grad.dtype))
    if grad_scale is not None:
        g = g / grad_scale.reshape(())
        grad = g
    return (-g if maximize else g), grad


def _step_count(counter, param):
    """A step counter in float64, shaped to broadcast against its parameter: one per member,
    along the stacked axis, when the parameter is a stack (``stacks.collapse``)."""
    counter = counter.astype(jnp.float64)
    return counter.reshape(counter.shape + (1,) * (param.ndim - counter.ndim))


def _kept(outputs: list, inputs: list, found_inf) -> list:
    """Each new value, or its old one where the gradient scaler found an inf or a nan."""
    if found_inf is None:
        return outputs
    skip = found_inf.reshape(()) != 0
    return [jnp.where(skip, old, new.astype(old.dtype)) for new, old in zip(outputs, inputs)]


def _adam(
    decoupled, params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, state_steps, *, lr, beta1,
    beta2, weight_decay, eps, amsgrad, maximize, grad_scale=None, found_inf=None,
) -> list:  # fmt: skip
    lerp = LOWERINGS[aten.lerp.Scalar].fn
    lr = lr.reshape(()).astype(jnp.float64) if hasattr(lr, "reshape") else lr
    outs: tuple = ([], [], [], [], [])
    for i, (param, grad, exp_avg, exp_avg_sq) in enumerate(
        zip(params, grads, exp_avgs, exp_avg_sqs)
    ):
        g, new_grad = _unscaled(grad, grad_scale, maximize)
        p = param.astype(opmath(param.dtype))
        step = _step_count(state_steps[i], p)
        step_size = (lr / (1 - beta1**step)).astype(p.dtype)
        bias2_sqrt = jnp.sqrt(1 - beta2**step).astype(p.dtype)
        if decoupled:
            p = jnp.where(weight_decay != 0, p - (lr * weight_decay) * p, p)
        else:
            g = jnp.where(weight_decay != 0, g + p * weight_decay, g)
        m = lerp(exp_avg.astype(p.dtype), g, 1 - beta1)
        v = exp_avg_sq.astype(p.dtype) * beta2 + (1 - beta2) * g * g
        news = [new_grad, m, v]
        olds = [grad, exp_avg, exp_avg_sq]
        if amsgrad:
            v = jnp.maximum(max_exp_avg_sqs[i].astype(p.dtype), v)
            news.append(v)
            olds.append(max_exp_avg_sqs[i])
        news.insert(0, p - step_size * m / (jnp.sqrt(v) / bias2_sqrt + eps))
        olds.insert(0, param)
        for out, value in zip(outs, _kept(news, olds, found_inf)):
            out.append(value)
    return [value for out in outs for value in out]


@lowers(aten._fused_adam.default, aten._fused_adam.tensor_lr)
def _fused_adam(*args, **kwargs) -> list:
    return _adam(False, *args, **kwargs)


@lowers(aten._fused_adamw.default, aten._fused_adamw.tensor_lr)
def _fused_adamw(*args, **kwargs) -> list:
    return _adam(True, *args, **kwargs)


@lowers(aten._fused_sgd.default, aten._fused_sgd.tensor_lr)
def _fused_sgd(
    params, grads, momentum_buffer_list, *, weight_decay, momentum, lr, dampening, nesterov,
    maximize, is_first_step, grad_scale=None, found_inf=None,
) -> list:  # fmt: skip
    lr = lr.reshape(()) if hasattr(lr, "reshape") else lr
    outs: tuple = ([], [], [])
    for i, (param, grad) in enumerate(zip(params, grads)):
        g, new_grad = _unscaled(grad, grad_scale, maximize)
        p = param.astype(opmath(param.dtype))
        g = jnp.where(weight_decay != 0, g + p * weight_decay, g)
        news, olds = [new_grad], [grad]
        if momentum_buffer_list:  # torch passes buffers only with a momentum
            buf = momentum_buffer_list[i]
            new_buf = g if is_first_step else buf.astype(p.dtype) * momentum + (1 - dampening) * g
            news.append(new_buf)
            olds.append(buf)
            g = g + momentum * new_buf if nesterov else new_buf
        news.insert(0, p - lr * g)
        olds.insert(0, param)
        for out, value in zip(outs, _kept(news, olds, found_inf)):
            out.append(value)
    return [value for out in outs for value in out]


def _adagrad(
    params, grads, state_sums, state_steps, *, lr, lr_decay, weight_decay, eps, maximize,
    grad_scale=None, found_inf=None,
) -> list:  # fmt: skip
    lr = lr.reshape(()).astype(jnp.float64) if hasattr(lr, "reshape") else lr
    outs: tuple = ([], [], [])
    for i, (param, grad, state_sum) in enumerate(zip(params, grads, state_sums)):
        g, new_grad = _unscaled(grad, grad_scale, maximize)
        p = param.astype(opmath(param.dtype))
        step = _step_count(state_steps[i], p)
        decayed_lr = (lr / (1 + (step - 1) * lr_decay)).astype(p.dtype)
        g = jnp.where(weight_decay != 0, g + p * weight_decay, g)
        total = state_sum.astype(p.dtype) + g * g
        news = [p - decayed_lr * g / (jnp.sqrt(total) + eps), new_grad, total]
        for out, value in zip(outs, _kept(news, [param, grad, state_sum], found_inf)):
            out.append(value)
    return [value for out in outs for value in out]


@lowers(aten._fused_adagrad.default)
def _fused_adagrad(params, grads, state_sums, state_steps, **kwargs) -> list:
    """This overload also returns the step counters, which the kernel reads and leaves."""
    return _adagrad(params, grads, state_sums, state_steps, **kwargs) + list(state_steps)


lowers(aten._fused_adagrad.tensor_lr)(_adagrad)


# In-place fused step -> (its functional overload, the list arguments it writes): the gradients
# too when it unscales them (given ``grad_scale``); Adagrad's step counters never.
FUSED_STEPS = {
    aten._fused_adam_.default: (aten._fused_adam.default, (0, 2, 3, 4)),
    aten._fused_adam_.tensor_lr: (aten._fused_adam.tensor_lr, (0, 2, 3, 4)),
    aten._fused_adamw_.default: (aten._fused_adamw.default, (0, 2, 3, 4)),
    aten._fused_adamw_.tensor_lr: (aten._fused_adamw.tensor_lr, (0, 2, 3, 4)),
    aten._fused_sgd_.default: (aten._fused_sgd.default, (0, 2)),
    aten._fused_sgd_.tensor_lr: (aten._fused_sgd.tensor_lr, (0, 2)),
    aten._fused_adagrad_.default: (aten._fused_adagrad.default, (0, 2)),
    aten._fused_adagrad_.tensor_lr: (aten._fused_adagrad.tensor_lr, (0, 2)),
}


# A fused step's functional overload -> the position of its list of step counters.
STEP_COUNTERS = {
    aten._fused_adam.default: 5,
    aten._fused_adam.tensor_lr: 5,
    aten._fused_adamw.default: 5,
    aten._fused_adamw.tensor_lr: 5,
    aten._fused_adagrad.default: 3,
    aten._fused_adagrad.tensor_lr: 3,
}


def _in_place_meta(*args, **kwargs) -> None:
    """A fused step writes its lists in place, shapes unchanged: all the meta kernel of its
    functional overload needs from it (some overloads have none in PyTorch)."""


meta_kernel(
    *[
        f"{op._schema.name.split('::')[1]}.{op._overloadname}".removesuffix(".default")
        for op in FUSED_STEPS
        if not torch._C._dispatch_has_kernel_for_dispatch_key(op.name(), "Meta")
    ]
)(_in_place_meta)
