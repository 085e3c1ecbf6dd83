"""The legacy DataParallel API: one replica per device, batches dealt in turn, gradients averaged
by xm.optimizer_step, against an eager CPU reference; torch_xla_py's numbers the batches."""

from __future__ import annotations

import copy
import itertools

import pytest
import torch

import spmd_torch.core.xla_model as xm
import spmd_torch.distributed.data_parallel as dp
import spmd_torch.distributed.legacy_data_parallel as legacy_dp
import spmd_torch.utils.utils as xu
from tests.helpers import assert_close

DEVICES = 8
BATCH = 4


def _net() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))


def _batches(count: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(7)
    return [
        (torch.randn(BATCH, 6, generator=generator), torch.randn(BATCH, 3, generator=generator))
        for _ in range(count)
    ]


def _train_loop(model, loader, device, context):
    """A PyTorch/XLA-style loop: optimizer kept in the context, xm.optimizer_step per batch."""
    optimizer = context.getattr_or("optimizer", lambda: torch.optim.SGD(model.parameters(), 0.1))
    losses = []
    for data, target in loader:
        optimizer.zero_grad()
        loss = torch.nn.functional.mse_loss(model(data), target)
        loss.backward()
        xm.optimizer_step(optimizer)
        losses.append(loss.detach())
    return torch.stack(losses).cpu()


def _reference(initial, batches, epochs: int, devices: int):
    """Eager CPU SGD, each step on the gradient averaged over one round of ``devices`` batches
    (an incomplete last round is dropped, as DataParallel does)."""
    model = copy.deepcopy(initial)
    optimizer = torch.optim.SGD(model.parameters(), 0.1)
    losses = []
    rounds = len(batches) // devices
    for _ in range(epochs):
        for r in range(rounds):
            optimizer.zero_grad()
            step = [
                torch.nn.functional.mse_loss(model(x), y)
                for x, y in batches[r * devices : (r + 1) * devices]
            ]
            torch.stack(step).mean().backward()
            optimizer.step()
            losses.append(torch.stack(step).detach())
    return torch.stack(losses), dict(model.state_dict())


def test_data_parallel_trains_as_sgd_on_the_averaged_gradient_across_calls():
    torch.manual_seed(0)
    initial = _net()
    batches = _batches(DEVICES * 2 + 3)  # the 3 of the incomplete last round are dropped
    model_parallel = dp.DataParallel(copy.deepcopy(initial))
    first = model_parallel(_train_loop, batches)
    second = model_parallel(_train_loop, batches)  # models and optimizers carry on

    expected_losses, expected_state = _reference(initial, batches, epochs=2, devices=DEVICES)
    assert len(first) == len(second) == DEVICES
    for index in range(DEVICES):
        losses = torch.cat([first[index], second[index]])
        assert_close(losses, expected_losses[:, index])
        state = {k: v.cpu() for k, v in model_parallel.models[index].state_dict().items()}
        assert_close(state, expected_state)


def test_batches_are_dealt_in_turn_and_an_incomplete_round_is_dropped():
    """Each device's loader yields its batches alone, as PyTorch/XLA 2.9's per-device loader."""
    batches = [torch.full((1,), float(k)) for k in range(3 * 3 + 2)]

    def loop(model, loader, device, context):
        return [(batch.device.type, int(batch.item())) for batch in loader]

    results = dp.DataParallel(_net(), device_ids=["xla:0", "xla:1", "xla:2"])(loop, batches)
    assert results == [[("xla", 3 * r + i) for r in range(3)] for i in range(3)]


def test_a_sample_generator_is_dealt_once_through():
    """``xu.SampleGenerator`` restarts on every ``iter()`` (as PyTorch/XLA's); its samples are
    still dealt once each: ``sample_count`` rounds over the devices, as PyTorch/XLA's
    TestParallelTensorMNIST feeds DataParallel."""
    loader = xu.SampleGenerator(data=(torch.zeros(2, 6), torch.zeros(2, 3)), sample_count=3 * 2)

    def loop(model, loader, device, context):
        return sum(1 for _ in itertools.islice(loader, 10))  # bounded: a restart never ends

    assert dp.DataParallel(_net(), device_ids=["xla:0", "xla:1"])(loop, loader) == [3, 3]


def test_torch_xla_py_data_parallel_numbers_each_devices_batches():
    """torch_xla_py.data_parallel's loader (seed guide 002) yields ``(batch_number, batch)``."""
    batches = [torch.full((1,), float(k)) for k in range(2 * 3)]

    def loop(model, loader, device, context):
        return [(number, int(batch.item())) for number, batch in loader]

    results = legacy_dp.DataParallel(_net(), device_ids=["xla:0", "xla:1"])(loop, batches)
    assert results == [[(r, 2 * r + i) for r in range(3)] for i in range(2)]


def test_device_ids_pick_the_replicas_and_each_runs_on_its_own_copy():
    network = _net()
    model_parallel = dp.DataParallel(network, device_ids=["xla:0", "xla:1"])
    assert model_parallel.devices == ["xla:0", "xla:1"]
    models = model_parallel.models
    assert len(models) == 2 and models[0] is not models[1] and network not in models
    for copy_ in models:
        assert_close(copy_.state_dict(), network.state_dict(), tol="exact")

    def loop(model, loader, device, context):
        return str(device), str(next(model.parameters()).device), context.device == device

    assert model_parallel(loop, []) == [("xla:0", "xla:0", True)] * 2


def test_default_device_ids_are_one_per_accelerator():
    assert dp.DataParallel(_net()).devices == [f"xla:{i}" for i in range(DEVICES)]


def test_empty_device_ids_run_the_network_itself_once_on_the_cpu():
    network = _net()
    model_parallel = dp.DataParallel(network, device_ids=[])
    batches = _batches(3)

    def loop(model, loader, device, context):
        return model is network, device, [number for number, _ in loader]

    assert model_parallel.devices == ["cpu"]
    assert model_parallel(loop, batches) == [(True, torch.device("cpu"), [0, 1, 2])]


def test_network_may_be_a_function_building_it():
    model_parallel = dp.DataParallel(_net, device_ids=["xla:0", "xla:1"])
    assert all(isinstance(m, torch.nn.Sequential) for m in model_parallel.models)


def test_context_getattr_or_makes_a_value_once_per_device():
    made = []

    def loop(model, loader, device, context):
        return context.getattr_or("state", lambda: made.append(1) or object())

    model_parallel = dp.DataParallel(_net(), device_ids=["xla:0", "xla:1"])
    first, second = model_parallel(loop, []), model_parallel(loop, [])
    assert first == second and first[0] is not first[1] and len(made) == 2
    assert dp.Context(torch.device("cpu")).getattr_or("step", 0) == 0


def test_fixed_batch_size_stops_at_the_first_batch_of_another_size():
    batches = [torch.zeros(4, 2)] * 4 + [torch.zeros(3, 2)] + [torch.zeros(4, 2)] * 2

    def loop(model, loader, device, context):
        return sum(1 for _ in loader)

    model_parallel = dp.DataParallel(_net(), device_ids=["xla:0", "xla:1"])
    assert model_parallel(loop, batches, fixed_batch_size=True) == [2, 2]
    assert model_parallel(loop, batches) == [3, 3]


@pytest.mark.parametrize(
    "device_ids, message",
    [
        (["cpu"], r"'cpu' is not an xla device"),
        (["xla:8"], r"'xla:8' is not an xla device 'xla:N' with N < 8"),
        (["xla:1", "xla:1"], r"name a device twice"),
    ],
)
def test_bad_device_ids_are_named(device_ids, message):
    with pytest.raises(ValueError, match=message):
        dp.DataParallel(_net(), device_ids=device_ids)
