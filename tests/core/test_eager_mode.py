"""spmd_torch.experimental eager mode: each op runs when issued; compile regions stay one graph."""

from __future__ import annotations

import pytest
import torch

import spmd_torch
import spmd_torch.experimental as exp
from spmd_torch._lazy import counters
from spmd_torch.debug import graph
from spmd_torch.debug import metrics as met
from tests.helpers import assert_close, assert_compiles

dev = spmd_torch.device()


@pytest.fixture
def eager():
    with exp.eager_mode_context(True) as saved:
        assert saved is False
        yield
    assert not exp.is_eager_mode()


def _programs_run() -> int:
    """Programs run: eager ops' (PyTorch/XLA's name for them) and compile regions'."""
    metrics = counters.metrics()  # ExecuteTime is recorded once a program finished
    return len(metrics["EagerOpExecuteTime"]) + len(metrics["ExecuteTime"])


def test_eager_ops_are_timed_under_their_own_names(eager):
    x = torch.ones(3).to(dev)
    met.clear_all()
    with assert_compiles(1):
        (x + 100.5).cpu()
    assert met.metric_data("EagerOpCompileTime")[0] == 1
    assert met.metric_data("EagerOpExecuteTime")[0] == 1
    spmd_torch.sync()  # nothing pending: runs nothing
    assert "CompileTime" not in met.metric_names() and "ExecuteTime" not in met.metric_names()


def test_a_torch_compiled_graph_in_eager_mode_is_timed_as_a_graph(eager):
    """As PyTorch/XLA: the compiled function's one program under ExecuteTime and CompileTime, not
    the eager ops' names."""
    x = torch.ones(5, 5, device=dev) * 5
    met.clear_all()
    compiled = torch.compile(lambda t: torch.cos(torch.sin(t)), backend="spmd_torch")
    out = compiled(x)
    assert_close(out.cpu(), torch.cos(torch.sin(torch.full((5, 5), 5.0))))
    assert met.metric_data("ExecuteTime")[0] == 1
    assert met.metric_data("CompileTime")[0] == 1
    assert met.metric_data("EagerOpExecuteTime") is None  # nothing else ran since the clear


def test_each_op_is_computed_when_issued(eager):
    x = torch.randn(4, 6)
    xd = x.to(dev)
    steps = counters.COUNTERS["MarkStep"]
    y = xd.sin()
    assert graph.pending_count() == 0
    z = y @ xd.t()
    assert graph.pending_count() == 0
    z.mul_(2)
    assert graph.pending_count() == 0
    assert counters.COUNTERS["MarkStep"] == steps  # per-op runs are not steps
    assert_close(z.cpu(), (x.sin() @ x.t()) * 2)


def test_factories_on_the_device_are_computed_when_issued(eager):
    x = torch.arange(6, device=dev).reshape(2, 3)
    assert graph.pending_count() == 0
    assert torch.equal(x.cpu(), torch.arange(6).reshape(2, 3))


def test_same_op_signature_compiles_once(eager):
    x = torch.randn(8, 3).to(dev)
    (x * 2 + 1).relu()  # warm: one program per op signature
    before = _programs_run()
    with assert_compiles(0):
        for _ in range(3):
            out = (x * 2 + 1).relu()
    assert _programs_run() - before == 9  # three ops, each its own program, three times
    assert torch.equal(out.cpu(), (x.cpu() * 2 + 1).relu())


def test_training_step_matches_eager_cpu(eager):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Tanh(), torch.nn.Linear(7, 2))
    reference = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Tanh(), torch.nn.Linear(7, 2))
    reference.load_state_dict(model.state_dict())
    model.to(dev)
    x, target = torch.randn(3, 5), torch.randn(3, 2)
    for net, data, goal in ((model, x.to(dev), target.to(dev)), (reference, x, target)):
        optimizer = torch.optim.SGD(net.parameters(), lr=0.1)
        loss = torch.nn.functional.mse_loss(net(data), goal)
        loss.backward()
        optimizer.step()
    assert graph.pending_count() == 0
    for got, want in zip(model.parameters(), reference.parameters()):
        assert_close(got.detach().cpu(), want.detach())


def test_compile_region_inside_stays_one_graph(eager):
    x = torch.randn(4, 4)
    xd = x.to(dev)
    before = _programs_run()

    @spmd_torch.compile
    def step(t):
        for _ in range(5):
            t = torch.sin(t) * 2
        assert graph.pending_count() >= 1  # traced lazily inside
        return t

    y = step(xd)
    assert _programs_run() - before == 1
    assert exp.is_eager_mode()
    expected = x
    for _ in range(5):
        expected = torch.sin(expected) * 2
    assert_close(y.cpu(), expected)


def test_context_restores_the_mode_and_runs_nothing_twice():
    assert not exp.is_eager_mode()
    a = torch.ones(3, device=dev) + 1  # traced: pending
    with exp.eager_mode_context(True):
        assert exp.is_eager_mode()
        assert graph.pending_count() == 0  # turning eager mode on runs what was traced
        with exp.eager_mode_context(False) as saved:
            assert saved is True
            b = a * 3
            assert graph.pending_count() == 1
        assert exp.is_eager_mode()
        spmd_torch.sync()
    assert not exp.is_eager_mode()
    assert torch.equal(b.cpu(), torch.full((3,), 6.0))


def test_deprecated_experimental_compile_warns_and_compiles():
    with pytest.warns(DeprecationWarning, match="use spmd_torch.compile"):
        compiled = exp.compile(lambda t: t + 1)
    assert torch.equal(compiled(torch.zeros(2, device=dev)).cpu(), torch.ones(2))
