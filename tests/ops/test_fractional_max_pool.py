"""Fractional max pooling in 2-D and 3-D with given random samples, against eager PyTorch on the
CPU (the same float32 samples): values and indices exactly, gradients; no CPU fallback."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import spmd_torch
import spmd_torch.debug.metrics as met
from tests.helpers import assert_close

dev = spmd_torch.device()

CASES = [
    ((2, 3, 9, 9), 3, (2, 3), F.fractional_max_pool2d),
    ((1, 3, 9, 11), (4, 2), (5, 4), F.fractional_max_pool2d),
    ((3, 10, 12), (2, 3), (4, 5), F.fractional_max_pool2d),  # no batch dim
    ((1, 1, 16, 16), (1, 1), (16, 16), F.fractional_max_pool2d),
    ((2, 2, 7, 8, 9), (2, 3, 2), (3, 4, 5), F.fractional_max_pool3d),
]


@pytest.mark.parametrize(("shape", "kernel", "output_size", "pool"), CASES)
def test_fractional_max_pool_matches_eager(shape, kernel, output_size, pool):
    nd = len(output_size)
    generator = torch.Generator().manual_seed(sum(shape) + nd)
    x = torch.randn(shape, generator=generator, requires_grad=True)
    batch = shape[0] if len(shape) == nd + 2 else 1
    samples = torch.rand(batch, shape[-nd - 1], nd, generator=generator)
    kwargs = dict(output_size=output_size, return_indices=True)
    y, indices = pool(x, kernel, _random_samples=samples, **kwargs)
    weights = torch.randn(y.shape, generator=generator)
    (grad,) = torch.autograd.grad((y * weights).sum(), x)

    met.clear_all()
    xd = x.detach().to(dev).requires_grad_()
    yd, indices_d = pool(xd, kernel, _random_samples=samples.to(dev), **kwargs)
    (grad_d,) = torch.autograd.grad((yd * weights.to(dev)).sum(), xd)
    assert_close(yd, y, tol="exact")
    assert torch.equal(indices_d.cpu(), indices)
    assert_close(grad_d, grad, tol="exact")
    assert met.executed_fallback_ops() == []
