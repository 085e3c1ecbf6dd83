"""The store behind the metrics: named counters and sampled metrics. Imports nothing of ours.

Names follow PyTorch/XLA (CompileTime, ExecuteTime, CachedCompile, aten::<op>, ...), so the metrics
report reads the same and tests can count events instead of timing them.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections import defaultdict

COUNTERS: dict[str, int] = defaultdict(int)
METRICS: dict[str, list[float]] = defaultdict(list)
_LOCK = threading.Lock()  # loader threads count their uploads too; appends need no lock


def bump(name: str, amount: int = 1) -> None:
    with _LOCK:
        COUNTERS[name] += amount


def record(name: str, value: float) -> None:
    METRICS[name].append(value)


@contextlib.contextmanager
def timed(name: str):
    """Record the wall time of the block, in nanoseconds, as one sample of metric ``name``."""
    start = time.perf_counter_ns()
    try:
        yield
    finally:
        METRICS[name].append(time.perf_counter_ns() - start)


def clear() -> None:
    COUNTERS.clear()
    METRICS.clear()
