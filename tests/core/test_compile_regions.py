"""spmd_torch.compile / step / sync and the other top-level names of torch_xla."""

from __future__ import annotations

import pytest
import torch

import spmd_torch
from spmd_torch._lazy import counters
from spmd_torch.core import xla_model as xm
from spmd_torch.debug import graph
from tests.helpers import assert_close, assert_compiles, assert_counter_delta

dev = spmd_torch.device()


def _programs_run() -> int:
    metrics = counters.metrics()  # ExecuteTime is recorded once a program finished
    return len(metrics["ExecuteTime"]) + len(metrics["ExecuteReplicatedTime"])


def _f(x: torch.Tensor) -> torch.Tensor:
    return torch.sin(x) * 2 + torch.cos(x)


def test_decorator_form_gives_eager_values_and_runs_one_program():
    x = torch.randn(4, 5)
    xd = x.to(dev)
    compiled = spmd_torch.compile(_f)
    before = _programs_run()
    y = compiled(xd)
    assert _programs_run() - before == 1
    assert graph.pending_count() == 0
    assert_close(y.cpu(), _f(x))


def test_called_decorator_and_context_manager_forms_give_eager_values():
    x = torch.randn(3, 3)
    xd = x.to(dev)
    spmd_torch.sync()

    @spmd_torch.compile()
    def g(t):
        return t @ t + 1

    with spmd_torch.compile():
        before = _programs_run()
        y = g(xd)
        after_g = graph.pending_count()  # g's region ran its program on leaving
        z = y * 3
    assert after_g == 0
    assert _programs_run() - before == 2  # g's region, then the outer region's end
    assert_close(z.cpu(), (x @ x + 1) * 3)


def test_region_syncs_what_came_before_it():
    a = torch.ones(3, device=dev) * 2
    assert graph.pending_count() == 1
    with spmd_torch.compile():
        assert graph.pending_count() == 0
        b = a + 1
    assert torch.equal(b.cpu(), torch.full((3,), 3.0))


def test_full_graph_item_raises_naming_the_line():
    x = torch.ones(3, device=dev)
    with pytest.raises(RuntimeError, match=r"full_graph=True.*test_compile_regions\.py:(\d+)") as e:
        with spmd_torch.compile(full_graph=True, name="train_step"):
            (x * 2).sum().item()
    line = int(e.value.args[0].split("test_compile_regions.py:")[1].split(":")[0])
    source = open(__file__).read().splitlines()[line - 1]
    assert ".item()" in source
    assert "'train_step'" in str(e.value)


@pytest.mark.filterwarnings("ignore:.*has no xla lowering")
@pytest.mark.parametrize(
    "read",
    [
        pytest.param(lambda t: t.cpu(), id="cpu"),
        pytest.param(lambda t: print(t), id="print"),
        pytest.param(lambda t: t[t > 1], id="data-dependent-shape"),
        pytest.param(lambda t: spmd_torch.sync(), id="barrier"),
    ],
)
def test_full_graph_host_reads_raise(read):
    x = torch.arange(4.0, device=dev)
    spmd_torch.sync()

    @spmd_torch.compile(full_graph=True)
    def step(t):
        read(t + 1)

    with pytest.raises(RuntimeError, match="'step' \\(full_graph=True\\) would run a program"):
        step(x)


def test_full_graph_allows_reading_computed_values_and_off_by_default():
    x = torch.arange(4.0, device=dev)
    spmd_torch.sync()
    with spmd_torch.compile(full_graph=True):
        assert x.cpu().sum() == 6.0  # computed before the region: no program needed
        y = x * 2
    with spmd_torch.compile():
        assert (y + 1).sum().item() == 16.0  # full_graph=False: a read runs a partial program


def test_max_different_graphs_two_shapes_raise():
    @spmd_torch.compile(max_different_graphs=1)
    def double(t):
        return t * 2

    a = double(torch.ones(3, device=dev))
    with pytest.raises(RuntimeError, match="'double' traced 2 different graphs.*=1"):
        double(torch.ones(4, device=dev))
    assert torch.equal(a.cpu(), torch.full((3,), 2.0))


def test_max_different_graphs_same_shape_twice_does_not_raise():
    @spmd_torch.compile(max_different_graphs=1)
    def double(t):
        return t * 2

    x = torch.ones(3, 13, device=dev)
    spmd_torch.sync()
    with assert_compiles(1):
        for _ in range(3):
            out = double(x)
    assert torch.equal(out.cpu(), torch.full((3, 13), 2.0))


def test_max_different_graphs_counts_graphs_not_shapes_only():
    @spmd_torch.compile(max_different_graphs=2)
    def op(t, square):
        return t * t if square else t + t

    op(torch.ones(3, device=dev), True)
    op(torch.ones(3, device=dev), False)
    op(torch.ones(3, device=dev), True)
    with pytest.raises(RuntimeError, match="traced 3 different graphs"):
        op(torch.ones(5, device=dev), True)


def test_max_different_graphs_counts_per_function_over_its_wrappers():
    """PyTorch/XLA's dynamic-shape test wraps the function anew at each call: the count is the
    function's, not the wrapper's."""

    def triple(t):
        return t * 3

    spmd_torch.compile(triple, max_different_graphs=1)(torch.ones(3, device=dev))
    with pytest.raises(
        RuntimeError,
        match=r"'triple' traced 2 different graphs.*its input shapes changed: input 0: f32\[3\] "
        r"-> f32\[4\]",
    ):
        spmd_torch.compile(triple, max_different_graphs=1)(torch.ones(4, device=dev))


def test_max_different_graphs_names_the_first_op_that_changed():
    @spmd_torch.compile(max_different_graphs=1)
    def scaled(t, divide):
        t = t + t
        return t / 3 if divide else t * 3

    scaled(torch.ones(3, device=dev), False)
    with pytest.raises(RuntimeError, match=r"node 1 \(op/args\): aten.mul.Tensor.* -> aten.div"):
        scaled(torch.ones(3, device=dev), True)


def test_max_different_graphs_must_be_positive():
    with pytest.raises(ValueError, match="max_different_graphs must be >= 1, got 0"):
        spmd_torch.compile(_f, max_different_graphs=0)


def test_step_context_syncs_at_exit_and_counts_a_mark_step():
    x = torch.randn(5)
    with assert_counter_delta("MarkStep", 2):  # one before, one at the end
        with spmd_torch.step():
            y = x.to(dev).exp()
            assert graph.pending_count() >= 1
        assert graph.pending_count() == 0
    assert_close(y.cpu(), x.exp())


def test_sync_runs_step_closures_after_the_barrier():
    seen = []
    loss = torch.ones(2, device=dev).sum() * 3
    xm.add_step_closure(lambda t: seen.append(t.item()), args=(loss,))
    with assert_compiles(1):
        spmd_torch.sync()
    assert seen == [6.0]


def test_real_devices_and_device_count_agree():
    assert spmd_torch.real_devices() == [f"CPU:{k}" for k in range(8)]
    assert spmd_torch.device_count() == len(spmd_torch.real_devices())


def test_manual_seed_accepts_a_device():
    spmd_torch.manual_seed(7, device=dev)
    a = torch.rand(4, device=dev).cpu()
    spmd_torch.manual_seed(7)
    assert torch.equal(torch.rand(4, device=dev).cpu(), a)
