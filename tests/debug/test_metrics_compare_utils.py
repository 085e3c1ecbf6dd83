"""metrics_compare_utils: reports as numbers (durations in seconds, sizes in MB), and a report
checked against earlier ones, as PyTorch/XLA's CI uses it to notice a step that changed."""

from __future__ import annotations

import pytest
import torch

import spmd_torch
import spmd_torch.debug.metrics as met
import spmd_torch.debug.metrics_compare_utils as mcu

REPORT = """Metric: TransferToDeviceTime
  TotalSamples: 4
  Accumulator: 01m29s615ms
  Rate: 3.2 / second
  Percentiles: 1%=05m003ms; 50%=750.5us; 99%=1h02s
Metric: InboundData
  TotalSamples: 2
  Accumulator: 10GB
  Percentiles: 1%=393.00KB; 99%=1.54MB
Counter: UncachedCompile
  Value: 2
"""


def test_a_report_becomes_numbers_in_seconds_and_megabytes():
    points = mcu.get_data_points_from_metrics_reports(
        [REPORT, "Counter: UncachedCompile\n  Value: 5"]
    )
    expected = {
        "TransferToDeviceTime__Accumulator_sec": 89.615,
        "TransferToDeviceTime__TotalSamples": 4,
        "TransferToDeviceTime__Percentile_1_sec": 300.003,
        "TransferToDeviceTime__Percentile_50_sec": 750.5e-6,
        "TransferToDeviceTime__Percentile_99_sec": 3602.0,
        "InboundData__Accumulator_mb": 10_000.0,
        "InboundData__TotalSamples": 2,
        "InboundData__Percentile_1_mb": 0.393,
        "InboundData__Percentile_99_mb": 1.54,
    }
    assert set(points) == set(expected) | {"UncachedCompile__Value"}
    for name, value in expected.items():
        assert points[name][0] == pytest.approx(value, rel=1e-12) and points[name][1] is None
    assert points["UncachedCompile__Value"] == [2, 5]


def test_a_step_that_compiles_again_or_falls_back_is_reported():
    x = torch.ones(4, device=spmd_torch.device())
    spmd_torch.sync()
    reports = []
    for _ in range(3):
        met.clear_all()
        (x * 2).sum().item()
        reports.append(met.metrics_report())
    points = mcu.get_data_points_from_metrics_reports(reports)
    assert "ExecuteTime__Accumulator_sec" in points and "CompileTime__TotalSamples" in points
    assert mcu.compare_metrics(points, reports[-1], {"base_expression": "True"}) == ""
    changed = (
        reports[-1] + "Counter: UncachedCompile\n  Value: 9\nCounter: aten::nonzero\n  Value: 1\n"
    )
    history = dict(points, UncachedCompile__Value=[1, 1, 1])
    lines = mcu.compare_metrics(history, changed, {"base_expression": "True"}).splitlines()
    assert lines == ["Found new aten counter: aten::nonzero__Value: 1"]
    lines = mcu.compare_metrics(
        history,
        changed,
        {"UncachedCompile__Value_expression": "v == v_mean", "base_expression": "True"},
    ).splitlines()
    assert lines[0].startswith(
        "UncachedCompile__Value failed its expression check. Expression: v == v_mean.  Mean: 1.0."
    )
    assert lines[0].endswith("Actual Value: 9") and len(lines) == 2
    with pytest.raises(ValueError, match="'12parsecs'"):
        mcu.get_data_points_from_metrics_reports(
            ["Metric: X\n  TotalSamples: 1\n  Accumulator: 12parsecs"]
        )
