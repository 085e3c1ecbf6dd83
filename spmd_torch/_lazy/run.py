"""One program run, built once as a value, and running it through the compile cache.

Every mode runs programs through ``execute``: one device, the SPMD mesh, and the replicas of
``launch``, whose runs their world first stacks into one (``stacked``). So a program records the
same metrics whichever mode runs it.
"""

from __future__ import annotations

import functools
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


@dataclass
class Run:
    """A program with its inputs, which of them it may donate, and its lifted scalars."""

    program: Program
    arrays: list  # one per leaf: device arrays (for a replica, its blocks or ReplicaShards)
    donated: tuple  # per leaf: no live tensor holds it any more
    scalars: np.ndarray  # the lifted Python scalars, packed
    out_shardings: tuple | None = None  # each output's layout (None entries: the partitioner's)
    replicas: Mesh | None = None  # run by each replica of this mesh, inputs stacked over it

    @classmethod
    def of(cls, program: Program, arrays: list, donate: bool, out_shardings=None) -> Run:
        """Donates (with ``donate``) the inputs no live tensor holds any more."""
        donated = tuple(
            donate and node.op == DATA and node.holders == 0 for node, _ in program.leaves
        )
        scalars = program.scalar_values()
        return cls(program, arrays, donated, scalars, out_shardings)

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


def execute(run: Run) -> list:
    """Run through the compile cache (compiling on a miss); the outputs, dispatched."""
    refuse_in_bad_fork("running a program")
    executable, hit = compiler.lookup_or_compile(run)
    if config.DEBUG_LEVEL.value:
        compiler.analyze(run, executable, hit)
    if executable.lockstep:
        _after_lockstep_programs()
    start = time.perf_counter_ns()
    outputs = executable(run.arrays, run.donated, run.scalars)
    if executable.lockstep:
        _LOCKSTEP_OUTPUTS[:] = [weakref.ref(out) for out in outputs]
    # PyTorch/XLA's names: a program over several devices is a replicated execution; an eager
    # op's on one device has its own name.
    name = "ExecuteReplicatedTime" if executable.devices > 1 else _EXECUTE[current().eager]
    counters.record(name, time.perf_counter_ns() - start)
    counters.record("TensorsGraphSize", len(run.program.nodes))
    return outputs


_EXECUTE = {False: "ExecuteTime", True: "EagerOpExecuteTime"}

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
    return Run(first.program, arrays, donated, scalars, replicas=mesh)


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
