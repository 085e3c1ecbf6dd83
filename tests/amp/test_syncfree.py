"""Sync-free optimizers: step for step as torch.optim on eager CPU while gradients are finite; a step
with ``found_inf`` set changes nothing; no step reads anything back from the device."""

from __future__ import annotations

import copy

import pytest
import torch

import spmd_torch
from spmd_torch.amp import syncfree
from tests.helpers import assert_close, assert_counter_delta, to_cpu, tolerance

CASES = {
    "sgd": (syncfree.SGD, torch.optim.SGD, {"lr": 0.1}),
    "sgd_momentum_nesterov_wd": (
        syncfree.SGD,
        torch.optim.SGD,
        {"lr": 0.1, "momentum": 0.9, "nesterov": True, "weight_decay": 0.01},
    ),
    "sgd_dampening_maximize": (
        syncfree.SGD,
        torch.optim.SGD,
        {"lr": 0.05, "momentum": 0.8, "dampening": 0.3, "maximize": True},
    ),
    "adam": (syncfree.Adam, torch.optim.Adam, {"lr": 0.01}),
    "adam_l2_amsgrad": (
        syncfree.Adam,
        torch.optim.Adam,
        {"lr": 0.01, "betas": (0.8, 0.99), "eps": 1e-6, "weight_decay": 0.1, "amsgrad": True},
    ),
    "adamw": (syncfree.AdamW, torch.optim.AdamW, {"lr": 0.01, "weight_decay": 0.1}),
    "adamw_amsgrad_maximize": (
        syncfree.AdamW,
        torch.optim.AdamW,
        {"lr": 0.01, "amsgrad": True, "maximize": True},
    ),
}


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 2))


def _backward(model: torch.nn.Module, x: torch.Tensor) -> None:
    model.zero_grad()
    model(x).pow(2).mean().backward()


def _state(optimizer: torch.optim.Optimizer) -> list:
    """Each param's state as float32 CPU tensors, keyed alike for torch.optim and syncfree."""
    return [
        {k: to_cpu(v).float() for k, v in sorted(optimizer.state[p].items()) if k != "step"}
        for group in optimizer.param_groups
        for p in group["params"]
    ]


def _clean_step(cpu_model, cpu_opt, xla_model, xla_opt, x) -> None:
    """One finite step on both sides; the device side reads nothing back."""
    _backward(cpu_model, x)
    cpu_opt.step()
    _backward(xla_model, x.to(spmd_torch.device()))
    with assert_counter_delta("TransferFromDevice", 0):
        xla_opt.step(found_inf=torch.zeros((), device=spmd_torch.device()))
        spmd_torch.sync()
    training = tolerance(torch.float32, "fwd", "training")
    assert_close(to_cpu(list(xla_model.parameters())), list(cpu_model.parameters()), **training)
    assert_close(_state(xla_opt), _state(cpu_opt), **training)


@pytest.mark.parametrize("name", sorted(CASES))
def test_matches_torch_optim_and_skips_on_found_inf(name):
    ours_cls, torch_cls, kwargs = CASES[name]
    cpu_model = _model()
    xla_model = copy.deepcopy(cpu_model).to(spmd_torch.device())
    cpu_opt = torch_cls(cpu_model.parameters(), **kwargs)
    xla_opt = ours_cls(xla_model.parameters(), **kwargs)
    torch.manual_seed(1)
    for _ in range(2):
        _clean_step(cpu_model, cpu_opt, xla_model, xla_opt, torch.randn(4, 6))
    params, state = to_cpu(list(xla_model.parameters())), _state(xla_opt)

    _backward(xla_model, torch.randn(4, 6).to(spmd_torch.device()))  # overflowed: skipped
    with assert_counter_delta("TransferFromDevice", 0):
        xla_opt.step(found_inf=torch.ones((), device=spmd_torch.device()))
        spmd_torch.sync()
    exact = tolerance(torch.float32, name="exact")
    assert_close(to_cpu(list(xla_model.parameters())), params, **exact)
    assert_close(_state(xla_opt), state, **exact)
    assert to_cpu(xla_opt.state[next(xla_model.parameters())]["step"]).item() == 2

    _clean_step(cpu_model, cpu_opt, xla_model, xla_opt, torch.randn(4, 6))
    assert to_cpu(xla_opt.state[next(xla_model.parameters())]["step"]).item() == 3


def test_found_inf_on_the_first_step_keeps_momentum_unstarted():
    """A skipped first step leaves the momentum buffer to start from the next step's grad, as
    torch.optim.SGD's first step (the one that counts) starts it."""
    cpu_model = _model()
    xla_model = copy.deepcopy(cpu_model).to(spmd_torch.device())
    cpu_opt = torch.optim.SGD(cpu_model.parameters(), lr=0.1, momentum=0.9)
    xla_opt = syncfree.SGD(xla_model.parameters(), lr=0.1, momentum=0.9)
    x = torch.randn(4, 6)
    _backward(xla_model, x.to(spmd_torch.device()))
    xla_opt.step(found_inf=torch.ones((), device=spmd_torch.device()))
    for batch in (x, torch.randn(4, 6)):
        _backward(cpu_model, batch)
        cpu_opt.step()
        _backward(xla_model, batch.to(spmd_torch.device()))
        xla_opt.step(found_inf=torch.zeros((), device=spmd_torch.device()))
    spmd_torch.sync()
    assert_close(
        to_cpu(list(xla_model.parameters())),
        list(cpu_model.parameters()),
        **tolerance(torch.float32, "fwd", "training"),
    )


def test_without_found_inf_steps_like_torch_optim():
    cpu_model = _model()
    xla_model = copy.deepcopy(cpu_model).to(spmd_torch.device())
    cpu_opt = torch.optim.AdamW(cpu_model.parameters(), lr=0.01)
    xla_opt = syncfree.AdamW(xla_model.parameters(), lr=0.01)
    for _ in range(2):
        x = torch.randn(4, 6)
        _backward(cpu_model, x)
        cpu_opt.step()
        _backward(xla_model, x.to(spmd_torch.device()))
        xla_opt.step()
    spmd_torch.sync()
    assert_close(
        to_cpu(list(xla_model.parameters())),
        list(cpu_model.parameters()),
        **tolerance(torch.float32, "fwd", "training"),
    )


def test_found_inf_must_be_a_scalar_tensor():
    model = _model().to(spmd_torch.device())
    optimizer = syncfree.Adam(model.parameters())
    with pytest.raises(ValueError, match=r"Adam.step: found_inf must be a 0-dim tensor.*\(2,\)"):
        optimizer.step(found_inf=torch.zeros(2, device=spmd_torch.device()))
    spmd_torch.sync()


def test_closure_loss_is_returned():
    model = _model().to(spmd_torch.device())
    optimizer = syncfree.SGD(model.parameters(), lr=0.1)
    x = torch.randn(4, 6).to(spmd_torch.device())

    def closure():
        optimizer.zero_grad()
        loss = model(x).pow(2).mean()
        loss.backward()
        return loss

    loss = optimizer.step(closure, found_inf=torch.zeros((), device=spmd_torch.device()))
    assert loss.requires_grad
    spmd_torch.sync()
