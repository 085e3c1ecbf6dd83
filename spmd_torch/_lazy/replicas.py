"""The world of ``launch``'s replicas: threads that take turns at running Python, and meet at
barriers and rendezvous.

Each replica is a thread running its own ``Engine`` in replica mode (modes.Replica) on its own
device. Replicas take turns running Python, as the processes they stand for would run side by
side: one holds the turn and hands it on, round-robin, whenever it waits (at a barrier, a
rendezvous, or for data). The torch CPU RNG travels with the turn, so each replica draws from its
own stream as a process would, and a run is deterministic.

At a barrier each replica hands in its run (run.Run). Once no replica runs, the world resolves the
waits in the last one's thread: runs that share a key become ONE run over the mesh of their
devices (``run.stacked``), compiled once whatever their number. Collectives
(lowering/collectives.py) are jax collectives over that mesh's axis, so a program holding one runs
only when every replica traced it; anything else is an error naming the replicas and the
collective, never a hang. A replica that raises ends every other replica's wait with
``ReplicaAborted``.
"""

from __future__ import annotations

import contextlib
import pickle
import threading
from dataclasses import dataclass

import jax
import numpy as np
import torch
from jax._src import distributed  # the job's key-value store: no public API
from jax.sharding import Mesh

from spmd_torch import config

from . import compile as compiler
from . import run as runs
from .engine import CompileCache
from .lowering.collectives import REPLICA_AXIS
from .transfer import ReplicaShard

# How long a rendezvous waits for other hosts' replicas (as long as the job's start-up may take).
_REMOTE_WAIT_MS = config.INIT_TIMEOUT_S.value * 1000


class ReplicaAborted(BaseException):
    """Ends a replica whose world stopped because another replica failed. A BaseException, so a
    script's ``except Exception`` does not swallow it."""


class CollectiveMismatchError(RuntimeError):
    """Replicas reached a barrier whose collectives not all of them run."""


class RendezvousError(RuntimeError):
    """Replicas met at different rendezvous, or one left the world while others waited."""


@dataclass
class _Rendezvous:
    tag: str
    payload: object
    participants: tuple


class World:
    """The replicas of one launch: whose turn it is, what each waits for, and the answers."""

    def __init__(self, devices: list, cache: CompileCache, local: list | None = None):
        self.size = len(devices)  # replicas of the whole job, numbered along the devices
        self.mesh = Mesh(np.array(devices), (REPLICA_AXIS,))
        self.local = tuple(sorted(range(self.size) if local is None else local))  # this host's
        self.cache = cache
        self.lock = threading.Lock()
        # One condition per replica, so handing the turn on wakes just the replica it goes to.
        self.wakeups = [threading.Condition(self.lock) for _ in range(self.size)]
        self.turn: int | None = None  # the replica running Python now
        self.last_turn = -1
        self.ready = set(self.local)  # replicas wanting the turn: all, at the start
        self.away: set = set()  # replicas waiting for something outside (data); they come back
        self.waits: dict = {}  # ordinal -> run.Run | _Rendezvous
        self.answers: dict = {}  # ordinal -> the result of its wait, or an error to raise
        self.done: set = set()
        self.failure: tuple | None = None  # (ordinal, exception) of the first replica to fail
        self.meetings: dict = {}  # tag -> rendezvous held with other hosts' replicas so far

    # --- turns ---------------------------------------------------------------------------------

    def start(self, replica) -> None:
        """Wait for the replica's first turn (every replica is ready from the start)."""
        with self.lock:
            self._pass_turn()
            self._await_turn(replica)

    def finish(self, replica) -> None:
        with self.lock:
            self.done.add(replica.ordinal)
            self._give_turn(replica)
            self._resolve()
            self._pass_turn()

    def fail(self, replica, error: BaseException) -> None:
        with self.lock:
            if self.failure is None:
                self.failure = (replica.ordinal, error)
            self.done.add(replica.ordinal)
            if self.turn == replica.ordinal:
                self.turn = None
            for wakeup in self.wakeups:
                wakeup.notify()

    @contextlib.contextmanager
    def stepped_away(self, replica):
        """Around a wait outside the world (for data): the turn goes on, the replica stays in."""
        with self.lock:
            self.away.add(replica.ordinal)
            self._give_turn(replica)
            self._pass_turn()
        try:
            yield
        finally:
            with self.lock:
                self.away.discard(replica.ordinal)
                self.ready.add(replica.ordinal)
                self._pass_turn()
                self._await_turn(replica)

    def _give_turn(self, replica) -> None:
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

    def _await_turn(self, replica) -> None:
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

    def rendezvous(self, replica, tag: str, payload, participants: list) -> list:
        """Every participant's payload, in ordinal order, once all of them arrived at ``tag``."""
        participants = tuple(sorted(participants)) if participants else tuple(range(self.size))
        if replica.ordinal not in participants:
            raise RendezvousError(
                f"rendezvous {tag!r}: replica {replica.ordinal} is not among its replicas "
                f"{list(participants)}"
            )
        return self.wait(replica, _Rendezvous(tag, payload, participants))

    def run_alone(self, replica, run: runs.Run) -> list:
        """Run a collective-free run of this replica's on its own device, now."""
        return self._run([(replica.ordinal, run)])[replica.ordinal]

    def wait(self, replica, wait) -> object:
        """Hand in a run (a barrier: this replica's outputs, once every replica's ran) or a
        rendezvous; the answer once the other replicas' waits resolve it."""
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
        barriers = {k: w for k, w in self.waits.items() if type(w) is runs.Run}
        others = {k: w for k, w in self.waits.items() if type(w) is not runs.Run}
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
            if sorted(arrived) != [k for k in participants if k in self.local]:
                continue
            tags = {self.waits[k].tag for k in arrived}
            payloads = {k: self.waits[k].payload for k in arrived}
            try:
                if len(tags) > 1:
                    raise RendezvousError(
                        f"replicas met at different rendezvous: {self._at(arrived)}"
                    )
                if len(arrived) < len(participants):
                    payloads = self._from_other_hosts(tags.pop(), participants, payloads)
                answer = [payloads[k] for k in participants]
            except RendezvousError as error:
                answer = error
            for k in arrived:
                self._answer(k, answer if isinstance(answer, BaseException) else list(answer))

    def _from_other_hosts(self, tag: str, participants: tuple, mine: dict) -> dict:
        """The payloads of the participants on other hosts."""
        count = self.meetings[tag] = self.meetings.get(tag, 0) + 1
        others = {self.mesh.devices.flat[k].process_index for k in participants}
        return across_hosts(f"{tag}/{count}", mine, others - {jax.process_index()})

    def _stuck(self, wait: _Rendezvous, others: dict) -> RendezvousError:
        missing = [k for k in wait.participants if k in self.local and k not in others]
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
        """A program with collectives that not every replica runs: fail every waiting replica.
        The message leads with where the first two programs part, then groups the replicas
        that run the same collectives."""
        programs: dict = {}
        runs_of: dict = {}
        for ordinal, wait in sorted(barriers.items()):
            programs.setdefault(wait.key, []).append(ordinal)
            runs_of.setdefault(tuple(wait.collectives), []).append(ordinal)
        lines = []
        if len(programs) > 1:
            (a, *_), (b, *_) = list(programs.values())[:2]
            difference = _difference(barriers[a], barriers[b])
            lines.append(f"replica {a}'s and replica {b}'s programs part at {difference}")
        if len(runs_of) == 1 and len(programs) > 1:
            (collectives,) = runs_of
            lines.append(
                f"every replica runs [{', '.join(collectives)}], but each of {len(programs)} "
                f"groups of replicas traced another program: the graph depends on the ordinal "
                f"(a shape or a non-scalar constant that differs by replica): "
                + ", ".join(str(ks) for ks in programs.values())
            )
        else:
            lines += [
                f"replicas {ks} run [{', '.join(collectives) or 'no collective'}]"
                for collectives, ks in runs_of.items()
            ]
        if others:
            lines.append(self._at(list(others)))
        if self.done:
            lines.append(f"replicas {sorted(self.done)} returned from the launched function")
        error = CollectiveMismatchError(
            "replicas disagree at a barrier with collectives: " + "; ".join(lines)
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
                results = self._run(group)
            except Exception as error:  # a compile or run error: every replica raises it
                results = {k: error for k, _ in group}
            for ordinal, result in results.items():
                self._answer(ordinal, result)

    def _run(self, group: list) -> dict:
        """One run for the replicas of ``group`` (equal keys), on the mesh of their devices."""
        ordinals = [k for k, _ in group]
        mesh = self.mesh if len(group) == len(self.local) else self._submesh(ordinals)
        outputs = runs.execute(runs.stacked([run for _, run in group], mesh))
        return {k: [ReplicaShard(out, p) for out in outputs] for p, k in enumerate(ordinals)}

    def _submesh(self, ordinals: list) -> Mesh:
        return Mesh(np.array([self.mesh.devices.flat[k] for k in ordinals]), (REPLICA_AXIS,))


def across_hosts(key: str, mine: dict, hosts: set) -> dict:
    """``mine`` merged with what ``hosts`` posted under ``key``, through the job's key-value
    store (JAX's coordination service): each host posts its part and reads the others'."""
    client = distributed.global_state.client
    prefix = f"spmd_torch/rendezvous/{key}/"
    client.key_value_set_bytes(f"{prefix}{jax.process_index()}", pickle.dumps(mine))
    merged = dict(mine)
    for host in sorted(hosts):
        try:
            blob = client.blocking_key_value_get_bytes(f"{prefix}{host}", _REMOTE_WAIT_MS)
        except Exception as error:  # noqa: BLE001 - the runtime's timeout, named below
            raise RendezvousError(
                f"rendezvous {key!r}: host {host} did not arrive within "
                f"{_REMOTE_WAIT_MS // 1000} s ({type(error).__name__})"
            ) from error
        merged |= pickle.loads(blob)
    return merged


def _difference(a: runs.Run, b: runs.Run) -> str:
    """Where two replicas' programs part: the first differing node (by op and static args)."""
    ops = {id(node.op): node.op for node in a.program.nodes + b.program.nodes}
    if a.key[0] != b.key[0]:
        return compiler.explain_graph_change(a.program.structure(), b.program.structure(), ops)
    return "the inputs' shapes or dtypes, or which inputs are donated"
