"""torch_xla.runtime on JAX: device kind, ordinals, device counts, the persistent compile cache.

Outside ``launch``, spmd_torch runs in PyTorch/XLA's SPMD model: one program per process (one
process per host) addresses one logical device, ``xla:0``, that wraps every device JAX sees. So, as
in PyTorch/XLA with SPMD enabled, the *device* counts are those of the logical device (1 per
process) and the *runtime device* counts are those of the real accelerators
(``global_runtime_device_count()``). Inside a replica of ``launch``/``spawn`` the answers are those
of PyTorch/XLA's multiprocessing: one process per device, the replica's ordinal its process index.
"""

from __future__ import annotations

import ctypes
import importlib.metadata
import importlib.util
import math
import os
import pkgutil
import re

import jax
import jax.numpy as jnp
import numpy as np
import torch

# JAX has no public query for these: whether backends started (xla_bridge), how it finds libtpu
# (cloud_tpu_init) and whether it sees a GPU (hardware_utils)
from jax._src import cloud_tpu_init, hardware_utils, xla_bridge

from . import config
from ._lazy import engine, modes

_PLATFORM_NAMES = {"cpu": "CPU", "tpu": "TPU", "gpu": "CUDA", "cuda": "CUDA", "rocm": "ROCM"}
_JAX_PLATFORMS = {"CPU": "cpu", "TPU": "tpu", "CUDA": "cuda", "GPU": "cuda", "ROCM": "rocm"}
_XLA_DEVICE = re.compile(r"xla(?::(\d+))?$")


def jax_platform(device_kind: str) -> str:
    """JAX's platform for a PyTorch/XLA device kind: ``'CPU'`` -> ``cpu``, ``'CUDA'``/``'GPU'``
    -> ``cuda``, ``'ROCM'`` -> ``rocm``, ``'TPU'`` -> ``tpu``, any other name lower-cased (a JAX
    PJRT plugin's platform).

    Example:
        >>> xr.jax_platform('GPU')
        'cuda'
    """
    return _JAX_PLATFORMS.get(device_kind.upper(), device_kind.lower())


def device_type() -> str:
    """The kind of accelerator the program runs on, as PyTorch/XLA's ``PJRT_DEVICE`` names it.

    JAX's platform of the first device, upper-cased; NVIDIA GPUs read ``'CUDA'`` and AMD GPUs
    ``'ROCM'``, as in PyTorch/XLA.

    Returns:
        ``'CPU'``, ``'CUDA'``, ``'ROCM'``, ``'TPU'`` or another JAX platform name upper-cased.

    Example:
        >>> import spmd_torch.runtime as xr
        >>> xr.device_type()
        'CPU'
    """
    first = jax.devices()[0]
    platform = first.platform.lower()
    if platform == "gpu" and "rocm" in getattr(first.client, "platform_version", "").lower():
        platform = "rocm"
    return _PLATFORM_NAMES.get(platform, platform.upper())


def set_device_type(pjrt_device: str) -> None:
    """Choose the kind of accelerator, as PyTorch/XLA's ``PJRT_DEVICE`` does; call it first.

    Sets ``PJRT_DEVICE``. Before JAX has started its runtime it also picks JAX's platform:
    ``'CPU'`` -> ``cpu``, ``'CUDA'``/``'GPU'`` -> ``cuda``, ``'ROCM'`` -> ``rocm``, ``'TPU'`` ->
    ``tpu``, any other name -> that name lower-cased (a JAX PJRT plugin's platform). Once the
    runtime has started, naming the kind it runs on is accepted and any other is an error.

    Args:
        pjrt_device: The device kind, e.g. ``'TPU'``, ``'CUDA'`` or ``'CPU'``.

    Raises:
        RuntimeError: The runtime already runs on another kind of device, or JAX cannot start
            the platform asked for (its message says what is missing and how to install it).

    Example:
        >>> import spmd_torch.runtime as xr
        >>> xr.set_device_type('CPU')
        >>> xr.device_type()
        'CPU'
    """
    requested = jax_platform(pjrt_device)
    if xla_bridge.backends_are_initialized():
        running = jax_platform(device_type())
        if requested != running:
            raise RuntimeError(
                f"Can't change device type to {pjrt_device!r} after the runtime is initialized: "
                f"it runs on {device_type()}"
            )
    else:
        missing = _why_jax_cannot_start(requested)
        if missing:
            raise RuntimeError(
                f"PJRT_DEVICE={pjrt_device} asks for JAX's {requested!r} platform, which JAX "
                f"cannot start here: {'; '.join(missing)}. Set PJRT_DEVICE=CPU to run on the "
                "CPU, or unset it to run on what JAX finds"
            )
        jax.config.update("jax_platforms", requested)
    os.environ["PJRT_DEVICE"] = pjrt_device


def _why_jax_cannot_start(platform: str) -> list[str]:
    """What keeps JAX from starting ``platform`` (empty: nothing known), found as JAX looks for it
    but without starting it (a multi-host job must join before any backend starts) or importing a
    plugin (which reads its options from the environment as it registers): otherwise the first
    device use fails inside JAX, with a bare AssertionError for CUDA."""
    missing = []
    if platform == "cuda":
        if not _plugin_installed("cuda"):
            missing.append(
                "JAX's CUDA plugin is not installed "
                '(pip install -U "jax[cuda12]", or "jax[cuda13]" for CUDA 13)'
            )
        if not hardware_utils.has_visible_nvidia_gpu():  # JAX skips CUDA without one
            missing.append("no NVIDIA GPU is visible (no /dev/nvidia0, /dev/nvidiactl, /dev/dxg)")
    elif platform == "tpu" and not _libtpu_found():
        missing.append('libtpu is not installed (pip install -U "jax[tpu]" on a TPU VM)')
    return missing


def _plugin_installed(platform: str) -> bool:
    """Whether JAX's plugin discovery will find one for ``platform``: registered already, a module
    under the ``jax_plugins`` namespace (jax[cuda12] installs ``jax_plugins.xla_cuda12``), a
    ``jax_plugins`` entry point, or a name in ``PJRT_NAMES_AND_LIBRARY_PATHS``."""
    if platform in xla_bridge._backend_factories:
        return True
    names = [entry.name for entry in importlib.metadata.entry_points(group="jax_plugins")]
    namespace = importlib.util.find_spec("jax_plugins")
    if namespace is not None and namespace.submodule_search_locations:
        names += [m.name for m in pkgutil.iter_modules(namespace.submodule_search_locations)]
    from_env = os.environ.get("PJRT_NAMES_AND_LIBRARY_PATHS", "")
    names += [pair.split(":")[0] for pair in from_env.split(",") if pair]
    return any(platform in name for name in names)


def _libtpu_found() -> bool:
    """Whether JAX's TPU client will find libtpu: ``TPU_LIBRARY_PATH`` or the libtpu package (JAX's
    own lookup), else ``libtpu.so`` on the loader's path, which only loading it tells."""
    if cloud_tpu_init.get_tpu_library_path() is not None:
        return True
    try:
        ctypes.CDLL("libtpu.so")
    except OSError:
        return False
    return True


def start_from_environment() -> None:
    """PyTorch/XLA's start-up variables, read when spmd_torch is imported (JAX not yet running):
    ``PJRT_DEVICE`` picks the platform, ``CPU_NUM_DEVICES`` the CPU backend's device count
    (unless ``XLA_FLAGS`` gives XLA's own count)."""
    if xla_bridge.backends_are_initialized():
        return
    if config.PJRT_DEVICE.value:
        set_device_type(config.PJRT_DEVICE.value)
    counted = "host_platform_device_count" in os.environ.get("XLA_FLAGS", "")  # XLA's own flag
    if config.CPU_NUM_DEVICES.value and not counted and jax.config.jax_num_cpu_devices < 0:
        jax.config.update("jax_num_cpu_devices", config.CPU_NUM_DEVICES.value)


def is_bf16_supported() -> bool:
    """Whether the accelerator computes in ``torch.bfloat16`` (a bfloat16 add, run and checked).

    Example:
        >>> xr.is_bf16_supported()
        True
    """
    try:
        total = jnp.ones((2,), jnp.bfloat16) + jnp.ones((2,), jnp.bfloat16)
        return bool(np.all(np.asarray(total, dtype=np.float32) == 2.0))
    except Exception:  # noqa: BLE001 - any refusal by the runtime means "not supported"
        return False


def global_runtime_device_attributes() -> list[dict[str, object]]:
    """The attributes of every accelerator in the job, one dict each, in id order.

    Each has ``name`` (``'CUDA:3'``), ``id``, ``process_index``, ``platform``, ``device_kind``
    and, where JAX reports them (TPUs), ``coords`` and ``core_on_chip``.

    Example:
        >>> xr.global_runtime_device_attributes()[0]['name']
        'CPU:0'
    """
    return [_attributes(d) for d in sorted(jax.devices(), key=lambda d: d.id)]


def runtime_device_attributes(device: str) -> dict[str, object]:
    """The attributes of one accelerator (see :func:`global_runtime_device_attributes`).

    Args:
        device: Its name, e.g. ``'TPU:0'`` or ``'CPU:3'``.

    Raises:
        RuntimeError: No accelerator has that name.

    Example:
        >>> xr.runtime_device_attributes('CPU:0')['device_kind']
        'cpu'
    """
    for attributes in global_runtime_device_attributes():
        if attributes["name"] == str(device):
            return attributes
    names = [a["name"] for a in global_runtime_device_attributes()]
    raise RuntimeError(f"runtime_device_attributes: no device {device!r}; devices are {names}")


def _attributes(device: jax.Device) -> dict[str, object]:
    attributes: dict[str, object] = {
        "name": f"{device_type()}:{device.id}",
        "id": device.id,
        "process_index": device.process_index,
        "platform": device.platform,
        "device_kind": device.device_kind,
    }
    for name in ("coords", "core_on_chip"):
        if hasattr(device, name):
            attributes[name] = getattr(device, name)
    return attributes


def get_num_cached_compilation_graph() -> int:
    """The number of compiled programs in the in-memory cache (of this program, or replica).

    Example:
        >>> before = xr.get_num_cached_compilation_graph()
        >>> (torch.ones(3, device='xla') + 1).cpu()
        >>> xr.get_num_cached_compilation_graph() - before
        1
    """
    return len(engine.current().cache.executables)


def world_size() -> int:
    """The number of processes taking part in the job: one per host, or, inside ``launch``, the
    number of replicas.

    Returns:
        ``jax.process_count()`` (1 on a single host), or the replica count.

    Example:
        >>> xr.world_size()
        1
    """
    return process_count()


def global_ordinal() -> int:
    """This process's ordinal among all processes, in ``[0, world_size())``; inside ``launch``,
    the replica's.

    Returns:
        ``jax.process_index()``, or the replica's ordinal.

    Example:
        >>> xr.global_ordinal()
        0
    """
    return process_index()


def local_ordinal() -> int:
    """This process's ordinal among the processes of its host: 0 (one process per host), or,
    inside ``launch``, the replica's ordinal.

    Example:
        >>> xr.local_ordinal()
        0
    """
    return engine.current().mode.local_ordinal


def process_index() -> int:
    """The index of this process (``jax.process_index()``); inside ``launch``, the replica's
    ordinal (each replica stands for one process).

    Example:
        >>> xr.process_index()
        0
    """
    return engine.current().mode.ordinal


def process_count() -> int:
    """The number of processes (``jax.process_count()``); inside ``launch``, the replica count.

    Example:
        >>> xr.process_count()
        1
    """
    return engine.current().mode.world_size


def host_index() -> int:
    """The index of this host; hosts and processes coincide here.

    Example:
        >>> xr.host_index()
        0
    """
    return jax.process_index()


def local_process_count() -> int:
    """The number of processes on this host: 1, or, inside ``launch``, the replica count.

    Example:
        >>> xr.local_process_count()
        1
    """
    return engine.current().mode.local_world_size


def addressable_device_count() -> int:
    """The number of xla devices this process addresses: outside SPMD one per local device
    (``xla:0``, ``xla:1``...), as in PyTorch/XLA; under SPMD, and in a replica of ``launch``,
    one (``xla:0``).

    For the number of real accelerators this process drives, see
    :func:`addressable_runtime_device_count`.

    Example:
        >>> xr.use_spmd()
        >>> xr.addressable_device_count()
        1
    """
    return engine.current().mode.device_count()


def local_device_count() -> int:
    """The number of xla devices on this host (processes on the host times each one's).

    Example:
        >>> xr.local_device_count()  # 8 CPU devices, no SPMD
        8
    """
    return local_process_count() * addressable_device_count()


def global_device_count() -> int:
    """The number of xla devices in the job: each process's (one under SPMD).

    For the number of real accelerators, see :func:`global_runtime_device_count`.

    Example:
        >>> xr.use_spmd()
        >>> xr.global_device_count()
        1
    """
    return process_count() * addressable_device_count()


def global_runtime_device_count() -> int:
    """The number of real accelerators across all hosts, the size a device mesh spans.

    Returns:
        ``jax.device_count()``.

    Example:
        >>> xr.global_runtime_device_count()  # 8 virtual CPU devices in the tests
        8
    """
    return jax.device_count()


def addressable_runtime_device_count() -> int:
    """The number of real accelerators this process drives (``jax.local_device_count()``).

    Example:
        >>> xr.addressable_runtime_device_count()
        8
    """
    return jax.local_device_count()


def use_spmd(auto: bool = False) -> None:
    """Declare that the program uses SPMD sharding, as in PyTorch/XLA (which also sets
    ``XLA_USE_SPMD=1`` in the environment: so does this).

    From then on every program runs over all devices JAX sees: new tensors are replicated over
    them, and tensors already on the device are replicated onto them the first time a program
    uses them (a one-time copy, as in PyTorch/XLA). Sharding annotations
    (``spmd_torch.distributed.spmd.mark_sharding``) turn it on themselves. Call it at the start of
    the program, as in PyTorch/XLA.

    Args:
        auto: PyTorch/XLA's automatic sharding; not supported.

    Example:
        >>> xr.use_spmd()
        >>> xr.is_spmd()
        True
    """
    if auto:
        raise NotImplementedError(
            "use_spmd(auto=True): automatic sharding is not supported; annotate tensors with "
            "mark_sharding instead"
        )
    modes.use_spmd()


def is_spmd() -> bool:
    """Whether the calling engine runs its programs over the SPMD mesh: its mode says so.

    ``XLA_USE_SPMD`` is PyTorch/XLA's switch (:func:`use_spmd` sets it, :func:`reset` removes
    it): a script that sets or deletes it turns SPMD on or off for this engine here, where
    PyTorch/XLA's ``is_spmd`` reads it (a replica of ``launch`` is never in SPMD mode).

    Example:
        >>> xr.is_spmd()
        False
    """
    return modes.in_spmd()


def reset() -> None:
    """Start the calling thread's engine over; no PyTorch/XLA counterpart (tests, notebooks).

    Pending computations are dropped (tensors whose values were computed keep them), SPMD mode
    ends (``XLA_USE_SPMD``, its switch, is removed), and so do open profiler
    ``Trace`` names, compile regions, a ``StepTrace``'s marked step, the global mesh and queued
    step closures; eager mode goes back to ``XLA_USE_EAGER_DEBUG_MODE``, manual-region
    bookkeeping is forgotten and the device RNG goes back to its default seed. Compiled programs
    stay cached. Data already laid out on the mesh stays there.

    Example:
        >>> xr.use_spmd()
        >>> xr.reset()
        >>> xr.is_spmd()
        False
    """
    own = engine.current()
    own.reset()
    if own.mode.follows_spmd_variable:  # SPMD off: its switch too, whoever set it
        os.environ.pop("XLA_USE_SPMD", None)


def initialize_cache(path: str, readonly: bool = False) -> None:
    """Keep compiled programs on disk under ``path`` and reuse them in later runs.

    Backed by JAX's persistent compilation cache, so it applies to every JAX program of the
    process. Every program is written, however small or quick to compile. With ``readonly``
    the cache is only read: JAX has no read-only switch, so writes are suppressed by raising
    the minimum compile time worth caching to infinity. Programs already compiled in this
    process stay in the in-memory cache and are not written.

    Args:
        path: Directory of the cache; created if missing. Several processes may share it.
        readonly: Read existing entries without writing new ones (for all but one worker
            sharing a cache).

    Example:
        >>> xr.initialize_cache('/tmp/xla_cache', readonly=False)
    """
    from jax.experimental.compilation_cache import compilation_cache

    os.makedirs(path, exist_ok=True)
    compilation_cache.reset_cache()  # JAX sets its cache up once; start over with this path
    jax.config.update("jax_compilation_cache_dir", os.fspath(path))
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)
    min_time = math.inf if readonly else 0.0
    jax.config.update("jax_persistent_cache_min_compile_time_secs", min_time)


def xla_real_devices(devices: list | None = None) -> list[str]:
    """The real device names behind xla devices, e.g. ``['CPU:0']`` for ``['xla:0']``.

    Under SPMD the one logical device stands for all accelerators; it is named after the first.

    Args:
        devices: xla devices (``torch.device`` or strings); default: every xla device.

    Example:
        >>> xr.xla_real_devices(['xla:0'])
        ['CPU:0']
    """
    if not devices:
        devices = [f"xla:{i}" for i in range(addressable_device_count())]
    return [_real_device(d) for d in devices]


def xla_device_hw(device: str | torch.device) -> str:
    """The hardware kind of an xla device: ``'CPU'``, ``'CUDA'``, ``'TPU'``...

    Args:
        device: an xla device, ``torch.device('xla:0')`` or ``'xla:0'``.

    Example:
        >>> xr.xla_device_hw('xla:0')
        'CPU'
    """
    return _real_device(device).split(":")[0]


def _real_device(device: str | torch.device) -> str:
    match = _XLA_DEVICE.match(str(device))
    count = addressable_device_count()
    index = int(match.group(1) or 0) if match else count
    if match and index == engine.current().mode.home_index:
        index = engine.current().mode.index_of(index)  # a replica's xla:N is its one device
    if index >= count:
        raise RuntimeError(
            f"Invalid xla device {str(device)!r}: this process has {count} xla devices, "
            f"xla:0 to xla:{count - 1}"
        )
    return f"{device_type()}:{index}"
