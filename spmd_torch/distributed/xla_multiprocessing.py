"""torch_xla.distributed.xla_multiprocessing: per-device replicas, emulated on one program per host.

``spawn(fn)`` calls ``fn(index, *args)`` once per replica, each replica owning one device, as
PyTorch/XLA's multiprocessing does. Here a replica is a thread of this process with its own engine
(see ``spmd_torch/_lazy/replicas.py``): at each barrier the replicas' graphs run as one program
over their devices, compiled once for all of them. See docs/multiprocessing.md for what differs
from real processes.
"""

from __future__ import annotations

import copy
import pickle
import threading
from collections.abc import Callable
from typing import Any

import jax
import torch

from spmd_torch import config, runtime
from spmd_torch._lazy import engine, modes
from spmd_torch._lazy.replicas import ReplicaAborted, World

__all__ = ["MpModelWrapper", "spawn"]

_UNWIND_S = 10.0  # how long the other replicas get to stop after one failed


def spawn(
    fn: Callable,
    args: tuple = (),
    nprocs: int | None = None,
    join: bool = True,
    daemon: bool = False,
    start_method: str = "spawn",
) -> Any:
    """Run ``fn(index, *args)`` once per replica, one replica per device, and wait for them all.

    Each replica sees ``xm.xla_device()`` as ``xla:0`` (its own device; ``xla:N`` for replica N
    under the ``torch_xla`` name on the CPU platform, as PyTorch/XLA's CPU threads), its global
    ordinal as
    ``index`` and ``xr.world_size()`` replicas. Its tensors and graphs are its own; collectives
    (``xm.all_reduce``, ``xm.optimizer_step``...) and barriers meet the other replicas', and all
    replicas' graphs run as one program, compiled once. ``args`` are deep-copied into each
    replica, as spawning processes pickles them.

    Args:
        fn: The function each replica runs; its first argument is the replica's global ordinal.
        args: The other arguments of ``fn``.
        nprocs: How many replicas: ``None`` for one per local device, or any count from 1 to
            the local device count (PyTorch/XLA accepts only None and 1).
        join: Must be True: replicas are threads of this process and the call waits for them.
        daemon: Ignored (replica threads never outlive a failed launch's unwinding).
        start_method: Accepted for compatibility ('spawn', 'fork', 'forkserver'); replicas are
            threads whatever it says.

    Returns:
        ``fn``'s result when ``nprocs`` is 1, as in PyTorch/XLA; otherwise a dict from ordinal to
        each replica's result (PyTorch/XLA returns None).

    Raises:
        ValueError: ``nprocs`` is not None or a count of local devices.
        RuntimeError: Called in SPMD mode, or from inside a replica.
        Exception: The first failing replica's error, with its traceback and a note naming the
            replica; the other replicas are stopped first.

    Example:
        >>> def _mp_fn(index):
        ...     device = xm.xla_device()
        ...     total = xm.all_reduce(xm.REDUCE_SUM, torch.tensor([index], device=device))
        ...     xm.master_print(total.item())
        >>> xmp.spawn(_mp_fn, args=())
        28
    """
    replicas = _replica_count(nprocs)
    if not join:
        raise ValueError("spawn(join=False): replicas are threads of this process; use join=True")
    if start_method not in ("spawn", "fork", "forkserver"):
        raise ValueError(f"spawn: unknown start_method {start_method!r}")
    engine.current().mode.refuse_per_replica("spawn/launch", "replicas do not nest")
    modes.refuse_in_spmd(
        "Runtime is already initialized. Do not use the XLA device before calling xmp.spawn. "
        "(SPMD mode is on: a launch's replicas each own one device; run an SPMD program in "
        "one process instead)"
    )
    results = _run(fn, args, replicas)
    return results[0] if nprocs == 1 else results


def _replica_count(nprocs: int | None) -> int:
    devices = jax.local_device_count()
    if nprocs is None:
        return devices
    if isinstance(nprocs, bool) or not isinstance(nprocs, int) or not 1 <= nprocs <= devices:
        raise ValueError(
            f"Unsupported nprocs ({nprocs!r}): use None (one replica per local device) or a "
            f"count from 1 to the {devices} local devices"
        )
    if nprocs < devices and jax.process_count() > 1:
        raise ValueError(
            f"spawn(nprocs={nprocs}) in a job of {jax.process_count()} hosts: every host runs "
            "one replica per local device (nprocs=None)"
        )
    return nprocs


def cpu_threads() -> bool:
    """Whether replicas stand for PyTorch/XLA's CPU threads, thread N on ``xla:N``: under the
    ``torch_xla`` face on the CPU platform. Elsewhere a replica stands for a process owning one
    device, ``xla:0``, as on TPU v4+ and GPUs, so per-device code reads alike on every platform."""
    return config.FACE.on and runtime.device_type() == "CPU"


def _world(replicas: int) -> World:
    """The replicas of this launch: one per device of every host, numbered host after host
    (host 1 of 2 with 4 devices runs ordinals 4-7); this host runs its own."""
    if jax.process_count() == 1:
        return World(jax.local_devices()[:replicas], engine.current().cache)
    devices = sorted(jax.devices(), key=lambda d: (d.process_index, d.id))
    local = [k for k, d in enumerate(devices) if d.process_index == jax.process_index()]
    return World(devices, engine.current().cache, local)


def _run(fn: Callable, args: tuple, replicas: int) -> dict:
    """Run this host's replicas to the end; raises the first failure after the others stopped."""
    cpu_rng = torch.get_rng_state()
    autocast_dtype = torch.get_autocast_dtype("xla")  # per thread in PyTorch: replicas inherit it
    world = _world(replicas)
    named = cpu_threads()
    outcomes: dict = {}
    threads = [
        threading.Thread(
            target=_replica_main,
            args=(world, ordinal, fn, args, outcomes, cpu_rng, autocast_dtype, named),
            name=f"spmd_torch-replica-{ordinal}",
            daemon=True,
        )
        for ordinal in world.local
    ]
    for thread in threads:
        thread.start()
    try:
        _join(world, threads)
    finally:
        torch.set_rng_state(cpu_rng)  # replicas drew from their own streams, not the caller's
    if world.failure is not None:
        ordinal, error = world.failure
        if hasattr(error, "add_note"):
            error.add_note(f"(raised by replica {ordinal} of {world.size} in launch/spawn)")
        raise error
    return {ordinal: outcomes[ordinal] for ordinal in world.local}


def _join(world: World, threads: list) -> None:
    """Wait for every replica; once one failed, give the others a bounded time to stop."""
    for thread in threads:
        while thread.is_alive():
            thread.join(timeout=0.1)
            if world.failure is not None:
                for other in threads:
                    other.join(timeout=_UNWIND_S)
                return


def _replica_main(
    world: World,
    ordinal: int,
    fn: Callable,
    args: tuple,
    outcomes: dict,
    cpu_rng: torch.Tensor,
    autocast_dtype,
    named: bool = False,
) -> None:
    torch.set_autocast_dtype("xla", autocast_dtype)
    # The launcher's CPU RNG state, taken before any replica started: read here, on a thread
    # started after replica 0, it could be replica 0's stream partway through its draws.
    replica = modes.Replica(world, ordinal, cpu_rng.clone(), named_by_ordinal=named)
    own = engine.Engine(replica, cache=world.cache)
    # Backward passes on this thread, not autograd's device thread, which runs no engine of its
    # own (the switch is per thread).
    with engine.running(own), torch.autograd.set_multithreading_enabled(False):
        try:
            world.start(replica)
            outcomes[ordinal] = fn(ordinal, *map(_replica_copy, args))
            world.finish(replica)
        except ReplicaAborted:
            pass
        except BaseException as error:  # the launch raises it in the caller
            world.fail(replica, error)


def _replica_copy(arg: Any) -> Any:
    """The replica's own copy of a launch argument, as a spawned process would receive it: through
    pickle (a ``Manager().Queue`` proxy reconnects), else a deep copy; what neither can copy (a
    ``multiprocessing.Queue``, a lock) is a channel between processes, which threads share."""
    try:
        return pickle.loads(pickle.dumps(arg))
    except Exception:
        pass
    try:
        return copy.deepcopy(arg)
    except Exception:
        return arg


class MpModelWrapper:
    """Wraps a model built once, outside the launched function, for every replica to move to its
    device: ``MpModelWrapper(model).to(device)`` gives each replica its own copy.

    In PyTorch/XLA this saves host memory under ``start_method='fork'``; replicas here are threads
    of one process, so each gets a deep copy of the one host model.

    Args:
        model: The model, on the CPU.

    Example:
        >>> WRAPPED = xmp.MpModelWrapper(Net())
        >>> def _mp_fn(index):
        ...     model = WRAPPED.to(xm.xla_device())
    """

    def __init__(self, model: torch.nn.Module) -> None:
        self._model = model

    def to(self, device: torch.device | str) -> torch.nn.Module:
        """A copy of the model on ``device`` (the calling replica's)."""
        return copy.deepcopy(self._model).to(device)
