"""spmd_torch.debug.metrics and spmd_torch.debug.graph: counts after syncs, report format."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest
import torch

import spmd_torch
import spmd_torch.debug.metrics as met
from spmd_torch._lazy import counters
from spmd_torch.debug import graph

DEV = torch.device("xla:0")


pytestmark = pytest.mark.usefixtures("isolated_metrics")  # tests here clear the store


def _step(columns: int) -> torch.Tensor:
    return torch.ones(2, columns, device=DEV) * 3 + 1


def test_sync_counts_one_mark_step():
    before = met.counter_value("MarkStep") or 0
    spmd_torch.sync()
    spmd_torch.sync()
    assert met.counter_value("MarkStep") == before + 2


def test_first_sync_compiles_and_the_second_hits_the_cache():
    met.clear_all()
    first = _step(257)  # noqa: F841  (a live tensor: dead ones are never computed)
    spmd_torch.sync()
    assert met.counter_value("UncachedCompile") == 1
    assert met.counter_value("CachedCompile") is None
    assert met.metric_data("CompileTime")[0] == 1
    assert met.metric_data("ExecuteTime")[0] == 1
    second = _step(257)
    spmd_torch.sync()
    assert torch.equal(second.cpu(), torch.full((2, 257), 4.0))
    assert met.counter_value("UncachedCompile") == 1
    assert met.counter_value("CachedCompile") == 1
    assert met.metric_data("CompileTime")[0] == 1
    assert met.metric_data("ExecuteTime")[0] == 2
    assert met.counter_value("MarkStep") == 2


def test_sync_with_nothing_pending_runs_nothing():
    spmd_torch.sync()
    met.clear_all()
    spmd_torch.sync()
    assert met.counter_names() == ["MarkStep"]
    assert met.metric_names() == []


def test_metric_data_shape():
    met.clear_all()
    counters.record("ExecuteTime", 1000)
    counters.record("ExecuteTime", 3000)
    total, accumulator, samples = met.metric_data("ExecuteTime")
    assert total == 2
    assert accumulator == 4000.0
    assert [value for _, value in samples] == [1000.0, 3000.0]
    assert all(len(sample) == 2 for sample in samples)


def test_absent_names_read_as_none():
    met.clear_all()
    assert met.counter_value("NoSuchCounter") is None
    assert met.metric_data("NoSuchMetric") is None
    assert "NoSuchCounter" not in met.counter_names()


def test_clear_counters_keeps_metrics_and_clear_metrics_keeps_counters():
    counters.bump("MarkStep")
    counters.record("CompileTime", 5)
    met.clear_counters()
    assert met.counter_names() == [] and met.metric_names() != []
    counters.bump("MarkStep")
    met.clear_metrics()
    assert met.metric_names() == [] and met.counter_names() == ["MarkStep"]
    met.clear_all()
    assert met.counter_names() == [] and met.metric_names() == []


def test_executed_fallback_ops_lists_aten_counters():
    met.clear_all()
    counters.bump("aten::nonzero", 2)
    counters.bump("aten::_unique2")
    counters.bump("MarkStep")
    assert met.executed_fallback_ops() == ["aten::_unique2", "aten::nonzero"]


def test_host_scalar_reads_count_as_local_scalar_dense_and_not_as_fallbacks():
    """``.item()`` and ``if t:`` each count once under PyTorch/XLA's ``aten::_local_scalar_dense``
    (its troubleshooting guide finds host syncs by it); the values are eager CPU's."""
    met.clear_all()
    cpu = torch.tensor([1.5, -2.0])
    x = cpu.to(DEV) * 2
    assert x.sum().item() == (cpu * 2).sum().item()
    assert bool(x[0] > 0) is bool(cpu[0] * 2 > 0)
    assert met.counter_value("aten::_local_scalar_dense") == 2
    assert met.executed_fallback_ops() == []
    assert met.performance_report() == ""


def test_short_metrics_report_adds_every_aten_counter():
    """As PyTorch/XLA's: the chosen counters, then each ``aten::`` counter (fallbacks, reads)."""
    met.clear_all()
    x = torch.tensor([0.0, 3.0], device=DEV)
    x.max().item()
    torch.nonzero(x)
    report = met.short_metrics_report(counter_names=["MarkStep"], metric_names=["InboundData"])
    assert "Counter: aten::_local_scalar_dense\n  Value: 1" in report
    assert "Counter: aten::nonzero\n  Value: 1" in report
    assert met.executed_fallback_ops() == ["aten::nonzero"]


def test_each_recorded_op_call_counts_under_its_xla_name():
    """``xla::<op>`` counts the calls recorded into the graph, overloads summed (an in-place
    ``+=`` records the functional add), not the ops that ran on the CPU; clearing the counters
    restarts them."""
    met.clear_all()
    x = torch.ones(3, device=DEV)
    x += 2  # add.Tensor
    y = x.add(1.5).mul(x)  # add.Scalar lifted: still add
    torch.nonzero(y)  # a CPU fallback: aten::nonzero, no xla::nonzero
    assert met.counter_value("xla::add") == 2
    assert met.counter_value("xla::mul") == 1
    assert "xla::add" in met.counter_names() and "xla::nonzero" not in met.counter_names()
    assert "Counter: xla::mul\n  Value: 1" in met.metrics_report()
    met.clear_counters()
    assert met.counter_value("xla::add") is None
    x += 1
    assert met.counter_value("xla::add") == 1


def test_metrics_report_format():
    met.clear_all()
    counters.record("CompileTime", 93_462_052)
    counters.bump("UncachedCompile")
    counters.bump("CachedCompile", 4)
    sample = "093ms462.052us"
    percentiles = "; ".join(f"{p}%={sample}" for p in (1, 5, 10, 20, 50, 80, 90, 95, 99))
    assert met.metrics_report() == (
        "Metric: CompileTime\n"
        "  TotalSamples: 1\n"
        f"  Accumulator: {sample}\n"
        f"  Percentiles: {percentiles}\n"
        "Counter: CachedCompile\n"
        "  Value: 4\n"
        "Counter: CreateCompileHandles\n"  # PyTorch/XLA's count of compiles: CompileTime's samples
        "  Value: 1\n"
        "Counter: UncachedCompile\n"
        "  Value: 1\n"
    )


def test_report_percentiles_pick_sorted_samples():
    met.clear_all()
    for value in (4000, 1000, 3000, 2000):
        counters.record("ExecuteTime", value)
    report = met.metrics_report()
    assert "Accumulator: 010.000us" in report
    assert "1%=001.000us; 5%=001.000us; 10%=001.000us; 20%=001.000us; 50%=003.000us" in report
    assert "99%=004.000us" in report


@pytest.mark.parametrize(
    "nanoseconds, text",
    [
        (12_500, "012.500us"),
        (1_500_000_000, "01s500ms000.000us"),
        (62_003_004_000, "01m02s003ms004.000us"),
        (90_061_000_000_000, "01d01h01m01s000ms000.000us"),
    ],
)
def test_format_time(nanoseconds, text):
    assert met.format_time(nanoseconds) == text


def test_short_metrics_report_defaults_and_selection():
    met.clear_all()
    counters.bump("MarkStep", 3)
    counters.bump("UncachedCompile")
    counters.record("ExecuteTime", 2_000)
    counters.record("CompileTime", 1_000)
    short = met.short_metrics_report()
    assert "Counter: MarkStep\n  Value: 3\n" in short
    assert "UncachedCompile" not in short
    assert "Metric: CompileTime" in short and "Metric: ExecuteTime" in short
    only = met.short_metrics_report(counter_names=["UncachedCompile"], metric_names=["CompileTime"])
    assert only.startswith("Metric: CompileTime\n")
    assert only.endswith("Counter: UncachedCompile\n  Value: 1\n")
    assert "ExecuteTime" not in only and "MarkStep" not in only


# debug.graph ----------------------------------------------------------------------------------


def test_get_tensors_text_shows_the_pending_ops():
    y = torch.ones(3, device=DEV) * 2
    text = graph.get_tensors_text([y])
    assert "aten.mul.Tensor" in text
    assert text.splitlines()[-1].startswith("return")
    assert graph.pending_text([y]) == text


def test_get_tensors_hlo_is_hlo_text_and_runs_nothing():
    x = torch.ones(3).to(DEV)
    spmd_torch.sync()
    y = x * 2
    before = dict(counters.COUNTERS)
    hlo = graph.get_tensors_hlo([y])
    assert hlo.startswith("HloModule ") and re.search(r"%\S+ = f32\[3\]\{0\} multiply\(", hlo)
    assert dict(counters.COUNTERS) == before


def test_graph_rejects_cpu_tensors():
    with pytest.raises(
        ValueError, match=r"\(tensors\[1\]\) needs a tensor on the xla device, got .* on cpu"
    ):
        graph.get_tensors_text([torch.ones(1, device=DEV), torch.ones(1)])


_ENDS_WITH_A_PROGRAM_IN_FLIGHT = """
import torch, spmd_torch.core.xla_model as xm
x = torch.randn(1000, 1000, device=xm.xla_device())
for _ in range(20):
    x = torch.tanh(x @ x)
xm.mark_step()  # dispatched, not waited for: the interpreter exits while it runs
"""


@pytest.mark.multiprocess
def test_a_script_ending_with_a_program_in_flight_exits_cleanly():
    """ExecuteTime's waiting thread is stopped at exit: left to leave XLA's wait during the
    interpreter's finalization, it aborted the process (code -6, "exception not rethrown")."""
    result = subprocess.run(
        [sys.executable, "-c", _ENDS_WITH_A_PROGRAM_IN_FLIGHT],
        capture_output=True,
        text=True,
        timeout=300,
        env=dict(os.environ, JAX_PLATFORMS="cpu"),
    )
    assert result.returncode == 0, result.stderr
