"""torch_xla.debug mirrors: metrics (counters and timings), the pending graph as text, HLO or
StableHLO, PyTorch/XLA's ``LoweringContext`` over it, and the profiler."""
