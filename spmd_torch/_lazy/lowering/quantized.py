"""Lowerings: PyTorch/XLA's quantized matmuls (linear layers with int8 or int4 weights, for
inference) as ops of our own under its schemas.

``quantized_matmul_int8`` (``custom_kernel``'s): ``x [batch, in] @ w.T`` where ``w`` is int8
``[out, in]`` with one float scale per output channel (``scalar``). With ``quantize_activation``
each row of ``x`` is quantized to int8 too (symmetric, its largest magnitude to 127, rounded to
nearest even) and the product is taken in integers, accumulated in int32, then scaled by both;
without it ``w`` is widened to ``x``'s dtype. One XLA form on every platform: PyTorch/XLA's TPU
kernel is its own (JAX ships none), and its fallback is this same computation. The block sizes
are that kernel's and have no effect.

``quantized_matmul`` (``xla_quantized_matmul``'s, behind ``XlaQuantizedLinear``): the same with
a scale per output channel, or per block of ``block_size`` input features (``w`` then ``[in /
block_size, block_size, out]``), an optional zero point (asymmetric weights), and int4 weights
held in int8 (``int4_weight``: the program reads them as XLA's ``s4``). On CPU and meta tensors
the op is PyTorch/XLA's own composite of torch ops, which also gives its result's dtype.
"""

from __future__ import annotations

import jax.numpy as jnp
import torch
from jax import lax

from .registry import lowers

_LIBRARY = torch.library.Library("xla", "FRAGMENT")
_LIBRARY.define(
    "quantized_matmul_int8(Tensor x, Tensor w, Tensor scalar, Tensor? zero_point=None, "
    "Tensor? quant_block_size=None, bool quantize_activation=False, int? batch_block_size=None, "
    "int? out_block_size=None, int? in_block_size=None) -> Tensor"
)
_LIBRARY.define(
    "quantized_matmul(Tensor x, Tensor w, Tensor scale, Tensor? zero_point=None, "
    "int? block_size=-1, bool? int4_weight=False, bool? quantize_activation=False) -> Tensor"
)
_INT8_MAX = 127


@torch.library.register_fake("xla::quantized_matmul_int8", lib=_LIBRARY)
def _quantized_matmul_int8_shape(x, w, scalar, zero_point=None, quant_block_size=None, *rest):
    shapes = f"x {tuple(x.shape)}, w {tuple(w.shape)}, scalar {tuple(scalar.shape)}"
    problems = (
        (x.dim() != 2 or w.dim() != 2 or x.shape[1] != w.shape[1], "x is [batch, in], w [out, in]"),
        (tuple(scalar.shape) != (w.shape[0],), "scalar is [out]"),
        (w.dtype != torch.int8, f"w must be int8, got {w.dtype}"),
        (not x.dtype.is_floating_point, f"x must be floating, got {x.dtype}"),
        (
            zero_point is not None or quant_block_size is not None,
            "zero_point and quant_block_size are not supported (symmetric per-channel weights "
            "only, as PyTorch/XLA's kernel)",
        ),
    )
    for failed, message in problems:
        if failed:
            raise ValueError(f"quantized_matmul_int8: {message}: {shapes}")
    return x.new_empty(x.shape[0], w.shape[0])


@lowers(torch.ops.xla.quantized_matmul_int8.default)
def _quantized_matmul_int8(x, w, scalar, zero_point=None, quant_block_size=None,
                           quantize_activation=False, *blocks):  # fmt: skip
    """``quantized_matmul``'s per-channel case (its fake kernel refuses the rest)."""
    return _quantized_matmul(x, w, scalar, quantize_activation=quantize_activation)


def _quantized_rows(x):
    """(``x``'s rows as int8, symmetric: each row's largest magnitude to 127, half to even; the
    scale of each row, float32)."""
    wide = x.astype(jnp.float32)
    row_scale = jnp.max(jnp.abs(wide), axis=-1, keepdims=True) / _INT8_MAX
    row_scale = jnp.where(row_scale == 0, 1.0, row_scale)  # a row of zeros quantizes to zeros
    return jnp.round(wide / row_scale).astype(jnp.int8), row_scale


# --- quantized_matmul ---------------------------------------------------------------------------


def _composite(x, w, scale, zero_point=None, block_size=-1, int4_weight=False,
               quantize_activation=False):  # fmt: skip
    """The op in torch ops, as PyTorch/XLA computes it off its device: its kernel for CPU and
    meta tensors (the meta run gives the result's dtype on the device too)."""
    block_size = -1 if block_size is None else block_size
    if block_size == -1:
        w = w.to(x.dtype)
        if quantize_activation:
            x, x_scale = _torch_quantized_rows(x)
            x, w = x.to(torch.int32), w.to(torch.int32)  # an int32 product, as the device's
        out = torch.nn.functional.linear(x, w) * scale
    else:
        x = x.reshape(*x.shape[:-1], x.shape[-1] // block_size, block_size)
        out = torch.einsum("scn,...sc->...sn", w.to(x.dtype), x)
        out = torch.einsum("sn,...sn->...n", scale, out)
    if zero_point is not None:
        if block_size == -1:
            out = out - torch.einsum("...c,z->...z", x, zero_point)
        else:
            out = out - torch.matmul(x.sum(dim=-1), zero_point)
    return out * x_scale if quantize_activation else out


def _torch_quantized_rows(x):
    """``_quantized_rows`` in torch ops (the scale in ``x``'s dtype, as PyTorch/XLA's)."""
    scale = x.abs().amax(dim=-1, keepdim=True) / _INT8_MAX
    return torch.round(x / scale).to(torch.int8), scale.to(x.dtype)


_LIBRARY.impl("quantized_matmul", _composite, "CompositeExplicitAutograd")


@lowers(torch.ops.xla.quantized_matmul.default)
def _quantized_matmul(x, w, scale, zero_point=None, block_size=-1, int4_weight=False,
                      quantize_activation=False):  # fmt: skip
    """The composite's arithmetic in float32 (products of int8 activations in int32), rounded
    once to the dtype its meta run gives."""
    if int4_weight:
        w = w.astype(jnp.int4)
    wide, scale = x.astype(jnp.float32), scale.astype(jnp.float32)
    if block_size is None or block_size == -1:
        if quantize_activation:
            x, x_scale = _quantized_rows(x)
            product = lax.dot_general(
                x, w, (((x.ndim - 1,), (1,)), ((), ())), preferred_element_type=jnp.int32
            ).astype(jnp.float32)
            wide = x.astype(jnp.float32)
        else:
            product = jnp.einsum("...c,zc->...z", wide, w.astype(jnp.float32))
        out = product * scale
        if zero_point is not None:
            out = out - wide.sum(-1, keepdims=True) * zero_point.astype(jnp.float32)
        return out * x_scale if quantize_activation else out
    blocks = wide.reshape(*wide.shape[:-1], wide.shape[-1] // block_size, block_size)
    out = jnp.einsum("scn,...sc->...sn", w.astype(jnp.float32), blocks)
    out = jnp.einsum("sn,...sn->...n", scale, out)
    if zero_point is not None:
        out = out - blocks.sum(-1) @ zero_point.astype(jnp.float32)
    return out
