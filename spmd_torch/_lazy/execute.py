"""The barrier: gather every live pending tensor, run one compiled program, rebind the results.

``sync()`` returns once the program is dispatched (JAX runs it asynchronously); only reading values
(``.item()``, ``.cpu()``) waits. A read of one pending tensor runs just the part of the graph it
needs and leaves the rest pending.
"""

from __future__ import annotations

import contextlib
import time
import weakref
from contextvars import ContextVar

import jax
import numpy as np
import torch

from . import compile as compiler
from . import config, counters, manual, placement, replicas, rng
from .engine import current
from .graph import DATA, Node, Program, linearize, to_text
from .record import user_frame
from .tensor import LazyTensor, live_pending
from .transfer import to_torch

_COMPACT_PENDING_AT = 100_000
# The compile(full_graph=True) region being traced on this thread, where no program may run.
_ONE_GRAPH: ContextVar[str | None] = ContextVar("spmd_torch_one_graph", default=None)


def sync(wait: bool = False, step: bool = True) -> None:
    """Compile (or reuse) and dispatch one program computing every live pending tensor;
    ``step=False`` for a barrier that is no training step (eager mode's one per op)."""
    if step:
        counters.bump("MarkStep")
    engine = current()
    storages = live_pending()  # in write order: the same program gives the same graph
    engine.pending.clear()
    owners: dict = {}  # (id(node), index) -> (ref, [storages])
    for storage in storages:
        node, index = storage.ref
        if node.is_leaf(index):
            if node.op != DATA:  # computed by an earlier partial run: drop its history
                array = node.arrays[index]
                storage.set((Node.data(array, node.avals[index]), 0))
                if placement.spmd_enabled():
                    placement.remember(storage, array)
            continue
        owners.setdefault((id(node), index), (storage.ref, []))[1].append(storage)
    if not owners:
        return
    _check_may_run()
    program = linearize([ref for ref, _ in owners.values()])
    if engine.replica is not None:
        results = replicas.barrier(program, donate=True)
        _bind(owners, results, keep_on_nodes=True)
        engine.in_flight = [weakref.ref(shard.stacked) for shard in results]
        return
    local = manual.local_nodes(program)
    if local:  # per-device shards stay pending until disable_manual_sharding
        owners = {key: entry for key, entry in owners.items() if id(entry[0][0]) not in local}
        if not owners:
            return
        program = linearize([ref for ref, _ in owners.values()])
    spmd = placement.spmd_enabled()
    shardings = None
    if spmd:  # each output keeps the layout its storage had (see placement.py)
        shardings = tuple(
            placement.output_sharding(holders[0], ref[0].avals[ref[1]])
            for ref, holders in owners.values()
        )
    arrays = run(program, donate=True, out_shardings=shardings)
    _bind(owners, arrays)
    if wait:
        jax.block_until_ready(arrays)


def _bind(owners: dict, arrays: list, keep_on_nodes: bool = False) -> None:
    """Give each storage its computed value; ``keep_on_nodes`` also leaves it on the computed
    node, so that references read before the barrier (a replica's partial read) find it."""
    spmd = placement.spmd_enabled()
    for (ref, holders), array in zip(owners.values(), arrays):
        node, index = ref
        if keep_on_nodes:
            _keep(node, index, array)
        data = Node.data(array, node.avals[index])
        for storage in holders:
            storage.set((data, 0))
            if spmd:
                placement.remember(storage, array)


def run(program: Program, donate: bool, out_shardings: tuple | None = None) -> list:
    """Compute a linearised graph; donates inputs no live tensor holds any more when ``donate``.

    ``out_shardings`` constrains each output's layout (None entries: the partitioner decides).
    """
    arrays = [node.arrays[i] for node, i in program.leaves]
    if placement.spmd_enabled():
        arrays = placement.onto_spmd_devices(program.leaves, arrays)
    donated = tuple(donate and node.op == DATA and node.holders == 0 for node, _ in program.leaves)
    executable, hit = compiler.lookup_or_compile(program, arrays, donated, out_shardings)
    if config.DEBUG_LEVEL.value:
        compiler.debug_line(program, executable, hit)
    scalars = np.array([node.args[0] for node in program.scalars], dtype=np.float64)
    start = time.perf_counter_ns()
    outputs = executable(arrays, donated, scalars)
    # PyTorch/XLA's names: a program over the SPMD devices is a replicated execution.
    replicated = "ExecuteReplicatedTime" if placement.spmd_enabled() else "ExecuteTime"
    counters.record(replicated, time.perf_counter_ns() - start)
    counters.record("TensorsGraphSize", len(program.nodes))
    current().in_flight = [weakref.ref(a) for a in outputs]
    return outputs


def materialize(tensors: list[LazyTensor]) -> list[jax.Array]:
    """The arrays of ``tensors``, running only the part of the graph they need (no donation);
    each gets its tensor's layout, as at the barrier, so reading mid-step changes no layout."""
    refs = [t._ref() for t in tensors]
    layouts = None
    if placement.spmd_enabled():
        layouts = {
            (id(ref[0]), ref[1]): placement.output_sharding(t._storage, ref[0].avals[ref[1]])
            for t, ref in zip(tensors, refs)
            if t._view is None
        }
    return materialize_refs(refs, layouts)


def global_array(t: LazyTensor) -> jax.Array:
    """``t``'s device array, computed if pending; padded at the end when its sharding is uneven."""
    (array,) = materialize([t])
    return array


def materialize_refs(refs: list, layouts: dict | None = None) -> list[jax.Array]:
    """The arrays of graph references, computing only what they need (no donation);
    ``layouts`` maps (id(node), index) to the sharding an output must have."""
    engine = current()
    if len(engine.pending) > _COMPACT_PENDING_AT:  # programs that read values, never sync()
        engine.pending = [weakref.ref(s) for s in live_pending() if not s.ref[0].is_leaf(s.ref[1])]
    missing = [ref for ref in refs if not ref[0].is_leaf(ref[1])]
    if missing:
        _check_may_run()
    if missing and engine.replica is not None:
        _replica_read(missing)
    elif missing:
        unique = list({(id(n), i): (n, i) for n, i in missing}.values())
        shardings = None
        if layouts:
            shardings = tuple(layouts.get((id(n), i)) for n, i in unique)
        for (node, index), array in zip(unique, run(linearize(unique), False, shardings)):
            _keep(node, index, array)
    return [placement.resolve(node, index) for node, index in refs]


@contextlib.contextmanager
def one_graph(region: str):
    """Inside, running a program raises: ``compile(full_graph=True)`` traces one graph."""
    token = _ONE_GRAPH.set(region)
    try:
        yield
    finally:
        _ONE_GRAPH.reset(token)


def _check_may_run() -> None:
    region = _ONE_GRAPH.get()
    if region is not None:
        raise RuntimeError(
            f"compile region {region!r} (full_graph=True) would run a program before its end, at "
            f"{user_frame()}: a host read (.item(), .cpu(), print), an op whose output shape "
            "depends on data, or a barrier inside the region; move it after the region or pass "
            "full_graph=False"
        )


def _replica_read(missing: list) -> None:
    """A replica reading pending values: a barrier (its collectives need every replica, and the
    others' programs then match); what is left (views of its results) runs on its own device."""
    sync()
    missing = [ref for ref in missing if not ref[0].is_leaf(ref[1])]
    if missing:
        unique = list({(id(n), i): (n, i) for n, i in missing}.values())
        for (node, index), array in zip(unique, replicas.run_alone(linearize(unique))):
            _keep(node, index, array)


def _keep(node: Node, index: int, array) -> None:
    """Leave a computed value on its node: references to it read it from there."""
    if node.arrays is None:
        node.arrays = [None] * len(node.avals)
    node.arrays[index] = array


def to_cpu(t: LazyTensor) -> torch.Tensor:
    """A CPU copy of a device tensor (waits for its value)."""
    (array,) = materialize([t])
    return to_torch(array, t.dtype, tuple(t.shape))


def rng_words() -> tuple[int, int]:
    """The device PRNG key as two 32-bit words; computes pending random ops' key if needed."""
    (array,) = materialize_refs([rng.state().ref])
    high, low = (int(word) for word in np.asarray(array).reshape(-1))
    return high, low


def wait_device_ops() -> None:
    """Block until every dispatched program has finished."""
    outputs = (weak() for weak in current().in_flight)
    jax.block_until_ready([a for a in outputs if a is not None])


def pending_count() -> int:
    """How many live storages of tensors have a value the next barrier computes (the engine's
    own PRNG key is not a tensor: it is left out)."""
    key = current().rng
    return sum(1 for s in live_pending() if s is not key and not s.ref[0].is_leaf(s.ref[1]))


def pending_text(tensors: list[LazyTensor] | None = None) -> str:
    """The pending graph of ``tensors`` (default: all live pending tensors) as text."""
    refs = _pending_refs(tensors)
    return to_text(linearize(refs))


def pending_hlo(tensors: list[LazyTensor] | None = None) -> str:
    """The pending graph of ``tensors`` lowered to StableHLO text (nothing runs)."""
    program = linearize(_pending_refs(tensors))
    return compiler.stablehlo_text(program, [placement.resolve(n, i) for n, i in program.leaves])


def pending_signature() -> tuple:
    """What tells the pending graph's program from others: its structure and input avals."""
    program = linearize(_pending_refs(None))
    return program.structure(), tuple(node.avals[i] for node, i in program.leaves)


def _pending_refs(tensors) -> list:
    if tensors is None:
        refs = [s.ref for s in live_pending() if not s.ref[0].is_leaf(s.ref[1])]
    else:
        refs = [t._ref() for t in tensors]
    return list({(id(n), i): (n, i) for n, i in refs}.values())
