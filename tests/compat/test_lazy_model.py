"""spmd_torch.core.lazy_model: the lazy-tensor-core guide's names are xla_model's functions, and
the guide's single-device training loop and save flow run with them, matching eager."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import spmd_torch.core.lazy_model as ltm
import spmd_torch.core.xla_model as xm
from tests.helpers import assert_close


@pytest.mark.parametrize(
    "old, new",
    [
        ("lazy_device", "xla_device"),
        ("is_lazy_tensor", "is_xla_tensor"),
        ("get_lazy_supported_devices", "get_xla_supported_devices"),
        ("lazy_real_devices", "xla_real_devices"),
        ("lazy_device_hw", "xla_device_hw"),
        ("lazy_replication_devices", "xla_replication_devices"),
        ("parse_lazy_device", "parse_xla_device"),
        ("ToLazyTensorArena", "ToXlaTensorArena"),
        ("mark_step", "mark_step"),
        ("save", "save"),
        ("get_ordinal", "get_ordinal"),
        ("optimizer_step", "optimizer_step"),
        ("add_step_closure", "add_step_closure"),
        ("send_cpu_data_to_device", "send_cpu_data_to_device"),
        ("RateTracker", "RateTracker"),
        ("all_reduce", "all_reduce"),
        ("mesh_reduce", "mesh_reduce"),
    ],
)
def test_old_name_is_the_xla_model_function(old, new):
    assert getattr(ltm, old) is getattr(xm, new)


def test_the_guides_training_loop_runs_with_the_old_names(tmp_path):
    torch.manual_seed(0)
    eager = nn.Sequential(nn.Linear(10, 20), nn.ReLU(), nn.Linear(20, 3), nn.LogSoftmax(dim=1))
    device = ltm.lazy_device()
    model = nn.Sequential(nn.Linear(10, 20), nn.ReLU(), nn.Linear(20, 3), nn.LogSoftmax(dim=1))
    model.load_state_dict(eager.state_dict())
    model = model.train().to(device)
    loss_fn = nn.NLLLoss()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    eager_optimizer = torch.optim.SGD(eager.parameters(), lr=0.1, momentum=0.9)
    batches = [(torch.randn(8, 10), torch.randint(0, 3, (8,))) for _ in range(4)]
    losses, eager_losses = [], []
    for data, target in batches:
        optimizer.zero_grad()
        loss = loss_fn(model(data.to(device)), target.to(device))
        loss.backward()
        optimizer.step()
        ltm.add_step_closure(lambda t: losses.append(t.item()), args=(loss,))
        ltm.mark_step()
        eager_optimizer.zero_grad()
        eager_loss = loss_fn(eager(data), target)
        eager_loss.backward()
        eager_optimizer.step()
        eager_losses.append(eager_loss.item())
    assert_close(torch.tensor(losses), torch.tensor(eager_losses))  # float32 losses
    assert ltm.is_lazy_tensor(model[0].weight)
    path = tmp_path / "model.pt"
    ltm.save(model.state_dict(), path)
    saved = torch.load(path)
    assert saved["0.weight"].device.type == "cpu"
    assert_close(saved["0.weight"], eager[0].weight.detach())
