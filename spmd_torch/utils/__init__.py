"""torch_xla.utils mirrors: serialization."""
