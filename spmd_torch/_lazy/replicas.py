"""The replicas of ``launch``: threads that each trace their own graph, and the barrier that runs
all their graphs as one program.

Each replica is a thread running its own ``Engine`` (``Engine.replica``) on its own device.
Replicas take turns running Python, as the processes they stand for would run side by side: one
holds the turn and hands it on, round-robin, whenever it waits (at a barrier, a rendezvous, or for
data). The torch CPU RNG travels with the turn, so each replica draws from its own stream as a
process would, and a run is deterministic.

At a barrier each replica hands in its linearised program. Once no replica runs, the world
resolves the waits in the last one's thread: replicas whose programs share a key run as ONE
``jax.shard_map`` over the mesh of their devices, compiled once whatever their number. An input
is the replicas' arrays stacked along the mesh axis (free when they are the blocks of one earlier
output), an output the replicas' results stacked (``transfer.ReplicaShard``). Collectives
(lowering/collectives.py) are jax collectives over that axis, so a program holding one runs only
when every replica traced it; anything else is an error naming the replicas and the collective,
never a hang. A replica that raises ends every other replica's wait with ``ReplicaAborted``.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import jax
import numpy as np
import torch
from jax.sharding import Mesh

from . import compile as compiler
from . import config, counters
from .collective import COLLECTIVES
from .engine import CompileCache, Engine, current
from .graph import DATA, Program
from .lowering.collectives import REPLICA_AXIS
from .transfer import OnReplica, ReplicaShard


class ReplicaAborted(BaseException):
    """Ends a replica whose world stopped because another replica failed. A BaseException, so a
    script's ``except Exception`` does not swallow it."""


class CollectiveMismatchError(RuntimeError):
    """Replicas reached a barrier whose collectives not all of them run."""


class RendezvousError(RuntimeError):
    """Replicas met at different rendezvous, or one left the world while others waited."""


class Replica:
    """One replica: its ordinal, its device (where its uploads land) and its torch CPU RNG."""

    __slots__ = ("world", "ordinal", "landing", "cpu_rng")

    def __init__(self, world: World, ordinal: int, device: jax.Device, cpu_rng: torch.Tensor):
        self.world = world
        self.ordinal = ordinal
        self.landing = OnReplica(device)
        self.cpu_rng = cpu_rng


@dataclass
class _Barrier:
    """A replica's program at a barrier, with everything the merged run needs of it."""

    program: Program
    arrays: list  # the leaves' stacked arrays or ReplicaShards
    donated: tuple
    scalars: np.ndarray
    key: tuple  # programs with equal keys run as one
    collectives: list  # names of the collectives it runs, in order


@dataclass
class _Rendezvous:
    tag: str
    payload: object
    participants: tuple


def _barrier_of(program: Program, donated: tuple) -> _Barrier:
    arrays = [node.arrays[i] for node, i in program.leaves]
    scalars = np.array([node.args[0] for node in program.scalars], dtype=np.float64)
    key = (program.structure(), tuple(n.avals[i] for n, i in program.leaves), donated)
    collectives = [str(node.op) for node in program.nodes if node.op in COLLECTIVES]
    return _Barrier(program, arrays, donated, scalars, key, collectives)


class World:
    """The replicas of one launch: whose turn it is, what each waits for, and the answers."""

    def __init__(self, devices: list, cache: CompileCache):
        self.size = len(devices)
        self.mesh = Mesh(np.array(devices), (REPLICA_AXIS,))
        self.cache = cache
        self.lock = threading.Lock()
        # One condition per replica, so handing the turn on wakes just the replica it goes to.
        self.wakeups = [threading.Condition(self.lock) for _ in range(self.size)]
        self.turn: int | None = None  # the replica running Python now
        self.last_turn = -1
        self.ready = set(range(self.size))  # replicas wanting the turn: all, at the start
        self.away: set = set()  # replicas waiting for something outside (data); they come back
        self.waits: dict = {}  # ordinal -> _Barrier | _Rendezvous
        self.answers: dict = {}  # ordinal -> the result of its wait, or an error to raise
        self.done: set = set()
        self.failure: tuple | None = None  # (ordinal, exception) of the first replica to fail

    def engine(self, ordinal: int) -> Engine:
        """A fresh engine for replica ``ordinal``, starting from the caller's CPU RNG state."""
        device = self.mesh.devices.flat[ordinal]
        replica = Replica(self, ordinal, device, torch.get_rng_state())
        return Engine(cache=self.cache, replica=replica)

    # --- turns ---------------------------------------------------------------------------------

    def start(self, replica: Replica) -> None:
        """Wait for the replica's first turn (every replica is ready from the start)."""
        with self.lock:
            self._pass_turn()
            self._await_turn(replica)

    def finish(self, replica: Replica) -> None:
        with self.lock:
            self.done.add(replica.ordinal)
            self._give_turn(replica)
            self._resolve()
            self._pass_turn()

    def fail(self, replica: Replica, error: BaseException) -> None:
        with self.lock:
            if self.failure is None:
                self.failure = (replica.ordinal, error)
            self.done.add(replica.ordinal)
            if self.turn == replica.ordinal:
                self.turn = None
            for wakeup in self.wakeups:
                wakeup.notify()

    def step_away(self, replica: Replica) -> None:
        """Give the turn up while waiting outside the world (for data), without leaving it."""
        with self.lock:
            self.away.add(replica.ordinal)
            self._give_turn(replica)
            self._pass_turn()

    def come_back(self, replica: Replica) -> None:
        with self.lock:
            self.away.discard(replica.ordinal)
            self.ready.add(replica.ordinal)
            self._pass_turn()
            self._await_turn(replica)

    def _give_turn(self, replica: Replica) -> None:
        replica.cpu_rng = torch.get_rng_state()
        self.turn = None

    def _pass_turn(self) -> None:
        """Hand a free turn to the next ready replica after the last holder (round-robin)."""
        if self.turn is not None or not self.ready or self.failure is not None:
            return
        following = min(self.ready, key=lambda k: (k - self.last_turn - 1) % self.size)
        self.ready.discard(following)
        self.turn = self.last_turn = following
        self.wakeups[following].notify()

    def _await_turn(self, replica: Replica) -> None:
        while self.turn != replica.ordinal:
            if self.failure is not None:
                ordinal, error = self.failure
                raise ReplicaAborted(
                    f"replica {replica.ordinal} stopped: replica {ordinal} raised "
                    f"{type(error).__name__}: {error}"
                )
            self.wakeups[replica.ordinal].wait()
        torch.set_rng_state(replica.cpu_rng)

    # --- waits ---------------------------------------------------------------------------------

    def barrier(self, replica: Replica, program: Program, donated: tuple) -> list:
        """Run ``program`` with the other replicas' programs; this replica's outputs."""
        return self._wait(replica, _barrier_of(program, donated))

    def rendezvous(self, replica: Replica, tag: str, payload, participants: list) -> list:
        """Every participant's payload, in ordinal order, once all of them arrived at ``tag``."""
        participants = tuple(sorted(participants)) if participants else tuple(range(self.size))
        if replica.ordinal not in participants:
            raise RendezvousError(
                f"rendezvous {tag!r}: replica {replica.ordinal} is not among its replicas "
                f"{list(participants)}"
            )
        return self._wait(replica, _Rendezvous(tag, payload, participants))

    def run_alone(self, replica: Replica, program: Program) -> list:
        """Run a collective-free program of this replica's on its own device, now."""
        wait = _barrier_of(program, (False,) * len(program.leaves))
        return self._run([(replica.ordinal, wait)], {replica.ordinal: 0})[replica.ordinal]

    def _wait(self, replica: Replica, wait) -> object:
        with self.lock:
            self.waits[replica.ordinal] = wait
            self._give_turn(replica)
            self._resolve()
            self._pass_turn()
            self._await_turn(replica)
            answer = self.answers.pop(replica.ordinal)
        if isinstance(answer, BaseException):
            raise answer
        return answer

    def _answer(self, ordinal: int, answer) -> None:
        del self.waits[ordinal]
        self.answers[ordinal] = answer
        self.ready.add(ordinal)

    def _resolve(self) -> None:
        """Answer whatever waits can be answered now (lock held)."""
        if self.failure is not None:
            return
        self._meet_rendezvous()
        if self.turn is not None or self.ready or self.away or not self.waits:
            return  # someone still runs: it may join the waits
        barriers = {k: w for k, w in self.waits.items() if type(w) is _Barrier}
        others = {k: w for k, w in self.waits.items() if type(w) is not _Barrier}
        if barriers:
            blocking = [k for k, w in barriers.items() if w.collectives]
            if blocking and (others or self.done):
                self._mismatch(barriers, others)
                return
            self._run_barriers(barriers)
            return
        for ordinal, wait in others.items():
            self._answer(ordinal, self._stuck(wait, others))

    def _meet_rendezvous(self) -> None:
        """Answer each rendezvous all of whose participants arrived (with one tag)."""
        meetings = {}
        for ordinal, wait in self.waits.items():
            if type(wait) is _Rendezvous:
                meetings.setdefault(wait.participants, []).append(ordinal)
        for participants, arrived in meetings.items():
            if sorted(arrived) != list(participants):
                continue
            tags = {self.waits[k].tag for k in arrived}
            if len(tags) > 1:
                error = RendezvousError(
                    f"replicas met at different rendezvous: {self._at(arrived)}"
                )
                for k in arrived:
                    self._answer(k, error)
                continue
            payloads = [self.waits[k].payload for k in participants]
            for k in arrived:
                self._answer(k, list(payloads))

    def _stuck(self, wait: _Rendezvous, others: dict) -> RendezvousError:
        missing = [k for k in wait.participants if k not in others]
        return RendezvousError(
            f"rendezvous {wait.tag!r} waits for replicas {missing}, which returned from the "
            f"launched function or wait elsewhere: {self._at(list(others))}"
        )

    def _at(self, ordinals: list) -> str:
        places = {}
        for k in sorted(ordinals):
            wait = self.waits[k]
            place = f"rendezvous {wait.tag!r}" if type(wait) is _Rendezvous else "a barrier"
            places.setdefault(place, []).append(k)
        return "; ".join(f"replicas {ks} at {place}" for place, ks in places.items())

    def _mismatch(self, barriers: dict, others: dict) -> None:
        """A program with collectives that not every replica runs: fail every waiting replica."""
        groups: dict = {}
        for ordinal, wait in sorted(barriers.items()):
            groups.setdefault(wait.key, []).append(ordinal)
        lines = [
            f"replicas {ks} run [{', '.join(barriers[ks[0]].collectives) or 'no collective'}]"
            for ks in groups.values()
        ]
        if len(groups) > 1:
            lines.append(
                "first difference: " + _difference(*[barriers[ks[0]] for ks in groups.values()][:2])
            )
        if others:
            lines.append(self._at(list(others)))
        if self.done:
            lines.append(f"replicas {sorted(self.done)} returned from the launched function")
        error = CollectiveMismatchError(
            "replicas disagree at a barrier with collectives (did one skip a collective, or "
            "trace an ordinal-dependent graph?): " + "; ".join(lines)
        )
        for ordinal in list(self.waits):
            self._answer(ordinal, error)

    def _run_barriers(self, barriers: dict) -> None:
        """Run the waiting programs: one program per distinct key (all replicas share one when
        there are collectives: ``_resolve`` checked)."""
        groups: dict = {}
        for ordinal, wait in sorted(barriers.items()):
            groups.setdefault(wait.key, []).append((ordinal, wait))
        if len(groups) > 1 and any(w.collectives for w in barriers.values()):
            self._mismatch(barriers, {})
            return
        for group in groups.values():
            try:
                results = self._run(group, {k: p for p, (k, _) in enumerate(group)})
            except Exception as error:  # a compile or run error: every replica raises it
                results = {k: error for k, _ in group}
            for ordinal, result in results.items():
                self._answer(ordinal, result)

    def _run(self, group: list, position: dict) -> dict:
        """One program for the replicas of ``group`` (equal keys), on the mesh of their devices."""
        ordinals = [k for k, _ in group]
        mesh = self.mesh if len(group) == self.size else self._submesh(ordinals)
        layout = compiler.stacked(mesh)
        waits = [w for _, w in group]
        first = waits[0]
        arrays = [
            _stacked([w.arrays[i] for w in waits], mesh, layout) for i in range(len(first.arrays))
        ]
        donated = tuple(all(w.donated[i] for w in waits) for i in range(len(arrays)))
        scalars = jax.device_put(np.stack([w.scalars for w in waits]), layout)
        structure = first.key[0]  # computed once, at the barrier
        executable, hit = compiler.lookup_or_compile(
            first.program, arrays, donated, replicas=mesh, structure=structure
        )
        if config.DEBUG_LEVEL.value:
            compiler.debug_line(first.program, executable, hit)
        with counters.timed("ExecuteTime"):
            outputs = executable(arrays, donated, scalars)
        return {k: [ReplicaShard(out, position[k]) for out in outputs] for k in ordinals}

    def _submesh(self, ordinals: list) -> Mesh:
        return Mesh(np.array([self.mesh.devices.flat[k] for k in ordinals]), (REPLICA_AXIS,))


def _difference(a: _Barrier, b: _Barrier) -> str:
    """Where two replicas' programs part: the first differing node (by op and static args)."""
    ops = {id(node.op): node.op for node in a.program.nodes + b.program.nodes}
    if a.key[0] != b.key[0]:
        return compiler.explain_graph_change(a.key[0], b.key[0], ops)
    return "the inputs' shapes or dtypes, or which inputs are donated"


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
            return whole
    local = [b.local() if type(b) is ReplicaShard else b for b in blocks]
    shape = (len(local),) + tuple(local[0].shape[1:])
    return jax.make_array_from_single_device_arrays(shape, layout, local)


# --- what a replica's thread calls --------------------------------------------------------------


def barrier(program: Program, donate: bool) -> list:
    """The calling replica's part in a barrier: its outputs once every replica's program ran."""
    replica = current().replica
    donated = tuple(donate and node.op == DATA and node.holders == 0 for node, _ in program.leaves)
    return replica.world.barrier(replica, program, donated)


def run_alone(program: Program) -> list:
    replica = current().replica
    return replica.world.run_alone(replica, program)


class away:
    """``with away():`` around a wait for something outside the world (a loader's next batch)
    lets the other replicas run meanwhile; a no-op outside a replica."""

    def __enter__(self):
        self.replica = current().replica
        if self.replica is not None:
            self.replica.world.step_away(self.replica)

    def __exit__(self, *exc):
        if self.replica is not None:
            self.replica.world.come_back(self.replica)
