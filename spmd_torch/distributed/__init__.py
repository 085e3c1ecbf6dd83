"""torch_xla.distributed on JAX: SPMD sharding (``spmd``) and the distributed helpers around it."""
