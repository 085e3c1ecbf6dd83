"""SPMD tests run with every program over the 8 virtual CPU devices; the root conftest's leak
guard checks what each test left pending, then turns SPMD off."""

import pytest

import spmd_torch.runtime as xr


@pytest.fixture(autouse=True)
def spmd_mode():
    xr.use_spmd()
