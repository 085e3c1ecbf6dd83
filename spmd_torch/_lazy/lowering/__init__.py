"""THE registry of ATen lowerings: one small JAX function per aten overload.

A lowering receives the op's arguments as the aten schema lists them, with every tensor replaced by
a ``jax.Array`` (tensor lists by lists of arrays) and every other argument as it was passed
(Python numbers -- float Scalars of pointwise ops may arrive as weakly typed JAX scalars so that they
stay inputs of the compiled program -- ``torch.dtype``, lists of ints, ...). It returns an array, or a
tuple of arrays in the order of the schema's returns. The engine casts each result to the dtype
PyTorch's meta kernel promised, so a lowering computes in the right precision and need not cast its
result. Random lowerings (``random=True``) receive a ``jax.random`` key as their first argument.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Lowering:
    fn: Callable
    random: bool = False


LOWERINGS: dict[torch._ops.OpOverload, Lowering] = {}


def lowers(*overloads: torch._ops.OpOverload, random: bool = False) -> Callable:
    """Register the decorated function as the lowering of ``overloads``; registering one twice raises."""

    def register(fn: Callable) -> Callable:
        for overload in overloads:
            if overload in LOWERINGS:
                raise ValueError(f"{overload} already has a lowering: {LOWERINGS[overload].fn}")
            LOWERINGS[overload] = Lowering(fn, random)
        return fn

    return register


def register_table(table: dict, adapt: Callable = lambda f: f) -> None:
    """Register a table of one-line lowerings {overload or tuple of overloads: fn}."""
    for overloads, fn in table.items():
        if not isinstance(overloads, tuple):
            overloads = (overloads,)
        lowers(*overloads)(adapt(fn))


def _load_tables() -> None:
    from . import (  # noqa: F401  (each module fills LOWERINGS at import)
        elementwise,
        factories,
        indexing,
        linalg,
        nn,
        random,
        reductions,
    )


_load_tables()
