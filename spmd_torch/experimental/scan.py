"""torch_xla.experimental.scan: a loop over the leading axis of tensors, traced and lowered once.

``scan(fn, init, xs)`` is ``jax.lax.scan`` for xla tensors: ``fn(carry, x) -> (carry, y)`` runs
once per call on placeholders (one iteration's ops, whatever the length), and the loop is one node
of the lazy graph lowered as one ``lax.scan``, so a program holding it compiles in the time of one
iteration. Autograd goes through it (the backward is one scan too). ``partition_fn`` chooses what
each iteration keeps for the backward: PyTorch/XLA's ``default_partition`` (everything it needs)
and ``min_cut_rematerialization_partition`` (matmul results only, the rest recomputed), or any
``jax.checkpoint_policies`` policy (``nothing_saveable``: each iteration's carry only, as
checkpointing every layer does).

``is_fn_pure=True`` records ``fn`` once per structure of its inputs (the carry's and xs' pytrees,
shapes and dtypes, and the autocast state) and replays the recording at later calls, so a step
calling it costs no tracing of ``fn``, as PyTorch/XLA's tracing cache does. Without it ``fn`` is
traced at each call (one iteration's ops).

Where it differs from PyTorch/XLA: ``fn`` may close over tensors, which get gradients like the
arguments (a replayed recording reads them at their values of the moment); random ops draw new
numbers in each iteration, the same ones as the unrolled loop.

``value_and_grad_partitioned`` is PyTorch/XLA's building block of its scan's autograd, kept for
the code that calls it: one iteration split by AOTAutograd into a forward returning the
activations and a backward taking them. Our ``scan`` does not use it (JAX differentiates the
lowered loop).
"""

from __future__ import annotations

import sys
import weakref
from collections.abc import Callable
from typing import Any

import jax
import torch
import torch.utils._pytree as pytree

from spmd_torch._lazy import loop
from spmd_torch._lazy.graph import Aval, aval_text
from spmd_torch._lazy.tensor import DEVICE, LazyTensor

__all__ = ["scan", "tree_flatten_none", "value_and_grad_partitioned"]


def scan(
    fn: Callable[[Any, Any], tuple[Any, Any]],
    init: Any,
    xs: Any,
    partition_fn: Callable | None = None,
    is_fn_pure: bool = False,
) -> tuple[Any, Any]:
    """Apply ``fn`` over the leading dimension of ``xs``, carrying state; like ``jax.lax.scan``.

    For one tensor ``xs``, the same as::

        carry, ys = init, []
        for i in range(xs.size(0)):
            carry, y = fn(carry, xs[i])
            ys.append(y)
        return carry, torch.stack(ys)

    ``init``, ``xs`` and what ``fn`` returns may be pytrees of xla tensors; every leaf of ``xs``
    is sliced along dimension 0 (they must agree on its length), each leaf of the ys ``fn``
    returns is stacked. The carry ``fn`` returns keeps ``init``'s structure, shapes and dtypes.

    Args:
        fn: ``fn(carry, x) -> (new_carry, y)``; may write its arguments in place (PyTorch/XLA's
            cumsum example does ``carry += x``), which leaves ``init`` and ``xs`` as they were;
            may read tensors it closes over, not write them.
        init: The first carry.
        xs: The pytree to scan over.
        partition_fn: What each iteration keeps for the backward: ``None`` or
            ``functorch.compile.default_partition`` (all it needs),
            ``min_cut_rematerialization_partition`` (matmul results), or a
            ``jax.checkpoint_policies`` policy (``nothing_saveable``: only the carry).
        is_fn_pure: ``fn`` computes its results from its arguments (and the tensors it reads)
            only, with no side effects: it is recorded once per structure of its inputs and
            the recording replayed at later calls (``_SCAN_COMPUTATION_CACHE``).

    Returns:
        ``(carry, ys)``: the last carry, and the ys stacked along a new dimension 0.

    Example:
        >>> from spmd_torch.experimental.scan import scan
        >>> xs = torch.arange(6.0, device='xla').reshape(3, 2)
        >>> carry, ys = scan(lambda c, x: (c + x, c + x), torch.zeros(2, device='xla'), xs)
        >>> ys.cpu()  # the running sums
        tensor([[0., 1.], [2., 4.], [6., 9.]])
    """
    return without_dynamo(_scan)(fn, init, xs, partition_fn, is_fn_pure)


def value_and_grad_partitioned(
    fn: Callable[[Any, Any], tuple[Any, Any]],
    init: Any,
    xs: Any,
    partition_fn: Callable | None = None,
    is_fn_pure: bool = True,
) -> tuple[Callable, Callable, Callable]:
    """One iteration of ``fn`` as AOTAutograd's forward and backward graphs, ``partition_fn``
    (default: ``functorch.compile.default_partition``) choosing the activations between them.

    Returns ``(forward, alias_input, backward)``:

    - ``forward(carry, x) -> (new_carry, (y, partial_activations))``: the activations that are
      not ``x``'s own tensors (a scan need not store those again);
    - ``alias_input(partial_activations, x) -> activations``: ``x``'s tensors put back in place;
    - ``backward(grad_new_carry, (grad_y, activations)) -> (grad_carry, grad_x)``.

    ``fn`` is traced once, on empty tensors shaped like ``init`` and one slice of ``xs`` (the
    carry always requiring grad, so that gradients flow from one iteration to the next); with
    ``is_fn_pure`` the three functions are kept per partition function and input structure.
    """
    from functorch.compile import aot_function, default_partition, make_boxed_func

    partition_fn = partition_fn or default_partition
    carry = pytree.tree_map(lambda t: torch.empty_like(t, requires_grad=True), init)
    x = pytree.tree_map(lambda t: torch.empty_like(t[0], requires_grad=t.requires_grad), xs)
    key = (id(partition_fn), *(_structure(tree) for tree in (carry, x)))
    kept = _kept_for(_PARTITIONED, fn) if is_fn_pure else None
    if kept is None:  # traced anew at each call
        kept = {}
    if key in kept:
        return kept[key]

    graphs: dict = {}

    def keeps(part: str) -> Callable:
        def compiler(graph: torch.fx.GraphModule, _inputs) -> Callable:
            graphs[part] = graph
            return make_boxed_func(graph)

        return compiler

    def fn_returning_no_input(*args):  # an output that is an input would bypass the graphs
        inputs = {id(t) for t in pytree.tree_leaves(args)}
        return pytree.tree_map(lambda t: t.clone() if id(t) in inputs else t, fn(*args))

    with torch.enable_grad():
        traced = aot_function(
            fn_returning_no_input,
            fw_compiler=keeps("forward"),
            bw_compiler=keeps("backward"),
            partition_fn=partition_fn,
        )
        outputs, unflatten_outputs = tree_flatten_none(traced(carry, x))
        torch.autograd.backward(outputs, [torch.ones_like(t) for t in outputs])
    forward_graph, backward_graph = graphs["forward"], graphs["backward"]
    _, unflatten_grads = tree_flatten_none((carry, x))
    n_outputs = len(outputs)
    # Which activations are x's own tensors: activation position by x leaf.
    x_leaves = pytree.tree_leaves(x)
    activations = forward_graph(*pytree.tree_leaves(carry), *x_leaves)[n_outputs:]
    leaf_of = {id(t): k for k, t in enumerate(x_leaves)}
    aliases = {leaf_of[id(a)]: k for k, a in enumerate(activations) if id(a) in leaf_of}
    aliased = set(aliases.values())
    put_back = sorted(aliases.items(), key=lambda item: item[1])  # (x leaf, position), in order

    def forward(carry: Any, x: Any) -> tuple[Any, tuple]:
        results = forward_graph(*pytree.tree_leaves(carry), *pytree.tree_leaves(x))
        new_carry, y = unflatten_outputs(list(results[:n_outputs]))
        partial = tuple(a for k, a in enumerate(results[n_outputs:]) if k not in aliased)
        return new_carry, (y, partial)

    def alias_input(partial_activations: tuple, x: Any) -> tuple:
        activations = list(partial_activations)
        leaves = pytree.tree_leaves(x)
        for leaf, position in put_back:
            activations.insert(position, leaves[leaf])
        return tuple(activations)

    def backward(grad_new_carry: Any, grads_and_activations: tuple) -> tuple[Any, Any]:
        grad_y, activations = grads_and_activations
        tangents = [*pytree.tree_leaves(grad_new_carry), *tree_flatten_none(grad_y)[0]]
        return unflatten_grads(list(backward_graph(*activations, *tangents)))

    kept[key] = (forward, alias_input, backward)
    return kept[key]


def tree_flatten_none(tree: Any) -> tuple[list, Callable[[list], Any]]:
    """``tree``'s leaves with its ``None`` leaves left out, and the function that builds the tree
    back from such a list (the ``None``s put back where they were)."""
    leaves, spec = pytree.tree_flatten(tree)
    holes = [leaf is None for leaf in leaves]

    def unflatten(values: list) -> Any:
        given = iter(values)
        return pytree.tree_unflatten([None if hole else next(given) for hole in holes], spec)

    return [leaf for leaf in leaves if leaf is not None], unflatten


def _structure(tree: Any) -> tuple:
    """A pytree's structure with its leaves' shapes and dtypes."""
    leaves, spec = pytree.tree_flatten(tree)
    return spec, tuple((tuple(t.shape), t.dtype) for t in leaves)


# Per function (weakly), value_and_grad_partitioned's three functions by partition function and
# input structure.
_PARTITIONED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def without_dynamo(function: Callable) -> Callable:
    """``function``, run with Dynamo off: under torch.compile a loop is a graph break and its body
    is traced lazily (Dynamo would compile the body's frames on their own otherwise)."""
    dynamo = sys.modules.get("torch._dynamo")
    return function if dynamo is None else dynamo.disable(function, recursive=True)


def checkpoint_policy(partition_fn: Callable | None, api: str) -> Callable | None:
    """The ``jax.checkpoint`` policy a PyTorch/XLA partition function stands for (None: keep
    every residual, no checkpoint)."""
    module = getattr(partition_fn, "__module__", None) or ""
    name = getattr(partition_fn, "__name__", None)
    if partition_fn is None or (module, name) == (_PARTITIONERS, "default_partition"):
        return None
    if (module, name) == (_PARTITIONERS, "min_cut_rematerialization_partition"):
        return jax.checkpoint_policies.dots_saveable
    if callable(partition_fn) and module.split(".")[0] == "jax":
        return partition_fn
    raise ValueError(
        f"{api}: partition_fn {partition_fn!r} is not one spmd_torch knows: pass None or "
        "default_partition (keep what the backward needs), min_cut_rematerialization_partition "
        "(keep matmul results, recompute the rest) or a jax.checkpoint_policies policy"
    )


_PARTITIONERS = "torch._functorch.partitioners"


# PyTorch/XLA's name: per function scanned with is_fn_pure=True (weakly), its recordings, by
# what else a recording depends on (``_recording_key``), with the structure of its ys.
_SCAN_COMPUTATION_CACHE: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _scan(
    fn: Callable, init: Any, xs: Any, partition_fn: Callable | None, pure: bool, state: tuple = ()
) -> tuple[Any, Any]:
    """``scan``; ``state``: what else ``fn``'s ops depend on (a module's training modes), part of
    a pure ``fn``'s recording key."""
    if not callable(fn):
        raise ValueError(f"scan: fn {fn!r} is not callable")
    policy = checkpoint_policy(partition_fn, "scan")
    init_leaves, init_tree, init_names = _flatten(init, "init")
    xs_leaves, xs_tree, xs_names = _flatten(xs, "xs")
    names = init_names + xs_names
    length = _length(xs_leaves, xs_names)
    recordings = _recordings(fn) if pure and not loop.recording_inside() else None
    key = None if recordings is None else _recording_key(init_leaves, init_tree, xs_leaves, xs_tree)
    found = None if recordings is None else recordings.get((key, state))
    if found is None:
        found = _record(fn, init_leaves, init_tree, xs_leaves, xs_tree, names)
        if recordings is not None:
            recordings[(key, state)] = found
    recorded, ys_tree = found
    carry, ys = loop.scan(recorded, init_leaves, xs_leaves, length, policy=policy)
    return _unflatten(carry, init_tree), _unflatten(ys, ys_tree)


def _record(
    fn: Callable, init: list, init_tree: tuple, xs: list, xs_tree: tuple, names: list
) -> tuple[loop.Recorded, tuple]:
    """``fn`` recorded on placeholders, and the structure of the ys it returns."""
    ys_structure: list = []

    def body(carry: list, x: list) -> tuple[list, list]:
        out = fn(_unflatten(carry, init_tree), _unflatten(x, xs_tree))
        if not isinstance(out, (tuple, list)) or len(out) != 2:
            raise ValueError(f"scan: fn must return (carry, y), not {type(out).__name__}")
        new, y = out
        leaves, tree = pytree.tree_flatten(new)
        if tree != init_tree[1] or [t is None for t in leaves] != [t is None for t in init_tree[0]]:
            raise ValueError(
                f"scan: fn returned a carry of structure {tree}, init is {init_tree[1]}"
            )
        leaves = [t for t in leaves if t is not None]
        for name, before, after in zip(names, carry, leaves):
            after = _xla_tensor(f"the carry's {name}", after)
            if (after.shape, after.dtype) != (before.shape, before.dtype):
                raise ValueError(
                    f"scan: fn changed the carry's {name} from {_text(before)} to {_text(after)}; "
                    "a scan's carry keeps its shape and dtype"
                )
        ys, ys_tree, _ = _flatten(y, "fn's y")
        ys_structure.append(ys_tree)
        return leaves, ys

    recorded = loop.record_scan("scan", body, init, xs, names, inputs_writable=True)
    return recorded, ys_structure[0]


def _recordings(fn: Callable) -> dict | None:
    """The kept recordings of ``fn`` (None where it cannot be held weakly)."""
    return _kept_for(_SCAN_COMPUTATION_CACHE, fn)


def _kept_for(cache: weakref.WeakKeyDictionary, fn: Callable) -> dict | None:
    """``cache``'s dict for ``fn`` (None where ``fn`` cannot be held weakly)."""
    try:
        return cache.setdefault(fn, {})
    except TypeError:
        return None


def _recording_key(init: list, init_tree: tuple, xs: list, xs_tree: tuple) -> tuple:
    """What a pure function's recording depends on besides the function: the pytrees' structures
    (None leaves included), the avals it is recorded on, and autocast (its casts are recorded)."""
    return (
        init_tree[1],
        tuple(t is None for t in init_tree[0]),
        xs_tree[1],
        tuple(t is None for t in xs_tree[0]),
        loop.scan_avals(init, xs),
        torch.is_autocast_enabled(DEVICE.type),
        torch.get_autocast_dtype(DEVICE.type),
    )


def _flatten(tree: Any, name: str) -> tuple[list, tuple, list]:
    """The xla tensors of a pytree (its None leaves are left out), how to put them back, and
    their names (``init[0]``, ``xs['w']``)."""
    paths, spec = pytree.tree_flatten_with_path(tree)
    named = [(f"{name}{pytree.keystr(p)}", t) for p, t in paths if t is not None]
    tensors = [_xla_tensor(n, t) for n, t in named]
    return tensors, ([t for _, t in paths], spec), [n for n, _ in named]


def _unflatten(tensors: list, tree: tuple) -> Any:
    leaves, spec = tree
    tensors = iter(tensors)
    return pytree.tree_unflatten([None if t is None else next(tensors) for t in leaves], spec)


def _length(xs: list, names: list) -> int:
    """The number of iterations: the leading dimension every leaf of ``xs`` shares."""
    if not xs:
        raise ValueError("scan: xs is an empty pytree; nothing says how many iterations to run")
    for name, x in zip(names, xs):
        if x.dim() == 0:
            raise ValueError(f"scan: {name} is a 0-dim tensor; there is no dimension to scan")
        if x.shape[0] != xs[0].shape[0]:
            raise ValueError(
                f"scan: the leaves of xs differ in length: {names[0]} has {xs[0].shape[0]}, "
                f"{name} has {x.shape[0]}"
            )
    return xs[0].shape[0]


def _xla_tensor(name: str, t: Any) -> LazyTensor:
    if not isinstance(t, LazyTensor):
        where = f"on {t.device}" if isinstance(t, torch.Tensor) else f"a {type(t).__name__}"
        raise ValueError(f"{name} must be an xla tensor, it is {where}")
    return t


def _text(t: torch.Tensor) -> str:
    return aval_text(Aval(tuple(t.shape), t.dtype))
