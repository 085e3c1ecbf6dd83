"""torch_xla.experimental on JAX: APIs PyTorch/XLA still calls experimental (SPMD FSDP...)."""
