"""torch_xla._internal.tpu: what TPU hardware this host has, and the TPU slice's environment.

Chips and cores are counted from JAX's devices (``platform == 'tpu'``), so a host without TPUs, or
a run that keeps JAX off them (``JAX_PLATFORMS=cpu``), has 0 chips and 0 devices: Lightning's
``XLAAccelerator`` calls :func:`num_available_devices` to decide whether XLA is usable. The TPU
generation comes from JAX's device kind. The slice's description (accelerator type, worker id,
process bounds, worker addresses) comes, as in PyTorch/XLA, from the TPU environment variables
when ``TPU_SKIP_MDS_QUERY`` is set, else from the GCE metadata server of a TPU VM; with neither
(any host that is not a TPU VM) those functions raise ``OSError``, as PyTorch/XLA's do. JAX
itself sets ``TPU_SKIP_MDS_QUERY=1`` when it finds no TPU chip, so on such a host the variables
answer: :func:`version` raises ``OSError`` and :func:`get_worker_ips` is ``['localhost']``.
"""

from __future__ import annotations

import functools
import operator
import os
import re
import urllib.request
from typing import NamedTuple

import jax

from spmd_torch.core import xla_env_vars as xenv

__all__ = [
    "MeshShape",
    "build_tpu_env_from_vars",
    "configure_one_chip_topology",
    "configure_topology",
    "get_tpu_env",
    "get_tpu_type",
    "get_worker_ips",
    "num_available_chips",
    "num_available_devices",
    "num_expected_global_devices",
    "num_local_processes",
    "num_logical_cores_per_chip",
    "num_tpu_workers",
    "process_bounds_size",
    "task_id",
    "version",
    "worker_id",
]

_METADATA_ROOT_URL = "http://metadata.google.internal/computeMetadata/v1"
_METADATA_TIMEOUT_S = 5.0
# Host bounds of the TPU v2/v3 slices, whose metadata does not carry them.
_ACCELERATOR_TYPE_TO_HOST_BOUNDS = {
    "v2-8": "1,1,1",
    "v2-32": "2,2,1",
    "v2-128": "4,4,1",
    "v2-256": "4,8,1",
    "v2-512": "8,8,1",
    "v3-8": "1,1,1",
    "v3-32": "2,2,1",
    "v3-64": "2,4,1",
    "v3-128": "4,4,1",
    "v3-256": "4,8,1",
    "v3-512": "8,8,1",
    "v3-1024": "8,16,1",
    "v3-2048": "16,16,1",
}
_ACCELERATOR_VERSION = re.compile(r"^(?:v|tpu)(\d+)[a-z]*-\d+$", re.IGNORECASE)
_DEVICE_KIND_VERSION = re.compile(r"^TPU\s*v?(\d+)", re.IGNORECASE)


class MeshShape(NamedTuple):
    """A TPU mesh shape ``(x, y, z)``, as the bound variables write it (``'2,2,1'``).

    Example:
        >>> MeshShape.from_string('2,2,1').size
        4
    """

    x: int
    y: int
    z: int

    @classmethod
    def from_string(cls, mesh: str) -> MeshShape:
        """Parse ``'x,y,z'``; raises ValueError for any other number of dimensions."""
        dims = tuple(int(d) for d in mesh.split(","))
        if len(dims) != 3:
            raise ValueError(f"Mesh shape {mesh!r} should be length 3")
        return cls(*dims)

    @property
    def size(self) -> int:
        """The number of elements of the mesh."""
        return functools.reduce(operator.mul, self)

    def __mul__(self, other: tuple) -> MeshShape:  # type: ignore[override]
        return MeshShape(*(a * b for a, b in zip(self, other)))


def _tpu_devices() -> list:
    """This process's TPU devices as JAX sees them (none off TPU)."""
    return [d for d in jax.local_devices() if d.platform == "tpu"]


def _env(name: str) -> str | None:
    return os.environ.get(name) or None


def process_bounds_size() -> int | None:
    """The number of processes across all TPU hosts that ``TPU_PROCESS_BOUNDS`` describes.

    Returns:
        The product of the bounds, or None when the variable is not set.

    Example:
        >>> os.environ['TPU_PROCESS_BOUNDS'] = '2,2,1'
        >>> tpu.process_bounds_size()
        4
    """
    bounds = _env(xenv.TPU_PROCESS_BOUNDS)
    return MeshShape.from_string(bounds).size if bounds else None


def num_available_chips() -> int:
    """The number of TPU chips attached to this host, as JAX sees them.

    On TPU v2/v3 a chip holds two JAX devices (TensorCores); they count once. Any host without
    TPUs (or a run with ``JAX_PLATFORMS`` keeping JAX off them) has 0.

    Example:
        >>> tpu.num_available_chips()  # on a CPU or GPU host
        0
    """
    devices = _tpu_devices()
    if all(hasattr(d, "coords") for d in devices):
        return len({tuple(d.coords) for d in devices})
    return len(devices)


def num_logical_cores_per_chip() -> int:
    """The number of XLA devices per TPU chip: 2 on TPU v2 and v3, 1 from v4 on.

    Raises:
        OSError: There is no TPU (see :func:`version`).

    Example:
        >>> tpu.num_logical_cores_per_chip()  # on a TPU v4 host
        1
    """
    return 2 if version() <= 3 else 1


def num_available_devices() -> int:
    """The number of TPU devices (cores JAX addresses) on this host; 0 without TPUs.

    Libraries call it to decide whether an XLA accelerator is present (Lightning's
    ``XLAAccelerator.is_available``).

    Example:
        >>> tpu.num_available_devices()  # on a CPU or GPU host
        0
    """
    chips = num_available_chips()
    return chips * num_logical_cores_per_chip() if chips else 0


def num_expected_global_devices() -> int:
    """The number of TPU devices in the slice: this host's times the number of TPU workers.

    Raises:
        OSError: The worker addresses are unknown (see :func:`get_worker_ips`).

    Example:
        >>> tpu.num_expected_global_devices()  # on a v4-16 slice (2 hosts of 4 chips)
        8
    """
    return num_available_devices() * num_tpu_workers()


def num_local_processes() -> int:
    """How many processes per-chip launchers start on this host: one per local chip, no more
    than ``TPU_PROCESS_BOUNDS`` allows.

    Example:
        >>> tpu.num_local_processes()  # on a CPU host
        0
    """
    chips = num_available_chips()
    total = process_bounds_size()
    return min(chips, total) if total else chips


def task_id() -> int | None:
    """This process's index among all TPU worker processes (``CLOUD_TPU_TASK_ID``), if set.

    Example:
        >>> tpu.task_id()  # not set
    """
    value = _env(xenv.CLOUD_TPU_TASK_ID)
    return int(value) if value is not None else None


def worker_id() -> int:
    """The index of this TPU worker (host) in its slice, from the TPU environment.

    Raises:
        OSError: The TPU environment names no worker (no TPU VM metadata, no
            ``TPU_WORKER_ID`` / ``CLOUD_TPU_TASK_ID``).

    Example:
        >>> os.environ.update(TPU_SKIP_MDS_QUERY='1', TPU_WORKER_ID='1')
        >>> tpu.worker_id()
        1
    """
    worker = get_tpu_env().get(xenv.WORKER_ID)
    if worker is None:
        raise OSError(
            f"worker_id: the TPU environment names no worker (set {xenv.TPU_WORKER_ID} or "
            f"{xenv.CLOUD_TPU_TASK_ID}, with {xenv.TPU_SKIP_MDS_QUERY}=1, off a TPU VM)"
        )
    return int(worker)


def build_tpu_env_from_vars() -> dict[str, str | None]:
    """The TPU environment from variables instead of metadata (GKE and other non-VM hosts).

    ``TPU_ACCELERATOR_TYPE``; ``TPU_PROCESS_BOUNDS`` (else ``TPU_HOST_BOUNDS``);
    ``TPU_CHIPS_PER_PROCESS_BOUNDS`` (else ``TPU_CHIPS_PER_HOST_BOUNDS``); the worker id from
    ``CLOUD_TPU_TASK_ID`` (else ``TPU_WORKER_ID``). A missing variable gives None.

    Example:
        >>> os.environ.update(TPU_ACCELERATOR_TYPE='v4-16', TPU_WORKER_ID='0')
        >>> tpu.build_tpu_env_from_vars()['ACCELERATOR_TYPE']
        'v4-16'
    """
    return {
        xenv.ACCELERATOR_TYPE: _env(xenv.TPU_ACCELERATOR_TYPE),
        xenv.TPU_PROCESS_BOUNDS: _env(xenv.TPU_PROCESS_BOUNDS) or _env(xenv.TPU_HOST_BOUNDS),
        xenv.TPU_CHIPS_PER_PROCESS_BOUNDS: (
            _env(xenv.TPU_CHIPS_PER_PROCESS_BOUNDS) or _env(xenv.TPU_CHIPS_PER_HOST_BOUNDS)
        ),
        xenv.WORKER_ID: _env(xenv.CLOUD_TPU_TASK_ID) or _env(xenv.TPU_WORKER_ID),
    }


def _get_metadata(key: str) -> str:
    """One attribute of this VM's GCE metadata (TPU VMs carry the slice's description there)."""
    url = f"{_METADATA_ROOT_URL}/instance/attributes/{key}"
    request = urllib.request.Request(url, headers={"Metadata-Flavor": "Google"})
    try:
        with urllib.request.urlopen(request, timeout=_METADATA_TIMEOUT_S) as response:
            return response.read().decode()
    except OSError as error:  # URLError, timeouts
        raise OSError(
            f"Failed to get TPU metadata {key!r} from {url} ({error}): this is not a TPU VM; "
            f"set {xenv.TPU_SKIP_MDS_QUERY}=1 and the TPU_* variables to describe the slice"
        ) from error


def _parse_flat_yaml(text: str) -> dict[str, str]:
    """The ``KEY: 'value'`` lines of the tpu-env metadata as a dict of strings."""
    env = {}
    for line in text.splitlines():
        key, sep, value = line.partition(":")
        if sep and key.strip() and not key.lstrip().startswith("#"):
            env[key.strip()] = value.strip().strip("'\"")
    return env


def get_tpu_env() -> dict[str, str | None]:
    """The TPU slice's description: ``ACCELERATOR_TYPE``, bounds, ``WORKER_ID``...

    From the variables (:func:`build_tpu_env_from_vars`) when ``TPU_SKIP_MDS_QUERY`` is set,
    else from the ``tpu-env`` attribute of the TPU VM's metadata.

    Raises:
        OSError: Not on a TPU VM and ``TPU_SKIP_MDS_QUERY`` is not set.

    Example:
        >>> os.environ.update(TPU_SKIP_MDS_QUERY='1', TPU_ACCELERATOR_TYPE='v5litepod-8')
        >>> tpu.get_tpu_env()['ACCELERATOR_TYPE']
        'v5litepod-8'
    """
    if _env(xenv.TPU_SKIP_MDS_QUERY):
        return build_tpu_env_from_vars()
    return _parse_flat_yaml(_get_metadata("tpu-env"))


def version() -> int:
    """The TPU generation: 2, 3, 4, 5, 6, 7...

    From JAX's device kind (``'TPU v4'``, ``'TPU v5 lite'``) when JAX runs on TPUs, else from the
    accelerator type of the TPU environment (``'v5litepod-16'`` is 5).

    Raises:
        OSError: There is no TPU: JAX sees none and the TPU environment is unavailable
            or names no TPU type (PyTorch/XLA raises an ``OSError`` there too).

    Example:
        >>> tpu.version()  # on a TPU v4 host
        4
    """
    devices = _tpu_devices()
    if devices:
        match = _DEVICE_KIND_VERSION.match(devices[0].device_kind)
        if match:
            return int(match.group(1))
    accelerator = get_tpu_env().get(xenv.ACCELERATOR_TYPE)
    match = _ACCELERATOR_VERSION.match(accelerator or "")
    if not match:
        raise OSError(
            f"Failed to parse TPU version from accelerator type {accelerator!r}: JAX sees no "
            f"TPU device and the TPU environment names no TPU type ({xenv.TPU_ACCELERATOR_TYPE})"
        )
    return int(match.group(1))


def get_tpu_type() -> str:
    """The TPU type of the slice's accelerator type: ``'v6e-8'`` gives ``'v6e'``.

    Raises:
        OSError: Not on a TPU VM and ``TPU_SKIP_MDS_QUERY`` is not set.

    Example:
        >>> os.environ.update(TPU_SKIP_MDS_QUERY='1', TPU_ACCELERATOR_TYPE='v6e-8')
        >>> tpu.get_tpu_type()
        'v6e'
    """
    accelerator = get_tpu_env().get(xenv.ACCELERATOR_TYPE) or ""
    return accelerator.split("-")[0] if "-" in accelerator else accelerator


def get_worker_ips() -> list[str]:
    """The addresses of the slice's TPU workers, in worker order; ``['localhost']`` for one.

    From ``TPU_WORKER_HOSTNAMES`` (comma-separated) when ``TPU_SKIP_MDS_QUERY`` is set, else
    from the ``worker-network-endpoints`` metadata (``host:uid:ip,...``). A single-process job
    that JAX runs on TPUs without metadata is one worker, ``['localhost']``.

    Raises:
        OSError: No TPU environment (not on a TPU VM, no ``TPU_SKIP_MDS_QUERY``).

    Example:
        >>> os.environ.update(TPU_SKIP_MDS_QUERY='1', TPU_WORKER_HOSTNAMES='w0,w1')
        >>> tpu.get_worker_ips()
        ['w0', 'w1']
    """
    if _env(xenv.TPU_SKIP_MDS_QUERY):
        hostnames = (_env(xenv.TPU_WORKER_HOSTNAMES) or "").split(",")
    else:
        try:
            endpoints = _get_metadata("worker-network-endpoints")
        except OSError:
            if _tpu_devices() and jax.process_count() == 1:
                return ["localhost"]
            raise
        hostnames = [worker.split(":")[2] for worker in endpoints.split(",")]
    return hostnames if len(hostnames) > 1 else ["localhost"]


def num_tpu_workers() -> int:
    """The number of TPU workers (hosts) of the slice (see :func:`get_worker_ips`).

    Example:
        >>> tpu.num_tpu_workers()  # on a single-host TPU VM
        1
    """
    return len(get_worker_ips())


def configure_one_chip_topology() -> None:
    """Set the TPU variables for one process on one chip (those not set already).

    ``TPU_VISIBLE_CHIPS=0``, ``TPU_CHIPS_PER_PROCESS_BOUNDS=1,1,1``, ``TPU_PROCESS_BOUNDS=1,1,1``.
    libtpu reads them when JAX starts its TPU backend: call it before any device is used.

    Example:
        >>> tpu.configure_one_chip_topology()
        >>> os.environ['TPU_VISIBLE_CHIPS']
        '0'
    """
    os.environ.setdefault(xenv.TPU_VISIBLE_CHIPS, "0")
    os.environ.setdefault(xenv.TPU_CHIPS_PER_PROCESS_BOUNDS, "1,1,1")
    os.environ.setdefault(xenv.TPU_PROCESS_BOUNDS, "1,1,1")


def configure_topology(local_rank: int, local_world_size: int, base_port: int = 8476) -> None:
    """Set the TPU variables for one process per chip (those not set already), from the slice's
    TPU environment: process bounds of one chip each, this process's task id, visible chip,
    port, and every process's address.

    libtpu reads them when JAX starts its TPU backend: call it before any device is used.

    Args:
        local_rank: This process's rank on its host.
        local_world_size: The number of processes on each host.
        base_port: The first of the ``local_world_size`` consecutive ports each host uses.

    Raises:
        OSError: No TPU environment (see :func:`get_tpu_env`).

    Example:
        >>> tpu.configure_topology(local_rank=1, local_world_size=4)  # on a v4-8 VM
        >>> os.environ['TPU_VISIBLE_CHIPS'], os.environ['TPU_PROCESS_PORT']
        ('1', '8477')
    """
    env = get_tpu_env()
    generation = version()
    if generation >= 4:
        host_bounds = MeshShape.from_string(env[xenv.TPU_PROCESS_BOUNDS])
        chips_per_host = MeshShape.from_string(env[xenv.TPU_CHIPS_PER_PROCESS_BOUNDS])
    else:
        host_bounds = MeshShape.from_string(
            _ACCELERATOR_TYPE_TO_HOST_BOUNDS[env[xenv.ACCELERATOR_TYPE]]
        )
        chips_per_host = MeshShape(2, 2, 1)
    process_bounds = ",".join(str(d) for d in host_bounds * chips_per_host)
    if generation == 7:
        process_bounds += ",2"  # TPU 7x bounds carry a fourth dimension, as PyTorch/XLA writes
    os.environ.setdefault(xenv.TPU_CHIPS_PER_PROCESS_BOUNDS, "1,1,1")
    os.environ.setdefault(xenv.TPU_PROCESS_BOUNDS, process_bounds)
    worker = int(env[xenv.WORKER_ID])
    os.environ.setdefault(xenv.CLOUD_TPU_TASK_ID, str(worker * local_world_size + local_rank))
    ports = [base_port + k for k in range(local_world_size)]
    addresses = [f"{ip}:{port}" for ip in get_worker_ips() for port in ports]
    os.environ.setdefault(xenv.TPU_PROCESS_ADDRESSES, ",".join(addresses))
    os.environ.setdefault(xenv.TPU_VISIBLE_CHIPS, str(local_rank))
    os.environ.setdefault(xenv.TPU_PROCESS_PORT, str(ports[local_rank]))
