"""torch_xla.backends: switches of the XLA backend, as ``torch.backends.<device>`` has for others.

The matmul precision applies to float32 matrix products and convolutions of the programs traced
after it is set: it enters the compile-cache key, so a program built for one precision is never
reused for another. Our default is ``'highest'`` (PyTorch/XLA's is ``'default'``): float32 matmuls
match PyTorch on the CPU unless asked otherwise.
"""

from __future__ import annotations

import logging
from typing import Literal

from spmd_torch import config as _config

__all__ = ["get_mat_mul_precision", "set_mat_mul_precision"]

logger = logging.getLogger(__name__)

_PRECISIONS = ("default", "high", "highest")
_WARNING_MESSAGE = (
    "Setting mat mul precision multiple times is not recommended. If you need to do so, please "
    "empirically verify that the precision setting is behaving as expected."
)


def set_mat_mul_precision(precision: Literal["default", "high", "highest"]) -> None:
    """Set the precision of float32 matmuls and convolutions in the programs traced from now on.

    On a TPU, ``'default'`` rounds float32 operands to one bfloat16 pass (fastest), ``'high'``
    takes three bfloat16 passes (about 14 bits) and ``'highest'`` six (about 22 bits, float32);
    GPUs map ``'high'`` to TF32. XLA on the CPU computes float32 products in float32 at every
    setting. The value is JAX's ``jax.lax.Precision`` of each product.

    Args:
        precision: ``'default'``, ``'high'`` or ``'highest'``.

    Raises:
        ValueError: Any other value.

    Example:
        >>> import spmd_torch.backends
        >>> spmd_torch.backends.set_mat_mul_precision('high')
    """
    if precision not in _PRECISIONS:
        raise ValueError(
            f"Invalid precision: {precision!r}. Must be one of {', '.join(_PRECISIONS)}."
        )
    logger.warning(_WARNING_MESSAGE)
    _config.MAT_MUL_PRECISION.value = precision


def get_mat_mul_precision() -> Literal["default", "high", "highest"]:
    """The precision of float32 matmuls and convolutions (see :func:`set_mat_mul_precision`).

    Example:
        >>> spmd_torch.backends.get_mat_mul_precision()
        'highest'
    """
    return _config.MAT_MUL_PRECISION.value
