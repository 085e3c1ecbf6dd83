"""Run a lowering on JAX copies of torch arguments, for the lowering unit tests.

The comparison is tests.helpers.assert_close: same structure and shapes, the exact dtype (the
lowering's own, mapped back with to_torch_dtype), values within the dtype's tolerance.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import torch.utils._pytree as pytree

from spmd_torch._lazy.lowering import LOWERINGS
from spmd_torch._lazy.lowering.dtypes import to_torch_dtype
from tests.helpers import assert_close

_GEN = torch.Generator().manual_seed(0)


def sample(*shape: int, dtype: torch.dtype = torch.float32, low=-3, high=3) -> torch.Tensor:
    """Reproducible values in [low, high]: uniform floats or integers, or coin-flip bools."""
    if dtype == torch.bool:
        return torch.rand(shape, generator=_GEN) > 0.5
    if dtype.is_floating_point:
        unit = torch.rand(shape, generator=_GEN, dtype=torch.float64)
        return (unit * (high - low) + low).to(dtype)
    return torch.randint(int(low), int(high) + 1, shape, generator=_GEN, dtype=dtype)


def op_name(op) -> str:
    return str(op).removeprefix("aten.").removesuffix(".default")


def cases(*cases: tuple) -> list:
    """pytest params (op, *values) with ids "<op>-<n>", n counting the cases of the same op."""
    seen: dict = {}
    params = []
    for op, *values in cases:
        seen[op] = seen.get(op, -1) + 1
        params.append(pytest.param(op, *values, id=f"{op_name(op)}-{seen[op]}"))
    return params


def _to_jax(x: object) -> object:
    if not isinstance(x, torch.Tensor):
        return x
    if x.dtype == torch.bfloat16:  # numpy has no bfloat16; float32 holds it exactly
        return jnp.asarray(x.float().numpy(), jnp.bfloat16)
    return jnp.asarray(x.numpy())


def _to_torch(a: object) -> object:
    if not isinstance(a, jnp.ndarray):
        return a
    dtype = to_torch_dtype(a.dtype)
    values = a.astype(jnp.float32) if dtype == torch.bfloat16 else a
    return torch.from_numpy(np.array(values)).to(dtype)


def to_jax(tree: object) -> object:
    return pytree.tree_map(_to_jax, tree)


def to_torch(tree: object) -> object:
    return pytree.tree_map(_to_torch, tree)


class Traced(float):
    """A float Scalar passed into jax.jit as a traced, weakly typed argument, the way the engine
    passes learning rates and other float Scalars of pointwise ops."""


def _plain(v: object) -> object:
    return float(v) if isinstance(v, Traced) else v


def lowered(op, *args: object, **kwargs: object) -> object:
    """The lowering of ``op`` under jax.jit, as the engine runs it: tensors (and Traced scalars)
    are arguments, everything else is static; keyword-only schema arguments go by keyword."""
    fn = LOWERINGS[op].fn
    inputs = [v for v in (*args, *kwargs.values()) if isinstance(v, (torch.Tensor, Traced))]

    def program(*arrays):
        it = iter(arrays)

        def bind(v: object) -> object:
            return next(it) if isinstance(v, (torch.Tensor, Traced)) else v

        positional = [bind(v) for v in args]  # before the keywords: both draw from ``it``
        return fn(*positional, **{k: bind(v) for k, v in kwargs.items()})

    return to_torch(jax.jit(program)(*to_jax([_plain(v) for v in inputs])))


def check(op, *args: object, cast: bool = False, tol: dict | None = None, **kwargs: object):
    """The lowering of ``op`` matches ``op`` run eagerly on CPU. ``cast`` first casts the result to
    torch's dtype, as the engine does, for lowerings that may return another dtype."""
    expected = op(*map(_plain, args), **{k: _plain(v) for k, v in kwargs.items()})
    got = lowered(op, *args, **kwargs)
    if cast:
        got = pytree.tree_map(lambda g, e: g.to(e.dtype), got, expected)
    assert_close(got, expected, **(tol or {}))
