"""torch_xla.core.xla_model: the names PyTorch/XLA programs call, thin over the engine and runtime.

Outside ``launch``, programs run in PyTorch/XLA's SPMD model: one program per process addresses
one logical device, ``xla:0``, that spans every accelerator. There is one replica per process, so
ordinals and world size are those of processes (one per host), gradients need no all-reduce (a
backward pass over global, sharded tensors already yields global gradients) and collectives act
on a world of one. Inside a replica of ``launch``/``spawn`` (per-device multiprocessing, see
docs/multiprocessing.md) ordinals are the replicas', and collectives and ``optimizer_step``'s
gradient all-reduce run across replicas, inside the one program they all run at the barrier.
"""

from __future__ import annotations

import contextlib
import copy
import itertools
import re
import sys
import time
from collections.abc import Callable
from typing import Any, TypedDict

import jax
import torch

from spmd_torch import _barrier, runtime
from spmd_torch import config as _config
from spmd_torch._lazy import collective as _collective
from spmd_torch._lazy import engine as _engine
from spmd_torch._lazy import execute as _execute
from spmd_torch._lazy import rng as _rng
from spmd_torch._lazy.tensor import DEVICE as _DEVICE
from spmd_torch.debug import graph as _graph
from spmd_torch.utils import utils as xu
from spmd_torch.utils.checkpoint import optimization_barrier_  # noqa: F401  (xm's name for it)

REDUCE_SUM = "sum"
REDUCE_MUL = "mul"
REDUCE_AND = "and"
REDUCE_OR = "or"
REDUCE_MIN = "min"
REDUCE_MAX = "max"


def is_xla_tensor(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` lives on the xla device.

    Args:
        tensor: any tensor.

    Example:
        >>> xm.is_xla_tensor(torch.ones(2, device=xm.xla_device()))
        True
    """
    return tensor.device.type == "xla"


def xla_device(n: int | None = None, devkind: str | None = None) -> torch.device:
    """An xla device: ``xla:n`` (default ``xla:0``), as :func:`spmd_torch.device` gives.

    Args:
        n: Device ordinal. Outside SPMD each of the process's devices has one; under SPMD and
            in a replica of ``launch`` only 0 exists (shard tensors over a mesh instead).
        devkind: Deprecated in PyTorch/XLA; if given it must equal
            :func:`spmd_torch.runtime.device_type`.

    Raises:
        IndexError: no device has ordinal ``n`` (as PyTorch/XLA for an ordinal out of range).

    Example:
        >>> dev = xm.xla_device()
        >>> x = torch.zeros(4, device=dev)
    """
    if devkind is not None and devkind.upper() != runtime.device_type():
        raise RuntimeError(
            f"xla_device(devkind={devkind!r}): this program runs on {runtime.device_type()}"
        )
    return _engine.current().mode.use_device(n)


def get_xla_supported_devices(
    devkind: str | None = None, max_devices: int | None = None
) -> list[str] | None:
    """The xla devices of this process as strings: ``['xla:0', 'xla:1', ...]``, one per local
    device outside SPMD, ``['xla:0']`` under SPMD and in a replica of ``launch``.

    Args:
        devkind: Deprecated; a hardware kind such as ``'CPU'``. If it is not this program's
            kind, returns ``None`` as PyTorch/XLA does.
        max_devices: The most devices to return (``None`` or 0: all).

    Example:
        >>> xm.get_xla_supported_devices()  # 4 CPU devices, no SPMD
        ['xla:0', 'xla:1', 'xla:2', 'xla:3']
    """
    if devkind is not None and devkind.upper() != runtime.device_type():
        return None
    devices = [f"{_DEVICE.type}:{i}" for i in range(runtime.addressable_device_count())]
    return devices[:max_devices] if max_devices else devices


def xla_real_devices(devices: list | None = None) -> list[str]:
    """The real device names behind xla devices, e.g. ``['CPU:0']``.

    Args:
        devices: xla devices such as ``['xla:0']``; default: all of them.

    Example:
        >>> xm.xla_real_devices([xm.xla_device()])
        ['CPU:0']
    """
    return runtime.xla_real_devices(devices)


def xla_device_hw(device: str | torch.device) -> str:
    """The hardware kind of an xla device: ``'CPU'``, ``'CUDA'``, ``'TPU'``...

    Args:
        device: an xla device (``torch.device`` or string).

    Example:
        >>> xm.xla_device_hw(xm.xla_device())
        'CPU'
    """
    return runtime.xla_device_hw(device)


def parse_xla_device(device: str) -> tuple[str, int] | None:
    """Split a real device name into its kind and ordinal: ``'CPU:3'`` -> ``('CPU', 3)``.

    Args:
        device: A name as :func:`xla_real_devices` gives them.

    Returns:
        ``(kind, ordinal)``, or ``None`` if ``device`` is not of that form.

    Example:
        >>> xm.parse_xla_device('CUDA:1')
        ('CUDA', 1)
    """
    match = re.match(r"([A-Z]+):(\d+)$", device)
    return (match.group(1), int(match.group(2))) if match else None


def xla_device_kind(device: str | torch.device | None = None) -> str:
    """The vendor's name for the kind of accelerator behind an xla device, JAX's
    ``device_kind`` (``'cpu'``, ``'NVIDIA H100 80GB HBM3'``, ``'TPU v5 lite'``...).

    Args:
        device: The xla device (default ``xla:0``).

    Example:
        >>> xm.xla_device_kind()
        'cpu'
    """
    return _backing_devices(_check_device(device, "xla_device_kind"))[0].device_kind


def xla_replication_devices(local_devices: list | None = None) -> list[str]:
    """The real devices a replicated program runs on: every device of the kind behind
    ``local_devices``, in ordinal order (``['CUDA:0', 'CUDA:1', ...]``).

    Args:
        local_devices: The xla devices of this process (``['xla:0']``; default: all of them).

    Raises:
        RuntimeError: A device is not an xla device of this program.

    Example:
        >>> xm.xla_replication_devices([xm.xla_device()])  # 8 virtual CPU devices
        ['CPU:0', 'CPU:1', 'CPU:2', 'CPU:3', 'CPU:4', 'CPU:5', 'CPU:6', 'CPU:7']
    """
    xla_real_devices(local_devices)  # checks each device
    kind = runtime.device_type()
    return [f"{kind}:{d.id}" for d in sorted(jax.devices(), key=lambda d: d.id)]


def set_replication(device: str | torch.device, devices: list | None) -> None:
    """Set the devices a replicated program runs over, as PyTorch/XLA's runtime calls it for each
    process it starts (and ``DataParallel`` for its devices).

    Here ``launch``/``spawn`` set up the replicas, each with its own engine and device, so there is
    nothing to record: the call checks its arguments as PyTorch/XLA does (``device`` must be one
    of ``devices`` when they are given) and returns.

    Args:
        device: This replica's xla device.
        devices: The xla devices of the replication (empty or None: no replication).

    Raises:
        ValueError: ``device`` is not an xla device, or not one of ``devices``.

    Example:
        >>> xm.set_replication(xm.xla_device(), [xm.xla_device()])
    """
    device = str(device)
    if torch.device(device).type != "xla":
        raise ValueError(f"set_replication: {device!r} is not an xla device")
    names = [str(d) for d in devices or []]
    if names and device not in names:
        raise ValueError(f"set_replication: device {device!r} is not among devices {names}")
    xla_real_devices(names or None)  # checks each device


def xrt_world_size(defval: int = 1) -> int:
    """The number of replicas: one per process (``runtime.world_size()``).

    Args:
        defval: Ignored (kept for PyTorch/XLA compatibility).

    Example:
        >>> xm.xrt_world_size()
        1
    """
    return runtime.world_size()


def world_size() -> int:
    """Alias of :func:`xrt_world_size`.

    Example:
        >>> xm.world_size()
        1
    """
    return runtime.world_size()


def get_ordinal(defval: int = 0) -> int:
    """This replica's ordinal in ``[0, xrt_world_size())`` (the process index).

    Args:
        defval: Ignored (kept for PyTorch/XLA compatibility).

    Example:
        >>> xm.get_ordinal()
        0
    """
    return runtime.global_ordinal()


def get_local_ordinal(defval: int = 0) -> int:
    """This replica's ordinal on its host: 0 (one process per host).

    Args:
        defval: Ignored (kept for PyTorch/XLA compatibility).

    Example:
        >>> xm.get_local_ordinal()
        0
    """
    return runtime.local_ordinal()


def is_master_ordinal(local: bool = True) -> bool:
    """Whether this process is the master: ordinal 0 on its host (``local``) or in the job.

    Args:
        local: Check the host-local master (one per host) rather than the global one.

    Example:
        >>> xm.is_master_ordinal()
        True
    """
    ordinal = get_local_ordinal() if local else get_ordinal()
    return ordinal == 0


def master_print(*args: Any, fd=None, local: bool = False, flush: bool = False) -> None:
    """``print`` on the master ordinal only.

    Args:
        *args: What to print.
        fd: The stream to print to (default: ``sys.stdout``).
        local: Print on every host's master rather than on the global master only.
        flush: Flush the stream.

    Example:
        >>> xm.master_print('step', 10)
        step 10
    """
    if is_master_ordinal(local=local):
        print(*args, file=fd or sys.stdout, flush=flush)


def mark_step(wait: bool = False, reset_scope: bool = True) -> None:
    """The barrier: compile (once) and dispatch every pending computation.

    ``spmd_torch.sync()``: then the step closures queued by :func:`add_step_closure` run, in
    order, reading the step's values without running another program.

    Args:
        wait: Block until the dispatched program has finished.
        reset_scope: Number the profiler's ``Trace`` regions afresh; under the ``torch_xla``
            face a region still open is then an error, as in PyTorch/XLA.

    Example:
        >>> loss = model(x).sum(); loss.backward(); opt.step()
        >>> xm.mark_step()
    """
    _barrier.barrier(wait=wait, reset_scope=reset_scope)


# --- step closures -------------------------------------------------------------------------------


def add_step_closure(
    closure: Callable[..., Any], args: tuple = (), run_async: bool = False
) -> None:
    """Run ``closure(*args)`` right after the barrier that ends the current step.

    By then every live tensor has its value, those in ``args`` too, so the closure reads them
    (``.item()``, ``.cpu()``, printing) without running a second program: report losses this way
    instead of reading them mid-step. Closures run in the order they were added, once, at the
    next :func:`mark_step` (or ``spmd_torch.sync()``, or a ``MpDeviceLoader``'s barrier). Inside
    ``launch`` each replica has its own queue, run at its own barrier.

    Args:
        closure: The function to call.
        args: Its arguments (tensors in them are read after the barrier).
        run_async: Run it on a background thread instead, in order with the other asynchronous
            closures, while the next step is traced; an error it raises is raised (as a
            ``RuntimeError``) at the next step's barrier.

    Example:
        >>> loss = loss_fn(model(data), target)
        >>> xm.add_step_closure(lambda l: print('loss', l.item()), args=(loss,))
        >>> xm.mark_step()
        loss 0.6931
    """
    _barrier.add_step_closure(lambda: closure(*args), run_async)


def run_step_closures() -> None:
    """Run the step closures queued by :func:`add_step_closure` for this program (or replica).

    :func:`mark_step` calls it after the barrier; a barrier issued some other way calls it too.
    The synchronous closures run here, in order; asynchronous ones are handed to the background
    thread first. A closure that raises stops the rest (they are dropped).

    Example:
        >>> spmd_torch.sync()
        >>> xm.run_step_closures()
    """
    _barrier.run_step_closures()


def wait_device_ops(devices: list | None = None) -> None:
    """Block until every dispatched program has finished.

    Args:
        devices: Ignored: there is one logical device, and all of it is waited for.

    Example:
        >>> xm.mark_step()
        >>> xm.wait_device_ops()
    """
    _execute.wait_device_ops()


def unlazy(tensors: list[torch.Tensor]) -> None:
    """Compute ``tensors`` now and wait for them (for benchmarks), leaving the rest pending.

    Args:
        tensors: xla tensors.

    Example:
        >>> y = x * 2
        >>> xm.unlazy([y])
    """
    arrays = _execute.materialize(list(tensors))
    for array in arrays:
        array.block_until_ready()


def _fetch_gradients(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """The gradients of the optimizer's parameters that have one, in parameter-group order (the
    tensors themselves: in-place changes reach the parameters' ``.grad``).

    Args:
        optimizer: The optimizer.

    Example:
        >>> xm._fetch_gradients(optimizer)[0].mul_(0.5)  # halves the first gradient
    """
    return [
        p.grad.data
        for group in optimizer.param_groups
        for p in group["params"]
        if isinstance(p, torch.Tensor) and p.grad is not None
    ]


def reduce_gradients(
    optimizer: torch.optim.Optimizer, groups=None, pin_layout: bool = True
) -> None:
    """Average the optimizer's gradients over the replicas (an all-reduce sum scaled by
    ``1 / xrt_world_size()``, as PyTorch/XLA does, groups or not).

    Outside ``launch`` there is nothing to do: one SPMD program computes the gradients of the
    global batch, so they are already the global gradients.

    Args:
        optimizer: The optimizer whose parameters' gradients are reduced in place.
        groups: Replica groups to reduce within, e.g. ``[[0, 1, 2, 3], [4, 5, 6, 7]]``.
        pin_layout: Ignored (layouts are XLA's to choose).

    Example:
        >>> loss.backward()
        >>> xm.reduce_gradients(optimizer)
    """
    count = _collective.world_size()
    if count == 1:  # a world of one: its gradients are the global gradients
        return
    gradients = [
        p.grad for group in optimizer.param_groups for p in group["params"] if p.grad is not None
    ]
    if gradients:
        all_reduce(REDUCE_SUM, gradients, scale=1.0 / count, groups=groups)


def optimizer_step(
    optimizer: torch.optim.Optimizer,
    barrier: bool = False,
    optimizer_args: dict | None = None,
    groups=None,
    pin_layout: bool = True,
) -> Any:
    """Average the gradients over the replicas (:func:`reduce_gradients`), then run
    ``optimizer.step(**optimizer_args)``, and the barrier if ``barrier``.

    Outside ``launch`` the gradients are already global (see :func:`reduce_gradients`), so
    nothing is all-reduced.

    Args:
        optimizer: The optimizer to step.
        barrier: Call :func:`mark_step` after the step (not needed when a ``MpDeviceLoader``
            issues the barrier).
        optimizer_args: Keyword arguments of ``optimizer.step()``.
        groups: Replica groups of the gradient all-reduce.
        pin_layout: Ignored.

    Returns:
        What ``optimizer.step()`` returned (the loss when a closure is passed).

    Example:
        >>> loss.backward()
        >>> xm.optimizer_step(optimizer, barrier=True)
    """
    reduce_gradients(optimizer, groups=groups, pin_layout=pin_layout)
    loss = optimizer.step(**(optimizer_args or {}))
    if barrier:
        mark_step()
    return loss


# --- collectives ---------------------------------------------------------------------------------


def all_reduce(
    reduce_type: str,
    inputs: torch.Tensor | list[torch.Tensor],
    scale: float = 1.0,
    groups=None,
    pin_layout: bool = True,
) -> torch.Tensor | list[torch.Tensor]:
    """Reduce tensors over the replicas (within each group), times ``scale``.

    Args:
        reduce_type: ``xm.REDUCE_SUM``, ``REDUCE_MUL``, ``REDUCE_AND``, ``REDUCE_OR``,
            ``REDUCE_MIN`` or ``REDUCE_MAX``.
        inputs: A tensor, or a list of tensors reduced in place.
        scale: Multiplies the result (applied when not 1.0).
        groups: Replica groups reducing separately, e.g. ``[[0, 2], [1, 3]]``; None: all.
        pin_layout: Ignored.

    Returns:
        For a tensor, the reduced tensor; for a list, the same list, its tensors reduced in place.

    Example:
        >>> total = xm.all_reduce(xm.REDUCE_SUM, torch.tensor([index], device=device))
    """
    single = isinstance(inputs, torch.Tensor)
    tensors = [inputs] if single else list(inputs)
    if torch.compiler.is_compiling() and not groups:  # an op Dynamo keeps in the graph
        reduced = [_functional_all_reduce(reduce_type, t, scale) for t in tensors]
    else:
        reduced = _collective.all_reduce(reduce_type, tensors, scale, groups)
    if single:
        return reduced[0]
    with torch.no_grad():
        for tensor, value in zip(tensors, reduced):
            tensor.copy_(value)
    return inputs


def _functional_all_reduce(reduce_type: str, tensor: torch.Tensor, scale: float) -> torch.Tensor:
    """``all_reduce`` as torch.distributed's functional collective, which torch.compile traces
    into its graph (the engine records it as its own all-reduce), as PyTorch/XLA does."""
    functional = torch.ops._c10d_functional
    reduced = functional.wait_tensor(functional.all_reduce(tensor, reduce_type, ""))
    return reduced if scale == 1.0 else reduced * scale


def all_gather(
    value: torch.Tensor | list[torch.Tensor],
    dim: int = 0,
    groups=None,
    output: torch.Tensor | list[torch.Tensor] | None = None,
    pin_layout: bool = True,
) -> torch.Tensor | list[torch.Tensor]:
    """Concatenate the replicas' tensors along ``dim`` (within each group, in group order).

    Args:
        value: A tensor, or a list of tensors gathered each.
        dim: The dimension to concatenate along.
        groups: Replica groups of one size gathering separately; None: all replicas.
        output: Tensors to write the results into (returned then).
        pin_layout: Ignored.

    Returns:
        The gathered tensor (list) whose ``dim`` is the group size times larger.

    Example:
        >>> everyone = xm.all_gather(torch.tensor([index], device=device))  # [0, 1, ..., 7]
    """

    return _each(value, output, lambda t: _collective.all_gather(t, dim, groups))


def reduce_scatter(
    reduce_type: str,
    input: torch.Tensor | list[torch.Tensor],
    scale: float,
    scatter_dim: int,
    shard_count: int,
    groups=None,
    output: torch.Tensor | list[torch.Tensor] | None = None,
    pin_layout: bool = True,
) -> torch.Tensor | list[torch.Tensor]:
    """Reduce over the replicas (times ``scale``), each keeping its chunk along ``scatter_dim``.

    Args:
        reduce_type: One of the ``xm.REDUCE_*`` types.
        input: A tensor, or a list of tensors reduced and scattered each.
        scale: Multiplies the result.
        scatter_dim: The dimension split into ``shard_count`` chunks.
        shard_count: The number of chunks: the group size.
        groups: Replica groups of one size; None: all replicas.
        output: Tensors to write the results into (returned then).
        pin_layout: Ignored.

    Returns:
        The replica's chunk of the reduction (a list for a list).

    Example:
        >>> mine = xm.reduce_scatter(xm.REDUCE_SUM, grads, 1.0, 0, xr.world_size())
    """

    def scatter(t):
        return _collective.reduce_scatter(reduce_type, t, scale, scatter_dim, shard_count, groups)

    return _each(input, output, scatter)


def all_to_all(
    value: torch.Tensor,
    split_dimension: int,
    concat_dimension: int,
    split_count: int,
    groups=None,
    pin_layout: bool = True,
) -> torch.Tensor:
    """Each replica splits ``value`` into ``split_count`` chunks along ``split_dimension`` and
    sends chunk r to the group's member of rank r, which concatenates what it receives along
    ``concat_dimension``.

    Args:
        value: The tensor to exchange.
        split_dimension: The dimension split into chunks.
        concat_dimension: The dimension the received chunks are concatenated along.
        split_count: The number of chunks: the group size.
        groups: Replica groups of one size; None: all replicas.
        pin_layout: Ignored.

    Example:
        >>> swapped = xm.all_to_all(x, 0, 1, xr.world_size())
    """
    return _collective.all_to_all(value, split_dimension, concat_dimension, split_count, groups)


def collective_permute(value: torch.Tensor, pairs: list) -> torch.Tensor:
    """Send ``value`` from each pair's source replica to its target; a replica no pair targets
    receives zeros.

    Args:
        value: The tensor to send.
        pairs: ``[[source, target], ...]`` ordinals.

    Example:
        >>> n = xr.world_size()
        >>> from_left = xm.collective_permute(x, [[i, (i + 1) % n] for i in range(n)])
    """
    return _collective.collective_permute(value, pairs)


def collective_broadcast(
    tensors: list[torch.Tensor], root_ordinal: int = 0, groups=None, pin_layout: bool = True
) -> None:
    """Overwrite ``tensors`` in place on every replica with the root replica's values.

    Args:
        tensors: The tensors to broadcast (the same list on every replica).
        root_ordinal: The replica whose values everyone receives.
        groups: Replica groups broadcasting separately (``root_ordinal`` is a rank in each).
        pin_layout: Ignored.

    Example:
        >>> xm.collective_broadcast(list(model.parameters()))
    """
    if _collective.world_size() == 1:  # a world of one holds the root's values already
        return
    ordinal = runtime.global_ordinal()
    if groups:
        ordinal = next(list(g).index(ordinal) for g in groups if ordinal in g)
    with torch.no_grad():
        for tensor in tensors:
            keep = torch.tensor(ordinal == root_ordinal, dtype=tensor.dtype)
            tensor.mul_(keep.to(tensor.device))
    all_reduce(REDUCE_SUM, tensors, groups=groups)


def rendezvous(tag: str, payload: Any = b"", replicas: list | None = None) -> list:
    """Wait until every replica (of ``replicas``; default all) reaches rendezvous ``tag``.

    A replica reaching another tag, or leaving the launched function while others wait, is an
    error naming the replicas and tags, not a hang.

    Args:
        tag: The rendezvous' name: every participant must use the same.
        payload: The bytes this replica shares.
        replicas: The ordinals taking part; None or [] for all.

    Returns:
        The participants' payloads, in ordinal order.

    Raises:
        TypeError: ``payload`` is not bytes (as in PyTorch/XLA; ``mesh_reduce`` shares objects).

    Example:
        >>> xm.rendezvous('epoch_end')
    """
    if not isinstance(payload, bytes):
        raise TypeError(f"rendezvous {tag!r}: payload must be bytes, not {type(payload).__name__}")
    return _engine.current().mode.rendezvous(tag, payload, list(replicas or []))


def mesh_reduce(tag: str, data: Any, reduce_fn: Callable[[list], Any]) -> Any:
    """``reduce_fn`` of every replica's ``data`` (xla tensors in it moved to the CPU), in
    ordinal order; every replica gets the result.

    Args:
        tag: The rendezvous' name.
        data: This replica's value: any picklable object, tensors included.
        reduce_fn: Reduces the list of every replica's value.

    Example:
        >>> accuracy = xm.mesh_reduce('accuracy', correct / total, np.mean)
    """
    host = rewrite_instances(data, _is_xla_value, lambda t, i: to_cpu_tensor(t))
    return reduce_fn(copy.deepcopy(_engine.current().mode.rendezvous(tag, host, [])))


def _each(value, output, collective: Callable):
    """Apply a one-tensor collective to a tensor or each tensor of a list; write into ``output``
    when given, resized to the result as PyTorch's ``out=`` tensors are (a reduce-scatter's output
    may be given at the input's shape)."""
    single = isinstance(value, torch.Tensor)
    results = [collective(t) for t in ([value] if single else value)]
    if output is None:
        return results[0] if single else results
    outputs = [output] if single else list(output)
    with torch.no_grad():
        for out, result in zip(outputs, results):
            if out.shape == result.shape:
                out.copy_(result)
            else:  # the tensor object itself becomes the result (its sizes are the wrapper's)
                torch.utils.swap_tensors(out, result)
    return output


def save(data: Any, file_or_path, master_only: bool = True, global_master: bool = False) -> None:
    """Save ``data`` with ``torch.save``, every xla tensor in it moved to the CPU first.

    ``torch.load`` then gives CPU tensors. The xla tensors are computed together in one program
    (on every process, since a program over sharded tensors involves them all); only the master
    copies them to the host and writes. Shared tensors stay shared; views are saved as copies.

    Args:
        data: Any nesting of lists, tuples, dicts, sets and objects holding tensors.
        file_or_path: The destination: a path or a file object.
        master_only: Only the master ordinal writes. If ``False`` every process writes, so
            ``file_or_path`` must differ between processes.
        global_master: With ``master_only``, only the global master (ordinal 0) writes, instead
            of the master of each host.

    Example:
        >>> xm.save(model.state_dict(), 'model.pt')
        >>> state = torch.load('model.pt')  # CPU tensors
    """
    should_write = not master_only or is_master_ordinal(local=not global_master)
    _compute_xla_tensors(data)
    if should_write:
        cpu_data = rewrite_instances(data, _is_xla_value, lambda t, i: to_cpu_tensor(t))
        torch.save(cpu_data, file_or_path)
    rendezvous("spmd_torch.core.xla_model.save")


def _maybe_convert_to_cpu(data: Any, convert: bool = True) -> Any:
    """``data`` with its xla tensors computed (in one program) and, with ``convert``, replaced by
    CPU copies; the helper behind :func:`save`, which state-dict comparisons call directly.

    Args:
        data: Any nesting of lists, tuples, dicts, sets and objects holding tensors.
        convert: Replace the xla tensors by CPU copies; if False they are only computed and
            ``data`` keeps them.

    Returns:
        ``data`` rebuilt (containers copied) with the CPU copies, or with the computed tensors.

    Example:
        >>> state = xm._maybe_convert_to_cpu(optimizer.state_dict())  # CPU tensors
    """
    _compute_xla_tensors(data)
    if not convert:
        return rewrite_instances(data, _is_xla_value, lambda t, i: t)
    return rewrite_instances(data, _is_xla_value, lambda t, i: to_cpu_tensor(t))


def to_cpu_tensor(t: torch.Tensor) -> torch.Tensor:
    """A CPU copy of an xla tensor, a leaf with the same ``requires_grad``."""
    cpu = t.detach().cpu()
    return cpu.requires_grad_(t.requires_grad) if t.requires_grad else cpu


def get_rng_state(device: str | torch.device | None = None) -> int:
    """The device RNG state, as one integer that :func:`set_rng_state` restores exactly.

    The state is the device PRNG key (two 32-bit words, high word first). If random ops are
    pending, the key they leave behind is computed (only that small part of the graph runs).
    A state below ``2**32`` is the same as seeding with it: ``set_rng_state(s)`` equals
    ``manual_seed(s)``.

    Args:
        device: An xla device (default: ``xla:0``); the process's devices share one state.

    Returns:
        The RNG state as a non-negative integer below ``2**64``.

    Example:
        >>> state = xm.get_rng_state()
        >>> a = torch.rand(3, device=dev)
        >>> xm.set_rng_state(state)
        >>> b = torch.rand(3, device=dev)  # equal to a
    """
    _check_device(device, "get_rng_state")
    high, low = _execute.rng_words()
    return (high << 32) | low


def set_rng_state(seed: int, device: str | torch.device | None = None) -> None:
    """Set the device RNG state: a value of :func:`get_rng_state`, or a seed.

    Args:
        seed: The state; taken modulo ``2**64`` (negative seeds wrap, as in PyTorch).
        device: An xla device (default: ``xla:0``); the process's devices share one state.

    Example:
        >>> xm.set_rng_state(1234)
    """
    _check_device(device, "set_rng_state")
    state = int(seed) & 0xFFFFFFFFFFFFFFFF
    _rng.set_words(state >> 32, state & 0xFFFFFFFF)


@contextlib.contextmanager
def fork_rng(device: str | torch.device | None = None, enabled: bool = True):
    """Restore the device RNG state on exit, so the block's random draws leave no trace.

    Args:
        device: The xla device (default: ``xla:0``).
        enabled: If ``False``, do nothing.

    Example:
        >>> with xm.fork_rng():
        ...     noise = torch.rand(3, device=dev)
    """
    if not enabled:
        yield
        return
    state = get_rng_state(device)
    try:
        yield
    finally:
        set_rng_state(state, device)


def get_stablehlo(tensors: list[torch.Tensor] | None = None) -> str:
    """The StableHLO text of the pending computation of ``tensors`` (nothing runs).

    Args:
        tensors: The outputs of the graph to lower; default: every pending tensor.

    Example:
        >>> y = x * 2 + 1
        >>> print(xm.get_stablehlo([y]))
    """
    return _graph.pending_stablehlo(list(tensors) if tensors else None)


def _check_device(device, api: str) -> int:
    """The index of the xla device ``device`` names (None: ``xla:0``); a ValueError if the
    process has no such device."""
    if device is None:
        return 0
    parsed = torch.device(device)
    if parsed.type != "xla":
        raise ValueError(f"{api}(device={str(device)!r}): not an xla device")
    try:
        return _engine.current().mode.use_device(parsed.index).index
    except IndexError as error:
        raise ValueError(f"{api}(device={str(device)!r}): {error}") from None


def _compute_xla_tensors(data: Any) -> list[torch.Tensor]:
    """Compute every xla tensor in ``data`` in one program (no donation); returns them."""
    tensors: list[torch.Tensor] = []
    rewrite_instances(data, _is_xla_value, lambda t, i: tensors.append(t))
    if tensors:
        _execute.materialize(tensors)
    return tensors


def rewrite_instances(data: Any, select: Callable, convert: Callable) -> Any:
    """``data`` with every value ``v`` where ``select(v)`` replaced by ``convert(v, index)``.

    ``index`` numbers distinct selected values in order of first appearance; the walk is
    :func:`spmd_torch.utils.utils.for_each_instance_rewrite`'s (a value met twice is converted
    once, containers are copied, never mutated, tuples stay tuples).
    """
    counter = itertools.count()
    return xu.for_each_instance_rewrite(data, select, lambda value: convert(value, next(counter)))


def _is_xla_value(value: Any) -> bool:
    return isinstance(value, torch.Tensor) and value.device.type == "xla"


# --- training helpers ----------------------------------------------------------------------------


class RateTracker:
    """Examples per second, smoothed between reports and averaged over the whole run.

    ``add(n)`` counts examples; :meth:`rate` is the rate since the previous ``rate()`` call,
    blended with that call's rate (``(1 - s) * current + s * previous``, ``s`` the smoothing
    factor); :meth:`global_rate` is every example counted over the time since creation.

    Args:
        smooth_factor: The weight of the previous rate; default the ``RATE_TRACKER_SMOOTHING``
            environment variable, else 0.4.
        clock: Seconds as a float (default ``time.time``); tests pass their own.

    Example:
        >>> tracker = xm.RateTracker()
        >>> tracker.add(batch_size)
        >>> print(f'{tracker.rate():.1f} examples/s, {tracker.global_rate():.1f} overall')
    """

    def __init__(
        self, smooth_factor: float | None = None, clock: Callable[[], float] = time.time
    ) -> None:
        if smooth_factor is None:
            smooth_factor = _config.RATE_TRACKER_SMOOTHING.read()
        self._smooth_factor = smooth_factor
        self._clock = clock
        self._start_time = clock()
        self._partial_time = self._start_time
        self._partial_count = 0.0
        self._partial_rate: float | None = None
        self._count = 0.0

    def add(self, count: float) -> None:
        """Count ``count`` more examples."""
        self._count += count

    def rate(self) -> float:
        """The smoothed rate since the previous call (0.0 if no time has passed)."""
        now = self._clock()
        delta = now - self._partial_time
        if delta <= 0:
            return 0.0
        current = self._count / delta
        if self._partial_rate is not None:
            current = (1 - self._smooth_factor) * current + self._smooth_factor * self._partial_rate
        self._partial_count += self._count
        self._count = 0.0
        self._partial_time = now
        self._partial_rate = current
        return current

    def global_rate(self) -> float:
        """Every example counted, divided by the seconds since the tracker was made."""
        delta = self._clock() - self._start_time
        return (self._partial_count + self._count) / delta if delta > 0 else 0.0


class ToXlaTensorArena:
    """Converts the selected tensors of a nested structure all at once, then puts the results
    back where the tensors were (the helper behind :func:`send_cpu_data_to_device`).

    Args:
        convert_fn: Takes the list of selected tensors, returns their replacements in order.
        select_fn: Picks the tensors to convert.

    Example:
        >>> arena = xm.ToXlaTensorArena(lambda ts: [t.to(device) for t in ts], torch.is_tensor)
        >>> on_device = arena.transform({'x': x, 'y': [y]})
    """

    def __init__(
        self,
        convert_fn: Callable[[list[torch.Tensor]], list[torch.Tensor]],
        select_fn: Callable[[Any], bool],
    ) -> None:
        self._convert_fn = convert_fn
        self._select_fn = select_fn

    def transform(self, inputs: Any) -> Any:
        """``inputs`` with each selected tensor replaced by its conversion."""
        tensors: list[torch.Tensor] = []
        xu.for_each_instance(inputs, self._select_fn, tensors.append)
        converted = list(self._convert_fn(tensors)) if tensors else []
        if len(converted) != len(tensors):
            raise ValueError(
                f"ToXlaTensorArena: convert_fn returned {len(converted)} tensors for {len(tensors)}"
            )
        replacement = {id(t): new for t, new in zip(tensors, converted)}
        return xu.for_each_instance_rewrite(inputs, self._select_fn, lambda t: replacement[id(t)])


def send_cpu_data_to_device(datas: Any, device: str | torch.device, input_sharding=None) -> Any:
    """``datas`` with every CPU tensor in it moved to the xla device (optionally sharded).

    A single tensor comes back as a one-element list, as in PyTorch/XLA. Tensors already on
    the device, and anything not a tensor, stay as they are.

    Args:
        datas: A tensor or any nesting of containers and objects holding tensors.
        device: The xla device.
        input_sharding: A ``spmd_torch.distributed.spmd.ShardingSpec``: each tensor it fits
            (one spec entry per dimension) is sharded as it says; the others are replicated.

    Raises:
        RuntimeError: With a ``minibatch`` spec, a batch whose first dimension does not divide
            by the number of accelerators this process drives.

    Example:
        >>> (x,) = xm.send_cpu_data_to_device(torch.ones(4), xm.xla_device())
        >>> batch = xm.send_cpu_data_to_device({'x': x_cpu, 'y': y_cpu}, device, spec)
    """
    device = torch.device(device)
    if device.type != "xla":
        raise ValueError(f"send_cpu_data_to_device: {device} is not an xla device")

    def convert(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        uploaded = [t.to(device) for t in tensors]
        if input_sharding is not None:
            for cpu, xla in zip(tensors, uploaded):
                if input_sharding.can_apply(xla):
                    input_sharding.check_minibatch(cpu)
                    input_sharding.apply(xla)
        return uploaded

    if isinstance(datas, torch.Tensor):
        datas = [datas]
    return ToXlaTensorArena(convert, _is_cpu_tensor).transform(datas)


def _is_cpu_tensor(value: Any) -> bool:
    return isinstance(value, torch.Tensor) and value.device.type == "cpu"


def do_on_ordinals(target: Callable[..., Any], data: tuple = (), ordinals=(0,)) -> Any:
    """Run ``target(*data)`` only on the replicas in ``ordinals``, the xla tensors of ``data``
    moved to the CPU; then wait for every replica.

    Args:
        target: The function to run.
        data: Its arguments; every xla tensor the function reads must be passed here.
        ordinals: The replicas that run it.

    Returns:
        ``target``'s result on the replicas that ran it, ``None`` on the others.

    Example:
        >>> xm.do_on_ordinals(lambda w: print(w.sum()), (model.weight,))
    """
    running = runtime.global_ordinal() in ordinals
    _compute_xla_tensors(data)
    result = None
    if running:
        result = target(*rewrite_instances(data, _is_xla_value, lambda t, i: to_cpu_tensor(t)))
    rendezvous("spmd_torch.core.xla_model.do_on_ordinals")
    return result


def xla_rendezvous(
    payload: bytes = b"", ordinals: list[int] | None = None, tag: str | None = None
) -> list[bytes]:
    """Share ``payload`` with every replica; :func:`rendezvous` restricted to bytes.

    Args:
        payload: This replica's bytes.
        ordinals: ``None``, or every ordinal (only a global rendezvous is supported).
        tag: The rendezvous' name.

    Returns:
        Every replica's payload, in ordinal order.

    Example:
        >>> xm.xla_rendezvous(b'ready')
        [b'ready']
    """
    if ordinals and len(ordinals) != runtime.world_size():
        raise ValueError(
            f"xla_rendezvous: only a global rendezvous is supported; got ordinals {ordinals} "
            f"in a world of {runtime.world_size()}"
        )
    return rendezvous(tag or "spmd_torch.core.xla_model.xla_rendezvous", payload)


def broadcast_master_param(model: torch.nn.Module) -> None:
    """Give every replica the master replica's (ordinal 0) parameters and buffers, then
    :func:`mark_step`.

    Example:
        >>> model = Net().to(device)
        >>> xm.broadcast_master_param(model)
    """
    collective_broadcast([*model.parameters(), *model.buffers()])
    mark_step()


def all_reduce_bucketized_gradients(
    gradients: list[torch.Tensor],
    scale: float,
    groups=None,
    pin_layout: bool = True,
    bucket_cap_mb: int = 0,
) -> None:
    """All-reduce (sum, times ``scale``) ``gradients`` in place.

    PyTorch/XLA splits them into buckets of ``bucket_cap_mb`` to overlap communication with the
    backward pass; here every collective of the step is one program that XLA schedules, so all
    go in one call and ``bucket_cap_mb`` changes nothing.

    Example:
        >>> xm.all_reduce_bucketized_gradients(grads, 1.0 / xr.world_size(), None, False, 50)
    """
    if gradients:
        all_reduce(REDUCE_SUM, list(gradients), scale=scale, groups=groups)


def all_gather_bucketized(
    input_list: list[torch.Tensor],
    dim: int = 0,
    groups=None,
    output: list[torch.Tensor] | None = None,
    pin_layout: bool = False,
    bucket_cap_mb: int = 160,
) -> list[torch.Tensor]:
    """:func:`all_gather` of each tensor of ``input_list`` (``bucket_cap_mb`` changes nothing:
    see :func:`all_reduce_bucketized_gradients`).

    Example:
        >>> full = xm.all_gather_bucketized([w1, w2], dim=0)
    """
    if pin_layout:
        raise RuntimeError("all_gather_bucketized: pin_layout=True is not supported")
    return all_gather(list(input_list), dim=dim, groups=groups, output=output)


def reduce_scatter_bucketized(
    reduce_type: str,
    input_list: list[torch.Tensor],
    scale: float,
    scatter_dim: int,
    shard_count: int,
    groups=None,
    output: list[torch.Tensor] | None = None,
    pin_layout: bool = False,
    bucket_cap_mb: int = 160,
) -> list[torch.Tensor]:
    """:func:`reduce_scatter` of each tensor of ``input_list`` (``bucket_cap_mb`` changes
    nothing: see :func:`all_reduce_bucketized_gradients`).

    Example:
        >>> mine = xm.reduce_scatter_bucketized(xm.REDUCE_SUM, grads, 1.0, 0, xr.world_size())
    """
    return reduce_scatter(
        reduce_type, list(input_list), scale, scatter_dim, shard_count, groups, output
    )


class MemoryInfo(TypedDict):
    """Device memory in bytes, as :func:`get_memory_info` reports it.

    Example:
        >>> info = xm.get_memory_info()  # on a GPU or TPU
        >>> info['bytes_used'] <= info['bytes_limit']
        True
    """

    bytes_used: int
    bytes_limit: int
    peak_bytes_used: int


def get_memory_info(device: str | torch.device | None = None) -> MemoryInfo:
    """The device memory in use, its limit and the peak use, summed over the accelerators
    behind the xla device (outside SPMD the one it names; under SPMD all of them; inside
    ``launch`` the replica's own).

    Args:
        device: The xla device (default ``xla:0``).

    Raises:
        RuntimeError: The runtime keeps no memory statistics (JAX's CPU backend).

    Example:
        >>> info = xm.get_memory_info()
        >>> info['bytes_used'] / info['bytes_limit']
        0.12
    """
    backing = _backing_devices(_check_device(device, "get_memory_info"))
    stats = [d.memory_stats() for d in backing]
    if any(s is None for s in stats):
        raise RuntimeError(
            f"get_memory_info: the {runtime.device_type()} runtime keeps no memory statistics "
            f"(device {backing[0]})"
        )
    return MemoryInfo(
        bytes_used=sum(s.get("bytes_in_use", 0) for s in stats),
        bytes_limit=sum(s.get("bytes_limit", 0) for s in stats),
        peak_bytes_used=sum(s.get("peak_bytes_in_use", 0) for s in stats),
    )


def _backing_devices(index: int = 0) -> list:
    """The accelerators behind ``xla:index``: outside SPMD the one it names; under SPMD every
    device of this process; inside ``launch`` the replica's own."""
    mode = _engine.current().mode
    devices = mode.local_devices()
    return [devices[index]] if mode.device_count() > 1 else devices
