"""Loops whose body is traced once: a scan and a while loop are one node each, any trip count.

The body, a Python function of xla tensors, runs once per call on placeholders, recording a
sub-program as a torch.compile graph's template is recorded (compiled.py). A tensor from outside
its arguments that it hands a torch function (a module's parameter, a mask it closes over) becomes
a placeholder of its own there and an input of the call; the Python numbers it lifts become the
call's lifted scalars; its random ops draw from the device key, carried from one iteration to the
next. The call is one node whose static argument, the loop (equal to another recording of the same
body, so a step's program keeps its identity), lowers itself: ``jax.lax.scan`` or
``jax.lax.while_loop`` over the sub-program's JAX function, one body whatever the trip count.

A scan is differentiated by an autograd Function whose backward is one node too: the forward's
lowering returns the residuals of JAX's pullback (``jax.vjp`` of the whole scan) as extra outputs,
and the backward's rebuilds the pullback's structure by tracing ``jax.vjp`` on zeros (a forward
XLA removes as dead code) and applies it to the cotangents. A checkpoint policy wraps each
iteration in ``jax.checkpoint``: it chooses what an iteration keeps for the backward (nothing: its
carry only).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import torch
from torch.autograd.function import once_differentiable
from torch.overrides import TorchFunctionMode

from . import compiled, execute, rng
from .collective import COLLECTIVES
from .compile import build_function, splits_programs
from .compiled import placeholder, recording
from .engine import current
from .graph import Arg, Aval, Node, aval_text, linearize
from .lowering import EngineOp, attention, lowers
from .lowering.dtypes import to_jax_dtype, to_torch_dtype
from .tensor import SEVERAL_DEVICES, LazyTensor, wrap


def _ops(name: str) -> tuple[EngineOp, EngineOp]:
    """A kind of loop's op, and its twin for bodies holding collectives (a replica's program
    holding one runs only together with the other replicas', run.py)."""
    plain, with_collectives = EngineOp(name), EngineOp(f"{name}_with_collectives")
    COLLECTIVES.add(with_collectives)
    lowers(plain, with_collectives)(lambda inputs, loop: loop.lower(inputs))
    return plain, with_collectives


SCAN, SCAN_BACKWARD, WHILE = _ops("scan"), _ops("scan_backward"), _ops("while_loop")
ACCUMULATE = _ops("gradient_accumulation")
_KEY_AVAL = Aval((2,), torch.uint32)


# --- recording a body ----------------------------------------------------------------------------


class Body:
    """Recorded programs over numbered inputs (the placeholders, the tensors captured from
    outside, then the device key if read), each leaf an input or a constant the body made; equal
    to another recording of the same computation."""

    def __init__(self, programs: list, slots: tuple, avals: tuple, consts: tuple, keys: tuple):
        self.programs = programs
        self.slots = slots  # per program, per leaf: its input's number, or ("const", k)
        self.avals = avals  # per input
        self.consts = consts  # the constants' avals
        self.uses_key, self.key_out = keys  # reads the key (its last input); returns the next
        self.outputs = tuple(tuple(n.avals[i] for n, i in p.outputs) for p in programs)
        self.collectives = any(node.op in COLLECTIVES for p in programs for node in p.nodes)
        self.scalars = tuple(len(p.scalars) for p in programs)
        self.scalar_sizes = tuple(len(p.scalar_values()) for p in programs)
        self._functions: list = [None] * len(programs)
        self._same = (tuple(p.identity for p in programs), slots, avals, consts, keys)
        self._hash = hash(self._same)

    def __eq__(self, other: object) -> bool:
        return type(other) is Body and self._same == other._same

    def __hash__(self) -> int:
        return self._hash

    def call(self, k: int, inputs: list, consts: list, packed: jax.Array) -> list:
        """Program ``k``'s outputs on the inputs' and constants' arrays and its packed scalars
        (its JAX function is built once)."""
        function = self._functions[k]
        if function is None:
            leaves = len(self.programs[k].leaves)
            function = self._functions[k] = build_function(self.programs[k], (False,) * leaves)
        leaves = [inputs[s] if type(s) is int else consts[s[1]] for s in self.slots[k]]
        return function([], leaves, packed)


class Recorded(NamedTuple):
    """A body as one call recorded it: the static part, and what the call passes it."""

    body: Body
    captured: list  # the tensors from outside it reads, in input order
    consts: list  # refs of the constants it made (uploads)
    scalars: list  # refs of its programs' lifted scalars, in order


class _Outside(TorchFunctionMode):
    """While a body records: each xla tensor from outside it that a torch function gets is
    replaced by a placeholder, made at its first use, so the body's programs read placeholders
    only and the call passes the tensor itself. Inside means made during the recording: a
    placeholder, or a storage given a pending value since it began."""

    def __init__(self, mark: int):
        self.mark = mark
        self.seen, self.ended = mark, compiled.RECORDINGS_ENDED[0]
        self.inside: set = set()  # ids of the storages the recording made
        self.captured: dict = {}  # id(tensor from outside) -> (the tensor, its placeholder)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = {k: self.swap(v) for k, v in kwargs.items()} if kwargs else {}
        return func(*self.swap(args), **kwargs)

    def swap(self, x: Any) -> Any:
        """``x`` with each xla tensor in it stood in for (lists and tuples walked: a call's
        arguments; pytree's general walk costs more than the op it wraps)."""
        if isinstance(x, LazyTensor):
            return self.stand_in(x)
        if type(x) is tuple or type(x) is list:
            return type(x)(self.swap(v) for v in x)
        return x

    def stand_in(self, t: LazyTensor) -> LazyTensor:
        node, i = t._storage.ref
        if node.arrays is not None and type(node.arrays[i]) is jax.ShapeDtypeStruct:
            return t  # a placeholder's value (or a view of one)
        pending = current().pending
        if self.ended != compiled.RECORDINGS_ENDED[0]:  # one inside dropped its pending part
            self.seen, self.ended = self.mark, compiled.RECORDINGS_ENDED[0]
        self.inside.update(id(s) for s in (w() for w in pending[self.seen :]) if s is not None)
        self.seen = len(pending)
        if id(t._storage) in self.inside:
            return t
        entry = self.captured.get(id(t))
        if entry is None:
            entry = self.captured[id(t)] = (t, wrap(*placeholder(t.shape, t.dtype)))
        return entry[1]


_RECORDING = threading.local()  # per thread, the bodies being recorded, innermost last


def record(
    name: str,
    functions: list[Callable],
    avals: list[Aval],
    names: list[str],
    inputs_writable: bool = False,
) -> tuple:
    """Run each of ``functions`` on the same placeholders, of ``avals`` (named ``names`` in
    errors); each returns a list of xla tensors, and only the last may draw random numbers.
    With ``inputs_writable``, the functions may write the placeholders in place: each write is a
    new value inside the body, as any op's (the tensors given to the loop stay as they were).
    Returns the recording."""
    if not hasattr(_RECORDING, "stack"):
        _RECORDING.stack = []
    stack = _RECORDING.stack
    with recording(f"{name}'s body", "a loop body is one graph: keep it outside") as key:
        key_in = key.ref
        outside = _Outside(len(current().pending))
        inputs = [wrap(*placeholder(a.shape, a.dtype)) for a in avals]
        places = {id(t._storage.ref[0]): k for k, t in enumerate(inputs)}
        groups = []
        stack.append(outside)
        try:
            with outside:
                for k, function in enumerate(functions):
                    groups.append([outside.stand_in(t) for t in function(inputs)])
                    if key.ref is not key_in and k < len(functions) - 1:
                        raise RuntimeError(f"{name}: its condition draws random numbers")
        finally:
            stack.pop()
        captured = list(outside.captured.values())
        _check_unwritten(name, [] if inputs_writable else inputs, names, captured)
        for k, (_, stand_in) in enumerate(captured, start=len(inputs)):
            places[id(stand_in._storage.ref[0])] = k
        key_out = key.ref is not key_in
        refs = [[t._ref() for t in group] for group in groups]
        if key_out:
            refs[-1].append(key.ref)
        programs = [linearize(r) for r in refs]
    places[id(key_in[0])] = len(places)
    consts: dict = {}  # (id(node), i) -> (number, ref) of each leaf no input holds
    slots = []
    for program in programs:
        row = []
        for node, i in program.leaves:
            k = places.get(id(node))
            row.append(k if k is not None else ("const", _number(consts, (node, i))))
        slots.append(tuple(row))
    tensors = [t for t, _ in captured]
    for enclosing in reversed(stack):  # what is outside an enclosing body is its inputs too
        tensors = [enclosing.stand_in(t) for t in tensors]
    uses_key = key_out or any(len(places) - 1 in row for row in slots)
    all_avals = (*avals, *(_aval(t) for t in tensors)) + ((_KEY_AVAL,) if uses_key else ())
    const_refs = [ref for _, ref in consts.values()]
    const_avals = tuple(n.avals[i] for n, i in const_refs)
    body = Body(programs, tuple(slots), all_avals, const_avals, (uses_key, key_out))
    scalars = [(node, 0) for p in programs for node in p.scalars]
    return Recorded(body, tensors, const_refs, scalars)


class WrittenInBody(RuntimeError):
    """A loop body wrote in place a tensor it may not write."""


def _check_unwritten(name: str, inputs: list, names: list, captured: list) -> None:
    """A body may not write in place the tensors it reads from outside (the loop is one node:
    it has no way to write them), nor, unless its loop allows it, its own ``inputs``."""
    for t, what in zip(inputs, names):
        if t._storage.version != 1:
            raise WrittenInBody(
                f"{name}: an in-place operation on {what} ({aval_text(_aval(t))}) inside the "
                "body; write to a clone of it"
            )
    for t, stand_in in captured:
        if stand_in._storage.version != 1:
            raise WrittenInBody(
                f"{name}: an in-place operation inside the body on a {aval_text(_aval(t))} tensor "
                "from outside it; return the new value instead"
            )


def _number(numbered: dict, ref: tuple) -> int:
    """``ref``'s number among the refs numbered so far (a new one gets the next)."""
    key = (id(ref[0]), ref[1])
    if key not in numbered:
        numbered[key] = (len(numbered), ref)
    return numbered[key][0]


def _aval(t: torch.Tensor) -> Aval:
    return Aval(tuple(t.shape), t.dtype)


# --- the loops -----------------------------------------------------------------------------------


class _Loop:
    """A loop node's static argument: its body and shape, lowering itself; ``avals``: its outputs'
    (the key last, when the body draws random numbers)."""

    kind: tuple  # (op, op with collectives)
    body: Body
    avals: tuple
    _same: tuple

    @property
    def op(self) -> EngineOp:
        return self.kind[self.body.collectives]

    def __eq__(self, other: object) -> bool:
        return type(other) is type(self) and self._same == other._same

    def __hash__(self) -> int:
        return hash(self._same)

    def __repr__(self) -> str:
        nodes = sum(len(p.nodes) for p in self.body.programs)
        return f"{self.kind[0]}({len(self.avals)} outputs, body of {nodes} nodes)"

    def split(self, inputs: list) -> tuple[list, list, list]:
        """The node's inputs as (the body's inputs, its constants, each program's packed
        scalars); inputs are made strongly typed (a loop's carry keeps its type)."""
        body = self.body
        n, c = len(body.avals), len(body.consts)
        values = [_strong(v) for v in inputs[:n]]
        scalars, packed = inputs[n + c :], []
        for count in body.scalars:
            part, scalars = scalars[:count], scalars[count:]
            flat = [jnp.ravel(s).astype(jnp.float64) for s in part]
            packed.append(jnp.concatenate(flat) if flat else jnp.zeros((0,), jnp.float64))
        return values, list(inputs[n : n + c]), packed

    def key_parts(self, values: list) -> tuple[list, list]:
        """(the inputs every iteration reads as they are, the key as an input: [] or [key])."""
        end = len(values) - self.body.uses_key
        return values[self.carried : end], values[end:]


def _strong(x: jax.Array) -> jax.Array:
    """``x`` not weakly typed: a scan's carry must keep one type."""
    return x.astype(x.dtype) if getattr(x, "weak_type", False) else x


class Scan(_Loop):
    """``jax.lax.scan`` of the body over ``length`` slices: inputs (carry, xs stacked, captured,
    key), outputs (carry, ys stacked, key). With ``diff`` (the inputs to differentiate), the
    pullback's residuals follow; ``policy``: jax.checkpoint's, per iteration (None: keep all)."""

    kind = SCAN

    def __init__(self, body: Body, carry: int, xs: int, length: int, policy, diff: tuple):
        self.body, self.n_carry, self.n_xs, self.length = body, carry, xs, length
        self.policy, self.diff = policy, diff
        self.carried = carry + xs  # the inputs before the invariant ones
        outs = body.outputs[0]
        self.n_ys = len(outs) - carry - body.key_out
        ys = tuple(Aval((length, *a.shape), a.dtype) for a in outs[carry : carry + self.n_ys])
        self.avals = outs[:carry] + ys + outs[carry + self.n_ys :]
        self.floats = tuple(
            k for k, a in enumerate(self.avals[: carry + self.n_ys]) if a.dtype.is_floating_point
        )
        self._same = (body, carry, xs, length, policy, diff)

    def lower(self, inputs: list) -> list:
        values, consts, packed = self.split(inputs)
        if not self.diff:
            return self.run(values, consts, packed)
        outputs, pullback = self.pullback(values, consts, packed)
        return outputs + jax.tree.leaves(pullback)

    def run(self, values: list, consts: list, packed: list) -> list:
        n_carry, n_ys, key_out = self.n_carry, self.n_ys, self.body.key_out
        invariant, key = self.key_parts(values)

        def step(carry: list, xs: list) -> tuple:
            inputs = carry[:n_carry] + xs + invariant + (carry[n_carry:] if key_out else key)
            outs = self.body.call(0, inputs, consts, packed[0])
            ys = outs[n_carry : n_carry + n_ys]
            return [_strong(o) for o in outs[:n_carry] + outs[n_carry + n_ys :]], ys

        if self.policy is not None:
            step = jax.checkpoint(step, prevent_cse=False, policy=self.policy)
        init = values[:n_carry] + (key if key_out else [])
        xs = values[n_carry : self.carried]
        carry, ys = jax.lax.scan(step, init, xs, length=self.length)
        return carry[:n_carry] + ys + carry[n_carry:]

    def pullback(self, values: list, consts: list, packed: list) -> tuple[list, Any]:
        """The scan's outputs and JAX's pullback of its floating outputs on ``diff``."""
        floats = set(self.floats)

        def differentiated(*diff):
            chosen = list(values)
            for k, value in zip(self.diff, diff):
                chosen[k] = value
            outs = self.run(chosen, consts, packed)
            return [outs[k] for k in self.floats], [
                o for k, o in enumerate(outs) if k not in floats
            ]

        primals = [values[k] for k in self.diff]
        out, pullback, others = jax.vjp(differentiated, *primals, has_aux=True)
        out, others = iter(out), iter(others)
        return [
            next(out) if k in floats else next(others) for k in range(len(self.avals))
        ], pullback

    def abstract_inputs(self) -> tuple[list, list, list]:
        """Shapes and dtypes of the inputs ``lower`` splits: values, constants, packed scalars."""
        stacked = range(self.n_carry, self.carried)
        values = [
            _struct(Aval((self.length, *a.shape), a.dtype) if k in stacked else a)
            for k, a in enumerate(self.body.avals)
        ]
        packed = [jax.ShapeDtypeStruct((n,), jnp.float64) for n in self.body.scalar_sizes]
        return values, [_struct(a) for a in self.body.consts], packed

    def residuals(self) -> tuple:
        """The avals of the pullback's residuals (one trace of the scan, once per structure and
        mode kind: where the partitioner splits programs, attention's fused kernels save other
        residuals, as the lowering traces them)."""
        key = (self, splits_programs())
        found = _RESIDUALS.get(key)
        if found is None:
            with attention.partitioned(key[1]):
                leaves = jax.eval_shape(
                    lambda *a: jax.tree.leaves(self.pullback(*a)[1]), *self.abstract_inputs()
                )
            found = _RESIDUALS[key] = tuple(_torch_aval(leaf) for leaf in leaves)
        return found


_RESIDUALS: dict = {}  # (a differentiated Scan, splits_programs()) -> its residuals' avals


def _struct(aval: Aval) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(aval.shape, to_jax_dtype(aval.dtype))


def _torch_aval(leaf) -> Aval:
    try:
        return Aval(tuple(leaf.shape), to_torch_dtype(leaf.dtype))
    except KeyError:
        raise NotImplementedError(
            f"scan: the backward needs a {leaf.dtype}{list(leaf.shape)} value the forward "
            "computes, which no tensor can hold; pass a checkpoint policy that saves less"
        ) from None


class ScanBackward(_Loop):
    """A differentiated scan's backward: inputs (its residuals, the cotangents of its floating
    outputs), outputs the gradients of its ``diff`` inputs."""

    kind = SCAN_BACKWARD

    def __init__(self, scan: Scan):
        self.scan, self.body = scan, scan.body
        values = scan.abstract_inputs()[0]
        self.avals = tuple(Aval(values[k].shape, scan.body.avals[k].dtype) for k in scan.diff)
        self._same = (scan,)

    def lower(self, inputs: list) -> list:
        scan = self.scan
        count = len(scan.residuals())
        residuals, cotangents = inputs[:count], inputs[count:]
        dummies = [[jnp.zeros(s.shape, s.dtype) for s in part] for part in scan.abstract_inputs()]
        _, pullback = scan.pullback(*dummies)  # its forward is dead code
        leaves, tree = jax.tree.flatten(pullback)
        found = [(leaf.shape, leaf.dtype) for leaf in leaves]
        given = [(r.shape, r.dtype) for r in residuals]
        if found != given:
            raise RuntimeError(
                f"scan's backward: the pullback traced again has residuals {found}, the forward "
                f"gave {given}"
            )
        dtypes = [to_jax_dtype(scan.avals[k].dtype) for k in scan.floats]
        cotangents = [_strong(c).astype(d) for c, d in zip(cotangents, dtypes)]
        return list(jax.tree.unflatten(tree, residuals)(cotangents))


class While(_Loop):
    """``jax.lax.while_loop``: program 0 the condition, program 1 the body; inputs (carried,
    captured, key), outputs (carried, key)."""

    kind = WHILE

    def __init__(self, body: Body, carried: int):
        self.body, self.carried = body, carried
        self.avals = body.outputs[1]
        self._same = (body, carried)

    def lower(self, inputs: list) -> list:
        values, consts, packed = self.split(inputs)
        invariant, key = self.key_parts(values)
        carried, body = self.carried, self.body

        def inputs_of(carry: list) -> list:
            return carry[:carried] + invariant + (carry[carried:] if body.key_out else key)

        def cond(carry: list) -> jax.Array:
            (out,) = body.call(0, inputs_of(carry), consts, packed[0])
            return jnp.reshape(out, ()).astype(jnp.bool_)

        def step(carry: list) -> list:
            return [_strong(o) for o in body.call(1, inputs_of(carry), consts, packed[1])]

        init = values[:carried] + (key if body.key_out else [])
        return list(jax.lax.while_loop(cond, step, init))


class Accumulate(_Loop):
    """Gradient accumulation: ``jax.lax.scan`` of the body's value and gradient over ``length``
    slices. The body returns (carry, a scalar loss); each iteration adds ``loss / length`` and
    its gradient with respect to the ``diff`` inputs (tensors read from outside: a model's
    parameters) to running sums, so one iteration's activations live at a time. Inputs (carry,
    xs stacked, captured, key), outputs (carry, the summed loss, the summed gradients, key)."""

    kind = ACCUMULATE

    def __init__(self, body: Body, carry: int, xs: int, length: int, diff: tuple):
        self.body, self.n_carry, self.n_xs, self.length, self.diff = body, carry, xs, length, diff
        self.carried = carry + xs
        outs = body.outputs[0]
        grads = tuple(body.avals[k] for k in diff)
        self.avals = outs[:carry] + (outs[carry],) + grads + outs[carry + 1 :]
        self._same = (body, carry, xs, length, diff)

    def lower(self, inputs: list) -> list:
        values, consts, packed = self.split(inputs)
        invariant, key = self.key_parts(values)
        n_carry, key_out, body = self.n_carry, self.body.key_out, self.body
        diff = [k - self.carried for k in self.diff]  # their places among the invariant inputs
        loss_dtype = to_jax_dtype(self.avals[n_carry].dtype)

        def step(state: tuple, xs: list) -> tuple:
            carry, total, grads = state

            def loss_of(params: list) -> tuple:
                read = list(invariant)
                for k, param in zip(diff, params):
                    read[k] = param
                outs = body.call(
                    0,
                    carry[:n_carry] + xs + read + (carry[n_carry:] if key_out else key),
                    consts,
                    packed[0],
                )
                return (outs[n_carry] / self.length).astype(loss_dtype), outs

            (loss, outs), gradients = jax.value_and_grad(loss_of, has_aux=True)(
                [invariant[k] for k in diff]
            )
            carry = [_strong(o) for o in outs[:n_carry] + outs[n_carry + 1 :]]
            return (carry, total + loss, [a + g for a, g in zip(grads, gradients)]), None

        zeros = [jnp.zeros(invariant[k].shape, invariant[k].dtype) for k in diff]
        init = (values[:n_carry] + (key if key_out else []), jnp.zeros((), loss_dtype), zeros)
        xs = values[n_carry : self.carried]
        (carry, total, grads), _ = jax.lax.scan(step, init, xs, length=self.length)
        return carry[:n_carry] + [total] + grads + carry[n_carry:]


# --- calls ---------------------------------------------------------------------------------------


def _call(loop: _Loop, recorded: Recorded, tensors: list, extra: tuple = ()) -> tuple:
    """One node of ``loop`` on ``tensors`` (then the key, constants, scalars), with ``extra``
    outputs after the loop's; returns (the loop's outputs, the extra ones) as new tensors. The
    device key advances when the body draws numbers. In eager mode it runs at once."""
    enclosing = getattr(_RECORDING, "stack", None)
    if enclosing:  # inside a body: a tensor from outside it is its placeholder there
        tensors = [enclosing[-1].stand_in(t) for t in tensors]
    key = rng.state() if loop.body.uses_key else None
    src = [t._ref() for t in tensors] + ([key.ref] if key else [])
    src += recorded.consts + recorded.scalars
    avals = loop.avals + extra
    node = Node(loop.op, tuple(src), (tuple(Arg(k) for k in range(len(src))), loop), {}, avals)
    if SEVERAL_DEVICES and tensors:
        node.device = tensors[0]._ref()[0].device
    outputs = [wrap((node, k), aval) for k, aval in enumerate(avals)]
    count = len(loop.avals) - loop.body.key_out
    if loop.body.key_out:
        key.set((node, count))
    if current().eager:
        execute.sync()
    return outputs[:count], outputs[len(loop.avals) :]


class _Differentiated(torch.autograd.Function):
    """A scan autograd sees as one op: its backward is one node over the forward's residuals."""

    @staticmethod
    def forward(ctx, scan: Scan, recorded: Recorded, *tensors: torch.Tensor) -> tuple:
        outputs, residuals = _call(scan, recorded, list(tensors), scan.residuals())
        ctx.save_for_backward(*residuals)  # freed once the backward ran
        ctx.scan, ctx.inputs = scan, len(tensors)
        floats = set(scan.floats)
        ctx.mark_non_differentiable(*[o for k, o in enumerate(outputs) if k not in floats])
        return tuple(outputs)

    @staticmethod
    @once_differentiable
    def backward(ctx, *grads: torch.Tensor) -> tuple:
        scan = ctx.scan
        backward = ScanBackward(scan)
        src = [r._ref() for r in ctx.saved_tensors] + [grads[k]._ref() for k in scan.floats]
        args = (tuple(Arg(k) for k in range(len(src))), backward)
        node = Node(backward.op, tuple(src), args, {}, backward.avals)
        if SEVERAL_DEVICES:
            node.device = src[0][0].device
        gradients: list = [None] * ctx.inputs
        for j, k in enumerate(scan.diff):
            gradients[k] = wrap((node, j), backward.avals[j])
        return (None, None, *gradients)


def scan_avals(init: list, xs: list) -> tuple:
    """What a scan body is recorded on: the carry's avals, then one slice of each of ``xs``."""
    return (*(_aval(t) for t in init), *(Aval(tuple(x.shape[1:]), x.dtype) for x in xs))


def record_scan(
    name: str,
    body: Callable[[list, list], tuple[list, list]],
    init: list,
    xs: list,
    names: list,
    inputs_writable: bool = False,
) -> Recorded:
    """``body(carry, x) -> (carry, ys)`` recorded once on placeholders of ``scan_avals``;
    ``names`` name the carry and xs in errors; ``inputs_writable``: as ``record``'s."""
    n = len(init)

    def flat(inputs: list) -> list:
        carry, ys = body(inputs[:n], inputs[n:])
        return carry + ys

    return record(name, [flat], list(scan_avals(init, xs)), names, inputs_writable)


def recording_inside() -> bool:
    """Whether a body is being recorded: a recording made inside one reads its placeholders, so
    it holds for that call only."""
    return bool(getattr(_RECORDING, "stack", None))


def scan(
    recorded: Recorded, init: list, xs: list, length: int, policy: Callable | None = None
) -> tuple[list, list]:
    """The recorded body (``record_scan``) over the leading axis of ``xs`` as one node
    (differentiable): the last carry and the ys stacked. ``policy``: jax.checkpoint's for each
    iteration's residuals. A recording serves every call on the same avals: the tensors it read
    from outside are passed at their values of the moment."""
    n = len(init)
    tensors = [*init, *xs, *recorded.captured]
    diff = ()
    if torch.is_grad_enabled():
        diff = tuple(k for k, t in enumerate(tensors) if t.requires_grad and t.is_floating_point())
    loop = Scan(recorded.body, n, len(xs), length, policy if diff else None, diff)
    if diff:
        outputs = _Differentiated.apply(loop, recorded, *tensors)
    else:
        outputs = _call(loop, recorded, tensors)[0]
    return list(outputs[:n]), list(outputs[n:])


def while_loop(name: str, cond: Callable, body: Callable, carried: list, names: list) -> list:
    """``body(carried) -> carried`` while ``cond(carried)`` (a one-element tensor) holds, as one
    node; not differentiable: an input requiring grad (where grad mode is on) raises."""
    avals = [_aval(t) for t in carried]
    recorded = record(name, [cond, body], avals, names)
    tensors = [*carried, *recorded.captured]
    if torch.is_grad_enabled():
        for k, t in enumerate(tensors):
            if t.requires_grad:
                what = names[k] if k < len(names) else "a tensor it reads from outside"
                raise RuntimeError(
                    f"{name}: {what} ({aval_text(_aval(t))}) requires grad, and gradients do not "
                    "flow through a while loop (as in PyTorch/XLA): run it under torch.no_grad(), "
                    "or use scan (or fori_loop with Python int bounds)"
                )
    return _call(While(recorded.body, len(carried)), recorded, tensors)[0]


def accumulate(recorded: Recorded, init: list, xs: list, length: int, diff: tuple) -> tuple:
    """The recorded body (``record_scan``, its ys one scalar loss) over ``xs`` as one node:
    (the last carry, the mean loss, the summed gradients of ``loss / length`` with respect to
    the body's inputs ``diff``). No autograd history: the gradients are the result."""
    loop = Accumulate(recorded.body, len(init), len(xs), length, diff)
    outputs = _call(loop, recorded, [*init, *xs, *recorded.captured])[0]
    return outputs[: len(init)], outputs[len(init)], outputs[len(init) + 1 :]
