"""Antialiased bilinear resizing (``F.interpolate(..., antialias=True)``, torchvision's resize)
against eager PyTorch in float64 on the CPU: down- and upscaling, both corner conventions, scale
factors; forward and gradient, no CPU fallback."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import spmd_torch
import spmd_torch.debug.metrics as met
from tests.helpers import assert_close

dev = spmd_torch.device()

CASES = [
    ((2, 3, 16, 20), dict(size=(5, 7))),
    ((2, 3, 16, 20), dict(size=(5, 7), align_corners=True)),
    ((1, 2, 9, 9), dict(size=(20, 4))),  # up along one axis, down along the other
    ((1, 2, 10, 12), dict(scale_factor=(0.3, 0.55))),
    ((1, 2, 30, 30), dict(size=(1, 2), align_corners=True)),
]


@pytest.mark.parametrize(("shape", "kwargs"), CASES)
def test_antialiased_bilinear_matches_eager(shape, kwargs):
    generator = torch.Generator().manual_seed(sum(shape))
    x = torch.randn(shape, generator=generator, dtype=torch.float64, requires_grad=True)
    resize = dict(mode="bilinear", antialias=True, **kwargs)
    y = F.interpolate(x, **resize)
    weights = torch.randn(y.shape, generator=generator, dtype=torch.float64)
    (grad,) = torch.autograd.grad((y * weights).sum(), x)

    met.clear_all()
    xd = x.detach().float().to(dev).requires_grad_()
    yd = F.interpolate(xd, **resize)
    (grad_d,) = torch.autograd.grad((yd * weights.float().to(dev)).sum(), xd)
    assert_close(yd, y.float(), rtol=1e-6, atol=1e-6)
    assert_close(grad_d, grad.float(), rtol=1e-6, atol=1e-6)
    assert met.executed_fallback_ops() == []
