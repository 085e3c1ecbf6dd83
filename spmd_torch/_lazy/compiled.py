"""A graph ``torch.compile`` traced (Dynamo's, or AOTAutograd's forward or backward) as one node.

The first call with new input shapes runs the graph once through the dispatcher on placeholder
inputs, recording a template program. Its CPU part (an optimizer's step counters and the scalars
made from them) runs on the CPU at every call, feeding the template its values. Every call
records one node whose static argument is that template, and which lowers to the template's JAX
function: no per-op Python after the first call. The node joins the pending graph like any
other, so the step still runs as one program in every mode and what runs outside the compiled
graph (an optimizer step) joins the same barrier; a graph called again before a barrier runs the
earlier iteration first (loops need no barrier). A graph that cannot be recorded (it reads a
value, or an op's output shape depends on data) runs op by op instead, traced lazily as
uncompiled code is."""

from __future__ import annotations

import contextlib
import warnings
import weakref
from collections.abc import Iterator
from typing import Any

import jax
import torch
import torch.utils._pytree as pytree
from torch import fx

from . import execute, rng, stacks
from .collective import COLLECTIVES
from .compile import build_function
from .engine import current
from .graph import Arg, Aval, Node, Ref, linearize
from .lowering import EngineOp, lowers
from .lowering.dtypes import to_jax_dtype
from .tensor import SEVERAL_DEVICES, LazyTensor, Storage, TensorHandle, wrap, wrap_data
from .transfer import to_device_array

GRAPH = EngineOp("compiled_graph")
# A replica's program holding collectives runs only together with the other replicas' (run.py).
GRAPH_WITH_COLLECTIVES = EngineOp("compiled_graph_with_collectives")
COLLECTIVES.add(GRAPH_WITH_COLLECTIVES)


class Template:
    """A recorded graph: its program; where each program input comes from at a call (``("arg",
    k)``: argument k; ``("stack", k)``: the whole stack argument k is a member of, as are the
    arguments at the other positions recorded with it; ``("cpu", node[, k])``: a value of the
    graph's CPU part; ``("key",)``: the PRNG key; else a constant's ref); where each output leaf
    comes from (``("out", k)``: the program's output k; ``("arg", k)``, ``("cpu", node)``,
    ``("value", v)``); the arguments written in place and then the stacks written (by the position
    of a member), whose new values follow the outputs, and then the next PRNG key if it draws
    random numbers.
    It is a node's static argument, and so part of the program's key: equal to another recording
    of the same computation (the same graph recorded by each replica of ``launch``, whose steps
    must then be one program), else only to itself."""

    def __init__(
        self, program, sources, results, tree, writes, stack_writes, key_out: bool, layouts: list
    ):
        self.program = program
        self.layouts = layouts  # per computed output, the layout marked inside the graph, or None
        self.sources = sources
        self.results = results
        self.tree = tree
        self.writes = writes
        self.stack_writes = stack_writes
        self.key_out = key_out
        self.uses_key = key_out or ("key",) in sources
        self.avals = tuple(node.avals[i] for node, i in program.outputs)
        self.computed = sum(kind == "out" for kind, _ in results)
        self.placeholders = tuple(Arg(k) for k in range(len(sources)))  # the node's static args
        self.op = GRAPH_WITH_COLLECTIVES if _has_collectives(program) else GRAPH
        # engine -> (weak ref to its last call, its step, calls in that step, calls not run); weak,
        # so a replica's finished engine takes its count with it (an id may be reused)
        self.calls = weakref.WeakKeyDictionary()
        self.calls_per_step = 1  # the most calls seen in a step a barrier ended, at least 1
        # CPU scalars arrive as lifted float64 scalars: each is cast back to its tensor's dtype.
        self.casts = [
            to_jax_dtype(node.avals[i].dtype)
            if source[0] == "cpu" and not node.avals[i].shape
            else None
            for source, (node, i) in zip(sources, program.leaves)
        ]
        self._function = None
        # What the computation is: the program's structure, its input and output avals, its
        # baked-in scalars (as lower() packs them), and where its inputs and outputs go (nodes of
        # the graph by name; a constant by identity). Hashed once, on a part that is always
        # hashable (a value the graph returns need not be): a program's key hashes node args.
        name = lambda where: tuple(x.name if type(x) is fx.Node else x for x in where)  # noqa: E731
        self._same = (
            program.identity,
            tuple(node.avals[i] for node, i in program.leaves),
            self.avals,
            program.scalar_values().tobytes(),
            tuple(map(name, sources)),
            tuple(map(name, results)),
            tuple(writes),
            tuple(stack_writes),
            key_out,
            tuple(layouts),
        )
        self._hash = hash(self._same[:3])

    def __eq__(self, other: object) -> bool:
        return self is other or (
            type(other) is Template and self._same == other._same and self.tree == other.tree
        )

    def __hash__(self) -> int:
        return self._hash

    def lower(self, inputs: tuple) -> list:
        """The template's JAX function on the node's inputs (built once: every program holding
        a call of this graph inlines the same function)."""
        if self._function is None:
            program = self.program
            self._function = build_function(program, (False,) * len(program.leaves))
            self._scalars = program.scalar_values()
        inputs = [x if d is None else x.astype(d) for x, d in zip(inputs, self.casts)]
        return self._function([], inputs, self._scalars)

    def call(self, args: list, cpu: dict, at_once: bool) -> Any:
        """One node computing the graph on ``args`` (``cpu``: its CPU part's values); the graph's
        outputs, new tensors. The node waits for the barrier with the rest of the step, unless
        ``at_once`` (or in eager mode): then what is pending runs now."""
        engine = current()
        last, step, in_step, unrun = self.calls.get(engine, (_no_call, engine.steps, 0, 0))
        if step != engine.steps:  # a barrier ended the step of its last call
            self.calls_per_step, in_step, unrun = max(self.calls_per_step, in_step), 0, 0
        elif (node := last()) is None or node.arrays is not None:
            unrun = 0  # its calls so far have run
        elif unrun >= self.calls_per_step:
            # More calls pending than any whole step made: a loop of calls and no barrier.
            # Running what is pending keeps the graph one iteration long, the same program each
            # time, as PyTorch/XLA's loops need no mark_step. A graph called several times a
            # step (once per layer) waits for the barrier, from the step after the first on.
            execute.sync()
            unrun = 0
        key = rng.state() if self.uses_key else None
        find, sources = self._source, self.sources  # most are arguments: read inline
        src = tuple(
            [args[s[1]]._ref() if s[0] == "arg" else find(s, args, cpu, key) for s in sources]
        )
        node = Node(self.op, src, (self.placeholders, self), {}, self.avals)
        if SEVERAL_DEVICES:  # on its tensors' xla device
            node.device = next(
                (r[0].device for r, s in zip(src, self.sources) if s[0] in ("arg", "stack")), 0
            )
        outputs = []
        for kind, k in self.results:
            if kind == "out":
                outputs.append(wrap((node, k), self.avals[k]))
                outputs[-1]._storage.sharding = self.layouts[k]  # read before the barrier too
            else:
                outputs.append(args[k] if kind == "arg" else cpu[k] if kind == "cpu" else k)
        for k, position in enumerate(self.writes, start=self.computed):
            args[position]._write((node, k))
        for k, position in enumerate(self.stack_writes, start=self.computed + len(self.writes)):
            args[position]._storage.set((node, k))  # the whole stack: every member
        if self.key_out:
            key.set((node, len(self.avals) - 1))
        self.calls[engine] = (weakref.ref(node), engine.steps, in_step + 1, unrun + 1)
        if at_once or engine.eager:
            # A compiled graph, even in eager mode: PyTorch/XLA's ExecuteTime and CompileTime
            # time it, not the eager op metrics.
            eager, engine.eager = engine.eager, False
            try:
                execute.sync()
            finally:
                engine.eager = eager
        return pytree.tree_unflatten(outputs, self.tree)

    @staticmethod
    def _source(source, args: list, cpu: dict, key) -> tuple:
        """The ref of a source other than an argument (``call`` reads those inline)."""
        kind = source[0]
        if kind == "stack":  # the whole stack of the member at that position
            return args[source[1]]._storage.ref
        if kind == "key":
            return key.ref
        if kind != "cpu":
            return source  # a constant's ref
        value = cpu[source[1]] if len(source) == 2 else cpu[source[1]][source[2]]
        if value.dim() == 0:  # lifted, as Python scalars are: packed with the others
            return (Node.scalar(value.item()), 0)
        return wrap_data(to_device_array(value), Aval(tuple(value.shape), value.dtype))._ref()


lowers(GRAPH, GRAPH_WITH_COLLECTIVES)(lambda inputs, template: template.lower(inputs))


def _has_collectives(program) -> bool:
    return any(node.op in COLLECTIVES for node in program.nodes)


class CompiledGraph:
    """A graph ``torch.compile`` traced, callable on xla tensors (or the handles its runtime
    passes, ``tensor.TensorHandle``), on CPU tensors and on Python values."""

    def __init__(self, graph: fx.GraphModule, name: str = "compiled graph", at_once: bool = False):
        self.graph = graph
        self.name = name
        self.at_once = at_once  # each call runs what is pending (PyTorch/XLA's bridge does)
        # input signature -> (Template, its CPU part's nodes in order), or None: op by op
        self.templates: dict = {}
        self.placeholders = [n for n in graph.graph.nodes if n.op == "placeholder"]
        self.last_call: tuple | None = None  # the last call's signature: (plain, stack groups)

    def __call__(self, *args: Any) -> Any:
        args = [a.tensor if type(a) is TensorHandle else a for a in args]
        # Dynamo's guards already hold every tensor's device, dtype and shape to the graph's;
        # only the values it takes as arguments (sizes of dynamic shapes) tell calls apart.
        # And which arguments are the members of one stack (stacks.py): recorded as one input.
        plain = tuple([type(a) is LazyTensor or _signature_of(a) for a in args])
        if _META in plain:  # shapes only, no values: the graph runs as it is, on meta tensors
            return self.graph(*args)
        last = self.last_call
        if last is not None and last[0] == plain and stacks.still_grouped(args, last[1]):
            groups = last[1]  # as at the last call (a step's optimizer: every call)
        else:
            groups = stacks.groups_in(args)
        self.last_call = (plain, groups)
        signature = (plain, groups)
        if signature not in self.templates:
            self.templates[signature] = self._record(args, groups)
        recorded = self.templates[signature]
        if recorded is None:
            return self.graph(*args)
        template, cpu_part = recorded
        return template.call(args, self._run_cpu_part(cpu_part, args), self.at_once)

    def _run_cpu_part(self, cpu_part: dict, args: list) -> dict:
        """The values of the graph's CPU part for this call."""
        if not cpu_part:
            return {}
        values = dict(zip(self.placeholders, args))
        read = values.__getitem__
        for node in cpu_part:
            if node.op == "call_function":
                values[node] = node.target(
                    *fx.map_arg(node.args, read), **fx.map_arg(node.kwargs, read)
                )
            elif node.op == "get_attr":
                values[node] = _attribute(self.graph, node.target)
        return values

    def _record(self, args: list, groups: tuple) -> tuple | None:
        """Run the graph once on placeholders, recording its template; None where it cannot be
        recorded (it reads a value, an op's output shape depends on data, or its CPU part needs
        a device value), with a warning: then it runs op by op."""
        recorder = _Recorder(self.graph, self.placeholders, args, groups)
        try:
            with recording(self.name, "the graph cannot be recorded") as key:
                key_in = key.ref
                out = recorder.run(*recorder.inputs)
                return recorder.template(out, key_in, key.ref), recorder.cpu_part
        except (RuntimeError, NotImplementedError) as error:
            warnings.warn(
                f"torch.compile: {self.name} runs op by op, lazily traced at each call: {error}",
                stacklevel=3,
            )
            return None


@contextlib.contextmanager
def recording(name: str, remedy: str) -> Iterator[Storage]:
    """Ops record onto placeholders inside: the device key is one (yielded: its storage, whose
    value at the end says whether the ops drew numbers), nothing runs (a read raises, naming
    ``name`` and the ``remedy``), autograd records nothing, and what the block left pending is
    dropped (placeholders' values are never computed)."""
    own = current()
    saved_key, mark, eager = own.rng, len(own.pending), own.eager
    own.rng, own.eager = Storage(placeholder((2,), torch.uint32)[0]), False
    try:
        with execute.one_graph(name, remedy), torch.no_grad():
            yield own.rng
    finally:
        own.rng, own.eager = saved_key, eager
        del own.pending[mark:]
        RECORDINGS_ENDED[0] += 1


# How many recordings ended: each shortened the pending list (loop.py's watchers of it look again).
RECORDINGS_ENDED = [0]


class _Recorder(fx.Interpreter):
    """Runs a graph once through the dispatcher on placeholders: xla arguments, CPU arguments and
    the values of the CPU part (nodes whose value is a CPU tensor) each become one. The members
    of a stack given whole (``groups``: their positions) are the members of one placeholder
    stack, so that the graph's foreach ops over them are recorded over the stack (an optimizer
    step over ``scan_layers``' layers, or over step counters kept stacked) and the program
    reads and writes one array for all of them."""

    def __init__(self, graph: fx.GraphModule, placeholders: list, args: list, groups: tuple):
        super().__init__(graph)
        self.slots: dict = {}  # id(placeholder leaf) -> its template source
        self.cpu_part: dict = {}  # its nodes in order (a dict: order, and membership in O(1))
        self.inputs, self.xla_inputs = [], {}
        self.stack_inputs: dict = {}  # a stack's first position -> its placeholder stack
        stand_ins = {}  # position -> a member of a placeholder stack
        for positions in groups:
            whole = self._stand_in(args[positions[0]]._storage.aval, ("stack", positions[0]))
            self.stack_inputs[positions[0]] = whole
            stand_ins.update(zip(positions, stacks.members(whole._storage)))
        for k, (node, a) in enumerate(zip(placeholders, args)):
            if k in stand_ins:
                self.inputs.append(stand_ins[k])
            elif type(a) is LazyTensor:
                self.xla_inputs[k] = self._stand_in(a, ("arg", k))
                self.inputs.append(self.xla_inputs[k])
            elif isinstance(a, torch.Tensor):
                self.cpu_part[node] = None
                self.inputs.append(self._stand_in(a, ("cpu", node)))
            else:
                self.inputs.append(a)
        self.before = {k: t._storage.ref for k, t in self.xla_inputs.items()}
        self.stacks_before = {k: t._storage.ref for k, t in self.stack_inputs.items()}

    def _stand_in(self, like: torch.Tensor | Aval, source: tuple) -> LazyTensor:
        ref, aval = placeholder(like.shape, like.dtype)
        self.slots[id(ref[0])] = source
        return wrap(ref, aval)

    def run_node(self, node: fx.Node) -> Any:
        value = node.meta.get("val", node.meta.get("example_value"))
        if node.op != "call_function" or not _on_cpu(value):
            return super().run_node(node)
        for source in node.all_input_nodes:
            if source not in self.cpu_part and source.op != "get_attr":
                raise RuntimeError(f"{node.target} makes a CPU value of a device value")
            self.cpu_part[source] = None  # a constant it reads joins the part (no-op if in)
        self.cpu_part[node] = None
        if isinstance(value, torch.Tensor):
            return self._stand_in(value, ("cpu", node))
        return [self._stand_in(v, ("cpu", node, k)) for k, v in enumerate(value)]

    def template(self, out: Any, key_in: tuple, key_now: tuple) -> Template:
        leaves, tree = pytree.tree_flatten(out)
        results, refs, layouts = [], [], []
        for leaf in leaves:
            source = self.slots.get(id(leaf._ref()[0])) if type(leaf) is LazyTensor else None
            if source is not None and leaf._view is None:
                results.append(source)
            elif type(leaf) is LazyTensor:
                results.append(("out", len(refs)))
                refs.append(leaf._ref())
                layouts.append(leaf._storage.sharding if leaf._view is None else None)
            elif isinstance(leaf, torch.Tensor):
                raise RuntimeError(f"the graph returned a tensor on {leaf.device}, not on xla")
            else:
                results.append(("value", leaf))
        writes = [k for k, t in self.xla_inputs.items() if t._storage.ref is not self.before[k]]
        refs += [self.xla_inputs[k]._storage.ref for k in writes]
        stack_writes = []
        for k, whole in self.stack_inputs.items():
            before, now = self.stacks_before[k], whole._storage.ref
            if now is not before:
                stack_writes.append(k)
                refs.append(_copied_whole(now, before) or now)
        key_out = key_now is not key_in
        if key_out:
            refs.append(key_now)
        program = linearize(refs)
        self.slots[id(key_in[0])] = ("key",)
        sources = [self.slots.get(id(node), (node, i)) for node, i in program.leaves]
        return Template(program, sources, results, tree, writes, stack_writes, key_out, layouts)


def _copied_whole(written: Ref, start: Ref) -> Ref | None:
    """The stack ``T`` when ``written`` is ``start`` with each of its members replaced in turn
    by the member of the same index of ``T`` (a functionalized graph copies each updated input
    back, ``copy_(member k, new member k)``: here each member of a stack the foreach ops made
    whole), else None: one array out instead of a chain of one slice and one write per member."""
    length, copied, source = start[0].avals[start[1]].shape[0], set(), None
    ref = written
    while ref is not start and len(copied) < length:
        node = ref[0]
        if node.op is not _SELECT_SCATTER or node.args[2] != 0:
            return None
        k, (base, piece) = node.args[3], node.src
        read = piece[0]
        if read.op is not _SELECT or read.args[1:] != (0, k) or k in copied:
            return None
        source = read.src[0] if source is None else source
        if read.src[0] != source:
            return None
        copied.add(k)
        ref = base
    if ref is not start or len(copied) != length:
        return None
    return source if source[0].avals[source[1]] == start[0].avals[start[1]] else None


_SELECT, _SELECT_SCATTER = torch.ops.aten.select.int, torch.ops.aten.select_scatter.default


def _no_call() -> None:
    """A graph's last call before its first: none."""


def _signature_of(arg) -> Any:
    """What tells calls apart at a position not holding an xla tensor: a CPU tensor, a meta
    tensor, or a value."""
    if isinstance(arg, torch.Tensor):
        return _META if arg.is_meta else False
    return (type(arg), arg)


_META = "meta tensor"


def _on_cpu(value) -> bool:
    """A value of the graph's CPU part: a CPU tensor, or a list of them (a CPU foreach op's)."""
    if isinstance(value, (list, tuple)):
        return bool(value) and all(_on_cpu(v) for v in value)
    return isinstance(value, torch.Tensor) and value.device.type == "cpu"


def placeholder(shape, dtype: torch.dtype) -> tuple:
    """A leaf standing for an input (its ref and aval): known shape and dtype, no value."""
    aval = Aval(tuple(shape), dtype)
    return (Node.data(jax.ShapeDtypeStruct(aval.shape, to_jax_dtype(dtype)), aval), 0), aval


def _attribute(module: torch.nn.Module, target: str) -> Any:
    for name in target.split("."):
        module = getattr(module, name)
    return module
