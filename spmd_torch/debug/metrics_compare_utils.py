"""Metrics reports as numbers, and a report checked against earlier ones (PyTorch/XLA's
``torch_xla.debug.metrics_compare_utils``): what a CI job uses to notice a step that suddenly
compiles more, transfers more or falls back to the CPU.

A report's metric ``Name`` gives the data points ``Name__Accumulator``, ``Name__TotalSamples``
and ``Name__Percentile_<p>`` (with ``_sec`` for a duration, ``_mb`` for a size, in those units);
a counter gives ``Name__Value``.
"""

from __future__ import annotations

import re
from collections import defaultdict

import numpy as np

_METRIC = re.compile(
    r"Metric: (\S+)\s+TotalSamples: (\d+)\s+Accumulator: (\S+)"
    r"(?:\s+ValueRate: [^\n]*)?(?:\s+Rate: [^\n]*)?(?:\s+Percentiles: ([^\n]*))?"
)
_COUNTER = re.compile(r"Counter: (\S+)\s+Value: (\d+)")
_PERCENTILE = re.compile(r"([\d.]+)%=(\S+?);?(?:\s|$)")


def _units(units: tuple) -> tuple:
    """A pattern of numbers each followed by one of ``units`` (each once, in the order printed),
    and each unit's factor to seconds or MB."""
    pattern = "".join(rf"(?:([\d.]+){re.escape(unit)})?" for unit, _ in units)
    return re.compile(pattern, re.IGNORECASE), [factor for _, factor in units]


_DURATION = _units(
    (("d", 86400.0), ("h", 3600.0), ("m", 60.0), ("s", 1.0), ("ms", 1e-3), ("us", 1e-6))
)
_SIZE = _units((("PB", 1e9), ("TB", 1e6), ("GB", 1e3), ("MB", 1.0), ("KB", 1e-3), ("B", 1e-6)))
_WITHIN_TWO_STDDEVS = "v_mean - 2.0 * v_stddev <= v <= v_mean + 2.0 * v_stddev"


def _composite(text: str, units: tuple) -> float | None:
    """``text`` in ``units`` (``_units``'s) as one number, or None when it is not written so."""
    pattern, factors = units
    match = pattern.fullmatch(text)
    if match is None or not any(match.groups()):
        return None
    return sum(float(v) * factor for v, factor in zip(match.groups(), factors) if v)


def _accumulator(text: str) -> tuple[float, str]:
    """An accumulator's value and unit suffix: a plain number, a duration in seconds (``sec``:
    ``1m02s003ms``) or a size in MB (``mb``: ``1.5GB``)."""
    try:
        return float(text), ""
    except ValueError:
        pass
    for units, suffix in ((_DURATION, "sec"), (_SIZE, "mb")):
        value = _composite(text, units)
        if value is not None:
            return value, suffix
    raise ValueError(
        f"metrics report: accumulator {text!r} is neither a number, a duration nor a size"
    )


def _data_points(report: str) -> dict[str, float | int]:
    """A report's numbers by data point name, each metric's accumulator, sample count and
    percentiles (``Name__Percentile_99_sec``) in that order, then the counters."""
    points: dict[str, float | int] = {}
    for name, samples, accumulated, percentiles in _METRIC.findall(report):
        value, unit = _accumulator(accumulated)
        suffix = f"_{unit}" if unit else ""
        points[f"{name}__Accumulator{suffix}"] = value
        points[f"{name}__TotalSamples"] = float(samples)
        for rank, text in _PERCENTILE.findall(percentiles):
            value, unit = _accumulator(text)
            points[f"{name}__Percentile_{rank}" + (f"_{unit}" if unit else "")] = value
    for name, value in _COUNTER.findall(report):
        points[f"{name}__Value"] = int(value)
    return points


def get_data_points_from_metrics_reports(metrics_reports: list[str]) -> dict[str, list]:
    """{data point: its value in each report, in the reports' order (None where absent)}."""
    points: dict[str, list] = defaultdict(lambda: [None] * len(metrics_reports))
    for k, report in enumerate(metrics_reports):
        for name, value in _data_points(report).items():
            points[name][k] = value
    return points


def compare_metrics(
    data_points: dict[str, list], metrics_report: str, config: dict | None = None
) -> str:
    """One line for each data point of ``metrics_report`` whose value ``v`` fails its check
    against the mean ``v_mean`` and standard deviation ``v_stddev`` of its values in
    ``data_points``, and one for each ``aten::`` counter (a CPU fallback) they never had; '' when
    all pass. A check is a Python expression: ``config['<point>_expression']``, else
    ``config['base_expression']``, else within two standard deviations of the mean."""
    config = config or {}
    lines = []
    for name, value in _data_points(metrics_report).items():
        history = [v for v in data_points.get(name, ()) if v is not None]
        if not history:
            if name.startswith("aten::"):
                lines.append(f"Found new aten counter: {name}: {value}")
            continue
        mean, stddev = float(np.mean(history)), float(np.std(history))
        check = config.get(f"{name}_expression", config.get("base_expression", _WITHIN_TWO_STDDEVS))
        if not eval(check, {}, {"v": value, "v_mean": mean, "v_stddev": stddev}):  # noqa: S307
            lines.append(
                f"{name} failed its expression check. Expression: {check}.  Mean: {mean}.  "
                f"Stddev: {stddev}.  Actual Value: {value}"
            )
    return "".join(line + "\n" for line in lines)
