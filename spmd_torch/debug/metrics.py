"""torch_xla.debug.metrics: a read-only view of the engine's counters and sampled metrics.

Counters count events (``MarkStep``, ``CachedCompile``, ``UncachedCompile``, ``TransferToDevice``,
``aten::<op>`` for an op run on the CPU because it has no lowering, ``xla::<op>`` for each call of
an op recorded into the graph, ``aten::_local_scalar_dense`` for each scalar read to the host, as
PyTorch/XLA names it...); metrics keep samples with
PyTorch/XLA's names and units: times in nanoseconds (``CompileTime``, ``ExecuteTime``, and
``ExecuteReplicatedTime`` for a program over the SPMD devices, ``TransferToDeviceTime``,
``TransferFromDeviceTime``), data in bytes (``OutboundData`` per upload, ``InboundData`` per
download) and ``TensorsGraphSize``, the node count of each program run. Reports read the same as
PyTorch/XLA's, and tests can count events instead of timing them.

``ExecuteTime`` runs from a program's dispatch until its outputs are ready (a thread of its own
waits; a read of the metrics waits for the programs in flight), ``DispatchTime`` covers the
dispatch alone; ``CreateXlaTensor``/``DestroyXlaTensor`` count the storages (one per traced value)
made and freed, ``DeviceDataCacheMiss`` each upload of a program's lifted scalars that were not
on the device from an earlier run (of any program; the upload is a ``TransferToDeviceTime``
sample too).

A few of PyTorch/XLA's names are other names of events recorded here (``ALIASES``): the counters
``ExecuteComputation`` and ``ExecuteReplicated`` count the programs run on one device and over
several (the samples of ``ExecuteTime`` and ``ExecuteReplicatedTime``), ``CreateCompileHandles``
the programs compiled (``CompileTime``'s samples), and the metrics ``TensorToData`` time each
tensor's upload (``TransferToDeviceTime``'s samples), ``UnwrapXlaData`` the gathering of a
program's inputs (``GatherTime``'s) and ``WrapXlaData`` the binding of its outputs to their
tensors (``BindTime``'s).
"""

from __future__ import annotations

import math
from collections.abc import Callable

from spmd_torch._lazy import counters as _store

# The barrier's phases and the metrics that time them: the structure walk, the program's identity,
# gathering its inputs, the cache key and lookup (a compile on a miss is CompileTime), the
# dispatch, binding the outputs to their tensors.
BARRIER_PHASES = {
    "linearize": ("LinearizeTime",),
    "key": ("ProgramKeyTime",),
    "gather": ("GatherTime",),
    "lookup": ("CacheLookupTime",),
    "dispatch": ("DispatchTime",),
    "bind": ("BindTime",),
}
_PERCENTILES = (1, 5, 10, 20, 50, 80, 90, 95, 99)
_TIME_PARTS = (("d", 86400e9, 2), ("h", 3600e9, 2), ("m", 60e9, 2), ("s", 1e9, 2), ("ms", 1e6, 3))
_BYTE_UNITS = ("B", "KB", "MB", "GB", "TB", "PB")
_BYTE_METRICS = ("OutboundData", "InboundData")  # PyTorch/XLA reports these in bytes
_DEFAULT_COUNTERS = ("CachedCompile", "MarkStep")
# PyTorch/XLA's name -> the metric recording the same event (a counter counts its samples).
COUNTED_METRICS = {
    "CreateCompileHandles": "CompileTime",
    "ExecuteComputation": "ExecuteTime",
    "ExecuteReplicated": "ExecuteReplicatedTime",
}
SAME_METRICS = {
    "TensorToData": "TransferToDeviceTime",
    "UnwrapXlaData": "GatherTime",  # a program's input buffers, gathered
    "WrapXlaData": "BindTime",  # its output buffers, bound to their tensors
}
# Storages made and freed, each traced value's (PyTorch/XLA's XLATensor), counted apart.
_STORAGE_COUNTERS = ("CreateXlaTensor", "DestroyXlaTensor")
ALIASES = {**COUNTED_METRICS, **SAME_METRICS}
# Per counted metric, its samples object and count when the counters were last cleared: a
# counter restarts from zero then, though the metric keeps its samples.
_COUNTED_SINCE: dict[str, tuple[object, int]] = {}
# Sections a layer above adds to the full report while it is on, by name: each gives its text
# (automatic capture's callables, their states and graph breaks: core/auto_capture.py).
SECTIONS: dict[str, Callable[[], str]] = {}
_DEFAULT_METRICS = (
    "CompileTime",
    "ExecuteTime",
    "ExecuteReplicatedTime",
    "TransferToDeviceTime",
    "TransferFromDeviceTime",
)


def counter_names() -> list[str]:
    """The names of the counters that have counted something, sorted.

    Example:
        >>> import spmd_torch.debug.metrics as met
        >>> 'MarkStep' in met.counter_names()  # after a sync
        True
    """
    own = {name for name, value in _store.COUNTERS.items() if value}
    ops = {name for name, value in _store.op_counters().items() if value}
    storages = {name for name, value in _store.storage_counters().items() if value}
    return sorted(own | ops | storages | {name for name in COUNTED_METRICS if _counted(name)})


def _counted(name: str) -> int:
    """How many samples the metric behind counter ``name`` took since the counters were cleared."""
    samples = _store.metrics().get(COUNTED_METRICS[name])
    if not samples:
        return 0
    since, count = _COUNTED_SINCE.get(name, (None, 0))
    return samples.count - count if since is samples else samples.count


def counter_value(name: str) -> int | None:
    """The value of counter ``name``, or ``None`` if it has not counted anything.

    Args:
        name: The counter's name, e.g. ``'CachedCompile'`` or ``'aten::nonzero'``.

    Example:
        >>> before = met.counter_value('MarkStep') or 0
        >>> spmd_torch.sync()
        >>> met.counter_value('MarkStep') - before
        1
    """
    value = _store.COUNTERS.get(name, 0) + (_counted(name) if name in COUNTED_METRICS else 0)
    if name.startswith("xla::"):
        value += _store.op_counters().get(name, 0)
    elif name in _STORAGE_COUNTERS:
        value += _store.storage_counters()[name]
    return value if value else None


def metric_names() -> list[str]:
    """The names of the metrics that hold samples, sorted.

    Example:
        >>> 'CompileTime' in met.metric_names()  # after a compile
        True
    """
    own = {name for name, samples in _store.metrics().items() if samples}
    return sorted(own | {alias for alias, name in SAME_METRICS.items() if name in own})


def metric_data(name: str) -> tuple[int, float, list[tuple[float, float]]] | None:
    """The samples of metric ``name``, or ``None`` if it has none.

    Args:
        name: The metric's name, e.g. ``'CompileTime'`` (nanoseconds).

    Returns:
        ``(total_samples, accumulator, samples)``: the number of samples, their sum, and the
        latest 1024 samples (PyTorch/XLA's window) as ``(timestamp, value)`` pairs. The engine
        records no sample times, so each timestamp is 0.0.

    Example:
        >>> total, accumulator, samples = met.metric_data('CompileTime')
    """
    samples = _store.metrics().get(SAME_METRICS.get(name, name))
    if not samples:
        return None
    return samples.count, float(samples.total), [(0.0, float(v)) for v in samples]


def barrier_phases() -> dict[str, tuple[int, float]]:
    """Per phase of the barrier, its (samples, total nanoseconds) so far.

    Example:
        >>> met.barrier_phases()['linearize']
        (12, 3456789.0)
    """
    phases, metrics = {}, _store.metrics()
    for phase, names in BARRIER_PHASES.items():
        samples = [metrics[name] for name in names if name in metrics]
        phases[phase] = (sum(s.count for s in samples), float(sum(s.total for s in samples)))
    return phases


def clear_counters() -> None:
    """Forget every counter.

    Example:
        >>> met.clear_counters()
        >>> met.counter_value('MarkStep') is None
        True
    """
    _store.COUNTERS.clear()
    _store.OPS.clear()
    _store.SITES.clear()
    _store.clear_storage_counters()
    store = _store.metrics()
    for name, metric in COUNTED_METRICS.items():
        samples = store.get(metric)
        _COUNTED_SINCE[name] = (samples, samples.count if samples else 0)


def clear_metrics() -> None:
    """Forget every metric's samples.

    Example:
        >>> met.clear_metrics()
        >>> met.metric_names()
        []
    """
    _store.clear_metrics()


def clear_all() -> None:
    """Forget every counter and every metric.

    Example:
        >>> met.clear_all()
    """
    clear_metrics()
    clear_counters()


def executed_fallback_ops() -> list[str]:
    """The ops that ran on the CPU for lack of a lowering, as ``aten::<op>`` names, sorted.

    ``.item()``'s counter ``aten::_local_scalar_dense`` is not one of them: the value is computed
    on the device and only the scalar read back, so a loop that logs its loss lists nothing.

    Example:
        >>> met.executed_fallback_ops()
        []
    """
    return [name for name in _aten_counters() if name != _store.HOST_SCALAR_READ]


def _aten_counters() -> list[str]:
    """The ``aten::`` counters that counted something: CPU fallbacks and host scalar reads."""
    return [name for name in counter_names() if name.startswith("aten::")]


# PyTorch/XLA's metrics analysis: (metric, samples per step above which it is too frequent,
# steps before it is judged), and (metric, nanoseconds above which one sample is too slow).
_TOO_FREQUENT = (("CompileTime", 0.5, 10), ("TransferFromDeviceTime", 0.5, 0))
_TOO_SLOW = (("CompileTime", 300e9), ("ExecuteTime", 30e9))
_ANALYSIS = "pt-xla-profiler"


def performance_report() -> str:
    """PyTorch/XLA's analysis of the metrics (``PT_XLA_DEBUG``): compiles or host reads more
    frequent than every other step, a compile or run too slow, ops not lowered; each line names
    where in the user's code it happened, most frequent first. Empty when nothing stands out.

    Example:
        >>> print(met.performance_report())
        pt-xla-profiler: CompileTime too frequent: 21 counts during 11 steps (train.py:57 x21)
    """
    lines, metrics = [], _store.metrics()
    steps = counter_value("MarkStep") or 0
    for name, threshold, warmup in _TOO_FREQUENT:
        count = metrics[name].count if name in metrics else 0
        if steps > warmup and count / steps > threshold:
            lines.append(f"{name} too frequent: {count} counts during {steps} steps{_sites(name)}")
    for name, threshold in _TOO_SLOW:
        longest = max(metrics[name], default=0) if name in metrics else 0
        if longest > threshold:
            lines.append(f"{name} too slow: longest instance took {format_time(longest)}")
    unlowered = executed_fallback_ops()
    if unlowered:
        ops = ", ".join(f"{name}{_sites(name)}" for name in unlowered)
        lines.append(
            f"Op(s) not lowered: {ops}. Please open an issue with the above lowering requests."
        )
    return "".join(f"{_ANALYSIS}: {line}\n" for line in lines)


def _sites(name: str) -> str:
    """`` (train.py:57 x12, train.py:80 x9)``: where the events of ``name`` happened."""
    sites = _store.SITES.get(name)
    if not sites:
        return ""
    return " (" + ", ".join(f"{where} x{n}" for where, n in sites.most_common(4)) + ")"


def metrics_report() -> str:
    """Every metric, then every counter, as PyTorch/XLA prints them, then the sections of
    features that are on (``AutoCapture:`` lines per callable automatic capture saw).

    Each metric lists its sample count, the sum of its samples and percentiles (times human
    readable, e.g. ``093ms462.052us``); each counter its value.

    Example:
        >>> print(met.metrics_report())
        Metric: CompileTime
          TotalSamples: 1
          Accumulator: 052ms103.204us
          Percentiles: 1%=052ms103.204us; 5%=052ms103.204us; ...
        Counter: MarkStep
          Value: 1
    """
    sections = "".join(section() for section in list(SECTIONS.values()))
    return _report(metric_names(), counter_names()) + sections


def short_metrics_report(
    counter_names: list[str] | None = None, metric_names: list[str] | None = None
) -> str:
    """The report restricted to some counters and metrics (those without data are left out),
    then every ``aten::`` counter (CPU fallbacks, host scalar reads), as PyTorch/XLA's.

    Args:
        counter_names: Counters to show; default ``['CachedCompile', 'MarkStep']``.
        metric_names: Metrics to show; default: compile, execute and transfer times.

    Example:
        >>> print(met.short_metrics_report(['MarkStep'], ['ExecuteTime']))
    """
    counters = list(counter_names or _DEFAULT_COUNTERS)
    metrics = list(metric_names or _DEFAULT_METRICS)
    return _report(
        [m for m in metrics if metric_data(m) is not None],
        [c for c in counters if counter_value(c) is not None] + _aten_counters(),
    )


def _report(metrics: list[str], counters: list[str]) -> str:
    lines, store = [], _store.metrics()
    for name in metrics:
        samples = store[SAME_METRICS.get(name, name)]
        fmt = _formatter(SAME_METRICS.get(name, name))
        ordered = sorted(samples)
        percentiles = "; ".join(
            f"{p}%={fmt(ordered[min(len(ordered) - 1, int(p / 100 * len(ordered)))])}"
            for p in _PERCENTILES
        )
        lines += [
            f"Metric: {name}",
            f"  TotalSamples: {samples.count}",
            f"  Accumulator: {fmt(samples.total)}",
            f"  Percentiles: {percentiles}",
        ]
    for name in counters:
        lines += [f"Counter: {name}", f"  Value: {counter_value(name)}"]
    return "\n".join(lines) + "\n" if lines else ""


def _formatter(name: str):
    if name.endswith("Time"):
        return format_time
    if name.endswith("Bytes") or name in _BYTE_METRICS:
        return format_bytes
    return lambda value: f"{value:.2f}"


def format_time(nanoseconds: float) -> str:
    """A duration in PyTorch/XLA's report format: ``01m02s003ms004.000us``, ``012.500us``."""
    rest = float(nanoseconds)
    parts = []
    for suffix, scale, width in _TIME_PARTS:
        whole = math.floor(rest / scale)
        if whole >= 1 or parts:
            parts.append(f"{whole:0{width}d}{suffix}")
            rest -= whole * scale
    parts.append(f"{rest / 1e3:07.3f}us")
    return "".join(parts)


def format_bytes(size: float) -> str:
    """A size in PyTorch/XLA's report format: ``512.00B``, ``4.00KB``, ``1.50MB``."""
    value = float(size)
    for unit in _BYTE_UNITS[:-1]:
        if abs(value) < 1024:
            return f"{value:.2f}{unit}"
        value /= 1024
    return f"{value:.2f}{_BYTE_UNITS[-1]}"
