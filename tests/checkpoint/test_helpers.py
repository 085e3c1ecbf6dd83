"""The distributed checkpoint's _helpers (what PyTorch/XLA's checkpoint tests import): a state
dict staged on the host with sharded tensors kept as their shards, the sharded test, and the
state-dict walks with _CpuShards counted as tensors."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch.distributed.checkpoint._nested_dict import flatten_state_dict as dcp_flatten

import spmd_torch
import spmd_torch.debug.metrics as met
import spmd_torch.distributed.spmd as xs
import spmd_torch.runtime as xr
from spmd_torch.experimental.distributed_checkpoint._helpers import (
    _cpu_shards_from_tensors,
    _CpuShards,
    _is_sharded_tensor,
    _sharded_cpu_state_dict,
    _unwrap_xla_sharded_tensor,
    flatten_state_dict,
    narrow_tensor_by_index,
    unflatten_state_dict,
)
from tests.helpers import assert_close

dev = spmd_torch.device()


@pytest.fixture
def spmd_mode():
    xr.use_spmd()


def _mesh() -> xs.Mesh:
    return xs.Mesh(np.arange(8), (2, 4), ("x", "y"))


def _assembled(cpu: _CpuShards) -> torch.Tensor:
    """The whole tensor from its shards; every replica must agree with what is there."""
    full = torch.full(cpu.global_shape, float("nan"))
    for shard in cpu.shards:
        index = tuple(shard.indices) if shard.indices is not Ellipsis else ...
        if not torch.isnan(full[index]).all():
            assert_close(full[index], shard.unpadded_data)
        full[index] = shard.unpadded_data
    return full


def test_sharded_tensors_stay_shards_and_the_rest_become_cpu_tensors(spmd_mode):
    tiled, partial, replicated, plain = (torch.randn(8, 8) for _ in range(4))
    state = {
        "model": {"tiled": tiled.to(dev), "partial": partial.to(dev)},
        "rest": [replicated.to(dev), plain.to(dev), torch.ones(2), 3, "step"],
    }
    xs.mark_sharding(state["model"]["tiled"], _mesh(), ("x", "y"))
    xs.mark_sharding(state["model"]["partial"], _mesh(), (None, "y"))
    xs.mark_sharding(state["rest"][0], _mesh(), (None, None))
    cpu = _sharded_cpu_state_dict(state)
    assert list(cpu) == ["model", "rest"] and isinstance(cpu["rest"], list)
    for name, expected in (("tiled", tiled), ("partial", partial)):
        shards = cpu["model"][name]
        assert isinstance(shards, _CpuShards) and len(shards.shards) == 8
        assert shards.global_shape == torch.Size([8, 8])
        assert all(s.data.device == torch.device("cpu") for s in shards.shards)
        assert_close(_assembled(shards), expected)
    for got, expected in zip(cpu["rest"][:2], (replicated, plain)):
        assert type(got) is torch.Tensor and got.device == torch.device("cpu")
        assert_close(got, expected)
    assert cpu["rest"][2] is state["rest"][2] and cpu["rest"][3:] == [3, "step"]


def test_partially_replicated_shards_carry_their_replica_ids(spmd_mode):
    t = torch.arange(32.0).reshape(8, 4).to(dev)
    xs.mark_sharding(t, _mesh(), ("y", None))  # 4 row blocks, each on the 2 devices of "x"
    (cpu,) = _cpu_shards_from_tensors([t])
    assert sorted(s.replica_id for s in cpu.shards) == [0, 0, 0, 0, 1, 1, 1, 1]
    rows = sorted(s.indices[0].start for s in cpu.shards if s.replica_id == 0)
    assert rows == [0, 2, 4, 6]  # one copy of each distinct block has replica id 0
    assert_close(_assembled(cpu), torch.arange(32.0).reshape(8, 4))


def test_uneven_shards_come_padded_as_the_devices_hold_them(spmd_mode):
    t = torch.arange(10.0).to(dev)
    xs.mark_sharding(t, xs.get_1d_mesh(), (0,))
    (cpu,) = _cpu_shards_from_tensors([xs.wrap_as_sharded_tensor(t)])
    assert cpu.global_shape == torch.Size([10])
    assert [tuple(s.data.shape) for s in cpu.shards] == [(2,)] * 8  # PyTorch/XLA's padded data
    assert [tuple(s.unpadded_data.shape) for s in cpu.shards] == [(2,)] * 5 + [(0,)] * 3
    assert all(s.data.abs().sum() == 0 for s in cpu.shards[5:])  # zero padding
    assert_close(_assembled(cpu), torch.arange(10.0))


def test_pending_values_are_computed_in_one_program(spmd_mode):
    w = torch.randn(8, 8).to(dev)
    xs.mark_sharding(w, _mesh(), ("x", "y"))
    spmd_torch.sync()
    state = {"w": w * 2, "b": w.sum(0), "c": w + 1}
    xs.mark_sharding(state["w"], _mesh(), ("x", "y"))
    runs = (met.metric_data("ExecuteReplicatedTime") or (0,))[0]
    cpu = _sharded_cpu_state_dict(state)
    assert met.metric_data("ExecuteReplicatedTime")[0] == runs + 1
    assert_close(_assembled(cpu["w"]), w.cpu() * 2)
    assert_close(cpu["b"], w.cpu().sum(0))


def test_requires_grad_is_kept_on_the_cpu_copies(spmd_mode):
    p = torch.nn.Parameter(torch.randn(4).to(dev))
    cpu = _sharded_cpu_state_dict({"p": p, "q": p.detach()})
    assert cpu["p"].requires_grad and not cpu["q"].requires_grad
    assert cpu["p"].is_leaf


def test_is_sharded_tensor_only_for_split_data(spmd_mode):
    def wrapped(spec):
        t = torch.zeros(8, 8).to(dev)
        return xs.mark_sharding(t, _mesh(), spec)

    assert _is_sharded_tensor(wrapped(("x", "y")))
    assert _is_sharded_tensor(wrapped((None, "y")))
    assert not _is_sharded_tensor(wrapped((None, None)))
    assert not _is_sharded_tensor(xs.XLAShardedTensor(torch.zeros(8).to(dev)))
    assert not _is_sharded_tensor(wrapped(("x", "y")).global_tensor)  # not wrapped
    t = torch.zeros(2).to(dev)
    assert _unwrap_xla_sharded_tensor(xs.XLAShardedTensor(t)) is t
    assert _unwrap_xla_sharded_tensor(t) is t


def test_flatten_counts_cpu_shards_as_tensors(spmd_mode):
    t = torch.zeros(8, 8).to(dev)
    xs.mark_sharding(t, _mesh(), ("x", "y"))
    (cpu,) = _cpu_shards_from_tensors([t])
    state = {"model": {"weight": cpu}, "opt": [cpu, cpu], "step": 3}
    flat, mapping = flatten_state_dict(state)
    assert list(flat) == ["model.weight", "opt.0", "opt.1", "step"]
    assert mapping["opt.1"] == ("opt", 1)
    assert unflatten_state_dict(flat, mapping) == state
    assert list(dcp_flatten(state)[0]) == ["model.weight", "opt", "step"]  # DCP's keeps the list


def test_flatten_refuses_two_paths_with_one_key():
    with pytest.raises(ValueError, match=r"\('a\.b',\) and \('a', 'b'\) both flatten to 'a\.b'"):
        flatten_state_dict({"a.b": torch.ones(1), "a": {"b": torch.ones(1)}})


def test_narrow_tensor_by_index():
    t = torch.arange(24).reshape(4, 6)
    box = narrow_tensor_by_index(t, (1, 2), (2, 3))
    assert torch.equal(box, t[1:3, 2:5]) and box.data_ptr() == t[1:3, 2:5].data_ptr()
    assert narrow_tensor_by_index(t, (0, 0), (4, 6)) is t
