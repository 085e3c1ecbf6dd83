"""Mapping between PyTorch and JAX dtypes, with the bf16 switches applied at the device boundary."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import torch

from spmd_torch import config

_TORCH_TO_JAX = {
    torch.float32: jnp.dtype(jnp.float32),
    torch.float64: jnp.dtype(jnp.float64),
    torch.bfloat16: jnp.dtype(jnp.bfloat16),
    torch.float16: jnp.dtype(jnp.float16),
    torch.float8_e5m2: jnp.dtype(jnp.float8_e5m2),  # fp8 caches and weights (inference)
    torch.float8_e4m3fn: jnp.dtype(jnp.float8_e4m3fn),
    torch.int8: jnp.dtype(jnp.int8),
    torch.int16: jnp.dtype(jnp.int16),
    torch.int32: jnp.dtype(jnp.int32),
    torch.int64: jnp.dtype(jnp.int64),
    torch.uint8: jnp.dtype(jnp.uint8),
    torch.uint16: jnp.dtype(jnp.uint16),
    torch.uint32: jnp.dtype(jnp.uint32),
    torch.uint64: jnp.dtype(jnp.uint64),
    torch.bool: jnp.dtype(jnp.bool_),
    torch.complex64: jnp.dtype(jnp.complex64),
    torch.complex128: jnp.dtype(jnp.complex128),
}
_JAX_TO_TORCH = {v: k for k, v in _TORCH_TO_JAX.items()}


class UnsupportedDtypeError(TypeError):
    """A dtype the device cannot hold or compute in."""


def to_jax_dtype(dtype: torch.dtype, op: object = None) -> np.dtype:
    """The dtype a tensor of PyTorch ``dtype`` has on the device (bf16 switches applied)."""
    if dtype is torch.float32:
        if config.USE_BF16.value or config.DOWNCAST_BF16.value:
            return _TORCH_TO_JAX[torch.bfloat16]
    elif dtype is torch.float64:
        if config.USE_BF16.value:
            return _TORCH_TO_JAX[torch.bfloat16]
        if config.DOWNCAST_BF16.value:
            return _TORCH_TO_JAX[torch.float32]
    try:
        return _TORCH_TO_JAX[dtype]
    except KeyError:
        where = f" in {op}" if op is not None else ""
        raise UnsupportedDtypeError(
            f"dtype {dtype}{where} is not supported on the xla device"
        ) from None


def to_torch_dtype(dtype: object) -> torch.dtype:
    """The PyTorch dtype of a JAX/numpy dtype, without the bf16 switches."""
    return _JAX_TO_TORCH[jnp.dtype(dtype)]


def promote(*dtypes: object) -> np.dtype:
    """PyTorch's type promotion over JAX dtypes (jnp.promote_types differs for mixed int/uint)."""
    result = to_torch_dtype(dtypes[0])
    for d in dtypes[1:]:
        result = torch.promote_types(result, to_torch_dtype(d))
    return _TORCH_TO_JAX[result]
