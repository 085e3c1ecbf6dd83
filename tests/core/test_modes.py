"""The engine's modes: one device, the SPMD mesh and launch replicas run the same step through one
run path (the same metrics, step closures and metrics-file lines); world size has one meaning; a
world of one has collectives too; every switch of the engine is reset and caught by the leak
guard; a program's identity is computed once and shared."""

from __future__ import annotations

import re
import threading

import numpy as np
import pytest
import torch

import spmd_torch
import spmd_torch.core.xla_model as xm
import spmd_torch.debug.metrics as met
import spmd_torch.debug.profiler as xp
import spmd_torch.distributed.spmd as xs
import spmd_torch.experimental as exp
import spmd_torch.runtime as xr
from spmd_torch import config
from spmd_torch._lazy import counters, engine, execute
from spmd_torch._lazy.graph import linearize
from spmd_torch.debug import graph
from spmd_torch.distributed import xla_multiprocessing as xmp
from tests.conftest import engine_leaks
from tests.helpers import assert_close

dev = spmd_torch.device()
STEPS = 3


def _train(closures: list) -> list[float]:
    """A small training step, three times, as any mode runs it; each step queues a closure."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    model.to(dev)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = torch.ones(16, 4).to(dev), torch.zeros(16, 2).to(dev)
    losses = []
    for step in range(STEPS):
        optimizer.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        optimizer.step()
        xm.add_step_closure(lambda step=step: closures.append(step))
        xm.mark_step()
        losses.append(loss)
    return [loss.item() for loss in losses]


def _recorded(run) -> tuple[dict, dict, list]:
    """(counter values, metric sample counts, closures run) of ``run`` in steady state: once to
    warm the compile and meta-kernel caches, then from a clean slate."""
    run([])
    met.clear_all()
    closures: list = []
    run(closures)
    names = {name: met.metric_data(name)[0] for name in met.metric_names()}
    return {name: met.counter_value(name) for name in met.counter_names()}, names, closures


def _in_launch(nprocs: int):
    def run(closures: list) -> None:
        seen: dict = {}

        def replica(index: int) -> None:
            mine: list = []
            _train(mine)
            seen[index] = mine

        xmp.spawn(replica, nprocs=nprocs)
        closures.extend(seen[0])
        assert all(seen[k] == seen[0] for k in seen)  # each replica ran its own closures

    return run


def _in_spmd(closures: list) -> None:
    xr.use_spmd()
    try:
        _train(closures)
    finally:
        xr.reset()


_EXECUTE = {"ExecuteTime", "ExecuteReplicatedTime"}


def test_one_device_and_one_replica_record_the_same_metrics():
    device = _recorded(_train)
    replica = _recorded(_in_launch(1))
    assert device == replica
    counters_seen, metrics_seen, closures = device
    assert closures == list(range(STEPS))
    assert counters_seen["MarkStep"] == STEPS
    programs = metrics_seen["ExecuteTime"]
    assert metrics_seen["TensorsGraphSize"] == programs  # one sample per program run
    assert counters_seen["CachedCompile"] == programs and "UncachedCompile" not in counters_seen
    for phase in ("LinearizeTime", "ProgramKeyTime", "GatherTime", "CacheLookupTime", "BindTime"):
        assert metrics_seen[phase] >= STEPS


def test_spmd_and_eight_replicas_record_the_same_metrics_as_one_device():
    device_counters, device_metrics, device_closures = _recorded(_train)
    for run, replicas in ((_in_spmd, 1), (_in_launch(8), 8)):
        got_counters, got_metrics, closures = _recorded(run)
        assert closures == device_closures == list(range(STEPS))
        # Each replica stands for a process: it marks its own steps and moves its own data; the
        # replicas' steps run as one program, compiled (here: found in the cache) once. Each
        # traces its own ops (xla::<op>).
        per_replica = ("MarkStep", "TransferToDevice", "TransferFromDevice", "xla::")
        per_replica += ("aten::_local_scalar_dense",)  # each reads its own loss (.item())
        per_replica += ("CreateXlaTensor", "DestroyXlaTensor")  # each traces its own tensors
        runs = got_counters.pop("ExecuteReplicated")  # PyTorch/XLA's name over several devices
        assert runs == device_counters["ExecuteComputation"]
        # SPMD mode holds uploads on the host (PyTorch/XLA's virtual device) until placed.
        assert (got_counters.pop("VirtualDeviceUsage", 0) > 0) == (run is _in_spmd)
        assert got_counters == {
            name: value * (replicas if name.startswith(per_replica) else 1)
            for name, value in device_counters.items()
            if name != "ExecuteComputation"
        }
        # Over several devices a program run is PyTorch/XLA's replicated execution.
        assert set(got_metrics) - _EXECUTE == set(device_metrics) - _EXECUTE
        assert "ExecuteReplicatedTime" in got_metrics and "ExecuteTime" not in got_metrics
        programs = got_metrics["ExecuteReplicatedTime"]
        assert programs == device_metrics["ExecuteTime"] == got_metrics["TensorsGraphSize"]


def test_metrics_file_gets_the_same_lines_in_every_mode(tmp_path, monkeypatch):
    def lines(run) -> list[str]:
        path = tmp_path / f"{len(list(tmp_path.iterdir()))}.txt"
        monkeypatch.setattr(config.METRICS_FILE, "value", str(path))
        met.clear_all()
        run([])
        text = path.read_text().splitlines()
        return [line for line in text if line.startswith(("Metric:", "Counter:"))]

    lines(_train), lines(_in_launch(1))  # warm
    device = lines(_train)
    assert lines(_in_launch(1)) == device  # one report per step, from the first replica
    assert len([line for line in device if line == "Counter: MarkStep"]) == STEPS


# --- world size: one meaning -----------------------------------------------------------------


def test_world_size_is_the_program_count_everywhere():
    assert xr.world_size() == xm.xrt_world_size() == xr.process_count() == 1
    assert xr.global_ordinal() == xr.local_ordinal() == 0
    seen = {}

    def replica(index: int) -> None:
        seen[index] = (xr.world_size(), xm.xrt_world_size(), xr.global_ordinal(), xm.get_ordinal())

    spmd_torch.launch(replica)
    assert seen == {k: (8, 8, k, k) for k in range(8)}


def test_collectives_in_a_world_of_one_are_graph_nodes_with_one_replica_values():
    met.clear_all()  # fallbacks of tests run before it in this process are not its own
    x = torch.arange(6.0).reshape(2, 3)
    xd = x.to(dev)
    reduced = xm.all_reduce(xm.REDUCE_SUM, xd, scale=0.5)
    gathered = xm.all_gather(xd, dim=1)
    scattered = xm.reduce_scatter(xm.REDUCE_MAX, xd, 2.0, 0, 1)
    swapped = xm.all_to_all(xd, 0, 1, 1)
    kept = xm.collective_permute(xd, [[0, 0]])
    dropped = xm.collective_permute(xd, [])
    assert "all_reduce" in graph.pending_text([reduced])
    assert met.executed_fallback_ops() == []
    assert_close(reduced, x * 0.5)
    assert_close(gathered, x)
    assert_close(scattered, x * 2)
    assert_close(swapped, x)
    assert_close(kept, x)
    assert_close(dropped, torch.zeros(2, 3))
    assert xm.rendezvous("alone", b"me") == [b"me"]


def test_always_allreduce_emits_a_world_of_ones_collectives_with_the_same_values(monkeypatch):
    x = torch.arange(6.0).reshape(2, 3)
    xd = x.to(dev)
    pattern = r"%(all-reduce|all-gather|reduce-scatter|collective-permute)\.\d+ = "

    def step():
        return [
            xm.all_reduce(xm.REDUCE_SUM, xd, scale=0.5),
            xm.all_gather(xd, dim=1),
            xm.reduce_scatter(xm.REDUCE_SUM, xd, 2.0, 0, 1),
            xm.collective_permute(xd, [[0, 0]]),
        ]

    left_out = step()
    assert re.findall(pattern, graph.get_tensors_hlo(left_out)) == []
    monkeypatch.setenv("XLA_ALWAYS_ALLREDUCE", "1")  # read at each collective, as PyTorch/XLA does
    emitted = step()
    hlo = graph.get_tensors_hlo(emitted)
    assert sorted(re.findall(pattern, hlo)) == [
        "all-gather",
        "all-reduce",
        "collective-permute",
        "reduce-scatter",
    ]
    assert "replica_groups={{0}}" in hlo
    for a, b, expected in zip(left_out, emitted, [x * 0.5, x, x * 2, x]):
        assert_close(a, expected)
        assert_close(b, expected)


def test_world_of_one_checks_collective_arguments():
    xd = torch.ones(2, 3).to(dev)
    with pytest.raises(ValueError, match="shard_count=2 must equal the group size 1"):
        xm.reduce_scatter(xm.REDUCE_SUM, xd, 1.0, 0, 2)
    with pytest.raises(ValueError, match=r"groups \[\[0, 1\]\] must name each of the 1 replicas"):
        xm.all_reduce(xm.REDUCE_SUM, xd, groups=[[0, 1]])
    spmd_torch.sync()


# --- every switch of the engine: reset, and caught by the leak guard ---------------------------


def _open_trace() -> None:
    xp.Trace("left_open").__enter__()


_LEFT_OPEN: list = []  # a generator-based context manager closes (exits) when collected


def _open_region() -> None:
    _LEFT_OPEN.append(execute.one_graph("left_open"))
    _LEFT_OPEN[-1].__enter__()


SWITCHED_ON = {
    "mode": xr.use_spmd,
    "scope": _open_trace,
    "one_graph": _open_region,
    "eager": lambda: exp.eager_mode(True),
    "marked_step": lambda: xp.set_tracer_marked_step(True),
    "global_mesh": lambda: xs.set_global_mesh(xs.get_1d_mesh("data")),
    "step_closures": lambda: xm.add_step_closure(lambda: None),
}


def test_every_switch_has_a_case():
    assert set(SWITCHED_ON) == set(engine.SWITCHES)


@pytest.mark.parametrize("switch", sorted(SWITCHED_ON))
def test_leak_guard_catches_a_switch_left_on_and_reset_clears_it(switch):
    assert engine_leaks() == []
    SWITCHED_ON[switch]()
    leaks = engine_leaks()
    assert len(leaks) == 1 and leaks[0].startswith(f"{switch} is "), leaks
    xr.reset()
    assert engine_leaks() == []
    assert engine.current().leftovers() == []


def test_replicas_have_switches_of_their_own():
    seen = {}

    def replica(index: int) -> None:
        if index == 0:
            exp.eager_mode(True)
            xp.set_tracer_marked_step(True)
        seen[index] = (exp.is_eager_mode(), xp.get_tracer_marked_step())
        xm.rendezvous("switched")
        seen[index] += (exp.is_eager_mode(),)

    spmd_torch.launch(replica)
    assert seen[0] == (True, True, True)
    assert all(seen[k] == (False, False, False) for k in range(1, 8))
    assert not exp.is_eager_mode() and not xp.get_tracer_marked_step()


# --- one barrier ------------------------------------------------------------------------------


def test_every_door_is_the_same_barrier():
    ran = []
    for door in (spmd_torch.sync, xm.mark_step, lambda: exp.eager_mode(True)):
        steps = met.counter_value("MarkStep") or 0
        y = torch.ones(2).to(dev) * 2
        xm.add_step_closure(lambda: ran.append(door))
        door()
        assert graph.pending_count() == 0
        assert met.counter_value("MarkStep") == steps + 1
        assert ran[-1] is door
        assert_close(y, torch.full((2,), 2.0))
    exp.eager_mode(False)


# --- program identity, metrics store -----------------------------------------------------------


def _program(scale: float):
    x = torch.ones(3).to(dev)
    return linearize([((x * scale + 1).sum()._ref())])


def test_programs_of_one_structure_share_one_identity():
    first, second = _program(2.0), _program(3.0)  # scalars are inputs: the same structure
    assert first is not second and first.identity == second.identity
    assert _program(2.0).identity != linearize([(torch.ones(3).to(dev).sum()._ref())]).identity
    spmd_torch.sync()


def test_identity_walks_the_structure_once_per_program(monkeypatch):
    program = _program(2.0)
    walks = []
    structure = type(program).structure
    monkeypatch.setattr(type(program), "structure", lambda self: walks.append(1) or structure(self))
    identity = program.identity
    assert program.identity == identity and walks == [1]
    spmd_torch.sync()


def test_metrics_store_counts_every_sample_from_many_threads():
    counters.METRICS.pop("ProbeThreads", None)

    def record() -> None:
        for _ in range(20_000):
            counters.record("ProbeThreads", 1)

    threads = [threading.Thread(target=record) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    samples = counters.METRICS.pop("ProbeThreads")
    assert samples.count == samples.total == 80_000
    assert np.sum(list(samples)) == 1024  # the window keeps the latest 1024
