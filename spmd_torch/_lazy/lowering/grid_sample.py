"""Lowerings: grid sampling (``F.grid_sample``) over 2-D and 3-D inputs, and its backward.

One sampler serves both ranks and all of ATen's modes: bilinear (trilinear in 3-D) and nearest
interpolation, bicubic in 2-D; zeros, border and reflection padding; both ``align_corners``
conventions. The grid's last axis lists coordinates fastest dimension first (x, y[, z]) in
[-1, 1]. The backward is ``jax.vjp`` of the sampler, so one definition of the index math serves
both directions. Low-precision inputs are sampled in float32 and rounded once.
"""

from __future__ import annotations

import itertools
import math

import jax
import jax.numpy as jnp
import torch

from .linalg import accumulation_dtype
from .nn import cubic_weights
from .registry import lowers

aten = torch.ops.aten

_BILINEAR, _NEAREST, _BICUBIC = 0, 1, 2
_ZEROS, _BORDER, _REFLECTION = 0, 1, 2


def _unnormalize(coord, size: int, align_corners: bool):
    """[-1, 1] to pixel coordinates: corner pixels' centres, or their outer edges."""
    if align_corners:
        return (coord + 1) / 2 * (size - 1)
    return ((coord + 1) * size - 1) / 2


def _reflect(coord, twice_low: int, twice_high: int):
    """``coord`` reflected into [twice_low / 2, twice_high / 2], as often as it takes."""
    if twice_low == twice_high:
        return jnp.zeros_like(coord)
    low, span = twice_low / 2, (twice_high - twice_low) / 2
    coord = coord - low
    coord = jnp.where(coord < 0, -coord, coord)  # slope +1 at 0, as ATen's backward takes it
    extra = jnp.fmod(coord, span)
    flips = jnp.floor(coord / span)
    return jnp.where(flips % 2 == 0, extra + low, span - extra + low)


def _pad(coord, size: int, padding_mode: int, align_corners: bool):
    """A pixel coordinate moved inside the input as the padding mode says (zeros: unchanged)."""
    if padding_mode == _REFLECTION:
        twice = (0, 2 * (size - 1)) if align_corners else (-1, 2 * size - 1)
        coord = _reflect(coord, *twice)
    if padding_mode in (_BORDER, _REFLECTION):
        # the borders count as outside for the gradient (slope 0 there), as in ATen's backward
        inside = (coord > 0) & (coord < size - 1)
        coord = jnp.where(inside, coord, jax.lax.stop_gradient(jnp.clip(coord, 0, size - 1)))
    return coord


def _gather(channels_last, indices: list):
    """Values at integer ``indices`` (one (N, *out) array per spatial dim) as (N, *out, C), zero
    where an index falls outside the input."""
    sizes = channels_last.shape[1:-1]
    inside = jnp.ones(indices[0].shape, bool)
    for index, size in zip(indices, sizes):
        inside &= (index >= 0) & (index < size)
    batch = jnp.arange(channels_last.shape[0]).reshape((-1,) + (1,) * (indices[0].ndim - 1))
    clipped = [jnp.clip(index, 0, size - 1) for index, size in zip(indices, sizes)]
    values = channels_last[(batch, *clipped)]
    return jnp.where(inside[..., None], values, 0)


def grid_sample(x, grid, interpolation_mode: int, padding_mode: int, align_corners: bool):
    """ATen's grid_sampler_2d/3d: ``x`` (N, C, *in) sampled at ``grid`` (N, *out, dims)."""
    dtype = x.dtype
    acc = accumulation_dtype(dtype) or dtype
    x, grid = x.astype(acc), grid.astype(acc)
    sizes = x.shape[2:]
    channels_last = jnp.moveaxis(x, 1, -1)
    # grid[..., 0] indexes the last (fastest) spatial dimension
    coords = [
        _unnormalize(grid[..., len(sizes) - 1 - d], size, align_corners)
        for d, size in enumerate(sizes)
    ]
    if interpolation_mode == _BICUBIC:
        out = _bicubic(channels_last, coords, padding_mode, align_corners)
    else:
        coords = [_pad(c, s, padding_mode, align_corners) for c, s in zip(coords, sizes)]
        if interpolation_mode == _NEAREST:
            out = _gather(channels_last, [jnp.round(c).astype(jnp.int32) for c in coords])
        else:
            out = _linear(channels_last, coords)
    return jnp.moveaxis(out, -1, 1).astype(dtype)


def _linear(channels_last, coords):
    """Each point from its 2**dims neighbours, gathered at once, weighted by how near it lies
    to each."""
    lows = [jnp.floor(c) for c in coords]
    fractions = [c - low for c, low in zip(coords, lows)]
    corners = list(itertools.product((0, 1), repeat=len(coords)))
    indices = [
        jnp.stack([low + corner[d] for corner in corners], -1).astype(jnp.int32)
        for d, low in enumerate(lows)
    ]
    weight = jnp.stack(
        [math.prod(f if up else 1 - f for up, f in zip(corner, fractions)) for corner in corners],
        -1,
    )
    return (weight[..., None] * _gather(channels_last, indices)).sum(-2)


def _bicubic(channels_last, coords, padding_mode: int, align_corners: bool):
    """Each point from its 4x4 neighbours, gathered at once; padding moves each tap, not the
    point."""
    sizes = channels_last.shape[1:-1]
    taps, weights = [], []
    for coord, size in zip(coords, sizes):  # rows, then columns: 4 taps and weights each
        low = jnp.floor(coord)
        taps.append(
            jnp.stack(
                [_pad(low - 1 + k, size, padding_mode, align_corners) for k in range(4)], -1
            ).astype(jnp.int32)
        )
        weights.append(jnp.stack(cubic_weights(coord - low), -1))
    grid_shape = taps[0].shape + (4,)
    rows = jnp.broadcast_to(taps[0][..., :, None], grid_shape)
    cols = jnp.broadcast_to(taps[1][..., None, :], grid_shape)
    values = _gather(channels_last, [rows, cols])  # (N, *out, 4, 4, C)
    weight = weights[0][..., :, None] * weights[1][..., None, :]
    return (weight[..., None] * values).sum((-3, -2))


@lowers(aten.grid_sampler_2d.default, aten.grid_sampler_3d.default)
def _grid_sampler(x, grid, interpolation_mode, padding_mode, align_corners):
    return grid_sample(x, grid, interpolation_mode, padding_mode, align_corners)


@lowers(aten.grid_sampler_2d_backward.default, aten.grid_sampler_3d_backward.default)
def _grid_sampler_backward(
    grad_output, x, grid, interpolation_mode, padding_mode, align_corners, output_mask
):
    """The sampler's pullback; an output the mask leaves out is None, as ATen leaves it."""

    def sample(x, grid):
        return grid_sample(x, grid, interpolation_mode, padding_mode, align_corners)

    _, pullback = jax.vjp(sample, x, grid)
    grad_x, grad_grid = pullback(grad_output.astype(x.dtype))
    return (grad_x if output_mask[0] else None, grad_grid if output_mask[1] else None)
