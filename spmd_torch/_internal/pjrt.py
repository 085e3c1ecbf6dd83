"""torch_xla._internal.pjrt: run a function on every local device, PyTorch/XLA's test harness.

PyTorch/XLA starts one process per chip (one thread per device inside it) and gathers each
device's return value. Here every call is one launch of
:func:`spmd_torch.distributed.xla_multiprocessing.spawn`: one replica per local device, each a
thread with its own engine and device, whose barriers meet as one program (see
docs/multiprocessing.md). So the replicas' results, collectives, rendezvous and ``xla://``
process groups are those of ``xmp.spawn``; the number of replicas is the number of devices JAX
started with. Under the ``torch_xla`` face on the CPU platform, a call runs PyTorch/XLA's CPU
threads instead: as many as ``CPU_NUM_DEVICES`` says at the call (1 when unset, at most the
devices JAX started with), replica N on ``xla:N``.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, TypeVar

from spmd_torch import config
from spmd_torch.distributed import xla_multiprocessing as xmp

__all__ = ["run_multiprocess", "spawn", "spawn_threads"]

R = TypeVar("R")


def _call_without_ordinal(fn: Callable, _ordinal: int, args: tuple, kwargs: dict) -> Any:
    """A replica's body for :func:`run_multiprocess`: ``fn`` takes no ordinal there (and is not
    copied: a bound method's instance stays the caller's)."""
    return fn(*args, **kwargs)


def run_multiprocess(
    fn: Callable[..., R], *args: Any, start_method: str = "spawn", **kwargs: Any
) -> dict[int, R]:
    """Run ``fn(*args, **kwargs)`` in one replica per local device and collect the results.

    Each replica has its own device, ordinal (``xr.global_ordinal()``) and graphs, as a process
    of PyTorch/XLA's would; ``args`` and ``kwargs`` are deep-copied into each, as pickling them
    into processes copies them. The call returns once every replica has.

    Args:
        fn: The function each replica runs; it takes no ordinal (read ``xr.global_ordinal()``).
        *args: Its positional arguments.
        start_method: Accepted for compatibility ('spawn', 'fork', 'forkserver'); replicas are
            threads whatever it says.
        **kwargs: Its keyword arguments.

    Returns:
        ``{ordinal: fn's result}`` for every local replica.

    Raises:
        RuntimeError: Called in SPMD mode or from inside a replica.
        Exception: The first failing replica's error, after the others stopped.

    Example:
        >>> pjrt.run_multiprocess(xr.global_ordinal)  # 4 devices
        {0: 0, 1: 1, 2: 2, 3: 3}
    """
    body = functools.partial(_call_without_ordinal, fn)
    nprocs = None
    if xmp.cpu_threads():  # PyTorch/XLA's CPU threads, as many as CPU_NUM_DEVICES says now
        nprocs = config.CPU_NUM_DEVICES.read() or 1
    results = xmp.spawn(body, args=(args, kwargs), nprocs=nprocs, start_method=start_method)
    return {0: results} if nprocs == 1 else results


def spawn(
    fn: Callable, nprocs: int | None = None, start_method: str = "spawn", args: tuple = ()
) -> Any:
    """Run ``fn(index, *args)`` as ``xmp.spawn`` does, on every local device or on one.

    Args:
        fn: The function each replica runs; its first argument is the replica's global ordinal.
        nprocs: None for one replica per local device, or 1 for a single replica; any other
            count raises ValueError, as in PyTorch/XLA (``xmp.spawn`` itself accepts any count
            up to the local devices).
        start_method: Accepted for compatibility; replicas are threads.
        args: The other arguments of ``fn``, deep-copied into each replica.

    Returns:
        ``fn``'s result with ``nprocs=1``; None otherwise, as in PyTorch/XLA.

    Raises:
        ValueError: ``nprocs`` is neither None nor 1.

    Example:
        >>> pjrt.spawn(lambda index: print(index))  # 4 devices: prints 0 1 2 3
    """
    if nprocs == 1:
        return xmp.spawn(fn, args=args, nprocs=1, start_method=start_method)
    if nprocs is not None:
        raise ValueError(
            f"spawn: unsupported nprocs ({nprocs!r}): use nprocs=1 or None (one replica per "
            "local device); to use fewer devices, start the process with fewer (CPU_NUM_DEVICES, "
            "TPU_VISIBLE_CHIPS, CUDA_VISIBLE_DEVICES)"
        )
    xmp.spawn(fn, args=args, nprocs=None, start_method=start_method)
    return None


def spawn_threads(fn: Callable, args: tuple = ()) -> None:
    """Run ``fn(index, *args)`` on one thread per local device of this process.

    PyTorch/XLA's single-process variant of :func:`spawn`; replicas here are threads either way,
    so the two run alike.

    Args:
        fn: The function each thread runs; its first argument is the replica's global ordinal.
        args: The other arguments of ``fn``, deep-copied into each replica.

    Example:
        >>> pjrt.spawn_threads(lambda index: print(index, torch_xla.device()))
    """
    xmp.spawn(fn, args=args, nprocs=None)
