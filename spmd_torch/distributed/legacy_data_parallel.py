"""torch_xla_py.data_parallel (PyTorch/XLA before 1.0), as seed guide 002 uses it: the
:mod:`spmd_torch.distributed.data_parallel` API, but each device's loader yields
``(batch_number, batch)`` pairs (``for _, (data, target) in loader``), where PyTorch/XLA 2.9's
yields the batches alone.
"""

from __future__ import annotations

from collections.abc import Iterable

from spmd_torch.distributed import data_parallel
from spmd_torch.distributed.data_parallel import Context

__all__ = ["Context", "DataParallel"]


class DataParallel(data_parallel.DataParallel):
    """:class:`spmd_torch.distributed.data_parallel.DataParallel` with numbered batches.

    Example:
        >>> def train_loop_fn(model, loader, device, context):
        ...     for step, (data, target) in loader:
        ...         ...
        >>> DataParallel(MNIST, device_ids=devices)(train_loop_fn, train_loader)
    """

    def _device_loader(self, loader: data_parallel.PerDeviceLoader) -> Iterable:
        """The device's batches numbered from 0, as torch_xla_py's loader gave them."""
        return enumerate(loader)
