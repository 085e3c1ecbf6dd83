"""torch_xla.experimental's eager mode: every op on an xla tensor runs as soon as it is issued.

Tracing a whole step into one program is fast but defers errors and values to the barrier; eager
mode trades speed for immediacy while debugging or porting. Each op runs as a program of its own
(not a step: no step closures run), compiled once per op signature (shapes, dtypes, arguments) and
cached, as PyTorch/XLA's eager mode does. The switch belongs to the engine: each replica of
``launch`` has its own. ``spmd_torch.compile`` regions inside still trace lazily into one
graph. ``XLA_USE_EAGER_DEBUG_MODE=1`` in the environment turns it on at import.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from spmd_torch import _barrier
from spmd_torch._lazy import engine as _engine

__all__ = ["eager_mode", "eager_mode_context", "is_eager_mode"]


def eager_mode(enable: bool) -> None:
    """Turn eager mode on or off (PyTorch/XLA's default execution mode), for this program or,
    inside ``launch``, this replica.

    Turning it on first runs what was traced so far (a barrier), as each later op will be.

    Args:
        enable: ``True``: each op runs when issued; ``False``: ops are traced until a barrier.

    Example:
        >>> import spmd_torch.experimental as exp
        >>> exp.eager_mode(True)
        >>> y = torch.ones(3, device='xla') * 2  # computed here, no mark_step needed
        >>> exp.eager_mode(False)
    """
    own = _engine.current()
    if enable and not own.eager:
        _barrier.barrier()
    own.eager = bool(enable)


def is_eager_mode() -> bool:
    """Whether ops run as soon as they are issued.

    Example:
        >>> spmd_torch.experimental.is_eager_mode()
        False
    """
    return _engine.current().eager


@contextlib.contextmanager
def eager_mode_context(enable: bool) -> Iterator[bool]:
    """Eager mode on (or off) inside the block, restored after it; yields the mode it replaced.

    Args:
        enable: The mode inside the block.

    Example:
        >>> with spmd_torch.experimental.eager_mode_context(True):
        ...     print((torch.ones(2, device='xla') + 1).cpu())
    """
    saved = is_eager_mode()
    eager_mode(enable)
    try:
        yield saved
    finally:
        eager_mode(saved)
