"""Adaptive max pooling in 1, 2 and 3 dimensions (even and uneven bins, more bins than inputs, ties)
against eager PyTorch on the CPU: values, indices and gradients; no CPU fallback."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import spmd_torch
import spmd_torch.debug.metrics as met
from tests.helpers import assert_close

dev = spmd_torch.device()

CASES = [
    ((2, 3, 11), (4,), F.adaptive_max_pool1d),
    ((2, 3, 7, 9), (3, 4), F.adaptive_max_pool2d),
    ((3, 10, 5), (3, 2), F.adaptive_max_pool2d),  # no batch dim
    ((1, 2, 8, 8), (4, 4), F.adaptive_max_pool2d),  # even bins
    ((1, 2, 3, 5), (6, 7), F.adaptive_max_pool2d),  # more bins than inputs: bins overlap
    ((2, 2, 5, 6, 7), (2, 3, 4), F.adaptive_max_pool3d),
]


@pytest.mark.parametrize(("shape", "output_size", "pool"), CASES)
def test_adaptive_max_pool_matches_eager(shape, output_size, pool):
    generator = torch.Generator().manual_seed(len(shape) * 10 + output_size[0])
    x = torch.randn(shape, generator=generator, dtype=torch.float64, requires_grad=True)
    y, indices = pool(x, output_size, return_indices=True)
    weights = torch.randn(y.shape, generator=generator, dtype=torch.float64)
    (grad,) = torch.autograd.grad((y * weights).sum(), x)

    met.clear_all()
    xd = x.detach().float().to(dev).requires_grad_()
    yd, indices_d = pool(xd, output_size, return_indices=True)
    (grad_d,) = torch.autograd.grad((yd * weights.float().to(dev)).sum(), xd)
    assert_close(yd, y.float(), tol="exact")
    assert torch.equal(indices_d.cpu(), indices)
    assert_close(grad_d, grad.float(), rtol=1e-6, atol=1e-6)
    assert met.executed_fallback_ops() == []


def test_ties_take_the_first_maximum():
    x = torch.randint(-2, 2, (2, 3, 7, 9), generator=torch.Generator().manual_seed(3)).float()
    y, indices = F.adaptive_max_pool2d(x, (3, 4), return_indices=True)
    yd, indices_d = F.adaptive_max_pool2d(x.to(dev), (3, 4), return_indices=True)
    assert_close(yd, y, tol="exact")
    assert torch.equal(indices_d.cpu(), indices)
