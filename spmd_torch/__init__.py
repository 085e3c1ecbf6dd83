"""spmd_torch: PyTorch/XLA programs on any accelerator JAX reaches, traced lazily, sharding-first."""

from __future__ import annotations

import gc
import importlib
from collections.abc import Callable
from typing import Any

import torch

from . import (
    _barrier,
    _multihost,
    experimental,  # noqa: F401, I001  (torch_xla.experimental after import torch_xla)
)
from . import config as _config
from . import runtime as _runtime
from ._lazy import device as _device
from ._lazy import engine as _engine
from ._lazy import rng as _rng
from ._lazy.tensor import DEVICE as _DEVICE
from ._regions import compile, step  # noqa: F401  (public: spmd_torch.compile, .step)
from .core.auto_capture import auto_capture  # noqa: F401  (public: spmd_torch.auto_capture)
from .distributed import _dtensor_route
from .distributed import xla_multiprocessing as _xmp

_runtime.start_from_environment()  # PJRT_DEVICE, CPU_NUM_DEVICES, as PyTorch/XLA reads them
_multihost.start()  # several processes (hosts): join them before any device is used
_device.register()
_dtensor_route.register()  # DTensor on an 'xla' DeviceMesh reaches spmd_torch.distributed.spmd
if _config.USE_SPMD.value:  # XLA_USE_SPMD=1 in the environment
    _runtime.use_spmd()
if _config.AUTO_CAPTURE.value:  # SPMD_TORCH_AUTO_CAPTURE=1
    auto_capture(True)

__version__ = "0.1.0"


def device(index: int | None = None) -> torch.device:
    """An xla device (default ``xla:0``); tensors moved there are traced lazily.

    Outside SPMD, ``xla:N`` is the process's N-th device, as in PyTorch/XLA; under SPMD (and in
    a replica of ``launch``) the process has one logical device, ``xla:0``, spanning them all.

    Raises:
        IndexError: no such device (under SPMD: any but 0; shard tensors with a mesh instead).

    Example:
        >>> dev = spmd_torch.device()
        >>> x = torch.ones(2, 2, device=dev) * 3
    """
    return _engine.current().mode.use_device(index)


def devices() -> list[torch.device]:
    """The xla devices of this process: one per local device outside SPMD, else ``xla:0``.

    Example:
        >>> spmd_torch.devices()  # 8 CPU devices, no SPMD
        [device(type='xla', index=0), ..., device(type='xla', index=7)]
    """
    return [torch.device(_DEVICE.type, i) for i in range(device_count())]


def real_devices() -> list[str]:
    """The accelerators behind this process's xla devices, as PyTorch/XLA names them.

    Example:
        >>> spmd_torch.real_devices()
        ['CPU:0', 'CPU:1', 'CPU:2', 'CPU:3']
    """
    return _runtime.xla_real_devices()


def device_count() -> int:
    """The number of xla devices this process addresses (see :func:`devices`).

    Example:
        >>> spmd_torch.device_count()
        4
    """
    return _runtime.addressable_device_count()


def sync(wait: bool = False, reset_scope: bool = True) -> None:
    """The barrier: compile (once) and dispatch every pending computation; same as mark_step().

    Then, as in PyTorch/XLA, the step's metrics go to ``XLA_METRICS_FILE`` (if set) and the step
    closures queued by ``xm.add_step_closure`` run.

    Args:
        wait: Block until the dispatched program has finished.
        reset_scope: Number the profiler's ``Trace`` regions afresh; under the ``torch_xla``
            face a region still open is then an error, as in PyTorch/XLA.

    Example:
        >>> loss = model(x).sum(); loss.backward(); opt.step()
        >>> spmd_torch.sync()
    """
    _barrier.barrier(wait=wait, reset_scope=reset_scope)


def launch(
    fn: Callable,
    args: tuple = (),
    start_method: str = "spawn",
    debug_single_process: bool = False,
) -> Any:
    """Run ``fn(index, *args)`` once per local device, each replica owning one device.

    The per-device multiprocessing entry point of PyTorch/XLA (``torch_xla.launch``): see
    :func:`spmd_torch.distributed.xla_multiprocessing.spawn`, which it calls with
    ``nprocs=None`` (every local device), or ``nprocs=1`` with ``debug_single_process``.

    Args:
        fn: The function each replica runs; its first argument is the replica's global ordinal.
        args: The other arguments of ``fn``.
        start_method: Accepted for compatibility; replicas are threads of this process.
        debug_single_process: Run a single replica (ordinal 0), for debugging.

    Example:
        >>> def _mp_fn(index, lr):
        ...     model = Net().to(xm.xla_device())
        ...     ...
        >>> spmd_torch.launch(_mp_fn, args=(0.1,))
    """
    nprocs = 1 if debug_single_process else None
    return _xmp.spawn(fn, args=args, nprocs=nprocs, start_method=start_method)


def manual_seed(seed: int, device: torch.device | str | None = None) -> None:
    """Seed the device RNG (``torch.manual_seed`` does this too).

    Args:
        seed: The seed.
        device: Accepted for compatibility: there is one device RNG per process (per replica).

    Example:
        >>> spmd_torch.manual_seed(0)
    """
    _rng.manual_seed(seed)


def __getattr__(name: str):
    """``spmd_torch._XLAC`` (PyTorch/XLA's binding, ``torch_xla._XLAC``) on first use: it imports
    the DTensor and checkpoint modules, which would double the time ``import spmd_torch`` takes."""
    if name == "_XLAC":
        return importlib.import_module(f"{__name__}._XLAC")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


if _config.FREEZE_HEAP.value:
    # What import made (torch's and JAX's modules, ~380k objects) lives as long as the process:
    # out of the cyclic collector's reach, full collections before warm-up ends
    # (compile.settle_heap) and the one at interpreter exit do not walk it (0.5-1.5 s of a
    # short run's exit on the 2-core CPU host).
    gc.freeze()
