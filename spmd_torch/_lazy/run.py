"""One program run, built once as a value, and running it through the compile cache.

Every mode runs programs through ``execute``: one device, the SPMD mesh, and the replicas of
``launch``, whose runs their world first stacks into one (``stacked``). So a program records the
same metrics whichever mode runs it.
"""

from __future__ import annotations

import atexit
import functools
import queue
import threading
import time
import weakref
from dataclasses import dataclass

import jax
import numpy as np
from jax.sharding import Mesh

from spmd_torch import config

from . import compile as compiler
from . import counters
from .collective import COLLECTIVES
from .engine import current, refuse_in_bad_fork
from .graph import DATA, Program
from .transfer import ReplicaShard

# Data whose buffer its user gave up (``_XLAC._set_buffer_donation``): the next program reading it
# may reuse the buffer although a live tensor holds it, which from then on holds no data.
DONATED_BY_USER: weakref.WeakSet = weakref.WeakSet()
# PyTorch/XLA's alias-with-buffer-donor config: a run that gives up nothing else (a partial read,
# ``_xla_sync_multi``) gives up the data its user donated too.
DONATE_ON_EVERY_RUN = [False]


@dataclass
class Run:
    """A program with its inputs, which of them it may donate, and its lifted scalars."""

    program: Program
    arrays: list  # one per leaf: device arrays (for a replica, its blocks or ReplicaShards)
    donated: tuple  # per leaf: no live tensor holds it any more, or its user donated it
    scalars: np.ndarray  # the lifted Python scalars, packed
    out_shardings: tuple | None = None  # each output's layout (None entries: the partitioner's)
    replicas: Mesh | None = None  # run by each replica of this mesh, inputs stacked over it
    written: list | None = None  # per output, (its ref, the storages the barrier binds it to)

    @classmethod
    def of(
        cls, program: Program, arrays: list, donate: bool, out_shardings=None, written=None
    ) -> Run:
        """Donates (with ``donate``) the inputs no live tensor holds any more, and the data its
        user donated (with ``donate``, or on every run where configured so)."""
        donated = tuple(
            donate and node.op == DATA and node.holders == 0 for node, _ in program.leaves
        )
        if DONATED_BY_USER and (donate or DONATE_ON_EVERY_RUN[0]):
            donated = tuple(
                given or (node.op == DATA and node in DONATED_BY_USER)
                for given, (node, _) in zip(donated, program.leaves)
            )
        scalars = program.scalar_values()
        return cls(program, arrays, donated, scalars, out_shardings, written=written)

    @functools.cached_property
    def key(self) -> tuple:
        """What tells replicas' runs apart: runs with equal keys run as one program."""
        avals = tuple(node.avals[i] for node, i in self.program.leaves)
        return (self.program.identity, avals, self.donated)

    @functools.cached_property
    def collectives(self) -> list[str]:
        """The collectives the run holds, in order: a replica's program with any runs only
        together with every other replica's."""
        return [str(node.op) for node in self.program.nodes if node.op in COLLECTIVES]


# PyTorch/XLA's ``_XLAC._set_allow_execution``: False makes any program about to run raise, so a
# region that must only trace (its Dynamo bridge's, a user's check) finds the run that escaped.
EXECUTION_ALLOWED = [True]


def execute(run: Run) -> list:
    """Run through the compile cache (compiling on a miss); the outputs, dispatched."""
    refuse_in_bad_fork("running a program")
    if not EXECUTION_ALLOWED[0]:
        raise RuntimeError(
            "Unexpected execution happens inside the compiled function, exiting: a program of "
            f"{len(run.program.nodes)} ops was about to run at {compiler.user_frame()} while "
            "torch_xla._XLAC._set_allow_execution(False) forbids running any (nothing ran; "
            "the values stay pending)"
        )
    executable, hit = compiler.lookup_or_compile(run)
    if config.DEBUG_LEVEL.value:
        compiler.analyze(run, executable, hit)
    start = time.perf_counter_ns()
    if executable.lockstep:
        _after_lockstep_programs()
    # The device waits before the dispatch (PyTorch/XLA's name): for an earlier program in
    # lockstep, on CPU collectives; nothing else waits.
    counters.record("DeviceLockWait", time.perf_counter_ns() - start)
    start = time.perf_counter_ns()
    outputs = executable(run.arrays, run.donated, run.scalars)
    dispatched = time.perf_counter_ns()
    counters.record("DispatchTime", dispatched - start)
    if executable.lockstep:
        _LOCKSTEP_OUTPUTS[:] = [weakref.ref(out) for out in outputs]
    # PyTorch/XLA's names: a program over several devices is a replicated execution; an eager
    # op's on one device has its own name.
    name = "ExecuteReplicatedTime" if executable.devices > 1 else _EXECUTE[current().eager]
    if name == "EagerOpExecuteTime" or not outputs:
        counters.record(name, dispatched - start)  # an eager op's: its dispatch
    else:
        _FINISHES.time(name, start, outputs)  # until its outputs are ready
    counters.record("TensorsGraphSize", len(run.program.nodes))
    return outputs


_EXECUTE = {False: "ExecuteTime", True: "EagerOpExecuteTime"}


class _Finishes:
    """Times each program from its dispatch until its outputs are ready, as PyTorch/XLA's
    ExecuteTime covers the execution, not the asynchronous dispatch: a thread of its own waits,
    so the host goes on tracing. A read of the metrics waits for the programs in flight."""

    def __init__(self):
        self.queue: queue.SimpleQueue = queue.SimpleQueue()
        self.waiting: list = []  # [done event, outputs] per program not recorded yet
        self.thread: threading.Thread | None = None
        self.lock = threading.Lock()
        self.stops_at_exit = False

    def time(self, name: str, start: int, outputs: list) -> None:
        entry = [threading.Event(), outputs]
        with self.lock:
            self.waiting.append(entry)
            if self.thread is None or not self.thread.is_alive():
                self.thread = threading.Thread(
                    target=self._wait_each, name="spmd_torch-execute-time", daemon=True
                )
                self.thread.start()
                if not self.stops_at_exit:  # registered after jax.distributed's: runs before it
                    atexit.register(self.stop)
                    self.stops_at_exit = True
        self.queue.put((name, start, entry))

    def stop(self) -> None:
        """At exit, let the thread finish the programs in flight and end. Left running, it could
        leave XLA's wait while the interpreter finalizes: a daemon thread taking the GIL back
        then is unwound through XLA's C++ frames, and the process aborts ("FATAL: exception not
        rethrown"), as a script ending with ``xm.mark_step()`` did."""
        thread = self.thread
        if thread is not None and thread.is_alive():
            self.queue.put(None)
            thread.join(timeout=_EXIT_WAIT_S)

    def _wait_each(self) -> None:
        while (item := self.queue.get()) is not None:
            name, start, entry = item
            for output in entry[1]:  # one program's outputs are ready together: one will do
                try:
                    output.block_until_ready()
                    break
                except Exception:  # noqa: BLE001 - a later program took it (donated): not ours
                    continue
            counters.record(name, time.perf_counter_ns() - start)
            with self.lock:
                self.waiting.remove(entry)
            entry[1] = None
            entry[0].set()
            entry = output = None  # held no longer than recorded (a heap freeze may come next)

    def settle(self) -> None:
        """Wait until the programs in flight are recorded: a read of the metrics counts each
        program dispatched before it (ExecuteComputation), as a read of their results would."""
        with self.lock:
            waiting = [done for done, _ in self.waiting]
        for done in waiting:
            done.wait(timeout=_SETTLE_S)


_SETTLE_S = 600.0  # the longest a read of the metrics waits for one program in flight
_EXIT_WAIT_S = 60.0  # the longest exit waits for the programs in flight (a dead peer's never end)
_FINISHES = _Finishes()
counters.BEFORE_READ.append(_FINISHES.settle)

# The outputs of the last program run in lockstep. Process-wide on purpose: XLA's CPU thread pool
# is the process's. Two such programs in flight can each hold some of its threads with
# participants waiting for the others' (PyTorch/XLA's eager SPMD example deadlocked so on a
# 2-core host): each waits for the one before.
_LOCKSTEP_OUTPUTS: list = []


def _after_lockstep_programs() -> None:
    output = unfinished_output(_LOCKSTEP_OUTPUTS)
    if output is not None:
        output.block_until_ready()


def unfinished_output(outputs: list):
    """An output of one program (``outputs``: weak refs to all of them) to wait on, or None when
    the program is done. Its outputs become ready together, so the first one held and not given
    to a later program (waiting on a donated buffer raises) answers for all."""
    for weak in outputs:
        output = weak()
        if output is not None and not output.is_deleted():
            return None if output.is_ready() else output
    return None


def stacked(runs: list[Run], mesh: Mesh) -> Run:
    """The runs of replicas with one key as one run over the mesh of their devices: each input
    the replicas' arrays stacked, donated only when every replica donates it. With several
    hosts, ``runs`` are this host's replicas' and the mesh spans every host's."""
    layout = compiler.stacked(mesh)
    first = runs[0]
    arrays = [
        _stacked([run.arrays[i] for run in runs], mesh, layout) for i in range(len(first.arrays))
    ]
    donated = tuple(all(run.donated[i] for run in runs) for i in range(len(arrays)))
    scalars = jax.make_array_from_process_local_data(layout, np.stack([r.scalars for r in runs]))
    return Run(first.program, arrays, donated, scalars, replicas=mesh, written=first.written)


def _stacked(blocks: list, mesh: Mesh, layout) -> jax.Array:
    """The replicas' arrays of one input as one array stacked over ``mesh``: the earlier output
    itself when they are its blocks in order, else assembled from the blocks (no copy)."""
    first = blocks[0]
    if type(first) is ReplicaShard:
        whole = first.stacked
        if whole.sharding.mesh == mesh and all(
            type(b) is ReplicaShard and b.stacked is whole and b.position == p
            for p, b in enumerate(blocks)
        ):
            if whole.sharding == layout:  # else one device's P() for P(replica): same blocks
                return whole
    local = [b.local() if type(b) is ReplicaShard else b for b in blocks]
    shape = (mesh.devices.size,) + tuple(local[0].shape[1:])  # other hosts hold the rest
    return jax.make_array_from_single_device_arrays(shape, layout, local)
