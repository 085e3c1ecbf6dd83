"""Running what is pending: gather every live pending tensor, run one program, rebind the results.

``sync()`` returns once the program is dispatched (JAX runs it asynchronously); only reading values
(``.item()``, ``.cpu()``) waits. A read of one pending tensor runs just the part of the graph it
needs, keeping the live values it computes on the way, and leaves the rest pending. How a program
runs is the engine's mode's business (modes.py); ending a training step (closures, the metrics
file) is the barrier's, above the engine.
"""

from __future__ import annotations

import contextlib
import time
import weakref

import jax
import numpy as np
import torch

from spmd_torch import config

from . import counters, manual, modes, placement, rng, stacks, transfer, views  # noqa: F401  (modes: the default mode)
from .engine import current
from .graph import DATA, Arg, Node, linearize
from .lowering import factories
from .record import user_frame
from .run import unfinished_output
from .tensor import LazyTensor, live_pending
from .transfer import PLACEHOLDERS, Placeholder, to_torch

_COMPACT_PENDING_AT = 100_000


def sync(wait: bool = False) -> None:
    """Compile (or reuse) and dispatch one program computing every live pending tensor."""
    engine = current()
    start = (time.perf_counter_ns(), time.thread_time_ns())
    counters.fold_tracing()
    owners = _owners(engine)
    if owners:
        groups = engine.mode.by_device(list(owners.values()), lambda entry: entry[0])
        for device, group in groups:  # one program per device used (xla:0's, unless others are)
            _run(engine, group, device, len(groups) == 1, start)
    engine.born.clear()
    if wait:
        wait_device_ops()


def _run(engine, owners: list, device: int, donate: bool, start: tuple) -> None:
    """One program on xla:``device`` computing ``owners``' values ([(ref, [storages])]), bound to
    their storages; ``donate``: it may give up inputs no live tensor holds (not when another
    program of this barrier may read them). ``start``: when the barrier began, wall and thread
    CPU time: the walk's wall time beyond its CPU time is time the thread waited (for the GIL)."""
    program = linearize([ref for ref, _ in owners], device)
    counters.record("LinearizeTime", time.perf_counter_ns() - start[0])
    counters.record("LinearizeCpuTime", time.thread_time_ns() - start[1])
    _check_may_run(engine)
    # per-device shards stay pending until disable_manual_sharding, values read from a
    # placeholder's (its staged-out graph) for good
    kept = manual.local_nodes(program) | _reading_placeholders(program)
    if kept:
        owners = [entry for entry in owners if id(entry[0][0]) not in kept]
        if not owners:
            return
        program = linearize([ref for ref, _ in owners], device)
    if engine.born and _constants_first(engine, program, kept):
        owners = _still_computed(owners)
        if not owners:
            return
        program = linearize([ref for ref, _ in owners], device)
    with counters.timed("ProgramKeyTime"):
        program.identity  # noqa: B018  (computed once here; every later use reads it)
    # Each output keeps the layout its storage had (see placement.py).
    layouts = tuple(
        placement.output_sharding(holders[0], ref[0].avals[ref[1]]) for ref, holders in owners
    )
    arrays = engine.mode.run(program, donate=donate, out_shardings=layouts, written=owners)
    with counters.timed("BindTime"):
        for (ref, holders), array in zip(owners, arrays):
            node, index = ref
            node.keep(index, array)  # references read before the barrier find it there
            data = Node.data(array, node.avals[index], node.device)
            for storage in holders:
                storage.set((data, 0))
                placement.remember(storage, array)
    # One check per program in flight, not per live output.
    running = [group for group in engine.in_flight if unfinished_output(group) is not None]
    running.append([weakref.ref(a) for a in arrays])
    engine.in_flight = running


def _owners(engine) -> dict:
    """The live pending storages by the value they wait for: (id(node), index) -> (ref,
    [storages]); storages whose value an earlier partial run computed become data."""
    storages = live_pending()  # in write order: the same program gives the same graph
    engine.pending.clear()
    owners: dict = {}
    for storage in storages:
        node, index = storage.ref
        if node.is_leaf(index):
            if node.op != DATA:  # computed by an earlier partial run: drop its history
                _hold_as_data(storage, node.arrays[index])
            continue
        owners.setdefault((id(node), index), (storage.ref, []))[1].append(storage)
    return owners


def _refuse_placeholders(refs: list) -> None:
    """A read that needs a placeholder tensor's value raises before anything runs."""
    for node, index in linearize(refs).leaves:
        if type(node.arrays[index]) is Placeholder:
            raise RuntimeError(node.arrays[index].unreadable())


def _reading_placeholders(program) -> set[int]:
    """ids of ``program``'s nodes whose values depend on a placeholder tensor's, which no program
    can read (xla_builder.create_placeholder_tensor)."""
    if not PLACEHOLDERS:
        return set()
    reading: set[int] = set()
    for node in program.nodes:
        for source, i in node.src:
            if id(source) in reading or (
                source.arrays is not None and type(source.arrays[i]) is Placeholder
            ):
                reading.add(id(node))
                break
    return reading


def _constants_first(engine, program, kept: set) -> bool:
    """Make first, as data, the constant fills that began a live storage's value since the last
    barrier and that ``program`` uses (AdamW's ``zeros_like`` moments, a fused step's counters);
    whether there were any. The step's program then reads that state as an input, as every
    later step's program does: the first step compiles the program the next steps run, where it
    used to compile one holding the fills and the second step another one. Each is made on the
    host and placed (``transfer.constant``), no program compiled for them. Fills of a pending
    tensor's shape (``zeros_like`` of a value not yet computed) and the fills the barrier leaves
    pending (``kept``: per-device shards inside an open manual region) stay in the program."""
    if not engine.mode.runs_side_programs:
        return False
    landing = engine.mode.landing_on(program.device)
    made = False
    for weak_storage, weak_node, index in engine.born:
        storage, node = weak_storage(), weak_node()
        if storage is None or node is None or id(node) not in program.index or id(node) in kept:
            continue
        if node.is_leaf(index) or not all(source.is_known(i) for source, i in node.src):
            continue
        layout = placement.output_sharding(storage, node.avals[index])
        written_since = storage.ref[0] is not node
        if written_since:  # its new value takes over the fill's buffer (compile.aliasing_of)
            storage.overwrote = (id(node), index)
            # Unmarked: replicated, the layout it keeps (placement.remember), so the step's
            # program writes it back as the next step's does.
            layout = layout or engine.mode.replicated
        value = factories.constant_value(node.op, node.args)
        if type(value) is Arg:  # a lifted fill value (dispatch._LIFTED_AT): its scalar's number
            value = node.src[value.index][0].args[0]
        node.keep(index, transfer.constant(node.avals[index], value, layout or landing))
        node.become_data()
        if written_since:
            placement.remember(storage, node.arrays[index])
        made = True
    return made


def _still_computed(owners: list) -> list:
    """``owners`` whose values are still to compute; the others (a fill nothing wrote since:
    ``_constants_first`` made its node data) keep their storages as they are."""
    left = []
    for ref, storages in owners:
        node, index = ref
        if not node.is_leaf(index):
            left.append((ref, storages))
            continue
        for storage in storages:
            placement.remember(storage, node.arrays[index])
    return left


def _hold_as_data(storage, array: jax.Array) -> None:
    """Make a computed value its storage's data, as the barrier leaves a program's outputs."""
    node, index = storage.ref
    storage.set((Node.data(array, node.avals[index], node.device), 0))
    placement.remember(storage, array)


def compute_now(tensors: list[LazyTensor]) -> None:
    """Compute ``tensors`` (none of them a view) as one program now and hold each value as
    data: the step's program then reads them as inputs, as every later step's does. Inside a
    region that must trace one graph (a compiled graph, a loop body) they stay pending."""
    if not tensors or current().one_graph is not None:
        return
    for t, array in zip(tensors, materialize(tensors)):
        _hold_as_data(t._storage, array)


def stack_counters(values: list) -> None:
    """A fused or capturable optimizer's step counters made one stack (``stacks.
    counters_stacked``), computed now where that takes a program: where the mode may run one
    before the step, and not inside a region that traces one graph (a compiled graph's
    placeholders stand for tensors that live outside it). The lazy step's first ``+1`` and the
    counters Dynamo moves to the device come here alike."""
    engine = current()
    if engine.mode.runs_side_programs and engine.one_graph is None:
        whole, now = stacks.counters_stacked(values)
        if now and whole is not None:
            compute_now([whole])


def materialize(tensors: list[LazyTensor]) -> list[jax.Array]:
    """The arrays of ``tensors``, running only the part of the graph they need (no donation);
    each gets its tensor's layout, as at the barrier, so reading mid-step changes no layout.

    A view through a select or a slice is read from its storage's value, computed first if
    pending (it is live, so the barrier would compute it anyway), together with the live values
    of the same op (a scan's backward gives every stacked gradient): reading each layer's
    gradient then runs the backward once and one small program per shape of slice
    (views.read_by_index), instead of the whole computation once per layer."""
    refs = [t._ref() for t in tensors]
    layouts = {
        (id(ref[0]), ref[1]): placement.output_sharding(t._storage, ref[0].avals[ref[1]])
        for t, ref in zip(tensors, refs)
        if t._view is None
    }
    bases = {id(t._storage.ref[0]) for t in tensors if t._view and views.indexed(t._view)}
    if not bases:
        return materialize_refs(refs, layouts)
    pending = [s for s in live_pending() if id(s.ref[0]) in bases]
    layouts.update(
        ((id(s.ref[0]), s.ref[1]), placement.output_sharding(s, s.aval)) for s in pending
    )
    direct = [r for t, r in zip(tensors, refs) if not (t._view and views.indexed(t._view))]
    materialize_refs(direct + [s.ref for s in pending], layouts)
    return materialize_refs(refs)


def global_array(t: LazyTensor) -> jax.Array:
    """``t``'s device array, computed if pending; padded at the end when its sharding is uneven."""
    (array,) = materialize([t])
    return array


def materialize_refs(refs: list, layouts: dict | None = None) -> list[jax.Array]:
    """The arrays of graph references, computing only what they need (no donation) and
    keeping the live values computed on the way (``_held_on_the_way``); ``layouts`` maps
    (id(node), index) to the sharding an output must have."""
    engine = current()
    if len(engine.pending) > _COMPACT_PENDING_AT:  # programs that read values, never sync()
        _still_pending(engine)
    missing = list({(id(n), i): (n, i) for n, i in refs if not n.is_leaf(i)}.values())
    if missing:
        _check_may_run(engine)
        if PLACEHOLDERS:
            _refuse_placeholders(missing)
        held = _held_on_the_way(missing)
        if held:
            missing += [storage.ref for storage in held]
            layouts = dict(layouts or {})
            layouts.update(
                ((id(s.ref[0]), s.ref[1]), placement.output_sharding(s, s.aval)) for s in held
            )
        read = [
            None if layouts and (id(n), i) in layouts else views.read_by_index((n, i))
            for n, i in missing
        ]
        engine.mode.read([r or ref for r, ref in zip(read, missing)], layouts, sync)
        for (node, index), by_index in zip(missing, read):
            if by_index is not None:
                node.keep(index, by_index[0].arrays[by_index[1]])
    return [placement.resolve(node, index) for node, index in refs]


def _held_on_the_way(missing: list) -> list:
    """The live pending storages whose values a program computing ``missing`` computes on the
    way (one each): read with them, they become data, and later programs read them instead of
    computing them again. A loop that reads a value per iteration while its tensors stay pending
    (LBFGS: a line search over a history of directions) otherwise computed all of its history
    again at every read, in programs that grew with each iteration until the process ran out of
    memory mappings for their code. Per-device shards of an open manual region stay pending."""
    program = linearize(missing)
    local = manual.local_nodes(program)
    wanted = {(id(node), index) for node, index in missing}
    held: dict = {}
    # Compacted here, not only past _COMPACT_PENDING_AT: a loop that reads every iteration and
    # never syncs would walk all of its writes at each read.
    for storage in _still_pending(current()):
        node, index = storage.ref
        key = (id(node), index)
        if id(node) in program.index and key not in wanted and id(node) not in local:
            held.setdefault(key, storage)
    return list(held.values())


def _still_pending(engine) -> list:
    """The live storages whose values are still pending, which become the engine's pending list
    (the dead ones, and those a read computed, dropped)."""
    storages = [s for s in live_pending() if not s.ref[0].is_leaf(s.ref[1])]
    engine.pending = [weakref.ref(s) for s in storages]
    engine.born = [entry for entry in engine.born if entry[0]() is not None]
    return storages


@contextlib.contextmanager
def one_graph(region: str, remedy: str = "move it after the region or pass full_graph=False"):
    """Inside, running a program raises, naming ``region`` and the ``remedy``:
    ``compile(full_graph=True)`` traces one graph, and so do recordings (compiled graphs, loop
    bodies)."""
    engine = current()
    outer, engine.one_graph = engine.one_graph, (region, remedy)
    try:
        yield
    finally:
        engine.one_graph = outer


def _check_may_run(engine) -> None:
    if engine.one_graph is not None:
        region, remedy = engine.one_graph
        raise RuntimeError(
            f"{region} would run a program before its end, at {user_frame()}: a host read "
            "(.item(), .cpu(), print), an op whose output shape depends on data, or a barrier "
            f"inside it; {remedy}"
        )


def to_cpu(t: LazyTensor) -> torch.Tensor:
    """A CPU copy of a device tensor (waits for its value)."""
    if config.DEBUG_LEVEL.value or config.DEBUG_TOOL.value:  # where host reads happen, for the
        # debugging tool's analysis
        counters.note_site("TransferFromDeviceTime", user_frame())
    (array,) = materialize([t])
    return to_torch(array, t.dtype, tuple(t.shape))


def rng_words() -> tuple[int, int]:
    """The device PRNG key as two 32-bit words; computes pending random ops' key if needed."""
    (array,) = materialize_refs([rng.state().ref])
    high, low = (int(word) for word in np.asarray(array).reshape(-1))
    return high, low


def wait_device_ops() -> None:
    """Block until every dispatched program has finished (and its ExecuteTime is recorded)."""
    for outputs in current().in_flight:
        output = unfinished_output(outputs)
        if output is not None:
            output.block_until_ready()
    counters.settle()
