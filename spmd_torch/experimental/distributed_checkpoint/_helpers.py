"""torch_xla.experimental.distributed_checkpoint._helpers: state-dict helpers of the DCP planners.

``_sharded_cpu_state_dict`` copies a state dict of xla tensors to the host, keeping each sharded
tensor as its per-device shards (``_CpuShards``) instead of assembling it, as PyTorch/XLA's
asynchronous checkpointing stages a step's state. The state-dict walks (``flatten_state_dict``,
``set_element``, ``unflatten_state_dict``, ``dedup_tensors``) are ``torch.distributed.checkpoint``'s,
with ``_CpuShards`` counted as tensors so that collections of them are flattened too.

Example:
    >>> from spmd_torch.experimental.distributed_checkpoint._helpers import (
    ...     _CpuShards, _sharded_cpu_state_dict)
    >>> xs.mark_sharding(model.fc1.weight, mesh, (0, 1))
    >>> cpu = _sharded_cpu_state_dict(model.state_dict())
    >>> isinstance(cpu['fc1.weight'], _CpuShards), cpu['fc1.bias'].device
    (True, device(type='cpu'))
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch.distributed.checkpoint._dedup_tensors import dedup_tensors
from torch.distributed.checkpoint._nested_dict import FLATTEN_MAPPING, unflatten_state_dict
from torch.distributed.checkpoint._traverse import (
    OBJ_PATH,
    STATE_DICT_ITEM,
    set_element,
    traverse_state_dict,
)
from torch.distributed.checkpoint.metadata import STATE_DICT_TYPE

from spmd_torch._lazy import execute
from spmd_torch.distributed.spmd import xla_sharding as xs
from spmd_torch.distributed.spmd.xla_sharded_tensor import XLAShard, XLAShardedTensor

__all__ = [
    "FLATTEN_MAPPING",
    "OBJ_PATH",
    "STATE_DICT_ITEM",
    "_CpuShards",
    "_cpu_shards_from_tensors",
    "_is_sharded_tensor",
    "_keep_visiting_tensors",
    "_sharded_cpu_state_dict",
    "_unwrap_xla_sharded_tensor",
    "dedup_tensors",
    "flatten_state_dict",
    "narrow_tensor_by_index",
    "set_element",
    "unflatten_state_dict",
]

# Kinds whose data is not split across devices.
_WHOLE = (None, xs.ShardingType.REPLICATED, xs.ShardingType.MAXIMAL)


@dataclasses.dataclass
class _CpuShards:
    """A sharded tensor copied to the host as its per-device shards, not assembled.

    Attributes:
        shards: One ``XLAShard`` per device, in device order (``data`` a CPU tensor as the
            device holds it, ``unpadded_data`` without an uneven sharding's padding, ``indices``
            its place in the global tensor, ``replica_id`` 0 for one copy of each distinct
            shard).
        global_shape: The shape of the whole tensor.

    Example:
        >>> (cpu,) = _cpu_shards_from_tensors([w])
        >>> cpu.global_shape, cpu.shards[0].indices
        (torch.Size([8, 4]), [slice(0, 1, 1), slice(0, 4, 1)])
    """

    shards: list[XLAShard]
    global_shape: torch.Size


def _keep_visiting_tensors(value: STATE_DICT_ITEM) -> bool:
    """Collections holding tensors or ``_CpuShards`` are flattened; others are kept whole."""
    return isinstance(value, (torch.Tensor, _CpuShards))


def flatten_state_dict(state_dict: STATE_DICT_TYPE) -> tuple[STATE_DICT_TYPE, FLATTEN_MAPPING]:
    """A nested state dict as one flat dict keyed by dotted paths, and the path of each key.

    DCP's ``flatten_state_dict``, except that ``_CpuShards`` count as tensors (a list of them is
    flattened); ``unflatten_state_dict(flat, mapping)`` nests it back.

    Args:
        state_dict: Nested dicts and lists.

    Example:
        >>> flatten_state_dict({'model': {'w': t}, 'step': [cpu_shards]})[0].keys()
        dict_keys(['model.w', 'step.0'])
    """
    flat: STATE_DICT_TYPE = {}
    mappings: FLATTEN_MAPPING = {}

    def keep(path: OBJ_PATH, value: STATE_DICT_ITEM) -> None:
        key = ".".join(map(str, path))
        if key in flat:
            raise ValueError(
                f"flatten_state_dict: the paths {mappings[key]} and {path} both flatten to {key!r}"
            )
        flat[key] = value
        mappings[key] = path

    traverse_state_dict(state_dict, keep, _keep_visiting_tensors)
    return flat, mappings


def narrow_tensor_by_index(
    tensor: torch.Tensor, offsets: Sequence[int], sizes: Sequence[int]
) -> torch.Tensor:
    """The box of ``tensor`` at ``offsets`` of ``sizes`` (a view; dimensions kept whole are not
    narrowed).

    Example:
        >>> narrow_tensor_by_index(torch.arange(12).reshape(3, 4), (1, 0), (2, 4)).shape
        torch.Size([2, 4])
    """
    for dim, (offset, size) in enumerate(zip(offsets, sizes)):
        if size < tensor.size(dim):
            tensor = tensor.narrow(dim, offset, size)
    return tensor


def _is_sharded_tensor(x: Any) -> bool:
    """Whether ``x`` is an XLAShardedTensor whose data is split across devices (tiled or
    partially replicated), not whole on each.

    Example:
        >>> _is_sharded_tensor(xs.mark_sharding(t, mesh, (0, None)))
        True
    """
    return isinstance(x, XLAShardedTensor) and x.sharding_type not in _WHOLE


def _unwrap_xla_sharded_tensor(x: Any) -> Any:
    """The tensor an XLAShardedTensor wraps; ``x`` itself otherwise."""
    return xs.unwrap_sharded_tensor(x)


def _cpu_shards_from_tensors(tensors: list[torch.Tensor]) -> list[_CpuShards]:
    """Each xla tensor's shards copied to the host, one ``_CpuShards`` per tensor (pending values
    computed in one program first).

    Example:
        >>> [c.global_shape for c in _cpu_shards_from_tensors([w, b])]
        [torch.Size([8, 4]), torch.Size([8])]
    """
    tensors = [xs.unwrap_sharded_tensor(t) for t in tensors]
    if tensors:
        execute.materialize(tensors)
    return [_CpuShards(XLAShardedTensor(t).local_shards, t.shape) for t in tensors]


def _sharded_cpu_state_dict(state_dict: STATE_DICT_TYPE) -> STATE_DICT_TYPE:
    """``state_dict`` on the host: each sharded xla tensor as its ``_CpuShards``, every other xla
    tensor as a CPU tensor (same ``requires_grad``), the rest as it is. The xla tensors' pending
    values are computed together, in one program.

    Args:
        state_dict: Nested dicts, lists and tuples (``model.state_dict()``, an optimizer's).

    Example:
        >>> cpu = _sharded_cpu_state_dict({'model': model.state_dict()})
        >>> cpu['model']['fc1.weight'].shards[0].data.device
        device(type='cpu')
    """
    leaves, spec = pytree.tree_flatten(state_dict)
    leaves = [xs.wrap_if_sharded(x) for x in leaves]
    xla = [
        xs.unwrap_sharded_tensor(x)
        for x in leaves
        if isinstance(x, (torch.Tensor, XLAShardedTensor)) and x.device.type == "xla"
    ]
    if xla:
        execute.materialize(xla)

    def to_cpu(x: Any) -> Any:
        if _is_sharded_tensor(x):
            return _CpuShards(x.local_shards, x.global_tensor.shape)
        x = xs.unwrap_sharded_tensor(x)
        if isinstance(x, torch.Tensor) and x.device.type == "xla":
            return x.detach().cpu().requires_grad_(x.requires_grad)
        return x

    return pytree.tree_unflatten([to_cpu(x) for x in leaves], spec)
