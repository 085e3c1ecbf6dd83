"""torch_xla.distributed.data_parallel on JAX: the legacy multi-device API of one process.

``DataParallel(network)`` keeps one copy of the network per device; calling it with a training
loop runs the loop once per device, each on its own copy and its own share of the batches, and
returns what each loop returned. Here each device's loop is one replica of
:func:`spmd_torch.distributed.xla_multiprocessing.spawn`, so ``xm.optimizer_step`` inside the loop
averages the gradients over the devices exactly as it does under ``xmp.spawn``. Each device's
loader yields batches, as PyTorch/XLA 2.9's; ``legacy_data_parallel`` (``torch_xla_py``'s) numbers
them.
"""

from __future__ import annotations

import copy
import threading
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
import torch.utils._pytree as pytree

from spmd_torch import runtime
from spmd_torch.core import xla_model as xm
from spmd_torch.distributed import xla_multiprocessing as xmp

__all__ = ["Context", "DataParallel", "PerDeviceLoader"]


class Context:
    """Per-device state that outlives one call of :class:`DataParallel`, such as the optimizer.

    Args:
        device: The device of this context's replica.

    Example:
        >>> def train_loop_fn(model, loader, device, context):
        ...     optimizer = context.getattr_or('optimizer', lambda: optim.SGD(model.parameters(), 0.1))
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def getattr_or(self, name: str, defval: Any) -> Any:
        """The attribute ``name``, first set to ``defval()`` (or ``defval``, if not callable).

        Args:
            name: The attribute.
            defval: Its initial value, or a function making it (called only the first time).

        Example:
            >>> context.getattr_or('step', 0)
            0
        """
        value = getattr(self, name, None)
        if value is None:
            value = defval() if callable(defval) else defval
            setattr(self, name, value)
        return value


class _Dealer:
    """Deals the host loader's batches to the replicas in turn, as PyTorch/XLA's ParallelLoader:
    batch ``k`` goes to replica ``k % count``. A last round that cannot give every replica a batch
    is dropped: each replica must run as many steps as the others, since their collectives meet.
    """

    def __init__(self, loader: Iterable, count: int, fixed_batch_size: bool, batchdim: int) -> None:
        self._batches = iter(loader)
        self._count = count
        self._fixed_batch_size = fixed_batch_size
        self._batchdim = batchdim
        self._batch_size: int | None = None
        self._queues: list[deque] = [deque() for _ in range(count)]
        self._done = False
        self._lock = threading.Lock()

    def next(self, index: int) -> Any | None:
        """Replica ``index``'s next batch (on the host), or ``None`` when it has no more."""
        with self._lock:
            if not self._queues[index] and not self._done:
                self._deal_round()
            return self._queues[index].popleft() if self._queues[index] else None

    def _deal_round(self) -> None:
        batches = _take(self._batches, self._count)
        if len(batches) < self._count or not all(map(self._fits, batches)):
            self._done = True
            return
        for queue, batch in zip(self._queues, batches):
            queue.append(batch)

    def _fits(self, batch: Any) -> bool:
        """With ``fixed_batch_size``, whether ``batch`` has the size of the first one."""
        if not self._fixed_batch_size:
            return True
        sizes = {t.shape[self._batchdim] for t in pytree.tree_leaves(batch) if torch.is_tensor(t)}
        if len(sizes) > 1:
            raise ValueError(
                f"DataParallel: a batch mixes sizes {sorted(sizes)} along the batch dim"
            )
        size = sizes.pop() if sizes else None
        if self._batch_size is None:
            self._batch_size = size
        return size == self._batch_size


def _take(batches: Iterator, count: int) -> list:
    """Up to ``count`` batches, by ``next`` alone: ``itertools.islice`` calls ``iter()`` on the
    iterator, which restarts PyTorch/XLA's ``SampleGenerator`` (its ``__iter__`` makes a new one),
    so a loop over one would never end."""
    taken = []
    for _ in range(count):
        try:
            taken.append(next(batches))
        except StopIteration:
            break
    return taken


class PerDeviceLoader:
    """One device's batches, already on the device, as PyTorch/XLA 2.9's per-device loader.

    Each ``next`` first issues the barrier (``xm.mark_step()``), as PyTorch/XLA's does, so the
    loop body needs none. Made by :class:`DataParallel`; a training loop only iterates it.

    Example:
        >>> def train_loop_fn(model, loader, device, context):
        ...     for data, target in loader:
        ...         ...
    """

    def __init__(self, dealer: _Dealer, index: int, device: torch.device) -> None:
        self._dealer = dealer
        self._index = index
        self._device = device

    def __iter__(self) -> Iterator[Any]:
        return self

    def __next__(self) -> Any:
        xm.mark_step()
        batch = self._dealer.next(self._index)
        if batch is None:
            raise StopIteration
        return pytree.tree_map_only(torch.Tensor, lambda t: t.to(self._device), batch)


class DataParallel:
    """Run a training loop on several devices, one copy of the network each, as PyTorch/XLA.

    The copies are deep copies of ``network``, so they start from identical weights. Calling the
    object with ``(train_loop_fn, loader)`` runs ``train_loop_fn(model, loader, device, context)``
    once per device, each as a replica of ``xmp.spawn``: ``model`` is that device's copy (moved to
    the device), ``loader`` a :class:`PerDeviceLoader` over that device's share of the batches
    (dealt in turn, as PyTorch/XLA's ParallelLoader), ``device`` the replica's device (``xla:0``:
    every replica's own device has that name here) and ``context`` its :class:`Context`. Call
    ``xm.optimizer_step(optimizer)`` in the loop: it averages the gradients over the devices
    before stepping. Models and contexts persist from one call to the next.

    Args:
        network: A ``torch.nn.Module``, or a function returning one.
        device_ids: One replica per entry, each ``'xla:N'`` with ``N`` below the number of
            accelerators, all distinct. ``None``: one per accelerator. ``[]``: no xla device, the
            loop runs once on the network itself on its own device (the CPU), with
            ``enumerate(loader)`` as its loader (as PyTorch/XLA 2.9 gives it).
        batchdim: The batch dimension, for ``fixed_batch_size``.

    Example:
        >>> model_parallel = dp.DataParallel(MNIST, device_ids=None)
        >>> def train_loop_fn(model, loader, device, context):
        ...     optimizer = context.getattr_or('optimizer', lambda: optim.SGD(model.parameters(), 0.01))
        ...     for data, target in loader:
        ...         optimizer.zero_grad()
        ...         F.nll_loss(model(data), target).backward()
        ...         xm.optimizer_step(optimizer)
        >>> model_parallel(train_loop_fn, train_loader)
    """

    def __init__(
        self,
        network: torch.nn.Module | Callable[[], torch.nn.Module],
        device_ids: list[str | torch.device] | None = None,
        batchdim: int = 0,
    ) -> None:
        module = network if isinstance(network, torch.nn.Module) else network()
        self._batchdim = batchdim
        self._native_run = device_ids is not None and len(device_ids) == 0
        if self._native_run:
            self._device_ids = [_module_device(module)]
            self._models = [module]
        else:
            self._device_ids = _check_device_ids(device_ids)
            self._models = [copy.deepcopy(module) for _ in self._device_ids]
        device = torch.device(self._device_ids[0]) if self._native_run else xm.xla_device()
        self._contexts = [Context(device) for _ in self._device_ids]

    @property
    def devices(self) -> list[str]:
        """One device name per replica (``['cpu']`` when running without xla devices)."""
        return list(self._device_ids)

    @property
    def models(self) -> list[torch.nn.Module]:
        """The per-device copies of the network (after a call, on the xla device)."""
        return self._models

    def __call__(
        self,
        loop_fn: Callable[[torch.nn.Module, Iterable, torch.device, Context], Any],
        loader: Iterable,
        fixed_batch_size: bool = False,
        batchdim: int | None = None,
    ) -> list[Any]:
        """Run ``loop_fn`` once per device; return what each run returned, in device order.

        Args:
            loop_fn: ``loop_fn(model, loader, device, context)``.
            loader: The host loader; its batches are dealt to the devices in turn.
            fixed_batch_size: Stop at the first batch whose size differs from the first one's.
            batchdim: The batch dimension for ``fixed_batch_size`` (default: the constructor's).

        Example:
            >>> losses = model_parallel(train_loop_fn, train_loader)
        """
        if self._native_run:
            model, device = self._models[0], torch.device(self._device_ids[0])
            return [loop_fn(model, enumerate(loader), device, self._contexts[0])]
        count = len(self._models)
        dim = self._batchdim if batchdim is None else batchdim
        dealer = _Dealer(loader, count, fixed_batch_size, dim)
        results: list[Any] = [None] * count

        def run_replica(index: int) -> None:
            device = xm.xla_device()
            model = self._models[index] = self._models[index].to(device)
            per_device = self._device_loader(PerDeviceLoader(dealer, index, device))
            results[index] = loop_fn(model, per_device, device, self._contexts[index])

        xmp.spawn(run_replica, nprocs=count)
        return results

    def _device_loader(self, loader: PerDeviceLoader) -> Iterable:
        """What a device's loop iterates: its batches (``legacy_data_parallel`` numbers them)."""
        return loader


def _check_device_ids(device_ids: list[str | torch.device] | None) -> list[str]:
    """The device names, one per replica, checked: distinct xla devices that exist."""
    available = runtime.addressable_runtime_device_count()
    if device_ids is None:
        return [f"xla:{i}" for i in range(available)]
    names = [str(torch.device(d)) for d in device_ids]
    for name in names:
        device = torch.device(name)
        if device.type != "xla" or device.index is None or device.index >= available:
            raise ValueError(
                f"DataParallel: device_ids entry {name!r} is not an xla device 'xla:N' with "
                f"N < {available} (the number of accelerators)"
            )
    if len(set(names)) != len(names):
        raise ValueError(f"DataParallel: device_ids {names} name a device twice")
    return names


def _module_device(module: torch.nn.Module) -> str:
    """The one device of ``module``'s parameters (``'cpu'`` if it has none)."""
    devices = {str(p.device) for p in module.parameters()}
    if len(devices) > 1:
        raise ValueError(f"DataParallel: the network's parameters span devices {sorted(devices)}")
    return devices.pop() if devices else "cpu"
