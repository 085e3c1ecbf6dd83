"""``nn.GRU`` and ``nn.LSTM`` on xla tensors: ATen runs each time step's pointwise part as a fused
cell off the CPU (``_thnn_fused_gru_cell``, ``_thnn_fused_lstm_cell``), for which PyTorch has a
CUDA kernel only; both directions are lowered. Outputs, states and every gradient equal eager
CPU's in float64, and nothing runs on the CPU."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import spmd_torch
import spmd_torch.debug.metrics as met
from spmd_torch._lazy import counters
from tests.helpers import assert_close

dev = spmd_torch.device()
# The fused cell's backward ATen calls: one per layer, direction and time step.
BACKWARD = {
    nn.GRU: "xla::_thnn_fused_gru_cell_backward",
    nn.LSTM: "xla::_thnn_fused_lstm_cell_backward_impl",
}


def _pair(cls, **options):
    torch.manual_seed(0)
    cpu = cls(3, 5, num_layers=2, dtype=torch.float64, **options)
    ours = cls(3, 5, num_layers=2, dtype=torch.float64, **options)
    ours.load_state_dict(cpu.state_dict())
    return cpu, ours.to(dev)


def _state(cls, directions: int, g: torch.Generator):
    h = torch.randn(2 * directions, 4, 5, generator=g, dtype=torch.float64)
    return (h, torch.randn_like(h)) if cls is nn.LSTM else h


def _to_device(state):
    if isinstance(state, tuple):
        return tuple(s.to(dev).requires_grad_() for s in state)
    return state.to(dev).requires_grad_()


def _leaves(state):
    return list(state) if isinstance(state, tuple) else [state]


@pytest.mark.parametrize("cls", [nn.GRU, nn.LSTM])
@pytest.mark.parametrize(
    "options",
    [{}, {"bias": False}, {"batch_first": True}, {"bidirectional": True}],
    ids=["bias", "no_bias", "batch_first", "bidirectional"],
)
def test_recurrent_layer_equals_eager(cls, options):
    cpu, ours = _pair(cls, **options)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(6, 4, 3, generator=g, dtype=torch.float64, requires_grad=True)
    if options.get("batch_first"):
        x = x.detach().transpose(0, 1).contiguous().requires_grad_()
    state = _state(cls, 2 if options.get("bidirectional") else 1, g)
    for leaf in _leaves(state):
        leaf.requires_grad_()
    x_dev, state_dev = x.detach().to(dev).requires_grad_(), _to_device(state)

    out, last = cpu(x, state)
    out_dev, last_dev = ours(x_dev, state_dev)
    upstream = torch.randn(out.shape, generator=g, dtype=torch.float64)
    loss = (out * upstream).sum() + sum(t.square().sum() for t in _leaves(last))
    loss_dev = (out_dev * upstream.to(dev)).sum() + sum(t.square().sum() for t in _leaves(last_dev))
    inputs, inputs_dev = [x, *_leaves(state)], [x_dev, *_leaves(state_dev)]
    grads = torch.autograd.grad(loss, inputs + list(cpu.parameters()))
    counters.clear()
    grads_dev = torch.autograd.grad(loss_dev, inputs_dev + list(ours.parameters()))
    spmd_torch.sync()

    assert_close(out_dev.cpu(), out)
    for got, want in zip(_leaves(last_dev), _leaves(last)):
        assert_close(got.cpu(), want)
    names = ["x"] + [f"state{i}" for i in range(len(_leaves(state)))]
    names += [name for name, _ in cpu.named_parameters()]
    assert_close(
        {n: g.cpu() for n, g in zip(names, grads_dev)}, dict(zip(names, grads)), kind="grad"
    )
    assert met.executed_fallback_ops() == []
    assert counters.op_counters()[BACKWARD[cls]] == 2 * 6 * (1 + bool(options.get("bidirectional")))


def test_lstm_cell_state_alone_has_a_gradient():
    """Only the last cell state reaches the loss: the backward gets no gradient for the hidden
    states (an undefined grad_hy), as for a model that reads ``c_n`` alone."""
    cpu, ours = _pair(nn.LSTM)
    x = torch.randn(6, 4, 3, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    x_dev = x.to(dev).requires_grad_()
    x.requires_grad_()
    (_, (_, c)), (_, (_, c_dev)) = cpu(x), ours(x_dev)
    (want,) = torch.autograd.grad(c.sum(), x)
    (got,) = torch.autograd.grad(c_dev.sum(), x_dev)
    assert_close(got.cpu(), want, kind="grad")


@pytest.mark.parametrize("cls", [nn.GRU, nn.LSTM])
def test_second_derivative_through_a_recurrent_layer(cls):
    """``create_graph``: ATen then differentiates its cells' composite backward, op by op."""
    cpu, ours = _pair(cls)
    x = torch.randn(3, 2, 3, generator=torch.Generator().manual_seed(4), dtype=torch.float64)
    x_dev = x.to(dev).requires_grad_()
    x.requires_grad_()
    results = []
    for model, inp in ((cpu, x), (ours, x_dev)):
        (grad,) = torch.autograd.grad(model(inp)[0].square().sum(), inp, create_graph=True)
        results.append(torch.autograd.grad(grad.square().sum(), inp)[0])
    assert_close(results[1].cpu(), results[0], kind="grad")
