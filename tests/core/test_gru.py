"""The scan-based GRU against nn.GRU on CPU (outputs, last hidden states and every gradient), one
step per layer in the program whatever the sequence length."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import spmd_torch
from spmd_torch.debug import graph
from spmd_torch.experimental.gru import GRU
from tests.helpers import assert_close

dev = spmd_torch.device()


def _pair(**kwargs) -> tuple[nn.GRU, GRU]:
    torch.manual_seed(0)
    reference = nn.GRU(5, 7, **kwargs)
    ours = GRU(5, 7, **kwargs)
    ours.load_state_dict(reference.state_dict())
    return reference, ours.to(dev)


@pytest.mark.parametrize(
    "kwargs, shape, with_hx",
    [
        ({"num_layers": 2}, (6, 3, 5), True),
        ({"num_layers": 2, "batch_first": True}, (3, 6, 5), False),
        ({"bias": False}, (6, 3, 5), True),
        ({"num_layers": 1}, (6, 5), True),  # unbatched
    ],
    ids=["two-layers", "batch-first", "no-bias", "unbatched"],
)
def test_outputs_and_gradients_equal_nn_gru(kwargs, shape, with_hx):
    reference, ours = _pair(**kwargs)
    layers = kwargs.get("num_layers", 1)
    x = torch.randn(*shape, requires_grad=True)
    hx = torch.randn(layers, *([3] if len(shape) == 3 else []), 7, requires_grad=True)
    want, want_h = reference(x, hx if with_hx else None)
    (want.sum() + want_h.square().sum()).backward()
    xd = x.detach().to(dev).requires_grad_()
    hd = hx.detach().to(dev).requires_grad_()
    got, got_h = ours(xd, hd if with_hx else None)
    (got.sum() + got_h.square().sum()).backward()
    assert_close((got, got_h), (want.detach(), want_h.detach()))
    assert_close(
        [xd.grad, *([hd.grad] if with_hx else []), *(p.grad for p in ours.parameters())],
        [x.grad, *([hx.grad] if with_hx else []), *(p.grad for p in reference.parameters())],
        kind="grad",
    )


def test_the_program_holds_one_step_per_layer_whatever_the_length():
    _, ours = _pair(num_layers=2)
    sizes = []
    for length in (4, 32):
        ours.zero_grad(set_to_none=True)  # the second pass would add to the first's
        out, h = ours(torch.randn(length, 3, 5, device=dev))
        (out.sum() + h.sum()).backward()
        sizes.append(len(graph.pending_program().nodes))
        spmd_torch.sync()
    assert sizes[0] == sizes[1]


def test_bidirectional_is_a_plain_gru_and_cpu_inputs_run_nn_grus_forward():
    assert type(GRU(5, 7, bidirectional=True)) is nn.GRU
    reference, ours = _pair()
    ours = ours.cpu()
    x = torch.randn(4, 2, 5)
    assert_close(ours(x)[0], reference(x)[0].detach())
