"""torch_xla.core.xla_env_vars: the names of PyTorch/XLA's environment variables, one constant each.

Scripts and launchers read or set these through the constants (``os.environ[xenv.PJRT_DEVICE]``),
so the names exist here with PyTorch/XLA's strings. Of them, spmd_torch itself reads
``PJRT_DEVICE`` (written by :func:`spmd_torch.runtime.set_device_type`); the others name settings
of PyTorch/XLA's own runtime (XRT workers, TPU topology, PJRT client options) that JAX configures
its own way, and are kept only so that scripts using them still import and run.

Example:
    >>> import spmd_torch.core.xla_env_vars as xenv
    >>> os.environ.get(xenv.PJRT_DEVICE)
    'CPU'
"""

from __future__ import annotations

# The runtime: which PJRT plugin runs the program, and how processes split a host.
PJRT_DEVICE = "PJRT_DEVICE"
PJRT_SELECT_DEFAULT_DEVICE = "PJRT_SELECT_DEFAULT_DEVICE"
PJRT_LOCAL_PROCESS_COUNT = "PJRT_LOCAL_PROCESS_COUNT"
PJRT_LOCAL_PROCESS_RANK = "PJRT_LOCAL_PROCESS_RANK"
PJRT_DIST_SERVICE_ADDR = "PJRT_DIST_SERVICE_ADDR"
PJRT_CPU_ASYNC_CLIENT = "PJRT_CPU_ASYNC_CLIENT"
PJRT_GPU_ASYNC_CLIENT = "PJRT_GPU_ASYNC_CLIENT"

# Device counts per kind.
TPU_NUM_DEVICES = "TPU_NUM_DEVICES"
GPU_NUM_DEVICES = "GPU_NUM_DEVICES"
CPU_NUM_DEVICES = "CPU_NUM_DEVICES"

# TPU topology and processes.
TPUVM_MODE = "TPUVM_MODE"
CLOUD_TPU_TASK_ID = "CLOUD_TPU_TASK_ID"
TPU_HOST_BOUNDS = "TPU_HOST_BOUNDS"
TPU_CHIPS_PER_HOST_BOUNDS = "TPU_CHIPS_PER_HOST_BOUNDS"
TPU_CHIPS_PER_PROCESS_BOUNDS = "TPU_CHIPS_PER_PROCESS_BOUNDS"
TPU_PROCESS_BOUNDS = "TPU_PROCESS_BOUNDS"
TPU_PROCESS_ADDRESSES = "TPU_PROCESS_ADDRESSES"
TPU_PROCESS_PORT = "TPU_PROCESS_PORT"
TPU_VISIBLE_CHIPS = "TPU_VISIBLE_CHIPS"
TPU_MESH_CTLER_ADDR = "TPU_MESH_CONTROLLER_ADDRESS"
TPU_MESH_CTLER_PORT = "TPU_MESH_CONTROLLER_PORT"

# The XRT runtime of PyTorch/XLA 1.x, whose names older scripts still import.
MP_DEVICE = "XRT_MULTI_PROCESSING_DEVICE"
LOCAL_WORKER = "XRT_LOCAL_WORKER"
TPU_CONFIG = "XRT_TPU_CONFIG"
SERVICE_ADDRESS = "XRT_MESH_SERVICE_ADDRESS"
DEVICE_MAP = "XRT_DEVICE_MAP"
WORKERS = "XRT_WORKERS"
LOCAL_ORDINAL = "XRT_SHARD_LOCAL_ORDINAL"
ORDINAL = "XRT_SHARD_ORDINAL"
WORLD_SIZE = "XRT_SHARD_WORLD_SIZE"
HOST_WORLD_SIZE = "XRT_HOST_WORLD_SIZE"
HOST_ORDINAL = "XRT_HOST_ORDINAL"
TORCH_DIST_METHOD = "XRT_TORCH_DIST_METHOD"
TORCH_DIST_ROOT = "XRT_TORCH_DIST_ROOT"
