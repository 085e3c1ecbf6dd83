"""torch_xla.core mirrors: xla_model."""
