"""torch_xla.utils mirrors: utils (``xu``), serialization, checkpoint."""
