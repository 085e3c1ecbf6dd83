"""torch_xla.distributed.spmd on JAX: meshes, partition specs, mark_sharding, sharded tensors.

Usage mirrors PyTorch/XLA (``import spmd_torch.distributed.spmd as xs``)::

    mesh = xs.Mesh(np.arange(8), (4, 2), ('data', 'model'))
    xs.mark_sharding(x, mesh, ('data', None))

Each (mesh, partition spec) maps once, through a cache, to a ``jax.sharding.NamedSharding``;
that is all the engine sees. PyTorch's DTensor API reaches it through ``api`` (``xla_distribute_tensor``,
``xla_distribute_module``).
"""

from __future__ import annotations

from . import xla_sharding
from .api import auto_policy, xla_distribute_module, xla_distribute_tensor
from .visualize import visualize_sharding, visualize_tensor_sharding
from .xla_sharding import *  # noqa: F403  (as in PyTorch/XLA, it also re-exports the mesh types)
from .xla_sharding import _mark_manual_sharding  # noqa: F401  (private, re-exported as there)

__all__ = [
    *xla_sharding.__all__,
    "auto_policy",
    "visualize_sharding",
    "visualize_tensor_sharding",
    "xla_distribute_module",
    "xla_distribute_tensor",
]
