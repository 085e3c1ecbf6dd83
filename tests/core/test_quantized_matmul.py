"""custom_kernel.quantized_matmul_int8 as one op: int8 weights with per-channel scales, the
activations optionally quantized per row, against the same arithmetic written out here in
float64 (integers exact), and against the float product it approximates; torch.compile; errors."""

from __future__ import annotations

import pytest
import torch

import spmd_torch
from spmd_torch.debug import graph
from spmd_torch.experimental.custom_kernel import quantized_matmul_int8

dev = spmd_torch.device()


def _weights(out_features: int, in_features: int, seed: int):
    """(float weights, their int8 form, the per-channel scale): symmetric, largest magnitude
    of each output channel to 127."""
    w = torch.randn(out_features, in_features, generator=torch.Generator().manual_seed(seed))
    scale = w.abs().amax(dim=1) / 127
    return w, torch.round(w / scale[:, None]).to(torch.int8), scale


def _activations(batch: int, in_features: int, dtype=torch.float32):
    x = torch.randn(batch, in_features, generator=torch.Generator().manual_seed(9))
    x[1] = 0.0  # a row of zeros quantizes to zeros
    return x.to(dtype)


def quantized_float64(x, w_int, scale, quantize_activation: bool):
    """The product in float64: x's rows rounded to int8 (half to even) when quantizing."""
    x = x.double()
    if quantize_activation:
        row_scale = x.abs().amax(dim=1, keepdim=True) / 127
        row_scale[row_scale == 0] = 1.0
        x = torch.round(x / row_scale) * row_scale
    return x @ (w_int.double() * scale.double()[:, None]).T


@pytest.mark.parametrize("quantize_activation", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quantized_matmul_int8_equals_float64(quantize_activation, dtype):
    w, w_int, scale = _weights(24, 64, seed=1)
    x = _activations(6, 64, dtype)
    out = quantized_matmul_int8(
        x.to(dev), w_int.to(dev), scale.to(dev), quantize_activation=quantize_activation
    ).cpu()
    assert out.dtype == dtype and out.shape == (6, 24)
    expected = quantized_float64(x, w_int, scale, quantize_activation)
    step = 2**-8 if dtype is torch.bfloat16 else 1e-5  # one rounding of the output
    torch.testing.assert_close(out.double(), expected, atol=step, rtol=step)
    assert not out[1].any()
    # and it approximates the float product (PyTorch/XLA's test asks 3e-2 of this error)
    exact = x.double() @ w.double().T
    error = (out.double() - exact).square().mean(1).sqrt().mean() / exact.square().mean().sqrt()
    assert error < 3e-2


def test_quantized_matmul_int8_is_one_node_and_compiles_under_dynamo():
    _, w_int, scale = _weights(8, 16, seed=2)
    x, w_int, scale = _activations(4, 16).to(dev), w_int.to(dev), scale.to(dev)
    out = quantized_matmul_int8(x, w_int, scale, quantize_activation=True)
    ops = [str(n.op) for n in graph.pending_program([out]).nodes]
    assert ops == ["xla.quantized_matmul_int8.default"], ops

    def call(x, w, s):
        return torch.ops.xla.quantized_matmul_int8(x, w, s, quantize_activation=True)

    compiled = torch.compile(call, backend="spmd_torch")
    torch.testing.assert_close(compiled(x, w_int, scale).cpu(), out.cpu(), atol=0, rtol=0)


def test_errors_name_the_argument():
    _, w_int, scale = _weights(8, 16, seed=3)
    x, w_int, scale = _activations(4, 16).to(dev), w_int.to(dev), scale.to(dev)
    with pytest.raises(ValueError, match=r"quantized_matmul_int8: w must be int8"):
        quantized_matmul_int8(x, w_int.float(), scale)
    with pytest.raises(ValueError, match=r"x is \[batch, in\], w \[out, in\]: x \(4, 8\)"):
        quantized_matmul_int8(x[:, :8], w_int, scale)
    with pytest.raises(ValueError, match=r"zero_point and quant_block_size are not supported"):
        quantized_matmul_int8(x, w_int, scale, zero_point=scale)
