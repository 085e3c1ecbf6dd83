"""torch_xla.experimental.pallas_kernels.ragged_paged_attention_v2: the ragged paged attention
Pallas TPU kernel, a JAX function, with its reference and input checks.

These are JAX's (``jax.experimental.pallas.ops.tpu.ragged_paged_attention``), the kernel
PyTorch/XLA's module holds a copy of. Called on torch tensors, use
``spmd_torch.experimental.custom_kernel.ragged_paged_attention`` (every platform).
"""

from jax.experimental.pallas.ops.tpu.ragged_paged_attention import (
    dynamic_validate_inputs,
    get_tuned_block_sizes,
    ragged_paged_attention,
    ref_ragged_paged_attention,
    static_validate_inputs,
)
from jax.experimental.pallas.ops.tpu.ragged_paged_attention.kernel import DEFAULT_MASK_VALUE

__all__ = [
    "DEFAULT_MASK_VALUE",
    "dynamic_validate_inputs",
    "get_tuned_block_sizes",
    "ragged_paged_attention",
    "ref_ragged_paged_attention",
    "static_validate_inputs",
]
