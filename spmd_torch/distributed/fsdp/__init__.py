"""torch_xla.distributed.fsdp: FSDP v1 over the replicas of ``launch``, its checkpoint
consolidation, wrap policies (``wrap``) and ``checkpoint_module``.

``XlaFullyShardedDataParallel`` shards parameters per replica with explicit all-gathers and
reduce-scatters (PyTorch/XLA's per-device FSDP); in SPMD mode FSDP is FSDPv2,
``spmd_torch.experimental.spmd_fully_sharded_data_parallel``, which shards over a mesh and lets the
partitioner place the collectives.

Example:
    >>> from spmd_torch.distributed.fsdp import XlaFullyShardedDataParallel as FSDP
    >>> from spmd_torch.distributed.fsdp import consolidate_sharded_model_checkpoints
    >>> from spmd_torch.distributed.fsdp.wrap import transformer_auto_wrap_policy
"""

from __future__ import annotations

from .state_dict_utils import consolidate_sharded_model_checkpoints, consolidate_sharded_state_dicts
from .utils import checkpoint_module
from .xla_fully_sharded_data_parallel import XlaFullyShardedDataParallel

__all__ = [
    "XlaFullyShardedDataParallel",
    "checkpoint_module",
    "consolidate_sharded_model_checkpoints",
    "consolidate_sharded_state_dicts",
]
