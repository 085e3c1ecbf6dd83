"""The IR: one small node type for the whole pending graph, linearised without recursion.

A ``Node`` is one call of an aten overload or of an engine op (lowering/registry.py). Tensor arguments
live in ``src`` as ``(node, output_index)`` references and appear in ``args``/``kwargs`` as ``Arg``
placeholders, so the same structure serves the compile-cache key and the lowering. Leaves are nodes
whose arrays are known: device data, or results computed by an earlier partial run.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np
import torch

from .engine import current

DATA = "data"  # a leaf holding device arrays
SCALAR = "scalar"  # a Python number lifted to a program input, so changing it never recompiles


class Arg(NamedTuple):
    """Placeholder for the i-th tensor source of a node inside its args/kwargs.

    A tuple so that hashing cache keys stays in C. It cannot be confused with a static tuple
    argument: a schema position holds either tensors or static values, never both.
    """

    index: int


class Aval(NamedTuple):
    """Shape and PyTorch dtype of one node output: known at trace time, from the meta kernel.

    A tuple, so that hashing it inside cache keys stays in C (it is on the trace path).
    """

    shape: tuple[int, ...]
    dtype: torch.dtype


SCALAR_AVAL = Aval((), torch.float64)  # a lifted Python float's (or bool's)
_SCALAR_AVALS = (SCALAR_AVAL,)
_INT_SCALAR_AVALS = (Aval((), torch.int64),)


class Node:
    __slots__ = (
        "op",
        "src",
        "args",
        "kwargs",
        "avals",
        "arrays",
        "holders",
        "where",
        "scope",
        "device",
        "signature",
        "__weakref__",
    )

    def __init__(
        self,
        op: Any,
        src: tuple,
        args: tuple,
        kwargs: dict,
        avals: tuple[Aval, ...],
        signature: int = 0,
    ):
        self.op = op
        self.src = src  # tuple of (Node, output index)
        self.args = args
        # The number of the op, static values and their types record.emit recorded it with (0:
        # built otherwise). A structure compares static values by value, where 2 == 2.0 ==
        # True: this tells x_int // 2 from x_int // 2.0 (else the int64 program of one ran for
        # the other), full(s, 7) from full(s, 7.0).
        self.signature = signature
        self.kwargs = kwargs
        self.avals = avals
        self.arrays: list | None = None  # per-output jax arrays once known
        self.holders = 0  # live storages whose value is this node (donation bookkeeping)
        self.where: str | None = None  # user file:line, captured only when debugging
        self.scope = current().scope  # the profiler Trace names open on the engine
        self.device = 0  # which xla:N its value is on (None: any, as a lifted scalar's)

    @classmethod
    def data(cls, array: Any, aval: Aval, device: int | None = 0) -> Node:
        return _input(DATA, (), (aval,), [array], device)

    @classmethod
    def scalar(cls, value: float | int | tuple, shared: bool = True) -> Node:
        """A lifted Python float or int, or a tuple of them of one type (a foreach op's list,
        one vector): a program input too (ints exactly, below 2**53). ``shared``: it may share
        its input with an equal number (an index, which changes from read to read, may not)."""
        if type(value) is tuple:
            avals = (Aval((len(value),), torch.int64 if type(value[0]) is int else torch.float64),)
        else:
            avals = _INT_SCALAR_AVALS if type(value) is int else _SCALAR_AVALS
        return _input(SCALAR, (value,) if shared else (value, "own input"), avals, None, 0)

    def is_leaf(self, index: int) -> bool:
        return self.arrays is not None and self.arrays[index] is not None

    def is_known(self, index: int) -> bool:
        """Whether its value is there before any program runs: data, or a lifted number."""
        return self.op == SCALAR or self.is_leaf(index)

    def keep(self, index: int, array: Any) -> None:
        """Leave a computed value on the node: references to it read it from there."""
        if self.arrays is None:
            self.arrays = [None] * len(self.avals)
        self.arrays[index] = array

    def become_data(self) -> None:
        """A computed node of one output whose array it keeps becomes an input node, as the
        barrier's outputs are: programs read it and may give its array up once no live tensor
        holds it (run.Run.of)."""
        self.op, self.src, self.args, self.kwargs, self.scope = DATA, (), (), _NO_KWARGS, None

    def __repr__(self) -> str:
        return f"Node({self.op}, {len(self.src)} src)"


def _input(op: str, args: tuple, avals: tuple, arrays: list | None, device: int | None) -> Node:
    """A node no program computes, made without ``__init__``'s engine lookup for a profiler scope
    (only computed nodes carry one): the barrier makes one per output, traced ops one per lifted
    scalar."""
    node = _new_node(Node)
    node.op, node.src, node.args, node.kwargs, node.avals = op, (), args, _NO_KWARGS, avals
    node.arrays, node.holders, node.where, node.scope, node.device = arrays, 0, None, None, device
    node.signature = 0
    return node


_new_node = object.__new__
_NO_KWARGS: dict = {}  # an input's, never written

Ref = tuple  # (Node, output index)


class Value:
    """A graph reference passed where an op expects a tensor, inside the engine."""

    __slots__ = ("ref",)

    def __init__(self, ref: Ref):
        self.ref = ref

    @property
    def aval(self) -> Aval:
        return self.ref[0].avals[self.ref[1]]


@dataclass
class Program:
    """A pending graph in topological order, with its leaves numbered as program inputs."""

    nodes: list[Node]  # computed nodes, topologically sorted
    leaves: list[Ref]  # leaf references, in first-use order
    scalars: list[Node]  # lifted Python scalars, in first-use order
    outputs: list[Ref]
    index: dict  # id(node) -> position among nodes; leaves: (id(node), i) -> input position
    rows: list  # per node: (id(op), args, kwargs, wiring, scope, signature), built by the walk
    located: tuple  # per output, where it comes from (``locate``'s answer), found by the walk
    _identity: int | None = None
    device: int = 0  # the xla:N it runs on (outside SPMD a process may use each of its devices)

    def scalar_values(self) -> np.ndarray:
        """The lifted scalars' values packed in one float64 vector (a tuple's values in a row):
        one transfer however many there are."""
        values = []
        for node in self.scalars:
            value = node.args[0]
            if type(value) is tuple:
                values.extend(value)
            else:
                values.append(value)
        return np.array(values, dtype=np.float64)

    @property
    def identity(self) -> int:
        """The number of its structure, shared by every program of that structure (replicas',
        step after step): keys and comparisons hash one int, not the structure."""
        if self._identity is None:
            structure = self.structure()
            self._identity = _IDENTITIES.setdefault(structure, len(STRUCTURES))
            if self._identity == len(STRUCTURES):
                STRUCTURES.append(structure)
        return self._identity

    def structure(self) -> tuple:
        """The hashable structure of the program: ops, static args, wiring and scopes, not data.

        Ops enter by ``id``: an OpOverload hashes in Python, and ops live as long as the process.
        Recorded args are hashable already (the walk made every list a tuple): no freezing here.
        """
        return (tuple(self.rows), self.located)

    def wiring(self, node: Node) -> tuple:
        """Where each source of ``node`` comes from (``locate``'s answers)."""
        return self.rows[self.index[id(node)]][3]

    def locate(self, ref: Ref) -> tuple:
        node, i = ref
        if node.op == SCALAR:
            return ("s", self.index[id(node)], node.avals[0])
        if node.is_leaf(i):
            return ("in", self.index[(id(node), i)])
        return ("n", self.index[id(node)], i)


_IDENTITIES: dict[tuple, int] = {}  # structure -> its number
STRUCTURES: list[tuple] = []  # number -> structure (what a recompilation's reason diffs)


def linearize(outputs: list[Ref], device: int = 0) -> Program:
    """Topologically sort everything ``outputs`` need, stopping at leaves; iterative DFS. The
    program runs on xla:``device``.

    Only computed nodes go on the stack (this runs over every node at every barrier). A node's row
    of the structure is written when it is placed, its sources already placed; leaves and lifted
    scalars are numbered there, on first use.
    """
    nodes: list[Node] = []
    leaves: list[Ref] = []
    scalars: list[Node] = []
    rows: list = []
    index: dict = {}
    slots: dict | None = {} if current().mode.shares_equal_scalars else None  # value -> slot

    def where(ref: Ref) -> tuple:
        node, i = ref
        if node.op == SCALAR:  # its aval is part of the structure: x * 2 is not x * 2.0
            k = index.get(id(node))
            if k is None:
                k = index[id(node)] = _scalar_slot(node.args, slots, len(scalars))
                if k == len(scalars):
                    scalars.append(node)
            return ("s", k, node.avals[0])
        arrays = node.arrays
        if arrays is None or arrays[i] is None:
            return ("n", index.get(id(node)), i)
        k = index.get((id(node), i))
        if k is None:
            k = index[(id(node), i)] = len(leaves)
            leaves.append(ref)
        return ("in", k)

    for root in outputs:
        if where(root)[0] != "n":
            continue
        stack = [(root[0], False)]
        while stack:
            node, expanded = stack.pop()
            if id(node) in index:
                continue
            if expanded:
                kwargs = tuple(node.kwargs.items()) if node.kwargs else ()
                wiring = []
                for ref in node.src:  # ``where`` inlined for data and computed sources
                    source, i = ref
                    arrays = source.arrays
                    if arrays is not None and arrays[i] is not None:
                        key = (id(source), i)
                        k = index.get(key)
                        if k is None:
                            k = index[key] = len(leaves)
                            leaves.append(ref)
                        wiring.append(("in", k))
                    elif source.op != SCALAR:
                        wiring.append(("n", index.get(id(source)), i))
                    else:
                        wiring.append(where(ref))
                wiring = tuple(wiring)
                index[id(node)] = len(nodes)
                nodes.append(node)
                rows.append((id(node.op), node.args, kwargs, wiring, node.scope, node.signature))
                continue
            stack.append((node, True))
            for source, i in reversed(node.src):  # inlined: a computed source not yet placed
                arrays = source.arrays
                if (arrays is None or arrays[i] is None) and source.op != SCALAR:
                    if id(source) not in index:
                        stack.append((source, False))
    located = tuple([where(root) for root in outputs])  # every computed root is placed now
    return Program(nodes, leaves, scalars, list(outputs), index, rows, located, device=device)


def _scalar_slot(args: tuple, slots: dict | None, count: int) -> int:
    """Where a lifted scalar goes in the program's packed vector: with the earlier scalar of the
    same value where there is one, as PyTorch/XLA's data cache gives equal scalars one device
    buffer. Each layer's ``eps`` then reads one slot, so XLA's kernels of alike layers stay alike
    and it compiles each once (a slot per use made every layer's kernels different: 1.6x the
    compile time of a 16-layer step). Which scalars share a slot is part of the structure; 1 and
    1.0, 0.0 and -0.0 never share, nor do the indices of reads by index (``shared=False``),
    which would coincide with other numbers from one read to the next, nor any in a mode whose
    programs must not part by it (``slots`` None: ``launch``'s replicas, pods). ``count``: the
    slots taken so far."""
    value = args[0]
    if slots is None or len(args) > 1 or type(value) is tuple:
        return count
    return slots.setdefault((type(value), value, math.copysign(1.0, value)), count)


_DTYPE_NAMES = {torch.bool: "pred", torch.bfloat16: "bf16"}  # the rest: f32, i64, u8, c64...


def aval_text(aval: Aval) -> str:
    """XLA's spelling of a shape: ``f32[4,2]``, ``pred[3]``, ``c64[4]``."""
    d = aval.dtype
    kind = "c" if d.is_complex else "f" if d.is_floating_point else "i" if d.is_signed else "u"
    return f"{_DTYPE_NAMES.get(d, f'{kind}{d.itemsize * 8}')}[{','.join(map(str, aval.shape))}]"


def _layout_text(sharding, rank: int) -> str:
    """``{fsdp,_}``: the mesh axes each dimension is split over; nothing when not split."""
    spec = getattr(sharding, "spec", None)
    if not spec or sharding.is_fully_replicated:
        return ""
    entries = list(spec) + [None] * (rank - len(spec))
    names = ["_" if e is None else e if isinstance(e, str) else "+".join(e) for e in entries]
    return "{" + ",".join(names) + "}"


def _arg_text(arg: Any, rank: int) -> str:
    """A static argument as written; a sharding as its layout over ``rank`` dimensions,
    ``{fsdp,_}`` (``{}``: replicated)."""
    if hasattr(arg, "spec") and hasattr(arg, "mesh"):
        return _layout_text(arg, rank) or "{}"
    return repr(arg)


def to_text(program: Program) -> str:
    """One line per node: ``%3:f32[4,8] = aten.addmm.default(%0, %1, %2)  # file.py:12``;
    inputs are device data, under PyTorch/XLA's IR name for it, with their layout in braces where
    sharded (``%in0:f32[8,4]{fsdp,_} = xla::device_data``), and a constrained value reads
    ``%4:f32[8,4] = sharding_constraint(%3, {fsdp,_})``."""
    lines = []
    for k, (node, i) in enumerate(program.leaves):
        sharding = getattr(node.arrays[i], "sharding", None)  # None: still on the host
        layout = _layout_text(sharding, len(node.avals[i].shape))
        lines.append(f"%in{k}:{aval_text(node.avals[i])}{layout} = xla::device_data")
    for k, node in enumerate(program.scalars):
        lines.append(f"%s{k} = scalar")

    def name(ref: Ref) -> str:
        kind, *pos = program.locate(ref)
        if kind == "in":
            return f"%in{pos[0]}"
        if kind == "s":
            return f"%s{pos[0]}"
        return f"%{pos[0]}" + (f".{pos[1]}" if pos[1] else "")

    for k, node in enumerate(program.nodes):
        avals = ", ".join(aval_text(a) for a in node.avals)
        refs = [name(ref) for ref in node.src]
        rank = len(node.avals[0].shape)
        static = [_arg_text(a, rank) for a in substitute(node.args, refs)]
        kwargs = substitute(node.kwargs, refs).items()
        static += [f"{key}={_arg_text(v, rank)}" for key, v in kwargs]
        args = ", ".join(s.replace("'", "") for s in static)
        where = f"  # {node.where}" if node.where else ""
        lines.append(f"%{k}:{avals} = {node.op}({args}){where}")
    lines.append("return " + ", ".join(name(ref) for ref in program.outputs))
    return "\n".join(lines)


def substitute(value: Any, sources: list) -> Any:
    """``value`` with each Arg placeholder replaced by its source."""
    if type(value) is Arg:
        return sources[value.index]
    if isinstance(value, (list, tuple)):
        return type(value)(substitute(v, sources) for v in value)
    if isinstance(value, dict):
        return {k: substitute(v, sources) for k, v in value.items()}
    return value
