"""torch_xla.distributed.parallel_loader on JAX: prefetch batches onto the device in the background.

Two kinds of daemon thread overlap input with the training step: one iterates the host loader,
and ``host_to_device_transfer_threads`` upload its batches. An upload only calls
``_lazy.transfer.to_device_array`` (pure JAX, safe off the main thread); with ``input_sharding``
each tensor is placed directly as a sharded global array, so every device receives only its shard.
The main thread, in ``__next__``, wraps the arrays as xla tensors (``placement.adopt``), hands
batches out in the host loader's order, re-raises any error a thread hit (with its traceback),
and issues the barrier (``mark_step``) every ``batches_per_execution`` batches, as PyTorch/XLA
does.

The threads share only a small pipeline object, never the loader itself, so a loader that is
closed, exhausted or garbage-collected (a loop left early) stops them.
"""

from __future__ import annotations

import atexit
import itertools
import queue
import threading
import weakref
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import jax
import torch
import torch.utils._pytree as pytree
from jax.sharding import NamedSharding

from spmd_torch import _barrier
from spmd_torch._lazy import engine, layout, modes, placement, transfer
from spmd_torch.debug import profiler as xp
from spmd_torch.distributed.spmd import ShardingSpec, validate

__all__ = ["MpDeviceLoader", "ParallelLoader", "PerDeviceLoader"]

_POLL_S = 0.1  # how often a blocked thread checks whether it should stop


class PerDeviceLoader:
    """The iterator over one device's batches that :meth:`ParallelLoader.per_device_loader` gives.

    Each ``next`` first issues the barrier (``spmd_torch.sync()``, i.e. ``xm.mark_step()``) once
    every ``batches_per_execution`` calls, then hands out the next batch, already on the device;
    a step whose barrier a profiler ``StepTrace`` issued is not given a second one. When the
    batches run out it issues one more barrier and stops, so the last step runs too.

    Args:
        loader: The :class:`ParallelLoader` feeding this device.
        device: The device, ``xla:0``.

    Example:
        >>> para_loader = pl.ParallelLoader(train_loader, [spmd_torch.device()])
        >>> for x, y in para_loader.per_device_loader(spmd_torch.device()):
        ...     train_step(x, y)  # no mark_step needed: next() issues it
    """

    def __init__(self, loader: ParallelLoader, device: torch.device) -> None:
        self._loader = loader
        self._device = device
        self._mark_step_batch_count = loader.batches_per_execution - 1
        self._batches_yielded = 0

    def __iter__(self) -> PerDeviceLoader:
        return self

    def __next__(self) -> Any:
        return self.next()

    def __len__(self) -> int:
        return self._loader.per_device_samples()

    def next(self) -> Any:
        """The next batch on the device; the barrier first when ``batches_per_execution`` is due
        and no ``StepTrace`` issued it.

        Raises:
            StopIteration: The host loader is exhausted (after a final barrier) or the loader
                was closed.
            Exception: Whatever the host loader or an upload raised, with its traceback.
        """
        if xp.get_tracer_marked_step():  # the step's StepTrace issued its barrier
            xp.set_tracer_marked_step(False)
            self._batches_yielded += 1
        elif self._mark_step_batch_count <= self._batches_yielded:
            self._batches_yielded = 0
            _barrier.barrier()
        else:
            self._batches_yielded += 1
        item = self._loader.next_item(self._device)
        if item is None:
            _barrier.barrier()
            raise StopIteration
        return item


class ParallelLoader:
    """Wraps a PyTorch DataLoader so that its batches are uploaded in the background.

    A thread iterates ``loader`` and others upload each batch (any nesting of tuples, lists and
    dicts; every CPU tensor in it is uploaded, anything else passes through), keeping up to
    ``device_prefetch_size`` batches ready on the device while the current step runs. Batches
    come out in ``loader``'s order, from :meth:`per_device_loader`. An error in ``loader`` (or in
    an upload) is raised by the ``next`` call that would have returned that batch.

    Args:
        loader: The host loader, e.g. a ``torch.utils.data.DataLoader``; ``len(loader)`` is
            needed only by :meth:`per_device_samples`.
        devices: The devices to feed: ``[spmd_torch.device()]``, the one logical device ``xla:0``
            (it spans every accelerator; spread a batch over them with ``input_sharding``).
        batchdim: The batch dimension. Accepted for PyTorch/XLA compatibility, which ignores it
            too; ``input_sharding`` says how batches are split.
        batches_per_execution: Issue the barrier (``mark_step``) once every this many batches.
        loader_prefetch_size: Most batches read from ``loader`` and waiting for upload.
        device_prefetch_size: Most uploaded batches waiting on the device.
        host_to_device_transfer_threads: Threads uploading batches in parallel.
        input_sharding: How to place the tensors: a ``ShardingSpec`` applied to every tensor whose
            rank it fits (others are uploaded as without it, as in PyTorch/XLA), or, for dict
            batches, a dict from batch key to ``ShardingSpec`` that must cover every key and fit
            the rank of every tensor under it. Each device then receives only its shard (padded
            at the end when a dimension does not divide evenly). ``None``: tensors land where
            uploads normally do (replicated over the devices in SPMD mode).

    Example:
        >>> mesh = xs.get_1d_mesh('data')
        >>> spec = xs.ShardingSpec(mesh, ('data', None))
        >>> para_loader = pl.ParallelLoader(train_loader, [spmd_torch.device()],
        ...                                 input_sharding=spec)
        >>> for x, y in para_loader.per_device_loader(spmd_torch.device()):
        ...     train_step(x, y)
    """

    def __init__(
        self,
        loader: Iterable,
        devices: Iterable[torch.device | str],
        batchdim: int = 0,
        batches_per_execution: int = 1,
        loader_prefetch_size: int = 16,
        device_prefetch_size: int = 8,
        host_to_device_transfer_threads: int = 1,
        input_sharding: ShardingSpec | dict[Any, ShardingSpec] | None = None,
    ) -> None:
        self._cpu_loader = loader
        self._devices = _check_devices(devices)
        for name, value in (
            ("batches_per_execution", batches_per_execution),
            ("loader_prefetch_size", loader_prefetch_size),
            ("device_prefetch_size", device_prefetch_size),
            ("host_to_device_transfer_threads", host_to_device_transfer_threads),
        ):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"ParallelLoader: {name} must be a positive int, got {value!r}")
        self._batchdim = batchdim
        self._batches_per_execution = batches_per_execution
        self._input_sharding = input_sharding
        plan = _plan(input_sharding, self._devices[0])
        if input_sharding is not None:
            modes.ensure_spmd()  # sharded inputs need SPMD mode, as mark_sharding turns it on
        self._pipeline = _Pipeline(
            _batches(loader),
            plan,
            loader_prefetch_size,
            device_prefetch_size,
            host_to_device_transfer_threads,
        )
        self._ready: dict[int, Any] = {}  # uploaded batches that arrived ahead of their turn
        self._next_seq = 0
        self._finished = False
        self._threads = [
            threading.Thread(
                target=_read_loader, args=(self._pipeline,), name="ParallelLoader-read", daemon=True
            )
        ]
        self._threads += [
            threading.Thread(
                target=_upload_batches,
                args=(self._pipeline,),
                name=f"ParallelLoader-upload-{i}",
                daemon=True,
            )
            for i in range(host_to_device_transfer_threads)
        ]
        # Dropping the loader (a loop left early) stops the threads; they never refer to it.
        weakref.finalize(self, self._pipeline.stop.set)
        self._pipeline.threads = self._threads
        _LIVE_PIPELINES.add(self._pipeline)
        for thread in self._threads:
            thread.start()

    @property
    def batches_per_execution(self) -> int:
        """How many batches go by between two barriers."""
        return self._batches_per_execution

    def per_device_loader(self, device: torch.device | str) -> PerDeviceLoader:
        """The iterator handing out ``device``'s batches, already on the device.

        Args:
            device: One of this loader's devices (``xla:0``).

        Returns:
            A :class:`PerDeviceLoader`: a Python iterator (not a DataLoader) yielding the same
            structures as the wrapped loader, with the tensors on the xla device.

        Example:
            >>> for batch in para_loader.per_device_loader(spmd_torch.device()):
            ...     train_step(batch)
        """
        return PerDeviceLoader(self, self._member(device, "per_device_loader"))

    def per_device_samples(self) -> int:
        """How many batches each device receives: ``len(loader) // len(devices)``.

        Example:
            >>> len(para_loader.per_device_loader(spmd_torch.device()))  # same number
        """
        return len(self._cpu_loader) // len(self._devices)

    def next_item(self, device: torch.device | str) -> Any:
        """``device``'s next batch on the device, or ``None`` once there are no more.

        Call it on the main thread: it wraps the uploaded arrays as xla tensors.

        Args:
            device: One of this loader's devices.

        Raises:
            Exception: The error the host loader or an upload raised for this batch, with the
                loader thread's traceback.
        """
        self._member(device, "next_item")
        if self._finished:
            return None
        while self._next_seq not in self._ready:
            item = self._take_now()
            if item is None:  # the threads were stopped (close() from elsewhere)
                self._finish()
                return None
            seq, payload = item
            self._ready[seq] = payload
        payload = self._ready.pop(self._next_seq)
        self._next_seq += 1
        if payload is _END:
            self._finish()
            return None
        if isinstance(payload, _Failure):
            self._finish()
            raise payload.error
        return payload.adopt()

    def send_cpu_data_to_device(self, batches: list, device: torch.device | str) -> list:
        """Upload ``batches`` now, on this thread, placed as ``input_sharding`` says.

        Args:
            batches: A list of batches (nestings of tuples, lists and dicts holding CPU tensors).
            device: One of this loader's devices.

        Returns:
            The batches with every CPU tensor replaced by an xla tensor.

        Example:
            >>> [batch] = para_loader.send_cpu_data_to_device([cpu_batch], spmd_torch.device())
        """
        self._member(device, "send_cpu_data_to_device")
        return [_stage(batch, self._pipeline.plan, k).adopt() for k, batch in enumerate(batches)]

    def close(self) -> None:
        """Stop the background threads and wait for them; iteration then ends.

        Example:
            >>> para_loader.close()
        """
        self._pipeline.stop.set()
        for thread in self._threads:
            thread.join()
        self._finish()

    def _take_now(self) -> tuple | None:
        """The next (seq, payload): at once if one is ready, else after a wait during which the
        other replicas of a launch run."""
        try:
            return self._pipeline.device_queue.get_nowait()
        except queue.Empty:
            with engine.current().mode.away():
                return self._take()

    def _take(self) -> tuple | None:
        """The next (seq, payload) from the upload threads; None if they all stopped early."""
        device_queue = self._pipeline.device_queue
        while True:
            try:
                return device_queue.get(timeout=_POLL_S)
            except queue.Empty:
                if not any(thread.is_alive() for thread in self._threads):
                    try:
                        return device_queue.get_nowait()
                    except queue.Empty:
                        return None

    def _finish(self) -> None:
        self._finished = True
        self._ready.clear()
        self._pipeline.stop.set()

    def _member(self, device: torch.device | str, api: str) -> torch.device:
        device = _check_device(device, f"ParallelLoader.{api}")
        if device not in self._devices:
            raise ValueError(
                f"ParallelLoader.{api}: device {device} is not one of the loader's devices "
                f"{[str(d) for d in self._devices]}"
            )
        return device


class MpDeviceLoader:
    """Wraps a PyTorch DataLoader so that each epoch's batches are uploaded in the background.

    Each ``iter()`` starts a :class:`ParallelLoader` over ``loader`` (closing the previous one)
    and returns its :class:`PerDeviceLoader`, which issues the barrier (``mark_step``) for you
    every ``batches_per_execution`` batches. Other attributes are the host loader's.

    Args:
        loader: The host loader, e.g. a ``torch.utils.data.DataLoader``.
        device: The xla device, ``spmd_torch.device()``.
        **kwargs: Keyword arguments of :class:`ParallelLoader` (``input_sharding``,
            ``batches_per_execution``, ``device_prefetch_size``...).

    Example:
        >>> device = spmd_torch.device()
        >>> spec = xs.ShardingSpec(xs.get_1d_mesh('data'), ('data', None))
        >>> train_device_loader = pl.MpDeviceLoader(train_loader, device, input_sharding=spec)
        >>> for x, y in train_device_loader:
        ...     loss = loss_fn(model(x), y); loss.backward(); optimizer.step()
    """

    def __init__(self, loader: Iterable, device: torch.device | str, **kwargs: Any) -> None:
        self._loader = loader
        self._device = _check_device(device, "MpDeviceLoader")
        self._parallel_loader_kwargs = kwargs
        self._parallel_loader: ParallelLoader | None = None

    def __iter__(self) -> PerDeviceLoader:
        if self._parallel_loader is not None:
            self._parallel_loader.close()
            self._parallel_loader = None
        self._parallel_loader = ParallelLoader(
            self._loader, [self._device], **self._parallel_loader_kwargs
        )
        return self._parallel_loader.per_device_loader(self._device)

    def __len__(self) -> int:
        return len(self._loader)

    def __getattr__(self, name: str) -> Any:
        """The wrapped loader's attributes (``dataset``, ``sampler``, ``batch_size``...): code that
        reads them off a prepared loader (accelerate's ``save_state``) finds them, where
        PyTorch/XLA's ``MpDeviceLoader`` raises AttributeError."""
        if name.startswith("__") or "_loader" not in self.__dict__:
            raise AttributeError(name)
        return getattr(self._loader, name)


# ---- the pipeline the threads share ----------------------------------------------------------


@dataclass(frozen=True)
class _Plan:
    """Where each tensor goes: one spec for all that fit it, or one spec per dict key."""

    spec: tuple | None = None  # partition spec of the single ShardingSpec
    sharding: NamedSharding | None = None
    minibatch: ShardingSpec | None = None  # the single spec, when tensors are the host's part
    per_key: dict | None = None  # key -> (partition spec, NamedSharding, the spec if minibatch)
    # Where tensors without a spec land, as the constructing thread's engine says (the upload
    # threads have no engine of their own): a replica's device, or the default placement.
    landing: Any = None
    device: int = 0  # the xla:N the batches are on

    def sharding_for(self, path: tuple, leaf: torch.Tensor) -> tuple:
        """The leaf's sharding (None: where uploads land), and its ShardingSpec if the leaf is
        the host's part of the batch (a minibatch), else None."""
        if self.per_key is None:
            fits = self.spec is not None and len(self.spec) == leaf.dim()
            if not fits and self.minibatch is not None and jax.process_count() > 1:
                raise ValueError(
                    f"input_sharding {self.minibatch} (minibatch=True) does not fit "
                    f"batch{pytree.keystr(path)} of shape {tuple(leaf.shape)}: on "
                    f"{jax.process_count()} hosts each host's part of it would be taken as the "
                    "whole tensor. Give each input its own spec: input_sharding={'input': "
                    "ShardingSpec(mesh, ('data', None), minibatch=True), 'label': "
                    "ShardingSpec(mesh, ('data',), minibatch=True)} with dict batches"
                )
            return (self.sharding, self.minibatch) if fits else (None, None)
        spec, sharding, minibatch = self.per_key[path[0].key]
        try:
            validate._check_spec_rank(tuple(leaf.shape), spec)
        except ValueError as error:
            raise ValueError(f"input_sharding for batch{pytree.keystr(path)}: {error}") from None
        return sharding, minibatch


class _Pipeline:
    """What the loader's threads share (never the loader itself, so dropping it stops them)."""

    def __init__(
        self, batches: Iterator, plan: _Plan, cpu_size: int, device_size: int, uploaders: int
    ) -> None:
        self.batches = batches
        self.plan = plan
        self.uploaders = uploaders
        self.stop = threading.Event()
        self.cpu_queue: queue.Queue = queue.Queue(maxsize=cpu_size)
        self.device_queue: queue.Queue = queue.Queue(maxsize=device_size)
        self.threads: list[threading.Thread] = []


# The pipelines whose threads may still run. At exit they are stopped and joined before JAX's own
# exit handlers (registered before this module's, so run after it) tear its runtime down: a
# daemon thread caught in a transfer then would abort the process.
_LIVE_PIPELINES: weakref.WeakSet = weakref.WeakSet()


@atexit.register
def _stop_pipelines() -> None:
    pipelines = list(_LIVE_PIPELINES)
    for pipeline in pipelines:
        pipeline.stop.set()
    for pipeline in pipelines:
        for thread in pipeline.threads:
            thread.join(timeout=10)


class _End:
    def __repr__(self) -> str:
        return "<end of loader>"


_END = _End()


@dataclass
class _Failure:
    """An error met while reading or uploading one batch, raised when that batch is due."""

    error: BaseException


@dataclass
class _Upload:
    """One tensor uploaded by a thread, waiting to become an xla tensor on the main thread."""

    array: jax.Array
    shape: tuple
    dtype: torch.dtype
    sharding: NamedSharding | None


@dataclass
class _Staged:
    """A batch whose CPU tensors are uploaded: its structure and leaves."""

    treedef: pytree.TreeSpec
    leaves: list
    device: int  # its xla:N

    def adopt(self) -> Any:
        """The batch with xla tensors in it; touches engine state, so main thread only."""
        leaves = [
            placement.adopt(leaf.array, leaf.shape, leaf.dtype, leaf.sharding, self.device)
            if isinstance(leaf, _Upload)
            else leaf
            for leaf in self.leaves
        ]
        return pytree.tree_unflatten(leaves, self.treedef)


def _put(q: queue.Queue, item: Any, stop: threading.Event) -> bool:
    """Put ``item`` once there is room; False if told to stop first."""
    while not stop.is_set():
        try:
            q.put(item, timeout=_POLL_S)
            return True
        except queue.Full:
            pass
    return False


def _get(q: queue.Queue, stop: threading.Event) -> Any:
    """The next item; None if told to stop first."""
    while not stop.is_set():
        try:
            return q.get(timeout=_POLL_S)
        except queue.Empty:
            pass
    return None


def _read_loader(pipeline: _Pipeline) -> None:
    """Thread: feed (seq, batch) from the host loader, then one end mark per upload thread."""
    seq = 0
    try:
        for batch in pipeline.batches:
            if not _put(pipeline.cpu_queue, (seq, batch), pipeline.stop):
                return
            seq += 1
    except BaseException as error:  # raised on the main thread when this batch is due
        _note(error, f"raised by the host loader of a ParallelLoader, reading batch {seq}")
        _put(pipeline.cpu_queue, (seq, _Failure(error)), pipeline.stop)
        seq += 1
    finally:
        for _ in range(pipeline.uploaders):
            _put(pipeline.cpu_queue, (seq, _END), pipeline.stop)


def _upload_batches(pipeline: _Pipeline) -> None:
    """Thread: upload each batch's CPU tensors (pure JAX transfers; no xla tensor is made here)."""
    while True:
        item = _get(pipeline.cpu_queue, pipeline.stop)
        if item is None:
            return
        seq, batch = item
        if batch is not _END and not isinstance(batch, _Failure):
            try:
                batch = _stage(batch, pipeline.plan, seq)
            except BaseException as error:
                _note(error, f"raised by a ParallelLoader uploading batch {seq}")
                batch = _Failure(error)
        if not _put(pipeline.device_queue, (seq, batch), pipeline.stop) or batch is _END:
            return


def _stage(batch: Any, plan: _Plan, seq: int) -> _Staged:
    """Upload every CPU tensor of ``batch`` as ``plan`` places it."""
    if plan.per_key is not None:
        if not isinstance(batch, dict):
            raise ValueError(
                f"input_sharding is a dict (keys {list(plan.per_key)}) but batch {seq} is a "
                f"{type(batch).__name__}; a dict input_sharding needs dict batches"
            )
        missing = [key for key in batch if key not in plan.per_key]
        if missing:
            raise KeyError(
                f"Keys: {missing} of batch {seq} are missing from input_sharding "
                f"(keys {list(plan.per_key)})"
            )
    flat, treedef = pytree.tree_flatten_with_path(batch)
    leaves = []
    for path, leaf in flat:
        if isinstance(leaf, torch.Tensor) and leaf.device.type == "cpu":
            sharding, minibatch = plan.sharding_for(path, leaf)
            if minibatch is not None:
                minibatch.check_minibatch(leaf)
            if minibatch is not None and jax.process_count() > 1:  # every host's part, one batch
                array = transfer.upload_part(leaf, sharding)
                shape = tuple(array.shape)
            else:
                array = transfer.to_device_array(leaf, sharding or plan.landing)
                shape = tuple(leaf.shape)
            leaf = _Upload(array, shape, leaf.dtype, sharding)
        leaves.append(leaf)
    return _Staged(treedef, leaves, plan.device)


def _note(error: BaseException, text: str) -> None:
    if hasattr(error, "add_note"):  # Python 3.11+
        error.add_note(text)


# ---- argument checks (main thread) -----------------------------------------------------------


def _plan(input_sharding: Any, device: torch.device) -> _Plan:
    """Check ``input_sharding`` and resolve each spec to the sharding the engine stores."""
    landing = transfer.landing(device.index)
    if input_sharding is None:
        return _Plan(landing=landing, device=device.index)
    if isinstance(input_sharding, ShardingSpec):
        spec, sharding = input_sharding.partition_spec, input_sharding.sharding
        minibatch = input_sharding if input_sharding.minibatch else None
        return _Plan(spec, layout.canonical(sharding), minibatch, landing=landing)
    if isinstance(input_sharding, dict):
        per_key = {}
        for key, spec in input_sharding.items():
            if not isinstance(spec, ShardingSpec):
                raise ValueError(
                    f"input_sharding[{key!r}] must be a spmd_torch.distributed.spmd.ShardingSpec, "
                    f"got {type(spec).__name__}: {spec!r}"
                )
            minibatch = spec if spec.minibatch else None
            per_key[key] = (spec.partition_spec, layout.canonical(spec.sharding), minibatch)
        return _Plan(per_key=per_key, landing=landing)
    raise ValueError(
        "input_sharding must be a spmd_torch.distributed.spmd.ShardingSpec, a dict of them keyed "
        f"like the batches, or None; got {type(input_sharding).__name__}: {input_sharding!r}"
    )


def _batches(loader: Iterable) -> Iterator:
    """``loader``'s iterator, started on this thread: in a replica of ``launch`` the first batch
    is read here, so a shuffling sampler draws its seed from the replica's own CPU RNG stream
    (as in a process of its own) rather than from whichever replica holds the turn."""
    batches = iter(loader)
    try:
        first = next(batches)
    except StopIteration:
        return iter(())
    return itertools.chain([first], batches)


def _check_device(device: Any, api: str) -> torch.device:
    """The xla device named (``xla`` is ``xla:0``), or an error naming what was passed."""
    try:
        parsed = torch.device(device)
    except (RuntimeError, TypeError) as error:
        raise ValueError(
            f"{api}: {device!r} is not a device; pass the xla device, spmd_torch.device()"
        ) from error
    if parsed.type != "xla":
        raise ValueError(
            f"{api}: device {str(parsed)!r} is not the xla device; batches are uploaded to "
            "spmd_torch.device() (xla:0)"
        )
    try:
        return engine.current().mode.use_device(parsed.index)
    except IndexError as error:
        raise ValueError(f"{api}: no device {str(parsed)!r}: {error}") from None


def _check_devices(devices: Iterable) -> list[torch.device]:
    if isinstance(devices, (str, torch.device)):
        raise ValueError(
            f"ParallelLoader: devices must be a list of devices, got {devices!r}; "
            "pass [spmd_torch.device()]"
        )
    devices = list(devices)
    checked = [_check_device(device, "ParallelLoader") for device in devices]
    if len(checked) != 1:
        raise ValueError(
            f"ParallelLoader: devices must list one xla device; got {[str(d) for d in devices]}"
        )
    return checked
