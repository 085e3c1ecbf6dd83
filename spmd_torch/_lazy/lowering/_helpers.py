"""Conversions lowerings share: PyTorch's type promotion over arrays and scalars, and opmath.

Import these, don't copy them. ``result_type`` is ``torch.result_type`` for any number of
arguments; the adapters ``promoted``, ``arithmetic`` and ``floating`` wrap a jnp function so that
it sees its positional arguments in the dtype ATen computes in (so every positional argument must
be a tensor or a Scalar: pass ints, lists and strings by keyword). Each adapted lowering is
``traced_once``: make it once, at import, not at every call (a wrapper made per call keeps no trace).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import torch

from spmd_torch import config

from .dtypes import promote, to_jax_dtype

_LOW_PRECISION = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


def default_float() -> np.dtype:
    """PyTorch's default dtype on the device: what integer sqrt, true division, zeros() give."""
    return to_jax_dtype(torch.get_default_dtype())


def category(dtype: Any) -> int:
    """0 bool, 1 integer, 2 floating, 3 complex: a lower-priority operand only promotes upward."""
    dtype = jnp.dtype(dtype)
    if dtype == jnp.bool_:
        return 0
    if jnp.issubdtype(dtype, jnp.integer):
        return 1
    return 2 if jnp.issubdtype(dtype, jnp.floating) else 3


def is_scalar(x: Any) -> bool:
    """A Python number or a weakly typed JAX scalar (a traced float Scalar): a wrapped number."""
    if isinstance(x, (bool, int, float, complex)):
        return True
    return bool(getattr(x, "weak_type", False)) and x.ndim == 0


def scalar_dtype(x: Any) -> np.dtype:
    """The dtype PyTorch gives a wrapped number: bool, int64, or the default float (or complex)."""
    kind = category(jnp.result_type(x))
    if kind == 3:
        return jnp.dtype(jnp.complex128 if default_float() == jnp.float64 else jnp.complex64)
    return (jnp.dtype(jnp.bool_), jnp.dtype(jnp.int64), default_float())[kind]


def result_type(*args: Any) -> np.dtype:
    """torch.result_type over any number of arrays and scalars (``None`` skipped).

    Tensors with dims outrank 0-dim tensors, which outrank wrapped numbers; a lower rank changes
    the result only by lifting its category (int tensor * 0.5 is float32, f32 * f64 0-dim is f32).
    """
    ranks: list[Any] = [None, None, None]
    for x in args:
        if x is None:
            continue
        rank = 2 if is_scalar(x) else int(x.ndim == 0)
        dtype = scalar_dtype(x) if rank == 2 else x.dtype
        ranks[rank] = dtype if ranks[rank] is None else promote(ranks[rank], dtype)
    result = None
    for dtype in ranks:
        if dtype is not None and (result is None or category(dtype) > category(result)):
            result = dtype if result is None else promote(result, dtype)
    return jnp.dtype(result)


def opmath(dtype: Any) -> np.dtype:
    """The dtype ATen computes a pointwise op in: float32 for bfloat16/float16, else the dtype."""
    dtype = jnp.dtype(dtype)
    return jnp.dtype(jnp.float32) if dtype in _LOW_PRECISION else dtype


def traced_once(fn: Callable) -> Callable:
    """``fn`` through ``jax.jit``, its arrays as arguments and everything else static: JAX traces
    it once per distinct shapes, dtypes and static values, and every later call with the same
    ones, in any program, reuses that trace, inlined where it is called (the program and its ops'
    names are what ``fn`` itself would make). For lowerings a deep model calls many times alike
    (each layer's attention and einsums, the optimizer's update of each parameter): tracing them
    again at every call was most of the time a program took to lower (a cached call costs about
    0.1 ms with its MLIR; ``jnp.einsum`` traced anew about 1 ms, one attention 16 ms).

    ``fn`` must be pure: no counters, no reads of state other than the flags in the compile
    cache's key and the default dtype, which are part of the trace's key. Unhashable static
    values, and ``XLA_HLO_DEBUG`` (each call's own source location), call ``fn`` directly."""
    traces: dict = {}

    def call(*args: Any, **kwargs: Any) -> Any:
        if config.HLO_DEBUG.value:
            return fn(*args, **kwargs)
        leaves, tree = jax.tree.flatten((args, kwargs))
        is_array = tuple(isinstance(x, (jax.Array, np.ndarray)) for x in leaves)
        statics = tuple(None if a else _static_key(x) for x, a in zip(leaves, is_array))
        key = (tree, is_array, statics, config.cache_key(), torch.get_default_dtype())
        try:
            jitted = traces.get(key)
        except TypeError:  # an unhashable static value
            return fn(*args, **kwargs)
        if jitted is None:
            flat = _with_statics(fn, tree, is_array, leaves)
            jitted = traces[key] = jax.jit(flat, inline=True)
        return jitted(*[x for x, a in zip(leaves, is_array) if a])

    return call


def _static_key(x: Any) -> Any:
    """A static value as a key that tells apart what ``==`` does not: 1, 1.0 and True; 0.0 and
    -0.0."""
    if isinstance(x, float):  # numpy's float64 too
        return type(x), x, math.copysign(1.0, x)
    return type(x), x


def _with_statics(fn: Callable, tree: Any, is_array: tuple, leaves: list) -> Callable:
    """``fn`` as a function of the arrays alone, the static leaves filled in (not the arrays)."""
    statics = [None if a else x for x, a in zip(leaves, is_array)]

    def flat(*arrays: Any) -> Any:
        given = iter(arrays)
        args, kwargs = jax.tree.unflatten(
            tree, [next(given) if a else x for x, a in zip(statics, is_array)]
        )
        return fn(*args, **kwargs)

    flat.__name__ = getattr(fn, "__name__", "lowering")
    return flat


def _cast(args: tuple, dtype: np.dtype) -> list:
    return [None if a is None else jnp.asarray(a, dtype) for a in args]


def promoted(fn: Callable) -> Callable:
    """fn on its positional args cast to their result_type: comparisons, where, min/max, bitwise."""

    def lowering(*args: Any, **kwargs: Any) -> Any:
        return fn(*_cast(args, result_type(*args)), **kwargs)

    return traced_once(lowering)


def float_dtype(dtype: Any) -> np.dtype:
    """The dtype a float op (sqrt, mean of logits) on ``dtype`` returns: integers give default float."""
    return jnp.dtype(dtype) if category(dtype) >= 2 else default_float()


def _computed(fn: Callable, to_float: bool) -> Callable:
    def lowering(*args: Any, **kwargs: Any) -> Any:
        dtype = float_dtype(result_type(*args)) if to_float else result_type(*args)
        return fn(*_cast(args, opmath(dtype)), **kwargs).astype(dtype)

    return traced_once(lowering)


def arithmetic(fn: Callable) -> Callable:
    """fn in the promoted dtype's opmath, rounded once to the promoted dtype, as ATen's kernels do."""
    return _computed(fn, to_float=False)


def floating(fn: Callable) -> Callable:
    """Like ``arithmetic``, but integer and bool inputs compute in the default float (sqrt, exp)."""
    return _computed(fn, to_float=True)
