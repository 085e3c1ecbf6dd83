"""gradient_accumulation against eager PyTorch on CPU calling backward once per micro-batch:
losses, gradients (added to existing ones), carried tensors, layers under scan_layers; one loop
in the program whatever the micro-batch count; named errors."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import spmd_torch
from spmd_torch.debug import graph
from spmd_torch.experimental.gradient_accumulation import gradient_accumulation
from spmd_torch.experimental.scan_layers import scan_layers
from tests.helpers import assert_close

dev = spmd_torch.device()


class Stack(nn.Module):
    def __init__(self, scanned: bool):
        super().__init__()
        self.scanned = scanned
        self.embed = nn.Linear(6, 8)
        self.layers = nn.ModuleList(nn.Sequential(nn.Linear(8, 8), nn.Tanh()) for _ in range(3))
        self.head = nn.Linear(8, 4)

    def forward(self, x):
        h = self.embed(x)
        if self.scanned and h.device.type == "xla":
            h = scan_layers(self.layers, h)
        else:
            for layer in self.layers:
                h = layer(h)
        return self.head(h)


def _eager(model: nn.Module, data, target, steps: int):
    """Backward once per micro-batch of ``loss / steps``, as PyTorch/XLA documents."""
    total = 0.0
    for k in range(steps):
        loss = F.cross_entropy(model(data[k]), target[k]) / steps
        loss.backward()
        total += loss.detach()
    return total


@pytest.mark.parametrize(
    "scanned, stacked_before",
    [(False, False), (True, False), (True, True)],
    ids=["unrolled", "scan_layers", "scan_layers-stacked-by-an-earlier-step"],
)
def test_losses_and_gradients_equal_a_backward_per_micro_batch(scanned, stacked_before):
    torch.manual_seed(0)
    model = Stack(scanned)
    data, target = torch.randn(4, 5, 6), torch.randint(0, 4, (4, 5))
    ours = copy.deepcopy(model).to(dev)
    if stacked_before:  # the layers' weights are then members of their stacks (stacks.py)
        with torch.no_grad():
            ours(data[0].to(dev))
        spmd_torch.sync()
    ours.head.weight.grad = torch.ones(4, 8, device=dev)  # added to, as backward adds
    model.head.weight.grad = torch.ones(4, 8)
    want = _eager(model, data, target, 4)

    def step(x, y, seen):
        return F.cross_entropy(ours(x), y), seen + x.sum()

    loss, seen = gradient_accumulation(
        step, (data.to(dev), target.to(dev)), ours, torch.zeros((), device=dev)
    )
    assert_close(loss, want)
    assert_close(seen, data.sum())
    assert_close(
        [p.grad for p in ours.parameters()], [p.grad for p in model.parameters()], kind="grad"
    )


def test_the_program_holds_one_micro_batch_whatever_the_count():
    sizes = []
    for steps in (2, 8):
        torch.manual_seed(0)
        model = Stack(False).to(dev)
        data = torch.randn(steps, 5, 6, device=dev)
        target = torch.randint(0, 4, (steps, 5), device=dev)
        spmd_torch.sync()
        gradient_accumulation(lambda x, y: F.cross_entropy(model(x), y), (data, target), model)
        sizes.append(len(graph.pending_program().nodes))
        spmd_torch.sync()
    assert sizes[0] == sizes[1]


def test_bad_input_is_named():
    model = nn.Linear(2, 1).to(dev)
    x = torch.ones(3, 4, 2, device=dev)
    with pytest.raises(ValueError, match="iterable_tensors cannot be empty"):
        gradient_accumulation(lambda: None, (), model)
    with pytest.raises(ValueError, match=r"iterable_tensors\[1\] has 2 micro-batches"):
        gradient_accumulation(lambda a, b: model(a).sum(), (x, x[:2]), model)
    with pytest.raises(ValueError, match=r"must be a 0-dim floating tensor, not f32\[4,1\]"):
        gradient_accumulation(lambda a: model(a), (x,), model)
    with pytest.raises(AssertionError, match=r"in-place operation on carried_tensors\[0\]"):
        gradient_accumulation(
            lambda a, c: (model(a).sum(), c.add_(1)), (x,), model, torch.zeros((), device=dev)
        )
    with pytest.raises(ValueError, match="returned 0 carried tensors, it was given 1"):
        gradient_accumulation(lambda a, c: model(a).sum(), (x,), model, torch.zeros((), device=dev))
