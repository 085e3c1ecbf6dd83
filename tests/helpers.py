"""The one comparison helper (eager CPU vs xla), and metric-counting assertions."""

from __future__ import annotations

import contextlib
import math

import torch
import torch.utils._pytree as pytree

import spmd_torch
from spmd_torch._lazy import counters

TOLERANCES = {
    torch.float32: dict(rtol=1e-4, atol=1e-5),
    torch.float64: dict(rtol=1e-7, atol=1e-7),
    torch.bfloat16: dict(rtol=1.6e-2, atol=1e-2),
    torch.float16: dict(rtol=1e-3, atol=1e-3),
}


def to_device(tree):
    dev = spmd_torch.device()
    return pytree.tree_map(
        lambda x: (
            x.detach().to(dev).requires_grad_(x.requires_grad) if isinstance(x, torch.Tensor) else x
        ),
        tree,
    )


def to_cpu(tree):
    return pytree.tree_map(lambda x: x.cpu() if isinstance(x, torch.Tensor) else x, tree)


def assert_close(actual, expected, **tolerance):
    """Same structure, shapes and dtypes exactly; values within the dtype's tolerance."""
    actual, expected = to_cpu(actual), to_cpu(expected)
    flat_actual, spec_actual = pytree.tree_flatten(actual)
    flat_expected, spec_expected = pytree.tree_flatten(expected)
    assert spec_actual == spec_expected, f"structure {spec_actual} != {spec_expected}"
    for a, e in zip(flat_actual, flat_expected):
        if isinstance(e, torch.Tensor):
            assert isinstance(a, torch.Tensor), f"expected a tensor, got {type(a)}"
            assert a.shape == e.shape, f"shape {tuple(a.shape)} != {tuple(e.shape)}"
            assert a.dtype == e.dtype, f"dtype {a.dtype} != {e.dtype}"
            tol = tolerance or TOLERANCES.get(e.dtype, dict(rtol=0, atol=0))
            torch.testing.assert_close(a, e, equal_nan=True, **tol)
        else:
            assert a == e or (math.isnan(a) and math.isnan(e)), f"{a!r} != {e!r}"


def assert_matches_eager(fn, *args, **kwargs):
    """fn on CPU and on xla give the same result (forward only)."""
    expected = fn(*args, **kwargs)
    actual = fn(*to_device(args), **to_device(kwargs))
    assert_close(actual, expected)
    return actual


@contextlib.contextmanager
def assert_compiles(n: int):
    """The block compiles exactly ``n`` new programs."""
    before = counters.COUNTERS.get("UncachedCompile", 0)
    yield
    compiled = counters.COUNTERS.get("UncachedCompile", 0) - before
    assert compiled == n, f"expected {n} compilations, got {compiled}"


@contextlib.contextmanager
def assert_counter_delta(name: str, n: int):
    before = counters.COUNTERS.get(name, 0)
    yield
    delta = counters.COUNTERS.get(name, 0) - before
    assert delta == n, f"counter {name}: expected +{n}, got +{delta}"
