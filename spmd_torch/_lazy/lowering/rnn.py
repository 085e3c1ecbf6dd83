"""Lowerings: the fused GRU and LSTM cells ``nn.GRU`` and ``nn.LSTM`` call on an accelerator.

ATen runs a recurrent layer one time step at a time and, off the CPU, each step's pointwise part
as one fused cell (``_thnn_fused_gru_cell``, ``_thnn_fused_lstm_cell``) whose backward reads a
workspace the forward saved. PyTorch ships those kernels for CUDA only (no CPU or Meta kernel),
so both directions are lowered here, with the workspace laid out as CUDA's kernels lay it out:
GRU ``[r, z, n, hx, hn]`` (the reset, update and new gates, the previous hidden state, and the
hidden part of the new gate), LSTM ``[i, f, g, o]`` (the activated gates), each (batch, k *
hidden). The gates are in ``nn.GRU``'s and ``nn.LSTM``'s weight order.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import torch

from .registry import lowers, meta_kernel

aten = torch.ops.aten


@meta_kernel("_thnn_fused_gru_cell")
def _gru_cell_shapes(input_gates, hidden_gates, hx, input_bias=None, hidden_bias=None):
    """The new hidden state, and the workspace: five (batch, hidden) blocks."""
    return torch.empty_like(hx), hx.new_empty((hx.shape[0], 5 * hx.shape[1]))


@lowers(aten._thnn_fused_gru_cell.default)
def _gru_cell(input_gates, hidden_gates, hx, input_bias=None, hidden_bias=None):
    if input_bias is not None:
        input_gates, hidden_gates = input_gates + input_bias, hidden_gates + hidden_bias
    i_r, i_z, i_n = jnp.split(input_gates, 3, axis=1)
    h_r, h_z, h_n = jnp.split(hidden_gates, 3, axis=1)
    r = jax.nn.sigmoid(i_r + h_r)
    z = jax.nn.sigmoid(i_z + h_z)
    n = jnp.tanh(i_n + r * h_n)
    hy = n + z * (hx - n)
    return hy, jnp.concatenate([r, z, n, hx, h_n], axis=1)


@meta_kernel("_thnn_fused_gru_cell_backward")
def _gru_cell_backward_shapes(grad_hy, workspace, has_bias):
    """Gradients of the input gates, hidden gates, hx and both biases (empty without bias)."""
    batch, hidden = grad_hy.shape
    gates = grad_hy.new_empty((batch, 3 * hidden))
    bias = grad_hy.new_empty((3 * hidden,) if has_bias else (0,))
    return gates, torch.empty_like(gates), torch.empty_like(grad_hy), bias, torch.empty_like(bias)


@lowers(aten._thnn_fused_gru_cell_backward.default)
def _gru_cell_backward(grad_hy, workspace, has_bias):
    r, z, n, hx, h_n = jnp.split(workspace, 5, axis=1)
    grad_n = grad_hy * (1 - z) * (1 - n * n)  # through tanh, before the reset gate's product
    grad_z = grad_hy * (hx - n) * z * (1 - z)
    grad_r = grad_n * h_n * r * (1 - r)
    input_gates = jnp.concatenate([grad_r, grad_z, grad_n], axis=1)
    hidden_gates = jnp.concatenate([grad_r, grad_z, grad_n * r], axis=1)
    if has_bias:
        bias_i, bias_h = input_gates.sum(axis=0), hidden_gates.sum(axis=0)
    else:
        bias_i = bias_h = jnp.zeros((0,), grad_hy.dtype)
    return input_gates, hidden_gates, grad_hy * z, bias_i, bias_h


@meta_kernel("_thnn_fused_lstm_cell")
def _lstm_cell_shapes(input_gates, hidden_gates, cx, input_bias=None, hidden_bias=None):
    """The new hidden and cell states, and the workspace: the four activated gates."""
    return torch.empty_like(cx), torch.empty_like(cx), torch.empty_like(input_gates)


@lowers(aten._thnn_fused_lstm_cell.default)
def _lstm_cell(input_gates, hidden_gates, cx, input_bias=None, hidden_bias=None):
    gates = input_gates + hidden_gates
    if input_bias is not None:
        gates = gates + input_bias + hidden_bias
    i, f, g, o = jnp.split(gates, 4, axis=1)
    i, f, g, o = jax.nn.sigmoid(i), jax.nn.sigmoid(f), jnp.tanh(g), jax.nn.sigmoid(o)
    cy = f * cx + i * g
    return o * jnp.tanh(cy), cy, jnp.concatenate([i, f, g, o], axis=1)


@meta_kernel("_thnn_fused_lstm_cell_backward_impl")
def _lstm_cell_backward_shapes(grad_hy, grad_cy, cx, cy, workspace, has_bias):
    """Gradients of the gates, of cx, and of the (summed) bias (empty without bias)."""
    bias = workspace.new_empty((workspace.shape[1],) if has_bias else (0,))
    return torch.empty_like(workspace), torch.empty_like(cx), bias


@lowers(aten._thnn_fused_lstm_cell_backward_impl.default)
def _lstm_cell_backward(grad_hy, grad_cy, cx, cy, workspace, has_bias):
    i, f, g, o = jnp.split(workspace, 4, axis=1)
    tanh_cy = jnp.tanh(cy)
    grad_hy = jnp.zeros_like(cy) if grad_hy is None else grad_hy  # an unused output's
    grad_c = grad_hy * o * (1 - tanh_cy * tanh_cy)
    if grad_cy is not None:
        grad_c = grad_c + grad_cy
    gates = jnp.concatenate(
        [grad_c * g * i * (1 - i), grad_c * cx * f * (1 - f), grad_c * i * (1 - g * g)]
        + [grad_hy * tanh_cy * o * (1 - o)],
        axis=1,
    )
    bias = gates.sum(axis=0) if has_bias else jnp.zeros((0,), gates.dtype)
    return gates, grad_c * f, bias
