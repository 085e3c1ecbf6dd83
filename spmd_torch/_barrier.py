"""The barrier that ends a training step, one for every door: ``spmd_torch.sync()``,
``xm.mark_step()``, the data loaders, ``StepTrace``, compile regions, checkpoints.

It counts the step (``MarkStep``), appends the graph to ``XLA_SAVE_TENSORS_FILE`` when set (and
the outputs' shardings once they run), runs everything pending as one program (the engine's
``execute.sync``), appends the metrics report to ``XLA_METRICS_FILE`` when set, and runs the
step closures queued by ``xm.add_step_closure``. A read of values (``.item()``) or eager mode's
per-op run computes what it needs without ending a step.
"""

from __future__ import annotations

import atexit
import re
import threading
from collections.abc import Callable
from concurrent import futures
from typing import Any

from spmd_torch import config
from spmd_torch._lazy import compile as compiler
from spmd_torch._lazy import counters, engine, execute
from spmd_torch.debug import graph, metrics, metrics_saver

# Called at each barrier before its program runs, on the barrier's thread: automatic capture's
# look at the step (core/auto_capture.py) while it is on. Empty otherwise.
BEFORE_RUN: list[Callable[[], None]] = []


def barrier(wait: bool = False, reset_scope: bool = True) -> None:
    """End the step: compile (once) and dispatch every pending computation, then the step's
    side effects, in every mode alike."""
    own = engine.current()
    if reset_scope:
        _reset_regions(own)
    counters.bump("MarkStep")
    for watcher in BEFORE_RUN:
        watcher()
    outputs = []
    if config.SAVE_TENSORS_FILE.value:  # one file per process or replica, as PyTorch/XLA's
        path = f"{config.SAVE_TENSORS_FILE.value}.{own.mode.ordinal}"
        outputs = graph.save_pending(path, str(config.SAVE_TENSORS_FMT.value).lower())
    execute.sync(wait=wait)
    if outputs:
        graph.save_output_shardings(path, outputs)
    own.steps += 1
    if own.mode.local_ordinal == 0 and config.METRICS_FILE.value:  # one report per host
        metrics_saver.save_metrics()
    if own.mode.local_ordinal == 0 and config.DEBUG_TOOL.value:
        _analyze_metrics(at_exit=False)
    run_step_closures()


def _reset_regions(own: engine.Engine) -> None:
    """PyTorch/XLA's scope reset: profiler regions are numbered afresh after each barrier. Under
    the ``torch_xla`` face a ``Trace`` region still open at the barrier is an error, as there
    (``reset_scope=False`` keeps it open); spmd_torch's own barrier may run inside one."""
    if not own.regions:
        own.next_region = 1
    elif config.FACE.on:
        raise RuntimeError(f"Expecting scope to be empty but it is {own.regions[0][0]}")


_ANALYZED = [""]  # the symptoms of the analysis last written, its numbers left out


def _analyze_metrics(at_exit: bool) -> None:
    """PyTorch/XLA's metrics analysis (``PT_XLA_DEBUG``): written when a symptom appears (not at
    every step its counts grow), and in full at exit (also for ``PT_XLA_DEBUG_LEVEL`` alone)."""
    report = metrics.performance_report()
    symptoms = re.sub(r"\d+", "", report)
    if report and (at_exit or symptoms != _ANALYZED[0]):
        _ANALYZED[0] = symptoms
        compiler.write_debug(report)


def _analyze_at_exit() -> None:
    if config.DEBUG_LEVEL.value or config.DEBUG_TOOL.value:
        _analyze_metrics(at_exit=True)


atexit.register(_analyze_at_exit)


def add_step_closure(closure: Callable[[], Any], run_async: bool) -> None:
    """Queue ``closure`` on the calling engine, for the end of its step."""
    engine.current().step_closures.append((closure, run_async))


def run_step_closures() -> None:
    """Run the calling engine's queued closures: synchronous ones here, in order (one that
    raises drops the rest), asynchronous ones handed to the background thread first."""
    own = engine.current()
    closures, own.step_closures = own.step_closures, []
    asynchronous = [closure for closure, run_async in closures if run_async]
    if asynchronous:
        _async_runner().submit(asynchronous)
    for closure, run_async in closures:
        if not run_async:
            closure()


class _AsyncClosureRunner:
    """Runs asynchronous step closures one at a time, in order, on one background thread; a
    closure's error stops the ones queued after it and is raised at the next step."""

    def __init__(self) -> None:
        self._executor = futures.ThreadPoolExecutor(1, thread_name_prefix="xm-step-closure")
        self._lock = threading.Lock()
        self._error: BaseException | None = None

    def submit(self, closures: list[Callable[[], Any]]) -> None:
        with self._lock:
            error, self._error = self._error, None
        if error is not None:
            raise RuntimeError(
                "Cannot run asynchronous step closures: an earlier one raised "
                f"{type(error).__name__}: {error}"
            ) from error
        for closure in closures:
            self._executor.submit(self._run, closure)

    def _run(self, closure: Callable[[], Any]) -> None:
        with self._lock:
            if self._error is not None:
                return
        try:
            closure()
        except Exception as error:  # kept for the next step, as PyTorch/XLA does
            with self._lock:
                self._error = error


_RUNNER: list[_AsyncClosureRunner] = []  # made on first use: most programs never need its thread


def _async_runner() -> _AsyncClosureRunner:
    if not _RUNNER:
        _RUNNER.append(_AsyncClosureRunner())
    return _RUNNER[0]
