"""Whole training loops on xla match eager CPU step by step, compiling once per distinct graph."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import spmd_torch
from spmd_torch._lazy import counters
from tests.helpers import assert_close, tolerance

dev = spmd_torch.device()


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.Sequential(
            nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 10)
        )

    def forward(self, x, dropout_mask=None):
        return self.layers(x)


class CNN(nn.Module):
    """conv, pooling, batch norm and dropout, with the dropout mask supplied from outside."""

    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 8, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(8)
        self.conv2 = nn.Conv2d(8, 16, 3, bias=False)
        self.bn2 = nn.BatchNorm2d(16)
        self.fc = nn.Linear(16 * 2 * 2, 10)

    def forward(self, x, dropout_mask):
        x = F.max_pool2d(F.relu(self.bn1(self.conv1(x))), 2)
        x = F.avg_pool2d(F.relu(self.bn2(self.conv2(x))), 2)
        x = torch.flatten(x, 1) * dropout_mask / 0.75  # dropout(p=0.25) with a shared mask
        return F.log_softmax(self.fc(x), dim=1)


def _batches(model_cls, steps):
    generator = torch.Generator().manual_seed(0)
    for _ in range(steps):
        if model_cls is MLP:
            yield (
                torch.randn(16, 32, generator=generator),
                torch.randint(0, 10, (16,), generator=generator),
                None,
            )
        else:
            mask = (torch.rand(8, 64, generator=generator) > 0.25).float()
            yield (
                torch.randn(8, 1, 14, 14, generator=generator),
                torch.randint(0, 10, (8,), generator=generator),
                mask,
            )


def _train(model, make_optimizer, batches, device, compiles: list | None = None):
    """The losses and the trained model; ``compiles`` gets the programs each step compiled."""
    model = model.to(device)
    optimizer = make_optimizer(model.parameters())
    losses = []
    for x, y, mask in batches:
        before = counters.COUNTERS.get("UncachedCompile", 0)
        x, y = x.to(device), y.to(device)
        mask = mask.to(device) if mask is not None else None
        optimizer.zero_grad()
        loss = F.cross_entropy(model(x, mask), y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 5.0)
        optimizer.step()
        if device.type == "xla":
            spmd_torch.sync()
        losses.append(loss.detach())
        if compiles is not None:
            compiles.append(counters.COUNTERS.get("UncachedCompile", 0) - before)
    return [float(loss) for loss in losses], model


OPTIMIZERS = {
    "sgd_nesterov": lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9, nesterov=True),
    "adam": lambda p: torch.optim.Adam(p, lr=1e-3),
    "adamw": lambda p: torch.optim.AdamW(p, lr=1e-3, weight_decay=0.01),
}


@pytest.mark.slow
@pytest.mark.parametrize("model_cls", [MLP, CNN], ids=["mlp", "cnn"])
@pytest.mark.parametrize("optimizer", sorted(OPTIMIZERS))
def test_training_matches_eager_step_by_step(model_cls, optimizer):
    torch.manual_seed(0)
    reference = model_cls()
    model = copy.deepcopy(reference)
    steps = 20
    expected, trained_cpu = _train(
        reference, OPTIMIZERS[optimizer], _batches(model_cls, steps), torch.device("cpu")
    )
    # The first step compiles its program, and the optimizer state's fills unless an earlier
    # test did; every later step runs it, but SGD's second, whose momentum exists from then on.
    compiles: list = []
    actual, trained = _train(
        model, OPTIMIZERS[optimizer], _batches(model_cls, steps), dev, compiles
    )
    assert 1 <= compiles[0] <= 2, compiles
    assert compiles[1:] == [int(optimizer.startswith("sgd"))] + [0] * (steps - 2), compiles
    assert_close(torch.tensor(actual), torch.tensor(expected))
    assert_close(
        dict(trained.state_dict()),
        dict(trained_cpu.state_dict()),
        **tolerance(torch.float32, name="training"),
    )


def test_gradient_accumulation_and_zero_grad_keep_grads():
    torch.manual_seed(0)
    reference = MLP()
    model = copy.deepcopy(reference).to(dev)
    x, y = torch.randn(8, 32), torch.randint(0, 10, (8,))
    for m, device in ((reference, "cpu"), (model, dev)):
        m.zero_grad(set_to_none=False)
        for half in (slice(0, 4), slice(4, 8)):
            F.cross_entropy(m(x[half].to(device)), y[half].to(device)).backward()
    assert_close(
        {name: p.grad for name, p in model.named_parameters()},
        {name: p.grad for name, p in reference.named_parameters()},
        **tolerance(torch.float32, "grad", "training"),
    )
    model.zero_grad(set_to_none=False)
    assert all(float(p.grad.abs().sum()) == 0.0 for p in model.parameters())
