"""``torch_xla`` in the processes a ``run_as_torch_xla`` run starts (a ``multiprocessing`` spawn
child, a subprocess): their ``PYTHONPATH`` holds this package's folder, so they see PyTorch/XLA's
names as the run's own process does, metadata included."""

from spmd_torch._as_torch_xla import become_torch_xla

become_torch_xla(__import__("sys").modules[__name__], installed=False)
