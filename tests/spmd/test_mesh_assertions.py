"""A bad mesh raises what PyTorch/XLA's ``Mesh`` raises (AssertionError, its wording) and stays
our ValueError that names the culprit (tests/spmd/test_validation.py)."""

from __future__ import annotations

import numpy as np
import pytest

import spmd_torch.distributed.spmd as xs

# PyTorch/XLA 2.9's own test (test/spmd/test_xla_sharding.py) for each case: args, its regex.
PYTORCH_XLA_CASES = {
    "ids_out_of_bounds": ((np.arange(9, 17), (1, 8)), "Device IDs must be less than mesh size"),
    "duplicate_axis_names": ((np.arange(8), (1, 8), ("data", "data")), "Axis names must be unique"),
    "invalid_device_count": (
        (np.arange(8), (2, 8)),
        r"Number of device IDs .* must match mesh size",
    ),
    "duplicate_device_ids": ((np.array([0] * 8), (1, 8)), "Device IDs must be unique"),
    "axis_names_length": (
        (np.arange(8), (1, 8), ("data", "model", "extra")),
        r"Number of axis names .* must match mesh dimensions",
    ),
    "fewer_than_the_global_devices": (
        (np.arange(4), (1, 4)),
        r"Number of device IDs .* must match the global number of devices",
    ),
}


@pytest.mark.parametrize("args, message", PYTORCH_XLA_CASES.values(), ids=PYTORCH_XLA_CASES.keys())
def test_bad_mesh_raises_pytorch_xlas_assertion_and_our_value_error(args, message):
    with pytest.raises(AssertionError, match=message) as caught:
        xs.Mesh(*args)
    assert isinstance(caught.value, ValueError)
