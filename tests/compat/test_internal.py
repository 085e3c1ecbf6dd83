"""torch_xla._internal: ``tpu`` (TPU chips, generation and slice environment, from JAX's devices and
the TPU variables) and ``pjrt`` (run_multiprocess/spawn/spawn_threads over the replicas of
xmp.spawn), against PyTorch/XLA 2.9's documented answers; this host has 8 CPU devices, no TPU."""

from __future__ import annotations

import os

import pytest
import torch

import spmd_torch.core.xla_model as xm
import spmd_torch.runtime as xr
from spmd_torch._internal import pjrt, tpu

_TPU_VARIABLES = (
    "TPU_SKIP_MDS_QUERY",
    "TPU_ACCELERATOR_TYPE",
    "TPU_PROCESS_BOUNDS",
    "TPU_HOST_BOUNDS",
    "TPU_CHIPS_PER_PROCESS_BOUNDS",
    "TPU_CHIPS_PER_HOST_BOUNDS",
    "CLOUD_TPU_TASK_ID",
    "TPU_WORKER_ID",
    "TPU_WORKER_HOSTNAMES",
    "TPU_VISIBLE_CHIPS",
    "TPU_PROCESS_ADDRESSES",
    "TPU_PROCESS_PORT",
)


@pytest.fixture
def tpu_env(monkeypatch):
    """No TPU variable set; tests set the ones they describe, and whatever the code under test
    sets is removed afterwards (setenv first, so that the undo deletes it)."""
    for name in _TPU_VARIABLES:
        monkeypatch.setenv(name, "")
        monkeypatch.delenv(name)
    return monkeypatch


class _FakeTpu:
    """A JAX TPU device as ``tpu`` reads it: platform, device kind, chip coordinates."""

    platform = "tpu"

    def __init__(self, kind: str, coords: tuple, core: int = 0):
        self.device_kind = kind
        self.coords = coords
        self.core_on_chip = core


def _v3_host() -> list:
    """A v3-8 host: 4 chips of 2 TensorCores, each core a JAX device."""
    return [_FakeTpu("TPU v3", (x, y, 0), core) for x in (0, 1) for y in (0, 1) for core in (0, 1)]


def _v4_host() -> list:
    return [_FakeTpu("TPU v4", (x, y, 0)) for x in (0, 1) for y in (0, 1)]


# --- tpu: off TPU --------------------------------------------------------------------------------


def test_no_tpu_chips_or_devices_on_a_cpu_host(tpu_env):
    assert tpu.num_available_chips() == 0
    assert tpu.num_available_devices() == 0
    assert tpu.num_local_processes() == 0


def test_version_without_tpu_raises_oserror(tpu_env):
    tpu_env.setenv("TPU_SKIP_MDS_QUERY", "1")
    with pytest.raises(OSError, match="Failed to parse TPU version.*JAX sees no TPU device"):
        tpu.version()


def test_metadata_server_unreachable_raises_oserror_naming_the_key(tpu_env):
    tpu_env.setattr(tpu, "_METADATA_ROOT_URL", "http://127.0.0.1:9/computeMetadata/v1")
    with pytest.raises(OSError, match="Failed to get TPU metadata 'tpu-env'.*TPU_SKIP_MDS_QUERY"):
        tpu.get_tpu_env()


def test_worker_id_without_one_raises_oserror(tpu_env):
    tpu_env.setenv("TPU_SKIP_MDS_QUERY", "1")
    with pytest.raises(OSError, match="names no worker.*TPU_WORKER_ID"):
        tpu.worker_id()


# --- tpu: chips, devices, processes (JAX's devices faked as a TPU host's) ------------------------


def test_v3_host_has_four_chips_of_two_devices(tpu_env):
    tpu_env.setattr(tpu, "_tpu_devices", _v3_host)
    assert tpu.num_available_chips() == 4
    assert tpu.version() == 3
    assert tpu.num_logical_cores_per_chip() == 2
    assert tpu.num_available_devices() == 8


def test_v4_host_has_four_chips_of_one_device(tpu_env):
    tpu_env.setattr(tpu, "_tpu_devices", _v4_host)
    assert tpu.num_available_chips() == 4
    assert tpu.version() == 4
    assert tpu.num_available_devices() == 4


@pytest.mark.parametrize(
    "kind, expected",
    [("TPU v2", 2), ("TPU v4 lite", 4), ("TPU v5 lite", 5), ("TPU v5p", 5), ("TPU v6 lite", 6),
     ("TPU7x", 7)],
)  # fmt: skip
def test_version_from_jax_device_kind(tpu_env, kind, expected):
    tpu_env.setattr(tpu, "_tpu_devices", lambda: [_FakeTpu(kind, (0, 0, 0))])
    assert tpu.version() == expected


@pytest.mark.parametrize(
    "version, chips, expected", [(2, 4, 8), (3, 4, 8), (4, 4, 4), (4, 1, 1), (5, 0, 0)]
)
def test_num_available_devices_is_chips_times_cores_per_chip(tpu_env, version, chips, expected):
    tpu_env.setattr(tpu, "version", lambda: version)
    tpu_env.setattr(tpu, "num_available_chips", lambda: chips)
    assert tpu.num_available_devices() == expected


@pytest.mark.parametrize(
    "bounds, expected", [(None, None), ("1,1,1", 1), ("2,2,1", 4), ("2,2,2", 8), ("2,2,4", 16)]
)
def test_process_bounds_size(tpu_env, bounds, expected):
    if bounds:
        tpu_env.setenv("TPU_PROCESS_BOUNDS", bounds)
    assert tpu.process_bounds_size() == expected


@pytest.mark.parametrize(
    "bounds, chips, expected",
    [(None, 4, 4), ("1,1,1", 4, 1), ("2,2,1", 4, 4), ("2,2,2", 4, 4), (None, 1, 1)],
)
def test_num_local_processes_is_local_chips_within_process_bounds(tpu_env, bounds, chips, expected):
    if bounds:
        tpu_env.setenv("TPU_PROCESS_BOUNDS", bounds)
    tpu_env.setattr(tpu, "num_available_chips", lambda: chips)
    assert tpu.num_local_processes() == expected


def test_mesh_shape_rejects_other_lengths():
    assert tpu.MeshShape.from_string("2,2,1") * (1, 1, 2) == (2, 2, 2)
    with pytest.raises(ValueError, match="'2,2' should be length 3"):
        tpu.MeshShape.from_string("2,2")


# --- tpu: the slice's environment ----------------------------------------------------------------


@pytest.mark.parametrize("value, expected", [(None, None), ("0", 0), ("15", 15)])
def test_task_id(tpu_env, value, expected):
    if value is not None:
        tpu_env.setenv("CLOUD_TPU_TASK_ID", value)
    assert tpu.task_id() == expected


def test_tpu_env_from_variables_prefers_process_over_host_bounds(tpu_env):
    for name, value in {
        "TPU_SKIP_MDS_QUERY": "1",
        "TPU_ACCELERATOR_TYPE": "v4-16",
        "TPU_PROCESS_BOUNDS": "1,2,2",
        "TPU_HOST_BOUNDS": "1,1,2",
        "TPU_CHIPS_PER_PROCESS_BOUNDS": "2,2,1",
        "TPU_CHIPS_PER_HOST_BOUNDS": "2,1,1",
        "CLOUD_TPU_TASK_ID": "1",
        "TPU_WORKER_ID": "0",
    }.items():
        tpu_env.setenv(name, value)
    assert tpu.get_tpu_env() == {
        "ACCELERATOR_TYPE": "v4-16",
        "TPU_CHIPS_PER_PROCESS_BOUNDS": "2,2,1",
        "TPU_PROCESS_BOUNDS": "1,2,2",
        "WORKER_ID": "1",
    }
    assert tpu.worker_id() == 1
    assert tpu.version() == 4


def test_tpu_env_from_variables_falls_back_to_host_bounds(tpu_env):
    for name, value in {
        "TPU_SKIP_MDS_QUERY": "1",
        "TPU_ACCELERATOR_TYPE": "v5litepod-8",
        "TPU_HOST_BOUNDS": "1,1,2",
        "TPU_CHIPS_PER_HOST_BOUNDS": "2,1,1",
        "TPU_WORKER_ID": "0",
    }.items():
        tpu_env.setenv(name, value)
    assert tpu.get_tpu_env() == {
        "ACCELERATOR_TYPE": "v5litepod-8",
        "TPU_CHIPS_PER_PROCESS_BOUNDS": "2,1,1",
        "TPU_PROCESS_BOUNDS": "1,1,2",
        "WORKER_ID": "0",
    }
    assert tpu.version() == 5
    assert tpu.get_tpu_type() == "v5litepod"


def test_tpu_env_from_metadata(tpu_env):
    metadata = "ACCELERATOR_TYPE: 'v6e-16'\nTPU_PROCESS_BOUNDS: '1,1,2'\nWORKER_ID: '1'\n"
    tpu_env.setattr(tpu, "_get_metadata", lambda key: {"tpu-env": metadata}[key])
    assert tpu.get_tpu_env() == {
        "ACCELERATOR_TYPE": "v6e-16",
        "TPU_PROCESS_BOUNDS": "1,1,2",
        "WORKER_ID": "1",
    }
    assert tpu.version() == 6
    assert tpu.get_tpu_type() == "v6e"
    assert tpu.worker_id() == 1


def test_worker_ips_from_variables(tpu_env):
    tpu_env.setenv("TPU_SKIP_MDS_QUERY", "1")
    tpu_env.setenv("TPU_WORKER_HOSTNAMES", "w0,w1,w2")
    assert tpu.get_worker_ips() == ["w0", "w1", "w2"]
    assert tpu.num_tpu_workers() == 3
    tpu_env.setenv("TPU_WORKER_HOSTNAMES", "w0")
    assert tpu.get_worker_ips() == ["localhost"]


def test_worker_ips_from_metadata_in_worker_order(tpu_env):
    endpoints = "w-0:123:10.1.0.26,w-1:124:10.1.0.27,w-2:125:10.1.0.25"
    tpu_env.setattr(tpu, "_get_metadata", lambda key: {"worker-network-endpoints": endpoints}[key])
    assert tpu.get_worker_ips() == ["10.1.0.26", "10.1.0.27", "10.1.0.25"]
    assert tpu.num_tpu_workers() == 3


def test_expected_global_devices_is_local_devices_times_workers(tpu_env):
    tpu_env.setattr(tpu, "_tpu_devices", _v4_host)
    tpu_env.setenv("TPU_SKIP_MDS_QUERY", "1")
    tpu_env.setenv("TPU_WORKER_HOSTNAMES", "w0,w1")
    assert tpu.num_expected_global_devices() == 8


def test_configure_topology_second_worker_first_process(tpu_env):
    env = {
        "ACCELERATOR_TYPE": "v4-16",
        "TPU_PROCESS_BOUNDS": "1,1,2",
        "TPU_CHIPS_PER_PROCESS_BOUNDS": "2,2,1",
        "WORKER_ID": "1",
    }
    tpu_env.setattr(tpu, "get_tpu_env", lambda: env)
    tpu_env.setattr(tpu, "get_worker_ips", lambda: ["10.0.0.1", "10.0.0.2"])
    tpu.configure_topology(local_rank=0, local_world_size=4)
    expected = {
        "TPU_PROCESS_BOUNDS": "2,2,2",
        "TPU_CHIPS_PER_PROCESS_BOUNDS": "1,1,1",
        "CLOUD_TPU_TASK_ID": "4",
        "TPU_VISIBLE_CHIPS": "0",
        "TPU_PROCESS_ADDRESSES": ",".join(
            f"{ip}:{port}" for ip in ("10.0.0.1", "10.0.0.2") for port in range(8476, 8480)
        ),
        "TPU_PROCESS_PORT": "8476",
    }
    assert {name: os.environ.get(name) for name in expected} == expected


def test_configure_topology_v3_uses_the_known_host_bounds(tpu_env):
    env = {"ACCELERATOR_TYPE": "v3-8", "WORKER_ID": "0"}
    tpu_env.setattr(tpu, "get_tpu_env", lambda: env)
    tpu_env.setattr(tpu, "get_worker_ips", lambda: ["localhost"])
    tpu.configure_topology(local_rank=3, local_world_size=4)
    assert os.environ["TPU_PROCESS_BOUNDS"] == "2,2,1"
    assert os.environ["CLOUD_TPU_TASK_ID"] == "3"
    assert os.environ["TPU_VISIBLE_CHIPS"] == "3"
    assert os.environ["TPU_PROCESS_PORT"] == "8479"


def test_configure_one_chip_topology_keeps_variables_already_set(tpu_env):
    tpu_env.setenv("TPU_VISIBLE_CHIPS", "2")
    tpu.configure_one_chip_topology()
    assert os.environ["TPU_VISIBLE_CHIPS"] == "2"
    assert os.environ["TPU_PROCESS_BOUNDS"] == "1,1,1"
    assert os.environ["TPU_CHIPS_PER_PROCESS_BOUNDS"] == "1,1,1"


# --- pjrt ----------------------------------------------------------------------------------------


def test_run_multiprocess_returns_each_replicas_result_by_ordinal():
    assert pjrt.run_multiprocess(xr.global_ordinal) == {k: k for k in range(8)}
    assert pjrt.run_multiprocess(xr.world_size) == {k: 8 for k in range(8)}


def _tag(base: list, scale: int = 1) -> tuple:
    base.append(xr.global_ordinal())  # each replica's own copy: nothing accumulates
    return tuple(base), scale * xr.global_ordinal()


def test_run_multiprocess_passes_copies_of_args_and_kwargs():
    shared = [-1]
    results = pjrt.run_multiprocess(_tag, shared, scale=10)
    assert results == {k: ((-1, k), 10 * k) for k in range(8)}
    assert shared == [-1]


def _reduced_ordinal() -> float:
    value = torch.tensor([float(xr.global_ordinal())], device=xm.xla_device())
    return xm.all_reduce(xm.REDUCE_SUM, value).item()


def test_run_multiprocess_replicas_reduce_together():
    assert pjrt.run_multiprocess(_reduced_ordinal) == {k: 28.0 for k in range(8)}


def _fail_on_three() -> int:
    if xr.global_ordinal() == 3:
        raise KeyError("replica three")
    return 0


def test_run_multiprocess_raises_the_failing_replicas_error():
    with pytest.raises(KeyError, match="replica three") as info:
        pjrt.run_multiprocess(_fail_on_three)
    assert "(raised by replica 3 of 8 in launch/spawn)" in info.value.__notes__


def test_run_multiprocess_refuses_spmd_mode():
    xr.use_spmd()
    try:
        with pytest.raises(RuntimeError, match="Runtime is already initialized"):
            pjrt.run_multiprocess(xr.global_ordinal)
    finally:
        xr.reset()


def test_spawn_calls_fn_with_each_index_and_returns_none():
    seen = {}
    assert pjrt.spawn(lambda index, base: seen.setdefault(index, base + index), args=(100,)) is None
    assert seen == {k: 100 + k for k in range(8)}


def test_spawn_one_process_returns_fns_result():
    assert pjrt.spawn(lambda index: ("only", index, xr.world_size()), nprocs=1) == ("only", 0, 1)


def test_spawn_refuses_other_process_counts():
    with pytest.raises(ValueError, match=r"unsupported nprocs \(4\).*nprocs=1 or None"):
        pjrt.spawn(lambda index: None, nprocs=4)


def test_spawn_threads_runs_one_thread_per_device():
    devices = {}
    pjrt.spawn_threads(lambda index: devices.setdefault(index, str(xm.xla_device())))
    assert devices == {k: "xla:0" for k in range(8)}
