"""What libraries read off spmd_torch's objects besides PyTorch/XLA's API (tests/libraries runs
the libraries themselves)."""

from __future__ import annotations

import pytest
import torch

import spmd_torch
from spmd_torch.distributed import parallel_loader as pl


def test_torch_accelerator_does_not_name_the_xla_device():
    # As under PyTorch/XLA: code pinning memory for "the" accelerator leaves the xla device alone.
    assert not torch.accelerator.is_available()
    loader = torch.utils.data.DataLoader(torch.arange(6.0), batch_size=3, pin_memory=True)
    with pytest.warns(UserWarning, match="no accelerator is found"):
        assert [b.tolist() for b in loader] == [[0.0, 1.0, 2.0], [3.0, 4.0, 5.0]]


def test_a_device_tensor_storage_holds_no_host_memory():
    t = torch.ones(4, device=spmd_torch.device()) * 2
    storage = t.untyped_storage()
    assert storage.data_ptr() == 0 and storage.nbytes() == 0
    assert t.cpu().tolist() == [2.0] * 4  # the value is the engine's, untouched


def test_device_loader_answers_its_loaders_attributes():
    data = torch.utils.data.TensorDataset(torch.arange(8.0))
    loader = torch.utils.data.DataLoader(data, batch_size=4)
    device_loader = pl.MpDeviceLoader(loader, spmd_torch.device())
    assert device_loader.dataset is data and device_loader.batch_size == 4
    assert len(device_loader) == 2
    with pytest.raises(AttributeError, match="no_such_attribute"):
        device_loader.no_such_attribute
