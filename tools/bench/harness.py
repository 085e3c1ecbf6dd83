"""What every workload shares: timing loops, the host-time probe, device helpers, child processes.

Timing: warm-up steps first (the first one compiles), then timed steps. Blocked steps (each waited
for) give medians and, read around them, the host-time breakdown; pipelined steps (one wait at the
end of a window) give the throughput a training loop sees.

The breakdown reads only public numbers before and after a probed window and takes the
difference: the time spent in ``step()`` and in the barrier (measured here, around the calls the
benchmark makes), ``CompileTime`` and the barrier's phases (``debug.metrics.barrier_phases()``;
an older checkout without it reports its phases as n/a). Nothing of the engine is patched.

Each (workload, implementation, checkout) runs in its own child process, ``python -m tools.bench
--only W:IMPL --tree PATH``, so compile caches, thread pools and device memory never leak from one
run into the next, and a child imports exactly one checkout's spmd_torch.
"""

from __future__ import annotations

import json
import os
import re
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

RESULT_TAG = "BENCH_RESULT "
ROOT = str(Path(__file__).resolve().parents[2])  # this checkout: holds tools/ and spmd_torch/


def now() -> float:
    return time.perf_counter()


def diff(a: int | None, b: int | None) -> int | None:
    return None if a is None or b is None else a - b


# ------------------------------------------------------------------------------------------------
# Timing loops


@dataclass
class Trainer:
    """What the shared timing loop needs from one implementation of W2, W3, W3amp or W4."""

    step: Callable[[], Any]  # one full training step; returns a handle to the loss
    wait: Callable[[], None]  # blocks until all queued device work is done
    loss_value: Callable[[Any], float]
    compiles: Callable[[], int | None] = lambda: None
    cached_compiles: Callable[[], int | None] = lambda: None
    peak_bytes: Callable[[], int | None] = lambda: None
    # (bytes of one device's shards, bytes of the whole params), read after the timed steps so a
    # sharding lost during training shows; only W4 sets it.
    param_bytes: Callable[[], tuple[int, int] | None] = lambda: None
    # XLA's memory analysis of the steady-state step: bytes one device needs while it runs
    # (arguments + temporaries + outputs not aliased to arguments). Known on CPU too; W4 only.
    program_bytes: Callable[[], int | None] = lambda: None
    # spmd_torch only: host seconds of each step's barrier (time in sync()), one entry per step.
    # Set, run_trainer also probes its blocked steps (read_probe) to split their host time.
    barrier_times: list[float] | None = None
    # The same barriers in the main thread's CPU time (time.thread_time): on a CPU host the wall
    # time also holds the waits for a core that XLA's threads, running the program, hold.
    barrier_cpu_times: list[float] | None = None


def blocked_steps(
    step: Callable[[], Any], wait: Callable[[], None], n: int, losses: list, probe: bool
) -> dict[str, Any]:
    """Runs `n` steps, each waited for, timing the host part (in step()) apart from the device
    wait, so device work (on CPU, on the same cores) stays out of the host time; with `probe`,
    reads the engine's public numbers before and after, for host_breakdown."""
    before = read_probe() if probe else None
    host, host_cpu, waited = [], [], []
    for _ in range(n):
        c0, t0 = time.thread_time(), now()
        losses.append(step())
        t1, c1 = now(), time.thread_time()
        wait()
        host.append(t1 - t0)
        host_cpu.append(c1 - c0)
        waited.append(now() - t1)
    return {
        "host_s": host,
        "host_cpu_s": host_cpu,
        "wait_s": waited,
        "before": before,
        "after": read_probe() if probe else None,
    }


def run_trainer(tr: Trainer, warmup: int, steps: int, check: bool) -> dict[str, Any]:
    """Times steps one by one (each blocked, median), then a pipelined window (one wait at end)."""
    if check:
        losses = []
        for _ in range(steps):
            loss = tr.step()
            tr.wait()
            losses.append(tr.loss_value(loss))
        return {"losses": losses}

    t0 = now()
    losses = [tr.step()]
    tr.wait()
    first_step_s = now() - t0
    compiles_first = tr.compiles()
    for _ in range(warmup - 1):
        losses.append(tr.step())
        tr.wait()
    compiles_warm = tr.compiles()

    spmd = tr.barrier_times is not None
    window = blocked_steps(tr.step, tr.wait, steps, losses, probe=spmd)
    times = [h + w for h, w in zip(window["host_s"], window["wait_s"])]
    barriers = (tr.barrier_times or [])[warmup : warmup + steps]
    barriers_cpu = (tr.barrier_cpu_times or [])[warmup : warmup + steps]

    t0 = now()
    for _ in range(steps):
        losses.append(tr.step())
    tr.wait()
    window_s = now() - t0

    compiles_end = tr.compiles()
    median_s = statistics.median(times)
    per_device, total = tr.param_bytes() or (None, None)
    return {
        "first_step_s": first_step_s,
        "median_step_s": median_s,
        "min_step_s": min(times),
        "max_step_s": max(times),
        "steps_per_s": 1.0 / median_s,
        "pipelined_steps_per_s": steps / window_s,
        "compiles_first_step": compiles_first,
        "compiles_total": compiles_end,
        "compiles_in_timed": diff(compiles_end, compiles_warm),
        "cached_compiles": tr.cached_compiles(),
        "peak_bytes": tr.peak_bytes(),
        "param_bytes_per_device": per_device,
        "param_bytes_total": total,
        "program_bytes_per_device": tr.program_bytes(),
        "barrier_ms": statistics.median(barriers) * 1e3 if barriers else None,
        "barrier_cpu_ms": statistics.median(barriers_cpu) * 1e3 if barriers_cpu else None,
        "host_ms": host_breakdown(window, sum(window["host_s"]) - sum(barriers)) if spmd else None,
        "graph": graph_per_step(window) if spmd else None,
        "loss_first": tr.loss_value(losses[0]),
        "loss_last": tr.loss_value(losses[-1]),
        "warmup": warmup,
        "steps": steps,
    }


def run_windows(
    step: Callable[[], Any],
    wait: Callable[[], None],
    warmup: int,
    windows: int,
    window: int,
    probe: bool,
) -> dict[str, Any]:
    """Warm-up, then `windows` timed windows of `window` pipelined steps (one wait at the end of
    each), then one more window of blocked steps, probed when `probe`. Every replica of a launch
    runs it (they meet at each step's barrier; only replica 0 probes, and its wait holds the
    turn), and replica 0's figures are the world's. Compiles count UncachedCompile. Every step's
    loss comes back too (read once the steps are done), so two layouts' runs can be compared."""
    t0 = now()
    losses = [step()]
    wait()
    first_step_s = now() - t0
    compiles_first = spmd_uncached()
    for _ in range(warmup - 1):
        losses.append(step())
    wait()
    compiles_warm = spmd_uncached()
    rates = []
    for _ in range(windows):
        t0 = now()
        for _ in range(window):
            losses.append(step())
        wait()
        rates.append(window / (now() - t0))
    compiles_timed = spmd_uncached()
    first_probed = warmup + windows * window  # index of the first probed step
    probed = blocked_steps(step, wait, window, losses, probe)
    return {
        "first_step_s": first_step_s,
        "steps_per_s": statistics.median(rates),
        "window_steps_per_s": rates,
        "compiles_first_step": compiles_first,
        "compiles_in_timed": compiles_timed - compiles_warm,
        "compiles_in_probe": spmd_uncached() - compiles_timed,
        "probe_steps": (first_probed, first_probed + window),
        "probe": probed,
        "loss_first": losses[0].item(),
        "loss_last": losses[-1].item(),
        "losses": [loss.item() for loss in losses],
    }


def median_per_op(run: Callable[[], float], warmup: int, reps: int, n_ops: int) -> float:
    """Runs `run` (returns seconds measured) warmup + reps times; median µs per op."""
    for _ in range(warmup):
        run()
    return statistics.median(run() for _ in range(reps)) / n_ops * 1e6


# ------------------------------------------------------------------------------------------------
# The host-time probe: public numbers only, read before and after a window


def read_probe() -> dict[str, Any]:
    """CompileTime's total and the barrier's phases so far ({phase: (samples, ns)}); the programs
    run and their nodes (TensorsGraphSize's samples and sum), the ops traced (LazyTracing's
    samples) and recorded (the sum of the ``xla::<op>`` counters). Each is None where the
    spmd_torch imported (an older checkout) does not keep it."""
    import spmd_torch.debug.metrics as met

    compiled = met.metric_data("CompileTime")
    walked = met.metric_data("LinearizeCpuTime")
    phases = getattr(met, "barrier_phases", None)
    graphs, traced = met.metric_data("TensorsGraphSize"), met.metric_data("LazyTracing")
    return {
        "compile_ns": 0.0 if compiled is None else compiled[1],
        "linearize_cpu_ns": None if walked is None else walked[1],
        "phases": None if phases is None else {k: tuple(v) for k, v in phases().items()},
        "graphs": None if graphs is None else graphs[:2],
        "traced": None if traced is None else traced[0],
        "recorded": recorded_ops(),
    }


def recorded_ops() -> int | None:
    """Ops recorded into graphs so far: the sum of the ``xla::<op>`` counters (None: none)."""
    import spmd_torch.debug.metrics as met

    ops = [n for n in met.counter_names() if n.startswith("xla::")]
    return sum(met.counter_value(n) or 0 for n in ops) if ops else None


def graph_per_step(window: dict[str, Any]) -> dict[str, float | None]:
    """Per step of a probed window: programs run, their mean node count, ops traced and ops
    recorded (read_probe's numbers; None where that checkout keeps none)."""
    before, after = window["before"], window["after"]
    n = len(window["host_s"])

    def per_step(key: str) -> float | None:
        if before.get(key) is None or after.get(key) is None:
            return None
        return (after[key] - before[key]) / n

    out = {"programs": None, "nodes_per_program": None}
    if before.get("graphs") is not None and after.get("graphs") is not None:
        programs = after["graphs"][0] - before["graphs"][0]
        nodes = after["graphs"][1] - before["graphs"][1]
        out = {
            "programs": programs / n,
            "nodes_per_program": nodes / programs if programs else None,
        }
    return {**out, "traced_ops": per_step("traced"), "recorded_ops": per_step("recorded")}


def host_breakdown(window: dict[str, Any], trace_s: float) -> dict[str, Any]:
    """ms per step of a probed window: host (in step(); also as the main thread's CPU time), device
    wait, tracing (`trace_s` over the window) and the rest, the barrier, split into its phases, compiles and what no phase covers
    (phases None: n/a). The phases are all serial host work inside the barrier."""
    n = len(window["host_s"])
    host = sum(window["host_s"]) * 1e3 / n
    trace = trace_s * 1e3 / n
    out: dict[str, Any] = {
        "host": host,
        "host_cpu": sum(window["host_cpu_s"]) * 1e3 / n if "host_cpu_s" in window else None,
        "device_wait": sum(window["wait_s"]) * 1e3 / n,
        "trace": trace,
        "barrier": host - trace,
        "compile": None,
        "phases": None,
        "phase_calls": None,
        "barrier_rest": None,
    }
    before, after = window["before"], window["after"]
    if before is None:
        return out
    out["compile"] = (after["compile_ns"] - before["compile_ns"]) / n / 1e6
    if before["phases"] is not None:
        names = after["phases"]
        out["phases"] = {p: (names[p][1] - before["phases"][p][1]) / n / 1e6 for p in names}
        out["phase_calls"] = {p: (names[p][0] - before["phases"][p][0]) / n for p in names}
        out["barrier_rest"] = out["barrier"] - sum(out["phases"].values()) - out["compile"]
    if before.get("linearize_cpu_ns") is not None:  # the walk's CPU time, beside its wall time
        out["linearize_cpu"] = (after["linearize_cpu_ns"] - before["linearize_cpu_ns"]) / n / 1e6
    return out


# ------------------------------------------------------------------------------------------------
# spmd_torch's counters (public API: debug.metrics)


def spmd_compiles() -> int:
    """Programs compiled so far (CompileTime samples)."""
    import spmd_torch.debug.metrics as met

    data = met.metric_data("CompileTime")
    return 0 if data is None else int(data[0])


def spmd_cached_compiles() -> int:
    import spmd_torch.debug.metrics as met

    return int(met.counter_value("CachedCompile") or 0)


def spmd_fallbacks() -> dict[str, int]:
    """CPU fallbacks so far, by op: the ``aten::<op>`` counters (an op run on the CPU for lack of
    a lowering), read through counter_names(), which older checkouts have too. A host read of a
    scalar (``.item()``, the loss logged) counts as ``aten::_local_scalar_dense``, as in
    PyTorch/XLA, but ran on the device: not a fallback."""
    import spmd_torch.debug.metrics as met

    names = [
        n
        for n in met.counter_names()
        if n.startswith("aten::") and n != "aten::_local_scalar_dense"
    ]
    return {n: int(met.counter_value(n) or 0) for n in names}


def run_counting_fallbacks(tr: Trainer, warmup: int, steps: int, check: bool) -> dict[str, Any]:
    """run_trainer, plus the CPU fallbacks its steps made (not the model's upload before them):
    their total, per step, and the count of each op that fell back."""
    before = spmd_fallbacks()
    result = run_trainer(tr, warmup, steps, check)
    after = spmd_fallbacks()
    ops = {n: c - before.get(n, 0) for n, c in sorted(after.items()) if c > before.get(n, 0)}
    n_steps = steps if check else warmup + 2 * steps  # warm-up (first included), blocked, pipelined
    total = sum(ops.values())
    return {
        **result,
        "fallbacks": total,
        "fallbacks_per_step": total / n_steps,
        "fallback_ops": ops,
    }


def spmd_uncached() -> int:
    """Cache misses so far: what W2mp counts as compiles (a merged replica run is one)."""
    import spmd_torch.debug.metrics as met

    return int(met.counter_value("UncachedCompile") or 0)


# ------------------------------------------------------------------------------------------------
# Devices


def eager_device(gpu: bool) -> torch.device:
    return torch.device("cuda" if gpu and torch.cuda.is_available() else "cpu")


def eager_wait(dev: torch.device) -> Callable[[], None]:
    return torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)


def eager_peak(dev: torch.device) -> Callable[[], int | None]:
    return torch.cuda.max_memory_allocated if dev.type == "cuda" else (lambda: None)


def jax_peak(devices: list[Any] | None = None) -> int | None:
    """Largest peak_bytes_in_use over `devices` (default: the first); None where JAX keeps no
    memory stats (CPU)."""
    import jax

    stats = [d.memory_stats() or {} for d in devices or jax.devices()[:1]]
    peaks = [s["peak_bytes_in_use"] for s in stats if "peak_bytes_in_use" in s]
    return max(peaks) if peaks else None


def program_bytes(compiled: Any) -> int | None:
    """What one device needs while the compiled program runs, by XLA's memory analysis."""
    stats = compiled.memory_analysis()
    if stats is None:
        return None
    return (
        stats.argument_size_in_bytes
        + stats.temp_size_in_bytes
        + stats.output_size_in_bytes
        - stats.alias_size_in_bytes
    )


def spmd_program_bytes() -> int | None:
    """The memory analysis of the last program spmd_torch compiled: the steady-state step, once
    the timed steps ran (an engine read, there is no public handle on a compiled program); None
    where the checkout imported keeps its executables elsewhere."""
    from spmd_torch._lazy import engine

    cache = getattr(engine.current(), "cache", None)
    executables = list(getattr(cache, "executables", {}).values())
    compiled = getattr(executables[-1], "compiled", None) if executables else None
    return None if compiled is None else program_bytes(compiled)


class RssPeak:
    """The largest growth of this process's resident memory while the block runs (sampled each
    millisecond on a thread), in bytes: host memory, where no allocator keeps a peak."""

    def __enter__(self) -> RssPeak:
        import threading

        self.base = self.peak = rss_bytes()
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._done.wait(0.001):
            self.peak = max(self.peak, rss_bytes())

    def __exit__(self, *exc: Any) -> None:
        self._done.set()
        self._thread.join()
        self.peak = max(self.peak, rss_bytes())
        self.growth = self.peak - self.base


def rss_bytes() -> int:
    """This process's resident bytes now (Linux)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


# ------------------------------------------------------------------------------------------------
# Child processes


def configure_jax_env(gpu: bool, env: dict[str, str], cpu_devices: int | None) -> dict[str, str]:
    """Pins the JAX platform before jax is imported; drops a forced CPU device count (tests set 8),
    which would split the CPU thread pool between virtual devices, except where a workload's mesh
    (or its replicas) needs `cpu_devices` of them on CPU."""
    env["JAX_PLATFORMS"] = "cuda" if gpu else "cpu"
    flags = re.sub(
        r"--xla_force_host_platform_device_count=\S+", "", env.get("XLA_FLAGS", "")
    ).strip()
    if cpu_devices and not gpu:
        flags = f"{flags} --xla_force_host_platform_device_count={cpu_devices}".strip()
    if flags:
        env["XLA_FLAGS"] = flags
    else:
        env.pop("XLA_FLAGS", None)
    return env


def child_env(gpu: bool, cpu_devices: int | None, tree: str) -> dict[str, str]:
    """The environment of a child that imports `tree`'s spmd_torch (PYTHONPATH first)."""
    env = configure_jax_env(gpu, dict(os.environ), cpu_devices)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (tree, env.get("PYTHONPATH")) if p)
    return env


def use_tree(tree: str) -> None:
    """Puts `tree` first on sys.path, so that `import spmd_torch` finds that checkout's:
    ``python -m`` puts the working directory (this checkout) ahead of PYTHONPATH."""
    if "spmd_torch" in sys.modules:
        raise RuntimeError(f"spmd_torch already imported from {sys.modules['spmd_torch'].__file__}")
    sys.path.insert(0, os.path.abspath(tree))


def spmd_file() -> str | None:
    """Where this process's spmd_torch came from (None: not imported), so the parent can check."""
    module = sys.modules.get("spmd_torch")
    return None if module is None else module.__file__


def emit(result: dict[str, Any]) -> None:
    """The one line a child prints for its parent."""
    print(RESULT_TAG + json.dumps(result), flush=True)


def spawn(argv: list[str], env: dict[str, str], timeout: float) -> dict[str, Any]:
    """Runs ``python -m tools.bench ARGV`` from this checkout's root; its BENCH_RESULT, or an
    error entry with the tail of its stderr."""
    cmd = [sys.executable, "-m", "tools.bench", *argv]
    try:
        proc = subprocess.run(
            cmd, check=False, env=env, cwd=ROOT, capture_output=True, text=True, timeout=timeout
        )
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout}s"}
    for line in proc.stdout.splitlines():
        if line.startswith(RESULT_TAG):
            return json.loads(line[len(RESULT_TAG) :])
    tail = (proc.stderr.strip().splitlines() or ["(no output)"])[-1]
    return {"error": f"exit {proc.returncode}: {tail}", "stderr_tail": proc.stderr[-4000:]}


def gpu_available(env: dict[str, str]) -> str | None:
    """Asks a throwaway interpreter, so the parent never initialises (or preallocates) the GPU."""
    probe = "import jax; d = jax.devices()[0]; print(d.platform, d.device_kind)"
    proc = subprocess.run(
        [sys.executable, "-c", probe], check=False, env=env, capture_output=True, text=True
    )
    return proc.stdout.strip() if proc.returncode == 0 and proc.stdout.startswith("gpu") else None
