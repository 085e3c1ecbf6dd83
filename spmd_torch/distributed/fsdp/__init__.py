"""torch_xla.distributed.fsdp: wrap policies (``wrap``) and ``checkpoint_module``.

PyTorch/XLA's FSDP v1, ``XlaFullyShardedDataParallel`` (per-replica parameter shards with
explicit all-gathers and reduce-scatters, and its sharded-checkpoint consolidation), is not
provided: FSDP here is FSDPv2, ``spmd_torch.experimental.spmd_fully_sharded_data_parallel``, which
shards parameters over a mesh and lets the partitioner insert the collectives. Importing the v1
names raises an ``ImportError`` that says so.

Example:
    >>> from spmd_torch.distributed.fsdp import checkpoint_module
    >>> from spmd_torch.distributed.fsdp.wrap import transformer_auto_wrap_policy
"""

from __future__ import annotations

from .utils import checkpoint_module

__all__ = ["checkpoint_module"]

_FSDP_V1_NAMES = (
    "XlaFullyShardedDataParallel",
    "consolidate_sharded_state_dicts",
    "consolidate_sharded_model_checkpoints",
)


def __getattr__(name: str):
    if name in _FSDP_V1_NAMES:
        raise ImportError(
            f"spmd_torch.distributed.fsdp.{name}: PyTorch/XLA's FSDP v1 is not provided; use "
            "FSDPv2, spmd_torch.experimental.spmd_fully_sharded_data_parallel."
            "SpmdFullyShardedDataParallel (it takes the same auto_wrap_policy), with "
            "spmd_torch.experimental.distributed_checkpoint for sharded checkpoints"
        )
    raise AttributeError(f"module 'spmd_torch.distributed.fsdp' has no attribute {name!r}")
