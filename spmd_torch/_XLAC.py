"""``torch_xla._XLAC``: the calls into PyTorch/XLA's C++ extension that user code, its test suite
and libraries make, each answered by this runtime.

The performance guide prints ``_xla_metrics_report()``; the troubleshooting guide reads a pending
graph with ``_get_xla_tensors_text`` / ``_get_xla_tensors_hlo``; the SPMD guide and tests read
shardings with ``_get_xla_sharding_spec``; huggingface_hub and transformers tell shared tensors
apart with ``_xla_get_tensor_id``. Device names follow PyTorch/XLA's: ``'xla:0'`` is the one
logical device of the process (as under SPMD), ``'CPU:3'``/``'CUDA:3'``/``'TPU:3'`` a real one.

Calls whose meaning is PyTorch/XLA's own machinery are absent rather than faked: IR and buffer
internals (``_get_graph_hash``, ``_get_tensors_xla_device_data_node``,
``_run_cached_graph``, ``_replace_xla_tensor``), dynamic shapes (``_xla_mark_dynamic``),
``xla::OpSharding`` values (``OpSharding``, ``_xla_mark_sharding``: the calls that take a sharding
take the ``NamedSharding`` that ``mesh.get_op_sharding`` gives). ``_xla_tpu_custom_call`` runs the
kernel ``custom_kernel.trace_pallas`` binds, not a serialised Mosaic payload.
``lowering.LoweringContext`` builds the HLO module of our own graph
(``debug/lowering_context.py``). The preemption sync manager's calls are the
distributed checkpoint package's (JAX's preemption service across processes).
``_get_xla_tensor_debug_info`` describes this runtime's own state of a tensor (its pending op or
its device buffer) in PyTorch/XLA's layout. ``_set_buffer_donation`` gives a live tensor's device
buffer to the next program that reads it, as PyTorch/XLA's user-configured donation does.

Example:
    >>> import spmd_torch._XLAC as xlac
    >>> xs.mark_sharding(t, xs.Mesh(np.arange(8), (4, 2)), (0, None))
    >>> xlac._get_xla_sharding_spec(t)
    '{devices=[4,1,2]0,1,2,3,4,5,6,7 last_tile_dim_replicate}'
"""

from __future__ import annotations

import itertools
import os
import threading
import weakref
from collections.abc import Callable, Sequence

import jax
import jax.version
import jaxlib.version
import torch
from jax._src import xla_bridge  # backends_are_initialized: JAX has no public query for it
from jax.sharding import NamedSharding, PartitionSpec

from spmd_torch import config, runtime
from spmd_torch._lazy import counters, execute, placement, run, transfer
from spmd_torch._lazy.graph import DATA, Aval
from spmd_torch._lazy.layout import padded_shape
from spmd_torch._lazy.lowering.dtypes import to_jax_dtype
from spmd_torch._lazy.manual import ManualShardingError
from spmd_torch._lazy.tensor import on_xla
from spmd_torch.core import xla_model as xm
from spmd_torch.core.xla_builder import _user_computation as _xla_user_computation
from spmd_torch.core.xla_builder import call_jax
from spmd_torch.debug import lowering_context as lowering  # noqa: F401  (``_XLAC.lowering``)
from spmd_torch.debug.graph import (
    get_tensors_hlo,
    get_tensors_text,
    held_text,
    pending_program,
    program_text,
)
from spmd_torch.debug.metrics import clear_counters as _clear_xla_counters
from spmd_torch.debug.metrics import clear_metrics as _clear_xla_metrics
from spmd_torch.debug.metrics import counter_names as _xla_counter_names
from spmd_torch.debug.metrics import counter_value as _xla_counter_value
from spmd_torch.debug.metrics import executed_fallback_ops as _get_executed_fallback_ops
from spmd_torch.debug.metrics import metric_data as _xla_metric_data
from spmd_torch.debug.metrics import metric_names as _xla_metric_names
from spmd_torch.debug.metrics import metrics_report as _xla_metrics_report
from spmd_torch.debug.metrics import short_metrics_report as _short_xla_metrics_report
from spmd_torch.distributed.spmd import xla_sharding as xs
from spmd_torch.distributed.spmd.xla_sharded_tensor import annotated_tiling
from spmd_torch.experimental.callback import on_ready_callback
from spmd_torch.experimental.custom_kernel import run_traced_kernel as _xla_tpu_custom_call
from spmd_torch.experimental.distributed_checkpoint._preemption import (
    activate_preemption_sync_manager as _activate_preemption_sync_manager,
)
from spmd_torch.experimental.distributed_checkpoint._preemption import (
    deactivate_preemption_sync_manager as _deactivate_preemption_sync_manager,
)
from spmd_torch.experimental.distributed_checkpoint._preemption import (
    sync_point_reached as _sync_point_reached,
)

__all__ = [
    "lowering",
    "_activate_preemption_sync_manager",
    "_clear_xla_counters",
    "_deactivate_preemption_sync_manager",
    "_clear_xla_metrics",
    "_ensure_xla_coordinator_initialized",
    "_get_executed_fallback_ops",
    "_get_git_revs",
    "_get_buffer_donation",
    "_get_tensors_handle",
    "_get_xla_sharding_spec",
    "_get_xla_sharding_specs",
    "_get_xla_sharding_type",
    "_get_xla_tensor_debug_info",
    "_get_xla_tensor_dimension_size",
    "_get_xla_tensor_shape_type",
    "_set_allow_execution",
    "_set_buffer_donation",
    "_get_xla_tensors_hlo",
    "_get_xla_tensors_text",
    "_global_tensor_from_cpu_shards",
    "_init_computation_client",
    "_is_placecholder",
    "_on_ready_callback",
    "_short_xla_metrics_report",
    "_spmd_full_to_shard_shape",
    "_spmd_shard_to_full_shape",
    "_sync_point_reached",
    "_unsafe_buffer_pointer",
    "_xla_clear_sharding",
    "_xla_dot_general",
    "_xla_tpu_custom_call",
    "_xla_counter_names",
    "_xla_counter_value",
    "_xla_get_all_devices",
    "_xla_get_all_runtime_devices",
    "_xla_get_default_device",
    "_xla_get_default_device_ordinal",
    "_xla_get_enable_alias_with_buffer_donor_config",
    "_xla_get_devices",
    "_xla_get_mat_mul_precision",
    "_xla_get_rng_seed",
    "_xla_get_runtime_devices",
    "_xla_get_tensor_id",
    "_xla_increment_counter",
    "_xla_metric_data",
    "_xla_metric_names",
    "_xla_metrics_report",
    "_xla_num_devices",
    "_xla_num_runtime_devices",
    "_xla_real_devices",
    "_xla_runtime_is_initialized",
    "_xla_set_enable_alias_with_buffer_donor_config",
    "_xla_set_mat_mul_precision",
    "_xla_set_rng_seed",
    "_xla_sync_multi",
    "_xla_tensors_from_aten",
    "_xla_user_computation",
    "_xla_wait_device_ops",
]

_PRECISIONS = ("default", "high", "highest")


def _xla_tensor(t, api: str) -> torch.Tensor:
    """``t`` (unwrapped from an XLAShardedTensor) if on the xla device; RuntimeError otherwise,
    as PyTorch/XLA's bindings raise for a tensor that is not an XLA tensor."""
    return on_xla(xs.unwrap_sharded_tensor(t), api, RuntimeError)


def _get_xla_tensors_hlo(tensors: Sequence[torch.Tensor]) -> str:
    """The graph computing ``tensors`` as the HLO text XLA is handed (PyTorch/XLA's print style);
    with ``XLA_DUMP_POST_OPTIMIZATIONS=1`` the HLO XLA runs, after its passes and SPMD
    partitioning (collectives included).

    Example:
        >>> print(_get_xla_tensors_hlo([t1 @ t2]))
    """
    if not config.DUMP_POST_OPTIMIZATIONS.read():
        return get_tensors_hlo(tensors)
    program = pending_program([_xla_tensor(t, "_get_xla_tensors_hlo") for t in tensors])
    return program_text(program, "optimized")


# --- sharding ------------------------------------------------------------------------------------


def _get_xla_sharding_spec(t: torch.Tensor) -> str:
    """The tensor's sharding as XLA prints it (``HloSharding::ToString``); ``''`` without one.

    ``'{devices=[8,1]0,1,2,3,4,5,6,7}'`` tiled, ``'{devices=[4,1,2]0,1,2,3,4,5,6,7
    last_tile_dim_replicate}'`` when each tile is replicated over the mesh axes the spec leaves
    out, ``'{replicated}'``. Device ids are written out in full, never XLA's ``<=[8]`` form. As in
    PyTorch/XLA, a pending value and an upload no program has written since have none (``''``);
    a program's output in SPMD mode has its layout, ``'{replicated}'`` included.

    Example:
        >>> xs.mark_sharding(t, xs.Mesh(np.arange(8), (8,)), (0, None))
        >>> _get_xla_sharding_spec(t)
        '{devices=[8,1]0,1,2,3,4,5,6,7}'
    """
    return xs.get_xla_sharding_spec(_xla_tensor(t, "_get_xla_sharding_spec"))


def _get_xla_sharding_specs(tensors: Sequence[torch.Tensor]) -> list[str]:
    """:func:`_get_xla_sharding_spec` of each tensor.

    Example:
        >>> _get_xla_sharding_specs([t, u])
        ['{devices=[8,1]0,1,2,3,4,5,6,7}', '']
    """
    return [_get_xla_sharding_spec(t) for t in tensors]


def _get_xla_sharding_type(t: torch.Tensor) -> int | None:
    """The tensor's ``xs.ShardingType`` as an int (``xla::OpSharding::Type``: 0 replicated,
    3 tiled, 5 partially replicated...); None without a sharding.

    Example:
        >>> xs.ShardingType(_get_xla_sharding_type(t))
        <ShardingType.TILED: 3>
    """
    tiling = annotated_tiling(_xla_tensor(t, "_get_xla_sharding_type"), "_get_xla_sharding_type")
    return None if tiling is None else int(tiling.type)


def _xla_clear_sharding(t: torch.Tensor) -> None:
    """Forget the tensor's sharding annotation (``xs.clear_sharding``).

    Example:
        >>> _xla_clear_sharding(t)
        >>> _get_xla_sharding_spec(t)
        ''
    """
    xs.clear_sharding(_xla_tensor(t, "_xla_clear_sharding"))


def _global_tensor_from_cpu_shards(
    shards: Sequence[torch.Tensor],
    sharding: NamedSharding,
    global_shape: Sequence[int] | None = None,
) -> torch.Tensor:
    """The xla tensor laid out with ``sharding`` (``mesh.get_op_sharding(spec)``) whose shards
    are ``shards``: one CPU tensor per device of this process the sharding uses, in device-id
    order, each the shape of one shard (an uneven sharding's padding included). Each host passes
    only its own devices' shards, so nothing crosses hosts.

    Args:
        global_shape: The tensor's shape; default: the shards tiled. It may be smaller than that
            by an uneven sharding's padding (the shards' padding is dropped); RuntimeError if
            the shards do not tile it.

    Example:
        >>> sharding = xs.Mesh(np.arange(8), (8,)).get_op_sharding((0,))
        >>> _global_tensor_from_cpu_shards([torch.tensor([i]) for i in range(8)], sharding).cpu()
        tensor([0, 1, 2, 3, 4, 5, 6, 7])
    """
    api = "_global_tensor_from_cpu_shards"
    if not isinstance(sharding, NamedSharding):
        raise TypeError(
            f"{api}: the sharding is a {type(sharding).__name__}; build it with "
            "mesh.get_op_sharding(partition_spec)"
        )
    devices = len(sharding.addressable_devices)
    if len(shards) != devices:
        raise RuntimeError(
            f"{api}: {len(shards)} shards for the {devices} devices of this "
            "process that the sharding uses"
        )
    kinds = {(tuple(s.shape), s.dtype) for s in shards}
    if len(kinds) != 1:
        raise RuntimeError(f"{api}: the shards differ in shape or dtype: {sorted(map(str, kinds))}")
    ((shard_shape, dtype),) = kinds
    if any(entry is not None for entry in sharding.spec[len(shard_shape) :]):
        raise RuntimeError(
            f"{api}: a sharding of {len(sharding.spec)} dimensions for shards of "
            f"shape {shard_shape}"
        )
    sharding = NamedSharding(sharding.mesh, PartitionSpec(*sharding.spec[: len(shard_shape)]))
    ways = padded_shape((1,) * len(shard_shape), sharding)
    tiled = tuple(n * w for n, w in zip(shard_shape, ways))
    shape = tiled if global_shape is None else tuple(global_shape)
    if len(shape) != len(tiled) or padded_shape(shape, sharding) != tiled:
        raise RuntimeError(
            f"{api}: shards of shape {shard_shape}, tiled {ways} to {tiled}, do "
            f"not make a tensor of shape {shape}"
        )
    devices = sorted(sharding.addressable_devices, key=lambda d: d.id)
    with counters.timed("TransferToDeviceTime"):
        arrays = [jax.device_put(transfer.host_copy(s), d) for s, d in zip(shards, devices)]
        array = jax.make_array_from_single_device_arrays(tiled, sharding, arrays)
    counters.bump("TransferToDevice")
    counters.record("OutboundData", sum(a.nbytes for a in arrays))
    return placement.adopt(array, shape, dtype, sharding)


def _spmd_full_to_shard_shape(t: torch.Tensor) -> torch.Tensor:
    """Each device's shard of ``t`` under its sharding, to work on by hand: ops on it and on what
    is computed from it run on each device on its own until :func:`_spmd_shard_to_full_shape`
    (``xs.enable_manual_sharding`` without the mark).

    Example:
        >>> xs.mark_sharding(x, mesh, (0, 1))
        >>> _spmd_full_to_shard_shape(x).shape  # [8, 8] over (1, 8) devices
        torch.Size([8, 1])
    """
    t = _xla_tensor(t, "_spmd_full_to_shard_shape")
    sharding = xs.own_sharding(t)
    if sharding is None:
        raise RuntimeError(
            f"_spmd_full_to_shard_shape: the tensor of shape {tuple(t.shape)} "
            "has no sharding; mark it with xs.mark_sharding first"
        )
    return xs.ToShards.apply(t, sharding)


def _spmd_shard_to_full_shape(
    t: torch.Tensor, sharding: NamedSharding, full_shape: Sequence[int], dtype: torch.dtype
) -> torch.Tensor:
    """The tensor of ``full_shape`` laid out with ``sharding`` whose shards are each device's
    ``t``, a shard computed by hand since :func:`_spmd_full_to_shard_shape`.

    Example:
        >>> y = _spmd_shard_to_full_shape(local + 1, mesh.get_op_sharding((0, 1)), (8, 8), x.dtype)
    """
    t = _xla_tensor(t, "_spmd_shard_to_full_shape")
    if t.dtype != dtype:
        raise RuntimeError(f"_spmd_shard_to_full_shape: the shard is {t.dtype}, not {dtype}")
    try:
        return xs.FromShards.apply(t, sharding, tuple(full_shape))
    except ManualShardingError as error:
        raise RuntimeError(f"_spmd_shard_to_full_shape: {error}") from error


# --- tensors -------------------------------------------------------------------------------------

# Storage -> id; weak, so an id lives as long as the value it names.
_TENSOR_IDS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_NEXT_ID = itertools.count(1)
_IDS_LOCK = threading.Lock()  # replicas of launch are threads


def _xla_get_tensor_id(t: torch.Tensor) -> int:
    """A positive id of the tensor's value, unique in the process while the value lives.

    Tensors sharing one value (the same tensor, ``detach()``, views, ``.data``, a tied weight)
    get the same id; distinct tensors (copies, ``clone()``) distinct ids; in-place updates and
    barriers keep it. So huggingface_hub and transformers find shared xla tensors when saving.
    (PyTorch/XLA numbers its C++ tensor objects, so there a view gets an id of its own.)

    Example:
        >>> _xla_get_tensor_id(w) == _xla_get_tensor_id(w.detach()) == _xla_get_tensor_id(w[0])
        True
        >>> _xla_get_tensor_id(w) == _xla_get_tensor_id(w.clone())
        False
    """
    storage = _xla_tensor(t, "_xla_get_tensor_id")._storage  # the value every alias shares
    with _IDS_LOCK:
        tensor_id = _TENSOR_IDS.get(storage)
        if tensor_id is None:
            tensor_id = _TENSOR_IDS[storage] = next(_NEXT_ID)
    return tensor_id


def _get_xla_tensor_dimension_size(t: torch.Tensor, dim: int) -> torch.Tensor:
    """The size of dimension ``dim`` as an int32 scalar on the xla device.

    PyTorch/XLA reads it from the device for dynamically shaped results (``nonzero``,
    ``masked_select``); here every shape is static (such ops compute their size), so it is the
    tensor's own.

    Example:
        >>> _get_xla_tensor_dimension_size(torch.nonzero(x), 0).item()
        4
    """
    t = _xla_tensor(t, "_get_xla_tensor_dimension_size")
    if not -t.dim() <= dim < max(t.dim(), 1):
        raise IndexError(
            f"_get_xla_tensor_dimension_size: dimension {dim} is out of range for a tensor of "
            f"shape {tuple(t.shape)}"
        )
    size = t.shape[dim] if t.dim() else 1
    return torch.full((), size, dtype=torch.int32, device=t.device)


def _get_xla_tensors_text(tensors: Sequence[torch.Tensor]) -> str:
    """The graph computing ``tensors`` as text, one typed line per op, ending in a line break as
    PyTorch/XLA's dump does (``text.split('\\n')[-3]`` is the last op).

    Example:
        >>> print(_get_xla_tensors_text([x + 1]))
        %in0:f32[2] = xla::device_data
        %0:f32[2] = aten.add.Tensor(%in0, 1)
        return %0
    """
    return get_tensors_text(list(tensors)) + "\n"


def _device_shape(t: torch.Tensor) -> str:
    """The tensor's shape as the device holds it (``XLA_USE_BF16`` applied): ``f32[4,2]``."""
    return held_text(Aval(tuple(t.shape), t.dtype))


def _get_xla_tensor_shape_type(t: torch.Tensor) -> str:
    """The element type the device holds the tensor in, XLA's name: ``'f16'``, ``'bf16'``...
    (``bf16`` for a float32 tensor under ``XLA_USE_BF16=1``).

    Example:
        >>> _get_xla_tensor_shape_type(torch.zeros(2, dtype=torch.half, device='xla'))
        'f16'
    """
    return _device_shape(_xla_tensor(t, "_get_xla_tensor_shape_type")).split("[")[0]


def _get_xla_tensor_debug_info(t: torch.Tensor) -> str:
    """What this runtime holds for the tensor, in PyTorch/XLA's layout: its id, device and shape,
    its sharding, the pending op computing it (``IR``) or else its device buffer (``XLAData``, the
    IR then PyTorch/XLA's ``xla::device_data``: programs read it as their input), or the host
    copy an SPMD upload waits in. ``'Not a XLATensor'`` for other tensors. In SPMD
    mode the device is ``SPMD:0``, PyTorch/XLA's virtual device: the mesh every program runs on.

    Example:
        >>> print(_get_xla_tensor_debug_info(x + 5))
        XLATensor {
        TensorID: 3
        Device: xla:0
        XLA Shape: f32[5]
        ShardingSpec: None
        IR: aten::add.Tensor
        XLAData: None
        Tensor on host: None
        }
    """
    t = xs.unwrap_sharded_tensor(t)
    if not isinstance(t, torch.Tensor) or t.device.type != "xla":
        return "Not a XLATensor\n"
    node, index = t._ref()
    spec = _get_xla_sharding_spec(t)
    lines = [
        "XLATensor {",
        f"TensorID: {_xla_get_tensor_id(t)}",
        f"Device: {'SPMD:0' if runtime.is_spmd() else t.device}",
        f"XLA Shape: {_device_shape(t)}",
        f"ShardingSpec: {spec or 'None'}",
    ]
    if not node.is_leaf(index):
        name = node.op.name() if callable(getattr(node.op, "name", None)) else str(node.op)
        return "\n".join(lines + [f"IR: {name}", "XLAData: None", "Tensor on host: None", "}\n"])
    array = node.arrays[index]
    sharding = getattr(array, "sharding", None)
    if not isinstance(array, jax.Array) or sharding is None:  # an upload waiting on the host
        return "\n".join(
            lines
            + ["IR: None", "XLAData: None", f"Tensor on host: with size {list(t.shape)}", "}\n"]
        )
    # An upload is PyTorch/XLA's device-data IR node; a program's output holds data, no IR.
    lines.append("IR: xla::device_data" if t._storage.from_host else "IR: None")
    devices = sorted(sharding.device_set, key=lambda d: d.id)
    data = "XLAData: " if len(devices) == 1 else "XLAShardedData: "
    where = _runtime_name(devices[0]) if len(devices) == 1 else "SPMD:0"
    lines += [data, f"  Data Device: {where}", f"  Data Shape: {_device_shape(t)}"]
    if len(devices) > 1:
        lines += [f"  OpSharding: {spec or '{replicated}'}", f"  NumShards: {len(devices)}"]
    return "\n".join(lines + ["Tensor on host: None", "}\n"])


def _unsafe_buffer_pointer(t: torch.Tensor) -> int:
    """The address of the tensor's device buffer (computing a pending value first): what DLPack
    and custom kernels hand to native code. Only a tensor held whole on one device has one.

    Example:
        >>> _unsafe_buffer_pointer(torch.arange(5, device='xla')) > 0
        True
    """
    (array,) = execute.materialize([_xla_tensor(t, "_unsafe_buffer_pointer")])
    if len(array.sharding.device_set) != 1:
        raise RuntimeError(
            f"_unsafe_buffer_pointer: the tensor of shape {tuple(t.shape)} is sharded over "
            f"{len(array.sharding.device_set)} devices; it has no single buffer"
        )
    return array.unsafe_buffer_pointer()


def _xla_tensors_from_aten(
    tensors: Sequence[torch.Tensor], devices: Sequence[str]
) -> list[torch.Tensor]:
    """Copies of CPU ``tensors`` on the xla devices named one per tensor (what
    ``xm.ToXlaTensorArena`` converts with); new tensors, outside autograd, as PyTorch/XLA's.

    Example:
        >>> _xla_tensors_from_aten([torch.ones(2)], ['xla:0'])[0].device
        device(type='xla', index=0)
    """
    if len(tensors) != len(devices):
        raise ValueError(
            f"_xla_tensors_from_aten: {len(tensors)} tensors but {len(devices)} devices"
        )
    return [t.detach().to(torch.device(d)) for t, d in zip(tensors, devices)]


def _xla_sync_multi(
    tensors: Sequence[torch.Tensor],
    devices: Sequence[str] = (),
    wait: bool = True,
    sync_xla_data: bool = True,
) -> None:
    """Compute the pending values of ``tensors`` now (only the part of the graph they need);
    the rest stays pending. Tensors off the xla device are skipped, as in PyTorch/XLA.

    Args:
        tensors: The tensors to compute.
        devices: Accepted for PyTorch/XLA's signature (one logical device).
        wait: Block until they are computed.
        sync_xla_data: Accepted; the computed values always become the tensors' data.

    Example:
        >>> y = x * 2
        >>> _xla_sync_multi([y], ['xla:0'])
    """
    xla = [
        t
        for t in map(xs.unwrap_sharded_tensor, tensors)
        if isinstance(t, torch.Tensor) and t.device.type == "xla"
    ]
    arrays = execute.materialize(xla) if xla else []
    if wait:  # a donated input's buffer is an output's now (_set_buffer_donation)
        jax.block_until_ready([a for a in arrays if not a.is_deleted()])


def _set_buffer_donation(t: torch.Tensor, should_donate: bool) -> bool:
    """Give up (or keep) the device buffer of ``t``'s data: the next program that reads it may
    reuse the buffer for an output, although ``t`` is alive; ``t`` then holds no data
    (``_is_placecholder``) and a program or read of it raises. Only data can be donated: False,
    and nothing set, for a pending value or a view. A barrier donates it; a partial read
    (``_xla_sync_multi``, ``.cpu()``) only with ``_xla_set_enable_alias_with_buffer_donor_config
    (True)``. Counted as ``XlaSetBufferDonation``.

    Example:
        >>> _set_buffer_donation(t, True)
        True
    """
    node = _data_of(_xla_tensor(t, "_set_buffer_donation"))
    if node is None:
        return False
    if should_donate:
        run.DONATED_BY_USER.add(node)
    else:
        run.DONATED_BY_USER.discard(node)
    counters.bump("XlaSetBufferDonation")
    return True


def _get_buffer_donation(t: torch.Tensor) -> bool:
    """Whether ``t``'s data is donated (``_set_buffer_donation``)."""
    node = _data_of(_xla_tensor(t, "_get_buffer_donation"))
    return node is not None and node in run.DONATED_BY_USER


def _is_placecholder(t: torch.Tensor) -> bool:
    """Whether ``t`` holds data whose buffer a program took (``_set_buffer_donation``): PyTorch/
    XLA's name, spelt as it spells it."""
    node = _data_of(_xla_tensor(t, "_is_placecholder"))
    return node is not None and getattr(node.arrays[0], "is_deleted", bool)()


def _get_tensors_handle(tensors: Sequence[torch.Tensor]) -> list[int]:
    """A number per tensor naming the data it holds: equal for tensors holding the same device
    data, distinct for different data (placeholders included) while they live. A pending value
    or a view has none, nor does data a program took (``_set_buffer_donation``): RuntimeError.

    Example:
        >>> h1, h2 = _get_tensors_handle([t1, t2])
    """
    handles = []
    for k, t in enumerate(tensors):
        node = _data_of(_xla_tensor(t, "_get_tensors_handle"))
        if node is None:
            raise RuntimeError(
                f"_get_tensors_handle: tensors[{k}] of shape {tuple(t.shape)} holds no device data "
                "yet (a pending value or a view): sync first"
            )
        array = node.arrays[0]
        if type(array) is not transfer.Placeholder and array.is_deleted():
            raise RuntimeError(
                f"_get_tensors_handle: the device buffer of tensors[{k}] (shape {tuple(t.shape)}) "
                "is deleted: a program took it (_set_buffer_donation)"
            )
        handles.append(id(array))
    return handles


def _xla_set_enable_alias_with_buffer_donor_config(enabled: bool) -> None:
    """Whether every run, a partial read's too, gives up the data donated with
    ``_set_buffer_donation`` (by default only a barrier does)."""
    run.DONATE_ON_EVERY_RUN[0] = bool(enabled)


def _xla_get_enable_alias_with_buffer_donor_config() -> bool:
    return run.DONATE_ON_EVERY_RUN[0]


def _data_of(t: torch.Tensor):
    """The data node ``t``'s value is, or None (a pending value, a view)."""
    node = t._storage.ref[0]
    return node if t._view is None and node.op == DATA else None


def _xla_wait_device_ops(devices: Sequence[str] = ()) -> None:
    """Block until every dispatched program has finished (``xm.wait_device_ops``).

    Example:
        >>> _xla_wait_device_ops([])
    """
    xm.wait_device_ops(list(devices))


# --- ops -----------------------------------------------------------------------------------------


def _xla_dot_general(
    lhs: torch.Tensor,
    rhs: torch.Tensor,
    dimension_numbers: tuple,
    precision_config: str | None = None,
    preferred_element_type: torch.dtype | None = None,
) -> torch.Tensor:
    """XLA's DotGeneral of two xla tensors (``jax.lax.dot_general``): the result's axes are the
    batch ones, then ``lhs``'s free ones, then ``rhs``'s.

    Args:
        lhs: The left operand.
        rhs: The right operand.
        dimension_numbers: ``((lhs_contracting, rhs_contracting), (lhs_batch, rhs_batch))``,
            each a list of dimensions (negative ones count from the end), or ``()`` for none.
        precision_config: Not supported (as in PyTorch/XLA): the default precision applies.
        preferred_element_type: The result's dtype (``torch.int32`` for int8 operands).

    Example:
        >>> y = _xla_dot_general(x, w, (([2], [1]), ([0], [0])))  # a batched matmul
    """
    on_xla(lhs, "_xla_dot_general's first argument", RuntimeError)
    on_xla(rhs, "_xla_dot_general's second argument", RuntimeError)
    if precision_config is not None:
        raise RuntimeError(
            "_xla_dot_general: precision_config is not supported, the default precision applies "
            "(set it with torch_xla._XLAC._xla_set_mat_mul_precision)"
        )
    if not isinstance(dimension_numbers, tuple) or len(dimension_numbers) != 2:
        raise RuntimeError(
            f"_xla_dot_general: dimension_numbers must be a tuple of 2 elements "
            f"((contracting dims), (batch dims)), not {dimension_numbers!r}"
        )
    dims = tuple(_dot_dims(part, lhs.dim(), rhs.dim()) for part in dimension_numbers)
    dtype = None if preferred_element_type is None else to_jax_dtype(preferred_element_type)
    return call_jax(_dot_general, (lhs, rhs), {"dims": dims, "dtype": dtype}, name="dot_general")


def _dot_dims(part: tuple, lhs_rank: int, rhs_rank: int) -> tuple[tuple, tuple]:
    """One of ``_xla_dot_general``'s dimension pairs, as non-negative tuples."""
    if part == ():
        return (), ()
    if not isinstance(part, tuple) or len(part) != 2:
        raise RuntimeError(
            "_xla_dot_general: contracting and batch dims are given for both lhs and rhs (two "
            f"lists) or for neither (()), not {part!r}"
        )
    return tuple(
        tuple(int(d) % rank for d in dims) for dims, rank in zip(part, (lhs_rank, rhs_rank))
    )


def _dot_general(lhs, rhs, dims: tuple, dtype):
    return jax.lax.dot_general(lhs, rhs, dims, preferred_element_type=dtype)


def _on_ready_callback(tensor: torch.Tensor, callback: Callable[[], None]) -> None:
    """Call ``callback()`` once the computed ``tensor``'s device buffer is ready, on a worker
    thread (``spmd_torch.experimental.callback``).

    Example:
        >>> _on_ready_callback(loss, lambda: print("ready"))
    """
    on_ready_callback(tensor, lambda _: callback())


# --- runtime and devices -------------------------------------------------------------------------


def _xla_runtime_is_initialized() -> bool:
    """Whether the runtime client has started (JAX's backends): from then on the device kind is
    fixed (``xr.set_device_type`` refuses another).

    Example:
        >>> _xla_runtime_is_initialized()  # after any device use
        True
    """
    return xla_bridge.backends_are_initialized()


_CLIENT_START: list = []  # the first _init_computation_client's error (None: it started)


def _init_computation_client() -> None:
    """Start the runtime client for the device kind ``PJRT_DEVICE`` names: JAX's backend for that
    platform (``runtime.jax_platform``; JAX's default when unset). As in PyTorch/XLA, the first
    call's outcome stands: after a failure every later call raises the first call's error,
    whatever ``PJRT_DEVICE`` says by then.

    Raises:
        RuntimeError: JAX has no backend of that name in this process (the message names it).

    Example:
        >>> os.environ['PJRT_DEVICE'] = 'CPU'
        >>> _init_computation_client()
    """
    if not _CLIENT_START:
        _CLIENT_START.append(_start_client(os.environ.get("PJRT_DEVICE")))
    if _CLIENT_START[0] is not None:
        raise RuntimeError(_CLIENT_START[0])


def _start_client(device_kind: str | None) -> str | None:
    """Start JAX's backend for ``device_kind`` (its default when None); why it failed, or None."""
    if device_kind is None:
        jax.devices()
        return None
    try:
        jax.devices(runtime.jax_platform(device_kind))
    except RuntimeError as error:
        return (
            f"No PjRtPlugin registered for: {device_kind}. Make sure the environment variable "
            f"PJRT_DEVICE is set to a correct device name. (JAX: {error})"
        )
    return None


def _ensure_xla_coordinator_initialized(
    global_rank: int, world_size: int, master_addr: str, master_port: str | int = ""
) -> None:
    """Make sure the job's coordination service is up, with this process as ``global_rank`` of
    ``world_size`` (PyTorch/XLA starts its coordinator here for checkpoints and preemption).

    Here the coordinator is JAX's distributed runtime, which every process of a job joins when
    spmd_torch is imported (a single process needs none); so this checks that the job is the one
    described, and raises RuntimeError if not. ``master_addr``/``master_port`` are the
    launcher's business (``docs/pods.md``).

    Example:
        >>> _ensure_xla_coordinator_initialized(global_rank=0, world_size=1, master_addr='localhost')
    """
    job = (jax.process_index(), jax.process_count())
    if (global_rank, world_size) != job:
        raise RuntimeError(
            f"_ensure_xla_coordinator_initialized(global_rank={global_rank}, "
            f"world_size={world_size}): this process is {job[0]} of a job of {job[1]} "
            "processes, joined at import (set the job up through the launcher, docs/pods.md)"
        )


def _set_allow_execution(allow: bool) -> None:
    """Allow or forbid running programs, process-wide: while forbidden, a program about to run
    (a sync, a read of a pending value) raises RuntimeError ("Unexpected execution happens inside
    the compiled function"), naming the user's line, and runs nothing. PyTorch/XLA's guard for
    code that must only trace.

    Example:
        >>> _set_allow_execution(False)
        >>> torch.ones(2, device='xla')[0].item()  # raises RuntimeError; nothing ran
        >>> _set_allow_execution(True)
    """
    run.EXECUTION_ALLOWED[0] = bool(allow)


def _xla_get_default_device() -> str:
    """The current thread's xla device: ``'xla:0'``, the logical device of the process (a
    replica of ``launch`` is a process of its own).

    Example:
        >>> torch.device(_xla_get_default_device())
        device(type='xla', index=0)
    """
    return str(xm.xla_device())


def _xla_get_default_device_ordinal() -> int:
    """The ordinal of :func:`_xla_get_default_device`: 0.

    Example:
        >>> _xla_get_default_device_ordinal()
        0
    """
    return xm.xla_device().index


def _xla_get_devices() -> list[str]:
    """The real device behind each xla device of this process: one per device outside SPMD,
    ``['CPU:0']`` under SPMD.

    Example:
        >>> _xla_get_devices()  # 4 CPU devices
        ['CPU:0', 'CPU:1', 'CPU:2', 'CPU:3']
    """
    return runtime.xla_real_devices()


def _xla_get_all_devices() -> list[str]:
    """The real device behind each xla device of the job, in ordinal order: every device of
    each process outside SPMD, its first under SPMD (each replica's own inside ``launch``); as
    many as ``xr.global_device_count()``.

    Example:
        >>> _xla_get_all_devices()  # one process, 4 CPU devices
        ['CPU:0', 'CPU:1', 'CPU:2', 'CPU:3']
    """
    devices = sorted(jax.devices(), key=lambda d: (d.process_index, d.id))
    if runtime.local_process_count() > 1:  # replicas of launch, one device each
        backing = devices[: runtime.global_device_count()]
    else:  # each process's own xla devices: all of its devices, or its first under SPMD
        per_process = runtime.addressable_device_count()
        backing = [d for d in devices if _local_position(d, devices) < per_process]
    return [_runtime_name(d) for d in backing]


def _local_position(device: jax.Device, devices: list) -> int:
    """Where ``device`` stands among its process's devices (``devices``: sorted)."""
    same = [d for d in devices if d.process_index == device.process_index]
    return same.index(device)


def _xla_get_runtime_devices() -> list[str]:
    """This process's accelerators, ``['CPU:0', ..., 'CPU:7']``: the devices its mesh shards
    span (``XLAShard.shard_device`` names).

    Example:
        >>> len(_xla_get_runtime_devices()) == xr.addressable_runtime_device_count()
        True
    """
    return [_runtime_name(d) for d in sorted(jax.local_devices(), key=lambda d: d.id)]


def _xla_get_all_runtime_devices() -> list[str]:
    """Every accelerator of the job, all hosts' (``xr.global_runtime_device_count()`` of them).

    Example:
        >>> _xla_get_all_runtime_devices()[:2]
        ['CPU:0', 'CPU:1']
    """
    return [_runtime_name(d) for d in sorted(jax.devices(), key=lambda d: d.id)]


def _runtime_name(device: jax.Device) -> str:
    return f"{runtime.device_type()}:{device.id}"  # as xr.global_runtime_device_attributes


def _xla_num_devices() -> int:
    """The number of xla devices of this process (``xr.addressable_device_count()``).

    Example:
        >>> _xla_num_devices()  # 4 CPU devices, no SPMD
        4
    """
    return runtime.addressable_device_count()


def _xla_num_runtime_devices() -> int:
    """The number of accelerators of this process (``xr.addressable_runtime_device_count()``).

    Example:
        >>> _xla_num_runtime_devices()
        8
    """
    return runtime.addressable_runtime_device_count()


def _xla_real_devices(devices: Sequence[str | torch.device] | None = None) -> list[str]:
    """The real device behind each given xla device (default: this process's), e.g.
    ``['CPU:0']`` for ``['xla:0']`` (``xr.xla_real_devices``).

    Example:
        >>> _xla_real_devices(['xla:0'])
        ['CPU:0']
    """
    return runtime.xla_real_devices(list(devices) if devices else None)


# --- RNG, matmul precision, counters -------------------------------------------------------------


def _xla_get_rng_seed(device: str = "") -> int:
    """The device RNG state (``xm.get_rng_state``): a seed given to :func:`_xla_set_rng_seed`
    until a random op advances it.

    Example:
        >>> _xla_set_rng_seed(7)
        >>> _xla_get_rng_seed()
        7
    """
    return xm.get_rng_state(device or None)


def _xla_set_rng_seed(seed: int = 101, device: str = "") -> None:
    """Set the device RNG state (``xm.set_rng_state``); 101 by default, as PyTorch/XLA.

    Example:
        >>> _xla_set_rng_seed(7)
    """
    xm.set_rng_state(seed, device or None)


def _xla_get_mat_mul_precision() -> str:
    """The float32 matmul precision: ``'default'``, ``'high'`` or ``'highest'``.

    Example:
        >>> _xla_get_mat_mul_precision()
        'highest'
    """
    return config.MAT_MUL_PRECISION.value


def _xla_set_mat_mul_precision(precision: str) -> None:
    """Set the float32 matmul precision of the programs traced from now on (what
    ``spmd_torch.backends.set_mat_mul_precision`` sets, without its warning).

    Example:
        >>> _xla_set_mat_mul_precision('highest')
    """
    if precision not in _PRECISIONS:
        raise RuntimeError(
            f"_xla_set_mat_mul_precision: unknown precision {precision!r}; "
            f"use one of {', '.join(_PRECISIONS)}"
        )
    config.MAT_MUL_PRECISION.value = precision


def _xla_increment_counter(name: str, value: int) -> None:
    """Add ``value`` to counter ``name`` of the metrics (a counter of the user's own included).

    Example:
        >>> _xla_increment_counter('MyEvents', 2)
        >>> met.counter_value('MyEvents')
        2
    """
    if value < 0:
        raise RuntimeError(f"_xla_increment_counter({name!r}, {value}): counters only grow")
    counters.bump(name, int(value))


def _get_git_revs() -> dict[str, str]:
    """The source revisions this runtime is built from: ``'xla'`` the jaxlib build that carries
    the XLA compiler running the programs, ``'jax'`` and ``'torch'``.

    Example:
        >>> sorted(_get_git_revs())
        ['jax', 'torch', 'xla']
    """
    return {
        "xla": jaxlib.version._git_hash or f"jaxlib {jaxlib.version.__version__}",
        "jax": jax.version._git_hash or f"jax {jax.__version__}",
        "torch": torch.version.git_version,
    }
