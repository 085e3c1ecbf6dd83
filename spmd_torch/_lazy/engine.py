"""The engine's state, in one object: what one (emulated) device is tracing and where its data lives.

Everything the engine remembers between ops lives in an ``Engine``: the storages with pending
values, the device PRNG key, the placement mode (one device, or the SPMD mesh), whether manual
regions were ever entered, the compile cache and the last program's outputs. ``current()`` is the
one way to reach it. A thread may run with its own engine (``running``), as each replica of the
multiprocessing emulation does (``replica`` says which one it is); every other thread shares the
default one.
"""

from __future__ import annotations

import contextlib
from contextvars import ContextVar

from jax.sharding import NamedSharding


class CompileCache:
    """Executables by cache key, and the recent keys that explain a recompilation. Engines may
    share one: the same program traced by two of them compiles once."""

    __slots__ = ("executables", "history", "ops")

    def __init__(self):
        self.executables: dict = {}
        self.history: list = []  # recent keys, newest last
        self.ops: dict = {}  # id(op) -> op, for naming the ops of keys (which hold ids)

    def clear(self) -> None:
        self.executables.clear()
        self.history.clear()


class Engine:
    __slots__ = tuple(
        "pending rng replicated manual_used cache in_flight replica step_closures".split()
    )

    def __init__(self, cache: CompileCache | None = None, replica=None):
        self.cache = cache if cache is not None else CompileCache()
        # A replica of ``launch`` (replicas.Replica): its device, ordinal and world; None outside.
        self.replica = replica
        self.reset()

    def reset(self) -> None:
        """Back to a fresh engine on one device, keeping the compile cache."""
        # Weak references to storages given a pending value, in write order: the barrier computes
        # the live ones. A plain list (no weakref callbacks) keeps the per-op cost low.
        self.pending: list = []
        self.rng = None  # the Storage of the device PRNG key; seeded on first use
        self.replicated: NamedSharding | None = None  # over the SPMD devices; None: one device
        self.manual_used = False  # until a region is entered, the barrier skips looking for one
        self.in_flight: list = []  # weak refs to the last program's outputs (wait_device_ops)
        self.step_closures: list = []  # xm.add_step_closure's (callable, run_async), for sync()


# Per thread (a new thread starts with no value, so it sees the default engine) and cheap to read:
# every traced op reads it once.
_CURRENT: ContextVar[Engine] = ContextVar("spmd_torch_engine", default=Engine())

current = _CURRENT.get  # the engine of the calling thread: the one way to reach engine state


@contextlib.contextmanager
def running(engine: Engine):
    """Run the block on this thread with ``engine``."""
    token = _CURRENT.set(engine)
    try:
        yield engine
    finally:
        _CURRENT.reset(token)
