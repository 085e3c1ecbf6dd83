"""grid_sample in 2-D and 3-D, every interpolation and padding mode and both corner conventions,
forward and both gradients, against eager PyTorch in float64 on the CPU; with no CPU fallback."""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.nn.functional as F

import spmd_torch
import spmd_torch.debug.metrics as met
from tests.helpers import assert_close

dev = spmd_torch.device()

CASES = [
    (dims, mode, padding, align)
    for dims, mode, padding, align in itertools.product(
        (2, 3), ("bilinear", "nearest", "bicubic"), ("zeros", "border", "reflection"), (False, True)
    )
    if not (dims == 3 and mode == "bicubic")  # PyTorch has no 3-D bicubic
]


def _grid(dims: int, generator: torch.Generator) -> torch.Tensor:
    """Points inside and outside [-1, 1], plus exact ones: pixel centres, edges and halfway ties."""
    shape = (2, 4, 6, dims) if dims == 2 else (2, 3, 4, 5, dims)
    grid = torch.rand(shape, generator=generator, dtype=torch.float64) * 2.6 - 1.3
    exact = torch.tensor([-1.0, -0.5, 0.0, 0.25, 0.5, 1.0], dtype=torch.float64)
    grid.view(-1, dims)[: exact.numel()] = exact[:, None]
    return grid


@pytest.mark.parametrize(("dims", "mode", "padding", "align"), CASES)
def test_grid_sample_matches_eager_forward_and_backward(dims, mode, padding, align):
    generator = torch.Generator().manual_seed(dims * 100 + len(mode) * 10 + len(padding) + align)
    shape = (2, 3, 5, 7) if dims == 2 else (2, 3, 4, 5, 6)
    x = torch.randn(shape, generator=generator, dtype=torch.float64, requires_grad=True)
    grid = _grid(dims, generator).requires_grad_()
    kwargs = dict(mode=mode, padding_mode=padding, align_corners=align)
    y = F.grid_sample(x, grid, **kwargs)
    weights = torch.randn(y.shape, generator=generator, dtype=torch.float64)
    grad_x, grad_grid = torch.autograd.grad((y * weights).sum(), (x, grid))

    met.clear_all()
    xd = x.detach().float().to(dev).requires_grad_()
    gridd = grid.detach().float().to(dev).requires_grad_()
    yd = F.grid_sample(xd, gridd, **kwargs)
    grad_xd, grad_gridd = torch.autograd.grad((yd * weights.float().to(dev)).sum(), (xd, gridd))
    assert_close(yd, y.float(), rtol=1e-5, atol=1e-5)
    assert_close(grad_xd, grad_x.float(), rtol=1e-5, atol=1e-5)
    assert_close(grad_gridd, grad_grid.float(), rtol=1e-4, atol=1e-4)
    assert met.executed_fallback_ops() == []
