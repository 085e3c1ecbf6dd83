"""Manually partitioned regions: nodes between ``enable_manual_sharding`` and its ``disable``.

``ENTER_MANUAL`` turns a full value into each device's shard; every node computed from a shard is
per-device ("local") until ``EXIT_MANUAL`` reassembles a full value. Connected local nodes form
a region, lowered as one ``jax.shard_map`` over the mesh: shards come in with the entry specs,
any other value a region reads comes in whole (replicated), and the exits leave with theirs.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field

from jax.sharding import NamedSharding, PartitionSpec

from .engine import current
from .graph import Arg, Aval, Node, Program, linearize
from .layout import canonical, padded_shape
from .lowering.sharding import ENTER_MANUAL, EXIT_MANUAL
from .tensor import LazyTensor, wrap


class ManualShardingError(ValueError):
    """A manual region used in a way no single shard_map can express."""


def enter(t: LazyTensor, sharding: NamedSharding) -> LazyTensor:
    """``t``'s per-device shard under ``sharding``: ops on it run on each device on its own."""
    current().manual_used = True
    aval = Aval(_shard_shape(tuple(t.shape), sharding, "enable_manual_sharding"), t.dtype)
    return wrap((Node(ENTER_MANUAL, (t._ref(),), (Arg(0), sharding), {}, (aval,)), 0), aval)


def is_shard(t: LazyTensor) -> bool:
    """Whether ``t`` is a per-device shard: computed inside a manual region."""
    return id(t._ref()[0]) in local_nodes(linearize([t._ref()]))


def leave(t: LazyTensor, sharding: NamedSharding, full_shape: tuple) -> LazyTensor:
    """The full tensor of ``full_shape`` whose shards are each device's ``t``, laid out so."""
    if not is_shard(t):
        raise ManualShardingError(
            f"disable_manual_sharding on a tensor of shape {tuple(t.shape)} that is not a "
            "per-device shard: call enable_manual_sharding on it first"
        )
    local = _shard_shape(full_shape, sharding, "disable_manual_sharding")
    if tuple(t.shape) != local:
        raise ValueError(
            f"disable_manual_sharding: a shard of full shape {full_shape} under "
            f"{sharding.spec} is {local}, but the tensor has shape {tuple(t.shape)}"
        )
    aval = Aval(tuple(full_shape), t.dtype)
    out = wrap((Node(EXIT_MANUAL, (t._ref(),), (Arg(0), sharding), {}, (aval,)), 0), aval)
    out._storage.sharding = canonical(sharding)
    return out


def _shard_shape(shape: tuple, sharding: NamedSharding, api: str) -> tuple:
    """Each device's block of ``shape``; manual shards must be even (no padding to hide)."""
    if padded_shape(shape, sharding) != shape:
        raise ValueError(
            f"{api}: shape {shape} does not divide evenly under {sharding.spec} over mesh "
            f"{dict(sharding.mesh.shape)}; manual sharding needs even shards"
        )
    return sharding.shard_shape(shape)


@dataclass
class Region:
    nodes: list[int] = field(default_factory=list)  # program node positions, topological
    mesh: object = None
    entries: list[int] = field(default_factory=list)
    exits: list[int] = field(default_factory=list)


def plan(program: Program) -> tuple[list, list[Region]] | None:
    """How to run ``program`` around its manual regions: (the order, each node position or Region
    after everything it reads; the regions); None when it has none."""
    if not _has_manual(program):
        return None
    region_of = _regions(program)
    for ref in program.outputs:
        kind, *pos = program.locate(ref)
        if kind == "n" and _is_local(program, region_of, pos[0]):
            node = program.nodes[pos[0]]
            raise ManualShardingError(
                f"a {node.op} result of shape {node.avals[pos[1]].shape} is a per-device shard "
                "(manual sharding): pass it through disable_manual_sharding before reading it"
            )
    return _order(program, region_of), list({id(r): r for r in region_of.values()}.values())


def local_nodes(program: Program) -> set[int]:
    """ids of ``program``'s nodes whose values are per-device shards: the barrier leaves those
    pending (only full values leave a program)."""
    if not current().manual_used or not _has_manual(program):
        return set()
    region_of = _regions(program)
    return {id(program.nodes[k]) for k in region_of if _is_local(program, region_of, k)}


def in_specs(program: Program, region: Region, inputs: list) -> tuple:
    """Entry values come in split by their spec; anything else a region reads comes in whole."""
    entry_sources = {program.wiring(program.nodes[k])[0]: k for k in region.entries}
    specs = []
    for location in inputs:
        k = entry_sources.get(location)
        specs.append(_sharding(program, k).spec if k is not None else PartitionSpec())
    return tuple(specs)


def out_specs(program: Program, region: Region) -> list:
    return [_sharding(program, k).spec for k in region.exits]


def _sharding(program: Program, k: int) -> NamedSharding:
    """The sharding a region bound (node ``k``) splits or reassembles by: its static argument."""
    return program.nodes[k].args[1]


def external_inputs(program: Program, region: Region) -> list:
    """Locations of values outside ``region`` that its nodes read, in first-use order."""
    members = set(region.nodes)
    inputs: list = []
    for k in region.nodes:
        for location in program.wiring(program.nodes[k]):
            inside = location[0] == "n" and location[1] in members
            if not inside and location not in inputs:
                inputs.append(location)
    return inputs


def _has_manual(program: Program) -> bool:
    return any(node.op in _BOUNDS for node in program.nodes)


_BOUNDS = (ENTER_MANUAL, EXIT_MANUAL)


def _is_local(program: Program, region_of: dict, k: int) -> bool:
    return k in region_of and program.nodes[k].op is not EXIT_MANUAL


def _regions(program: Program) -> dict:
    """Group local nodes (and their exits) into connected regions (union-find)."""
    parent: dict = {}

    def find(k: int) -> int:
        while parent[k] != k:
            parent[k] = parent[parent[k]]
            k = parent[k]
        return k

    for k, node in enumerate(program.nodes):
        wiring = program.wiring(node)
        local_sources = [w[1] for w in wiring if w[0] == "n" and _is_local(program, parent, w[1])]
        if node.op is ENTER_MANUAL:
            if local_sources:
                raise ManualShardingError(
                    "enable_manual_sharding on a tensor that is already a per-device shard "
                    f"(shape {node.src[0][0].avals[node.src[0][1]].shape})"
                )
            parent[k] = k
            continue
        if node.op is EXIT_MANUAL and not local_sources:
            raise ManualShardingError(
                f"disable_manual_sharding on a tensor of shape {node.avals[0].shape} that is not "
                "a per-device shard: call enable_manual_sharding on it first"
            )
        if not local_sources:
            continue
        parent[k] = k
        for s in local_sources:
            parent[find(s)] = find(k)
    regions: dict = {}
    region_of = {}
    for k in parent:
        region = regions.setdefault(find(k), Region())
        region.nodes.append(k)
        region_of[k] = region
        node = program.nodes[k]
        if node.op in _BOUNDS:
            mesh = _sharding(program, k).mesh
            if region.mesh is not None and mesh != region.mesh:
                raise ManualShardingError(
                    f"one manual region spans two meshes: {region.mesh} and {mesh}"
                )
            region.mesh = mesh
            (region.entries if node.op is ENTER_MANUAL else region.exits).append(k)
    return region_of


def _order(program: Program, region_of: dict) -> list:
    """Topological order with each region contracted to one step (Kahn, original order first)."""

    def unit(k: int):
        region = region_of.get(k)
        return ("r", id(region)) if region is not None else ("n", k)

    first: dict = {}  # unit -> its smallest node position (the tie-break)
    members: dict = {}
    for k in range(len(program.nodes)):
        u = unit(k)
        first.setdefault(u, k)
        members[u] = region_of.get(k, k)
    deps: dict = {u: set() for u in first}
    users: dict = {u: set() for u in first}
    for k, node in enumerate(program.nodes):
        for w in program.wiring(node):
            if w[0] == "n" and unit(w[1]) != unit(k):
                deps[unit(k)].add(unit(w[1]))
                users[unit(w[1])].add(unit(k))
    ready = [(first[u], u) for u in first if not deps[u]]
    heapq.heapify(ready)
    order = []
    while ready:
        _, u = heapq.heappop(ready)
        order.append(members[u])
        for v in users[u]:
            deps[v].discard(u)
            if not deps[v]:
                heapq.heappush(ready, (first[v], v))
    if len(order) != len(first):
        raise ManualShardingError(
            "a manual sharding region reads a value computed from its own "
            "disable_manual_sharding result; split it into two regions"
        )
    return order
