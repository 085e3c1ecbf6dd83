"""``torch_xla._XLAC``: the calls into PyTorch/XLA's C++ extension that its guides show users.

The performance guide prints ``torch_xla._XLAC._xla_metrics_report()`` after each step, and the
troubleshooting guide reads a tensor's pending graph with ``_get_xla_tensors_text`` and
``_get_xla_tensors_hlo``. The rest of ``_XLAC`` is PyTorch/XLA's internals and has no mirror here.

Example:
    >>> print(spmd_torch._XLAC._xla_metrics_report())
"""

from spmd_torch.debug.graph import get_tensors_hlo as _get_xla_tensors_hlo
from spmd_torch.debug.graph import get_tensors_text as _get_xla_tensors_text
from spmd_torch.debug.metrics import metrics_report as _xla_metrics_report

__all__ = ["_get_xla_tensors_hlo", "_get_xla_tensors_text", "_xla_metrics_report"]
