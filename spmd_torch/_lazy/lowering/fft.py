"""Lowerings: the three aten FFT primitives every ``torch.fft`` function reduces to.

ATen's ``normalization`` counts how the transform is scaled: 0 not at all, 1 by 1/sqrt(n), 2 by
1/n (n the product of the transformed sizes). jnp.fft names the same scalings by direction, so
an unscaled inverse is jnp's ``norm="forward"``.
"""

from __future__ import annotations

import jax.numpy as jnp
import torch

from .registry import lowers

aten = torch.ops.aten

_FORWARD_NORM = ("backward", "ortho", "forward")
_INVERSE_NORM = ("forward", "ortho", "backward")


@lowers(aten._fft_r2c.default)
def _fft_r2c(x, dim, normalization, onesided):
    """Real to complex; ``onesided`` keeps the non-redundant half of the last transformed dim."""
    norm = _FORWARD_NORM[normalization]
    if onesided:
        return jnp.fft.rfftn(x, axes=dim, norm=norm)
    return jnp.fft.fftn(x, axes=dim, norm=norm)


@lowers(aten._fft_c2r.default)
def _fft_c2r(x, dim, normalization, last_dim_size):
    """Complex (one-sided) to real: an inverse transform whose last dim has ``last_dim_size``."""
    sizes = [x.shape[d] for d in dim[:-1]] + [last_dim_size]
    return jnp.fft.irfftn(x, s=sizes, axes=dim, norm=_INVERSE_NORM[normalization])


@lowers(aten._fft_c2c.default)
def _fft_c2c(x, dim, normalization, forward):
    if forward:
        return jnp.fft.fftn(x, axes=dim, norm=_FORWARD_NORM[normalization])
    return jnp.fft.ifftn(x, axes=dim, norm=_INVERSE_NORM[normalization])
