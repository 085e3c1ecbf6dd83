"""The store behind the metrics: named counters and sampled metrics. Imports nothing of ours.

Names follow PyTorch/XLA (CompileTime, ExecuteTime, CachedCompile, aten::<op>, ...), so the metrics
report reads the same and tests can count events instead of timing them.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections import Counter, defaultdict, deque
from collections.abc import Callable


class Samples:
    """One metric: its number of samples and their sum since the last clear, and the latest 1024
    samples (PyTorch/XLA's window), so that per-op metrics stay small over a long run."""

    __slots__ = ("count", "total", "recent")

    def __init__(self):
        self.count, self.total, self.recent = 0, 0, deque(maxlen=1024)

    def append(self, value: float) -> None:
        _LOCK.acquire()  # loader threads record uploads while the main thread traces; no `with`:
        self.count += 1  # every traced op records a sample (LazyTracing)
        self.total += value
        self.recent.append(value)
        _LOCK.release()

    def extend(self, values: list) -> None:
        """Record several samples at once; the caller holds ``_LOCK``."""
        self.count += len(values)
        self.total += sum(values)
        self.recent.extend(values[-1024:])

    def __len__(self) -> int:
        return self.count

    def __iter__(self):
        return iter(self.recent)

    def since(self, count: int) -> list[float]:
        """The samples recorded after the first ``count`` that the window still holds."""
        new = min(self.count - count, len(self.recent))
        return list(self.recent)[len(self.recent) - new :] if new > 0 else []


COUNTERS: dict[str, int] = defaultdict(int)
METRICS: dict[str, Samples] = defaultdict(Samples)
# Recorded calls per op (PyTorch/XLA's ``xla::<op>`` counters): keyed by the op's id, a C hash on
# the trace path; ``OP_NAMES`` names each op once, when its meta kernel first runs.
OPS: dict[int, int] = defaultdict(int)
# LazyTracing's samples not yet in METRICS: every traced op appends one, and a list's append needs
# no lock (the GIL makes it atomic) where a sample's does. ``metrics()`` and the barrier fold them.
TRACING: list[int] = []
OP_NAMES: dict[int, str] = {}
# Where in the user's code events happened, per metric or counter: "file:line" -> how often (what
# the debugging tool's analysis names: each compile and CPU fallback, host reads when debugging).
SITES: dict[str, Counter] = defaultdict(Counter)
_LOCK = threading.Lock()
# Called before the metrics are read: each records what finished meanwhile (run.py registers the
# programs' execution times, taken on a thread of their own).
BEFORE_READ: list[Callable[[], None]] = []
# Storages made and freed so far, which tensor.py counts (making a storage is too hot for
# ``bump``: a list item's increment), and both at the last clear: PyTorch/XLA's CreateXlaTensor
# and DestroyXlaTensor (one XLATensor per traced value) count from there.
STORAGES = [0, 0]
_STORAGES_AT_CLEAR = [0, 0]
# A scalar read to the host (``.item()``, ``if t:``), under PyTorch/XLA's name for it: its
# troubleshooting guide finds host syncs by this counter. Not a CPU fallback here.
HOST_SCALAR_READ = "aten::_local_scalar_dense"


def bump(name: str, amount: int = 1) -> None:
    with _LOCK:
        COUNTERS[name] += amount


def note_site(name: str, where: str) -> None:
    """One event of ``name`` happened at ``where`` (the user's file:line)."""
    with _LOCK:
        SITES[name][where] += 1


def fold_tracing() -> None:
    """Move TRACING's samples into LazyTracing's (the barrier does, so the list stays short)."""
    with _LOCK:  # two folds at once (a replica's barrier, a closure's report) would count twice
        count = len(TRACING)
        if count:
            folded = TRACING[:count]
            del TRACING[:count]  # what another thread appends meanwhile stays for the next fold
            METRICS["LazyTracing"].extend(folded)


def settle() -> None:
    """Record what finished meanwhile (the execution times of programs in flight)."""
    for record_finished in BEFORE_READ:
        record_finished()


def metrics() -> dict[str, Samples]:
    """Every metric, LazyTracing's latest samples included (and the execution times of programs
    that finished)."""
    settle()
    fold_tracing()
    return METRICS


def clear_metrics() -> None:
    settle()  # what ran before the clear records before it, not after
    with _LOCK:
        METRICS.clear()
        TRACING.clear()
        SITES.clear()


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


def storage_counters() -> dict[str, int]:
    """CreateXlaTensor (storages made) and DestroyXlaTensor (storages freed, whenever made) since
    the counters were cleared."""
    made, freed = STORAGES
    return {
        "CreateXlaTensor": made - _STORAGES_AT_CLEAR[0],
        "DestroyXlaTensor": freed - _STORAGES_AT_CLEAR[1],
    }


def clear_storage_counters() -> None:
    """CreateXlaTensor and DestroyXlaTensor start again from zero."""
    _STORAGES_AT_CLEAR[:] = STORAGES


def op_counters() -> dict[str, int]:
    """``xla::<op>`` -> calls recorded since the counters were cleared (overloads summed)."""
    counts: dict[str, int] = defaultdict(int)
    for op, calls in list(OPS.items()):
        counts[OP_NAMES[op]] += calls
    return counts


def clear() -> None:
    settle()
    with _LOCK:
        COUNTERS.clear()
        METRICS.clear()
        TRACING.clear()
        OPS.clear()
        SITES.clear()
    clear_storage_counters()
