"""torch_xla.core.xla_op_registry: PyTorch operations whose lowering is written with the builder.

``register(name, opfn)`` gives an operation that, called on xla tensors, builds ``opfn`` over
parameters of the tensors' shapes (``spmd_torch.core.xla_builder``), once per distinct shapes
and keyword arguments, and records the computation as one node of the lazy graph: it runs
inside the step's program at the next barrier, like any other op.
"""

from __future__ import annotations

import pickle
import sys
import threading
from collections.abc import Callable
from typing import Any

import torch

from spmd_torch.core import xla_builder as xb
from spmd_torch.utils import utils as xu

__all__ = ["Op", "register"]


class Op:
    """A PyTorch operation whose XLA lowering is a builder function.

    Args:
        name: The operation's name; the graph and HLO op names call it ``xla::_op_<name>``.
        opfn: Takes one ``xla_builder.Op`` per input tensor, plus keyword arguments, and
            returns the result op (a tuple op for several results).

    Example:
        >>> op = Op('axpy', lambda a, x, y: a * x + y)
        >>> out = op(a, x, y)  # xla tensors of one shape and dtype
    """

    def __init__(self, name: str, opfn: Callable):
        self._name = name
        self._opfn = opfn
        self._opname = "xla::_op_" + name
        self._lock = threading.Lock()
        self._computations: dict = {}

    def __call__(self, *args: torch.Tensor, **kwargs: Any) -> Any:
        """Run the operation on xla tensors.

        Args:
            *args: The xla tensors, the parameters of the builder function in order.
            **kwargs: Python values passed to the builder function (not tensors); each distinct
                set builds its own computation.

        Returns:
            The result tensor, or a list of them when the function returns a tuple of several.
        """
        shapes = xb.tensor_shape(args)
        key = (
            tuple((s.dtype, s.sizes) for s in shapes),
            pickle.dumps(sorted(kwargs.items())),
        )
        with self._lock:
            computation = self._computations.get(key)
            if computation is None:
                computation = xb.create_computation(self._name, self._opfn, shapes, **kwargs)
                self._computations[key] = computation
                if xu.getenv_as("XLA_OP_PRINT_COMPUTATIONS", bool, False):
                    print(xb.get_computation_hlo(computation), file=sys.stderr)
        result = xb._user_computation(self._opname, args, computation)
        return result[0] if len(result) == 1 else result


def register(name: str, opfn: Callable) -> Op:
    """Register a PyTorch operation whose XLA lowering is ``opfn``, written with the builder.

    Register operations once (at module level): each keeps the computations it built, so calls
    with shapes and keyword arguments seen before do not build again.

    Args:
        name: The operation's name.
        opfn: Takes one ``xla_builder.Op`` per input tensor (and keyword arguments), returns
            the result op.

    Returns:
        The :class:`Op`, to be called on xla tensors.

    Example:
        >>> import spmd_torch.core.xla_op_registry as xor
        >>> def slice_and_add(a, b, dimno=0):
        ...     sa = a.slice_in_dim(start_index=0, limit_index=1, dimno=dimno)
        ...     sb = b.slice_in_dim(start_index=1, limit_index=2, dimno=dimno)
        ...     return sa + sb
        >>> SLICE_AND_ADD = xor.register('slice_and_add', slice_and_add)
        >>> z = SLICE_AND_ADD(x, y, dimno=0)  # x, y: 2x2 xla tensors
    """
    return Op(name, opfn)
