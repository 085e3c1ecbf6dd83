"""The xla_model names PyTorch/XLA scripts use beyond the core ones: RateTracker, sending CPU
data to the device, device names, rendezvous helpers, bucketized collectives, memory info."""

from __future__ import annotations

import collections

import pytest
import torch

import spmd_torch
import spmd_torch.core.xla_model as xm
import spmd_torch.distributed.spmd as xs
import spmd_torch.runtime as xr
import spmd_torch.utils.utils as xu
from tests.helpers import assert_close

DEV = xm.xla_device()


class Clock:
    def __init__(self, now: float = 100.0):
        self.now = now

    def __call__(self) -> float:
        return self.now


def test_rate_tracker_rates_for_known_counts_and_times():
    clock = Clock()
    tracker = xm.RateTracker(smooth_factor=0.25, clock=clock)
    tracker.add(50)
    clock.now += 2.0
    assert tracker.rate() == pytest.approx(25.0)  # the first rate is not smoothed
    tracker.add(30)
    tracker.add(10)
    clock.now += 1.0
    assert tracker.rate() == pytest.approx(0.75 * 40.0 + 0.25 * 25.0)
    assert tracker.global_rate() == pytest.approx(90.0 / 3.0)
    tracker.add(6)
    clock.now += 3.0
    assert tracker.global_rate() == pytest.approx(96.0 / 6.0)


def test_rate_tracker_no_elapsed_time_reports_zero():
    tracker = xm.RateTracker(clock=Clock())
    tracker.add(5)
    assert tracker.rate() == 0.0
    assert tracker.global_rate() == 0.0


def test_rate_tracker_smoothing_comes_from_the_environment(monkeypatch):
    monkeypatch.setenv("RATE_TRACKER_SMOOTHING", "0.5")
    clock = Clock()
    tracker = xm.RateTracker(clock=clock)
    tracker.add(10)
    clock.now += 1.0
    tracker.rate()
    tracker.add(30)
    clock.now += 1.0
    assert tracker.rate() == pytest.approx(0.5 * 30.0 + 0.5 * 10.0)


def test_send_cpu_data_to_device_moves_every_cpu_tensor_keeping_the_structure():
    Batch = collections.namedtuple("Batch", "x y")
    x, y, z = torch.arange(6.0).reshape(2, 3), torch.tensor([1, 2]), torch.ones(2, device=DEV)
    data = {"batch": Batch(x, y), "extra": [x, "label", 3], "ready": z}
    moved = xm.send_cpu_data_to_device(data, DEV)
    assert type(moved["batch"]) is Batch
    assert moved["batch"].x.device.type == "xla" and moved["batch"].y.device.type == "xla"
    assert moved["extra"][0] is moved["batch"].x  # one tensor held twice moves once
    assert moved["extra"][1:] == ["label", 3] and moved["ready"] is z
    assert_close((moved["batch"].x, moved["batch"].y), (x, y), tol="exact")
    assert data["batch"].x.device.type == "cpu"  # the input is left as it was


def test_send_cpu_data_to_device_wraps_a_single_tensor_in_a_list():
    (moved,) = xm.send_cpu_data_to_device(torch.tensor([1.0, 2.0]), DEV)
    assert moved.device.type == "xla"
    assert_close(moved, torch.tensor([1.0, 2.0]), tol="exact")


def test_send_cpu_data_to_device_refuses_a_cpu_device():
    with pytest.raises(ValueError, match="cpu is not an xla device"):
        xm.send_cpu_data_to_device(torch.ones(2), "cpu")


def test_send_cpu_data_to_device_shards_with_input_sharding():
    mesh = xs.get_1d_mesh("data")
    spec = xs.ShardingSpec(mesh, ("data", None))
    batch = torch.arange(32.0).reshape(8, 4)
    labels = torch.arange(8)  # one dimension: the two-entry spec does not fit, replicated
    moved_batch, moved_labels = xm.send_cpu_data_to_device([batch, labels], DEV, spec)
    assert xr.is_spmd()
    assert xs.get_xla_sharding_spec(moved_batch) == xs.get_xla_sharding_spec(
        xs.mark_sharding(torch.zeros(8, 4, device=DEV), mesh, ("data", None))
    )
    assert_close((moved_batch, moved_labels), (batch, labels), tol="exact")
    xr.reset()


def test_send_cpu_data_to_device_minibatch_must_divide_by_local_devices():
    spec = xs.ShardingSpec(xs.get_1d_mesh("data"), ("data",), minibatch=True)
    with pytest.raises(RuntimeError, match=r"divisible by local .* shape = \(6,\), .* = 8"):
        xm.send_cpu_data_to_device(torch.ones(6), DEV, spec)
    xr.reset()


def test_to_xla_tensor_arena_converts_all_selected_tensors_in_one_call():
    calls = []

    def convert(tensors):
        calls.append(len(tensors))
        return [t * 10 for t in tensors]

    a, b = torch.tensor([1]), torch.tensor([2])
    out = xm.ToXlaTensorArena(convert, torch.is_tensor).transform({"a": a, "b": (b, a)})
    assert calls == [2]
    assert out["a"].item() == 10 and out["b"][0].item() == 20 and out["b"][1] is out["a"]


def test_device_names():
    assert xm.parse_xla_device("CUDA:3") == ("CUDA", 3)
    assert xm.parse_xla_device("xla:0") is None
    assert xm.xla_device_kind() == "cpu"
    assert xm.xla_replication_devices([DEV]) == [f"CPU:{i}" for i in range(8)]
    assert xm.xla_replication_devices(["xla:3"]) == [f"CPU:{i}" for i in range(8)]
    with pytest.raises(RuntimeError, match="'xla:8'.* 8 xla devices"):
        xm.xla_replication_devices(["xla:8"])


def test_get_memory_info_refuses_a_runtime_without_statistics():
    with pytest.raises(RuntimeError, match="CPU runtime keeps no memory statistics"):
        xm.get_memory_info()


def test_xla_rendezvous_checks_its_payload_outside_launch():
    assert xm.xla_rendezvous(b"ready", tag="t") == [b"ready"]
    with pytest.raises(TypeError, match="payload must be bytes, not str"):
        xm.xla_rendezvous("ready")


def test_rendezvous_helpers_and_broadcast_inside_launch():
    def body(index):
        shared = xm.xla_rendezvous(bytes([index]), tag="bytes")
        ran = xm.do_on_ordinals(lambda t: t.tolist(), (torch.tensor([index * 1.0], device=DEV),))
        model = torch.nn.Linear(2, 1).to(xm.xla_device())
        with torch.no_grad():  # uploaded, not a per-replica constant: one graph for all
            model.weight.copy_(torch.full((1, 2), float(index)).to(xm.xla_device()))
        xm.broadcast_master_param(model)
        return shared, ran, model.weight.cpu().tolist()

    results = spmd_torch.launch(body)
    for index, (shared, ran, weight) in results.items():
        assert shared == [bytes([k]) for k in range(8)]
        assert ran == ([0.0] if index == 0 else None)
        assert weight == [[0.0, 0.0]]


def test_bucketized_collectives_match_the_plain_ones_inside_launch():
    def body(index):
        a = torch.full((8, 2), float(index)).to(xm.xla_device())  # data: one graph for all
        b = (torch.arange(16.0).reshape(8, 2) + index).to(xm.xla_device())
        gathered = xm.all_gather_bucketized([a, b], dim=1)
        scattered = xm.reduce_scatter_bucketized(xm.REDUCE_SUM, [a, b], 0.5, 0, 8)
        grads = [a.clone(), b.clone()]
        xm.all_reduce_bucketized_gradients(grads, 1.0 / 8, None, False, bucket_cap_mb=1)
        return [t.cpu() for t in (*gathered, *scattered, *grads)]

    results = spmd_torch.launch(body)
    a = [torch.full((8, 2), float(k)) for k in range(8)]
    b = [torch.arange(16.0).reshape(8, 2) + k for k in range(8)]
    for index, got in results.items():
        expected = [
            torch.cat(a, dim=1),
            torch.cat(b, dim=1),
            0.5 * sum(a)[index : index + 1],
            0.5 * sum(b)[index : index + 1],
            sum(a) / 8,
            sum(b) / 8,
        ]
        # small integers, halves and eighths: exact in float32
        assert_close(got, expected, tol="exact")


def test_all_gather_bucketized_refuses_pin_layout():
    with pytest.raises(RuntimeError, match="pin_layout=True"):
        xm.all_gather_bucketized([torch.ones(2, device=DEV)], pin_layout=True)


def test_rewrite_instances_still_numbers_distinct_values_in_order():
    a, b = torch.tensor(1), torch.tensor(2)
    out = xm.rewrite_instances([a, (b, a)], torch.is_tensor, lambda t, i: i)
    assert out == [0, (1, 0)]
    assert xu.for_each_instance_rewrite([1, 2], torch.is_tensor, str) == [1, 2]
