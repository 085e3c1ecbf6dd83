"""spmd_torch.utils.checkpoint: gradients as torch.utils.checkpoint's, and a recomputation that
XLA's common-subexpression elimination cannot merge back into the forward pass."""

from __future__ import annotations

import jax
import pytest
import torch
import torch.utils.checkpoint as torch_checkpoint

import spmd_torch
from spmd_torch._lazy import compile as compiler
from spmd_torch._lazy import placement
from spmd_torch.debug import graph
from spmd_torch.utils.checkpoint import checkpoint, optimization_barrier_
from tests.helpers import assert_close

dev = spmd_torch.device()
# XLA on the CPU drops optimization barriers (its ``cse_barrier_expander`` pass) before its last
# CSE; TPU keeps them through scheduling. With that pass off, the CPU pipeline shows what a
# pipeline honouring barriers does with the program.
_KEEP_BARRIERS = {"xla_disable_hlo_passes": "cse_barrier_expander"}


def _block(x, w1, w2):
    return torch.tanh(torch.sin(x @ w1) @ w2)


def _inputs(device):
    torch.manual_seed(0)
    tensors = (torch.randn(8, 16), torch.randn(16, 16), torch.randn(16, 4))
    return [t.to(device).requires_grad_() for t in tensors]


def _grads(run, device):
    inputs = _inputs(device)
    out = run(*inputs)
    (out * out).sum().backward()
    return inputs


def test_grads_match_torch_checkpoint_on_cpu():
    want = _grads(lambda *a: torch_checkpoint.checkpoint(_block, *a, use_reentrant=True), "cpu")
    got = _grads(lambda *a: checkpoint(_block, *a), dev)
    spmd_torch.sync()
    for g, w in zip(got, want):
        assert_close(g.grad.cpu(), w.grad)


def test_dropout_recomputed_with_the_forward_mask():
    x = torch.randn(64, 32)
    xd = x.to(dev).requires_grad_()
    spmd_torch.manual_seed(3)
    out = checkpoint(lambda t: torch.nn.functional.dropout(t * 3, p=0.5, training=True), xd)
    out.sum().backward()
    kept = out.detach().cpu() != 0
    # d(sum(dropout(3x)))/dx is 6 where the forward kept an element, 0 where it dropped it
    assert torch.equal(xd.grad.cpu(), torch.where(kept, 6.0, 0.0))
    assert 0 < kept.sum() < kept.numel()


def _optimized_backward_hlo(run) -> str:
    x, w1, w2 = _grads(run, dev)
    program = graph.pending_program([x.grad, w1.grad, w2.grad])
    arrays = [placement.resolve(node, i) for node, i in program.leaves]
    function = compiler.build_function(program, (False,) * len(arrays))
    abstract = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in arrays]
    scalars = compiler._scalars_aval(len(program.scalars))
    lowered = jax.jit(function).lower([], abstract, scalars)
    spmd_torch.sync()
    return lowered.compile(compiler_options=_KEEP_BARRIERS).as_text()


def test_recomputation_survives_cse():
    # forward: 2 matmuls; backward: 4; the recomputation: 2 more, unless CSE merged it
    ours = _optimized_backward_hlo(lambda *a: checkpoint(_block, *a))
    merged = _optimized_backward_hlo(
        lambda *a: torch_checkpoint.checkpoint(_block, *a, use_reentrant=True)
    )
    plain = _optimized_backward_hlo(_block)
    assert plain.count(" dot(") == 6
    assert merged.count(" dot(") == 6  # no barrier: XLA merged the recomputation away
    assert ours.count(" dot(") == 8
    assert ours.count("opt-barrier(") == 1


class _LinearWithBuffer(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(16, 12)
        self.register_buffer("scale", torch.full((3, 5), 2.0))

    def forward(self, x):
        return torch.tanh(self.linear(x))


def test_a_modules_recomputation_waits_behind_its_state_and_the_gradient():
    """As in PyTorch/XLA, the backward pass puts the saved input, the incoming gradient and the
    module's parameters and buffers through one barrier before it recomputes: the recomputation
    cannot start before the gradient arrives nor share work with the forward pass."""
    from spmd_torch.distributed.fsdp import checkpoint_module

    torch.manual_seed(0)
    reference = _LinearWithBuffer()
    model = checkpoint_module(_LinearWithBuffer().to(dev))
    model.load_state_dict(reference.state_dict())
    x = torch.randn(8, 16)
    (reference(x) ** 2).sum().backward()
    (model(x.to(dev).requires_grad_()) ** 2).sum().backward()
    barrier = next(
        line
        for line in graph.get_tensors_hlo([model.linear.weight.grad]).splitlines()
        if " opt-barrier(" in line
    )
    operands = barrier.split(" opt-barrier(")[1]
    # input (8,16), gradient (8,12), weight (12,16), bias (12), buffer (3,5)
    for shape in ("f32[8,16]", "f32[8,12]", "f32[12,16]", "f32[12]", "f32[3,5]"):
        assert operands.count(shape + "{") == 1, (shape, operands)
    assert_close(model.linear.weight.grad, reference.linear.weight.grad)
    assert_close(model.linear.bias.grad, reference.linear.bias.grad)


def test_optimization_barrier_in_place_keeps_values():
    a = torch.arange(6.0).reshape(2, 3).to(dev) * 2
    b = torch.ones(4, device=dev)
    before = a._ref()
    optimization_barrier_([a, b])
    assert a._ref() is not before
    assert "optimization_barrier" in graph.pending_text([a])
    assert torch.equal(a.cpu(), torch.arange(6.0).reshape(2, 3) * 2)
    assert torch.equal(b.cpu(), torch.ones(4))


def test_optimization_barrier_rejects_cpu_tensors():
    with pytest.raises(
        TypeError, match="optimization_barrier_ needs a tensor on the xla device, got .* on cpu"
    ):
        optimization_barrier_([torch.ones(2)])


def test_use_reentrant_false_and_unknown_kwargs_raise():
    x = torch.ones(2, device=dev, requires_grad=True)
    with pytest.raises(ValueError, match="use_reentrant=False is not supported"):
        checkpoint(torch.sin, x, use_reentrant=False)
    with pytest.raises(ValueError, match="unexpected keyword arguments: context_fn"):
        checkpoint(torch.sin, x, context_fn=None)
