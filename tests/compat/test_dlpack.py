"""utils.dlpack: xla tensors to and from DLPack producers, values and dtypes intact."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import spmd_torch
import spmd_torch.distributed.spmd as xs
import spmd_torch.runtime as xr
from spmd_torch.utils import dlpack as xdlpack


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.int32, torch.bool])
def test_round_trip_through_dlpack(dtype):
    source = (torch.arange(6).reshape(2, 3) % 2).to(dtype)
    t = xdlpack.from_dlpack(source)
    assert t.device.type == "xla" and t.dtype == dtype and t.shape == (2, 3)
    back = torch.utils.dlpack.from_dlpack(xdlpack.to_dlpack(t.clone()))  # a computed value
    assert back.dtype == dtype and torch.equal(back, source)


def test_capsules_and_numpy_arrays_are_accepted():
    capsule = torch.utils.dlpack.to_dlpack(torch.tensor([1.5, -2.0]))
    assert xdlpack.from_dlpack(capsule).cpu().tolist() == [1.5, -2.0]
    assert xdlpack.from_dlpack(np.arange(3, dtype=np.int64)).cpu().tolist() == [0, 1, 2]


def test_writes_to_the_xla_tensor_never_reach_the_producer():
    source = torch.arange(4.0)
    t = xdlpack.from_dlpack(source)
    t.add_(1)
    spmd_torch.sync()
    assert t.cpu().tolist() == [1.0, 2.0, 3.0, 4.0] and source.tolist() == [0.0, 1.0, 2.0, 3.0]


def test_bad_input_names_the_problem():
    with pytest.raises(
        ValueError, match="to_dlpack needs a tensor on the xla device, got a torch.float32 tensor"
    ):
        xdlpack.to_dlpack(torch.ones(2))
    xr.use_spmd()
    try:
        t = torch.ones(8, 2, device=spmd_torch.device())
        xs.mark_sharding(t, xs.get_1d_mesh("data"), ("data", None))
        with pytest.raises(ValueError, match=r"shape \(8, 2\) is laid out over 8 devices"):
            xdlpack.to_dlpack(t)
    finally:
        xr.reset()
