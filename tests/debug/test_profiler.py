"""spmd_torch.debug.profiler: captures written by JAX's profiler (from a server, asked by xprof's
client), read back (the xplane protobuf through jax.profiler.ProfileData, the trace-event JSON with
gzip + json), and the engine's side of Trace (named ops, compile cache) and StepTrace (barriers)."""

from __future__ import annotations

import gc
import gzip
import importlib
import json
import pathlib
import socket
import sys
import threading

import jax
import pytest
import torch

import spmd_torch
import spmd_torch.debug.profiler as xp
from spmd_torch._lazy import compile as compiler
from spmd_torch._lazy import counters, engine, modes
from spmd_torch._lazy.engine import current
from spmd_torch.debug import graph
from spmd_torch.distributed import parallel_loader as pl
from tests.helpers import assert_close, assert_compiles, assert_counter_delta, tolerance

STEP = "train_step"


def _model() -> tuple[torch.nn.Module, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    return model, torch.randn(32, 8), torch.randint(0, 4, (32,))


def _train(model, optimizer, x, y, steps: int) -> None:
    """``steps`` SGD steps, each a StepTrace with 'fwd' and 'bwd' regions. No loader takes the
    marked step (as PyTorch/XLA's, it stays marked until one does): it is cleared at the end."""
    for step in range(steps):
        with xp.StepTrace(STEP, step_num=step):
            with xp.Trace("fwd"):
                loss = torch.nn.functional.cross_entropy(model(x), y)
            with xp.Trace("bwd"):
                loss.backward()
            optimizer.step()
            optimizer.zero_grad()
    xp.set_tracer_marked_step(False)


@pytest.fixture(autouse=True)
def _fresh_compile_cache():
    """Every program a test runs is compiled by it, so the last compiled is the last run."""
    compiler.clear_cache()


def _last_program():
    """The executable of the last program compiled (its key and its optimized HLO text)."""
    cache = current().cache
    return cache.executables[cache.history[-1]]


def _xplane(logdir: pathlib.Path, host: str = "*") -> pathlib.Path:
    [path] = logdir.glob(f"plugins/profile/*/{host}.xplane.pb")
    return path


def _xplane_events(path: pathlib.Path) -> list[tuple[str, float, float, dict]]:
    """(name, start_ns, end_ns, stats) of every event of the capture."""
    profile = jax.profiler.ProfileData.from_file(str(path))
    return [
        (event.name, event.start_ns, event.start_ns + event.duration_ns, dict(event.stats))
        for plane in profile.planes
        for line in plane.lines
        for event in line.events
    ]


def _json_events(path: pathlib.Path) -> list[dict]:
    with gzip.open(path, "rt") as f:
        return [e for e in json.load(f)["traceEvents"] if e.get("ph") == "X"]


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@pytest.fixture
def server():
    """A profiler server on a free port, stopped after the test."""
    server = xp.start_server(_free_port())
    yield server
    server.stop()


@pytest.fixture
def busy():
    """Something to capture while the test runs, a jitted program inside a host region (a window
    where nothing ran is an empty trace); yields the region's name."""
    name = "busy_region"
    done = threading.Event()
    work = jax.jit(lambda a: a @ a)
    work(jax.numpy.ones((32, 32))).block_until_ready()  # compiled before: a window is all runs

    def run() -> None:
        while not done.is_set():
            with jax.profiler.TraceAnnotation(name):
                work(jax.numpy.ones((32, 32))).block_until_ready()

    worker = threading.Thread(target=run)
    worker.start()
    yield name
    done.set()
    worker.join()


# ---- a capture of a training run --------------------------------------------------------------


def test_capture_of_three_steps_holds_regions_steps_and_program(tmp_path):
    model, x, y = _model()
    dev = spmd_torch.device()
    model.to(dev)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = x.to(dev), y.to(dev)
    xp.start_trace(tmp_path)
    _train(model, optimizer, x, y, steps=3)
    xp.stop_trace()
    module = f"jit_SyncTensorsGraph_{_last_program().key}"

    events = _xplane_events(_xplane(tmp_path))
    steps = sorted((e for e in events if e[0] == STEP), key=lambda e: e[1])
    assert [e[3]["step_num"] for e in steps] == [0, 1, 2]
    for region in ("fwd", "bwd"):
        spans = [e for e in events if e[0] == region]
        assert len(spans) == 3, f"{region}: {len(spans)} regions"
        for step, span in zip(steps, sorted(spans, key=lambda e: e[1])):  # inside its step
            assert step[1] <= span[1] and span[2] <= step[2]
    runs = {e[3]["run_id"] for e in events if e[3].get("hlo_module") == module}
    assert len(runs) == 3, f"{module} ran {len(runs)} times in the capture"

    [trace_json] = tmp_path.glob("plugins/profile/*/*.trace.json.gz")
    json_events = _json_events(trace_json)
    step_nums = sorted(e["args"]["step_num"] for e in json_events if e["name"] == STEP)
    assert step_nums == ["0", "1", "2"]
    assert any(e.get("args", {}).get("hlo_module") == module for e in json_events)


def test_traced_steps_train_as_eager_cpu(tmp_path):
    cpu_model, x, y = _model()
    initial = [p.detach().clone() for p in cpu_model.parameters()]
    _train(cpu_model, torch.optim.SGD(cpu_model.parameters(), lr=0.1), x, y, steps=3)
    model, _, _ = _model()
    dev = spmd_torch.device()
    model.to(dev)
    xp.start_trace(tmp_path)
    _train(model, torch.optim.SGD(model.parameters(), lr=0.1), x.to(dev), y.to(dev), steps=3)
    xp.stop_trace()
    assert all(not torch.equal(p, q) for p, q in zip(initial, cpu_model.parameters()))
    expected = list(cpu_model.parameters())
    assert_close(list(model.parameters()), expected, **tolerance(torch.float32, "fwd", "training"))


# ---- Trace: named ops, the compile cache ------------------------------------------------------


def _attention_step(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    with xp.Trace("attn"):
        scores = torch.softmax(q @ k.t(), dim=-1)
    return scores.sum(dim=0) + 1.0


def test_ops_inside_trace_carry_its_name_in_the_program():
    dev = spmd_torch.device()
    q, k = torch.randn(4, 8), torch.randn(6, 8)
    out = _attention_step(q.to(dev), k.to(dev))
    spmd_torch.sync()
    program = _last_program()
    hlo = program.compiled.as_text()
    prefix = f"jit(SyncTensorsGraph_{program.key})"
    assert f'op_name="{prefix}/attn/aten.linear.default/dot_general"' in hlo  # q @ k.t()
    assert f'op_name="{prefix}/attn/aten._softmax.default/' in hlo
    assert f'op_name="{prefix}/aten.add.Tensor/add"' in hlo  # outside the region: no name
    assert_close(out, _attention_step(q, k))


def test_same_step_under_same_trace_hits_the_compile_cache():
    dev = spmd_torch.device()
    q, k = torch.randn(4, 8).to(dev), torch.randn(6, 8).to(dev)
    first = _attention_step(q, k)
    spmd_torch.sync()
    with assert_compiles(0), assert_counter_delta("CachedCompile", 1):
        second = _attention_step(q, k)
        spmd_torch.sync()
    assert_close(second, first)


def test_same_ops_under_another_trace_name_compile_another_program():
    dev = spmd_torch.device()
    q, k = torch.randn(4, 8).to(dev), torch.randn(6, 8).to(dev)
    first = _attention_step(q, k)
    spmd_torch.sync()
    with assert_compiles(1):
        with xp.Trace("other"):
            second = _attention_step(q, k)
        spmd_torch.sync()
    assert_close(second, first)
    assert "/other/attn/aten.linear.default/" in _last_program().compiled.as_text()


def test_nested_traces_and_trace_me_join_names_outermost_first():
    dev = spmd_torch.device()

    @xp.trace_me("loss")
    def loss_of(t: torch.Tensor) -> torch.Tensor:
        return (t * t).mean()

    with xp.Trace("layer"):
        out = loss_of(torch.randn(3, 3, device=dev))
    assert loss_of.__name__ == "loss_of"
    spmd_torch.sync()
    assert "/layer/loss/aten.mul.Tensor/mul" in _last_program().compiled.as_text()
    assert out.shape == ()


def test_trace_name_ends_with_its_block_even_on_error():
    dev = spmd_torch.device()
    with pytest.raises(ZeroDivisionError):
        with xp.Trace("broken"):
            inside = torch.ones(2).to(dev) * 3
            raise ZeroDivisionError
    after = inside.sum()
    spmd_torch.sync()
    program = _last_program()
    hlo = program.compiled.as_text()
    assert "/broken/aten.mul.Tensor/mul" in hlo
    assert f'op_name="jit(SyncTensorsGraph_{program.key})/aten.sum.default/reduce_sum"' in hlo
    assert after.item() == 6.0


def test_trace_names_belong_to_the_engine():
    seen = []  # the scope a node recorded now would carry, on each engine

    def other_engine():
        with engine.running(engine.Engine(modes.PerDevice())):
            seen.append(engine.current().scope)

    with xp.Trace("main_only"):
        worker = threading.Thread(target=other_engine)
        worker.start()
        worker.join()
        seen.append(engine.current().scope)
    assert seen == [None, "main_only"]
    assert engine.current().scope is None


def test_trace_name_must_be_a_non_empty_string():
    with pytest.raises(TypeError, match=r"Trace: name must be a non-empty str, got 3"):
        xp.Trace(3)
    with pytest.raises(TypeError, match=r"got ''"):
        xp.StepTrace("")


# ---- StepTrace and the loader's barrier -------------------------------------------------------


def test_step_trace_syncs_at_exit():
    dev = spmd_torch.device()
    x = torch.arange(6.0).reshape(2, 3)
    with assert_counter_delta("MarkStep", 1):
        with xp.StepTrace(STEP, step_num=0):
            y = x.to(dev) * 2 + 1
            assert graph.pending_count() == 1
        assert graph.pending_count() == 0
    assert_close(y, x * 2 + 1)
    xp.set_tracer_marked_step(False)


def test_mp_device_loader_inside_step_trace_runs_one_barrier_per_step():
    """Per step, StepTrace's barrier and no other: MarkStep counts the loader's first (empty)
    barrier, one per step and the loader's last; without the skip the loader would add its own
    after each step (2n + 2)."""
    n = 3
    batches = [(torch.full((4, 2), float(i)),) for i in range(n)]
    dev = spmd_torch.device()
    weight = torch.ones(2).to(dev)  # data, so the loader's first barrier has nothing to run
    executions = len(counters.METRICS["TensorsGraphSize"])
    totals = []
    with assert_counter_delta("MarkStep", n + 2):
        for step, (x,) in enumerate(pl.MpDeviceLoader(batches, dev)):
            with xp.StepTrace(STEP, step_num=step):
                weight.add_(x.sum(0))
                totals.append(weight.sum())
    assert len(counters.METRICS["TensorsGraphSize"]) - executions == n
    cpu_weight = torch.ones(2)
    expected = [cpu_weight.add_(x.sum(0)).sum().item() for (x,) in batches]
    assert [t.item() for t in totals] == expected
    assert not xp.get_tracer_marked_step()


def test_mp_device_loader_without_step_trace_keeps_its_barriers():
    n = 3
    dev = spmd_torch.device()
    with assert_counter_delta("MarkStep", n + 2):  # before each batch, and once at the end
        for (x,) in pl.MpDeviceLoader([(torch.ones(2),)] * n, dev):
            (x * 2).sum()


def test_tracer_marked_step_belongs_to_the_engine():
    xp.set_tracer_marked_step(True)
    seen = []

    def other_engine():
        with engine.running(engine.Engine(modes.PerDevice())):
            seen.append(xp.get_tracer_marked_step())

    worker = threading.Thread(target=other_engine)
    worker.start()
    worker.join()
    assert seen == [False] and xp.get_tracer_marked_step()
    xp.set_tracer_marked_step(False)


# ---- capturing from a server ------------------------------------------------------------------


def test_trace_from_a_thread_captures_the_running_steps(tmp_path, server):
    model, x, y = _model()
    dev = spmd_torch.device()
    model.to(dev)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = x.to(dev), y.to(dev)
    _train(model, optimizer, x, y, steps=1)  # compiled before the capture
    capture = xp.trace_detached(f"localhost:{server.port}", tmp_path, duration_ms=1500)
    steps = 0
    while capture.is_alive() and steps < 2000:
        _train(model, optimizer, x, y, steps=1)
        capture.join(0.01)
        steps += 1
    capture.join()
    module = f"jit_SyncTensorsGraph_{_last_program().key}"
    xplane = _xplane(tmp_path, f"localhost_{server.port}")
    events = _xplane_events(xplane)
    assert any(e[0] == STEP for e in events)
    assert any(e[0] == "fwd" for e in events)
    assert any(e[3].get("hlo_module") == module for e in events)
    json_events = _json_events(xplane.with_name(f"localhost_{server.port}.trace.json.gz"))
    assert any(e["name"] == STEP for e in json_events)


def test_trace_asks_xprof_for_the_capture_with_the_options_given(
    tmp_path, server, busy, monkeypatch
):
    plugin = importlib.import_module("xprof.convert._pywrap_profiler_plugin")
    capture, calls = plugin.trace, []

    def spy(*args):
        calls.append(args)
        return capture(*args)

    monkeypatch.setattr(plugin, "trace", spy)
    monkeypatch.chdir(tmp_path)
    address = f"localhost:{server.port}"
    xp.trace(address, "logs", duration_ms=300, host_tracer_level=3, device_tracer_level=0)
    [(service_addr, logdir, _, _, duration_ms, attempts, options)] = calls
    assert (service_addr, logdir) == (address, str(tmp_path / "logs"))  # made absolute
    assert (duration_ms, attempts) == (300, 1)  # one attempt a call: the waits between are ours
    levels = {"host_tracer_level": 3, "device_tracer_level": 0, "delay_ms": 0}
    assert options.items() >= levels.items()
    xplane = _xplane(tmp_path / "logs", f"localhost_{server.port}")  # the server wrote it
    assert xplane.parent.name == options["session_id"]
    assert busy in {e[0] for e in _xplane_events(xplane)}


def test_trace_of_several_servers_warns_about_the_one_that_captured_nothing(tmp_path, server, busy):
    dead = f"localhost:{_free_port()}"
    live = f"localhost:{server.port}"
    with pytest.warns(UserWarning, match=rf"trace: {dead} captured nothing \(no localhost_\d+"):
        xp.trace(f"{live},{dead}", tmp_path, duration_ms=300, num_tracing_attempts=1)
    assert _xplane(tmp_path).name == f"localhost_{server.port}.xplane.pb"


def test_trace_without_a_server_fails_naming_address_and_status(tmp_path):
    address = f"localhost:{_free_port()}"
    expected = rf"no profile captured from {address}: attempt 1: UNAVAILABLE: No trace event .*"
    expected += r" \| attempt 2: UNAVAILABLE: "
    with pytest.raises(RuntimeError, match=expected):
        xp.trace(address, tmp_path, duration_ms=100, num_tracing_attempts=2, interval_s=0)
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize(
    "arguments, message",
    [
        ({"service_addr": "localhost"}, r"service_addr must be 'host:port'"),
        ({"service_addr": 9012}, r"service_addr must be a 'host:port' string, got 9012"),
        ({"duration_ms": 0}, r"duration_ms must be an int >= 1, got 0"),
        ({"num_tracing_attempts": 0}, r"num_tracing_attempts must be an int >= 1"),
        ({"delay_ms": -1}, r"delay_ms must be an int >= 0, got -1"),
    ],
)
def test_trace_rejects_bad_arguments(tmp_path, arguments, message):
    call = {"service_addr": "localhost:9012", "logdir": tmp_path, **arguments}
    with pytest.raises(RuntimeError, match=message):
        xp.trace(**call)


def test_trace_without_xprof_names_the_extra(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "xprof.convert._pywrap_profiler_plugin", None)
    with pytest.raises(
        RuntimeError, match=r"needs the xprof package \(pip install 'spmd_torch\[profile\]'\)"
    ):
        xp.trace("localhost:9012", tmp_path)


def test_start_server_on_a_busy_port_raises():
    with socket.socket(socket.AF_INET6 if socket.has_ipv6 else socket.AF_INET) as taken:
        taken.bind(("::" if socket.has_ipv6 else "0.0.0.0", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(RuntimeError, match=rf"port {port} is already in use"):
            xp.start_server(port)


@pytest.mark.parametrize("port", [0, 70000, "9012", True])
def test_start_server_rejects_an_invalid_port(port):
    with pytest.raises(RuntimeError, match=r"port must be an int in 1..65535"):
        xp.start_server(port)


def test_one_server_per_process(server):
    with pytest.raises(RuntimeError, match=r"already running in this process"):
        xp.start_server(_free_port(), only_on_master=False)


def test_dropping_the_server_object_stops_the_server():
    xp.start_server(_free_port())  # dropped at once
    gc.collect()
    replacement = xp.start_server(_free_port())
    replacement.stop()
    replacement.stop()  # a second stop does nothing


# ---- in-process capture errors ----------------------------------------------------------------


def test_stop_trace_without_a_capture_raises():
    with pytest.raises(RuntimeError, match="No profile started"):
        xp.stop_trace()


def test_one_capture_at_a_time(tmp_path):
    xp.start_trace(tmp_path)
    try:
        with pytest.raises(RuntimeError, match="Only one profile may be run at a time"):
            xp.start_trace(tmp_path / "second")
    finally:
        xp.stop_trace()
