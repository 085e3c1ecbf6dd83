"""Pending graph -> one JAX function -> ``jax.jit`` executable, cached by the graph's structure.

The cache key is the program's structure (ops, static args, wiring), the inputs' shapes, dtypes and
shardings, which inputs are donated, and the config flags that change programs. Data never enters
the key: device buffers and lifted Python scalars are arguments, so the same step traced again
reuses its executable.
"""

from __future__ import annotations

import hashlib
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax._src.lax.lax import _convert_element_type  # weak-typed casts have no public API

from . import config, counters, manual, placement, rng
from .graph import MANUAL_ENTER, MANUAL_EXIT, RNG_SPLIT, Program, substitute
from .lowering import LOWERINGS
from .lowering.dtypes import to_jax_dtype


def _scalars_aval(n: int) -> jax.ShapeDtypeStruct:
    """Lifted scalars travel packed in one float64 vector: one transfer, however many there are."""
    return jax.ShapeDtypeStruct((n,), jnp.float64)


class LoweringError(RuntimeError):
    """A lowering returned something other than what PyTorch's meta kernel promised."""


@dataclass
class Executable:
    compiled: Any
    key: str  # short hex digest, for debug lines
    n_nodes: int


class CacheKey(NamedTuple):
    """What makes two programs the same executable; the debug line diffs these parts."""

    structure: tuple
    inputs: tuple
    donated: tuple
    n_scalars: int
    out_shardings: tuple | None
    flags: tuple

    def parts(self) -> tuple:
        return tuple(self)


def cache_key(
    program: Program, arrays: list, donated: tuple, out_shardings: tuple | None = None
) -> CacheKey:
    """Inputs enter as (stored shape, dtype, sharding, logical shape): uneven ones are padded."""
    inputs = tuple(
        (a.shape, a.dtype, placement.key_of(a.sharding), node.avals[i].shape)
        for a, (node, i) in zip(arrays, program.leaves)
    )
    scalars, flags = len(program.scalars), config.cache_key()
    return CacheKey(program.structure(), inputs, donated, scalars, out_shardings, flags)


def build_function(
    program: Program, donated: tuple, stored_shapes: list, out_shardings: tuple | None = None
) -> Callable:
    """The program as a function of (donated inputs, kept inputs, scalars) -> outputs.

    Inputs stored padded (``stored_shapes`` differ from the leaves' shapes) are sliced to their
    logical shape first; outputs given a sharding are constrained to it, padded when uneven.
    """
    slots = []  # input position -> (is donated, index within its group)
    counts = [0, 0]
    for is_donated in donated:
        slots.append((is_donated, counts[is_donated]))
        counts[is_donated] += 1
    trims = {
        k: node.avals[i].shape
        for k, (stored, (node, i)) in enumerate(zip(stored_shapes, program.leaves))
        if tuple(stored) != node.avals[i].shape
    }
    steps = [
        (
            node.op,
            node.args,
            node.kwargs,
            program.wiring(node),
            tuple((a.shape, to_jax_dtype(a.dtype)) for a in node.avals),
            node.shardings,
        )
        for node in program.nodes
    ]
    outputs = [program.locate(ref) for ref in program.outputs]
    order, regions = range(len(steps)), {}
    manual_plan = manual.plan(program)
    if manual_plan is not None:
        order, regions = manual_plan[0], _region_calls(program, steps, manual_plan[1])

    def run(donated_inputs, kept_inputs, packed_scalars):
        groups = (kept_inputs, donated_inputs)
        results: list = [None] * len(steps)
        # Weakly typed, as Python scalars are: ``x_f32 * lr`` stays float32.
        scalars = [
            _convert_element_type(packed_scalars[k], np.dtype(np.float64), weak_type=True)
            for k in range(packed_scalars.shape[0])
        ]

        def value(location):
            kind = location[0]
            if kind == "n":
                return results[location[1]][location[2]]
            if kind == "in":
                is_donated, k = slots[location[1]]
                x = groups[is_donated][k]
                logical = trims.get(location[1])
                return x if logical is None else jax.lax.slice(x, (0,) * x.ndim, logical)
            return scalars[location[1]]

        for k in order:
            if type(k) is not int:  # a manual region: one shard_map, its exits come out
                call, inputs, exits = regions[id(k)]
                for position, out in zip(exits, call(*[value(w) for w in inputs])):
                    results[position] = [out]
                continue
            op, args, kwargs, wiring, avals, shardings = steps[k]
            sources = [value(w) for w in wiring]
            with jax.named_scope(str(op)):
                outs = _lower_step(op, args, kwargs, sources, avals)
            if shardings is not None:  # GSPMD propagates from these constraints
                outs = [
                    o if s is None else jax.lax.with_sharding_constraint(o, s)
                    for o, s in zip(outs, shardings)
                ]
            results[k] = outs
        values = [value(o) for o in outputs]
        if out_shardings is None:
            return values
        return [v if s is None else _laid_out(v, s) for v, s in zip(values, out_shardings)]

    return run


def _region_calls(program: Program, steps: list, regions: list) -> dict:
    """id(region) -> (shard_map'ed function of the region's inputs, input locations, exits)."""
    calls = {}
    for region in regions:
        inputs = manual.external_inputs(program, region)
        slot_of = {location: i for i, location in enumerate(inputs)}

        def local(*values, region=region, slot_of=slot_of):
            results: dict = {}

            def value(location):
                if location[0] == "n" and location[1] in results:
                    return results[location[1]][location[2]]
                return values[slot_of[location]]

            for k in region.nodes:
                op, args, kwargs, wiring, avals, _ = steps[k]
                sources = [value(w) for w in wiring]
                if op in (MANUAL_ENTER, MANUAL_EXIT):  # the shard_map boundary does the work
                    results[k] = sources
                    continue
                with jax.named_scope(str(op)):
                    results[k] = _lower_step(op, args, kwargs, sources, avals)
            return [results[k][0] for k in region.exits]

        out_specs = [program.nodes[k].args[0].spec for k in region.exits]
        call = jax.shard_map(
            local,
            mesh=region.mesh,
            in_specs=manual.in_specs(program, region, inputs),
            out_specs=out_specs,
            check_vma=False,
        )
        calls[id(region)] = (call, inputs, region.exits)
    return calls


def _laid_out(value: jax.Array, sharding) -> jax.Array:
    """``value`` constrained to ``sharding``, zero-padded first when the sharding is uneven."""
    target = placement.padded_shape(value.shape, sharding)
    if target != value.shape:
        value = jnp.pad(value, [(0, t - n) for t, n in zip(target, value.shape)])
    return jax.lax.with_sharding_constraint(value, sharding)


def _lower_step(op, args, kwargs, sources: list, avals: tuple) -> list:
    if op == RNG_SPLIT:
        return list(rng.split(sources[0]))
    lowering = LOWERINGS[op]
    if lowering.random:
        sources = [rng.wrap(sources[0])] + sources[1:]
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


_CACHE: dict[tuple, Executable] = {}
_HISTORY: list[tuple] = []  # recent key parts, to explain recompilations


def lookup_or_compile(
    program: Program, arrays: list, donated: tuple, out_shardings: tuple | None = None
) -> tuple[Executable, bool]:
    """The executable for ``program`` on these inputs; compiles on a miss. Returns (exe, was_hit)."""
    key = cache_key(program, arrays, donated, out_shardings)
    parts = key.parts()
    executable = _CACHE.get(parts)
    if executable is not None:
        counters.bump("CachedCompile")
        return executable, True
    counters.bump("UncachedCompile")
    digest = hashlib.sha1(repr(parts[0]).encode()).hexdigest()[:8]
    start = time.perf_counter_ns()
    function = build_function(program, donated, [a.shape for a in arrays], out_shardings)
    abstract_inputs = [jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding) for a in arrays]
    kept = [a for a, d in zip(abstract_inputs, donated) if not d]
    given = [a for a, d in zip(abstract_inputs, donated) if d]
    jitted = jax.jit(function, donate_argnums=(0,) if any(donated) else ())
    with warnings.catch_warnings():
        # Donating a dead input no output can reuse still frees it early; that is the point.
        warnings.filterwarnings("ignore", "Some donated buffers were not usable")
        compiled = jitted.lower(given, kept, _scalars_aval(len(program.scalars))).compile()
    counters.record("CompileTime", time.perf_counter_ns() - start)
    executable = _CACHE[parts] = Executable(compiled, digest, len(program.nodes))
    _HISTORY.append(parts)
    del _HISTORY[:-16]
    return executable, False


def explain_last_miss() -> str:
    """Why the last compiled key missed: the first part differing from the most similar key."""
    parts = _HISTORY[-1]
    previous = _HISTORY[:-1]
    if not previous:
        return "first compilation"
    names = (
        "graph",
        "input shapes/dtypes/shardings",
        "donated inputs",
        "lifted scalars",
        "output shardings",
        "flags",
    )
    best = max(previous, key=lambda p: sum(a == b for a, b in zip(p, parts)))
    for name, old, new in zip(names, best, parts):
        if old != new:
            if name == "graph":
                return _explain_graph_change(old, new)
            if name.startswith("input") and len(old) == len(new):
                diffs = [
                    f"input {i}: {o[:3]} -> {n[:3]}"
                    for i, (o, n) in enumerate(zip(old, new))
                    if o != n
                ]
                return f"{name} changed: " + "; ".join(diffs[:3])
            return f"{name} changed"
    return "unknown"


_ROW_PARTS = ("op/args", "op/args", "op/args", "inputs", "sharding constraint")


def _explain_graph_change(old: tuple, new: tuple) -> str:
    """The first node whose row differs, and which part of it (rows as in Program.structure)."""
    old_rows, new_rows = old[0], new[0]  # (rows, outputs) each
    for k, (a, b) in enumerate(zip(old_rows, new_rows)):
        if a != b:
            part = _ROW_PARTS[next(i for i, (x, y) in enumerate(zip(a, b)) if x != y)]
            return f"graph changed at node {k} ({part}): {a[0]}{a[1:3]} -> {b[0]}{b[1:3]}"
    if len(old_rows) != len(new_rows):
        return f"graph changed ({len(old_rows)} -> {len(new_rows)} nodes)"
    return "graph outputs changed (which tensors are computed, or their order)"


def stablehlo_text(program: Program, arrays: list) -> str:
    """The program lowered to StableHLO, nothing compiled or run."""
    function = build_function(program, (False,) * len(arrays), [a.shape for a in arrays])
    abstract = [jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding) for a in arrays]
    return jax.jit(function).lower([], abstract, _scalars_aval(len(program.scalars))).as_text()


def clear_cache() -> None:
    _CACHE.clear()
    _HISTORY.clear()
