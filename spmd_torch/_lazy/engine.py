"""The engine's state, in one object: what one program (or one replica of ``launch``) traces.

An ``Engine`` holds the storages with pending values, the device PRNG key, its mode (modes.py), the
compile cache, the last program's outputs, the step closures, and the switches user code turns for
a while (``SWITCHES``). ``current()`` is the one way to reach it: each replica's thread runs its own
(``running``); every other thread shares the default one.
"""

from __future__ import annotations

import contextlib
from contextvars import ContextVar

from spmd_torch import config


class CompileCache:
    """Executables by cache key, and the recent keys that explain a recompilation. Engines may
    share one: the same program traced by two of them compiles once."""

    __slots__ = ("executables", "history", "ops", "unsettled")

    def __init__(self):
        self.executables: dict = {}
        self.unsettled = False  # compiled since the heap was last frozen (compile.settle_heap)
        self.history: list = []  # recent keys, newest last
        self.ops: dict = {}  # id(op) -> op, for naming the ops of keys (which hold ids)

    def clear(self) -> None:
        self.executables.clear()
        self.history.clear()


# What user code switches on an engine for a while; reset() switches each back.
SWITCHES = ("mode", "scope", "one_graph", "eager", "marked_step", "global_mesh", "step_closures")


class Engine:
    __slots__ = tuple(
        "home mode cache pending rng manual_used in_flight step_closures scope one_graph eager "
        "eager_depth marked_step global_mesh steps".split()
    )

    def __init__(self, mode=None, cache: CompileCache | None = None):
        self.cache = cache if cache is not None else CompileCache()
        self.home = mode  # the mode reset() returns to: one device, or a replica's own
        self.reset()

    def reset(self) -> None:
        """Back to a fresh engine in its home mode, keeping the compile cache."""
        self.mode = self.home
        # Weak references to storages given a pending value, in write order: the barrier computes
        # the live ones. A plain list (no weakref callbacks) keeps the per-op cost low.
        self.pending: list = []
        self.rng = None  # the Storage of the device PRNG key; seeded on first use
        self.manual_used = False  # until a region is entered, the barrier skips looking for one
        self.in_flight: list = []  # per program not known done, weak refs to its outputs
        self.step_closures: list = []  # xm.add_step_closure's (callable, run_async)
        self.scope: str | None = None  # open profiler Trace names, "/"-joined: nodes carry them
        self.one_graph: str | None = None  # the compile(full_graph=True) region: nothing runs
        self.eager: bool = config.EAGER.value  # each op runs as it is issued
        self.eager_depth = 0  # ops issued by an op (decompositions) run with it
        self.marked_step = False  # a profiler StepTrace issues this step's barrier
        self.global_mesh = None  # xs.set_global_mesh's
        self.steps = 0  # steps ended by a barrier (what tells a compiled graph a step ended)

    def leftovers(self) -> list[str]:
        """The switches user code left changed (what a finished test must not leave behind)."""
        fresh = Engine(self.home)
        changed = [name for name in SWITCHES if getattr(self, name) != getattr(fresh, name)]
        return [f"{name} is {getattr(self, name)!r}" for name in changed]


DEFAULT = Engine()  # every thread's but the replicas' of launch, which run their own
# Per thread (a new thread starts with no value, so it sees the default engine) and cheap to read:
# every traced op reads it once.
_CURRENT: ContextVar[Engine] = ContextVar("spmd_torch_engine", default=DEFAULT)

current = _CURRENT.get  # the engine of the calling thread: the one way to reach engine state


@contextlib.contextmanager
def running(engine: Engine):
    """Run the block on this thread with ``engine``."""
    token = _CURRENT.set(engine)
    try:
        yield engine
    finally:
        _CURRENT.reset(token)
