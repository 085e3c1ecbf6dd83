"""torch_xla.debug.metrics_saver: the metrics report of every step, appended to a file.

PyTorch/XLA's performance guide has ``XLA_METRICS_FILE`` collect per-step metrics without
touching the script: each barrier (``spmd_torch.sync``, ``xm.mark_step``) appends the full
report. ``STDOUT`` and ``STDERR`` print it instead.
"""

from __future__ import annotations

import sys
import threading

from spmd_torch import config as _config
from spmd_torch.debug import metrics as _metrics

__all__ = ["save_metrics"]

_LOCK = threading.Lock()


def save_metrics(metrics_file: str | None = None) -> None:
    """Append the metrics report to ``metrics_file`` (default: ``$XLA_METRICS_FILE``; nothing
    when neither is set); ``'STDOUT'``/``'STDERR'`` print it there.

    Args:
        metrics_file: A path, ``'STDOUT'`` or ``'STDERR'``.

    Example:
        >>> import spmd_torch.debug.metrics_saver as ms
        >>> ms.save_metrics('/tmp/metrics.txt')
    """
    metrics_file = metrics_file or _config.METRICS_FILE.value
    if metrics_file is None:
        return
    report = _metrics.metrics_report()
    if metrics_file == "STDERR":
        print(report, file=sys.stderr)
    elif metrics_file == "STDOUT":
        print(report)
    else:
        with _LOCK, open(metrics_file, "a") as out:
            out.write(report)
