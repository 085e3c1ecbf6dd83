"""The engine's state, in one object: what one program (or one replica of ``launch``) traces.

An ``Engine`` holds the storages with pending values, the device PRNG key, its mode (modes.py), the
compile cache, the last program's outputs, the step closures, and the switches user code turns for
a while (``SWITCHES``). ``current()`` is the one way to reach it: each replica's thread runs its own
(``running``); every other thread shares the default one.
"""

from __future__ import annotations

import collections
import contextlib
import os
import warnings
from contextvars import ContextVar

from jax._src import xla_bridge  # its backend table: JAX has no public query that takes no lock

from spmd_torch import config


class CompileCache:
    """Executables by cache key, and the recent keys that explain a recompilation. Engines may
    share one: the same program traced by two of them compiles once."""

    __slots__ = ("executables", "history", "ops", "unsettled", "scalars_on_device")

    def __init__(self):
        # Least recently run first: XLA_COMPILATION_CACHE_SIZE bounds it (compile.py evicts).
        self.executables: collections.OrderedDict = collections.OrderedDict()
        self.scalars_on_device: dict = {}  # its programs' packed scalars (compile.Executable)
        self.unsettled = False  # compiled since the heap was last frozen (compile.settle_heap)
        self.history: list = []  # recent keys, newest last
        self.ops: dict = {}  # id(op) -> op, for naming the ops of keys (which hold ids)

    def clear(self) -> None:
        self.executables.clear()
        self.history.clear()
        self.scalars_on_device.clear()


# What user code switches on an engine for a while; reset() switches each back.
SWITCHES = ("mode", "scope", "one_graph", "eager", "marked_step", "global_mesh", "step_closures")


class Engine:
    __slots__ = tuple(
        "home mode cache pending born rng seed manual_used in_flight step_closures scope one_graph eager "
        "eager_depth marked_step global_mesh steps regions next_region __weakref__".split()
    )

    def __init__(self, mode=None, cache: CompileCache | None = None):
        self.cache = cache if cache is not None else CompileCache()
        self.home = self.mode = mode  # the mode reset() returns to: one device, or a replica's own
        self.reset()

    def reset(self) -> None:
        """Back to a fresh engine in its home mode, keeping the compile cache."""
        if self.mode is not self.home and self.mode.replicated is not None:
            self.home.spmd_ended = True  # SPMD's outputs span the mesh (modes.PerDevice.gather)
        self.mode = self.home
        # Weak references to storages given a pending value, in write order: the barrier computes
        # the live ones. A plain list (no weakref callbacks) keeps the per-op cost low.
        self.pending: list = []
        # (weak refs to a storage and to the node of its first value, that value's index) for
        # the storages a constant fill made since the last barrier: the barrier makes those
        # starting live state first (execute._constants_first).
        self.born: list = []
        self.rng = None  # the Storage of the device PRNG key; made from ``seed`` on first use
        self.seed = None  # manual_seed's (None: the default), not yet on the device
        self.manual_used = False  # until a region is entered, the barrier skips looking for one
        self.in_flight: list = []  # per program not known done, weak refs to its outputs
        self.step_closures: list = []  # xm.add_step_closure's (callable, run_async)
        self.scope: str | None = None  # open profiler Trace names, "/"-joined: nodes carry them
        # The open Trace regions as PyTorch/XLA numbers them (name.N, N counting the siblings
        # since the last barrier), each with the number its next sibling gets.
        self.regions: list[tuple[str, int]] = []
        self.next_region = 1
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


# Non-empty in a child process forked after JAX started its runtime (a DataLoader worker): JAX's
# threads did not survive the fork, so device work there would wait forever.
FORKED_AFTER_JAX: list = []


def _note_fork() -> None:
    # Read without xla_bridge's lock: a thread of the parent may have held it at the fork.
    if xla_bridge._backends:
        FORKED_AFTER_JAX.append(os.getpid())


os.register_at_fork(after_in_child=_note_fork)
# JAX warns at every fork once it runs. A child that multiprocessing forks (DataLoader workers,
# pools) is safe from spmd_torch: nothing of ours starts device work there (refuse_in_bad_fork).
warnings.filterwarnings(
    "ignore", r"os\.fork\(\) was called", RuntimeWarning, r"multiprocessing\.popen_fork"
)


def refuse_in_bad_fork(what: str) -> None:
    """Raise instead of starting device work that could never finish in a forked child."""
    if FORKED_AFTER_JAX:
        raise RuntimeError(
            f"{what} in process {os.getpid()}, forked after JAX started its runtime (a DataLoader "
            "worker?): JAX cannot run in such a child. Keep the dataset's tensors on the CPU and "
            "move batches to the device in the main process, as MpDeviceLoader does"
        )
