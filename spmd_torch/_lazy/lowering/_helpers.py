"""Conversions lowerings share: PyTorch's type promotion over arrays and scalars, and opmath.

Import these, don't copy them. ``result_type`` is ``torch.result_type`` for any number of
arguments; the adapters ``promoted``, ``arithmetic`` and ``floating`` wrap a jnp function so that
it sees its positional arguments in the dtype ATen computes in (so every positional argument must
be a tensor or a Scalar: pass ints, lists and strings by keyword or close over them).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax.numpy as jnp
import numpy as np
import torch

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


def _cast(args: tuple, dtype: np.dtype) -> list:
    return [None if a is None else jnp.asarray(a, dtype) for a in args]


def promoted(fn: Callable) -> Callable:
    """fn on its positional args cast to their result_type: comparisons, where, min/max, bitwise."""

    def lowering(*args: Any, **kwargs: Any) -> Any:
        return fn(*_cast(args, result_type(*args)), **kwargs)

    return lowering


def float_dtype(dtype: Any) -> np.dtype:
    """The dtype a float op (sqrt, mean of logits) on ``dtype`` returns: integers give default float."""
    return jnp.dtype(dtype) if category(dtype) >= 2 else default_float()


def _computed(fn: Callable, to_float: bool) -> Callable:
    def lowering(*args: Any, **kwargs: Any) -> Any:
        dtype = float_dtype(result_type(*args)) if to_float else result_type(*args)
        return fn(*_cast(args, opmath(dtype)), **kwargs).astype(dtype)

    return lowering


def arithmetic(fn: Callable) -> Callable:
    """fn in the promoted dtype's opmath, rounded once to the promoted dtype, as ATen's kernels do."""
    return _computed(fn, to_float=False)


def floating(fn: Callable) -> Callable:
    """Like ``arithmetic``, but integer and bool inputs compute in the default float (sqrt, exp)."""
    return _computed(fn, to_float=True)
