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


# --- xla_quantized_matmul: XlaQuantizedLinear and torch.ops.xla.quantized_matmul ---------------


def _layer_weights(kind: str, seed: int, out_features=8, in_features=12, block_size=4):
    """(int weights in the layer's layout, scale, zero point or None, the float64 weights they
    stand for [out, in]) for ``kind``: per_channel, asymmetric, blockwise, asymmetric_blockwise,
    int4."""
    g = torch.Generator().manual_seed(seed)
    low = -8 if kind == "int4" else -128
    w = torch.randint(low, -low, (out_features, in_features), generator=g, dtype=torch.int8)
    if "blockwise" not in kind:
        scale = torch.rand(out_features, generator=g) + 0.5
        zero = torch.randn(out_features, generator=g) if kind == "asymmetric" else None
        dense = w.double() * scale.double()[:, None]
        if zero is not None:
            dense = dense - zero.double()[:, None]
        return w, scale, zero, dense
    blocks = in_features // block_size
    scale = torch.rand(blocks, out_features, generator=g) + 0.5
    zero = torch.randn(blocks, out_features, generator=g) if "asymmetric" in kind else None
    per_input = scale.double().repeat_interleave(block_size, 0).T  # [out, in]
    dense = w.double() * per_input
    if zero is not None:
        dense = dense - zero.double().repeat_interleave(block_size, 0).T
    layout = w.T.reshape(blocks, block_size, out_features).contiguous()
    return layout, scale, zero, dense


@pytest.mark.parametrize(
    "kind", ["per_channel", "asymmetric", "blockwise", "asymmetric_blockwise", "int4"]
)
def test_xla_quantized_linear_equals_its_float64_weights(kind):
    from spmd_torch.experimental.xla_quantized_matmul import XlaQuantizedLinear

    w, scale, zero, dense = _layer_weights(kind, seed=4)
    layer = XlaQuantizedLinear(
        12, 8, is_symmetric=zero is None, block_size=4 if "blockwise" in kind else -1,
        int4_weight=kind == "int4",
    )  # fmt: skip
    layer.load_quantized_weight(w, scale, zero_point=zero)
    x = torch.randn(5, 12, generator=torch.Generator().manual_seed(5))
    expected = x.double() @ dense.T
    on_cpu = layer(x)  # PyTorch/XLA's composite of torch ops
    out = layer.to(dev)(x.to(dev)).cpu()
    torch.testing.assert_close(out.double(), expected, atol=1e-4, rtol=1e-5)
    torch.testing.assert_close(on_cpu.double(), expected, atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize("zero_point", [False, True])
def test_quantized_matmul_with_quantized_activations(zero_point):
    """Rows of x quantized to int8, the product in int32: float64 over the rounded rows."""
    w, scale, zero, _ = _layer_weights("asymmetric" if zero_point else "per_channel", seed=6)
    x = torch.randn(2, 3, 12, generator=torch.Generator().manual_seed(7))
    out = torch.ops.xla.quantized_matmul(
        x.to(dev), w.to(dev), scale.to(dev), None if zero is None else zero.to(dev),
        quantize_activation=True,
    ).cpu()  # fmt: skip
    row_scale = x.double().abs().amax(-1, keepdim=True) / 127
    rows = torch.round(x.double() / row_scale)
    expected = (rows @ w.double().T) * scale.double()
    if zero is not None:
        expected = expected - rows.sum(-1, keepdim=True) * zero.double()
    expected = expected * row_scale
    assert out.shape == (2, 3, 8)
    torch.testing.assert_close(out.double(), expected, atol=1e-4, rtol=1e-5)


def test_quantized_matmul_is_one_node_and_compiles_under_dynamo():
    from spmd_torch.experimental.xla_quantized_matmul import XlaQuantizedLinear

    w, scale, zero, _ = _layer_weights("asymmetric", seed=8)
    layer = XlaQuantizedLinear(12, 8, quantize_activation=True)
    layer.load_quantized_weight(w, scale, zero_point=zero)
    layer = layer.to(dev)
    x = torch.randn(3, 12).to(dev)
    out = layer(x)
    ops = [str(n.op) for n in graph.pending_program([out]).nodes]
    assert ops == ["xla.quantized_matmul.default"], ops
    compiled = torch.compile(layer, backend="spmd_torch")
    torch.testing.assert_close(compiled(x).cpu(), out.cpu(), atol=0, rtol=0)


def test_quantized_weights_with_the_wrong_layout_are_refused():
    from spmd_torch.experimental.xla_quantized_matmul import (
        XlaQuantizedLinear,
        quantized_matmul_xla,
    )

    w, scale, _, _ = _layer_weights("per_channel", seed=9)
    with pytest.raises(ValueError, match=r"per-channel weights are int8 \[out, in\] = \[8, 12\]"):
        XlaQuantizedLinear(12, 8).load_quantized_weight(w.T.contiguous(), scale)
    with pytest.raises(ValueError, match=r"block_size=5 does not divide the 12 input features"):
        XlaQuantizedLinear(12, 8, block_size=5).load_quantized_weight(w, scale)
    x = torch.randn(3, 12).to(dev)
    with pytest.raises(ValueError, match=r"blockwise weights take no activation quantization"):
        quantized_matmul_xla(x, w.to(dev), scale.to(dev), block_size=4, quantize_activation=True)
