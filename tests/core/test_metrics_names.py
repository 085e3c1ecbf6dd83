"""PyTorch/XLA's metric names with their meanings and units, XLA_METRICS_FILE, LTC_USE_BF16."""

from __future__ import annotations

import threading

import pytest
import torch

import spmd_torch
import spmd_torch.debug.metrics as met
import spmd_torch.runtime as xr
from spmd_torch import config
from spmd_torch._lazy import compile as compile_module
from spmd_torch._lazy import counters
from spmd_torch.distributed.spmd import Mesh, mark_sharding

dev = spmd_torch.device()


pytestmark = pytest.mark.usefixtures("isolated_metrics")  # tests here clear the store


def _samples(name: str) -> list[float]:
    data = met.metric_data(name)
    return [] if data is None else [value for _, value in data[2]]


def test_outbound_data_is_the_uploaded_bytes():
    met.clear_all()
    host = torch.arange(30, dtype=torch.float32).reshape(5, 6)
    host.to(dev)
    assert _samples("OutboundData") == [120.0]
    torch.ones(3, dtype=torch.int64).to(dev)
    assert _samples("OutboundData") == [120.0, 24.0]
    assert "Metric: OutboundData" in met.metrics_report()
    assert "Accumulator: 144.00B" in met.metrics_report()


def test_inbound_data_is_the_downloaded_bytes():
    x = torch.ones(4, 5, dtype=torch.float64).to(dev) * 2
    spmd_torch.sync()
    met.clear_all()
    x.cpu()
    (x[0, 0] + 0).item()
    assert _samples("InboundData") == [160.0, 8.0]


def test_tensors_graph_size_is_the_node_count_of_each_program():
    x = torch.ones(3).to(dev)
    spmd_torch.sync()
    met.clear_all()
    y = (x * 2).sin() + 1  # mul, sin, add
    spmd_torch.sync()
    (y.exp()).cpu()  # one node
    assert _samples("TensorsGraphSize") == [3.0, 1.0]
    assert met.metric_data("ExecuteTime")[0] == 2
    assert met.metric_data("ExecuteReplicatedTime") is None


def test_programs_over_the_spmd_devices_are_replicated_executions():
    xr.use_spmd()
    mesh = Mesh(list(range(8)), (8,), ("data",))
    x = torch.ones(8, 4).to(dev)
    mark_sharding(x, mesh, ("data", None))
    spmd_torch.sync()
    met.clear_all()
    assert (x * 3).sum().item() == 96.0
    assert met.metric_data("ExecuteReplicatedTime")[0] == 1
    assert met.metric_data("ExecuteTime") is None
    xr.reset()


def test_metrics_file_gets_one_report_per_step(tmp_path, monkeypatch):
    path = tmp_path / "metrics.txt"
    monkeypatch.setattr(config.METRICS_FILE, "value", str(path))
    x = torch.ones(2).to(dev)
    for _ in range(3):
        x = x + 1
        spmd_torch.sync()
    text = path.read_text()
    assert text.count("Counter: MarkStep") == 3
    assert text.count("Metric: ExecuteTime") == 3
    assert torch.equal(x.cpu(), torch.full((2,), 4.0))


@pytest.mark.parametrize("where", ["STDOUT", "STDERR"])
def test_metrics_file_special_names_print(where, capsys, monkeypatch):
    monkeypatch.setattr(config.METRICS_FILE, "value", where)
    y = torch.ones(2).to(dev) * 5
    spmd_torch.sync()
    out, err = capsys.readouterr()
    printed, other = (out, err) if where == "STDOUT" else (err, out)
    assert "Counter: MarkStep" in printed and "Counter: MarkStep" not in other
    assert torch.equal(y.cpu(), torch.full((2,), 5.0))


def test_metrics_file_unset_writes_nothing(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(config.METRICS_FILE, "value", None)
    monkeypatch.chdir(tmp_path)
    spmd_torch.sync()
    assert list(tmp_path.iterdir()) == []
    assert "Counter:" not in capsys.readouterr().out


@pytest.mark.parametrize("name", ["XLA_USE_BF16", "LTC_USE_BF16"])
def test_ltc_use_bf16_is_an_alias_of_xla_use_bf16(name, monkeypatch):
    monkeypatch.delenv("XLA_USE_BF16", raising=False)
    monkeypatch.delenv("LTC_USE_BF16", raising=False)
    assert config.USE_BF16.read() is False
    monkeypatch.setenv(name, "1")
    assert config.USE_BF16.read() is True
    assert "LTC_USE_BF16" not in config.FLAGS  # one switch, two names


def test_lazy_tracing_is_one_sample_per_traced_op():
    x = torch.ones(3).to(dev)
    spmd_torch.sync()
    met.clear_all()
    y = (x * 2).sin() + 1  # mul, sin, add
    count, accumulator, samples = met.metric_data("LazyTracing")
    assert count == 3 and len(samples) == 3
    assert accumulator == sum(value for _, value in samples) > 0
    del y


def test_lazy_tracing_samples_survive_barriers_threads_and_clears():
    x = torch.ones(3).to(dev)
    spmd_torch.sync()
    met.clear_all()
    y = x + 1
    spmd_torch.sync()  # the barrier folds what was traced so far
    assert not counters.TRACING
    worker = threading.Thread(target=lambda: [x * 2 for _ in range(50)])
    worker.start()
    z = [x - 1 for _ in range(50)]
    worker.join()
    assert met.metric_data("LazyTracing")[0] == 101  # 1 + 50 + 50: none lost between threads
    w = x.neg()
    met.clear_metrics()  # samples not folded yet go too
    assert met.metric_data("LazyTracing") is None
    del y, z, w


def test_metrics_keep_counts_and_sums_past_the_window_of_samples():
    met.clear_all()
    for value in range(1, 2001):
        counters.record("Probe", value)
    count, accumulator, samples = met.metric_data("Probe")
    assert (count, accumulator) == (2000, 2000 * 2001 / 2)
    assert [value for _, value in samples] == list(range(977, 2001))  # the latest 1024
    assert counters.METRICS["Probe"].since(1990) == list(range(1991, 2001))


def test_create_and_destroy_xla_tensor_count_storages_made_and_freed():
    met.clear_all()
    x = torch.ones(3, device=dev)  # one storage
    assert met.counter_value("CreateXlaTensor") == 1
    assert met.counter_value("DestroyXlaTensor") is None
    y = x * 2 + 1  # two more; the product's is freed once the sum is bound
    assert met.counter_value("CreateXlaTensor") == 3
    assert met.counter_value("DestroyXlaTensor") == 1
    del y
    assert met.counter_value("DestroyXlaTensor") == 2
    assert {"CreateXlaTensor", "DestroyXlaTensor"} <= set(met.counter_names())
    met.clear_counters()
    assert met.counter_value("CreateXlaTensor") is None
    del x
    assert met.counter_value("DestroyXlaTensor") == 1  # a storage made before the clear, freed
    assert "Counter: DestroyXlaTensor\n  Value: 1" in met.metrics_report()


def test_device_data_cache_miss_counts_scalar_uploads_a_repeat_reuses():
    x = torch.ones(3, device=dev)
    spmd_torch.sync()
    compile_module.clear_cache()  # the scalars an earlier test left on the device go with it
    met.clear_all()
    for scale in (0.5, 0.5, 0.25, 0.5):
        y = x * scale
        spmd_torch.sync()
        assert y.cpu().tolist() == [scale] * 3
    assert met.counter_value("DeviceDataCacheMiss") == 2  # 0.5 and 0.25, each uploaded once
    assert met.counter_value("UncachedCompile") == 1


def test_a_scalar_upload_is_a_transfer_and_other_programs_reuse_it():
    """The packed scalars' upload is timed as TransferToDeviceTime, as a tensor's; another
    program with the same scalars (here one slot, 0.1, read twice) uploads nothing, as
    PyTorch/XLA's device data cache (its test_cached_addcdiv)."""
    compile_module.clear_cache()
    met.clear_all()
    t1, t2, t3 = (torch.randn(1, 3).to(dev) for _ in range(3))
    want = t1.cpu().addcdiv(t2.cpu(), t3.cpu(), value=0.1)
    t1.addcdiv_(t2, t3, value=0.1)
    spmd_torch.sync()
    assert met.metric_data("TransferToDeviceTime")[0] == 4
    t1.addcdiv_(t2, t3, value=0.1)
    t1.addcdiv_(t2, t3, value=0.1)
    spmd_torch.sync()
    assert met.metric_data("TransferToDeviceTime")[0] == 4
    assert met.counter_value("DeviceDataCacheMiss") == 1
    for _ in range(2):
        want = want.addcdiv(t2.cpu(), t3.cpu(), value=0.1)
    torch.testing.assert_close(t1.cpu(), want)


def test_execute_time_covers_the_execution_not_the_dispatch():
    x = torch.randn(512, 512, device=dev)
    spmd_torch.sync()
    met.clear_all()
    y = x
    for _ in range(20):
        y = y @ x / 512
    spmd_torch.sync()
    executed = met.metric_data("ExecuteTime")
    dispatched = met.metric_data("DispatchTime")
    assert executed[0] == dispatched[0] == 1
    assert met.counter_value("ExecuteComputation") == 1
    assert executed[1] > dispatched[1]  # twenty 512x512 matmuls take longer than a dispatch
    assert met.metric_data("DeviceLockWait")[0] == 1
    assert _samples("UnwrapXlaData") == _samples("GatherTime")
    assert _samples("WrapXlaData") == _samples("BindTime")
