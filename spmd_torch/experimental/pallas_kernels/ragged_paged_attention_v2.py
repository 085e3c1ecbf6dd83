"""torch_xla.experimental.pallas_kernels.ragged_paged_attention_v2: the ragged paged attention
Pallas TPU kernel, a JAX function, with its reference and input checks.

These are JAX's (``jax.experimental.pallas.ops.tpu.ragged_paged_attention``, whichever names this
JAX's module has: ``ragged_paged_attention``, ``ref_ragged_paged_attention``, ...), the kernel
PyTorch/XLA's module holds a copy of. Called on torch tensors, use
``spmd_torch.experimental.custom_kernel.ragged_paged_attention`` (every platform).
"""

from jax.experimental.pallas.ops.tpu import ragged_paged_attention as _jax_module


def __getattr__(name: str):
    for module in (_jax_module, getattr(_jax_module, "kernel", None)):
        if module is not None and hasattr(module, name):
            return getattr(module, name)
    raise AttributeError(f"{__name__} has no attribute {name!r} (nor has JAX's kernel module)")
