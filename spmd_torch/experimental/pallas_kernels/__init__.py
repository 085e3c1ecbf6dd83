"""torch_xla.experimental.pallas_kernels: Pallas TPU kernels as JAX functions.

``ragged_paged_attention_v2`` is JAX's own copy of the ragged paged attention kernel, the one
``custom_kernel.ragged_paged_attention`` runs on TPU. PyTorch/XLA's other modules here
(``multi_queries_paged_attention_kernel``, ``quantized_matmul_kernel``) hold kernels of its own,
which JAX does not ship; they are not provided.
"""
