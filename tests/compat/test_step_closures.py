"""xm.add_step_closure: closures run after the step's barrier, once, in order, reading the step's
values with no second program; asynchronous ones run on a thread and report errors next step."""

from __future__ import annotations

import threading

import pytest
import torch

import spmd_torch
import spmd_torch.core.xla_model as xm
from spmd_torch._lazy import counters

DEV = xm.xla_device()


def programs_run() -> int:
    """Every program run looks its executable up once: a hit or a compile."""
    return counters.COUNTERS.get("CachedCompile", 0) + counters.COUNTERS.get("UncachedCompile", 0)


def test_closures_run_after_the_barrier_in_order_with_the_steps_values():
    seen = []
    for step in range(3):
        x = torch.full((2,), float(step), device=DEV) * 2 + 1
        xm.add_step_closure(lambda t, s=step: seen.append(("a", s, t.tolist())), args=(x,))
        xm.add_step_closure(lambda s=step: seen.append(("b", s)))
        assert len(seen) == 2 * step  # nothing runs before the barrier
        xm.mark_step()
    assert seen == [
        ("a", 0, [1.0, 1.0]),
        ("b", 0),
        ("a", 1, [3.0, 3.0]),
        ("b", 1),
        ("a", 2, [5.0, 5.0]),
        ("b", 2),
    ]


def test_closures_read_values_without_a_second_program():
    w = torch.arange(4.0, device=DEV)
    xm.mark_step()
    loss = (w * w).sum()
    values = []
    xm.add_step_closure(lambda t: values.append(t.item()), args=(loss,))
    before = programs_run()
    xm.mark_step()
    assert values == [14.0]
    assert programs_run() - before == 1  # the step's program; the closure's read ran none


def test_closures_run_once():
    calls = []
    xm.add_step_closure(lambda: calls.append(1))
    xm.mark_step()
    xm.mark_step()
    assert calls == [1]


def test_spmd_torch_sync_runs_the_closures():
    calls = []
    xm.add_step_closure(lambda: calls.append("ran"))
    spmd_torch.sync()
    assert calls == ["ran"]


def test_async_closures_run_in_order_on_another_thread():
    done = threading.Event()
    seen = []
    x = torch.ones(3, device=DEV) * 7
    for k in range(3):
        xm.add_step_closure(
            lambda t, k=k: seen.append((k, t.sum().item(), threading.current_thread().name)),
            args=(x,),
            run_async=True,
        )
    xm.add_step_closure(done.set, run_async=True)
    xm.mark_step()
    assert done.wait(30)
    assert [(k, total) for k, total, _ in seen] == [(0, 21.0), (1, 21.0), (2, 21.0)]
    assert all(name != threading.current_thread().name for _, _, name in seen)


def test_an_async_closure_error_is_raised_at_the_next_step():
    finished = threading.Event()

    def fail():
        try:
            raise ValueError("closure failed")
        finally:
            finished.set()

    xm.add_step_closure(fail, run_async=True)
    xm.mark_step()
    assert finished.wait(30)
    xm.add_step_closure(lambda: None, run_async=True)
    with pytest.raises(RuntimeError, match="ValueError: closure failed") as info:
        xm.mark_step()
    assert isinstance(info.value.__cause__, ValueError)
    later = threading.Event()  # the error was reported once: later closures run again
    xm.add_step_closure(later.set, run_async=True)
    xm.mark_step()
    assert later.wait(30)


def test_each_replica_runs_its_own_closures_at_its_barrier():
    def body(index):
        seen = []
        x = torch.tensor([float(index)], device=xm.xla_device())
        total = xm.all_reduce(xm.REDUCE_SUM, x)
        xm.add_step_closure(lambda t: seen.append((index, t.item())), args=(total,))
        xm.mark_step()
        return seen

    results = spmd_torch.launch(body)
    assert results == {k: [(k, 28.0)] for k in range(8)}
