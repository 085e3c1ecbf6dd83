"""Reading sharded values on the host: PyTorch/XLA's ReplicateShardedData counter counts each
read that assembles a sharded array's shards into one value, and only those."""

from __future__ import annotations

import numpy as np
import torch

import spmd_torch
import spmd_torch.distributed.spmd as xs
from tests.helpers import assert_close, assert_counter_delta


def test_reading_a_sharded_value_counts_replicate_sharded_data():
    mesh = xs.Mesh(np.arange(8), (8,), ("x",))
    values = torch.arange(32.0).reshape(8, 4)
    replicated = values.to(spmd_torch.device())
    sharded = values.to(spmd_torch.device())
    xs.mark_sharding(sharded, mesh, ("x", None))
    with assert_counter_delta("ReplicateShardedData", 0):
        assert_close(replicated.cpu(), values, tol="exact")
    with assert_counter_delta("ReplicateShardedData", 1):
        assert_close(sharded.cpu(), values, tol="exact")
