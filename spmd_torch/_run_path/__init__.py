"""A folder for ``PYTHONPATH``: ``run_as_torch_xla`` hands it to the processes its run starts."""
