"""torch_xla.distributed.spmd.api: PyTorch's DTensor API on XLA SPMD sharding.

For a ``DeviceMesh('xla', ...)``, ``torch.distributed.tensor.distribute_tensor`` and
``distribute_module`` hand over to :func:`xla_distribute_tensor` and :func:`xla_distribute_module`,
which they import from ``torch_xla.distributed.spmd``. :func:`register_dtensor_route` makes that
import find this package when the real PyTorch/XLA is not installed. A DeviceMesh becomes an
``xs.Mesh`` with the same device ids, shape and dimension names, and placements become the
partition spec that ``mark_sharding`` takes.
"""

from __future__ import annotations

import inspect
import sys
import warnings
from collections.abc import Callable, Sequence

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor.placement_types import Placement, Replicate

from spmd_torch import runtime
from spmd_torch._lazy import modes
from spmd_torch.distributed import _dtensor_route

from . import _dtensor
from ._tiling import ShardingType
from .mesh import Mesh
from .xla_sharded_tensor import XLAShardedTensor
from .xla_sharding import mark_sharding

__all__ = [
    "auto_policy",
    "convert_to_xla_mesh",
    "convert_to_xla_partition_spec",
    "register_dtensor_route",
    "xla_distribute_module",
    "xla_distribute_tensor",
]


def register_dtensor_route() -> bool:
    """Let PyTorch's DTensor API reach this package for ``xla`` meshes, without a torch_xla.

    ``distribute_tensor``/``distribute_module`` run ``from torch_xla.distributed.spmd import
    ...`` for a ``DeviceMesh('xla', ...)``. This enters this package in ``sys.modules`` under
    that name, which such an import finds without importing its parents, so ``import torch_xla``
    and ``importlib.util.find_spec('torch_xla')`` still fail (libraries use them to detect a real
    PyTorch/XLA). Nothing is registered when a real torch_xla is installed; without one, any
    earlier entry under that name (a lazy stand-in) gives way to this package.

    Returns:
        Whether the route leads here (False: a real torch_xla is installed).

    Example:
        >>> register_dtensor_route()
        True
        >>> from torch.distributed.tensor import distribute_tensor, Shard
        >>> xt = distribute_tensor(torch.randn(8, 4), DeviceMesh('xla', list(range(8))), [Shard(0)])
    """
    return _dtensor_route.enter(sys.modules[__name__.rpartition(".")[0]])


def auto_policy(mod_name: str, mod: nn.Module, mesh: DeviceMesh) -> None:
    """The ``partition_fn`` asking :func:`xla_distribute_module` for automatic sharding.

    PyTorch/XLA's auto-sharding pass has no counterpart here: passing it raises
    NotImplementedError (``xr.use_spmd(auto=True)``).

    Example:
        >>> xla_distribute_module(model, mesh, auto_policy)  # NotImplementedError
    """


def convert_to_xla_mesh(dt_mesh: DeviceMesh) -> Mesh:
    """The ``xs.Mesh`` of a ``DeviceMesh('xla', ...)``: same device ids, shape and dim names.

    Turns SPMD on, as PyTorch/XLA does. The mesh must span every device.

    Args:
        dt_mesh: A DeviceMesh of device type ``'xla'``.

    Example:
        >>> convert_to_xla_mesh(DeviceMesh('xla', [[0, 1, 2, 3], [4, 5, 6, 7]])).mesh_shape
        (2, 4)
    """
    modes.ensure_spmd()
    return _dtensor.to_xla_mesh(dt_mesh, "convert_to_xla_mesh")


def convert_to_xla_partition_spec(tensor: torch.Tensor, placements: Sequence[Placement]) -> tuple:
    """The partition spec (mesh axis indices per tensor dimension) of DTensor ``placements``.

    ``placements[i]`` describes mesh dimension ``i``: ``Shard(d)`` splits tensor dimension
    ``d`` over it, ``Replicate()`` copies along it. Tensor dimensions split by several mesh
    dimensions get a tuple of them, in mesh order (PyTorch/XLA keeps only the last one).

    Args:
        tensor: The tensor (only its rank is used).
        placements: One ``Shard`` or ``Replicate`` per mesh dimension.

    Example:
        >>> convert_to_xla_partition_spec(torch.randn(4, 8, 8), [Replicate(), Shard(0)])
        (1, None, None)
    """
    modes.ensure_spmd()
    return _dtensor.to_partition_spec(tensor.dim(), placements, "convert_to_xla_partition_spec")


def xla_distribute_tensor(
    tensor: torch.Tensor,
    device_mesh: DeviceMesh,
    placements: Sequence[Placement] | None = None,
) -> XLAShardedTensor:
    """Shard ``tensor`` over an ``xla`` DeviceMesh as DTensor ``placements`` say.

    What ``torch.distributed.tensor.distribute_tensor`` calls for an ``xla`` mesh: the tensor
    (moved to the xla device first if it is not there) is marked with the equivalent partition
    spec (:func:`convert_to_xla_partition_spec`) and returned as an XLAShardedTensor, a global
    view; programs on it are partitioned by the compiler, no collectives are written by hand.

    Args:
        tensor: The global tensor, on the CPU or the xla device.
        device_mesh: A ``DeviceMesh('xla', ...)`` spanning every device.
        placements: One ``Shard(dim)`` or ``Replicate()`` per mesh dimension; all Replicate
            when omitted.

    Example:
        >>> mesh = DeviceMesh('xla', np.arange(8).reshape(4, 2))
        >>> xt = xla_distribute_tensor(torch.randn(8, 4), mesh, [Shard(0), Replicate()])
        >>> xt.sharding_spec
        '{devices=[4,1,2]0,1,2,3,4,5,6,7 last_tile_dim_replicate}'
    """
    modes.ensure_spmd()
    if type(tensor).__name__ == "DTensor":
        raise ValueError(
            "Cannot distribute a DTensor with local tensor on xla devices: "
            "the input tensor must be global"
        )
    mesh = _dtensor.to_xla_mesh(device_mesh, "xla_distribute_tensor")
    if isinstance(tensor, XLAShardedTensor):
        if tensor.sharding_type not in (None, ShardingType.REPLICATED):
            raise _dtensor.DTensorLayoutError(
                f"xla_distribute_tensor: the XLAShardedTensor is already sharded "
                f"({tensor.sharding_spec}); clear it first with xs.clear_sharding"
            )
        tensor = tensor.global_tensor
    if not tensor.is_meta:
        tensor = tensor.to(device_mesh.device_type)
    if placements is None:
        placements = [Replicate()] * len(mesh.mesh_shape)
    _dtensor.check_placement_count(placements, mesh, "xla_distribute_tensor")
    spec = _dtensor.to_partition_spec(tensor.dim(), placements, "xla_distribute_tensor")
    return mark_sharding(tensor, mesh, spec)


def xla_distribute_module(
    module: nn.Module,
    device_mesh: DeviceMesh | None = None,
    partition_fn: Callable[[str, nn.Module, DeviceMesh], None] | None = None,
    input_fn: Callable | None = None,
    output_fn: Callable | None = None,
) -> nn.Module:
    """Shard a module's parameters as ``partition_fn`` says; what ``distribute_module`` calls.

    ``partition_fn(name, submodule, device_mesh)`` runs on every submodule (the module itself
    first) and typically calls ``distribute_tensor`` on parameters, which marks them in place;
    parameters it leaves alone stay replicated. ``input_fn(module, inputs, device_mesh)`` and
    ``output_fn(module, outputs, device_mesh)`` are installed as forward pre- and post-hooks
    (the older two-argument forms are accepted with a deprecation warning).

    Args:
        module: The module, its parameters on the xla device.
        device_mesh: The ``xla`` DeviceMesh handed to the three functions.
        partition_fn: Shards the parameters of each submodule; ``auto_policy`` is refused.
        input_fn: Lays out the inputs of ``module``.
        output_fn: Lays out (or converts) the outputs of ``module``.

    Returns:
        ``module`` itself.

    Example:
        >>> def shard_linears(name, mod, mesh):
        ...     if isinstance(mod, nn.Linear):
        ...         distribute_tensor(mod.weight, mesh, [Shard(0)])
        >>> model = distribute_module(model.to('xla'), DeviceMesh('xla', range(8)), shard_linears)
    """
    modes.ensure_spmd()
    if partition_fn is auto_policy:
        runtime.use_spmd(auto=True)
    if partition_fn is not None:
        for name, submodule in module.named_modules():
            partition_fn(name, submodule, device_mesh)
    if input_fn is not None:
        module.register_forward_pre_hook(_hook(input_fn, device_mesh, "input_fn", pre=True))
    if output_fn is not None:
        module.register_forward_hook(_hook(output_fn, device_mesh, "output_fn", pre=False))
    return module


def _hook(fn: Callable, device_mesh: DeviceMesh | None, name: str, pre: bool) -> Callable:
    """``fn`` as a forward (pre-)hook, in its three-argument or deprecated two-argument form."""
    arity = len(inspect.signature(fn).parameters)
    if arity == 2:
        warnings.warn(
            f"Deprecating {name} that takes two arguments (values, device_mesh), please use "
            f"{name} that takes in (module, values, device_mesh) instead!",
            stacklevel=3,
        )
        if pre:
            return lambda module, inputs: fn(inputs, device_mesh)
        return lambda module, inputs, outputs: fn(outputs, device_mesh)
    if arity != 3:
        raise ValueError(f"{name} should take in 3 arguments, but got {arity} arguments!")
    if pre:
        return lambda module, inputs: fn(module, inputs, device_mesh)
    return lambda module, inputs, outputs: fn(module, outputs, device_mesh)
