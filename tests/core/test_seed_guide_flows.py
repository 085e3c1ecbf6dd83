"""The seed guide's single-device snippets, with only the import renamed, against eager CPU."""

from __future__ import annotations

import torch

import spmd_torch  # noqa: F401  (``import torch_xla``)
import spmd_torch.core.xla_model as xm
import spmd_torch.utils.serialization as xser
from tests.helpers import assert_close


def test_tensors_and_modules_on_the_device():
    t0 = torch.randn(2, 2, device=xm.xla_device())
    t1 = torch.randn(2, 2, device=xm.xla_device())
    assert "device='xla:0'" in repr(t0 + t1)
    assert_close(t0 + t1, t0.cpu() + t1.cpu())
    l_in = torch.randn(10, device=xm.xla_device())
    linear = torch.nn.Linear(10, 20).to(xm.xla_device())
    l_out = linear(l_in)
    assert l_out.shape == (20,) and l_out.device == xm.xla_device()
    expected = torch.nn.functional.linear(l_in.cpu(), linear.weight.cpu(), linear.bias.cpu())
    assert_close(l_out, expected)


def test_saving_cpu_copies_and_loading_them_back(tmp_path):
    device = xm.xla_device()
    t0 = torch.randn(2, 2, device=device)
    t1 = torch.randn(2, 2, device=device)
    tensors = (t0.cpu(), t1.cpu())
    torch.save(tensors, tmp_path / "tensors.pt")
    tensors = torch.load(tmp_path / "tensors.pt")
    assert_close(tensors[0].to(device), t0.cpu())
    assert_close(tensors[1].to(device), t1.cpu())


def test_xm_save_and_load_state_dict(tmp_path):
    model = torch.nn.Linear(4, 3).to(xm.xla_device())
    xm.save(model.state_dict(), tmp_path / "model.pt")
    state = torch.load(tmp_path / "model.pt")
    assert all(v.device.type == "cpu" for v in state.values())
    fresh = torch.nn.Linear(4, 3).to(xm.xla_device())
    fresh.load_state_dict(state)
    assert_close(fresh.weight, model.weight.cpu())


def test_streaming_serialization(tmp_path):
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2)).to(xm.xla_device())
    xser.save(model.state_dict(), str(tmp_path / "model.pt"))
    state_dict = xser.load(str(tmp_path / "model.pt"))
    fresh = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))
    fresh.load_state_dict(state_dict)
    for a, b in zip(fresh.parameters(), model.parameters()):
        assert_close(a, b.cpu())


def test_saving_device_tensors_directly_loads_them_on_the_device(tmp_path):
    t = torch.arange(6.0, device=xm.xla_device()).reshape(2, 3)
    torch.save(t, tmp_path / "t.pt")
    loaded = torch.load(tmp_path / "t.pt", weights_only=False)
    assert loaded.device == xm.xla_device()
    assert_close(loaded, torch.arange(6.0).reshape(2, 3))
