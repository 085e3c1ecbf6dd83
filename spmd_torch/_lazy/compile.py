"""Pending graph -> one JAX function -> ``jax.jit`` executable, cached by the graph's structure.

The cache key is the program's structure (ops, static args, wiring), the inputs' shapes, dtypes and
shardings, which inputs are donated, and the config flags that change programs. Data never enters
the key: device buffers and lifted Python scalars are arguments, so the same step traced again
reuses its executable.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import hashlib
import os
import re
import sys
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import torch
from jax._src import source_info_util  # a traceback as ops' source: no public API
from jax._src.lax.lax import _convert_element_type  # weak-typed casts have no public API
from jax._src.lib.mlir import passmanager  # MLIR's own passes: JAX exposes no public API
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from spmd_torch import config

from . import counters, manual
from .engine import current
from .graph import STRUCTURES, Program, substitute
from .layout import crop, padded
from .lowering import LOWERINGS, attention
from .lowering.collectives import REPLICA_AXIS
from .lowering.dtypes import to_jax_dtype
from .lowering.random import wrap_key
from .record import user_frame, user_frames


def _scalars_aval(n: int, replicas: Mesh | None = None) -> jax.ShapeDtypeStruct:
    """Lifted scalars travel packed in one float64 vector: one transfer, however many there are
    (for replicas, one vector each, stacked)."""
    if replicas is None:
        return jax.ShapeDtypeStruct((n,), jnp.float64)
    return jax.ShapeDtypeStruct((replicas.size, n), jnp.float64, sharding=stacked(replicas))


def scalar_avals(program: Program) -> list[jax.ShapeDtypeStruct]:
    """A program's lifted scalars as inputs of their own, each in its dtype (a tuple's as one
    vector). Sliced out of one packed vector, every fusion reading a number had its own slice,
    reshape and conversion of it (XLA copies cheap producers into each consumer): 3,600 more
    instructions for a 32-layer AdamW step, and 7% more of XLA's compile CPU time."""
    return [jax.ShapeDtypeStruct(shape, kind) for _, _, kind, shape in scalar_parts_of(program)]


def scalar_parts_of(program: Program) -> tuple:
    """Where each of ``program``'s lifted scalars lies in its packed vector, and its input's
    dtype and shape (``Executable.scalar_parts``)."""
    parts, start = [], 0
    for node in program.scalars:
        (aval,) = node.avals
        stop = start + (aval.shape[0] if aval.shape else 1)
        parts.append((start, stop, _SCALAR_KINDS[aval.dtype], aval.shape))
        start = stop
    return tuple(parts)


def unpacked(packed: np.ndarray, parts: tuple) -> list[np.ndarray]:
    """The packed host vector's scalars, one array each, in their dtypes and shapes (``parts``:
    ``scalar_parts_of``'s)."""
    return [packed[a:b].astype(kind).reshape(shape) for a, b, kind, shape in parts]


def stacked(replicas: Mesh) -> NamedSharding:
    """How the replicas' values travel: stacked along the replica axis, one block per device."""
    return NamedSharding(replicas, PartitionSpec(REPLICA_AXIS))


# PyTorch/XLA's name for the time a compile takes, by whether it is an eager op's.
COMPILE_TIME = {False: "CompileTime", True: "EagerOpCompileTime"}

# A collective in an optimized program (the partitioner adds its own).
_COLLECTIVE = re.compile(r"all-reduce|all-gather|reduce-scatter|all-to-all|collective-permute")


class LoweringError(RuntimeError):
    """A lowering returned something other than what PyTorch's meta kernel promised."""


@dataclass
class Executable:
    compiled: Any
    key: str  # short hex digest, for debug lines
    devices: int  # how many devices the program spans
    # Its devices' parts must all run at once: CPU collectives, whose participants each hold a
    # thread of XLA's one CPU thread pool until all of them arrived (see run.execute).
    lockstep: bool
    # (packed scalars' bytes, their parts, where) -> their inputs on the device, least recently
    # used first, shared by the programs of one compile cache: PyTorch/XLA's device data cache
    # for scalars. A step whose scalars did not change (a constant learning rate) uploads
    # nothing, nor does another program with the same scalars; an upload counts
    # DeviceDataCacheMiss and is timed as TransferToDeviceTime, as a tensor's.
    scalars_on_device: dict
    aliasing: Aliasing | None = None  # the donated inputs' and outputs' orders (None: theirs)
    # Where each lifted scalar lies in the packed vector, (start, stop, dtype, shape), for a
    # program taking one input per scalar (``scalar_avals``); None: it takes the packed vector.
    scalar_parts: tuple | None = None
    # Where those inputs are placed (None: the default device); read once here, since
    # ``compiled.input_shardings`` rebuilds the whole tree of them at each read (48 µs at 600).
    scalars_at: Any = None

    def __call__(self, arrays: list, donated: tuple, scalars) -> list:
        """Run on ``arrays`` (the donated ones given up) and the packed scalars."""
        kept = [a for a, d in zip(arrays, donated) if not d]
        if self.aliasing is None:
            given = [a for a, d in zip(arrays, donated) if d]
        else:
            given = [arrays[k] for k in self.aliasing.given]
        if self.scalar_parts is not None:
            scalars = self._scalar_inputs(scalars)
        outputs = self.compiled(given, kept, scalars)
        if self.aliasing is None:
            return outputs
        return [outputs[k] for k in self.aliasing.output_at]

    def _scalar_inputs(self, packed: np.ndarray) -> list:
        """One input per scalar, from the packed host vector: the device cache's for the same
        values, else each number uploaded by one call."""
        parts, where = self.scalar_parts, self.scalars_at
        if not parts:
            return []
        if where is not None and not where.is_fully_addressable:
            # on a pod JAX's device_put checks that every host has the same values, a
            # collective per upload: there the call takes them as they are
            return unpacked(packed, parts)
        key = (packed.tobytes(), parts, where)
        cache = self.scalars_on_device
        inputs = cache.pop(key, None)
        if inputs is None:
            values = unpacked(packed, parts)
            counters.bump("DeviceDataCacheMiss")
            with counters.timed("TransferToDeviceTime"):
                inputs = list(_uploader(tuple((v.dtype, v.shape) for v in values), where)(*values))
            if len(cache) >= _SCALARS_KEPT:
                del cache[next(iter(cache))]  # the oldest
        cache[key] = inputs  # now the latest
        return inputs


@functools.cache
def _uploader(avals: tuple, where) -> Callable:
    """Host values of ``avals`` as device arrays placed ``where`` (None: the default device), in
    one call: a program returning its inputs compiles to nothing (JAX forwards them), and its
    call moves numpy values for a few µs each, where ``jax.device_put`` takes tens."""
    if where is None:
        return jax.jit(lambda *values: values)
    layouts = (where,) * len(avals)
    return jax.jit(lambda *values: values, in_shardings=layouts, out_shardings=layouts)


_SCALARS_KEPT = 64  # packed vectors' worth of lifted scalars kept on the device per cache


class CacheKey(NamedTuple):
    """What makes two programs the same executable; the debug line diffs these parts."""

    structure: int  # the program's identity (graph.STRUCTURES holds the structure itself)
    inputs: tuple
    donated: tuple
    n_scalars: int
    out_shardings: tuple | None
    replicas: tuple | None  # the replicas' devices, for a program each of them runs
    mesh: tuple | None  # the SPMD mesh's devices, for a program over them (even with no input)
    flags: tuple


def cache_key(run) -> CacheKey:
    """The program's identity and what of its inputs the engine's mode says matters."""
    program, mode = run.program, current().mode
    replicas = None if run.replicas is None else tuple(d.id for d in run.replicas.devices.flat)
    return CacheKey(
        program.identity,
        mode.input_key(run),
        run.donated,
        len(program.scalars),
        run.out_shardings,
        replicas,
        mode.mesh_key,
        config.cache_key(),
    )


# --- the program as a JAX function ---------------------------------------------------------------


class _Step(NamedTuple):
    """One call of the interpreter: a lowered node, or a whole manual region."""

    call: Callable  # the values at ``wiring`` -> one value per entry of ``outputs``
    wiring: tuple  # locations of its inputs (Program.locate)
    outputs: tuple  # the locations its results answer for


_SCALAR_KINDS = {torch.float64: np.dtype(np.float64), torch.int64: np.dtype(np.int64)}


def splits_programs() -> bool:
    """Whether XLA's partitioner splits the current mode's programs over several devices (SPMD):
    attention's fused kernels are traced there as ops with a partitioning rule
    (``attention.partitioned``), whose residuals differ from the kernels'."""
    replicated = current().mode.replicated
    return replicated is not None and replicated.num_devices > 1


def build_function(
    program: Program,
    donated: tuple,
    out_shardings: tuple | None = None,
    aliasing: Aliasing | None = None,
    packed: bool = True,
) -> Callable:
    """The program as a function of (donated inputs, kept inputs, scalars) -> outputs; donated
    inputs and outputs in ``aliasing``'s orders when it is given. The lifted scalars come packed
    in one float64 vector (inside another program, or a replicas' one), else (not ``packed``) as
    one input each (``scalar_avals``).

    Inputs stored padded (an uneven sharding) are cropped to their logical shape first; outputs
    given a sharding are constrained to it, padded when uneven.
    """
    slots = []  # input position -> (is donated, index within its group)
    counts = [0, 0]
    for is_donated in donated:
        slots.append((is_donated, counts[is_donated]))
        counts[is_donated] += 1
    for k, position in enumerate(aliasing.given if aliasing else ()):
        slots[position] = (True, k)
    logical = [node.avals[i].shape for node, i in program.leaves]
    steps = _steps(program)
    outputs = program.located

    parts = scalar_parts_of(program)
    split = splits_programs()

    def run(donated_inputs, kept_inputs, scalar_inputs):
        with attention.partitioned(split):
            return interpreted(donated_inputs, kept_inputs, scalar_inputs)

    def interpreted(donated_inputs, kept_inputs, scalar_inputs):
        groups = (kept_inputs, donated_inputs)
        if packed:
            scalar_inputs = [
                scalar_inputs[a:b] if shape else scalar_inputs[a] for a, b, _, shape in parts
            ]
        # Weakly typed, as Python scalars are: ``x_f32 * lr`` stays float32, ``x_i32 * 3`` int32.
        scalars = [
            _convert_element_type(value, kind, weak_type=True)
            for value, (_, _, kind, _) in zip(scalar_inputs, parts)
        ]

        def read(location):
            if location[0] == "s":
                return scalars[location[1]]
            is_donated, k = slots[location[1]]
            return crop(groups[is_donated][k], logical[location[1]])

        value = _interpret(steps, read)
        values = [value(o) for o in outputs]
        if out_shardings is not None:
            values = [v if s is None else _laid_out(v, s) for v, s in zip(values, out_shardings)]
        return values if aliasing is None else [values[k] for k in aliasing.outputs]

    return run


def build_replica_function(
    program: Program, donated: tuple, replicas: Mesh, aliasing: Aliasing | None = None
) -> Callable:
    """The program run by every replica at once: one ``shard_map`` over the replicas' mesh whose
    inputs, scalars and outputs are the replicas' values stacked along the replica axis; each
    device computes its replica's values (inputs arrive as (1, *shape) blocks, cropped to shape).
    """
    run = build_function(program, donated, aliasing=aliasing)
    spec = PartitionSpec(REPLICA_AXIS)

    def each_replica(donated_inputs, kept_inputs, packed_scalars):
        return [value[None] for value in run(donated_inputs, kept_inputs, packed_scalars[0])]

    return jax.shard_map(
        each_replica, mesh=replicas, in_specs=(spec, spec, spec), out_specs=spec, check_vma=False
    )


def _interpret(steps: list[_Step], read: Callable) -> Callable:
    """Run ``steps`` in order; returns the value at any location (``read`` answers the ones no
    step computed: program inputs, or a region's inputs)."""
    results: dict = {}

    def value(location):
        found = results.get(location)
        return read(location) if found is None else found

    for step in steps:
        results.update(zip(step.outputs, step.call(*[value(w) for w in step.wiring])))
    return value


def _steps(program: Program) -> list[_Step]:
    """The nodes in order, each manual region (if any) contracted to one ``shard_map`` step."""
    plan = manual.plan(program)
    if plan is None:
        return [_node_step(program, k) for k in range(len(program.nodes))]
    order, _ = plan
    return [_node_step(program, k) if type(k) is int else _region_step(program, k) for k in order]


def _node_step(program: Program, k: int) -> _Step:
    node = program.nodes[k]
    avals = tuple((a.shape, to_jax_dtype(a.dtype)) for a in node.avals)
    call = partial(_lower, node.op, node.args, node.kwargs, avals, node.scope, node.where)
    return _Step(call, program.wiring(node), tuple(("n", k, i) for i in range(len(avals))))


def _region_step(program: Program, region: manual.Region) -> _Step:
    """A manual region as one ``jax.shard_map``: its nodes interpreted on each device's shards.
    An exit is the map's output: its out spec reassembles the shards the exit reads."""
    inputs = tuple(manual.external_inputs(program, region))
    slot_of = {location: i for i, location in enumerate(inputs)}
    exits = set(region.exits)
    steps = [_node_step(program, k) for k in region.nodes if k not in exits]
    shards = [program.wiring(program.nodes[k])[0] for k in region.exits]

    def local(*values):
        with attention.partitioned(False):  # each device's own shards
            value = _interpret(steps, lambda location: values[slot_of[location]])
            return [value(location) for location in shards]

    call = jax.shard_map(
        local,
        mesh=region.mesh,
        in_specs=manual.in_specs(program, region, list(inputs)),
        out_specs=manual.out_specs(program, region),
        check_vma=False,
    )
    return _Step(call, inputs, tuple(("n", k, 0) for k in region.exits))


def _lower(op, args, kwargs, avals: tuple, scope: str | None, where, *sources) -> list:
    """One node through its registered lowering, checked and cast against the meta kernel's avals;
    its ops are named ``<profiler Trace scopes>/<aten op>`` (HLO metadata, profiles) and, with
    ``XLA_HLO_DEBUG``, carry the user's source location (``where``: the node's traceback)."""
    lowering = LOWERINGS[op]
    if lowering.random:
        sources = (wrap_key(sources[0]),) + sources[1:]
    located = _user_located(where) if where is not None and config.HLO_DEBUG.value else _NOWHERE
    with jax.named_scope(str(op) if scope is None else f"{scope}/{op}"), located:
        out = lowering.fn(*substitute(args, sources), **substitute(kwargs, sources))
    outs = [o for o in out if o is not None] if isinstance(out, (tuple, list)) else [out]
    if len(outs) != len(avals):
        raise LoweringError(f"lowering of {op} returned {len(outs)} outputs, expected {len(avals)}")
    fixed = []
    for o, (shape, dtype) in zip(outs, avals):
        o = jnp.asarray(o)
        if o.shape != shape:
            raise LoweringError(f"lowering of {op} returned shape {o.shape}, expected {shape}")
        fixed.append(o if o.dtype == dtype else o.astype(dtype))
    return fixed


_NOWHERE = contextlib.nullcontext()


def _user_located(where) -> contextlib.AbstractContextManager:
    """JAX's ops made inside take ``where``'s traceback as their source, named by its innermost
    frame that is the user's: spmd_torch's and torch's frames are excluded once, on first use."""
    if not _EXCLUDED:
        for path in (os.path.dirname(os.path.dirname(__file__)), os.path.dirname(torch.__file__)):
            source_info_util.register_exclusion(path)
        _EXCLUDED.append(True)
    return source_info_util.user_context(where.traceback)


_EXCLUDED: list = []


def _laid_out(value: jax.Array, sharding) -> jax.Array:
    """``value`` constrained to ``sharding``, zero-padded first when the sharding is uneven."""
    return jax.lax.with_sharding_constraint(padded(value, sharding), sharding)


# --- the cache -----------------------------------------------------------------------------------


def settle_heap(cache) -> None:
    """Warm-up is over (a program compiled earlier runs again): free what compiling left and
    freeze what lives on (the model, Dynamo's graphs, program templates) out of the cyclic
    collector's reach. Each full collection otherwise walks all of it: on GPT-2 small, ~780k
    objects, a 0.5-0.9 s pause every 10-40 steps, which pipelined steps cannot hide. Frozen
    objects are still freed when their last reference goes; their cycles (a graph Dynamo
    dropped on a recompile) wait for a later warm-up's end that collects the whole heap, as
    often as that keeps such collections under a tenth of the time (eager mode ends a warm-up
    per new op).

    It also lets the young generation grow to ``YOUNG_GENERATION`` objects: a traced step's
    graph lives until the barrier and then dies by reference counting, so collecting every 700
    allocations (Python's default) walks it alive, several times a step, and frees nothing
    (W3: 8 collections, 1.6 ms a step)."""
    cache.unsettled = False
    young, *older = gc.get_threshold()
    if young < YOUNG_GENERATION:  # a user's larger setting stays
        gc.set_threshold(YOUNG_GENERATION, *older)
    counters.settle()  # programs in flight recorded: their records not frozen
    with counters.timed("HeapFreezeTime"):
        start = time.perf_counter()
        whole = start - _LAST_WHOLE_COLLECTION[0] > 10 * _LAST_WHOLE_COLLECTION[1]
        if whole:
            gc.unfreeze()
        gc.collect()
        gc.freeze()
        if whole:
            _LAST_WHOLE_COLLECTION[:] = [start, time.perf_counter() - start]


_LAST_WHOLE_COLLECTION = [float("-inf"), 0.0]  # when the last one began, and its seconds
YOUNG_GENERATION = 50_000  # net allocations between young collections once warm-up ends


def lookup_or_compile(run) -> tuple[Executable, bool]:
    """The executable of ``run`` (a ``run.Run``); compiles on a miss. Returns (exe, was_hit)."""
    cache = current().cache
    with counters.timed("CacheLookupTime"):
        key = cache_key(run)
        executable = cache.executables.get(key)
    if executable is not None:
        cache.executables.move_to_end(key)  # the most recently run last: evicted last
        counters.bump("CachedCompile")
        if cache.unsettled:
            settle_heap(cache)
        return executable, True
    counters.bump("UncachedCompile")
    counters.note_site("CompileTime", user_frame())
    cache.unsettled = config.FREEZE_HEAP.value
    program, donated, arrays = run.program, run.donated, run.arrays
    cache.ops.update((id(node.op), node.op) for node in program.nodes)
    structure = STRUCTURES[key.structure]
    digest = hashlib.sha1(repr(_named(structure[0], cache.ops)).encode()).hexdigest()[:8]
    start = time.perf_counter_ns()
    mesh = _split_mesh([a.sharding for a in arrays] + list(run.out_shardings or ()))
    out_shardings = None  # each output's layout, given to jit too: JAX then names none of them
    if run.replicas is None and run.out_shardings:
        out_shardings = [s and _on(mesh, s) for s in run.out_shardings]
    abstract_inputs = abstract(arrays, mesh)
    kept = [a for a, d in zip(abstract_inputs, donated) if not d]
    aliasing = aliasing_of(run)
    given = [abstract_inputs[k] for k in (aliasing.given if aliasing else _donated(donated))]
    with warnings.catch_warnings(), _collector_paused():
        # Donating a dead input no output can reuse still frees it early; that is the point.
        warnings.filterwarnings("ignore", "Some donated buffers were not usable")
        if run.replicas is None:
            scalars = scalar_avals(program)
        else:
            scalars = _scalars_aval(run.scalars.shape[-1], run.replicas)
        try:
            jitted = _jitted(run, out_shardings, digest, aliasing)
            compiled = _compiled(jitted.lower(given, kept, scalars))
        except Exception as error:  # JAX's IndivisibleError, a private class
            if type(error).__name__ != "IndivisibleError" or run.replicas is not None or not mesh:
                raise
            # An output left unmarked, split over a mesh of the same devices other than the one
            # JAX names it on: replicated instead (mark it to keep it split).
            replicated = NamedSharding(mesh[0], PartitionSpec())
            pinned = [s or replicated for s in out_shardings or [None] * len(program.located)]
            jitted = _jitted(run, pinned, digest, aliasing)
            compiled = _compiled(jitted.lower(given, kept, scalars))
    counters.record(COMPILE_TIME[current().eager], time.perf_counter_ns() - start)
    counters.record("InputOutputAliasCount", sum(donated))  # buffers given to outputs, per compile
    inputs = compiled.input_shardings
    shardings = jax.tree.leaves((inputs, compiled.output_shardings))
    devices = {d for s in shardings for d in s.device_set}
    cpu = len(devices) > 1 and next(iter(devices)).platform == "cpu"
    lockstep = cpu and _COLLECTIVE.search(compiled.as_text()) is not None
    parts = scalar_parts_of(program) if run.replicas is None else None
    scalars_at = inputs[0][2][0] if parts else None
    executable = Executable(
        compiled,
        digest,
        len(devices),
        lockstep,
        cache.scalars_on_device,
        aliasing,
        parts,
        scalars_at,
    )
    cache.executables[key] = executable
    while len(cache.executables) > max(config.COMPILATION_CACHE_SIZE.value, 1):
        cache.executables.popitem(last=False)
        counters.bump("CompilationCacheEviction")
    cache.history.append(key)
    del cache.history[:-16]
    return executable, False


def _compiled(lowered: jax.stages.Lowered) -> jax.stages.Compiled:
    """``lowered`` compiled, equal computations in its StableHLO merged first (MLIR's ``cse``).

    The graph holds a lifted Python number once, but each op that reads it converts it to its
    own dtype, and a ``_foreach_*`` op once per tensor of its list: an unrolled 32-layer AdamW
    step converts the same five hyperparameters 2,222 times. XLA merges them only after passes
    that walk each one; merged beforehand, its compile of that step took 3.8-4.0 s instead of
    4.4 s (hand-written JAX's, whose hyperparameters are literals: 3.4-3.7 s). The pass itself
    takes 20 ms there. The module is the one ``compile`` reads, changed in place."""
    merge_equal_ops(lowered)
    return lowered.compile()


def merge_equal_ops(lowered: jax.stages.Lowered):
    """``lowered``'s StableHLO module with equal computations merged (MLIR's ``cse``), in place;
    None for a backend whose lowering keeps no MLIR module. It also merges the fused attention
    kernel a backward differentiates with the forward's own call (cuDNN's: one forward kernel
    per attention)."""
    module = lowered.compiler_ir("stablehlo")
    if module is not None:
        with module.context:
            passmanager.PassManager.parse("builtin.module(cse)").run(module.operation)
    return module


class Aliasing(NamedTuple):
    """The order a program takes its donated inputs (``given``: positions among its inputs) and
    gives its outputs (``outputs``: positions among the program's), and where each program
    output is among those given (``output_at``)."""

    given: tuple
    outputs: tuple
    output_at: tuple


def aliasing_of(run) -> Aliasing | None:
    """The orders that let each output take over the buffer of the value it overwrites; None
    when the program's own orders do.

    JAX gives a donated input's buffer to the first output of its shape and dtype not yet given
    one, both in order. In program order AdamW's new moments took parameters' buffers whose old
    values the program still had to read, and XLA copied each parameter in and each new value
    out (295 of the 862 copies of an unrolled 16-layer decoder's step); under SPMD a step's new
    gradients, written before the optimizer's outputs, took their buffers. So the outputs that
    overwrite a donated input come first, each given its input in the same place, the others
    after them. Any order is correct; this one copies least.
    """
    if run.written is None or not any(run.donated):
        return None
    index, donated, leaves = run.program.index, run.donated, run.program.leaves
    overwritten = {}  # output -> the donated input a storage bound to it held before
    claimed: set = set()
    for k, ((node, i), storages) in enumerate(run.written):
        for storage in storages:
            position = index.get(storage.overwrote)
            if position is None or not donated[position] or position in claimed:
                continue
            leaf, j = leaves[position]
            if leaf.avals[j] == node.avals[i]:  # not resized or cast since
                overwritten[k] = position
                claimed.add(position)
                break
    count = len(run.written)
    outputs = (*overwritten, *(k for k in range(count) if k not in overwritten))
    given = (*overwritten.values(), *(k for k in _donated(donated) if k not in claimed))
    if outputs == tuple(range(count)) and given == tuple(_donated(donated)):
        return None
    output_at = [0] * count
    for at, k in enumerate(outputs):
        output_at[k] = at
    return Aliasing(given, outputs, tuple(output_at))


def _donated(donated: tuple) -> list[int]:
    """The donated inputs' positions, in order."""
    return [k for k, d in enumerate(donated) if d]


@contextlib.contextmanager
def _collector_paused():
    """Python's cyclic collector off while a program is lowered: lowering allocates tens of
    thousands of short-lived objects (JAX's tracers, variables and equations), and the collector
    walked the growing heap again and again meanwhile (a quarter of the tracing of a 32-layer
    step). Reference counting frees them when lowering ends; any cycle among them goes at the
    next collection. A collector the program turned off stays off."""
    if not gc.isenabled():
        yield
        return
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def _named(rows: tuple, ops: dict) -> list:
    """Structure rows with each op id replaced by the op, without the signature numbers: ids
    and numbers differ between processes (a pod's hosts name one program alike)."""
    return [(ops[row[0]],) + row[1:5] for row in rows]


# The parts of a CacheKey, as a recompilation's reason names them.
_KEY_PARTS = (
    "graph|input shapes/dtypes/shardings|donated inputs|lifted scalars|output shardings|"
    "replica devices|SPMD mesh|flags"
).split("|")


def explain_last_miss() -> str:
    """Why the last compiled key missed: the first part differing from the most similar key."""
    cache = current().cache
    key = cache.history[-1]
    previous = cache.history[:-1]
    if not previous:
        return "first compilation"
    nodes = len(STRUCTURES[key[0]][0])

    def likeness(k: int) -> tuple:  # a graph of as many nodes first (the same step, changed)
        p = previous[k]
        return len(STRUCTURES[p[0]][0]) == nodes, sum(a == b for a, b in zip(p, key)), k

    best = previous[max(range(len(previous)), key=likeness)]
    for name, old, new in zip(_KEY_PARTS, best, key):
        if old != new:
            if name == "graph":
                return explain_graph_change(STRUCTURES[old], STRUCTURES[new], cache.ops)
            if name.startswith("input") and len(old) == len(new):
                diffs = [
                    f"input {i}: {o[:3]} -> {n[:3]}"
                    for i, (o, n) in enumerate(zip(old, new))
                    if o != n
                ]
                return f"{name} changed: " + "; ".join(diffs[:3])
            return f"{name} changed"
    return "unknown"


_ROW_PARTS = (
    "op/args",
    "op/args",
    "op/args",
    "inputs",
    "profiler scope",
    "op/args (a Python number's type: 2 is not 2.0)",
)


def explain_graph_change(old: tuple, new: tuple, ops: dict) -> str:
    """The first node whose row differs, and which part of it (rows as in Program.structure)."""
    old_rows, new_rows = old[0], new[0]  # (rows, outputs) each
    for k, (a, b) in enumerate(zip(old_rows, new_rows)):
        if a != b:
            part = _ROW_PARTS[next(i for i, (x, y) in enumerate(zip(a, b)) if x != y)]
            if part == "inputs" and _only_scalar_slots_differ(a[3], b[3]):
                return (
                    f"graph changed at node {k} ({ops[a[0]]}): Python numbers it shared a "
                    "program input with because they were equal differ now, or the reverse "
                    "(equal numbers share one input, as PyTorch/XLA's data cache gives them one)"
                )
            return f"graph changed at node {k} ({part}): {ops[a[0]]}{a[1:3]} -> {ops[b[0]]}{b[1:3]}"
    if len(old_rows) != len(new_rows):
        return f"graph changed ({len(old_rows)} -> {len(new_rows)} nodes)"
    return "graph outputs changed (which tensors are computed, or their order)"


def _only_scalar_slots_differ(old: tuple, new: tuple) -> bool:
    """Whether two wirings differ only in which lifted scalar slot an input reads."""
    return len(old) == len(new) and all(
        o == n or (o[0] == n[0] == "s" and o[2] == n[2]) for o, n in zip(old, new)
    )


def lowered(
    program: Program,
    arrays: list,
    every_input: bool = False,
    replicas: Mesh | None = None,
    platforms: tuple | None = None,
) -> jax.stages.Lowered:
    """The program lowered for ``arrays``' shapes and layouts, nothing compiled or run; with
    ``replicas``, as the one program every replica of that mesh runs (``arrays``: one replica's
    (1, ...) blocks, standing for each's). With ``every_input`` its HLO parameters are the
    leaves in order, then the lifted scalars (one each; for replicas their packed vector) when
    there are any, each kept whether read or not (JAX drops unread ones otherwise). Without it,
    ``platforms`` lowers it for other platforms than this host's (``('tpu',)``), none of whose
    devices need be here."""
    donated = (False,) * len(arrays)
    if replicas is None:  # no output layouts here: the program's constraints name its mesh
        constrained = [a for node in program.nodes for a in node.args if type(a) is NamedSharding]
        mesh = _split_mesh([a.sharding for a in arrays] + constrained)
        function = build_function(program, donated, packed=False)
        inputs, scalars = abstract(arrays, mesh), scalar_avals(program)
    else:
        function = build_replica_function(program, donated, replicas)
        layout = stacked(replicas)
        inputs = [
            jax.ShapeDtypeStruct((replicas.size, *a.shape[1:]), a.dtype, sharding=layout)
            for a in arrays
        ]
        scalars = _scalars_aval(len(program.scalar_values()), replicas)
    if not every_input:
        return jax.jit(function).trace([], inputs, scalars).lower(lowering_platforms=platforms)
    if program.scalars:
        entry = jax.jit(lambda kept, values: function([], kept, values), keep_unused=True)
        return entry.lower(inputs, scalars)
    empty = [] if replicas is None else np.zeros(scalars.shape)
    return jax.jit(lambda kept: function([], kept, empty), keep_unused=True).lower(inputs)


def _jitted(run, out_shardings: list | None, digest: str, aliasing: Aliasing | None):
    """``run``'s program as a jitted function, its outputs laid out as ``out_shardings`` say."""
    if run.replicas is None:
        function = build_function(run.program, run.donated, out_shardings, aliasing, packed=False)
    else:
        function = build_replica_function(run.program, run.donated, run.replicas, aliasing)
    if out_shardings and aliasing is not None:
        out_shardings = [out_shardings[k] for k in aliasing.outputs]
    function.__name__ = f"SyncTensorsGraph_{digest}"  # profiles name the program by its key
    donate = (0,) if any(run.donated) else ()
    if out_shardings:
        return jax.jit(function, donate_argnums=donate, out_shardings=out_shardings)
    return jax.jit(function, donate_argnums=donate)


def abstract(arrays: list, mesh: list) -> list[jax.ShapeDtypeStruct]:
    """``arrays``' shapes, dtypes and layouts, each replicated one restated on ``mesh``
    (``_split_mesh``)."""
    return [jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=_on(mesh, a.sharding)) for a in arrays]


def _split_mesh(shardings: list) -> list:
    """The mesh of the first of ``shardings`` that splits its tensor (a list of none or one),
    which the program's replicated inputs and outputs are restated on. JAX names the layouts it
    chose for outputs on the mesh of the first input with a mesh, or else of the first layout
    the program constrains a value to: an output split over a 2-D mesh has no name on the 1-D
    mesh uploads are replicated over (IndivisibleError at compile), as in a program computing a
    2-D-sharded parameter's and an unmarked one's new AdamW moments. (Outputs given a layout are
    given it in ``jax.jit`` too, so that no other mesh names them: a program may read and write
    tensors laid out over two meshes of the same devices.)"""
    for s in shardings:
        if type(s) is NamedSharding and not s.is_fully_replicated:
            return [s.mesh]
    return []


def _on(mesh: list, sharding):
    """``sharding``, or the same replicated layout on ``mesh`` (a list of none or one) when it
    has the same devices in the same order."""
    replicated = mesh and type(sharding) is NamedSharding and sharding.is_fully_replicated
    if replicated and list(sharding.mesh.devices.flat) == list(mesh[0].devices.flat):
        return NamedSharding(mesh[0], PartitionSpec())
    return sharding


def clear_cache() -> None:
    current().cache.clear()


def analyze(run, executable: Executable, hit: bool) -> None:
    """PyTorch/XLA's debugging tool (``PT_XLA_DEBUG_LEVEL``): a Compilation Analysis for each
    compile (with why the cache missed) and, from level 2, an Execution Analysis for each run:
    what caused it, the graph, the user's frames. Eager mode's per-op programs are left out."""
    if current().eager or (hit and config.DEBUG_LEVEL.value < 2):
        return
    frames = user_frames()[: config.DEBUG_MAX_FRAME.value]
    analyses = [] if hit else ["Compilation"]
    analyses += ["Execution"] if config.DEBUG_LEVEL.value >= 2 else []
    for kind in analyses:
        lines = ["=" * 80, f"{kind} Cause", f"  {_cause()}"]
        if kind == "Compilation":
            seconds = counters.METRICS[COMPILE_TIME[False]].recent[-1] / 1e9
            lines.append(f"  compiled in {seconds:.2f} s; {explain_last_miss()}")
        lines += [
            "Graph Info: ",
            f"  Graph Hash: {executable.key}",
            f"  Number of Graph Inputs: {len(run.arrays)}",
            f"  Number of Graph Outputs: {len(run.program.outputs)}",
            "Python Frame Triggered Execution: ",
            *[f"  {f.f_code.co_name} ({f.f_code.co_filename}:{f.f_lineno})" for f in frames],
            "-" * 80,
            "=" * 80,
        ]
        write_debug("".join(f"\n{kind} Analysis: {line}" for line in lines) + "\n")


# The doors of the barrier a program's run can come through, by the file and function on the
# stack: PyTorch/XLA's causes (the first found, innermost first).
_CAUSES = (
    ("parallel_loader.py", None, "spmd_torch.sync in parallel loader at step end"),
    ("profiler.py", "__exit__", "spmd_torch.sync when exiting a profiler StepTrace region"),
    ("_regions.py", None, "spmd_torch.compile or step region"),
    ("compiled.py", None, "dynamo is executing a compiled program"),
    ("xla_model.py", "optimizer_step", "xm.optimizer_step(barrier=True)"),
)


def _cause() -> str:
    """Why the program runs: a barrier (through which door), or a read of pending values."""
    frame, files = sys._getframe(1), []
    while frame is not None:
        files.append((os.path.basename(frame.f_code.co_filename), frame.f_code.co_name))
        frame = frame.f_back
    if ("_barrier.py", "barrier") not in files:
        if ("compiled.py", "call") in files:
            return _CAUSES[3][2]
        return "most likely user code trying to access tensor value before spmd_torch.sync"
    for file, function, cause in _CAUSES:
        if any(f == file and function in (None, name) for f, name in files):
            return cause
    return "user spmd_torch.sync (xm.mark_step)"


def write_debug(text: str) -> None:
    """Where the debugging tool's output goes: ``PT_XLA_DEBUG_FILE`` (appended), else stderr."""
    if config.DEBUG_FILE.value:
        with open(config.DEBUG_FILE.value, "a") as out:
            out.write(text)
    else:
        print(text, end="", file=sys.stderr, flush=True)
