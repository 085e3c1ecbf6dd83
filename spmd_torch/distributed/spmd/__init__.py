"""torch_xla.distributed.spmd on JAX: meshes, partition specs, mark_sharding, sharded tensors.

Usage mirrors PyTorch/XLA (``import spmd_torch.distributed.spmd as xs``)::

    mesh = xs.Mesh(np.arange(8), (4, 2), ('data', 'model'))
    xs.mark_sharding(x, mesh, ('data', None))

Each (mesh, partition spec) maps once, through a cache, to a ``jax.sharding.NamedSharding``;
that is all the engine sees.
"""

from __future__ import annotations

from ._tiling import ShardingType
from .mesh import HybridMesh, Mesh, get_1d_mesh, get_global_mesh, set_global_mesh
from .visualize import visualize_sharding, visualize_tensor_sharding
from .xla_sharded_tensor import XLAShard, XLAShardedTensor
from .xla_sharding import (
    ShardingSpec,
    clear_sharding,
    disable_manual_sharding,
    enable_manual_sharding,
    get_xla_sharding_spec,
    mark_sharding,
    unwrap_sharded_tensor,
    wrap_as_sharded_tensor,
    wrap_if_sharded,
)

__all__ = [
    "HybridMesh",
    "Mesh",
    "ShardingSpec",
    "ShardingType",
    "XLAShard",
    "XLAShardedTensor",
    "clear_sharding",
    "disable_manual_sharding",
    "enable_manual_sharding",
    "get_1d_mesh",
    "get_global_mesh",
    "get_xla_sharding_spec",
    "mark_sharding",
    "set_global_mesh",
    "unwrap_sharded_tensor",
    "visualize_sharding",
    "visualize_tensor_sharding",
    "wrap_as_sharded_tensor",
    "wrap_if_sharded",
]
