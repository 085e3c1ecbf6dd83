"""Lowerings of the engine's sharding ops: a constraint on one value, and the bounds of a manually
partitioned region. A region is lowered as one ``shard_map`` whose in specs split the values its
entries read, so an entry is the identity on its shard; its out specs reassemble the shards the
exits read, so an exit is the map's output and has no lowering of its own."""

from __future__ import annotations

import jax

from .registry import EngineOp, lowers

CONSTRAIN = EngineOp("sharding_constraint")  # args (x, sharding): lay x out so; GSPMD propagates
ENTER_MANUAL = EngineOp("full_to_shard")  # args (x, sharding): a full value -> each device's shard
EXIT_MANUAL = EngineOp("shard_to_full")  # args (x, sharding): per-device shards -> the full value


@lowers(CONSTRAIN)
def _constrain(x, sharding):
    return jax.lax.with_sharding_constraint(x, sharding)


@lowers(ENTER_MANUAL)
def _enter_manual(shard, sharding):
    return shard
