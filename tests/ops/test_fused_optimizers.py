"""torch.optim's fused steps (``fused=True``, transformers' default AdamW) are recorded on the
device, not run on the CPU, and match ATen's CPU kernels step after step."""

from __future__ import annotations

import pytest
import torch

import spmd_torch  # noqa: F401
from spmd_torch.debug import metrics as met
from tests.helpers import assert_close, to_device

OPTIMIZERS = {
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=0.05, weight_decay=0.1, fused=True),
    "adam_l2_amsgrad": lambda ps: torch.optim.Adam(
        ps, lr=0.05, weight_decay=0.1, amsgrad=True, fused=True
    ),
    "adamw_maximize": lambda ps: torch.optim.AdamW(ps, lr=0.05, maximize=True, fused=True),
    "adamw_tensor_lr": lambda ps: torch.optim.AdamW(ps, lr=torch.tensor(0.05), fused=True),
    "sgd_nesterov": lambda ps: torch.optim.SGD(
        ps, lr=0.1, momentum=0.9, nesterov=True, weight_decay=0.01, fused=True
    ),
    "sgd_dampening": lambda ps: torch.optim.SGD(
        ps, lr=0.1, momentum=0.9, dampening=0.3, fused=True
    ),
    "sgd_plain": lambda ps: torch.optim.SGD(ps, lr=0.1, fused=True),
    "adagrad": lambda ps: torch.optim.Adagrad(
        ps, lr=0.1, lr_decay=0.01, weight_decay=0.1, fused=True
    ),
}


def _train(params: list[torch.Tensor], grads: list[list[torch.Tensor]], make) -> tuple:
    params = [p.clone().requires_grad_() for p in params]
    optimizer = make(params)
    for step_grads in grads:
        for p, g in zip(params, step_grads):
            p.grad = g.clone()
        optimizer.step()
        spmd_torch.sync()
    state = [{k: v for k, v in optimizer.state[p].items()} for p in params]
    return [p.detach() for p in params], state


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_fused_step_matches_the_cpu_kernel(name):
    torch.manual_seed(0)
    params = [torch.randn(4, 3), torch.randn(5)]
    grads = [[torch.randn_like(p) for p in params] for _ in range(3)]
    expected = _train(params, grads, OPTIMIZERS[name])
    met.clear_all()
    actual = _train(to_device(params), to_device(grads), OPTIMIZERS[name])
    assert not [op for op in met.executed_fallback_ops() if "fused" in op]
    assert_close(actual, expected)


@pytest.mark.parametrize("found", [0.0, 1.0])
def test_fused_adamw_unscales_and_skips_on_found_inf(found):
    torch.manual_seed(0)
    tensors = [[torch.randn(3, 2)] for _ in range(4)]  # params, grads, exp_avgs, exp_avg_sqs
    tensors[3][0].abs_()
    steps = [torch.tensor(2.0)]
    scale, found_inf = torch.tensor(4.0), torch.tensor([found])
    kwargs = dict(lr=0.1, beta1=0.9, beta2=0.99, weight_decay=0.1, eps=1e-8)
    kwargs.update(amsgrad=False, maximize=False)

    def step(tensors, steps, scale, found_inf):
        torch._fused_adamw_(*tensors, [], steps, **kwargs, grad_scale=scale, found_inf=found_inf)
        return tensors

    on_cpu = [[t.clone() for t in group] for group in tensors]
    expected = step(on_cpu, steps, scale, found_inf)
    actual = step(*to_device(([[t.clone() for t in g] for g in tensors], steps, scale, found_inf)))
    assert_close(actual, expected)  # gradients unscaled in place, or nothing touched
    if found:
        assert_close(actual, tensors, tol="exact")
