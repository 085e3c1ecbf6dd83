"""torch_xla.distributed.spmd.debugging: sharding visualization (implemented in visualize.py)."""

from __future__ import annotations

from .visualize import visualize_sharding, visualize_tensor_sharding

__all__ = ["visualize_sharding", "visualize_tensor_sharding"]
