"""``_XLAC._global_tensor_from_cpu_shards``: a sharded tensor built from one host shard per device,
checked against the tensor the shards tile (numpy) and against the layout asked for."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import spmd_torch._XLAC as xlac
import spmd_torch.distributed.spmd as xs
from tests.helpers import assert_close

from_cpu_shards = xlac._global_tensor_from_cpu_shards


def test_tiled_shards_make_the_tensor_they_tile_laid_out_so():
    mesh = xs.Mesh(np.arange(8), (4, 2))
    full = torch.randn(8, 6)
    shards = [
        full[2 * (i // 2) : 2 * (i // 2) + 2, 3 * (i % 2) : 3 * (i % 2) + 3] for i in range(8)
    ]
    t = from_cpu_shards(shards, mesh.get_op_sharding((0, 1)))
    assert_close(t, full)
    assert xs.get_xla_sharding_spec(t) == "{devices=[4,2]0,1,2,3,4,5,6,7}"
    assert_close(t * 2 + 1, full * 2 + 1)


def test_shards_follow_the_device_ids_of_the_mesh():
    mesh = xs.Mesh(np.array([7, 6, 5, 4, 3, 2, 1, 0]), (8,))
    shards = [torch.tensor([10 * i]) for i in range(8)]  # shard i belongs to device i
    t = from_cpu_shards(shards, mesh.get_op_sharding((0,)))
    assert t.cpu().tolist() == [70, 60, 50, 40, 30, 20, 10, 0]


def test_partially_replicated_and_replicated_shards():
    mesh = xs.Mesh(np.arange(8), (4, 2))
    shards = [torch.tensor([[float(i % 2)]]) for i in range(8)]
    t = from_cpu_shards(shards, mesh.get_op_sharding((None, 1)))
    assert t.cpu().tolist() == [[0.0, 1.0]]
    replicated = from_cpu_shards([torch.arange(4)] * 8, mesh.get_op_sharding((None,)))
    assert replicated.cpu().tolist() == [0, 1, 2, 3]
    # a replicated spec may name more dimensions than the shards have, as PyTorch/XLA allows
    fewer = from_cpu_shards([torch.tensor([8])] * 8, mesh.get_op_sharding((None, None)))
    assert fewer.cpu().tolist() == [8]
    with pytest.raises(
        RuntimeError, match=r"a sharding of 2 dimensions for shards of shape \(4,\)"
    ):
        from_cpu_shards([torch.arange(4)] * 8, mesh.get_op_sharding((None, 1)))


def test_a_smaller_global_shape_drops_the_padding_of_an_uneven_sharding():
    mesh = xs.Mesh(np.arange(8), (8,))
    shards = [torch.arange(3.0) + 3 * i for i in range(8)]
    t = from_cpu_shards(shards, mesh.get_op_sharding((0,)), torch.Size((22,)))
    assert_close(t, torch.arange(22.0))
    assert_close((t * t).sum(), (torch.arange(22.0) ** 2).sum())


def test_shards_that_do_not_make_the_shape_are_refused_with_it():
    mesh = xs.Mesh(np.arange(8), (8,))
    sharding = mesh.get_op_sharding((0,))
    shards = [torch.tensor([i]) for i in range(8)]
    with pytest.raises(RuntimeError, match="7 shards for the 8 devices"):
        from_cpu_shards(shards[:-1], sharding)
    with pytest.raises(
        RuntimeError,
        match=r"shards of shape \(1,\), tiled \(8,\) to \(8,\), do not make a tensor of shape \(16,\)",
    ):
        from_cpu_shards(shards, sharding, (16,))
    with pytest.raises(RuntimeError, match=r"shape \(1, 8\)"):
        from_cpu_shards(shards, sharding, (1, 8))
    with pytest.raises(RuntimeError, match="differ in shape or dtype"):
        from_cpu_shards(shards[:-1] + [torch.tensor([1.0])], sharding)
    with pytest.raises(TypeError, match=r"mesh.get_op_sharding"):
        from_cpu_shards(shards, ("x",))
