"""Pods: W4 and W2mp as a job of 2 hosts x 4 devices against 1 host x 8; start-up; fault detection.

Every layout runs as a job of ``spmd_torch.distributed.run``, 1 x 8 too: ``--hosts 1
--devices-per-host 8`` is one process with 8 virtual CPU devices, as W4 and W2mp run, started and
read the same way as the 2-host job. Each host runs ``python -m tools.bench.pods ROLE`` (after
``--``, the launcher hands ``-m tools.bench.pods ...`` to Python as it would a script) and prints
one BENCH_RESULT line, which the launcher prefixes with ``[host i]``. The pod workload's child
(``--only W4pod:spmd_torch``) runs the jobs one after the other, gathers the hosts' lines from the
launcher's output and returns one result, its targets judged, for the report.

  W4pod     W4's spmd_torch implementation (its model, batch 16, AdamW, marks, warm-up and timed
            steps) on the job's global 8-device mesh: per-step losses of 2x4 against 1x8 (max
            relative difference, rtol 1e-5), steps/s (median of timed windows of pipelined steps,
            as W2mp) and UncachedCompile per host (2x4: each host as many as 1x8).
  W2mppod   W2mp's mp implementation (launch, a replica per device of the job, each on the rows of
            the global batch its global ordinal picks, xm.optimizer_step): each replica's
            per-step losses and steps/s, 2x4 against 1x8.
  PodStart  seconds from starting the launcher to the line every host prints once spmd_torch is
            imported and its first xm.mark_step ran, and to the job's exit; 1x8 and 2x4
            alternated, --steps times each (default 3), medians. Target: 2x4 ready < 10 s after
            1x8.
  PodFault  a 2x4 job whose host 1 SIGKILLs itself at step 3, after steps of a program over both
            hosts' devices, heartbeat timeout 10 s: started by hand (two processes with the
            SPMD_TORCH_* variables, no launcher), seconds from the kill to host 0's exit and its
            status; then through the launcher, seconds from the kill to the launcher's exit.

The hosts are always the launcher's virtual CPU devices, whatever --gpu says; --against does not
apply (another checkout may have no launcher).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from . import harness, mp, training
from .models import GPT_W4_CFG, gpt_data, gpt_loss, new_adamw, new_gpt

LAYOUTS = ((1, 8), (2, 4))  # (hosts, devices per host); the reference first
LOSS_RTOL = 1e-5  # 2x4's per-step losses against 1x8's
START_TARGET_S = 10.0  # 2 hosts may be ready at most this much later than 1
HEARTBEAT_S = 10  # PodFault's SPMD_TORCH_HEARTBEAT_TIMEOUT_S
FAULT_STEP = 3  # the step at which PodFault's host 1 kills itself
INIT_TIMEOUT_S = 120  # hosts waiting for each other at start-up (slow imports on few cores)
JOB_TIMEOUT_S = 900.0  # no job outlives this: a hang becomes an error, not a stuck bench
FAULT_TIMEOUT_S = 240.0  # a PodFault job's limit: far past the heartbeat timeout
LAUNCHER_GRACE_S = 5.0  # spmd_torch.distributed.run's SIGTERM-to-SIGKILL grace (_STOP_GRACE_S)
STOP_GRACE_S = 15.0  # a job stopped at its limit gets this long after SIGTERM, then SIGKILL
READY = "POD_READY"  # PodStart's line: "POD_READY <time.time()>"
KILLED = "POD_KILLED"  # PodFault's host 1, right before SIGKILL: "POD_KILLED <time.time()>"
_HOST_LINE = re.compile(r"^\[host (\d+)\] (.*)$")


def layout_name(hosts: int, devices: int) -> str:
    return f"{hosts}x{devices}"


REFERENCE, POD = (layout_name(h, d) for h, d in LAYOUTS)


# ------------------------------------------------------------------------------------------------
# The hosts: python -m tools.bench.pods ROLE, one process per host of a job


def _where() -> dict[str, Any]:
    """This host in its job; read outside launch (inside, process_index is a replica's)."""
    import spmd_torch.runtime as xr

    return {
        "host": xr.process_index(),
        "process_count": xr.process_count(),
        "global_devices": xr.global_runtime_device_count(),
        "local_devices": xr.addressable_runtime_device_count(),
    }


def _window_fields(r: dict[str, Any]) -> dict[str, Any]:
    """What a host reports of harness.run_windows (the probe's raw readings left out)."""
    return {k: v for k, v in r.items() if k not in ("probe", "probe_steps", "trace_ns")}


def _w4_host(warmup: int, steps: int) -> dict[str, Any]:
    """W4's spmd_torch run (training.w4_spmd's trainer and marks) on the mesh of every device of
    the job; timed as W2mp is, in windows of pipelined steps, then one probed window."""
    n = training.fsdp_mesh_size()
    shard = training._spmd_fsdp_shard(n)
    tr = training.spmd_trainer(new_gpt(), new_adamw, gpt_loss, gpt_data(GPT_W4_CFG), shard=shard)
    windows, window = mp._windows(steps)
    r = harness.run_windows(tr.step, tr.wait, warmup, windows, window, probe=True)
    lo, hi = r["probe_steps"]
    trace_s = sum(r["probe"]["host_s"]) - sum(tr.barrier_times[lo:hi])
    return {
        **_window_fields(r),
        "host_ms": harness.host_breakdown(r["probe"], trace_s),
        "compiles_total": harness.spmd_uncached(),
        "mesh_devices": n,
    }


def _w2mp_replica(
    index: int, data: tuple[np.ndarray, np.ndarray], warmup: int, steps: int
) -> dict[str, Any]:
    """W2mp's replica (mp._replica), which takes its rows of the global batch by `index`: that
    must be the replica's global ordinal, on every host, or 2x4 would train on other rows."""
    import spmd_torch.runtime as xr

    if index != xr.global_ordinal():
        raise RuntimeError(f"launch gave index {index} to global ordinal {xr.global_ordinal()}")
    return mp._replica(index, data, warmup, steps, check=False)


def _w2mp_host(warmup: int, steps: int) -> dict[str, Any]:
    """W2mp's mp run with one replica per device of the job (this host runs its own); the data
    is the global batch, the same on every host. The host running replica 0 splits its host
    time as W2mp does (its replicas' tracing summed)."""
    import spmd_torch
    import spmd_torch.runtime as xr

    n = xr.global_runtime_device_count()
    results = spmd_torch.launch(_w2mp_replica, args=(mp._data(n), warmup, steps))
    local = [results[k] for k in sorted(results)]
    first = local[0]
    host_ms = None
    if 0 in results:  # replica 0 probed its last window
        lo, hi = first["probe_steps"]
        trace_s = sum(sum(r["trace_ns"][lo:hi]) for r in local) / 1e9
        host_ms = harness.host_breakdown(first["probe"], trace_s)
        host_ms["trace_per_replica"] = host_ms["trace"] / len(local)
    return {
        **{k: v for k, v in _window_fields(first).items() if k != "losses"},
        "replica_losses": {str(k): results[k]["losses"] for k in sorted(results)},
        "host_ms": host_ms,
        "compiles_total": harness.spmd_uncached(),
        "mesh_devices": n,
    }


def _start_host(warmup: int, steps: int) -> None:
    """The trivial script: (spmd_torch imported) one op, the first mark_step, one line."""
    import spmd_torch.core.xla_model as xm

    x = torch.ones(4).to(xm.xla_device()) + 1
    xm.mark_step()
    xm.wait_device_ops()
    del x
    print(f"{READY} {time.time()}", flush=True)


def _fault_host(warmup: int, steps: int) -> None:
    """Steps of one program over every device of the job, its result read on every host; host 1
    SIGKILLs itself at FAULT_STEP (as tests/pods/pod_job.py's fault scenario)."""
    import spmd_torch.core.xla_model as xm
    import spmd_torch.distributed.spmd as xs
    import spmd_torch.runtime as xr

    xr.use_spmd()
    n = xr.global_runtime_device_count()
    mesh = xs.Mesh(np.arange(n), (n,), ("data",))
    x = torch.ones(8 * n, 4).to(xm.xla_device())
    xs.mark_sharding(x, mesh, ("data", None))
    for step in range(10_000):
        x = x * 1.0
        total = x.sum().item()
        print(f"POD_STEP {step} {total}", flush=True)
        if step == FAULT_STEP and xr.process_index() == 1:
            print(f"{KILLED} {time.time()}", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(0.05)


_ROLES: dict[str, Callable[[int, int], dict[str, Any] | None]] = {
    "w4": _w4_host,
    "w2mp": _w2mp_host,
    "start": _start_host,
    "fault": _fault_host,
}


def host_main(argv: list[str] | None = None) -> int:
    """One host: runs ROLE and prints its BENCH_RESULT line (start and fault print their own)."""
    p = argparse.ArgumentParser(prog="python -m tools.bench.pods", description=__doc__)
    p.add_argument("role", choices=sorted(_ROLES))
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--steps", type=int, default=1)
    args = p.parse_args(argv)
    import spmd_torch  # noqa: F401  (first: a job's hosts join before any device is used)

    t0 = harness.now()
    result = _ROLES[args.role](max(args.warmup, 1), args.steps)
    if result is not None:
        where = _where()
        result.update(where, wall_s=harness.now() - t0, spmd_file=harness.spmd_file())
        harness.emit(result)
    return 0


# ------------------------------------------------------------------------------------------------
# Jobs, watched from this process (the pod workload's child)


class Watched:
    """A process whose output lines and exit are timestamped (time.time()) as they come, by
    threads, so a job's start-up and a host's death can be timed from outside."""

    def __init__(self, command: list[str], env: dict[str, str]) -> None:
        self.lines: list[tuple[float, str]] = []
        self.errors: list[str] = []
        self.ended: float | None = None
        self.started = time.time()
        self.process = subprocess.Popen(
            command,
            cwd=harness.ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        self._threads = [
            threading.Thread(target=self._read, args=(self.process.stdout, True), daemon=True),
            threading.Thread(target=self._read, args=(self.process.stderr, False), daemon=True),
        ]
        self._waiter = threading.Thread(target=self._wait, daemon=True)
        for thread in (*self._threads, self._waiter):
            thread.start()

    def _read(self, stream: Any, timed: bool) -> None:
        for line in iter(stream.readline, ""):
            if timed:
                self.lines.append((time.time(), line.rstrip("\n")))
            else:
                self.errors.append(line.rstrip("\n"))
        stream.close()

    def _wait(self) -> None:
        self.process.wait()
        self.ended = time.time()

    def wait(self, timeout: float) -> int | None:
        """The exit status (negative: the signal), or None: still running after `timeout`."""
        self._waiter.join(timeout)
        if self._waiter.is_alive():
            return None
        for thread in self._threads:
            thread.join(timeout=5.0)
        return self.process.returncode

    def stop(self) -> None:
        """SIGTERM (the launcher stops its hosts on it), SIGKILL if it is still there after
        STOP_GRACE_S."""
        if self.process.poll() is None:
            self.process.terminate()
            if self.wait(STOP_GRACE_S) is None:
                self.process.kill()
                self.wait(STOP_GRACE_S)

    def tail(self, n: int = 40) -> str:
        return "\n".join([line for _, line in self.lines[-n:]] + self.errors[-n:])


def _env(**extra: str) -> dict[str, str]:
    """The child's environment less any SPMD_TORCH_* of the caller's, on CPU."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("SPMD_TORCH_")}
    env.update(JAX_PLATFORMS="cpu", PYTHONUNBUFFERED="1", **extra)
    return env


def _launcher(hosts: int, devices: int, role: str, *args: str, heartbeat: int | None = None):
    command = [sys.executable, "-m", "spmd_torch.distributed.run", "--hosts", str(hosts)]
    command += ["--devices-per-host", str(devices), "--init-timeout", str(INIT_TIMEOUT_S)]
    if heartbeat is not None:
        command += ["--heartbeat-timeout", str(heartbeat)]
    return command + ["--", "-m", "tools.bench.pods", role, *args]


def _host_command(role: str) -> list[str]:
    return [sys.executable, "-m", "tools.bench.pods", role]


def _lines_of(job: Watched) -> list[tuple[float, int, str]]:
    """(time, host, text) of each [host i]-prefixed line of a launcher's output."""
    out = []
    for t, line in job.lines:
        m = _HOST_LINE.match(line)
        if m:
            out.append((t, int(m.group(1)), m.group(2)))
    return out


def _failed(what: str, job: Watched) -> RuntimeError:
    """The error a failed job raises, its output's tail on stderr for the parent to show."""
    print(f"--- {what}: last output\n{job.tail()}", file=sys.stderr, flush=True)
    return RuntimeError(what)


def _run_layout(hosts: int, devices: int, role: str, warmup: int, steps: int) -> dict[str, Any]:
    """One job of `role` through the launcher; every host's BENCH_RESULT, host by host."""
    name = layout_name(hosts, devices)
    print(f"... {role} as {name}", file=sys.stderr, flush=True)
    job = Watched(
        _launcher(hosts, devices, role, "--warmup", str(warmup), "--steps", str(steps)), _env()
    )
    status = job.wait(JOB_TIMEOUT_S)
    if status is None:
        job.stop()
        raise _failed(f"{role} as {name}: still running after {JOB_TIMEOUT_S:g} s", job)
    results = {}
    for _, host, text in _lines_of(job):
        if text.startswith(harness.RESULT_TAG):
            results[host] = json.loads(text[len(harness.RESULT_TAG) :])
    if status != 0 or sorted(results) != list(range(hosts)):
        raise _failed(f"{role} as {name}: exit {status}, results from hosts {sorted(results)}", job)
    return {"hosts": [results[h] for h in range(hosts)], "job_s": job.ended - job.started}


def _rel_diff(a: list[float], b: list[float]) -> float:
    """max |a - b| / |b| over the steps (b: the reference's); inf where the counts differ."""
    if len(a) != len(b) or not b:
        return float("inf")
    return max(abs(x - y) / max(abs(y), 1e-30) for x, y in zip(a, b))


def _spmd_file(layouts: dict[str, dict[str, Any]]) -> str | None:
    """The spmd_torch the hosts imported (__main__ checks it is this checkout's); None where
    they disagree, which the check then refuses."""
    files = {h["spmd_file"] for lay in layouts.values() for h in lay["hosts"]}
    return files.pop() if len(files) == 1 else None


def _compare(layouts: dict[str, dict[str, Any]], diff: float) -> dict[str, Any]:
    """What W4pod and W2mppod judge alike: losses, steps/s (host 0's), compiles per host."""
    speed = {name: lay["hosts"][0]["steps_per_s"] for name, lay in layouts.items()}
    compiles = {name: [h["compiles_total"] for h in lay["hosts"]] for name, lay in layouts.items()}
    return {
        "max_rel_diff": diff,
        "losses_equal": diff <= LOSS_RTOL,
        "rtol": LOSS_RTOL,
        "steps_per_s": speed,
        "pod_over_reference": speed[POD] / speed[REFERENCE],
        "compiles": compiles,
        "compiles_equal": len({c for cs in compiles.values() for c in cs}) == 1,
    }


def _layouts(role: str, warmup: int, steps: int) -> dict[str, dict[str, Any]]:
    return {layout_name(h, d): _run_layout(h, d, role, warmup, steps) for h, d in LAYOUTS}


def w4pod(warmup: int, steps: int, check: bool, gpu: bool) -> dict[str, Any]:
    """W4 as 1x8 and 2x4; every host's per-step losses against 1x8's."""
    layouts = _layouts("w4", warmup, steps)
    reference = layouts[REFERENCE]["hosts"][0]["losses"]
    diff = max(_rel_diff(h["losses"], reference) for h in layouts[POD]["hosts"])
    return {
        "layouts": layouts,
        "compare": _compare(layouts, diff),
        "device": "cpu (launcher jobs)",
        "spmd_file": _spmd_file(layouts),
        "warmup": warmup,
        "steps": steps,
        "windows": mp._windows(steps),
    }


def _replica_losses(layout: dict[str, Any]) -> dict[int, list[float]]:
    """Every replica's per-step losses, by global ordinal, gathered from the layout's hosts."""
    return {int(k): v for h in layout["hosts"] for k, v in h["replica_losses"].items()}


def w2mppod(warmup: int, steps: int, check: bool, gpu: bool) -> dict[str, Any]:
    """W2mp's mp as 1x8 and 2x4; each replica's per-step losses against the same ordinal's in
    1x8, and the global batch's loss (the replicas' mean) step by step."""
    layouts = _layouts("w2mp", warmup, steps)
    ours, reference = (_replica_losses(layouts[name]) for name in (POD, REFERENCE))
    if sorted(ours) != sorted(reference):
        raise RuntimeError(
            f"replica ordinals: {POD} {sorted(ours)}, {REFERENCE} {sorted(reference)}"
        )
    diff = max(_rel_diff(ours[k], reference[k]) for k in reference)
    means = {
        name: [float(np.mean(step)) for step in zip(*losses.values())]
        for name, losses in ((POD, ours), (REFERENCE, reference))
    }
    for name, lay in layouts.items():
        lay["mean_losses"] = means[name]
    return {
        "layouts": layouts,
        "compare": {
            **_compare(layouts, diff),
            "replicas": len(reference),
            "mean_max_rel_diff": _rel_diff(means[POD], means[REFERENCE]),
        },
        "device": "cpu (launcher jobs)",
        "spmd_file": _spmd_file(layouts),
        "warmup": warmup,
        "steps": steps,
        "windows": mp._windows(steps),
    }


def _start_once(hosts: int, devices: int) -> dict[str, Any]:
    """One trivial job: seconds from starting the launcher to the last host's READY line (the
    time the host printed in it) and to the launcher's exit."""
    job = Watched(_launcher(hosts, devices, "start"), _env())
    status = job.wait(JOB_TIMEOUT_S)
    if status is None:
        job.stop()
    ready = [float(text.split()[1]) for _, _, text in _lines_of(job) if text.startswith(READY)]
    if status != 0 or len(ready) != hosts:
        raise _failed(f"start as {layout_name(hosts, devices)}: exit {status}", job)
    return {"ready_s": max(ready) - job.started, "exit_s": job.ended - job.started}


def pod_start(warmup: int, steps: int, check: bool, gpu: bool) -> dict[str, Any]:
    """1x8 and 2x4 alternated `steps` times (default 3); medians of ready and exit seconds."""
    runs: dict[str, list[dict[str, float]]] = {layout_name(h, d): [] for h, d in LAYOUTS}
    for rep in range(max(steps, 1)):
        for hosts, devices in LAYOUTS:
            print(f"... start as {layout_name(hosts, devices)} ({rep + 1})", file=sys.stderr)
            runs[layout_name(hosts, devices)].append(_start_once(hosts, devices))
    medians = {
        name: {k: statistics.median(r[k] for r in rs) for k in ("ready_s", "exit_s")}
        for name, rs in runs.items()
    }
    later = medians[POD]["ready_s"] - medians[REFERENCE]["ready_s"]
    return {
        "runs": runs,
        "medians": medians,
        "pod_ready_later_s": later,
        "target_s": START_TARGET_S,
        "met": later < START_TARGET_S,
        "device": "cpu (launcher jobs)",
        "spmd_file": _found_spmd_file(),
        "reps": max(steps, 1),
    }


def _found_spmd_file() -> str | None:
    """The spmd_torch the hosts of PodStart and PodFault import (they print no BENCH_RESULT):
    found as they find it, from the repository root, without importing it here."""
    spec = importlib.util.find_spec("spmd_torch")
    return None if spec is None else spec.origin


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _killed_at(lines: list[str]) -> float | None:
    """The time host 1 printed right before its SIGKILL."""
    return next((float(x.split()[1]) for x in lines if x.startswith(KILLED)), None)


def _describe(status: int | None) -> str:
    if status is None:
        return "still running"
    return f"signal {signal.Signals(-status).name}" if status < 0 else f"status {status}"


def _error_line(lines: list[str]) -> str | None:
    """What host 0's output says ended it: JAX's first line naming the tasks that stopped
    sending heartbeats (their ids are on the next line), else its last line; shortened."""
    for k, line in enumerate(lines):
        at = line.find("The following tasks")
        if at >= 0:
            return f"{line[at:]} {lines[k + 1].strip() if k + 1 < len(lines) else ''}"[:200]
    said = [x.strip() for x in lines if x.strip()]
    return said[-1][:200] if said else None


def _fault_by_hand() -> dict[str, Any]:
    """Two host processes started with SPMD_TORCH_* variables (as a pod's scheduler would, as
    tests/pods/test_pods.py's _host_env does), 4 devices each; host 1 kills itself."""
    port = _free_port()
    hosts = []
    for host in range(2):
        env = _env(
            XLA_FLAGS="--xla_force_host_platform_device_count=4",
            SPMD_TORCH_COORDINATOR_ADDRESS=f"127.0.0.1:{port}",
            SPMD_TORCH_NUM_PROCESSES="2",
            SPMD_TORCH_PROCESS_ID=str(host),
            SPMD_TORCH_LOOPBACK="1",
            SPMD_TORCH_HEARTBEAT_TIMEOUT_S=str(HEARTBEAT_S),
            SPMD_TORCH_INIT_TIMEOUT_S=str(INIT_TIMEOUT_S),
        )
        hosts.append(Watched(_host_command("fault"), env))
    survivor, victim = hosts
    status = survivor.wait(FAULT_TIMEOUT_S)
    for job in (survivor, victim):
        job.stop()
    killed = _killed_at([line for _, line in victim.lines])
    if killed is None:
        raise _failed(f"fault by hand: host 1 never reached step {FAULT_STEP}", victim)
    return {
        "status": status,
        "exit": _describe(status),
        "seconds": None if status is None else survivor.ended - killed,
        "victim_status": _describe(victim.process.returncode),
        "victim_exit_after_kill_s": None if victim.ended is None else victim.ended - killed,
        "steps_after_kill": sum(
            1 for t, line in survivor.lines if line.startswith("POD_STEP") and t > killed
        ),
        "error_line": _error_line(survivor.errors),
        "names_heartbeats": any("stopped sending heartbeats" in x for x in survivor.errors),
    }


def _fault_launcher() -> dict[str, Any]:
    """The same job through the launcher (--heartbeat-timeout 10), which sees host 1 die itself
    and stops host 0: SIGTERM, then SIGKILL after its grace period (JAX's distributed runtime
    catches SIGTERM, as a preemption notice)."""
    job = Watched(_launcher(2, 4, "fault", heartbeat=HEARTBEAT_S), _env())
    status = job.wait(FAULT_TIMEOUT_S)
    job.stop()
    killed = _killed_at([text for _, host, text in _lines_of(job) if host == 1])
    if killed is None:
        raise _failed(f"fault through the launcher: host 1 never reached step {FAULT_STEP}", job)
    said = [x for x in job.errors if x.startswith("spmd_torch.distributed.run:")]
    return {
        "status": status,
        "exit": _describe(status),
        "seconds": None if status is None else job.ended - killed,
        "error_line": said[-1][:200] if said else _error_line(job.errors),
        "names_host_1": any("host 1 exited with signal SIGKILL" in x for x in said),
        # Past the grace, host 0 outlived the launcher's SIGTERM and was SIGKILLed.
        "host_0_outlived_sigterm": status is not None and job.ended - killed >= LAUNCHER_GRACE_S,
    }


def pod_fault(warmup: int, steps: int, check: bool, gpu: bool) -> dict[str, Any]:
    """Host 1 SIGKILLed at step 3: without the launcher (met: host 0 exits non-zero within twice
    the heartbeat timeout of the kill), then with it (met: non-zero, within the timeout)."""
    print("... fault by hand (no launcher)", file=sys.stderr, flush=True)
    by_hand = _fault_by_hand()
    print("... fault through the launcher", file=sys.stderr, flush=True)
    launcher = _fault_launcher()
    by_hand["limit_s"], launcher["limit_s"] = 2 * HEARTBEAT_S, HEARTBEAT_S
    for r in (by_hand, launcher):
        r["met"] = r["status"] not in (None, 0) and r["seconds"] <= r["limit_s"]
    return {
        "by_hand": by_hand,
        "launcher": launcher,
        "heartbeat_timeout_s": HEARTBEAT_S,
        "fault_step": FAULT_STEP,
        "device": "cpu (2 hosts x 4 devices)",
        "spmd_file": _found_spmd_file(),
    }


if __name__ == "__main__":
    sys.exit(host_main())
