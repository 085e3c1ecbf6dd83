"""THE registry of lowerings: one small JAX function per aten overload or engine op.

A lowering receives the op's arguments as the aten schema lists them, with every tensor replaced by
a ``jax.Array`` (tensor lists by lists of arrays) and every other argument as it was passed
(Python numbers -- the int and float Scalars of pointwise and foreach ops arrive as weakly typed JAX
scalars, a foreach op's ``Scalar[]`` as one vector, so that they stay inputs of the compiled program
-- ``torch.dtype``, lists of ints, ...). It returns an array, or a
tuple of arrays in the order of the schema's returns. The engine casts each result to the dtype
PyTorch's meta kernel promised, so a lowering computes in the right precision and need not cast its
result. Random lowerings (``random=True``) receive a ``jax.random`` key as their first argument.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch


class EngineOp:
    """An op of the engine's own (the PRNG split, sharding constraints, manual-region bounds):
    recorded as a node and lowered through this registry like any aten overload."""

    __slots__ = ("name",)

    def __init__(self, name: str):
        self.name = name

    def __repr__(self) -> str:
        return self.name

    def __copy__(self) -> EngineOp:
        return self  # the op is its own identity: a copy would have no lowering

    def __deepcopy__(self, memo: dict) -> EngineOp:
        return self


@dataclass(frozen=True)
class Lowering:
    fn: Callable
    # Takes a jax.random key first: True, or a predicate of the call's (args, kwargs) saying
    # whether this call draws numbers (one that does not reads the key without advancing it).
    random: bool | Callable = False
    static_scalars: bool = False  # Python number Scalars arrive as numbers (else: lifted data)


LOWERINGS: dict[torch._ops.OpOverload | EngineOp, Lowering] = {}


def lowers(
    *overloads: torch._ops.OpOverload | EngineOp,
    random: bool | Callable = False,
    static_scalars: bool = False,
) -> Callable:
    """Register the decorated function as the lowering of ``overloads``; registering one twice
    raises. ``static_scalars``: the lowering builds a different program per value (``x ** 2``
    is ``x * x``), so its pointwise op's Python numbers stay constants, not program inputs."""

    def register(fn: Callable) -> Callable:
        for overload in overloads:
            if overload in LOWERINGS:
                raise ValueError(f"{overload} already has a lowering: {LOWERINGS[overload].fn}")
            LOWERINGS[overload] = Lowering(fn, random, static_scalars)
        return fn

    return register


def register_table(table: dict, adapt: Callable = lambda f: f) -> None:
    """Register a table of one-line lowerings {overload or tuple of overloads: fn}."""
    for overloads, fn in table.items():
        if not isinstance(overloads, tuple):
            overloads = (overloads,)
        lowers(*overloads)(adapt(fn))


_META_KERNELS = torch.library.Library("aten", "IMPL")


def meta_kernel(*overload_names: str) -> Callable:
    """Register the decorated function as the Meta kernel of aten overloads PyTorch has none for
    (``"histogram.bin_ct"``): the engine takes output shapes from meta kernels, so without one a
    lowered op would still run on the CPU."""

    def register(fn: Callable) -> Callable:
        for name in overload_names:
            _META_KERNELS.impl(name, fn, "Meta")
        return fn

    return register
