"""nonzero_static: its ``size`` fixes the output shape, so it is lowered, not a CPU fallback."""

from __future__ import annotations

import pytest
import torch

import spmd_torch
from spmd_torch.debug import metrics as met

dev = spmd_torch.device()

CASES = [
    torch.tensor([[0, 1, 0], [2, 0, 3]]),
    torch.tensor([0.0, 1.0, 0.0, 2.0]),
    torch.tensor(3.0),
    torch.tensor(0.0),
    torch.zeros(2, 3, dtype=torch.bool),
]


@pytest.mark.parametrize("size", [0, 2, 5])  # fewer rows than nonzeros truncates; more pads
@pytest.mark.parametrize("x", CASES, ids=lambda t: f"{t.dtype}{list(t.shape)}")
def test_matches_eager_on_the_device(x, size):
    met.clear_all()
    got = torch.nonzero_static(x.to(dev), size=size, fill_value=-7).cpu()
    expected = torch.nonzero_static(x, size=size, fill_value=-7)
    assert got.dtype == expected.dtype == torch.int64
    assert torch.equal(got, expected)
    assert met.executed_fallback_ops() == []
