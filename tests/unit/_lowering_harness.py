"""Run a lowering on JAX copies of torch arguments, for all the lowering unit tests.

The expected value is tests.helpers.reference (a bf16/fp16 one computed in float64 and rounded
once); the comparison is tests.helpers.assert_close: same structure and shapes, the exact dtype
(the lowering's own, mapped back with to_torch_dtype, unless ``cast``), values within the table's
tolerance for the dtype or the named override a test asks for.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import torch.utils._pytree as pytree

from spmd_torch._lazy.lowering import LOWERINGS
from spmd_torch._lazy.lowering.dtypes import to_torch_dtype
from tests.helpers import assert_close, reference, tolerance

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


def _is_input(v: object) -> bool:
    return isinstance(v, (torch.Tensor, Traced, jax.Array))


def as_program(fn, args: tuple, kwargs: dict) -> tuple:
    """``fn`` as a function of the tensors, Traced scalars and jax arrays in ``args`` and
    ``kwargs`` (nested ones too), with the jax inputs to call it on; the rest stays static, as the
    engine keeps it."""
    leaves, spec = pytree.tree_flatten((args, kwargs))
    slots = [i for i, v in enumerate(leaves) if _is_input(v)]

    def program(*arrays):
        full = list(leaves)
        for i, array in zip(slots, arrays, strict=True):
            full[i] = array
        positional, keywords = pytree.tree_unflatten(full, spec)
        return fn(*positional, **keywords)

    return program, to_jax([_plain(leaves[i]) for i in slots])


def lowered(op, *args: object, jit: bool = True, **kwargs: object) -> object:
    """The lowering of ``op`` under jax.jit, as the engine runs it (see as_program); keyword-only
    schema arguments go by keyword. ``jit=False`` calls it eagerly, for data-dependent shapes."""
    program, inputs = as_program(LOWERINGS[op].fn, args, kwargs)
    if jit:  # compiled through Lowered.compile, as the engine's programs are (tests/conftest.py)
        program = jax.jit(program).lower(*inputs).compile()
    return to_torch(program(*inputs))


def named(name: str) -> Callable[[torch.dtype], dict]:
    """The tolerance table's override ``name`` (tests.helpers.TOLERANCE_OVERRIDES), per dtype."""
    tolerance(torch.float32, name=name)  # an unknown name fails at collection
    return lambda dtype: tolerance(dtype, name=name)


tight = named("single_op")
"""The nn and linalg tolerance: one aten op on its own."""


def _cast_like(got: object, expected: object) -> object:
    """``got`` in ``expected``'s dtypes and sequence types, as the engine hands a result back."""
    if isinstance(expected, (tuple, list)):
        assert len(got) == len(expected), f"{len(got)} results != {len(expected)}"
        return type(expected)(map(_cast_like, got, expected))
    if isinstance(expected, torch.Tensor) and isinstance(got, torch.Tensor):
        return got.to(expected.dtype)
    return got


Tolerance = dict | Callable[[torch.dtype], dict] | None


def assert_same(got: object, expected: object, tol: Tolerance = None, *, cast: bool = False):
    """assert_close, ``tol`` a dict for every tensor or a function of each tensor's dtype; ``cast``
    first casts ``got`` to torch's dtypes, for lowerings that may return another dtype."""
    if cast:
        got = _cast_like(got, expected)
    if not callable(tol):
        assert_close(got, expected, **(tol or {}))
        return
    flat_got, spec_got = pytree.tree_flatten(got)
    flat_expected, spec_expected = pytree.tree_flatten(expected)
    assert spec_got == spec_expected, f"structure {spec_got} != {spec_expected}"
    for g, e in zip(flat_got, flat_expected):
        assert_close(g, e, **(tol(e.dtype) if isinstance(e, torch.Tensor) else {}))


def check(
    op, *args: object, cast: bool = False, tol: Tolerance = None, jit: bool = True, **kwargs: object
):
    """The lowering of ``op`` matches ``op`` run eagerly on CPU, a bf16/fp16 result computed in
    float64 and rounded once (see tests.helpers.reference, assert_same and lowered)."""
    expected = reference(op, *map(_plain, args), **{k: _plain(v) for k, v in kwargs.items()})
    assert_same(lowered(op, *args, jit=jit, **kwargs), expected, tol, cast=cast)


def case(op, *args: object, id: str, tol: Tolerance = None, **kwargs: object):
    """A pytest param (op, args, kwargs, tol) with its own id."""
    return pytest.param(op, args, kwargs, tol, id=id)
