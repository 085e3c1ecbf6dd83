"""``torch_xla_py`` (a seed guide's older name for PyTorch/XLA's modules), installed with
``torch_xla``."""

from spmd_torch._as_torch_xla import become_older_name

become_older_name(__import__("sys").modules[__name__])
