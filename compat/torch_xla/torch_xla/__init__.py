"""PyTorch/XLA's name for spmd_torch: installed on purpose (``pip install ./compat/torch_xla``),
since libraries switch into their XLA code paths as soon as they see a ``torch_xla``."""

from spmd_torch._as_torch_xla import become_torch_xla

become_torch_xla(__import__("sys").modules[__name__])
