"""PyTorch/XLA's SPMD planners for ``torch.distributed.checkpoint`` (DCP): sharded xla tensors in
DCP's own checkpoint format, saved and loaded from one process.

Saving writes each distinct shard of an xla tensor once (replicas skipped, so a replicated tensor
is one chunk), cropped to the logical shape (uneven shardings are padded on device) and downloaded
only when the storage writer asks for it; a write item's ``index.index`` is its shard's place in
``local_shards``. The ``_CpuShards`` of ``_sharded_cpu_state_dict`` (a state dict staged on the
host) are written the same way. Both planners expose PyTorch/XLA's split of the flattened state
dict: ``sharded_state_dict`` (split over several devices) and ``unsharded_state_dict``. Loading fills the target state dict in place and each
xla tensor keeps its current layout: its distinct shards read only the checkpoint chunks they
overlap, whatever layout the tensor was saved with, into CPU buffers, and the tensor is written
once all of them are in. CPU tensors and Python values take DCP's default path. Every key and
shape is checked before anything is read, so a mismatch leaves the target untouched.

DCP runs without a process group when none is initialised (it warns that it does). One process
owns every device here, so no plan needs deduplicating across ranks.
"""

from __future__ import annotations

import dataclasses
import io
import math
from collections import ChainMap
from typing import Any, NamedTuple

import jax
import numpy as np
import torch
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.default_planner import (
    create_default_global_load_plan,
    create_default_global_save_plan,
    create_default_local_load_plan,
    create_default_local_save_plan,
)
from torch.distributed.checkpoint.metadata import (
    STATE_DICT_TYPE,
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
)
from torch.distributed.checkpoint.planner import (
    LoadPlan,
    LoadPlanner,
    ReadItem,
    SavePlan,
    SavePlanner,
    TensorWriteData,
    WriteItem,
    WriteItemType,
)
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list
from torch.distributed.checkpoint.utils import find_state_dict_object

from spmd_torch import _barrier
from spmd_torch._lazy import execute, placement, transfer
from spmd_torch._lazy.layout import even_part, padded_shape
from spmd_torch._lazy.tensor import LazyTensor
from spmd_torch.distributed.spmd import xla_sharding as xs
from spmd_torch.distributed.spmd._tiling import device_index
from spmd_torch.distributed.spmd.xla_sharded_tensor import XLAShardedTensor

from ._helpers import (
    FLATTEN_MAPPING,
    _CpuShards,
    _is_sharded_tensor,
    _unwrap_xla_sharded_tensor,
    flatten_state_dict,
)

__all__ = ["SPMDLoadPlanner", "SPMDSavePlanner"]


class SPMDSavePlanner(SavePlanner):
    """DCP's save planner for state dicts holding xla tensors, sharded or not, or ``_CpuShards``.

    Each distinct shard of an xla tensor becomes one write item, replicas written once (a
    replicated tensor is one plain tensor), copied to the host when the storage writer resolves
    it; a write item's ``index.index`` is the position of its shard in ``local_shards``. The
    ``_CpuShards`` of ``_sharded_cpu_state_dict`` are written the same way from their host
    copies. CPU tensors and Python values are planned by DCP's default logic. Nested state dicts
    are flattened as ``DefaultSavePlanner`` flattens them and the mapping is kept in the
    checkpoint's metadata.

    Attributes (after ``set_up_planner``, keyed by flattened key, as in PyTorch/XLA):
        sharded_state_dict: The tensors split over several devices: ``XLAShardedTensor`` (tiled
            or partially replicated) and ``_CpuShards``.
        unsharded_state_dict: Everything else (replicated and single-device xla tensors among
            them, unwrapped).

    Example:
        >>> import torch.distributed.checkpoint as dist_cp
        >>> import spmd_torch.experimental.distributed_checkpoint as xc
        >>> state = {"model": model.state_dict(), "optim": opt.state_dict()}
        >>> dist_cp.save(
        ...     state,
        ...     storage_writer=dist_cp.FileSystemWriter("/tmp/ckpt"),
        ...     planner=xc.SPMDSavePlanner(),
        ... )
    """

    def __init__(self) -> None:
        self.is_coordinator = False
        self.mappings: FLATTEN_MAPPING = {}
        self.sharded_state_dict: dict[str, XLAShardedTensor | _CpuShards] = {}
        self.unsharded_state_dict: dict[str, Any] = {}
        # xla tensors by flattened key: the tensor, its device array (padded when uneven) and
        # its distinct shards by local shard index.
        self._xla: dict[str, tuple[LazyTensor, jax.Array, dict[int, _Shard]]] = {}
        # Everything else that is no _CpuShards, planned and resolved by DCP's default logic.
        self._default: dict[str, Any] = {}

    def set_up_planner(
        self,
        state_dict: STATE_DICT_TYPE,
        storage_meta: StorageMeta | None = None,
        is_coordinator: bool = False,
    ) -> None:
        """Flatten ``state_dict``, split it into sharded and unsharded entries and compute its
        xla tensors (one program, as at a barrier)."""
        if isinstance(storage_meta, bool):  # PyTorch/XLA's signature: (state_dict, is_coordinator)
            storage_meta, is_coordinator = None, storage_meta
        self.is_coordinator = is_coordinator
        _barrier.barrier()
        flat, self.mappings = flatten_state_dict(state_dict)
        self.sharded_state_dict, self.unsharded_state_dict = _separate(flat, _CpuShards)
        tensors = {key: _xla_tensor(value) for key, value in flat.items()}
        xla = {key: t for key, t in tensors.items() if t is not None}
        self._xla = {}
        for (key, t), array in zip(xla.items(), execute.materialize(list(xla.values()))):
            shards = _distinct_shards(array.sharding, tuple(array.shape), tuple(t.shape))
            self._xla[key] = (t, array, shards)
        self._default = {
            key: value
            for key, value in self.unsharded_state_dict.items()
            if key not in xla and not isinstance(value, _CpuShards)
        }

    def create_local_plan(self) -> SavePlan:
        plan = create_default_local_save_plan(self._default, self.is_coordinator)
        for key, (t, _, shards) in self._xla.items():
            plan.items.extend(_write_items(key, t, shards))
        for key, value in self.sharded_state_dict.items():
            if isinstance(value, _CpuShards):
                plan.items.extend(_cpu_shards_write_items(key, value))
        return dataclasses.replace(plan, planner_data=self.mappings)

    def create_global_plan(self, all_plans: list[SavePlan]) -> tuple[list[SavePlan], Metadata]:
        # Index hints are kept: a shard's ``index.index`` names its local shard in resolve_data.
        plans, metadata = create_default_global_save_plan(all_plans, rewrite_index_hints=False)
        mappings = dict(ChainMap(*(plan.planner_data for plan in plans)))
        return plans, dataclasses.replace(metadata, planner_data=mappings)

    def finish_plan(self, new_plan: SavePlan) -> SavePlan:
        return new_plan

    def resolve_data(self, write_item: WriteItem) -> torch.Tensor | io.BytesIO:
        """The item's data on the host: an xla tensor's shard is downloaded now, cropped."""
        key = write_item.index.fqn
        entry = self._xla.get(key)
        if entry is not None:
            t, array, shards = entry
            shard = shards[write_item.index.index]
            (data,) = (s.data for s in array.addressable_shards if s.device == shard.device)
            return transfer.to_torch(data, t.dtype, tuple(shard.chunk.sizes))
        cpu_shards = self.sharded_state_dict.get(key)
        if isinstance(cpu_shards, _CpuShards):
            return cpu_shards.shards[write_item.index.index].unpadded_data
        value = find_state_dict_object(self._default, write_item.index)
        if write_item.type == WriteItemType.BYTE_IO:
            buffer = io.BytesIO()
            torch.save(value, buffer)
            return buffer
        return value


class SPMDLoadPlanner(LoadPlanner):
    """DCP's load planner filling a state dict of xla tensors in place, each in its current layout.

    Each xla tensor's distinct shards read only the checkpoint chunks they overlap, into CPU
    buffers (resharding from whatever layout the tensor was saved with); when all of a tensor's
    reads are in, the buffers become one device array in the tensor's layout, written in place
    (through ``detach()`` aliases, so ``model.state_dict()`` entries update the parameters). CPU
    tensors are copied into and Python values replaced by DCP's default logic. Every key and shape
    is checked before anything is read.

    Attributes (after ``set_up_planner``, keyed by flattened key, as in PyTorch/XLA):
        sharded_state_dict: The xla tensors split over several devices (tiled or partially
            replicated), as ``XLAShardedTensor``.
        unsharded_state_dict: Everything else (replicated and single-device xla tensors among
            them, unwrapped).

    Raises (``dist_cp.load`` reports them wrapped in a ``CheckpointException``, by rank):
        RuntimeError: A key of the target is missing from the checkpoint.
        ValueError: A tensor's shape differs from the saved one, or a tensor meets a saved
            non-tensor value (or the other way round).

    Example:
        >>> state = {"model": model.state_dict(), "optim": opt.state_dict()}
        >>> dist_cp.load(
        ...     state,
        ...     storage_reader=dist_cp.FileSystemReader("/tmp/ckpt"),
        ...     planner=xc.SPMDLoadPlanner(),
        ... )
        >>> opt.load_state_dict(state["optim"])
    """

    def __init__(self) -> None:
        self.metadata: Metadata | None = None
        self.is_coordinator = False
        self.original_state_dict: STATE_DICT_TYPE = {}
        self.mappings: FLATTEN_MAPPING = {}
        self.sharded_state_dict: dict[str, XLAShardedTensor] = {}
        self.unsharded_state_dict: dict[str, Any] = {}
        # xla tensors by flattened key, with their shards' buffers until written.
        self._xla: dict[str, _Target] = {}
        # Everything else, planned and filled by DCP's default logic.
        self._default: dict[str, Any] = {}

    def set_up_planner(
        self,
        state_dict: STATE_DICT_TYPE,
        metadata: Metadata | None = None,
        is_coordinator: bool = False,
    ) -> None:
        """Flatten ``state_dict``; its xla tensors' values become data, so their layouts are known."""
        self.metadata = metadata
        self.is_coordinator = is_coordinator
        self.original_state_dict = state_dict
        _barrier.barrier()
        flat, self.mappings = flatten_state_dict(state_dict)
        self.sharded_state_dict, self.unsharded_state_dict = _separate(flat)
        self._xla, self._default = {}, {}
        for key, value in flat.items():
            t = _xla_tensor(value)
            if t is None:
                self._default[key] = value
            else:
                self._xla[key] = _Target(key, t)

    def create_local_plan(self) -> LoadPlan:
        """The reads, once every key and shape of the target is checked against the metadata."""
        saved = self.metadata.state_dict_metadata
        for key, value in self._default.items():
            _check_entry(key, value, saved)
        for key, target in self._xla.items():
            _check_entry(key, target.tensor, saved)
        plan = create_default_local_load_plan(self._default, self.metadata)
        for key, target in self._xla.items():
            reads = create_read_items_for_chunk_list(key, saved[key], list(target.chunks.values()))
            covered = sum(math.prod(read.lengths) for read in reads)
            if covered != target.pending:
                raise ValueError(
                    f"checkpoint key {key!r}: its saved chunks cover {covered} of the "
                    f"{target.pending} elements the target of shape {tuple(target.tensor.shape)} "
                    "needs (an incomplete checkpoint?)"
                )
            plan.items.extend(reads)
        return plan

    def create_global_plan(self, global_plan: list[LoadPlan]) -> list[LoadPlan]:
        return create_default_global_load_plan(global_plan)

    def finish_plan(self, central_plan: LoadPlan) -> LoadPlan:
        return central_plan

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        set_element(
            self.original_state_dict,
            self.mappings[read_item.dest_index.fqn],
            torch.load(value, weights_only=False),
        )

    def resolve_tensor(self, read_item: ReadItem) -> torch.Tensor:
        """Where the storage reader copies the item: part of a CPU tensor of the target, or of
        an xla tensor's shard buffer (``dest_offsets`` are relative to the shard)."""
        index = read_item.dest_index
        target = self._xla.get(index.fqn)
        if target is None:
            tensor = find_state_dict_object(self._default, index)
        else:
            tensor = target.buffer(index.offset)
        return _narrow(tensor, read_item.dest_offsets, read_item.lengths)

    def commit_tensor(self, read_item: ReadItem, tensor: torch.Tensor) -> None:
        """Count an xla tensor's read; with the last one in, write the tensor in place."""
        key = read_item.dest_index.fqn
        target = self._xla.get(key)
        if target is None:
            return
        target.pending -= math.prod(read_item.lengths)
        if target.pending == 0:
            placement.assign(target.tensor, target.array())
            del self._xla[key]


class _Shard(NamedTuple):
    """A distinct shard of an xla tensor: its chunk of the logical tensor, and the device whose
    copy is saved."""

    chunk: ChunkStorageMetadata
    device: jax.Device


def _distinct_shards(sharding, padded: tuple, shape: tuple) -> dict[int, _Shard]:
    """The distinct shards of an array of (padded) shape laid out as ``sharding``, clipped to
    the logical ``shape``, by the position of their device in ``local_shards`` (device order):
    replicas once (the first device holding the shard), shards holding only padding left out."""
    index = device_index()
    placed = sorted(sharding.devices_indices_map(padded).items(), key=lambda i: index[i[0].id])
    shards: dict[int, _Shard] = {}
    seen: set = set()
    for position, (device, slices) in enumerate(placed):
        bounds = [s.indices(n)[:2] for s, n in zip(slices, padded)]
        offsets = torch.Size(min(start, n) for (start, _), n in zip(bounds, shape))
        sizes = torch.Size(min(stop, n) - o for (_, stop), n, o in zip(bounds, shape, offsets))
        if offsets not in seen:
            seen.add(offsets)
            shards[position] = _Shard(ChunkStorageMetadata(offsets, sizes), device)
    kept = {k: s for k, s in shards.items() if math.prod(s.chunk.sizes)}
    return kept or shards  # an empty tensor: its one empty chunk


def _write_items(key: str, t: LazyTensor, shards: dict[int, _Shard]) -> list[WriteItem]:
    """One write item per distinct shard, ``index.index`` its local shard; a tensor held whole
    (replicated, one device) is written as a plain tensor, as DCP's default planner writes one."""
    properties = TensorProperties(dtype=t.dtype, requires_grad=t.requires_grad)
    whole = len(shards) == 1
    return [
        WriteItem(
            index=MetadataIndex(key, shard.chunk.offsets, k),
            type=WriteItemType.TENSOR if whole else WriteItemType.SHARD,
            tensor_data=TensorWriteData(chunk=shard.chunk, properties=properties, size=t.shape),
        )
        for k, shard in shards.items()
    ]


def _cpu_shards_write_items(key: str, cpu: _CpuShards) -> list[WriteItem]:
    """One write item per distinct shard of host shards, ``index.index`` its position in
    ``cpu.shards`` (replicas and shards of padding left out, as for an xla tensor)."""
    shape = torch.Size(cpu.global_shape)
    chunks: dict[int, ChunkStorageMetadata] = {}
    seen: set = set()
    for k, shard in enumerate(cpu.shards):
        if shard.indices is Ellipsis:
            offsets, sizes = torch.Size([0] * len(shape)), shape
        else:
            offsets = torch.Size(s.start for s in shard.indices)
            sizes = torch.Size(s.stop - s.start for s in shard.indices)
        if offsets not in seen:
            seen.add(offsets)
            chunks[k] = ChunkStorageMetadata(offsets, sizes)
    kept = {k: c for k, c in chunks.items() if math.prod(c.sizes)} or chunks
    return [
        WriteItem(
            index=MetadataIndex(key, chunk.offsets, k),
            type=WriteItemType.SHARD,
            tensor_data=TensorWriteData(
                chunk=chunk,
                properties=TensorProperties.create_from_tensor(cpu.shards[k].unpadded_data),
                size=shape,
            ),
        )
        for k, chunk in kept.items()
    ]


def _separate(flat: dict, *keep: type) -> tuple[dict, dict]:
    """PyTorch/XLA's split of a flat state dict: tensors split over several devices (as
    ``XLAShardedTensor``, or of the ``keep`` types), and everything else, unwrapped."""
    sharded, unsharded = {}, {}
    for key, value in flat.items():
        wrapped = xs.wrap_if_sharded(value)
        if _is_sharded_tensor(wrapped) or isinstance(value, keep):
            sharded[key] = value if isinstance(value, keep) else wrapped
        else:
            unsharded[key] = _unwrap_xla_sharded_tensor(value)
    return sharded, unsharded


def _xla_tensor(value: Any) -> LazyTensor | None:
    if isinstance(value, XLAShardedTensor):
        value = value.global_tensor
    return value if isinstance(value, LazyTensor) else None


class _Target:
    """An xla tensor being loaded: its distinct shards' chunks, a CPU buffer for each (made at
    its first read), and how many elements are still to be read."""

    __slots__ = ("tensor", "layout", "chunks", "buffers", "pending")

    def __init__(self, key: str, tensor: LazyTensor) -> None:
        layout = placement.layout_of(tensor)
        if layout is None:
            raise RuntimeError(
                f"checkpoint key {key!r}: the xla tensor of shape {tuple(tensor.shape)} has no "
                "value to take a layout from (a result of a manual sharding region? leave it "
                "first)"
            )
        shape = tuple(tensor.shape)
        shards = _distinct_shards(layout, padded_shape(shape, layout), shape)
        self.tensor = tensor
        self.layout = layout
        self.chunks = {shard.chunk.offsets: shard.chunk for shard in shards.values()}
        self.buffers: dict[torch.Size, torch.Tensor] = {}
        self.pending = sum(math.prod(chunk.sizes) for chunk in self.chunks.values())

    def buffer(self, offsets: torch.Size) -> torch.Tensor:
        buffer = self.buffers.get(offsets)
        if buffer is None:
            sizes = self.chunks[offsets].sizes
            buffer = self.buffers[offsets] = torch.empty(sizes, dtype=self.tensor.dtype)
        return buffer

    def array(self) -> jax.Array:
        """The read value as a device array of the logical shape: each device receives its block
        of the buffers, in the tensor's layout (uneven dimensions replicated, see
        ``layout.even_part``; ``placement.assign`` pads them back)."""
        blocks = [(self.chunks[o], transfer.host_copy(b)) for o, b in self.buffers.items()]
        shape = tuple(self.tensor.shape)
        return jax.make_array_from_callback(
            shape, even_part(self.layout, shape), lambda index: _assemble(index, shape, blocks)
        )


def _assemble(index: tuple, shape: tuple, blocks: list) -> np.ndarray:
    """The region ``index`` of the tensor from the chunks' host blocks that cover it (one block
    as is when the region is exactly that chunk)."""
    bounds = [s.indices(n)[:2] for s, n in zip(index, shape)]
    starts = torch.Size(start for start, _ in bounds)
    sizes = torch.Size(stop - start for start, stop in bounds)
    region = None
    for chunk, block in blocks:
        if chunk.offsets == starts and chunk.sizes == sizes:
            return block
        lo = [max(start, o) for (start, _), o in zip(bounds, chunk.offsets)]
        hi = [min(stop, o + n) for (_, stop), o, n in zip(bounds, chunk.offsets, chunk.sizes)]
        if any(a >= b for a, b in zip(lo, hi)):
            continue
        if region is None:
            region = np.empty(sizes, dtype=block.dtype)
        into = tuple(slice(a - s, b - s) for a, b, s in zip(lo, hi, starts))
        region[into] = block[tuple(slice(a - o, b - o) for a, b, o in zip(lo, hi, chunk.offsets))]
    return region


def _check_entry(key: str, value: Any, saved: dict) -> None:
    """Raise unless the checkpoint holds ``key`` as the kind and shape of ``value``."""
    md = saved.get(key)
    tensor = isinstance(value, torch.Tensor)
    shape = tuple(value.shape) if tensor else None
    if md is None:
        held = f"a tensor of shape {shape}" if tensor else f"a {type(value).__name__}"
        raise RuntimeError(
            f"Missing key in checkpoint state_dict: {key!r} (the target holds {held} there; "
            f"the checkpoint has {len(saved)} keys); nothing was loaded"
        )
    if isinstance(md, BytesStorageMetadata):
        if tensor:
            raise ValueError(
                f"checkpoint key {key!r} holds a non-tensor value; the target holds a tensor of "
                f"shape {shape}; nothing was loaded"
            )
        return
    if not tensor:
        raise ValueError(
            f"checkpoint key {key!r} holds a tensor of shape {tuple(md.size)}; the target holds "
            f"a {type(value).__name__}; nothing was loaded"
        )
    if tuple(md.size) != shape:
        raise ValueError(
            f"checkpoint key {key!r} holds a tensor of shape {tuple(md.size)}; the target's has "
            f"shape {shape}; nothing was loaded"
        )


def _narrow(tensor: torch.Tensor, offsets, lengths) -> torch.Tensor:
    """A view of ``tensor``'s box at ``offsets`` of size ``lengths``."""
    return tensor[tuple(slice(o, o + n) for o, n in zip(offsets, lengths))]
