"""Compile regions: a block or function traced as one graph, run at its end (``spmd_torch.compile``,
``spmd_torch.step``)."""

from __future__ import annotations

import contextlib
import functools
import weakref
from collections.abc import Callable, Iterator
from typing import Any

from spmd_torch._barrier import barrier
from spmd_torch._lazy import engine
from spmd_torch._lazy import execute as _execute
from spmd_torch._lazy.compile import explain_graph_change
from spmd_torch._lazy.graph import STRUCTURES, aval_text
from spmd_torch.debug.graph import pending_program

__all__ = ["compile", "step"]


class _Region:
    """One ``compile`` region: its name, its switches and the distinct graphs it produced; a
    context manager, and a decorator whose calls all count towards ``max_different_graphs``."""

    def __init__(self, name: str | None, full_graph: bool, max_different_graphs: int | None):
        if max_different_graphs is not None and max_different_graphs < 1:
            raise ValueError(f"max_different_graphs must be >= 1, got {max_different_graphs}")
        self.name = name
        self.full_graph = full_graph
        self.max_different_graphs = max_different_graphs
        self.graphs: set = set()
        self._open: list = []  # the regions entered with ``with``, innermost last

    def __enter__(self) -> None:
        self._open.append(self.tracing())
        self._open[-1].__enter__()

    def __exit__(self, *exc_info) -> bool | None:
        return self._open.pop().__exit__(*exc_info)

    def __call__(self, f: Callable) -> Callable:
        if self.name is None:
            self.name = getattr(f, "__name__", None) or str(f)
        try:  # counted per function, as PyTorch/XLA does: a loop may wrap it at every step
            self.graphs = _GRAPHS_OF.setdefault(f, self.graphs)
        except TypeError:  # not weakly referenceable: this wrapper's own count
            pass

        @functools.wraps(f)
        def compiled(*args: Any, **kwargs: Any) -> Any:
            with self.tracing():
                return f(*args, **kwargs)

        return compiled

    @property
    def label(self) -> str:
        return self.name or "compile"

    @contextlib.contextmanager
    def tracing(self) -> Iterator[None]:
        """Trace the block lazily as one graph (eager mode off) and run it at the end."""
        own = engine.current()
        barrier()  # what came before is not part of the region's graph
        eager, own.eager = own.eager, False
        one_graph = contextlib.nullcontext()
        if self.full_graph:
            one_graph = _execute.one_graph(f"compile region {self.label!r} (full_graph=True)")
        try:
            with one_graph:
                yield
        finally:
            change = None
            if self.max_different_graphs is not None:
                program = pending_program()
                graph = (program.identity, tuple(n.avals[i] for n, i in program.leaves))
                if graph not in self.graphs:  # its ops named for the explanation (the graphs
                    # before it were compiled, which names theirs)
                    own.cache.ops.update((id(node.op), node.op) for node in program.nodes)
                    change = _change(graph, self.graphs, own.cache.ops)
                    self.graphs.add(graph)
            barrier()
            own.eager = eager
            if change is not None and len(self.graphs) > self.max_different_graphs:
                raise RuntimeError(
                    f"compile region {self.label!r} traced {len(self.graphs)} different "
                    f"graphs, more than max_different_graphs={self.max_different_graphs}; "
                    f"against the most similar one before, {change}"
                )


def _change(graph: tuple, before: set, ops: dict) -> str:
    """What differs between ``graph`` (identity, input avals) and the most similar of ``before``:
    the first input whose shape or dtype changed, or the first op that did."""
    if not before:
        return "none before"
    identity, avals = graph
    nodes = len(STRUCTURES[identity][0])

    def likeness(other: tuple) -> tuple:
        return (
            other[0] == identity,
            len(STRUCTURES[other[0]][0]) == nodes,
            sum(a == b for a, b in zip(other[1], avals)),
        )

    old_identity, old_avals = max(before, key=likeness)
    if old_identity == identity:
        changed = [
            f"input {k}: {aval_text(a)} -> {aval_text(b)}"
            for k, (a, b) in enumerate(zip(old_avals, avals))
            if a != b
        ]
        return "its input shapes changed: " + "; ".join(changed[:3])
    return explain_graph_change(STRUCTURES[old_identity], STRUCTURES[identity], ops)


# A compiled function (weakly) -> the distinct graphs its calls traced, over all its wrappers.
_GRAPHS_OF: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def compile(
    f: Callable | None = None,
    full_graph: bool = False,
    name: str | None = None,
    max_different_graphs: int | None = None,
):
    """Trace ``f`` (or the ``with`` block) into one graph, compiled once and run at its end.

    The region syncs before it starts (earlier work is not part of it) and when it ends, and
    traces lazily even in eager mode. As a decorator the region's graphs are counted over all
    calls of ``f``.

    Args:
        f: The function or module to compile; ``None`` gives a context manager (or decorator).
        full_graph: Raise if anything inside needs a program to run before the region ends
            (``.item()``, ``.cpu()``, printing a tensor, an op whose output shape depends on
            data, ``mark_step``); the error names the line.
        name: The region's name in error messages; default ``f``'s name.
        max_different_graphs: Raise when the region has traced more than this many different
            graphs (new input shapes or a different sequence of ops trace a new graph).

    Returns:
        ``f`` compiled, or a context manager when ``f`` is ``None``.

    Example:
        >>> @spmd_torch.compile(full_graph=True)
        ... def step(x):
        ...     return torch.sin(x) + torch.cos(x)
        >>> with spmd_torch.compile():
        ...     y = step(x) * 2
    """
    region = _Region(name, full_graph, max_different_graphs)
    return region if f is None else region(f)


def step() -> contextlib.AbstractContextManager:
    """A training step as a block: syncs before it and runs its one graph at its end.

    Example:
        >>> for x, y in loader:
        ...     with spmd_torch.step():
        ...         loss_fn(model(x), y).backward()
        ...         optimizer.step()
    """
    return compile()
