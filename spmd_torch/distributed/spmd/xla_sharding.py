"""torch_xla.distributed.spmd.xla_sharding: annotate xla tensors with a mesh and a partition spec.

``mark_sharding`` maps (mesh, spec) once to a ``jax.sharding.NamedSharding`` and hands only that
to the engine: data is laid out on the mesh right away, a pending value gets an in-graph sharding
constraint, and the tensor keeps the sharding across in-place updates.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from jax.sharding import NamedSharding

from spmd_torch import runtime
from spmd_torch._lazy import manual, placement

from . import validate
from ._tiling import ShardingType, Tiling, tiling_of
from .mesh import (
    HybridMesh,
    Mesh,
    PartitionSpecLike,
    get_1d_mesh,
    get_global_mesh,
    named_sharding,
    set_global_mesh,
    translate_spec,
)
from .xla_sharded_tensor import XLAShard, XLAShardedTensor

__all__ = [
    "HybridMesh",
    "Mesh",
    "ShardingSpec",
    "ShardingType",
    "XLAShard",
    "XLAShardedTensor",
    "clear_sharding",
    "disable_manual_sharding",
    "enable_manual_sharding",
    "get_1d_mesh",
    "get_global_mesh",
    "get_xla_sharding_spec",
    "mark_sharding",
    "set_global_mesh",
    "unwrap_sharded_tensor",
    "wrap_as_sharded_tensor",
    "wrap_if_sharded",
]


def mark_sharding(
    t: torch.Tensor | XLAShardedTensor, mesh: Mesh, partition_spec: PartitionSpecLike
) -> XLAShardedTensor:
    """Shard ``t`` over ``mesh`` as ``partition_spec`` says; ``t`` itself carries the sharding.

    Data already on the device is laid out on the mesh at once (padded at the end of each
    dimension when a dimension does not divide evenly); a pending value is constrained inside
    the graph. The sharding stays with ``t`` across in-place updates (parameters, optimizer
    state). Turns SPMD on (``spmd_torch.runtime.use_spmd()``) if it is not yet.

    Args:
        t: A tensor on the xla device (or an XLAShardedTensor wrapping one); not a view.
        mesh: The device mesh; it spans every device.
        partition_spec: One entry per dimension of ``t``: a mesh axis index, an axis name, a
            tuple of them (the dimension is split over all of them, the first one major), or
            None (replicated along that dimension).

    Returns:
        ``t`` wrapped as an XLAShardedTensor (the return value may be ignored).

    Example:
        >>> mesh = xs.Mesh(np.arange(8), (4, 2), ('data', 'model'))
        >>> x = torch.randn(8, 32).to(spmd_torch.device())
        >>> xs.mark_sharding(x, mesh, ('data', None))  # 4-way data parallel, 2-way replicated
        >>> xs.get_xla_sharding_spec(x)
        '{devices=[4,1,2]0,1,2,3,4,5,6,7 last_tile_dim_replicate}'
    """
    tensor = unwrap_sharded_tensor(t)
    validate._check_xla_tensor(tensor, "mark_sharding")
    validate._check_mesh(mesh)
    validate._check_spec_container(partition_spec)
    validate._check_spec_rank(tuple(tensor.shape), tuple(partition_spec))
    sharding = named_sharding(mesh, partition_spec)
    if not runtime.is_spmd():
        runtime.use_spmd()
    placement.mark(tensor, sharding)
    return wrap_as_sharded_tensor(t)


def enable_manual_sharding(
    t: torch.Tensor | XLAShardedTensor,
    partition_spec: PartitionSpecLike,
    *,
    mesh: Mesh | None = None,
) -> XLAShardedTensor:
    """Shard ``t`` as ``partition_spec`` says and hand each device its own shard to work on.

    The result has the shape of one shard. Ops on it, and on everything computed from it, run
    on every device separately with no sharding propagation (a hand-partitioned region, as in
    ``jax.shard_map``), until :func:`disable_manual_sharding` assembles a full tensor again. A
    shard cannot be read or kept past a barrier on its own: pass it through
    ``disable_manual_sharding`` first. Shards must be even.

    Args:
        t: A tensor on the xla device.
        partition_spec: As for :func:`mark_sharding`.
        mesh: The device mesh; the global mesh when omitted.

    Example:
        >>> mesh = xs.get_1d_mesh('x')
        >>> local = xs.enable_manual_sharding(x, ('x', None)).global_tensor  # [8, 4] -> [1, 4]
        >>> y = xs.disable_manual_sharding(local * 2, ('x', None), x.shape)
    """
    mesh = _mesh_or_global(mesh, "enable_manual_sharding")
    tensor = unwrap_sharded_tensor(mark_sharding(t, mesh, partition_spec))
    return wrap_as_sharded_tensor(_ToShards.apply(tensor, named_sharding(mesh, partition_spec)))


def disable_manual_sharding(
    t: torch.Tensor | XLAShardedTensor,
    partition_spec: PartitionSpecLike,
    full_shape: tuple | torch.Size,
    *,
    mesh: Mesh | None = None,
) -> XLAShardedTensor:
    """The full tensor of ``full_shape`` whose shards are each device's ``t``, sharded so.

    Args:
        t: A per-device shard from a region opened by :func:`enable_manual_sharding`.
        partition_spec: How the shards tile the full tensor.
        full_shape: The full tensor's shape.
        mesh: The device mesh; the global mesh when omitted.

    Example:
        >>> y = xs.disable_manual_sharding(local * 2, ('x', None), (8, 4))
    """
    mesh = _mesh_or_global(mesh, "disable_manual_sharding")
    tensor = unwrap_sharded_tensor(t)
    validate._check_xla_tensor(tensor, "disable_manual_sharding")
    validate._check_spec_container(partition_spec)
    validate._check_spec_rank(tuple(full_shape), tuple(partition_spec))
    sharding = named_sharding(mesh, partition_spec)
    return wrap_as_sharded_tensor(_FromShards.apply(tensor, sharding, tuple(full_shape)))


class _ToShards(torch.autograd.Function):
    """Entering a manual region; gradients leave it the opposite way."""

    @staticmethod
    def forward(ctx, t: torch.Tensor, sharding: NamedSharding) -> torch.Tensor:
        ctx.sharding, ctx.full_shape = sharding, tuple(t.shape)
        return manual.enter(t, sharding)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple:
        return manual.leave(grad, ctx.sharding, ctx.full_shape), None


class _FromShards(torch.autograd.Function):
    """Leaving a manual region; gradients come back in as each device's shard."""

    @staticmethod
    def forward(ctx, t: torch.Tensor, sharding: NamedSharding, full_shape: tuple) -> torch.Tensor:
        ctx.sharding = sharding
        return manual.leave(t, sharding, full_shape)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple:
        return manual.enter(grad.contiguous(), ctx.sharding), None, None


def _mesh_or_global(mesh: Mesh | None, api: str) -> Mesh:
    mesh = get_global_mesh() if mesh is None else mesh
    if mesh is None:
        raise ValueError(f"{api}: no mesh given and no global mesh set (xs.set_global_mesh)")
    return mesh


def clear_sharding(t: torch.Tensor | XLAShardedTensor) -> torch.Tensor:
    """Forget ``t``'s sharding annotation; later values are laid out by the partitioner.

    Args:
        t: A tensor on the xla device, or an XLAShardedTensor.

    Returns:
        The (unwrapped) tensor itself.

    Example:
        >>> xs.mark_sharding(x, xs.get_1d_mesh(), (0, None))
        >>> x = xs.clear_sharding(x)
    """
    tensor = unwrap_sharded_tensor(t)
    validate._check_xla_tensor(tensor, "clear_sharding")
    placement.clear(tensor)
    return tensor


def get_xla_sharding_spec(t: torch.Tensor | XLAShardedTensor) -> str:
    """The tensor's sharding as XLA prints it (``torch_xla._XLAC._get_xla_sharding_spec``).

    ``'{devices=[8,1]0,1,2,3,4,5,6,7}'`` for a tiled sharding (tiles per dimension, then the
    device ids in tile order), ``'{devices=[4,1,2]... last_tile_dim_replicate}'`` when each tile
    is replicated over a group of devices, ``'{replicated}'``, or ``''`` for a tensor without
    sharding. The device list is always written out in full (never XLA's ``<=[8]``).

    Args:
        t: A tensor on the xla device, or an XLAShardedTensor.

    Example:
        >>> xs.mark_sharding(x, xs.get_1d_mesh(), (0, None))
        >>> xs.get_xla_sharding_spec(x)
        '{devices=[8,1]0,1,2,3,4,5,6,7}'
    """
    tiling = _annotated_tiling(unwrap_sharded_tensor(t), "get_xla_sharding_spec")
    return "" if tiling is None else tiling.text()


def _annotated_tiling(tensor: torch.Tensor, api: str) -> Tiling | None:
    """The tiling of the tensor's sharding; None when it has none of its own.

    Data that merely sits on one device, or replicated on every device as SPMD mode uploads
    it, is unsharded, as PyTorch/XLA reports such tensors.
    """
    validate._check_xla_tensor(tensor, api)
    sharding = placement.sharding_of(tensor)
    if sharding is None or sharding.num_devices == 1 and not isinstance(sharding, NamedSharding):
        return None
    if sharding == placement.default_sharding():
        return None
    return tiling_of(sharding, tensor.dim())


def wrap_as_sharded_tensor(t: torch.Tensor | XLAShardedTensor) -> XLAShardedTensor:
    """``t`` as an XLAShardedTensor (itself when it already is one).

    Args:
        t: A tensor on the xla device, or an XLAShardedTensor.

    Example:
        >>> xs.wrap_as_sharded_tensor(x).global_tensor is x
        True
    """
    return t if isinstance(t, XLAShardedTensor) else XLAShardedTensor(t)


def unwrap_sharded_tensor(t: torch.Tensor | XLAShardedTensor) -> torch.Tensor:
    """The tensor an XLAShardedTensor wraps (``t`` itself otherwise).

    Args:
        t: A tensor, or an XLAShardedTensor.

    Example:
        >>> xs.unwrap_sharded_tensor(xs.mark_sharding(x, mesh, (0, None))) is x
        True
    """
    return t.global_tensor if isinstance(t, XLAShardedTensor) else t


def wrap_if_sharded(x: Any) -> Any:
    """An XLAShardedTensor around ``x`` if it is a sharded xla tensor; ``x`` otherwise.

    Args:
        x: Anything.

    Example:
        >>> isinstance(xs.wrap_if_sharded(x), xs.XLAShardedTensor)
        True
    """
    if (
        isinstance(x, torch.Tensor)
        and x.device.type == "xla"
        and _annotated_tiling(x, "wrap_if_sharded") is not None
    ):
        return XLAShardedTensor(x)
    return x


@dataclass(frozen=True)
class ShardingSpec:
    """A reusable (mesh, partition spec) pair, e.g. for the inputs a data loader shards.

    Frozen and hashable. Validated against the mesh when built; maps once, through a cache, to a
    ``jax.sharding.NamedSharding`` (:attr:`sharding`).

    Args:
        mesh: The device mesh.
        partition_spec: One entry per tensor dimension (see :func:`mark_sharding`).
        minibatch: The tensors are per-host minibatches of a global batch sharded along the
            first dimension (PyTorch/XLA's data loader flag). On one process the local batch
            is the global batch, so it changes nothing there.

    Example:
        >>> spec = xs.ShardingSpec(xs.get_1d_mesh('data'), ('data', None))
        >>> spec.sharding.spec
        PartitionSpec('data', None)
        >>> spec.apply(x)  # same as xs.mark_sharding(x, spec.mesh, spec.partition_spec)
    """

    mesh: Mesh
    partition_spec: tuple
    minibatch: bool = False

    def __post_init__(self) -> None:
        validate._check_mesh(self.mesh)
        validate._check_spec_container(self.partition_spec)
        spec = tuple(tuple(e) if isinstance(e, list) else e for e in self.partition_spec)
        translate_spec(self.mesh, spec)
        object.__setattr__(self, "partition_spec", spec)
        object.__setattr__(self, "minibatch", bool(self.minibatch))

    @property
    def sharding(self) -> NamedSharding:
        """The ``jax.sharding.NamedSharding`` of this spec (cached per mesh and spec)."""
        return named_sharding(self.mesh, self.partition_spec)

    @property
    def sharding_type(self) -> ShardingType:
        """TILED, PARTIAL or REPLICATED, as PyTorch/XLA classifies the spec."""
        return tiling_of(self.sharding, len(self.partition_spec)).type

    def can_apply(self, t: torch.Tensor) -> bool:
        """Whether the spec fits ``t``: one entry per dimension.

        Args:
            t: Any tensor.
        """
        return len(t.shape) == len(self.partition_spec)

    def apply(self, t: torch.Tensor) -> None:
        """Mark ``t`` with this spec (:func:`mark_sharding`).

        Args:
            t: A tensor on the xla device.
        """
        mark_sharding(t, self.mesh, self.partition_spec)

    def xla_spec(self, t: torch.Tensor) -> NamedSharding | None:
        """The sharding to give ``t``, or None if the spec does not fit it.

        PyTorch/XLA returns its C++ ``XlaShardingSpec`` here; the equivalent is the jax
        sharding that the engine and data loaders place data with.

        Args:
            t: Any tensor.
        """
        return self.sharding if self.can_apply(t) else None
