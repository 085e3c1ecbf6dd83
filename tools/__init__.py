"""Developer tools: the benchmarks (python -m tools.bench) and scripts run from the repository root."""
