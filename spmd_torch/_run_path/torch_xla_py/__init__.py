"""``torch_xla_py`` (a seed guide's older name) in the processes a ``run_as_torch_xla`` run
starts, beside ``torch_xla``."""

from spmd_torch._as_torch_xla import become_older_name

become_older_name(__import__("sys").modules[__name__], installed=False)
