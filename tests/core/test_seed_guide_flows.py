"""The seed guides' single-device snippets, with only the import renamed, against eager CPU."""

from __future__ import annotations

import copy

import torch

import spmd_torch  # ``import torch_xla``
import spmd_torch.core.xla_model as xm
import spmd_torch.utils.serialization as xser
from spmd_torch.amp import autocast, syncfree
from tests.helpers import assert_close, tolerance


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


def test_bf16_amp_with_a_syncfree_optimizer_and_optimizer_step():
    """The migration guide's AMP loop: autocast forward, backward outside, syncfree SGD."""
    torch.manual_seed(0)
    cpu_model = torch.nn.Sequential(
        torch.nn.Linear(12, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4)
    )
    model = copy.deepcopy(cpu_model).to("xla")
    cpu_optimizer = torch.optim.SGD(cpu_model.parameters(), lr=0.1, momentum=0.9)
    optimizer = syncfree.SGD(model.parameters(), lr=0.1, momentum=0.9)
    loss_fn = torch.nn.CrossEntropyLoss()
    data = [(torch.randn(16, 12), torch.randint(0, 4, (16,))) for _ in range(4)]
    losses, cpu_losses = [], []
    for input, target in data:
        optimizer.zero_grad()
        with autocast(spmd_torch.device()):
            output = model(input.to("xla"))
            loss = loss_fn(output, target.to("xla"))
        loss.backward()
        xm.optimizer_step(optimizer)
        losses.append(loss.detach())

        cpu_optimizer.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            cpu_loss = loss_fn(cpu_model(input), target)
        cpu_loss.backward()
        cpu_optimizer.step()
        cpu_losses.append(cpu_loss.detach())
    assert output.dtype == torch.bfloat16 and loss.dtype == torch.float32
    # bf16 products may round differently on the two sides (CPU's kernels, XLA's): bf16 tolerance
    assert_close(
        torch.stack([x.cpu() for x in losses]), torch.stack(cpu_losses), **tolerance(torch.bfloat16)
    )


def test_printing_the_metrics_report_after_each_step():
    """The performance guide's ``print(torch_xla._XLAC._xla_metrics_report())``."""
    x = torch.randn(4, 4, device=xm.xla_device())
    for _ in range(2):
        x = x @ x.t() / 4
        xm.mark_step()
        report = spmd_torch._XLAC._xla_metrics_report()
        assert "Metric: CompileTime" in report and "Counter: MarkStep" in report
