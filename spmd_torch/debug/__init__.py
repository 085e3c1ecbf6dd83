"""torch_xla.debug mirrors: metrics (counters and timings) and the pending graph as text or StableHLO."""
