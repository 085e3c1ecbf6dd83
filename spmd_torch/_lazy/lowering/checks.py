"""CPU PyTorch's argument checks where the meta kernels, which give every recorded op its output
shapes, check differently or not at all: each raises at the call, in CPU PyTorch's words."""

from __future__ import annotations

import math

import torch

aten = torch.ops.aten


class IndexCheckError(IndexError, RuntimeError):
    """A dimension or size check failed: an IndexError, as CPU PyTorch raises, and a RuntimeError,
    as PyTorch/XLA's C++ checks raise, so code written for either catches it."""


def _finite_range(args: tuple) -> None:
    """arange's bounds must be finite (the meta kernel blames the step's sign instead)."""
    start, end = (0, args[0]) if len(args) == 1 else args[:2]
    if not (math.isfinite(start) and math.isfinite(end)):
        raise RuntimeError(f"unsupported range: {start} -> {end}")


def _reduces_something(args: tuple, name: str, with_dim: bool) -> None:
    """max/min of nothing: meta kernels take empty inputs, and JAX would fail at the barrier."""
    x = args[0]
    if x.numel():
        return
    if not with_dim:
        raise RuntimeError(
            f"{name}(): Expected reduction dim to be specified for input.numel() == 0. "
            "Specify the reduction dim with the 'dim' argument."
        )
    if x.shape[args[1]] == 0:
        dim = args[1] % x.dim()
        raise IndexCheckError(f"{name}(): Expected reduction dim {dim} to have non-zero size.")


# Run before the meta kernel: its own check would speak first.
BEFORE_META = {
    aten.arange.default: _finite_range,
    aten.arange.start: _finite_range,
    aten.arange.start_step: _finite_range,
}
# Run after it: it checks the dimension first, as CPU PyTorch does.
AFTER_META = {
    aten.max.default: lambda args: _reduces_something(args, "max", with_dim=False),
    aten.min.default: lambda args: _reduces_something(args, "min", with_dim=False),
    aten.max.dim: lambda args: _reduces_something(args, "max", with_dim=True),
    aten.min.dim: lambda args: _reduces_something(args, "min", with_dim=True),
}
