"""SPMD tests run with every program over the 8 virtual CPU devices, and leave SPMD off after."""

import pytest

import spmd_torch.runtime as xr
from spmd_torch._lazy import placement


@pytest.fixture(autouse=True)
def spmd_mode():
    xr.use_spmd()
    yield
    placement.disable_spmd()
    xr._spmd_requested = False
