"""The pending graph, as text and as StableHLO, without running it: what the next sync compiles.

``get_tensors_text`` and ``get_tensors_hlo`` answer what PyTorch/XLA's
``torch_xla._XLAC._get_xla_tensors_text`` / ``_get_xla_tensors_hlo`` answer.
"""

from __future__ import annotations

import torch

from spmd_torch._lazy import compile as _compile
from spmd_torch._lazy import engine as _engine
from spmd_torch._lazy import placement as _placement
from spmd_torch._lazy.graph import Program, linearize, to_text
from spmd_torch._lazy.tensor import live_pending


def pending_text(tensors: list[torch.Tensor] | None = None) -> str:
    """The pending graph computing ``tensors`` as text, one typed line per op.

    Args:
        tensors: xla tensors whose graph to show; default: every pending tensor.

    Example:
        >>> y = torch.ones(2, device=dev) * 3
        >>> print(graph.pending_text([y]))
    """
    return to_text(pending_program(tensors))


def pending_hlo(tensors: list[torch.Tensor] | None = None) -> str:
    """The pending graph computing ``tensors`` lowered to StableHLO text; nothing runs.

    Args:
        tensors: xla tensors whose graph to lower; default: every pending tensor.

    Example:
        >>> print(graph.pending_hlo([y]))
    """
    program = pending_program(tensors)
    arrays = [_placement.resolve(node, i) for node, i in program.leaves]
    return _compile.stablehlo_text(program, arrays)


def pending_count() -> int:
    """How many live tensors (counting aliases once) hold a value the next sync computes.

    Example:
        >>> y = torch.ones(2, device=dev) * 3
        >>> graph.pending_count()
        1
    """
    key = _engine.current().rng  # the engine's own PRNG key is not a tensor
    return sum(1 for s in live_pending() if s is not key and not s.ref[0].is_leaf(s.ref[1]))


def get_tensors_text(tensors: list[torch.Tensor]) -> str:
    """The graph computing ``tensors`` as text (``_XLAC._get_xla_tensors_text``).

    Args:
        tensors: xla tensors; computed ones show as inputs.

    Example:
        >>> print(graph.get_tensors_text([y]))
    """
    return pending_text(_checked(tensors, "get_tensors_text"))


def get_tensors_hlo(tensors: list[torch.Tensor]) -> str:
    """The graph computing ``tensors`` as StableHLO text (``_XLAC._get_xla_tensors_hlo``).

    Args:
        tensors: xla tensors.

    Example:
        >>> print(graph.get_tensors_hlo([y]))
    """
    return pending_hlo(_checked(tensors, "get_tensors_hlo"))


def _checked(tensors, api: str) -> list[torch.Tensor]:
    tensors = list(tensors)
    for i, t in enumerate(tensors):
        if not isinstance(t, torch.Tensor) or t.device.type != "xla":
            where = t.device if isinstance(t, torch.Tensor) else type(t).__name__
            raise ValueError(f"{api}: tensors[{i}] is not an xla tensor ({where})")
    return tensors


def pending_program(tensors: list[torch.Tensor] | None = None) -> Program:
    """The linearised graph computing ``tensors`` (default: every pending tensor); nothing runs.

    Example:
        >>> program = graph.pending_program([y])
    """
    if tensors is None:
        refs = [s.ref for s in live_pending() if not s.ref[0].is_leaf(s.ref[1])]
    else:
        refs = [t._ref() for t in tensors]
    return linearize(list({(id(n), i): (n, i) for n, i in refs}.values()))
