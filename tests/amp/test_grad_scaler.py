"""GradScaler on xla: the scale grows and backs off as torch.amp.GradScaler('cpu') makes it on the
same gradients (an inf among them), the skipped step skips on the device, and a step of
scale-backward-step-update-sync reads nothing back to the host."""

from __future__ import annotations

import copy

import pytest
import torch

import spmd_torch
from spmd_torch.amp import GradScaler, syncfree
from tests.helpers import assert_close, assert_counter_delta, to_cpu, tolerance

# One batch per step; step 2 holds an inf, so its gradients overflow and the scale backs off.
# growth_interval=2 makes the scale grow twice in between.
_STEPS = 6
_OVERFLOW_STEP = 2
_SCALER_ARGS = {
    "init_scale": 2.0**10,
    "growth_factor": 2.0,
    "backoff_factor": 0.25,
    "growth_interval": 2,
}


def _batches() -> list[torch.Tensor]:
    torch.manual_seed(0)
    batches = [torch.randn(4, 6) for _ in range(_STEPS)]
    batches[_OVERFLOW_STEP][1, 3] = float("inf")
    return batches


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Linear(6, 3)


def _train_step(model, optimizer, scaler, x) -> None:
    optimizer.zero_grad()
    loss = model(x).pow(2).mean()
    scaler.scale(loss).backward()
    scaler.step(optimizer)
    scaler.update()


def _run_cpu() -> list[tuple]:
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    scaler = torch.amp.GradScaler("cpu", **_SCALER_ARGS)
    history = []
    for x in _batches():
        _train_step(model, optimizer, scaler, x)
        history.append(
            (
                scaler._scale.clone(),
                scaler._growth_tracker.clone(),
                copy.deepcopy(list(model.parameters())),
            )
        )
    return history


@pytest.mark.parametrize(
    "scaler_kind", ["spmd_torch.amp.GradScaler", "torch.amp.GradScaler('xla')"]
)
def test_scale_and_params_match_cpu_scaler(scaler_kind):
    expected = _run_cpu()
    model = _model().to(spmd_torch.device())
    optimizer = syncfree.SGD(model.parameters(), lr=0.05, momentum=0.9)
    if scaler_kind == "spmd_torch.amp.GradScaler":
        scaler = GradScaler(**_SCALER_ARGS)
    else:  # torch's own scaler: its step reads the flag on the host, the rest runs on the device
        scaler = torch.amp.GradScaler("xla", **_SCALER_ARGS)
    for step, x in enumerate(_batches()):
        _train_step(model, optimizer, scaler, x.to(spmd_torch.device()))
        spmd_torch.sync()
        scale, tracker, params = expected[step]
        assert to_cpu(scaler._scale).item() == scale.item(), f"step {step}"
        assert to_cpu(scaler._growth_tracker).item() == tracker.item(), f"step {step}"
        assert_close(
            to_cpu(list(model.parameters())), params, **tolerance(torch.float32, "fwd", "training")
        )
    scales = [s.item() for s, _, _ in expected]
    assert scales == [2.0**10, 2.0**11, 2.0**9, 2.0**9, 2.0**10, 2.0**10]  # grew, backed off, grew


def test_training_step_reads_nothing_from_the_device():
    model = _model().to(spmd_torch.device())
    optimizer = syncfree.AdamW(model.parameters(), lr=0.01)
    scaler = GradScaler(**_SCALER_ARGS)
    batches = [x.to(spmd_torch.device()) for x in _batches()]
    spmd_torch.sync()
    for x in batches:
        with assert_counter_delta("TransferFromDevice", 0):
            _train_step(model, optimizer, scaler, x)
            spmd_torch.sync()


def test_use_zero_grad_steps_plain_optimizers_without_a_host_read():
    """With use_zero_grad, an overflowed step runs any optimizer on zeroed gradients: plain SGD
    (no momentum or decay) leaves the parameters where they were."""
    model = _model().to(spmd_torch.device())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    scaler = GradScaler(use_zero_grad=True, **_SCALER_ARGS)
    batches = [x.to(spmd_torch.device()) for x in _batches()[: _OVERFLOW_STEP + 1]]
    for x in batches[:-1]:
        _train_step(model, optimizer, scaler, x)
    spmd_torch.sync()
    before = to_cpu(list(model.parameters()))
    with assert_counter_delta("TransferFromDevice", 0):
        _train_step(model, optimizer, scaler, batches[-1])
        spmd_torch.sync()
    assert_close(to_cpu(list(model.parameters())), before, **tolerance(torch.float32, name="exact"))


def test_float16_gradients_refused_as_torch_refuses_them():
    model = _model().to(spmd_torch.device()).half()
    optimizer = syncfree.SGD(model.parameters(), lr=0.05)
    scaler = GradScaler()
    loss = model(torch.randn(4, 6).half().to(spmd_torch.device())).float().sum()
    scaler.scale(loss).backward()
    with pytest.raises(ValueError, match="Attempting to unscale FP16 gradients"):
        scaler.step(optimizer)
    spmd_torch.sync()
