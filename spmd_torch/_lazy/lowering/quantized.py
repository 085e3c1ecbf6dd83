"""Lowering: PyTorch/XLA's ``quantized_matmul_int8`` (w8a8 and w8a16 linear layers for
inference) as an op of our own under its schema, ``torch.ops.xla.quantized_matmul_int8``.

``x [batch, in] @ w.T`` where ``w`` is int8 ``[out, in]`` with one float scale per output
channel (``scalar``). With ``quantize_activation`` each row of ``x`` is quantized to int8 too
(symmetric, its largest magnitude to 127, rounded to nearest even) and the product is taken in
integers, accumulated in int32, then scaled by both; without it ``w`` is widened to ``x``'s dtype.
One XLA form on every platform: PyTorch/XLA's TPU kernel is its own (JAX ships none), and its
fallback is this same computation. The block sizes are that kernel's and have no effect.
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
    scale = scalar.astype(jnp.float32)
    if not quantize_activation:
        out = jnp.dot(x, w.astype(x.dtype).T, preferred_element_type=jnp.float32) * scale
        return out.astype(x.dtype)
    wide = x.astype(jnp.float32)
    row_scale = jnp.max(jnp.abs(wide), axis=1, keepdims=True) / _INT8_MAX
    row_scale = jnp.where(row_scale == 0, 1.0, row_scale)  # a row of zeros quantizes to zeros
    quantized = jnp.round(wide / row_scale).astype(jnp.int8)
    product = lax.dot_general(
        quantized, w, (((1,), (1,)), ((), ())), preferred_element_type=jnp.int32
    )
    return (product.astype(jnp.float32) * scale * row_scale).astype(x.dtype)
