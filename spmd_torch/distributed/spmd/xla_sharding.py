"""torch_xla.distributed.spmd.xla_sharding: annotate xla tensors with a mesh and a partition spec.

``mark_sharding`` maps (mesh, spec) once to a ``jax.sharding.NamedSharding`` and hands only that
to the engine: data is laid out on the mesh right away, a pending value gets an in-graph sharding
constraint, and the tensor keeps the sharding across in-place updates.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from typing import Any

import torch
import torch.utils._pytree as pytree
from jax.sharding import NamedSharding

from spmd_torch import runtime
from spmd_torch._lazy import dispatch, manual, placement, transfer
from spmd_torch._lazy.tensor import DEVICE as _XLA
from spmd_torch._lazy.tensor import LazyTensor, on_xla
from spmd_torch.utils.checkpoint import optimization_barrier_

from . import validate
from ._tiling import ShardingType, tiling_of
from .mesh import (
    HybridMesh,
    Mesh,
    PartitionSpecLike,
    check_mesh,
    get_1d_mesh,
    get_global_mesh,
    named_sharding,
    set_global_mesh,
    translate_spec,
)
from .xla_sharded_tensor import XLAShard, XLAShardedTensor, annotated_tiling, lay_out

__all__ = [
    "EinsumLinear",
    "HybridMesh",
    "MarkShardingFunction",
    "Mesh",
    "ShardingSpec",
    "ShardingType",
    "XLAPatchedLinear",
    "XLAShard",
    "XLAShardedTensor",
    "annotate_custom_sharding",
    "apply_backward_optimization_barrier",
    "apply_xla_patch_to_nn_linear",
    "clear_sharding",
    "disable_manual_sharding",
    "enable_manual_sharding",
    "get_1d_mesh",
    "get_global_mesh",
    "get_xla_sharding_spec",
    "mark_sharding",
    "mark_sharding_with_gradients",
    "set_global_mesh",
    "shard_as",
    "unwrap_sharded_tensor",
    "wrap_as_sharded_tensor",
    "wrap_if_sharded",
    "xla_patched_nn_linear_forward",
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
    traced = type(tensor) is not LazyTensor and getattr(tensor, "device", None) == _XLA
    if torch.compiler.is_compiling() or traced:  # a graph being traced: fake xla tensors
        ids, shape, names = mesh._key
        spec = repr(tuple(partition_spec))
        torch.ops.xla.dynamo_mark_sharding(tensor, list(ids), list(shape), repr(names), spec)
        return tensor
    lay_out(tensor, mesh, partition_spec, "mark_sharding")
    return XLAShardedTensor._marked(t, mesh, partition_spec)


# PyTorch/XLA's op for a mark inside a traced graph (torch.compile, aot_function): the graph
# keeps it as an op with a side effect, and running the graph on xla tensors marks its input.
_OPS = torch.library.Library("xla", "FRAGMENT")
_OPS.define(
    "dynamo_mark_sharding(Tensor input, int[] device_ids, int[] mesh_shape, str axis_names, "
    "str partition_spec) -> ()"
)
torch.library.register_fake("xla::dynamo_mark_sharding", lambda *args: None, lib=_OPS)
torch.fx.node._side_effectful_functions.add(torch.ops.xla.dynamo_mark_sharding.default)


def _dynamo_mark_sharding(func, args: tuple, kwargs: dict) -> None:
    tensor, ids, shape, names, spec = args
    mesh = Mesh(ids, shape, ast.literal_eval(names))
    lay_out(tensor, mesh, ast.literal_eval(spec), "dynamo_mark_sharding")


dispatch.SPECIALS[torch.ops.xla.dynamo_mark_sharding.default] = _dynamo_mark_sharding


def annotate_custom_sharding(
    t: torch.Tensor | XLAShardedTensor, mesh: Mesh, partition_spec: PartitionSpecLike
) -> XLAShardedTensor:
    """Give an already sharded tensor another sharding from here on (a resharding hint).

    PyTorch/XLA needs this because its ``mark_sharding`` refuses to change an existing
    annotation; here any tensor may be re-marked, so this is :func:`mark_sharding`: a pending
    value gets an in-graph sharding constraint, and data already on the devices is laid out anew
    at once (PyTorch/XLA moves it inside the next program instead). Values never change.

    Args:
        t: A tensor on the xla device (or an XLAShardedTensor wrapping one).
        mesh: The device mesh.
        partition_spec: One entry per dimension of ``t`` (see :func:`mark_sharding`).

    Example:
        >>> xs.mark_sharding(w, mesh, ('fsdp', 'tp'))
        >>> xs.annotate_custom_sharding(w, mesh, (None, 'tp'))  # gathered over fsdp from here on
    """
    return mark_sharding(t, mesh, partition_spec)


def mark_sharding_with_gradients(
    t: torch.Tensor | XLAShardedTensor, mesh: Mesh, partition_spec: PartitionSpecLike
) -> torch.Tensor:
    """A sharded copy of ``t`` whose gradient is sharded the same way in the backward pass.

    Unlike :func:`mark_sharding` it leaves ``t`` as it is and returns a new tensor (an in-graph
    sharding constraint on a copy), so it suits intermediate values inside a differentiated
    function: the gradient flowing back through it is constrained to the same layout, which
    keeps the partitioner from choosing another one (and extra collectives) in the backward.

    Args:
        t: A tensor on the xla device (or an XLAShardedTensor wrapping one).
        mesh: The device mesh.
        partition_spec: One entry per dimension of ``t`` (see :func:`mark_sharding`).

    Returns:
        The sharded copy, a plain tensor on the xla device.

    Example:
        >>> h = xs.mark_sharding_with_gradients(x @ w, mesh, ('data', None))
        >>> h.sum().backward()  # the gradient reaching x @ w is sharded ('data', None) too
    """
    tensor = unwrap_sharded_tensor(t)
    on_xla(tensor, "mark_sharding_with_gradients")
    check_mesh(mesh)
    validate._check_spec_container(partition_spec)
    validate._check_spec_rank(tuple(tensor.shape), tuple(partition_spec))
    return MarkShardingFunction.apply(tensor, mesh, partition_spec)


def apply_backward_optimization_barrier(module: torch.nn.Module) -> None:
    """Keep XLA from fusing ``module``'s backward pass with the rest of the backward.

    A full backward hook puts the gradients of the module's parameters and of its inputs through
    one optimization barrier, so the compiler cannot interleave this block's backward with its
    neighbours' (which can otherwise hold very large buffers alive to synchronise gradients).
    Values are unchanged.

    Example:
        >>> for block in model.blocks:
        ...     xs.apply_backward_optimization_barrier(block)
    """

    def barrier(module: torch.nn.Module, grad_input: tuple, grad_output: tuple) -> None:
        grads = [p.grad for p in module.parameters() if p.grad is not None]
        optimization_barrier_(grads + [g for g in grad_input if isinstance(g, torch.Tensor)])

    module.register_full_backward_hook(barrier)


class MarkShardingFunction(torch.autograd.Function):
    """``mark_sharding`` on a copy of an intermediate tensor and on its gradient (autograd).

    The function behind :func:`mark_sharding_with_gradients`; ``apply(t, mesh, spec)`` returns
    the sharded copy, and the backward pass shards the incoming gradient the same way.

    Example:
        >>> h = xs.MarkShardingFunction.apply(x @ w, mesh, ('data', None))
    """

    @staticmethod
    def forward(ctx, torch_tensor: torch.Tensor, mesh: Mesh, partition_spec: tuple) -> torch.Tensor:
        ctx.mesh, ctx.partition_spec = mesh, partition_spec
        return _sharded_copy(torch_tensor, mesh, partition_spec)

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor) -> tuple:
        return _sharded_copy(grad_output, ctx.mesh, ctx.partition_spec), None, None


def _sharded_copy(t: torch.Tensor, mesh: Mesh, partition_spec: tuple) -> torch.Tensor:
    return unwrap_sharded_tensor(mark_sharding(t.clone(), mesh, partition_spec))


def shard_as(a: Any, b: Any) -> tuple[Any, Any]:
    """Copies of ``a`` and ``b`` (matching pytrees of tensors) sharded alike, leaf by leaf.

    Each pair of leaves takes the sharding one of them already has (``a``'s first); neither
    input changes. PyTorch/XLA (``jax.experimental.shard_alike``) also lets the partitioner pick
    a sharding when neither leaf has one; here one of them must have been sharded (marked,
    distributed, or laid out by a previous program), else NotImplementedError says so.

    Args:
        a: A tensor, or a pytree of tensors (and Nones).
        b: The same structure as ``a``; leaves of the same shapes, None where ``a`` has None.

    Returns:
        ``(a', b')``, the same structures, each pair of leaves with one sharding.

    Example:
        >>> xs.mark_sharding(x, mesh, ('data', None))
        >>> x2, y2 = xs.shard_as(x, y)  # y2 is sharded ('data', None) like x
    """
    a_leaves, a_tree = pytree.tree_flatten(a)
    b_leaves, b_tree = pytree.tree_flatten(b)
    if a_tree != b_tree:
        raise ValueError(
            f"shard_as: a and b must have the same structure, got {a_tree} and {b_tree}"
        )
    pairs = [_shard_pair(x, y) for x, y in zip(a_leaves, b_leaves)]
    return (
        pytree.tree_unflatten([x for x, _ in pairs], a_tree),
        pytree.tree_unflatten([y for _, y in pairs], b_tree),
    )


def _shard_pair(x: Any, y: Any) -> tuple[Any, Any]:
    if x is None or y is None:
        if x is not None or y is not None:
            raise ValueError("shard_as: a leaf is None in one tree but not in the other")
        return x, y
    x, y = unwrap_sharded_tensor(x), unwrap_sharded_tensor(y)
    on_xla(x, "shard_as")
    on_xla(y, "shard_as")
    if x.shape != y.shape:
        raise ValueError(f"shard_as: leaves of shapes {tuple(x.shape)} and {tuple(y.shape)} differ")
    sharding = own_sharding(x) or own_sharding(y)
    if sharding is None:
        raise NotImplementedError(
            f"shard_as: neither tensor of shape {tuple(x.shape)} has a sharding yet; shard one "
            "of them first (xs.mark_sharding)"
        )
    x, y = x.clone(), y.clone()
    placement.mark(x, sharding)
    placement.mark(y, sharding)
    return x, y


def own_sharding(tensor: torch.Tensor) -> NamedSharding | None:
    """The tensor's mesh sharding, or None when it has none of its own."""
    sharding = placement.sharding_of(tensor)
    if not isinstance(sharding, NamedSharding) or sharding == transfer.landing():
        return None
    return sharding


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
    return wrap_as_sharded_tensor(ToShards.apply(tensor, named_sharding(mesh, partition_spec)))


def _mark_manual_sharding(t: torch.Tensor | XLAShardedTensor) -> XLAShardedTensor:
    """``t`` wrapped, once checked to be a per-device shard (computed from
    ``_XLAC._spmd_full_to_shard_shape`` or :func:`enable_manual_sharding`). PyTorch/XLA marks a
    value manual here; in this runtime a value is a shard by how it was computed, so this only
    checks (RuntimeError otherwise).

    Example:
        >>> local = xs._mark_manual_sharding(xlac._spmd_full_to_shard_shape(x) + 1).global_tensor
    """
    tensor = unwrap_sharded_tensor(t)
    on_xla(tensor, "_mark_manual_sharding")
    if not manual.is_shard(tensor):
        raise RuntimeError(
            f"_mark_manual_sharding: the tensor of shape {tuple(tensor.shape)} is not a "
            "per-device shard; make one with xs.enable_manual_sharding"
        )
    return wrap_as_sharded_tensor(tensor)


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
    on_xla(tensor, "disable_manual_sharding")
    validate._check_spec_container(partition_spec)
    validate._check_spec_rank(tuple(full_shape), tuple(partition_spec))
    sharding = named_sharding(mesh, partition_spec)
    return wrap_as_sharded_tensor(FromShards.apply(tensor, sharding, tuple(full_shape)))


class ToShards(torch.autograd.Function):
    """Entering a manual region; gradients leave it the opposite way."""

    @staticmethod
    def forward(ctx, t: torch.Tensor, sharding: NamedSharding) -> torch.Tensor:
        ctx.sharding, ctx.full_shape = sharding, tuple(t.shape)
        return manual.enter(t, sharding)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple:
        return manual.leave(grad, ctx.sharding, ctx.full_shape), None


class FromShards(torch.autograd.Function):
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
    on_xla(tensor, "clear_sharding")
    placement.clear(tensor)
    return tensor


def get_xla_sharding_spec(t: torch.Tensor | XLAShardedTensor) -> str:
    """The tensor's sharding as XLA prints it (``torch_xla._XLAC._get_xla_sharding_spec``).

    ``'{devices=[8,1]0,1,2,3,4,5,6,7}'`` for a tiled sharding (tiles per dimension, then the
    device ids in tile order), ``'{devices=[4,1,2]... last_tile_dim_replicate}'`` when each tile
    is replicated over a group of devices, ``'{replicated}'`` (a program's replicated output), or
    ``''`` for a tensor without sharding (pending, or uploaded and not written by a program since).
    The device list is always written out in full (never XLA's ``<=[8]``).

    Args:
        t: A tensor on the xla device, or an XLAShardedTensor.

    Example:
        >>> xs.mark_sharding(x, xs.get_1d_mesh(), (0, None))
        >>> xs.get_xla_sharding_spec(x)
        '{devices=[8,1]0,1,2,3,4,5,6,7}'
    """
    tiling = annotated_tiling(unwrap_sharded_tensor(t), "get_xla_sharding_spec")
    return "" if tiling is None else tiling.text()


def wrap_as_sharded_tensor(
    t: torch.Tensor | XLAShardedTensor,
    mesh_shape: tuple[int, ...] | None = None,
    partition_spec: PartitionSpecLike | None = None,
) -> XLAShardedTensor:
    """``t`` as an XLAShardedTensor (itself when it already is one), laid out over a mesh of
    ``mesh_shape`` as ``partition_spec`` says when they are given.

    PyTorch/XLA records the two on the wrapper; here the sharding lives on the tensor, so the
    tensor is laid out so (nothing moves when it already is): the tensor's own mesh, else the
    global mesh, if of that shape, else the devices in order. Either one alone keeps the other
    from the current layout.

    Args:
        t: A tensor on the xla device, or an XLAShardedTensor.
        mesh_shape: The shape of the mesh to lay the tensor out over.
        partition_spec: One entry per dimension of ``t`` (see :func:`mark_sharding`).

    Example:
        >>> xs.wrap_as_sharded_tensor(x).global_tensor is x
        True
        >>> xs.wrap_as_sharded_tensor(x, (2, 4), (0, 1)).sharding_spec
        '{devices=[2,4]0,1,2,3,4,5,6,7}'
    """
    wrapped = t if isinstance(t, XLAShardedTensor) else XLAShardedTensor(t)
    if mesh_shape is not None or partition_spec is not None:
        wrapped._lay_out(mesh_shape, partition_spec, "wrap_as_sharded_tensor")
        wrapped.invalidate_spec_cache()
    return wrapped


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
        and annotated_tiling(x, "wrap_if_sharded") is not None
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
            first dimension (PyTorch/XLA's data loader flag): each batch dimension must divide
            by the host's device count (:meth:`check_minibatch`). On one process the local
            batch is the global batch.

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
        check_mesh(self.mesh)
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

    def check_minibatch(self, t: torch.Tensor) -> None:
        """With ``minibatch``, refuse a per-host batch that the host's devices cannot split
        evenly (its first dimension), as PyTorch/XLA does, before anything is uploaded.

        Args:
            t: A CPU tensor about to be uploaded with this spec.
        """
        local = runtime.addressable_runtime_device_count()
        if self.minibatch and t.dim() > 0 and t.shape[0] % local:
            raise RuntimeError(
                "When minibatch is configured, the per-host batch size must be divisible by "
                f"local runtime device count. Per host input data shape = {tuple(t.shape)}, "
                f"local_runtime_device_count = {local}"
            )

    def xla_spec(self, t: torch.Tensor) -> NamedSharding | None:
        """The sharding to give ``t``, or None if the spec does not fit it.

        PyTorch/XLA returns its C++ ``XlaShardingSpec`` here; the equivalent is the jax
        sharding that the engine and data loaders place data with.

        Args:
            t: Any tensor.
        """
        return self.sharding if self.can_apply(t) else None


class XLAPatchedLinear(torch.autograd.Function):
    """``torch.nn.functional.linear`` written with ``einsum``, forward and backward.

    PyTorch/XLA uses it so that matmuls keep the sharded batch dimensions instead of flattening
    them away: each ``einsum`` here lowers to one dot_general over the tensors as they are, with
    no reshape, in the forward and the backward alike. Inputs are cast as autocast('xla') says.

    Example:
        >>> y = xs.XLAPatchedLinear.apply(x, layer.weight, layer.bias)
    """

    @staticmethod
    @torch.amp.custom_fwd(device_type="xla", cast_inputs=torch.get_autocast_dtype("xla"))
    def forward(ctx, input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None):
        ctx.save_for_backward(input, weight, bias)
        product = torch.einsum("...n,mn->...m", input, weight)
        return product if bias is None else product + bias

    @staticmethod
    @torch.amp.custom_bwd(device_type="xla")
    def backward(ctx, grad_output: torch.Tensor) -> tuple:
        input, weight, bias = ctx.saved_tensors
        needs_input, needs_weight, *needs_bias = ctx.needs_input_grad  # bias may be left out
        grad_input = torch.einsum("...m,mn->...n", grad_output, weight) if needs_input else None
        grad_weight = torch.einsum("...m,...n->mn", grad_output, input) if needs_weight else None
        if not needs_bias:
            return grad_input, grad_weight
        grad_bias = torch.einsum("...m->m", grad_output) if needs_bias[0] else None
        return grad_input, grad_weight, grad_bias


def xla_patched_nn_linear_forward(m: torch.nn.Linear, input: torch.Tensor) -> torch.Tensor:
    """``m(input)`` for an ``nn.Linear`` ``m``, through :class:`XLAPatchedLinear`.

    Args:
        m: A linear layer (its ``weight`` and ``bias`` are used).
        input: The layer's input.

    Example:
        >>> y = xs.xla_patched_nn_linear_forward(layer, x)
    """
    return XLAPatchedLinear.apply(input, m.weight, m.bias)


class EinsumLinear(torch.nn.Linear):
    """An ``nn.Linear`` whose forward is :class:`XLAPatchedLinear` (same parameters, same values).

    Example:
        >>> layer = xs.EinsumLinear(32, 16).to(spmd_torch.device())
    """

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return xla_patched_nn_linear_forward(self, input)


def apply_xla_patch_to_nn_linear(module: torch.nn.Module) -> torch.nn.Module:
    """Replace every ``nn.Linear`` inside ``module`` by an :class:`EinsumLinear` over the same
    parameter data (shardings stay), as PyTorch/XLA's patch does.

    The parameters become new ``Parameter`` objects: patch before building the optimizer.

    Args:
        module: Any module; its children are replaced in place at any depth.

    Returns:
        ``module`` itself (the root is never swapped, as in PyTorch/XLA).

    Example:
        >>> model = xs.apply_xla_patch_to_nn_linear(model)
    """
    for name, child in module.named_children():
        if isinstance(child, torch.nn.Linear) and not isinstance(child, EinsumLinear):
            with torch.device("meta"):
                patched = EinsumLinear(
                    child.in_features, child.out_features, bias=child.bias is not None
                )
            patched.load_state_dict(child.state_dict(), strict=True, assign=True)
            setattr(module, name, patched)
        else:
            apply_xla_patch_to_nn_linear(child)
    return module
