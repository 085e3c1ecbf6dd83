"""Lowerings: factories. Layout, device, pin_memory and memory_format mean nothing on the device and
are ignored; an empty tensor is zeros. Without a dtype each op infers one as PyTorch does."""

from __future__ import annotations

import math

import jax.numpy as jnp
import torch
from jax import lax

from ._helpers import category, default_float, scalar_dtype
from .dtypes import to_jax_dtype
from .registry import register_table

aten = torch.ops.aten


def _dtype(dtype, default=None):
    """The requested dtype on the device, else ``default``, else PyTorch's default float."""
    if dtype is not None:
        return to_jax_dtype(dtype)
    return default_float() if default is None else default


def _arange(start, end=None, step=1, *, dtype=None, **_):
    """ATen's length, ceil((end - start) / step), and values start + i * step computed in int64
    for integer arguments and float64 otherwise (CPU's accumulate type), then cast."""
    if end is None:
        start, end = 0, start
    ints = all(isinstance(v, int) for v in (start, end, step))
    out = _dtype(dtype, jnp.dtype(jnp.int64) if ints else None)
    n = -((start - end) // step) if ints else math.ceil((end - start) / step)
    acc = jnp.int64 if ints and category(out) < 2 else jnp.float64
    return (start + step * lax.iota(acc, max(n, 0))).astype(out)


def _linspace(start, end, steps, *, dtype=None, **_):
    """ATen's formula: the first half steps forward from start, the rest back from end, so both ends
    are exact; the ends are cast to the result dtype first, and integers step in float64."""
    out = _dtype(dtype)
    acc = out if category(out) >= 2 else jnp.dtype(jnp.float64)
    start, end = (jnp.asarray(v).astype(out).astype(acc) for v in (start, end))
    step = (end - start) / max(steps - 1, 1)
    i = lax.iota(acc, steps)
    # max(.., 1): a single step is start, where ATen special-cases steps == 1.
    forward = i < max(steps // 2, 1)
    return jnp.where(forward, start + step * i, end - step * (steps - 1 - i)).astype(out)


def _logspace(start, end, steps, base=10.0, *, dtype=None, **_):
    """ATen's: the ends cast to the result dtype, exponents stepped as linspace's (the first half
    from start, the rest from end) and ``base ** exponent`` in float64, then cast."""
    out = _dtype(dtype)
    start, end = (jnp.asarray(v).astype(out).astype(jnp.float64) for v in (start, end))
    step = (end - start) / max(steps - 1, 1)
    i = lax.iota(jnp.float64, steps)
    forward = i < max(steps // 2, 1)
    exponent = jnp.where(forward, start + step * i, end - step * (steps - 1 - i))
    return jnp.power(jnp.float64(base), exponent).astype(out)


def _full(size, fill_value, *, dtype=None, **_):
    """Without a dtype, the fill value's: bool, int64 or the default float."""
    return jnp.full(size, fill_value, _dtype(dtype, scalar_dtype(fill_value)))


def _full_like(x, fill_value, *, dtype=None, **_):
    return jnp.full(x.shape, fill_value, _dtype(dtype, x.dtype))


def _new_full(x, size, fill_value, *, dtype=None, **_):
    return jnp.full(size, fill_value, _dtype(dtype, x.dtype))


def _constant(value):
    """zeros/ones/empty(size, [stride]): the default float, whatever the value."""
    return lambda size, *_, dtype=None, **__: jnp.full(size, value, _dtype(dtype))


def _constant_like(value):
    return lambda x, *, dtype=None, **_: jnp.full(x.shape, value, _dtype(dtype, x.dtype))


def _new_constant(value):
    """x.new_zeros(size, [stride]): x's dtype unless told otherwise."""
    return lambda x, size, *_, dtype=None, **__: jnp.full(size, value, _dtype(dtype, x.dtype))


# Ops making a new tensor like their first argument: the dispatcher lays the result out as that
# argument is laid out (placement.follow), so optimizer state is sharded like its parameter.
MADE_LIKE = frozenset(
    (aten.zeros_like.default, aten.ones_like.default, aten.empty_like.default)
    + (aten.full_like.default, aten.rand_like.default, aten.randn_like.default)
    + (aten.randint_like.default, aten.randint_like.low_dtype, aten.clone.default)
)

# The ones of them making a constant, whatever the source's values: a stack's member makes a
# member of a new stack (stacks.like). Not ``clone``: one layer's copy would hold every layer's.
STACKED_LIKE = frozenset(
    (aten.zeros_like.default, aten.ones_like.default, aten.empty_like.default)
    + (aten.full_like.default,)
)

# Ops whose value is a constant of its shape and dtype, whatever their tensor argument holds.
CONSTANT_FILLS = STACKED_LIKE | frozenset(
    (aten.zeros.default, aten.ones.default, aten.full.default, aten.empty.memory_format)
    + (aten.new_zeros.default, aten.new_ones.default, aten.new_full.default)
    + (aten.new_empty.default,)
)
_FILL_ARGUMENT = {aten.full.default: 1, aten.full_like.default: 1, aten.new_full.default: 2}
_ONES = frozenset((aten.ones.default, aten.ones_like.default, aten.new_ones.default))


def constant_value(op, args: tuple) -> bool | int | float:
    """The number a constant fill (one of ``CONSTANT_FILLS``, as recorded) holds everywhere: its
    fill value, else 1 or 0 (an empty tensor is zeros)."""
    position = _FILL_ARGUMENT.get(op)
    return args[position] if position is not None else int(op in _ONES)


register_table(
    {
        aten.full.default: _full,
        aten.full_like.default: _full_like,
        aten.new_full.default: _new_full,
        (
            aten.zeros.default,
            aten.empty.memory_format,
            aten.empty_strided.default,
            aten._efficientzerotensor.default,  # autograd's zero gradients (sgn, where, ...)
        ): _constant(0),
        aten.ones.default: _constant(1),
        (aten.zeros_like.default, aten.empty_like.default): _constant_like(0),
        aten.ones_like.default: _constant_like(1),
        (aten.new_zeros.default, aten.new_empty.default, aten.new_empty_strided.default): (
            _new_constant(0)
        ),
        aten.new_ones.default: _new_constant(1),
        aten.scalar_tensor.default: lambda s, *, dtype=None, **_: jnp.asarray(s, _dtype(dtype)),
        (aten.arange.default, aten.arange.start, aten.arange.start_step): _arange,
        (
            aten.linspace.default,
            aten.linspace.Tensor_Tensor,
            aten.linspace.Tensor_Scalar,
            aten.linspace.Scalar_Tensor,
        ): _linspace,
        (
            aten.logspace.default,
            aten.logspace.Tensor_Tensor,
            aten.logspace.Tensor_Scalar,
            aten.logspace.Scalar_Tensor,
        ): _logspace,
        aten.eye.default: lambda n, *, dtype=None, **_: jnp.eye(n, dtype=_dtype(dtype)),
        aten.eye.m: lambda n, m, *, dtype=None, **_: jnp.eye(n, m, dtype=_dtype(dtype)),
    }
)
