"""Starting JAX's multi-controller runtime from what the cluster provides, before any device use.

One process per host runs the same script (PyTorch/XLA's "run the same command on all hosts at the
same time"). ``start()`` runs when spmd_torch is imported and, when the job has several
processes, calls ``jax.distributed.initialize`` (a coordinator, heartbeats, one global device list)
with what it finds, first match wins:

1. spmd_torch's own variables: ``SPMD_TORCH_COORDINATOR_ADDRESS`` (host:port of process 0),
   ``SPMD_TORCH_NUM_PROCESSES`` and ``SPMD_TORCH_PROCESS_ID`` (``spmd_torch.distributed.run``
   sets them);
2. torchrun's ``MASTER_ADDR``/``MASTER_PORT``/``WORLD_SIZE``/``RANK`` with one process per host,
   which JAX does not read: the coordinator listens on ``MASTER_PORT + 1``, since torchrun's own
   store holds ``MASTER_PORT``;
3. JAX's own detection: TPU pods, SLURM, Open MPI, Kubernetes. Where SLURM or Open MPI runs one
   process per host, that process takes every local GPU instead of JAX's one per process.

Timeouts (``SPMD_TORCH_INIT_TIMEOUT_S``, ``SPMD_TORCH_HEARTBEAT_TIMEOUT_S``,
``SPMD_TORCH_SHUTDOWN_TIMEOUT_S``) default to JAX's, which suit a pod. ``SPMD_TORCH_LOOPBACK=1``
keeps the coordinator and CPU collectives (gloo) on 127.0.0.1, for jobs on one machine.
"""

from __future__ import annotations

import atexit
import errno
import multiprocessing
import os
import socket
import sys
from dataclasses import dataclass

import jax
from jax._src import clusters, distributed, xla_bridge  # the runtime's own hooks: no public API
from jax._src.lib import _jax

from spmd_torch import config

# Exit status of process 0 when the coordinator's port is taken: a launcher may retry elsewhere.
PORT_BUSY_EXIT = 75  # EX_TEMPFAIL


@dataclass(frozen=True)
class Job:
    """What ``jax.distributed.initialize`` needs; None fields are left to JAX's detection."""

    source: str  # where it came from, for errors
    coordinator: str | None
    processes: int | None
    process_id: int | None
    local_device_ids: tuple | None = None


def start() -> Job | None:
    """Join the job's other processes, if there are any; idempotent. Returns the job joined."""
    if distributed.global_state.client is not None:
        return _JOINED[0] if _JOINED else None
    if _started_by_multiprocessing():
        return None
    job = find_job()
    if job is None:
        return None
    if xla_bridge.backends_are_initialized():
        raise RuntimeError(
            f"spmd_torch: a {job.processes or 'multi'}-process job ({job.source}) must start "
            "JAX's distributed runtime before any device is used, but JAX's backends are already "
            "running: import spmd_torch before touching jax.devices() or any jax array"
        )
    if config.LOOPBACK.value:
        _collectives_on_loopback()
    if job.process_id == 0 and job.coordinator is not None:
        _check_port_free(job)
    jax.distributed.initialize(
        coordinator_address=job.coordinator,
        num_processes=job.processes,
        process_id=job.process_id,
        local_device_ids=list(job.local_device_ids) if job.local_device_ids else None,
        initialization_timeout=config.INIT_TIMEOUT_S.value,
        heartbeat_timeout_seconds=config.HEARTBEAT_TIMEOUT_S.value,
        shutdown_timeout_seconds=config.SHUTDOWN_TIMEOUT_S.value,
        coordinator_bind_address=_bind_address(job),
    )
    _JOINED.append(job)
    atexit.register(_leaving)  # after JAX's shutdown (registered by initialize): runs before it
    sys.excepthook = _failing(sys.excepthook)
    return job


_JOINED: list[Job] = []


def _started_by_multiprocessing() -> bool:
    """A process multiprocessing started (a DataLoader worker, a pool's), importing spmd_torch
    with its host's variables: it serves its host and never joins the job itself."""
    current = multiprocessing.current_process()
    return multiprocessing.parent_process() is not None or getattr(current, "_inheriting", False)


def _leaving() -> None:
    """Say so when this process ends its script: JAX's shutdown then waits for the others, and
    a process that left early is named here, not a silent wait."""
    print(
        f"{FINISHED} {jax.process_index()} of {jax.process_count()} finished its script; waiting "
        f"up to {config.SHUTDOWN_TIMEOUT_S.value} s for the other processes to finish theirs",
        file=sys.stderr,
        flush=True,
    )


FINISHED = "spmd_torch: process"  # the line's start, which the launcher looks for


def _failing(excepthook):
    """A process the script's error ends exits at once, with status 1: JAX's shutdown would make
    it wait for the other hosts (which wait for it) until the shutdown timeout, then abort."""

    def hook(kind, error, traceback) -> None:
        excepthook(kind, error, traceback)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)

    return hook


def find_job() -> Job | None:
    """The job this process belongs to, when it has more than one process (None: alone)."""
    explicit = config.COORDINATOR_ADDRESS.value
    if explicit:
        processes = config.NUM_PROCESSES.value
        process_id = config.PROCESS_ID.value
        if processes is None or process_id is None:
            raise ValueError(
                f"SPMD_TORCH_COORDINATOR_ADDRESS={explicit} needs SPMD_TORCH_NUM_PROCESSES and "
                "SPMD_TORCH_PROCESS_ID too"
            )
        return _checked(Job("SPMD_TORCH_* variables", explicit, processes, process_id))
    if _torchrun_job():
        address, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
        processes, rank = int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"])
        return _checked(Job("torchrun", f"{address}:{port + 1}", processes, rank))
    return _cluster_job()


def _torchrun_job() -> bool:
    names = ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK")
    if not all(name in os.environ for name in names) or int(os.environ["WORLD_SIZE"]) < 2:
        return False
    per_host = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    if per_host != 1:
        raise ValueError(
            f"spmd_torch runs one process per host; torchrun started {per_host} per host "
            "(LOCAL_WORLD_SIZE): pass --nproc-per-node=1, each process drives every local device"
        )
    return True


def _cluster_job() -> Job | None:
    """A cluster JAX detects by itself, with more than one process."""
    env = next(
        (
            c
            for c in clusters.ClusterEnv._cluster_types
            if not c.opt_in_only_method and c.is_env_present()
        ),
        None,
    )
    if env is None or env.get_process_count() < 2:
        return None
    return Job(env.__name__, None, None, None, _all_local_gpus(env))


def _all_local_gpus(env) -> tuple | None:
    """Every GPU of the host when the cluster runs one process per host (JAX gives each process
    the one GPU of its local rank); None: JAX decides."""
    per_host = os.environ.get("SLURM_NTASKS_PER_NODE") or os.environ.get(
        "OMPI_COMM_WORLD_LOCAL_SIZE"
    )
    if per_host != "1":
        return None
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible:
        count = len([d for d in visible.split(",") if d.strip()])
    else:
        count = sum(
            1 for name in os.listdir("/dev") if name[6:].isdigit() and name.startswith("nvidia")
        )
    return tuple(range(count)) if count > 1 else None


def _checked(job: Job) -> Job | None:
    if job.processes < 1 or not 0 <= job.process_id < job.processes:
        raise ValueError(
            f"{job.source}: process id {job.process_id} is not in [0, {job.processes}) processes"
        )
    return job if job.processes > 1 else None


def _bind_address(job: Job) -> str | None:
    if job.coordinator is None or not config.LOOPBACK.value:
        return None  # JAX's default: every interface
    return f"127.0.0.1:{job.coordinator.rsplit(':', 1)[1]}"


def _check_port_free(job: Job) -> None:
    """Process 0 hosts the coordinator: a taken port fails now, naming it, instead of crashing
    inside the runtime while the other processes wait for their initialization timeout."""
    port = int(job.coordinator.rsplit(":", 1)[1])
    host = "127.0.0.1" if config.LOOPBACK.value else ""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host, port))
        except OSError as error:
            if error.errno != errno.EADDRINUSE:
                raise
            print(
                f"spmd_torch: the coordinator's port {port} ({job.source}) is in use; "
                "start the job on another port",
                file=sys.stderr,
            )
            sys.exit(PORT_BUSY_EXIT)


def _collectives_on_loopback() -> None:
    """CPU collectives (gloo) listen on 127.0.0.1, not on whatever the host name resolves to."""

    def cpu_client():
        gloo = _jax.make_gloo_tcp_collectives(
            distributed_client=distributed.global_state.client, hostname="127.0.0.1"
        )
        return xla_bridge.make_cpu_client(collectives=gloo)

    xla_bridge.register_backend_factory("cpu", cpu_client, priority=0, fail_quietly=False)
