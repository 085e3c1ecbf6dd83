"""MpDeviceLoader / ParallelLoader: values, placement, the barrier, errors and thread lifetime."""

from __future__ import annotations

import copy
import gc
import threading
import traceback

import numpy as np
import pytest
import torch

import spmd_torch
import spmd_torch.distributed.parallel_loader as pl
import spmd_torch.distributed.spmd as xs
from spmd_torch._lazy import placement, transfer
from spmd_torch._lazy.execute import global_array
from spmd_torch._lazy.layout import canonical
from spmd_torch.debug import metrics
from tests.helpers import assert_close, assert_compiles


class Batches:
    """A host loader over a fixed list of batches; ``fail_at`` raises when reaching that batch."""

    def __init__(self, batches: list, fail_at: int | None = None) -> None:
        self.batches = batches
        self.fail_at = fail_at

    def __iter__(self):
        for k, batch in enumerate(self.batches):
            if k == self.fail_at:
                broken_dataset_read(k)
            yield batch

    def __len__(self) -> int:
        return len(self.batches)


def broken_dataset_read(k: int) -> None:
    raise RuntimeError(f"corrupt record in batch {k}")


def xy_batches(n: int, rows: int = 16, features: int = 4, seed: int = 0) -> list:
    g = torch.Generator().manual_seed(seed)
    return [
        (torch.randn(rows, features, generator=g), torch.randn(rows, 1, generator=g))
        for _ in range(n)
    ]


def data_spec(rank: int = 2) -> xs.ShardingSpec:
    return xs.ShardingSpec(xs.get_1d_mesh("data"), ("data",) + (None,) * (rank - 1))


def mark_steps() -> int:
    return metrics.counter_value("MarkStep") or 0


def assert_placed(t: torch.Tensor, cpu: torch.Tensor, spec: xs.ShardingSpec, rows: int) -> None:
    """``t`` carries ``spec``'s sharding; each of the 8 shards holds ``rows`` rows of ``cpu``."""
    sharding = placement.sharding_of(t)
    assert sharding.is_equivalent_to(spec.sharding, t.dim())
    assert sharding == canonical(spec.sharding)
    shards = global_array(t).addressable_shards
    assert len(shards) == 8
    padded = torch.zeros(rows * 8, *cpu.shape[1:], dtype=cpu.dtype)
    padded[: cpu.shape[0]] = cpu
    for shard in shards:
        assert shard.data.shape == (rows, *cpu.shape[1:])
        start = shard.index[0].start or 0
        assert_close(torch.from_numpy(np.array(shard.data)), padded[start:][:rows], tol="exact")


def test_yields_the_cpu_loader_values_exactly():
    batches = [(x, y.long(), "tag", 3) for x, y in xy_batches(3)]
    loader = pl.MpDeviceLoader(Batches(batches), spmd_torch.device())
    out = list(loader)
    assert len(out) == len(batches) == len(loader)
    for got, expected in zip(out, batches):
        assert got[0].device == spmd_torch.device() and got[1].device == spmd_torch.device()
        assert got[2:] == ("tag", 3)
        assert_close(got, expected, tol="exact")


def test_dict_and_nested_batches_keep_their_structure():
    x, y = xy_batches(1)[0]
    batch = {"x": x, "pair": [y, (x[0], None)], "id": "a"}
    (got,) = list(pl.MpDeviceLoader(Batches([batch]), spmd_torch.device()))
    assert isinstance(got, dict) and isinstance(got["pair"], list)
    assert isinstance(got["pair"][1], tuple)
    assert got["x"].device.type == "xla" and got["pair"][1][0].device.type == "xla"
    assert_close(got, batch, tol="exact")


def test_sharded_input_gives_each_device_its_rows():
    spec = data_spec()
    batches = xy_batches(2)
    loader = pl.MpDeviceLoader(Batches(batches), spmd_torch.device(), input_sharding=spec)
    for (x, y), (cx, cy) in zip(loader, batches):
        assert_placed(x, cx, spec, rows=2)
        assert_placed(y, cy, spec, rows=2)
        assert_close((x, y), (cx, cy), tol="exact")


def test_sharded_input_uneven_batch_is_padded_per_shard():
    spec = data_spec()
    (cx, cy) = xy_batches(1, rows=10)[0]
    loader = pl.MpDeviceLoader(Batches([(cx, cy)]), spmd_torch.device(), input_sharding=spec)
    ((x, y),) = list(loader)
    assert tuple(x.shape) == (10, 4)
    assert_placed(x, cx, spec, rows=2)
    assert_close((x, y), (cx, cy), tol="exact")
    assert_close((x * 2).sum(0), (cx * 2).sum(0), tol="single_op")  # the padding adds nothing


@pytest.mark.parametrize("per_key", [False, True])
def test_minibatch_batch_must_divide_by_the_local_devices(per_key):
    """A minibatch spec (the host's part of a global batch) refuses a batch its 8 local devices
    cannot split evenly, naming the shape and the count; without minibatch it is padded."""
    spec = xs.ShardingSpec(xs.get_1d_mesh("data"), ("data", None), minibatch=True)
    x, _ = xy_batches(1, rows=7)[0]
    batches, sharding = ([{"x": x}], {"x": spec}) if per_key else ([x], spec)
    loader = pl.MpDeviceLoader(Batches(batches), spmd_torch.device(), input_sharding=sharding)
    with pytest.raises(RuntimeError, match=r"divisible by local .* shape = \(7, 4\), .* = 8"):
        list(loader)
    (even,) = list(pl.MpDeviceLoader(Batches([x[:0].new_ones(8, 4)]), "xla", input_sharding=spec))
    assert_placed(even, torch.ones(8, 4), spec, rows=1)


def test_sharded_input_uploads_shards_directly():
    """Each tensor is uploaded once, straight to its sharding (no replicated copy first)."""
    spec = data_spec()
    seen = []
    real = transfer.to_device_array

    def spy(t, sharding=None):
        seen.append(sharding)
        return real(t, sharding)

    loader = pl.MpDeviceLoader(Batches(xy_batches(2)), spmd_torch.device(), input_sharding=spec)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(transfer, "to_device_array", spy)
        list(loader)
    assert seen == [canonical(spec.sharding)] * 4


def test_one_spec_leaves_tensors_of_another_rank_unsharded():
    """As in PyTorch/XLA, a ShardingSpec applies to the tensors whose rank it fits."""
    x, y = xy_batches(1)[0]
    labels = y[:, 0].long()
    loader = pl.MpDeviceLoader(
        Batches([(x, labels)]), spmd_torch.device(), input_sharding=data_spec()
    )
    ((gx, glabels),) = list(loader)
    assert placement.sharding_of(gx) == canonical(data_spec().sharding)
    assert placement.sharding_of(glabels) == transfer.landing()
    assert_close((gx, glabels), (x, labels), tol="exact")


def test_dict_input_sharding_places_each_key():
    x, y = xy_batches(1)[0]
    labels = y[:, 0]
    sharding = {"x": data_spec(2), "labels": data_spec(1)}
    loader = pl.MpDeviceLoader(
        Batches([{"x": x, "labels": labels}]), spmd_torch.device(), input_sharding=sharding
    )
    (got,) = list(loader)
    assert_placed(got["x"], x, sharding["x"], rows=2)
    assert_placed(got["labels"], labels, sharding["labels"], rows=2)


def test_dict_input_sharding_of_wrong_rank_names_the_batch_element():
    x, y = xy_batches(1)[0]
    loader = pl.MpDeviceLoader(
        Batches([{"x": x, "y": y[:, 0]}]),
        spmd_torch.device(),
        input_sharding={"x": data_spec(2), "y": data_spec(2)},
    )
    with pytest.raises(
        ValueError, match=r"batch\['y'\].*2 entries but the tensor of shape \(16,\)"
    ):
        list(loader)


def test_dict_input_sharding_missing_key_raises():
    x, y = xy_batches(1)[0]
    loader = pl.MpDeviceLoader(
        Batches([{"x": x, "y": y}]), spmd_torch.device(), input_sharding={"x": data_spec()}
    )
    with pytest.raises(KeyError, match=r"\['y'\].*missing from input_sharding"):
        list(loader)


def test_input_sharding_of_wrong_type_is_rejected():
    with pytest.raises(ValueError, match=r"input_sharding must be .*got tuple"):
        pl.ParallelLoader(Batches([]), [spmd_torch.device()], input_sharding=("data", None))
    with pytest.raises(ValueError, match=r"input_sharding\['x'\] must be"):
        pl.ParallelLoader(Batches([]), [spmd_torch.device()], input_sharding={"x": ("data",)})


@pytest.mark.parametrize("device", ["cpu", torch.device("cpu"), "xla:8", "nonsense"])
def test_device_must_be_an_xla_device(device):
    with pytest.raises(ValueError, match=repr(str(device))):
        pl.MpDeviceLoader(Batches([]), device)
    with pytest.raises(ValueError, match=repr(str(device))):
        pl.ParallelLoader(Batches([]), [device])


def test_training_loop_matches_eager_cpu_and_compiles_once():
    torch.manual_seed(0)
    cpu_model = torch.nn.Linear(4, 1)
    model = copy.deepcopy(cpu_model).to(spmd_torch.device())
    cpu_opt = torch.optim.SGD(cpu_model.parameters(), lr=0.1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    batches = xy_batches(4)
    loader = pl.MpDeviceLoader(Batches(batches), spmd_torch.device(), input_sharding=data_spec())

    def epoch(model, opt, data):
        losses = []
        for x, y in data:
            opt.zero_grad()
            loss = torch.nn.functional.mse_loss(model(x), y)
            loss.backward()
            opt.step()
            losses.append(loss.detach())
        return losses

    expected = epoch(cpu_model, cpu_opt, batches) + epoch(cpu_model, cpu_opt, batches)
    with assert_compiles(1):  # one step program, reused by every later step
        first = epoch(model, opt, loader)
    with assert_compiles(0):
        second = epoch(model, opt, loader)
    assert_close(torch.stack(first + second), torch.stack(expected))
    assert_close(dict(model.named_parameters()), dict(cpu_model.named_parameters()))


@pytest.mark.parametrize("per_execution", [1, 2])
def test_mark_step_once_per_batches_per_execution(per_execution):
    loader = pl.MpDeviceLoader(
        Batches(xy_batches(5)), spmd_torch.device(), batches_per_execution=per_execution
    )
    start = mark_steps()
    for k, _ in enumerate(loader, start=1):
        # PyTorch/XLA's count: the barrier comes before batches per_execution, 2 * per_execution...
        expected = k if per_execution == 1 else k // per_execution
        assert mark_steps() - start == expected
    # The sixth next() is due a barrier on the same count, then one more ends the iteration.
    assert mark_steps() - start == (7 if per_execution == 1 else 4)


def test_loader_error_is_raised_in_order_with_its_traceback():
    batches = xy_batches(4)
    loader = pl.MpDeviceLoader(Batches(batches, fail_at=2), spmd_torch.device())
    got = []
    with pytest.raises(RuntimeError, match="corrupt record in batch 2") as info:
        for x, _ in loader:
            got.append(x.cpu())
    assert len(got) == 2
    assert_close(got, [x for x, _ in batches[:2]], tol="exact")
    frames = [frame.name for frame in traceback.extract_tb(info.tb)]
    assert "broken_dataset_read" in frames and "test_loader_error_is_raised_in_order" in frames[0]
    assert any("reading batch 2" in note for note in info.value.__notes__)


def test_upload_error_is_raised_on_the_main_thread():
    def refuse(t, sharding=None):
        raise MemoryError("device full")

    loader = pl.MpDeviceLoader(Batches(xy_batches(2)), spmd_torch.device())
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(transfer, "to_device_array", refuse)
        with pytest.raises(MemoryError, match="device full"):
            next(iter(loader))


def test_threads_only_transfer_and_the_main_thread_makes_tensors():
    calls = {"transfer": set(), "adopt": set()}
    real_transfer, real_adopt = transfer.to_device_array, placement.adopt

    def spy_transfer(*args):
        calls["transfer"].add(threading.current_thread())
        return real_transfer(*args)

    def spy_adopt(*args):
        calls["adopt"].add(threading.current_thread())
        return real_adopt(*args)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(transfer, "to_device_array", spy_transfer)
        mp.setattr(placement, "adopt", spy_adopt)
        list(pl.MpDeviceLoader(Batches(xy_batches(3)), spmd_torch.device()))
    assert calls["adopt"] == {threading.main_thread()}
    assert threading.main_thread() not in calls["transfer"] and calls["transfer"]


def test_breaking_early_and_dropping_the_loader_stops_its_threads():
    loader = pl.MpDeviceLoader(
        Batches(xy_batches(40)), spmd_torch.device(), loader_prefetch_size=2, device_prefetch_size=2
    )
    for k, _ in enumerate(loader):
        if k == 1:
            break
    threads = list(loader._parallel_loader._threads)
    assert any(thread.is_alive() for thread in threads)  # blocked on full queues
    del loader, _
    gc.collect()
    for thread in threads:
        thread.join(timeout=2)
    assert not any(thread.is_alive() for thread in threads)


def test_exit_stops_and_joins_live_loader_threads_before_jax_shuts_down():
    loader = pl.MpDeviceLoader(
        Batches(xy_batches(40)), spmd_torch.device(), loader_prefetch_size=2, device_prefetch_size=2
    )
    next(iter(loader))
    threads = list(loader._parallel_loader._threads)
    assert any(thread.is_alive() for thread in threads)  # blocked on full queues
    pl._stop_pipelines()  # what interpreter exit runs, before JAX's own exit handlers
    assert not any(thread.is_alive() for thread in threads)


def test_close_stops_the_threads_and_ends_iteration():
    para = pl.ParallelLoader(Batches(xy_batches(40)), [spmd_torch.device()], device_prefetch_size=2)
    it = para.per_device_loader(spmd_torch.device())
    next(it)
    para.close()
    assert not any(thread.is_alive() for thread in para._threads)
    with pytest.raises(StopIteration):
        next(it)


def test_exhausted_loader_stops_its_threads():
    para = pl.ParallelLoader(Batches(xy_batches(3)), [spmd_torch.device()])
    assert len(list(para.per_device_loader("xla"))) == 3 == para.per_device_samples()
    for thread in para._threads:
        thread.join(timeout=2)
    assert not any(thread.is_alive() for thread in para._threads)


def test_several_transfer_threads_keep_the_loader_order():
    batches = [(torch.full((8, 2), float(k)),) for k in range(12)]
    loader = pl.MpDeviceLoader(
        Batches(batches),
        spmd_torch.device(),
        host_to_device_transfer_threads=3,
        input_sharding=data_spec(),
    )
    assert_close(list(loader), batches, tol="exact")


def test_each_epoch_restarts_the_loader():
    batches = xy_batches(2)
    loader = pl.MpDeviceLoader(Batches(batches), spmd_torch.device())
    assert_close(list(loader), batches, tol="exact")
    assert_close(list(loader), batches, tol="exact")
