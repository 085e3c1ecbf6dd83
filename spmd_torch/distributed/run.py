"""A local launcher: a job of several processes ("hosts") on this machine, for development and tests.

``python -m spmd_torch.distributed.run --hosts 2 --devices-per-host 4 train.py --lr 0.1`` (or the
``spmd-torch-run`` console script) starts one process per host, each with its own virtual CPU
devices, wired to a coordinator on 127.0.0.1 at a free port, exactly as a pod runs the same
command on every host. Each line a host prints comes out prefixed with ``[host i]``. The job ends
as soon as any host fails: the launcher names the host and its exit status, stops the others and
exits with that status. A coordinator port taken in the meantime restarts the job on another.
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import threading
import time

from spmd_torch._multihost import FINISHED, PORT_BUSY_EXIT

_POLL_S = 0.05
_RELAY_GRACE_S = 5.0  # how long the hosts' last lines may take to come out after they end
_PORT_TRIES = 3


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    for attempt in range(_PORT_TRIES):
        status = _run_job(args, _free_port())
        if status != PORT_BUSY_EXIT or attempt == _PORT_TRIES - 1:
            return status
        _say("the coordinator's port was taken; starting the job again on another port")
    return status


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m spmd_torch.distributed.run",
        description="Run a script as a job of several processes (hosts) on this machine, each "
        "with its own virtual CPU devices, as the same command runs on every host of a pod.",
    )
    parser.add_argument("--hosts", type=int, required=True, help="processes to start")
    parser.add_argument("--devices-per-host", type=int, default=4, help="CPU devices each")
    parser.add_argument("--heartbeat-timeout", type=int, help="seconds (SPMD_TORCH_*)")
    parser.add_argument("--init-timeout", type=int, help="seconds (SPMD_TORCH_*)")
    parser.add_argument("--shutdown-timeout", type=int, help="seconds (SPMD_TORCH_*)")
    parser.add_argument("script", help="the Python script every host runs")
    parser.add_argument("script_args", nargs=argparse.REMAINDER, help="its arguments")
    return parser


def _run_job(args: argparse.Namespace, port: int) -> int:
    hosts = [
        subprocess.Popen(
            [sys.executable, args.script, *args.script_args],
            env=_host_env(args, port, host),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # the job's signals reach the host and its children alone
        )
        for host in range(args.hosts)
    ]
    finished: dict = {}  # host -> seconds into the job when its script ended
    started = time.monotonic()
    printers = [
        threading.Thread(target=_relay, args=(host, process.stdout, finished, started), daemon=True)
        for host, process in enumerate(hosts)
    ]
    for printer in printers:
        printer.start()
    forward = _forward_signals(hosts)
    try:
        status = _watch(hosts, finished)
    finally:
        _stop(hosts)
        for printer in printers:
            printer.join(timeout=_RELAY_GRACE_S)
        forward()
    return status


def _host_env(args: argparse.Namespace, port: int, host: int) -> dict[str, str]:
    env = dict(os.environ)
    flags = [f for f in env.get("XLA_FLAGS", "").split() if "host_platform_device_count" not in f]
    flags.append(f"--xla_force_host_platform_device_count={args.devices_per_host}")
    env.update(
        XLA_FLAGS=" ".join(flags),
        JAX_PLATFORMS="cpu",
        PYTHONUNBUFFERED="1",
        SPMD_TORCH_COORDINATOR_ADDRESS=f"127.0.0.1:{port}",
        SPMD_TORCH_NUM_PROCESSES=str(args.hosts),
        SPMD_TORCH_PROCESS_ID=str(host),
        SPMD_TORCH_LOOPBACK="1",
    )
    timeouts = {
        "SPMD_TORCH_HEARTBEAT_TIMEOUT_S": args.heartbeat_timeout,
        "SPMD_TORCH_INIT_TIMEOUT_S": args.init_timeout,
        "SPMD_TORCH_SHUTDOWN_TIMEOUT_S": args.shutdown_timeout,
    }
    env.update({name: str(value) for name, value in timeouts.items() if value is not None})
    return env


def _watch(hosts: list[subprocess.Popen], finished: dict) -> int:
    """Wait for every host; the first that fails ends the job, named, with the hosts that are
    stopped (SIGSTOP) or had ended their script early, the usual causes of the others' failure."""
    while True:
        statuses = [process.poll() for process in hosts]
        failed = [(h, s) for h, s in enumerate(statuses) if s not in (None, 0)]
        if failed:
            host, status = _cause(failed)
            if status == PORT_BUSY_EXIT and host == 0:
                return status
            notes = [f"host {h} is stopped" for h, p in enumerate(hosts) if _stopped(p)]
            notes += [
                f"host {h} ended its script at {t:.1f} s" for h, t in sorted(finished.items())
            ]
            also = f" ({'; '.join(notes)})" if notes else ""
            _say(f"host {host} exited with {_describe(status)}{also}; stopping the other hosts")
            return status if status > 0 else 128 - status
        if all(status == 0 for status in statuses):
            return 0
        time.sleep(_POLL_S)


def _cause(failed: list[tuple[int, int]]) -> tuple[int, int]:
    """The failure that caused the others, among (host, status) pairs seen at one look: a host
    that losing a peer brings down (JAX's runtime aborts, SIGABRT, when a collective or its
    coordination service loses one, within milliseconds) comes after a host that failed
    otherwise."""
    return min(failed, key=lambda pair: (pair[1] == -signal.SIGABRT, pair[0]))


def _stopped(process: subprocess.Popen) -> bool:
    """Whether the process is stopped (state T in /proc; False where there is no /proc)."""
    try:
        with open(f"/proc/{process.pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] in ("T", "t")
    except (OSError, IndexError):
        return False


def _describe(status: int) -> str:
    if status < 0:
        return f"signal {signal.Signals(-status).name}"
    return f"status {status}"


def _stop(hosts: list[subprocess.Popen]) -> None:
    """SIGKILL the hosts still running once one failed: the job is over, they would wait for the
    failed one (in a collective, or at exit), and JAX takes a SIGTERM as a preemption notice."""
    for process in hosts:
        if process.poll() is None:
            _signal_group(process, signal.SIGKILL)
            process.wait()


def _signal_group(process: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(process.pid, sig)
    except ProcessLookupError:
        pass


def _forward_signals(hosts: list[subprocess.Popen]):
    """SIGTERM and SIGINT to the launcher go to every host (a preempted job); returns the undo."""
    if threading.current_thread() is not threading.main_thread():
        return lambda: None

    def forward(sig, frame):
        for process in hosts:
            if process.poll() is None:
                _signal_group(process, sig)

    previous = {sig: signal.signal(sig, forward) for sig in (signal.SIGTERM, signal.SIGINT)}
    return lambda: [signal.signal(sig, handler) for sig, handler in previous.items()]


def _relay(host: int, stream, finished: dict, started: float) -> None:
    for line in iter(stream.readline, b""):
        text = line.decode(errors="replace").rstrip("\n")
        if text.startswith(FINISHED):
            finished.setdefault(host, time.monotonic() - started)
        with _PRINT_LOCK:
            print(f"[host {host}] {text}", flush=True)
    stream.close()


_PRINT_LOCK = threading.Lock()


def _say(text: str) -> None:
    with _PRINT_LOCK:
        print(f"spmd_torch.distributed.run: {text}", file=sys.stderr, flush=True)


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


if __name__ == "__main__":
    sys.exit(main())
