"""torch_xla.experimental.xla_quantized_matmul: linear layers with int8 or int4 weights.

``XlaQuantizedLinear`` holds quantized weights with a scale per output channel or per block of
input features, and an optional zero point; its forward is ``torch.ops.xla.quantized_matmul``,
one op of the graph on xla tensors (``lowering/quantized.py``) and PyTorch/XLA's composite of
torch ops on CPU tensors. Activations may be quantized per row too (``quantize_activation``),
the product then taken in int32.

Differences from PyTorch/XLA, on purpose: on the device the arithmetic is float32 (int32 for
quantized activations) rounded once to the result's dtype, where PyTorch/XLA multiplies in the
activations' dtype; int4 weights are read as XLA's ``s4`` inside the program (no
``_xla_cast_int4`` with a host copy of the weights); a row of zeros quantizes to zeros.
"""

from __future__ import annotations

import torch

from spmd_torch._lazy.lowering import quantized

__all__ = ["XlaQuantizedLinear", "quantized_matmul", "quantized_matmul_xla"]

quantized_matmul = quantized._composite  # the op's CPU kernel, PyTorch/XLA's name for it


def quantized_matmul_xla(
    x: torch.Tensor,
    w: torch.Tensor,
    scaler: torch.Tensor,
    zero_point: torch.Tensor | None = None,
    block_size: int = -1,
    int4_weight: bool = False,
    quantize_activation: bool = False,
) -> torch.Tensor:
    """``x @ dequantized(w).T``, checked first (see :class:`XlaQuantizedLinear` for the shapes).

    Args:
        x: ``[..., in]`` activations.
        w: int8 ``[out, in]`` (per channel) or ``[in / block_size, block_size, out]``.
        scaler: ``[out]`` or ``[in / block_size, out]``.
        zero_point: shaped like ``scaler`` (asymmetric weights), already times the scale.
        block_size: input features per scale; -1: one scale per output channel.
        int4_weight: ``w`` holds int4 values (-8 to 7).
        quantize_activation: quantize ``x``'s rows to int8 too (per channel only).
    """
    if block_size == -1:
        _check_per_channel(x.shape[-1], scaler.shape[0], w, scaler, zero_point)
    else:
        if quantize_activation:
            raise ValueError("quantized_matmul: blockwise weights take no activation quantization")
        _check_blockwise(x.shape[-1], w.shape[-1], block_size, w, scaler, zero_point)
    return torch.ops.xla.quantized_matmul(
        x, w, scaler, zero_point, block_size, int4_weight, quantize_activation
    )


def _check_per_channel(in_features: int, out_features: int, w, scale, zero_point) -> None:
    shapes = f"w {tuple(w.shape)} {w.dtype}, scale {tuple(scale.shape)}"
    if w.dtype != torch.int8 or tuple(w.shape) != (out_features, in_features):
        raise ValueError(
            f"quantized_matmul: per-channel weights are int8 [out, in] = "
            f"[{out_features}, {in_features}]: {shapes}"
        )
    if tuple(scale.shape) != (out_features,):
        raise ValueError(f"quantized_matmul: the scale is [out] = [{out_features}]: {shapes}")
    if zero_point is not None and tuple(zero_point.shape) != (out_features,):
        raise ValueError(
            f"quantized_matmul: the zero point is [out] = [{out_features}], got "
            f"{tuple(zero_point.shape)}"
        )


def _check_blockwise(in_features: int, out_features: int, block_size: int, w, scale,
                     zero_point) -> None:  # fmt: skip
    blocks = in_features // block_size
    shapes = f"w {tuple(w.shape)} {w.dtype}, scale {tuple(scale.shape)}"
    if block_size <= 0 or in_features % block_size:
        raise ValueError(
            f"quantized_matmul: block_size={block_size} does not divide the {in_features} input "
            "features"
        )
    if w.dtype != torch.int8 or tuple(w.shape) != (blocks, block_size, out_features):
        raise ValueError(
            "quantized_matmul: blockwise weights are int8 [in / block_size, block_size, out] = "
            f"[{blocks}, {block_size}, {out_features}]: {shapes}"
        )
    for name, t in (("scale", scale), ("zero point", zero_point)):
        if t is not None and tuple(t.shape) != (blocks, out_features):
            raise ValueError(
                f"quantized_matmul: the {name} is [in / block_size, out] = "
                f"[{blocks}, {out_features}], got {tuple(t.shape)}"
            )


class XlaQuantizedLinear(torch.nn.Module):
    """A bias-free linear layer with quantized weights, loaded by :meth:`load_quantized_weight`.

    Args:
        input_dim, output_dim: the layer's features.
        is_symmetric: no zero point (else a ``zero_point`` buffer, shaped like the scale).
        block_size: input features per scale; -1: one scale per output channel.
        int4_weight: the int8 weights hold int4 values.
        quantize_activation: quantize the input's rows to int8 too (per channel only).
    """

    def __init__(
        self,
        input_dim: int,
        output_dim: int,
        is_symmetric: bool = False,
        block_size: int = -1,
        int4_weight: bool = False,
        quantize_activation: bool = False,
    ):
        super().__init__()
        self.input_dim, self.output_dim = input_dim, output_dim
        self.is_symmetric, self.block_size = is_symmetric, block_size
        self.int4_weight, self.quantize_activation = int4_weight, quantize_activation
        self.register_buffer("weight", torch.zeros(output_dim, input_dim, dtype=torch.int8))
        self.register_buffer("weight_scaler", torch.zeros(output_dim))
        if is_symmetric:
            self.zero_point = None
        else:
            self.register_buffer("zero_point", torch.zeros(output_dim))

    def load_quantized_weight(self, weight, weight_scaler, zero_point=None) -> None:
        """Per channel: ``weight`` int8 ``[out, in]``, ``weight_scaler`` ``[out]``; blockwise:
        ``[in / block_size, block_size, out]`` and ``[in / block_size, out]``; ``zero_point``
        shaped like the scale."""
        if self.block_size == -1:
            _check_per_channel(self.input_dim, self.output_dim, weight, weight_scaler, zero_point)
        else:
            _check_blockwise(
                self.input_dim, self.output_dim, self.block_size, weight, weight_scaler, zero_point
            )
        self.weight, self.weight_scaler, self.zero_point = weight, weight_scaler, zero_point

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.xla.quantized_matmul(
            x,
            self.weight,
            self.weight_scaler,
            self.zero_point,
            block_size=self.block_size,
            int4_weight=self.int4_weight,
            quantize_activation=self.quantize_activation,
        )
