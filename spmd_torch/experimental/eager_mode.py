"""torch_xla.experimental's eager mode: every op on an xla tensor runs as soon as it is issued.

Tracing a whole step into one program is fast but defers errors and values to the barrier; eager
mode trades speed for immediacy while debugging or porting. Each op becomes a barrier of its own:
a one-op program, compiled once per op signature (shapes, dtypes, arguments) and cached, as
PyTorch/XLA's eager mode does. ``spmd_torch.compile`` regions inside still trace lazily into one
graph. ``XLA_USE_EAGER_DEBUG_MODE=1`` in the environment turns it on at import.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator

from spmd_torch._lazy import config as _config
from spmd_torch._lazy import execute as _execute
from spmd_torch._lazy import tensor as _tensor

__all__ = ["eager_mode", "eager_mode_context", "is_eager_mode"]

_nesting = threading.local()  # ops issued by an op (decompositions) run with their caller
_lazy_dispatch: list[Callable] = []  # the tracing dispatcher, while eager mode wraps it


def _run_each_op(func, args: tuple, kwargs: dict):
    """The dispatcher of eager mode: trace the op as usual, then run what it left pending."""
    depth = getattr(_nesting, "depth", 0)
    _nesting.depth = depth + 1
    try:
        out = _lazy_dispatch[0](func, args, kwargs)
    finally:
        _nesting.depth = depth
    if depth == 0:
        _execute.sync(step=False)
    return out


def eager_mode(enable: bool) -> None:
    """Turn eager mode on or off for the whole process (PyTorch/XLA's default execution mode).

    Args:
        enable: ``True``: each op runs when issued; ``False``: ops are traced until a barrier.

    Example:
        >>> import spmd_torch.experimental as exp
        >>> exp.eager_mode(True)
        >>> y = torch.ones(3, device='xla') * 2  # computed here, no mark_step needed
        >>> exp.eager_mode(False)
    """
    if bool(enable) == is_eager_mode():
        return
    if enable:
        _lazy_dispatch.append(_tensor.connected())
        _tensor.connect(_run_each_op)
        _execute.sync(step=False)  # what was traced so far runs now, as each later op will
    else:
        _tensor.connect(_lazy_dispatch.pop())
    _config.EAGER.value = bool(enable)


def is_eager_mode() -> bool:
    """Whether ops run as soon as they are issued.

    Example:
        >>> spmd_torch.experimental.is_eager_mode()
        False
    """
    return bool(_config.EAGER.value) and bool(_lazy_dispatch)


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
