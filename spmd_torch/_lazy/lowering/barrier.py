"""Lowering: the optimization barrier, an op of our own, ``torch.ops.xla.optimization_barrier``.

XLA may not move computation across a barrier nor merge equal expressions on its two sides, so a
value read through one is opaque to common-subexpression elimination: activation checkpointing
puts the recomputation's inputs through it, or XLA would merge the recomputation with the forward
pass and keep the activations it was meant to free. The op is the identity (on CPU and meta
tensors too); on the device it lowers to ``jax.lax.optimization_barrier``.
"""

from __future__ import annotations

import jax
import torch

from .registry import lowers

_LIBRARY = torch.library.Library("xla", "DEF")
_LIBRARY.define("optimization_barrier(Tensor[] tensors) -> Tensor[]")
_LIBRARY.impl(
    "optimization_barrier",
    lambda tensors: [t.clone() for t in tensors],
    "CompositeExplicitAutograd",
)


@lowers(torch.ops.xla.optimization_barrier.default)
def optimization_barrier(tensors: tuple) -> list:
    return list(jax.lax.optimization_barrier(list(tensors)))
