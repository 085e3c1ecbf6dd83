"""Pods on one machine: jobs of several processes ("hosts") on 127.0.0.1, started by
``spmd_torch.distributed.run`` (or by hand, to see what each host does on its own), each under a
wall-clock limit that kills it. Two hosts of four devices must compute what one host of eight
does: SPMD training, the per-device emulation, checkpoints either way; and a host that dies,
stops or leaves early ends the job within its timeouts, named."""

from __future__ import annotations

import json
import os
import pathlib
import signal
import socket
import subprocess
import sys
import time

import psutil
import pytest
import torch

from spmd_torch.distributed import run
from tests.helpers import assert_close
from tests.xla_codegen import child_flags

pytestmark = pytest.mark.multiprocess

JOB = pathlib.Path(__file__).with_name("pod_job.py")
ROOT = str(JOB.parents[2])
LIMIT_S = 240  # no job may outlast this: a hang fails the test instead of the suite
FAST_FAILURE = {"SPMD_TORCH_HEARTBEAT_TIMEOUT_S": "6", "SPMD_TORCH_SHUTDOWN_TIMEOUT_S": "6"}


def _env(**extra: str) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SPMD_TORCH_", "XLA_"))}
    # XLA_FLAGS: the quick codegen; the launcher adds each host's device count
    env.update(
        PYTHONPATH=ROOT,
        JAX_PLATFORMS="cpu",
        SPMD_TORCH_INIT_TIMEOUT_S="60",
        XLA_FLAGS=child_flags(),
    )
    env.update(extra)
    return env


def _results(output: str) -> list[dict]:
    return [
        json.loads(line.split("RESULT ", 1)[1]) for line in output.splitlines() if "RESULT " in line
    ]


def _launcher(hosts: int, devices: int, *args: str, **env: str) -> subprocess.Popen:
    command = [sys.executable, "-m", "spmd_torch.distributed.run", "--hosts", str(hosts)]
    command += ["--devices-per-host", str(devices), str(JOB), *args]
    return subprocess.Popen(
        command,
        env=_env(**env),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=ROOT,
    )


def launch(hosts: int, devices: int, *args: str, **env: str) -> subprocess.CompletedProcess:
    """The job through the launcher, to its end (killed past LIMIT_S)."""
    job = _launcher(hosts, devices, *args, **env)
    try:
        out, err = job.communicate(timeout=LIMIT_S)
    finally:
        job.kill()
    return subprocess.CompletedProcess(job.args, job.returncode, out, err)


def by_host(job: subprocess.CompletedProcess, key: str) -> dict:
    assert job.returncode == 0, job.stdout[-4000:] + job.stderr[-4000:]
    return {r["host"]: r for r in _results(job.stdout) if key in r}


# --- the same job on 2 x 4 and on 1 x 8 ---------------------------------------------------------


def test_a_minibatch_spec_that_does_not_fit_an_input_is_refused_naming_it():
    """On 2 hosts, 1-d labels under a 2-d minibatch spec would be taken whole from each host's
    half (PyTorch's batch-size mismatch much later, or different values on every host)."""
    errors = by_host(launch(2, 4, "one-spec-for-two-inputs"), "error")
    assert sorted(errors) == [0, 1]
    for result in errors.values():
        assert "does not fit batch[1] of shape (8,)" in result["error"]
        assert "minibatch=True" in result["error"] and "its own spec" in result["error"]


def test_two_hosts_train_as_one_host_of_eight_devices():
    two = by_host(launch(2, 4, "train"), "losses")
    one = by_host(launch(1, 8, "train"), "losses")[0]
    for host, result in two.items():
        assert_close(torch.tensor(result["losses"]), torch.tensor(one["losses"]))
        assert_close(torch.tensor(result["weight_sum"]), torch.tensor(one["weight_sum"]))
        assert result["seen"] == one["seen"]  # each global batch: every sample exactly once
        assert result["compiles"] == one["compiles"]  # one compile per host per distinct graph
        assert (result["process_count"], result["global_devices"], result["local_devices"]) == (
            2,
            8,
            4,
        )
        assert (result["ordinal"], result["local_ordinal"], result["master"]) == (
            host,
            0,
            host == 0,
        )
        assert result["local_shards"] == [f"CPU:{k}" for k in range(4 * host, 4 * host + 4)]
        assert result["rendezvous"] == ["0", "1"] and one["rendezvous"] == ["0"]
        assert result["mesh_reduce"] == 1 and one["mesh_reduce"] == 0
        assert result["hybrid"] == one["hybrid"] == [[0, 1, 2, 3], [4, 5, 6, 7]]
        assert result["hybrid_hosts"] == [[0] * 4, [1] * 4]  # ICI inside a host, DCN across
    assert sorted(sum(one["seen"], [])) == list(range(16 * 4))


def test_two_hosts_of_replicas_run_as_eight_replicas(tmp_path):
    two = by_host(launch(2, 4, "mp", POD_SAVE=str(tmp_path / "two.pt")), "losses")
    one = by_host(launch(1, 8, "mp", POD_SAVE=str(tmp_path / "one.pt")), "losses")[0]
    assert two[0]["ordinal"] == 0 and two[1]["ordinal"] == 4  # host 1 runs ordinals 4-7
    for result in two.values():
        assert result["world"] == one["world"] == 8
        assert_close(torch.tensor(result["losses"]), torch.tensor(one["losses"]))
        assert result["total"] == one["total"] == sum(range(8))
        assert result["payloads"] == one["payloads"] == [str(k) for k in range(8)]
    saved, reference = torch.load(tmp_path / "two.pt"), torch.load(tmp_path / "one.pt")
    assert_close(saved["w"], reference["w"])  # the global master wrote it, once


# --- checkpoints across hosts ---------------------------------------------------------------------


@pytest.mark.parametrize("saver, restorer", [((2, 4), (1, 8)), ((1, 8), (2, 4))], ids=str)
def test_checkpoint_restores_on_another_host_count_bit_exact(tmp_path, saver, restorer):
    saved = by_host(launch(*saver, "save", str(tmp_path)), "steps")
    assert all(r["steps"] == [3, 4] for r in saved.values())
    restored = by_host(launch(*restorer, "restore", str(tmp_path)), "w_equal")
    assert len(restored) == restorer[0]
    for result in restored.values():
        assert result["w_equal"] and result["b_equal"]
        assert result["spec"].startswith("{devices=[4,2]")


def test_a_host_killed_during_an_async_save_leaves_the_previous_checkpoint(tmp_path):
    job = launch(2, 4, "save-killed", str(tmp_path))
    assert job.returncode != 0
    assert "host 1 exited with signal SIGKILL" in job.stderr
    restored = by_host(launch(1, 8, "restore", str(tmp_path), "4096", "1024"), "w_equal")[0]
    assert restored["steps"] in ([0, 1], [0, 1, 2])
    assert restored["w_equal"] and restored["b_equal"]


def test_sigterm_on_one_host_checkpoints_the_same_step_on_every_host(tmp_path):
    job = _launcher(2, 4, "preempt", str(tmp_path))
    try:
        lines = []
        for line in job.stdout:  # until both hosts run steps
            lines.append(line)
            if sum('"step": 2' in seen for seen in lines) == 2:
                break
        host_1 = next(
            p
            for p in psutil.Process(job.pid).children()
            if p.environ().get("SPMD_TORCH_PROCESS_ID") == "1"
        )
        host_1.send_signal(signal.SIGTERM)
        out, err = job.communicate(timeout=LIMIT_S)
        output = "".join(lines) + out + err
    finally:
        job.kill()
    assert job.returncode == 0, output[-4000:]
    steps = sorted(int(e) for e in os.listdir(tmp_path) if e.isdigit())
    assert len(steps) == 1, output[-4000:]
    last = {r["host"]: r["step"] for r in _results(output)}
    assert last[0] == last[1] == steps[0]  # both checkpointed, and stopped at, the same step


# --- faults: never a hang -------------------------------------------------------------------------


def _host_env(host: int, port: int) -> dict:
    """A host started by hand (no launcher), as a pod's scheduler would start it."""
    return _env(
        XLA_FLAGS=child_flags(devices=2),
        SPMD_TORCH_COORDINATOR_ADDRESS=f"127.0.0.1:{port}",
        SPMD_TORCH_NUM_PROCESSES="2",
        SPMD_TORCH_PROCESS_ID=str(host),
        SPMD_TORCH_LOOPBACK="1",
        **FAST_FAILURE,
    )


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


FAULTS = ("kill", "stop", "exit")  # host 1 at step 3: SIGKILL, SIGSTOP, returns from the script


def test_the_surviving_host_exits_naming_the_one_that_failed():
    """Host 0 of each job (the three run at once) ends non-zero within the 6 s timeouts, with
    JAX's error naming task 1; no launcher involved."""
    jobs = {}
    for mode in FAULTS:
        port = _free_port()
        command = [sys.executable, str(JOB), "fault", mode]
        jobs[mode] = [
            subprocess.Popen(command, env=_host_env(host, port), stderr=subprocess.PIPE, text=True)
            for host in range(2)
        ]
    start = time.monotonic()
    survivors = {}
    for mode, (survivor, failing) in jobs.items():
        try:
            err = survivor.communicate(timeout=LIMIT_S)[1]
        finally:
            for process in (survivor, failing):
                process.kill()
                process.communicate()
        survivors[mode] = (survivor.returncode, time.monotonic() - start, err)
    named = {
        "kill": "stopped sending heartbeats",
        "stop": "stopped sending heartbeats",
        "exit": "The first task at the barrier: 1",
    }
    for mode, (status, seconds, err) in survivors.items():
        assert status != 0, (mode, err[-2000:])
        assert named[mode] in err, (mode, err[-2000:])
        assert seconds < 60, mode  # 6 s timeouts, after start-up and a few steps


def test_the_launcher_names_the_failing_host():
    jobs = {mode: _launcher(2, 2, "fault", mode, **FAST_FAILURE) for mode in FAULTS}
    said = {
        "kill": "host 1 exited with signal SIGKILL",
        "stop": "host 1 is stopped",
        "exit": "host 1 ended its script",
    }
    for mode, job in jobs.items():
        _, err = job.communicate(timeout=LIMIT_S)
        assert job.returncode != 0, mode
        assert said[mode] in err, (mode, err[-3000:])


class _Exited:
    """A host process that has already ended with ``status``."""

    def __init__(self, status: int):
        self.status, self.pid = status, -1

    def poll(self) -> int:
        return self.status


@pytest.mark.parametrize("order", ["abort-first", "abort-second"])
def test_a_host_aborted_by_its_peers_death_is_not_named_as_the_cause(capfd, order):
    """Both hosts seen dead at one look: the one JAX's runtime aborted (SIGABRT, as it does within
    milliseconds when a collective or the coordination service loses a peer) is the consequence,
    the one killed is the cause, whatever their order."""
    statuses = [-signal.SIGABRT, -signal.SIGKILL]
    if order == "abort-second":
        statuses.reverse()
    killed = statuses.index(-signal.SIGKILL)
    assert run._watch([_Exited(s) for s in statuses], {}) == 128 + signal.SIGKILL
    assert f"host {killed} exited with signal SIGKILL" in capfd.readouterr().err
    run._watch([_Exited(-signal.SIGABRT), _Exited(-signal.SIGABRT)], {})  # all aborted: the first
    assert "host 0 exited with signal SIGABRT" in capfd.readouterr().err


def test_a_busy_coordinator_port_is_named_and_the_launcher_starts_elsewhere(monkeypatch, capfd):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        busy = taken.getsockname()[1]
        env = _env(
            SPMD_TORCH_COORDINATOR_ADDRESS=f"127.0.0.1:{busy}",
            SPMD_TORCH_NUM_PROCESSES="2",
            SPMD_TORCH_PROCESS_ID="0",
            SPMD_TORCH_LOOPBACK="1",
        )
        alone = subprocess.run(
            [sys.executable, str(JOB), "hello"], env=env, capture_output=True, text=True, timeout=60
        )
        assert alone.returncode == run.PORT_BUSY_EXIT
        assert f"port {busy}" in alone.stderr
        ports = iter([busy, _free_port()])
        monkeypatch.setattr(run, "_free_port", lambda: next(ports))
        for name, value in _env().items():
            monkeypatch.setenv(name, value)
        assert run.main(["--hosts", "2", "--devices-per-host", "2", str(JOB), "hello"]) == 0
    out, err = capfd.readouterr()
    assert "starting the job again on another port" in err
    assert out.count('"processes": 2') == 2
